"""Class labels against the heads that score them.

A head with fewer outputs than the data has classes makes cross-entropy fail at the first step
with ``IndexError: Target 7 is out of bounds`` on the CPU. On CUDA the same mistake is a
device-side assert: it cannot be caught, and it leaves the CUDA context unusable. So the labels
are checked before launch, from the label arrays the datasets already hold (class subfolders,
label files, a synthetic source's labels: no image is read), and a step that fails on the CPU
is explained from its batch (the only help on CUDA is the check before launch).

A loss or meter opts in with the class attribute ``class_index_targets = True``: its target is a
class index into the last dim of each head output. ``needs_labels`` alone is not enough: a loss
may use labels in other ways (a supervised contrastive loss picks positives with them).
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ssl_engine.errors import ConfigError, UserError


def scorer_name(cfg: Any, scorer: Any, loss: Any) -> str:
    """The config key a user reads for ``scorer``: ``config.LOSS.name=...`` or ``the meter config.METERS.<name>``."""
    if scorer is loss:
        return f"config.LOSS.name={cfg.LOSS.name}"
    return f"the meter config.METERS.{getattr(scorer, 'name', type(scorer).__name__)}"


def _classes(n: int) -> str:
    return f"{n} class" if n == 1 else f"{n} classes"


def _label_origin(cfg: Any, split: str) -> str:
    """Where ``split``'s labels come from, for the message: a transform that sets them, else LABEL_SOURCES."""
    from ssl_engine.data.transforms import labelling_transform

    transforms = cfg.DATA[split].get("TRANSFORMS", [])
    sources = f"LABEL_SOURCES {list(cfg.DATA[split].get('LABEL_SOURCES', []) or [])}"
    every, some = labelling_transform(transforms, every_entry=True), labelling_transform(transforms)
    if every:
        return f"set by {every} in config.DATA.{split}.TRANSFORMS"
    if some:  # it relabels some data entries only: the label may be the sources'
        return f"{sources}, or set by {some} in config.DATA.{split}.TRANSFORMS"
    return sources


def _message(cfg: Any, split: str, label: int, where: str, size: int, scored_by: str) -> str:
    """The one line for a label outside a head's classes (``label`` the largest, or a negative one)."""
    fix = (
        f"make that head output at least {_classes(label + 1)} (for mlp/eval_mlp the last entry of its dims)"
        if label >= size
        else f"a label must be a class index in 0..{size - 1} (or the loss's ignore_index)"
    )
    return (
        f"{where}, scored by {scored_by}, outputs {_classes(size)} (labels 0..{size - 1}), but "
        f"config.DATA.{split} has label {label} ({_label_origin(cfg, split)}); {fix}"
    )


def max_label(dataset: Any, ignore_index: Optional[int] = None) -> Optional[int]:
    """The largest integer label of ``dataset`` (every label source), leaving out ``ignore_index``;
    None when the dataset does not say (no labels, or not integer class indices). Labels that a
    transform sets (ImgRotatePil's rotation index) count instead of, or besides, the sources'."""
    transforms = getattr(dataset, "transforms", None)
    set_top, all_set = transforms.label_setters() if hasattr(transforms, "label_setters") else (None, False)
    if all_set:
        return set_top  # a transform (ImgRotatePil) gives every entry its label
    top: Optional[int] = None
    for labels in _class_index_labels(dataset):
        if ignore_index is not None:
            labels = labels[labels != ignore_index]
        if labels.size:
            top = int(labels.max()) if top is None else max(top, int(labels.max()))
    return top if set_top is None else max(set_top, top if top is not None else set_top)


def _class_index_labels(dataset: Any) -> List[np.ndarray]:
    """The label array of each of ``dataset``'s label sources that holds class indices (1-D
    integers); empty when the dataset does not say."""
    get = getattr(dataset, "get_labels", None)
    if get is None:
        return []
    n_sources = len(getattr(dataset, "label_arrays", [])) if getattr(dataset, "label_type", "standard") == "standard" else 1
    arrays = [np.asarray(get(j)) for j in range(n_sources)]
    return [a for a in arrays if a.ndim == 1 and a.dtype.kind in "iu"]


def _labels_set_by_transform(dataset: Any) -> bool:
    """Whether a transform of ``dataset`` (ImgRotatePil) sets the labels of some entries."""
    transforms = getattr(dataset, "transforms", None)
    return hasattr(transforms, "label_setters") and transforms.label_setters()[0] is not None


def every_label_ignored(dataset: Any, ignore_index: Optional[int]) -> bool:
    """True when ``dataset`` has integer labels and every one of them (of some label source) is
    ``ignore_index``: a loss that leaves those out averages over no sample and gives NaN (or sums
    over none and gives 0, so that nothing trains)."""
    if ignore_index is None or getattr(dataset, "label_type", "standard") != "standard":
        return False
    if _labels_set_by_transform(dataset):
        return False  # a transform (ImgRotatePil) gives entries their labels
    return any(a.size and bool((a == ignore_index).all()) for a in _class_index_labels(dataset))


def check_ordered_batches_labelled(cfg: Any, split: str, dataset: Any, sampler: Any, loss: Any) -> None:
    """Before launch, for a split read in order (TEST): no batch of any rank may hold only labels
    the loss ignores. Its loss would average over no sample (NaN) and stop the run at that batch,
    after a whole train phase; the order is fixed, so the batch is known now. (A shuffled split
    cannot be judged: there the step's non-finite-loss check says what happened.)"""
    from ssl_engine.data.sampler import StatefulDistributedSampler, is_padded

    ignored = getattr(loss, "ignore_index", None) if getattr(loss, "class_index_targets", False) else None
    if ignored is None or sampler is None or getattr(sampler, "shuffle", True):
        return
    if getattr(loss, "reduction", "mean") != "mean" or not cfg.HOOKS.CHECK_NAN:
        return  # a sum over no sample is 0, and without the check a NaN test loss does not stop the run
    if _labels_set_by_transform(dataset):
        return  # a transform (ImgRotatePil) gives entries their labels
    arrays = _class_index_labels(dataset)
    if not arrays or not any(bool((a == ignored).any()) for a in arrays):
        return
    labels = arrays[0]
    size = sampler.batch_size
    for rank in range(sampler.num_replicas):
        keys = list(StatefulDistributedSampler(sampler.dataset_len, sampler.num_replicas, rank, shuffle=False,
                                               drop_last=sampler.drop_last, batch_size=size, pad=sampler.pad))
        batches = len(keys) // size if sampler.drop_last else -(-len(keys) // size)
        for b in range(batches):
            batch = keys[b * size:(b + 1) * size]
            rows = [k[1] for k in batch if not is_padded(k)] or [k[1] for k in batch]
            if bool((labels[rows] == ignored).all()):
                where = f"rank {rank}'s batch {b + 1}" if sampler.num_replicas > 1 else f"batch {b + 1}"
                shown = ", ".join(map(str, rows[:6])) + (", ..." if len(rows) > 6 else "")
                raise ConfigError(
                    f"config.DATA.{split}: {where} (samples {shown} of the {split} data, read in "
                    f"order) holds only the label {ignored} ({_label_origin(cfg, split)}), which config.LOSS.name="
                    f"{cfg.LOSS.name} ignores: its loss would average over no sample (NaN) and stop the run there; "
                    f"give those samples their labels, leave them out, or place them among labelled ones"
                )


def label_scorers(cfg: Any, split: str, loss: Any, meters: Sequence[Any],
                  flag: str = "class_index_targets") -> List[Any]:
    """The loss and meters that score ``split``'s labels (those whose class attribute ``flag`` is
    set: ``class_index_targets``, or ``needs_labels`` for any use of labels): the loss in every
    phase, meters in test phases (and in train phases with METERS.enable_training_meter)."""
    out = [loss] if getattr(loss, flag, False) else []
    if split == "TEST" or cfg.METERS.enable_training_meter:
        out += [m for m in meters if getattr(m, flag, False)]
    return out


def check_dataset_labels(cfg: Any, datasets: Dict[str, Any], model: Any, loss: Any, meters: Sequence[Any]) -> None:
    """Before launch: every label of each split must be a class the heads that score it output.

    Raises a ConfigError naming the head's key (MODEL.HEAD.PARAMS[i]), its output size, the
    largest label and the split. Heads whose output size is not known from the config are
    left to the run (see :func:`explain_label_error`).
    """
    for split, dataset in datasets.items():
        ignored = getattr(loss, "ignore_index", None) if getattr(loss, "class_index_targets", False) else None
        if every_label_ignored(dataset, ignored):
            averaged = getattr(loss, "reduction", "mean") == "mean"
            raise ConfigError(
                f"config.DATA.{split}: every label ({_label_origin(cfg, split)}) is {ignored}, the label "
                f"config.LOSS.name={cfg.LOSS.name} ignores (its ignore_index): its loss would "
                f"{'average over no sample (NaN)' if averaged else 'sum over no sample (0): nothing would train'}; "
                f"give the samples their class labels, or use a loss that needs none"
            )
    output_heads = getattr(model, "output_heads", None)
    heads = [(where, size) for where, size in (output_heads() if callable(output_heads) else []) if size is not None]
    if not heads:
        return
    for split, dataset in datasets.items():
        for scorer in label_scorers(cfg, split, loss, meters):
            top = max_label(dataset, getattr(scorer, "ignore_index", None))
            if top is None:
                continue
            for where, size in heads:
                if top >= size:
                    raise ConfigError(_message(cfg, split, top, where, size, scorer_name(cfg, scorer, loss)))


def _first_out_of_range(output: Any, target: Any, ignore_index: Optional[int]) -> Optional[Tuple[int, int, int]]:
    """(output index, a label out of range, the output's class count) or None when every label fits."""
    outputs = [output] if isinstance(output, torch.Tensor) else list(output)
    targets = [target] if isinstance(target, torch.Tensor) else list(target)
    if len(targets) == 1:
        targets = targets * len(outputs)
    for i, (out, tgt) in enumerate(zip(outputs, targets)):
        if not (isinstance(out, torch.Tensor) and out.ndim >= 2 and isinstance(tgt, torch.Tensor)):
            continue
        if tgt.is_floating_point() or tgt.dtype == torch.bool or (tgt.ndim == 2 and tgt.shape[1] == out.shape[1]):
            continue  # not class indices (one-hot / multi-label rows)
        size = int(out.shape[1])
        labels = tgt.detach().reshape(-1).cpu()
        if ignore_index is not None:
            labels = labels[labels != ignore_index]
        above, below = labels[labels >= size], labels[labels < 0]
        if above.numel():
            return i, int(above.max()), size
        if below.numel():
            return i, int(below.min()), size
    return None


def explain_label_error(task: Any, output: Any, target: Any, scorer: Any) -> None:
    """After ``scorer`` (the loss or a meter) failed on a batch: raise a UserError when a label of
    the batch is not a class of the head output it scores, naming the head's key and the label.

    Returns (the caller re-raises the original error) when the labels fit, when ``scorer`` does not
    score class indices, or when the batch cannot be read (a CUDA device-side assert leaves the
    context unusable: that mistake is caught before launch instead).
    """
    if not getattr(scorer, "class_index_targets", False):
        return
    try:
        found = _first_out_of_range(output, target, getattr(scorer, "ignore_index", None))
    except Exception:  # noqa: BLE001 - the original error is the one to show
        return
    if found is None:
        return
    i, label, size = found
    output_heads = getattr(task.base_model, "output_heads", None)
    heads = output_heads() if callable(output_heads) else []
    where = heads[i][0] if i < len(heads) else f"the model's output {i}"
    split = "TRAIN" if task.train else "TEST"
    raise UserError(_message(task.config, split, label, where, size, scorer_name(task.config, scorer, task.loss)))
