"""standard_train_step: VISSL's sample format through forward, loss, meters, backward, update.

Hook events inside a step: on_forward, on_loss_and_meter, on_backward, on_update. Supports
AMP (torch.autocast, GradScaler for float16 on CUDA), gradient accumulation over
TRAINER.GRAD_ACCUMULATION_STEPS batches, gradient clipping, and a non-finite loss check.
"""

import contextlib
import time
from typing import Any, Optional

import torch

from ssl_engine.errors import NonFiniteLossError
from ssl_engine.registry import TRAIN_STEPS


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


def valid_rows(batch: Any) -> Optional[torch.Tensor]:
    """Boolean mask of the batch rows that are real samples, or None when all are (or unknown).

    Rows with ``data_valid <= 0`` are repeats: padding the sampler added to even out the
    ranks' shares (0) or replacements of unreadable images (-1). Meters and the logged loss
    leave them out so that a phase's values do not depend on the number of ranks.
    """
    flags = batch.get("data_valid") if isinstance(batch, dict) else None
    if isinstance(flags, (list, tuple)):  # one entry per data source or view; all mark the same rows
        flags = flags[0] if flags else None
    if not isinstance(flags, torch.Tensor) or flags.ndim != 1:
        return None
    mask = flags > 0
    return None if bool(mask.all()) else mask


def _rows(x: Any, mask: torch.Tensor) -> Any:
    """``x`` (a tensor or list of tensors with one row per sample) restricted to ``mask``."""
    if isinstance(x, torch.Tensor):
        return x[mask.to(x.device)]
    return type(x)(t[mask.to(t.device)] for t in x)


def _rows_match(x: Any, n: int) -> bool:
    items = [x] if isinstance(x, torch.Tensor) else list(x) if isinstance(x, (list, tuple)) else []
    return bool(items) and all(isinstance(t, torch.Tensor) and t.ndim >= 1 and t.shape[0] == n for t in items)


def check_finite_loss(task: Any, loss: torch.Tensor) -> None:
    """Stop the run on a NaN/inf loss, naming iteration and phase (HOOKS.CHECK_NAN)."""
    if not bool(torch.isfinite(loss).all()):
        raise NonFiniteLossError(
            f"the loss is {loss.detach().float().cpu().item()} at iteration {task.iteration} "
            f"(phase {task.phase_idx}, {task.phase_type}, local iteration {task.local_iteration_num}); "
            f"stopping without writing a checkpoint of this state"
        )


@TRAIN_STEPS.register("standard_train_step")
def standard_train_step(task: Any) -> None:
    """One iteration of the current phase; raises StopIteration at the end of the data."""
    t0 = time.perf_counter()
    batch = next(task.data_iterator)
    task.last_data_time = time.perf_counter() - t0
    cfg = task.config
    non_blocking = task.device.type == "cuda" and cfg.DATA.ENABLE_ASYNC_GPU_COPY
    valid = valid_rows(batch)  # on the host batch: no device sync
    batch = to_device(batch, task.device, non_blocking)
    task.last_batch = batch
    inputs, target = _single(batch["data"]), _single(batch["label"])

    accum = cfg.TRAINER.GRAD_ACCUMULATION_STEPS if task.train else 1
    is_update_step = (task.local_iteration_num + 1) % accum == 0 or accum == 1
    sync_ctx = contextlib.nullcontext()
    if task.train and not is_update_step and hasattr(task.model, "no_sync"):
        sync_ctx = task.model.no_sync()

    # Padded rows (see valid_rows) are left out of meters, and out of the loss of test phases,
    # when the outputs and target have one row per sample; train phases still train on them.
    with sync_ctx:
        with torch.set_grad_enabled(task.train), task.autocast():
            output = task.model(inputs)
            task.last_model_output = output
            task.run_hooks("on_forward")
            per_row = valid is not None and _rows_match(output, valid.numel()) and _rows_match(target, valid.numel())
            if per_row and not task.train and bool(valid.any()):
                loss = task.loss(_rows(output, valid), _rows(target, valid))
            else:
                loss = task.loss(output, target)
        if cfg.HOOKS.CHECK_NAN:
            check_finite_loss(task, loss)
        task.last_loss = loss.detach()
        if task.meters and (not task.train or cfg.METERS.enable_training_meter):
            detached = [o.detach().float() for o in output] if isinstance(output, (list, tuple)) else output.detach().float()
            tgt = target.detach() if isinstance(target, torch.Tensor) else target
            if per_row:
                detached, tgt = _rows(detached, valid), _rows(tgt, valid)
            if not per_row or bool(valid.any()):
                for meter in task.meters:
                    meter.update(detached, tgt)
        task.run_hooks("on_loss_and_meter")

        if task.train:
            scaled = loss / accum if accum > 1 else loss
            if task.grad_scaler is not None:
                scaled = task.grad_scaler.scale(scaled)
            scaled.backward()
            task.run_hooks("on_backward")

    if task.train and is_update_step:
        _update(task)
        task.run_hooks("on_update")
    if task.train:
        task.iteration += 1
    task.local_iteration_num += 1


def _update(task: Any) -> None:
    """Schedule, clip and optimizer step, then clear the gradients."""
    cfg = task.config
    opt = task.optimizer
    if opt.update_interval == "step":
        opt.set_where(task.where)
    if cfg.MODEL.GRAD_CLIP.USE_GRAD_CLIP:
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
