"""standard_train_step: VISSL's sample format through forward, loss, meters, backward, update.

Hook events inside a step: on_forward, on_loss_and_meter, on_backward, on_update. Supports
AMP (torch.autocast, GradScaler for float16 on CUDA), gradient accumulation over
TRAINER.GRAD_ACCUMULATION_STEPS batches (the last batch of a train phase steps too), gradient clipping, and a non-finite loss check.
"""

import math
import time
from typing import Any, NamedTuple, Optional, Tuple

import torch

from ssl_engine.errors import NonFiniteLossError, UserError
from ssl_engine.models.label_range import explain_label_error
from ssl_engine.registry import TRAIN_STEPS, part_origin


def to_device(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    """Move tensors in a (nested) batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    return batch


def _single(x: Any) -> Any:
    return x[0] if isinstance(x, (list, tuple)) and len(x) == 1 else x


def real_rows(batch: Any) -> Tuple[Optional[int], Optional[torch.Tensor]]:
    """(number of real samples, boolean mask of the real rows or None when every row is real).

    Rows with ``data_valid <= 0`` are repeats: padding the sampler added to even out the
    ranks' shares (0) or replacements of unreadable images (-1). Meters and the logged loss
    leave them out so that a phase's values do not depend on the number of ranks. Computed on
    the host batch, before it moves to the device: no device sync. ``(None, None)`` when the
    batch does not say.
    """
    flags = batch.get("data_valid") if isinstance(batch, dict) else None
    if isinstance(flags, (list, tuple)):  # one entry per data source or view; all mark the same rows
        flags = flags[0] if flags else None
    if not isinstance(flags, torch.Tensor) or flags.ndim != 1:
        return None, None
    if flags.is_cpu and not flags.is_floating_point():
        # the usual host batch (integer flags): read as a list, cheaper per step than numpy or
        # torch ops; float flags take the torch path below (min() of a list skips a NaN)
        rows = flags.tolist()
        if not rows or min(rows) > 0:  # every row real: no mask
            return len(rows), None
        real = [v > 0 for v in rows]
        n = sum(real)
        return n, torch.tensor(real)
    mask = flags > 0
    n = int(torch.count_nonzero(mask))
    return n, (None if n == flags.numel() else mask)


def _rows(x: Any, mask: torch.Tensor) -> Any:
    """``x`` (a tensor or list of tensors with one row per sample) restricted to ``mask``."""
    if isinstance(x, torch.Tensor):
        return x[mask.to(x.device)]
    return type(x)(t[mask.to(t.device)] for t in x)


def _rows_match(x: Any, n: int) -> bool:
    items = [x] if isinstance(x, torch.Tensor) else list(x) if isinstance(x, (list, tuple)) else []
    return bool(items) and all(isinstance(t, torch.Tensor) and t.ndim >= 1 and t.shape[0] == n for t in items)


def check_finite_loss(task: Any, loss: torch.Tensor) -> None:
    """Stop the run on a NaN/inf loss, naming iteration and phase (HOOKS.CHECK_NAN).

    On the CPU the loss is read at once (``.item()`` costs no sync there). On an accelerator
    reading it would stall the host on every step, so the flag is computed on the device and
    read one step later (:func:`confirm_finite_loss`, at the next step, at the end of the
    phase's data and before a checkpoint is written): the host runs at most one step ahead of
    the check and a bad step's state is never checkpointed. On CUDA the flag is copied to
    pinned host memory behind an event, so the later read waits for this step's loss only,
    not for the kernels queued after it.
    """
    if loss.device.type == "cpu" and not getattr(task, "defer_loss_check", False):
        if not math.isfinite(loss.float().sum().item() if loss.ndim else loss.item()):
            _raise_non_finite(loss, _where(task), task.last_model_output, task.last_batch)
        return
    confirm_finite_loss(task)
    ok = torch.isfinite(loss).all()
    ready = None
    if ok.is_cuda:
        host = getattr(task, "_finite_flag_host", None)
        if host is None:  # one pinned flag: the previous step's was read just above
            host = task._finite_flag_host = torch.ones((), dtype=torch.bool, pin_memory=True)
        host.copy_(ok, non_blocking=True)  # queued on the current stream of the loss's device
        ok, ready = host, torch.cuda.Event()
        ready.record(torch.cuda.current_stream(loss.device))
    task.pending_loss_check = (ok, ready, loss, _where(task), task.last_model_output, task.last_batch)


def _where(task: Any) -> Tuple[int, int, str, int]:
    return (task.iteration, task.phase_idx, task.phase_type, task.local_iteration_num)


def confirm_finite_loss(task: Any) -> None:
    """Read the flag :func:`check_finite_loss` left on the device, if any; raise when it is bad."""
    pending = getattr(task, "pending_loss_check", None)
    if pending is None:
        return
    task.pending_loss_check = None
    ok, ready, loss, where, output, batch = pending
    if ready is not None:
        ready.synchronize()  # the flag's copy is done (the kernels queued after it may still run)
    if not bool(ok):
        _raise_non_finite(loss, where, output, batch)


def _raise_non_finite(loss: torch.Tensor, where: Tuple[int, int, str, int], output: Any, batch: Any) -> None:
    from ssl_engine.hooks.nan_check import diagnose

    iteration, phase_idx, phase_type, local_iter = where
    value = loss.float().cpu().flatten()[:4].tolist()
    raise NonFiniteLossError(
        f"the loss is {value[0] if len(value) == 1 else value} at iteration {iteration} "
        f"(phase {phase_idx}, {phase_type}, local iteration {local_iter}); {diagnose(output, batch)}; "
        f"stopping without writing a checkpoint of this state"
    )


class StepSettings(NamedTuple):
    """The config values a step reads, looked up once per run instead of on every step."""

    move_to_device: bool
    non_blocking: bool
    accum: int
    check_nan: bool
    training_meters: bool
    grad_clip: bool
    amp: bool  # forward and loss run under autocast


def step_settings(task: Any) -> StepSettings:
    """``task``'s StepSettings, built from its config on first use (the config is fixed during a run)."""
    cached = getattr(task, "_step_settings", None)
    if cached is not None and cached[0] is task.config:
        return cached[1]
    cfg = task.config
    settings = StepSettings(
        move_to_device=task.device.type != "cpu",
        non_blocking=task.device.type == "cuda" and bool(cfg.DATA.ENABLE_ASYNC_GPU_COPY),
        accum=int(cfg.TRAINER.GRAD_ACCUMULATION_STEPS),
        check_nan=bool(cfg.HOOKS.CHECK_NAN),
        training_meters=bool(cfg.METERS.enable_training_meter),
        grad_clip=bool(cfg.MODEL.GRAD_CLIP.USE_GRAD_CLIP),
        amp=task.amp_dtype is not None,
    )
    task._step_settings = (task.config, settings)
    return settings


@TRAIN_STEPS.register("standard_train_step")
def standard_train_step(task: Any) -> None:
    """One iteration of the current phase; raises StopIteration at the end of the data."""
    t0 = time.perf_counter()
    try:
        batch = next(task.data_iterator)
    except StopIteration:
        confirm_finite_loss(task)  # the phase's last step, before the phase-end hooks checkpoint
        raise
    task.last_data_time = time.perf_counter() - t0
    settings = step_settings(task)
    train = task.train
    task.last_num_samples, valid = real_rows(batch)  # on the host batch: no device sync
    if settings.move_to_device:
        batch = to_device(batch, task.device, settings.non_blocking)
    task.last_batch = batch
    inputs, target = _single(batch["data"]), _single(batch["label"])

    accum = settings.accum if train else 1
    is_update_step = accum == 1 or _accumulation_done(task, accum, task.local_iteration_num + 1)
    if train and not is_update_step and hasattr(task.model, "no_sync"):
        with task.model.no_sync():  # gradients are all-reduced at the update step only
            output = _forward_backward(task, settings, inputs, target, valid, accum)
    else:
        output = _forward_backward(task, settings, inputs, target, valid, accum)
    if train and is_update_step:
        _update(task, settings)
        task.run_hooks("on_update")
    if train:
        task.iteration += 1
    task.local_iteration_num += 1


def ends_an_update(task: Any) -> bool:
    """Whether the train step that just ran ended in an optimizer update: always without gradient
    accumulation and in test phases. A checkpoint or preemption save taken between updates would
    lose the gradients accumulated so far (they are not part of a checkpoint), so the
    CheckpointHook waits for the step that ends the accumulation."""
    accum = step_settings(task).accum
    return accum <= 1 or not task.train or _accumulation_done(task, accum, task.local_iteration_num)


def _accumulation_done(task: Any, accum: int, done: int) -> bool:
    """Whether the ``done``-th batch of the phase ends an accumulation of ``accum`` batches, or
    is the last batch of the train phase: that one always steps (as Lightning does), since with
    more steps than the phase has batches the run never updated the weights, and a phase's tail
    leaked its gradients into the next epoch's first update (and was lost by a resume from the
    phase end)."""
    phase_end = int(getattr(task, "phase_iterations", 0) or 0)  # 0: a task of your own that does not say
    return done % accum == 0 or (phase_end > 0 and done >= phase_end)


def _forward_backward(
    task: Any, settings: StepSettings, inputs: Any, target: Any, valid: Optional[torch.Tensor], accum: int
) -> Any:
    """Forward, loss, meters and (in a train phase) backward of one batch; returns the model output.

    A train phase without AMP needs no context around the forward (gradients are on); a test
    phase runs it under no_grad, an AMP run under autocast.
    """
    train = task.train
    if train and not settings.amp and torch.is_grad_enabled():
        output, loss, per_row, logged = _forward_loss(task, inputs, target, valid)
    else:
        with torch.set_grad_enabled(train), task.autocast():
            output, loss, per_row, logged = _forward_loss(task, inputs, target, valid)
    task.last_loss = loss.detach()
    if settings.check_nan:
        check_finite_loss(task, task.last_loss)  # the loss the step trains on
    if logged is not None:
        task.last_loss = logged
    if task.meters and (not train or settings.training_meters):
        detached = [o.detach() for o in output] if isinstance(output, (list, tuple)) else output.detach()
        tgt = target
        if per_row:
            detached, tgt = _rows(detached, valid), _rows(tgt, valid)
        if not per_row or bool(valid.any()):
            try:
                for meter in task.meters:
                    meter.update(detached, tgt)
            except (IndexError, RuntimeError, AssertionError):  # no cost until raised (python >= 3.11)
                explain_label_error(task, detached, tgt, meter)  # a label beyond the head's classes
                raise
    task.run_hooks("on_loss_and_meter")
    if train:
        if accum > 1:
            loss = loss / accum
        if task.grad_scaler is not None:
            loss = task.grad_scaler.scale(loss)
        loss.backward()
        task.run_hooks("on_backward")
    return output


def restricts_to_real_rows(loss: Any) -> bool:
    """Whether ``loss`` may be given only the real rows of a batch: true for a loss that sets the
    class attribute ``per_row_loss = True`` (each row's loss depends on that row's output and
    target alone, and the batch's loss is their mean or sum, as cross entropy's).

    Other losses compare the rows of a step with each other, often across ranks (SimCLR's
    negatives, Barlow Twins' and SwAV's batch statistics), or hold state of the batch's rows
    (MoCo's keys): on rows cut out of the batch they would compute something else, and a
    cross-rank gather of batches cut to different sizes fails. They always get the whole batch.
    """
    return bool(getattr(loss, "per_row_loss", False))


def _forward_loss(
    task: Any, inputs: Any, target: Any, valid: Optional[torch.Tensor]
) -> Tuple[Any, torch.Tensor, bool, Optional[torch.Tensor]]:
    """(model output, loss, whether the padded rows are left out per row, the loss to log when it
    is not ``loss``).

    Padded rows (see real_rows) are left out of meters when the outputs and target have one row
    per sample. For a loss that allows it (:func:`restricts_to_real_rows`) they are left out of
    the loss of test phases too, and of the loss logged in train phases, which still train on
    them (every rank's batch keeps its size).
    """
    try:
        output = task.model(inputs)
    except ValueError as e:  # no cost until raised (python >= 3.11)
        explain_one_sample_batch(task, inputs, e)
        raise
    task.last_model_output = output
    task.run_hooks("on_forward")
    per_row = valid is not None and _rows_match(output, valid.numel()) and _rows_match(target, valid.numel())
    logged = None
    try:
        if per_row and bool(valid.any()) and restricts_to_real_rows(task.loss):
            if not task.train:
                loss = task.loss(_rows(output, valid), _rows(target, valid))
            else:  # trains on every row; the logged loss is that of the real rows
                loss = task.loss(output, target)
                with torch.no_grad():
                    detached = [o.detach() for o in output] if isinstance(output, (list, tuple)) else output.detach()
                    logged = task.loss(_rows(detached, valid), _rows(target, valid))
        else:
            loss = task.loss(output, target)
    except (IndexError, RuntimeError, AssertionError):  # no cost until raised (python >= 3.11)
        # a label beyond the head's classes ("Target 7 is out of bounds") becomes a UserError
        # naming the head's key; on CUDA it is a device-side assert that cannot be caught, which
        # only the pre-launch check of the dataset's labels prevents (models/label_range.py)
        explain_label_error(task, output, target, task.loss)
        raise
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise bad_loss_output(task, loss)
    return output, loss, per_row, logged


def bad_loss_output(task: Any, loss: Any) -> UserError:
    """The error for a loss whose forward returned something other than a tensor of one value
    (a python float, which cannot be back-propagated; a per-row vector; None)."""
    got = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
    name = task.config.LOSS.get("name", "") if hasattr(task, "config") else ""
    return UserError(
        f"loss {name!r} (config.LOSS.name) {part_origin(type(task.loss))} returned {got} from forward; a loss "
        f"returns a tensor of one value, the batch's loss (e.g. per_row_losses.mean())"
    )


def explain_one_sample_batch(task: Any, inputs: Any, error: ValueError) -> None:
    """A BatchNorm layer in training cannot normalise one value per channel: a batch of one
    sample whose features reach it as 1x1 (or as a vector) fails. That batch is almost always
    the last, short batch of an epoch, so the message gives the arithmetic and the two fixes."""
    if "more than 1 value per channel" not in str(error):
        return
    split = "TRAIN" if task.train else "TEST"
    first = inputs if isinstance(inputs, torch.Tensor) else inputs[0]
    rows = int(first.shape[0]) if isinstance(first, torch.Tensor) and first.ndim else 1
    sampler = task.dataloaders[split].sampler if split in getattr(task, "dataloaders", {}) else None
    # the rank's whole share (the length of a resumed phase's sampler counts the samples left)
    per_rank = None if sampler is None else getattr(sampler, "num_samples", None) or len(sampler)
    raise one_sample_batch_error(
        task.config, split, per_rank, rows,
        f"a BatchNorm layer of the model cannot train on one value per channel (iteration "
        f"{task.iteration + 1 if task.train else task.iteration}, batch {task.local_iteration_num + 1} of the phase)",
    ) from None


def one_sample_batch_error(cfg: Any, split: str, per_rank: Optional[int], rows: int, bn: str) -> UserError:
    """The one line for a batch of ``rows`` (one) sample that BatchNorm ``bn`` cannot train on:
    the arithmetic of ``per_rank`` samples in batches, and the two fixes. Raised at the step
    that fails, and before launch where the model's BatchNorm1d layers make it certain."""
    data = cfg.DATA[split]
    if int(data.BATCHSIZE_PER_REPLICA) == 1:
        return UserError(f"config.DATA.{split}.BATCHSIZE_PER_REPLICA=1 gives batches of one sample, and {bn}; raise it")
    where = (f"{per_rank} samples per rank in batches of {data.BATCHSIZE_PER_REPLICA} leave a last batch of "
             f"{rows}" if per_rank is not None else f"a batch of {rows} sample(s)")
    return UserError(
        f"config.DATA.{split}: {where}, and {bn}; set config.DATA.{split}.DROP_LAST=true, or change "
        f"BATCHSIZE_PER_REPLICA or the number of samples"
    )


def _update_where(task: Any, accum: int) -> float:
    """The training progress an update reads its scheduled values (lr, ...) at: that of the first
    batch it accumulated, so k accumulated batches of B get the values one batch of k * B gets at
    that update (the first update of training gets the schedule's start)."""
    first = task.progress_iteration - task.local_iteration_num % max(1, accum)
    return min(1.0, first / max(1, task.max_iteration))


def _update(task: Any, settings: StepSettings) -> None:
    """Schedule, clip and optimizer step, then clear the gradients."""
    cfg = task.config
    opt = task.optimizer
    if opt.update_interval == "step":
        opt.set_where(_update_where(task, settings.accum))
    if settings.grad_clip:
        if task.grad_scaler is not None:
            task.grad_scaler.unscale_(opt)
        params = [p for p in task.base_model.parameters() if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, max_norm=cfg.MODEL.GRAD_CLIP.MAX_NORM, norm_type=cfg.MODEL.GRAD_CLIP.NORM_TYPE)
    if task.grad_scaler is not None:
        task.grad_scaler.step(opt)
        task.grad_scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)
