"""Which logged records a resumed run keeps: metrics.json and stdout.json lines (TensorBoard
events are hidden by step instead, see hooks.tensorboard).

A run that resumes from a checkpoint redoes what came after it, so what a crashed attempt logged
past the checkpoint goes, and what it logged before stays. "Before" is decided by what a record
is, not by its ``phase_idx``: a record of train phase k, or of the test phase after train phase
k, sits at ``(k, train first)`` in every run, while ``phase_idx`` counts the phases of the run
that wrote it, and names another phase in a run whose config places its test phases otherwise
(``num_epochs`` raised with ``TEST_EVERY_NUM_EPOCH`` > 1, ``TEST_MODEL`` switched). Records
without ``train_phase_idx`` or a phase type fall back to ``phase_idx`` in this run's phases.
"""

from typing import Any, Callable, Dict, Optional, Tuple

Position = Tuple[int, int]  # (train_phase_idx, 0 for the train phase, 1 for the test phase after it)


def record_position(record: Dict[str, Any]) -> Optional[Position]:
    """Where a logged record sits in training: by ``train_phase_idx`` and its phase type
    (``phase_type``, or the ``train_`` / ``test_`` prefix of its values); None when it does not say."""
    try:
        k = int(record["train_phase_idx"])
    except (KeyError, TypeError, ValueError):
        return None
    kind = record.get("phase_type")
    if kind not in ("train", "test"):
        kinds = {key.split("_", 1)[0] for key in record if key != "train_phase_idx" and key.startswith(("train_", "test_"))}
        if len(kinds) != 1:
            return None
        kind = kinds.pop()
    return k, 0 if kind == "train" else 1


def done_before_resume(task: Any) -> Callable[[Dict[str, Any]], bool]:
    """A predicate: whether a logged record comes from the part of the run that the resumed
    checkpoint holds. A record of the checkpoint's own phase is done when that phase was complete,
    or, for an iteration's stats, when its ``local_iteration`` is within the checkpoint's steps
    (counted as the checkpoint counted them). A record that is not one of ours is kept.

    ``task.resume_point`` is ``(train_phase_idx, train, phase_complete)`` as the checkpoint wrote
    it (None when the run starts from scratch: nothing is done).
    """
    phase, in_phase = task.phase_idx, bool(getattr(task, "_resume_in_phase", False))
    steps = getattr(task, "checkpoint_local_iteration", None)
    steps = getattr(task, "local_iteration_num", 0) if steps is None else steps
    point = getattr(task, "resume_point", None)
    here: Optional[Position] = (int(point[0]), 0 if point[1] else 1) if point is not None else None
    complete = point is not None and bool(point[2])  # read only where ``here`` is set

    def within_steps(record: Dict[str, Any]) -> bool:
        try:
            return int(record["local_iteration"]) <= steps
        except (KeyError, TypeError, ValueError):
            return False  # a phase-end record of a phase that did not end before the checkpoint

    def done(record: Dict[str, Any]) -> bool:
        pos = record_position(record)
        if pos is not None and here is not None:
            return pos < here or (pos == here and (complete or within_steps(record)))
        if pos is not None and point is None and phase < 0:
            return False  # from scratch: every phase runs
        try:
            p = int(record["phase_idx"])
        except (KeyError, TypeError, ValueError):
            return True  # not one of ours: leave it
        if p != phase:
            return p < phase
        return not in_phase or within_steps(record)

    return done
