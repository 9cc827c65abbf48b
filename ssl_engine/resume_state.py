"""The training state a resume restores, read from a loaded checkpoint.

Two writers make training checkpoints a run may continue from: this engine, whose
``classy_state_dict`` carries every loop counter (``local_iteration_num``, ``phase_complete``,
...), and VISSL 0.1.6, whose ``classy_state_dict`` is classy_vision's task state (no position
inside a phase) with the loop counters at the top level. A VISSL user who points a run at the
folder VISSL trained in goes on from VISSL's checkpoint: :func:`from_vissl` converts it by
VISSL's own resume rule, and :func:`state_problem` tells a damaged or foreign file from a good
one before any part of it is used (auto-resume then skips it for an older one).
"""

import logging
from numbers import Integral
from typing import Any, Dict, List, Optional

from ssl_engine.errors import first_few

log = logging.getLogger(__name__)

# what this engine's classy_state_dict holds and VISSL's lacks
_OWN_COUNTERS = ("local_iteration_num", "phase_complete")
WRITTEN_BY_VISSL = "VISSL"


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer of a file's record (a bool, which is an int to Python, is not)."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def non_finite_tensors(tree: Any, prefix: str = "") -> List[str]:
    """The names of the floating-point tensors in a nested dict of weights that hold NaN or inf."""
    import torch

    if isinstance(tree, torch.Tensor):  # a file read without its data (meta tensors, before launch) has no values
        bad = tree.is_floating_point() and not tree.is_meta and not bool(torch.isfinite(tree).all())
        return [prefix or "the weights"] if bad else []
    if isinstance(tree, dict):
        return [name for k, v in tree.items() for name in non_finite_tensors(v, f"{prefix}.{k}" if prefix else str(k))]
    return []


def written_by_vissl(data: Dict[str, Any]) -> bool:
    """Whether ``data`` is a VISSL training checkpoint (classy_vision's task state inside)."""
    state = data.get("classy_state_dict")
    return isinstance(state, dict) and not any(k in state for k in _OWN_COUNTERS)


def state_problem(data: Dict[str, Any]) -> Optional[str]:
    """Why the training state of checkpoint ``data`` cannot be continued, or None when it can.

    Checks the loop counters a resume reads (names, types, ranges), so that a hand-edited,
    damaged or foreign file is one clear message instead of a KeyError or a run that counts
    from a negative iteration.
    """
    state = data.get("classy_state_dict")
    if not isinstance(state, dict) or not isinstance(state.get("base_model"), dict):
        return "it holds no classy_state_dict.base_model (the model weights of a training checkpoint)"
    if written_by_vissl(data):  # VISSL keeps its counters at the top level
        where, counters = "", {"phase_idx": -1, "train_phase_idx": -1, "iteration": 0}
        flags = {}
        values = data
    else:
        where, counters = "classy_state_dict.", {"phase_idx": -1, "train_phase_idx": -1, "iteration": 0,
                                                 "local_iteration_num": 0}
        flags = {"train": state.get("train"), "phase_complete": state.get("phase_complete")}
        values = state
    for key, lowest in counters.items():
        value = values.get(key)
        if not is_int(value) or int(value) < lowest:
            shown = "missing" if key not in values else f"{value!r}"
            return (f"its {where}{key} is {shown}, where a training checkpoint has an integer >= {lowest}: it was "
                    f"not written by a training run, or was changed since")
    for key, value in flags.items():
        if not isinstance(value, bool):
            shown = "missing" if value is None else f"{value!r}"
            return f"its {where}{key} is {shown}, where a training checkpoint has true or false"
    bad = non_finite_tensors(state["base_model"])
    if bad:  # a run stops on a NaN loss before it checkpoints (unless HOOKS.CHECK_NAN is off)
        return (f"its model weights hold NaN or infinite values ({first_few(bad)}): the run that wrote it had diverged "
                f"(with HOOKS.CHECK_NAN off), or the file was changed since")
    batches = (values.get("phase_data") or {}).get("batches") if isinstance(values.get("phase_data"), dict) else None
    if flags and not flags["phase_complete"] and is_int(batches) and int(values["local_iteration_num"]) > int(batches):
        # a phase stopped part-way cannot be further into its data than the phase is long
        return (f"its {where}local_iteration_num is {values['local_iteration_num']}, beyond the {batches} batches "
                f"of the phase it stopped in ({where}phase_data.batches): it was changed since it was written")
    return None


def from_vissl(data: Dict[str, Any], train_batches: Optional[int], source: str) -> Dict[str, Any]:
    """This engine's ``classy_state_dict`` for VISSL training checkpoint ``data``.

    VISSL writes ``phase_idx`` / ``train_phase_idx`` of the last finished phase (an iteration
    checkpoint lowers them by one) and resumes the next train phase at batch ``iteration -
    (train_phase_idx + 1) x batches per epoch``. The same rule places this run, with this
    config's ``train_batches`` per epoch: 0 is a phase end, a batch inside the epoch an
    interrupted phase. A position outside the epoch (the VISSL run had another batch size) goes
    on at the start of the next phase, with a warning, so no sample is skipped.

    Taken: the weights, the optimizer's state (``{"optim": ...}``, loaded when its groups and
    tensor shapes fit), the loss's state (MoCo's queue, ...; loaded when it fits). Not taken:
    meters and hook states (classy_vision's formats), the RNG state (VISSL stores none) and
    apex AMP state.
    """
    state = data["classy_state_dict"]
    phase_idx, k, iteration = int(data["phase_idx"]), int(data["train_phase_idx"]), int(data["iteration"])
    start = iteration - (k + 1) * train_batches if train_batches else 0
    if train_batches and start == train_batches:
        # an iteration checkpoint written at the last batch of an epoch: VISSL lowered its counters,
        # but that epoch is done
        phase_idx, k, start = phase_idx + 1, k + 1, 0
    in_phase = 0 < start < (train_batches or 0)
    if start != 0 and not in_phase:
        log.warning(
            "%s: VISSL's checkpoint is at iteration %d after %d finished epoch(s), which is not a position in this "
            "config's epochs of %s batches (the VISSL run had another batch size or data); the run goes on at the "
            "start of the next train phase", source, iteration, k + 1, train_batches,
        )
    optimizer = state.get("optimizer")
    torch_state = optimizer.get("optim") if isinstance(optimizer, dict) else None
    loss = data.get("loss") or data.get("criterion")  # VISSL's key before it was renamed "loss"
    converted = {
        "written_by": WRITTEN_BY_VISSL,
        "base_model": state["base_model"],
        "optimizer": {"optimizer": torch_state, "optimizer_class": None} if isinstance(torch_state, dict) else {},
        "loss": loss if isinstance(loss, dict) else {},
        "meters": [],
        "hooks": {},
        "iteration": iteration,
        "num_updates": iteration,
    }
    if in_phase:  # VISSL lowered the counters of this interrupted phase by one
        converted.update(phase_idx=phase_idx + 1, train_phase_idx=k + 1, train=True, phase_complete=False,
                         local_iteration_num=start)
        log.info("%s: VISSL's checkpoint of an interrupted epoch: the run goes on in train phase %d at batch %d of %d",
                 source, k + 1, start, train_batches)
    else:
        converted.update(phase_idx=phase_idx, train_phase_idx=k, train=True, phase_complete=True,
                         local_iteration_num=0)
    return converted


__all__ = ["WRITTEN_BY_VISSL", "from_vissl", "state_problem", "written_by_vissl"]
