"""CheckpointHook: phase, iteration, final and preemption checkpoints (rank 0 writes).

Every rank takes part in building the state (RNG states are gathered from all ranks); only
rank 0 writes the file. A preemption request (SIGTERM/SIGUSR1) is agreed on by all ranks
at a step boundary, written as an iteration checkpoint at the first step that ends an
optimizer update (with gradient accumulation, the accumulation's last batch), and ends the run.

With CHECKPOINT.ASYNC_WRITE (the default) rank 0 hands a snapshot of the state to the
background writer of ssl_engine.checkpoint and training goes on while the file is written.
The preemption and final checkpoints are written before the hook returns (after the write in
flight), the run waits for the write in flight at on_end, and a failed run finishes it (or, on
a second Ctrl-C, abandons it) in on_exception. A failed background write (a full disk) stops
the run at the next save or at on_end with the same one-line error as a synchronous one.
"""

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from ssl_engine import distributed as du
from ssl_engine import preemption
from ssl_engine.checkpoint import (
    final_checkpoint_name,
    iteration_checkpoint_name,
    phase_checkpoint_name,
    save_checkpoint,
    save_checkpoint_async,
    settle_checkpoint_writes,
    wait_for_checkpoint_writes,
)
from ssl_engine.hooks.base import Priority, SSLHook
from ssl_engine.registry import HOOKS
from ssl_engine.train_steps.standard_train_step import ends_an_update

log = logging.getLogger(__name__)


def build_checkpoint(task: Any, kind: str) -> Dict[str, Any]:
    """The checkpoint dict with VISSL's top-level keys."""
    return {
        "phase_idx": task.phase_idx,
        "train_phase_idx": task.train_phase_idx,
        "iteration": task.iteration,
        "iteration_num": task.iteration,
        "type": kind,
        "classy_state_dict": task.get_classy_state(),
    }


def async_write_enabled(task: Any) -> bool:
    """CHECKPOINT.ASYNC_WRITE of the task's config (true when a hand-made config lacks it)."""
    return bool(task.config.CHECKPOINT.get("ASYNC_WRITE", True))


def _log_saved(path: Path) -> None:
    log.info("saved checkpoint %s", path)


def files_synced_by_checkpoints(task: Any) -> List[Path]:
    """The files the task's hooks append to without syncing each line (``synced_by_checkpoints``,
    e.g. MetricsHook's metrics.json): each checkpoint makes them durable before itself."""
    return [Path(p) for h in task.hooks for p in getattr(h, "synced_by_checkpoints", ())]


def write_checkpoint(task: Any, name: str, kind: str, wait: Optional[bool] = None) -> None:
    """Build the state on every rank; write it from rank 0.

    ``wait``: True writes the file before returning (after any write in flight), False in the
    background, None as CHECKPOINT.ASYNC_WRITE says. In the background, rank 0 waits for the
    previous write (raising its error), snapshots the state, and returns.
    """
    ckpt = build_checkpoint(task, kind)
    if du.is_primary():
        keep = task.config.CHECKPOINT.KEEP_LAST
        background = async_write_enabled(task) if wait is None else not wait
        sync_first = files_synced_by_checkpoints(task)
        if background:
            save_checkpoint_async(task.checkpoint_folder, name, ckpt, keep_last=keep, on_saved=_log_saved,
                                  sync_first=sync_first)
        else:
            wait_for_checkpoint_writes()
            _log_saved(save_checkpoint(task.checkpoint_folder, name, ckpt, keep_last=keep, sync_first=sync_first))
    du.barrier()


def how_to_resume(task: Any) -> str:
    """What to run to go on after the preemption checkpoint of ``task``'s current iteration: the
    same command resumes it only under auto-resume without RESUME_FROM (which would start from its
    own file again, and AUTO_RESUME=false from scratch)."""
    ck = task.config.CHECKPOINT
    if ck.AUTO_RESUME and not ck.RESUME_FROM:
        return "rerun the same command to resume"
    path = Path(task.checkpoint_folder) / iteration_checkpoint_name(task.iteration)
    why = "config.CHECKPOINT.RESUME_FROM names another file" if ck.RESUME_FROM else "config.CHECKPOINT.AUTO_RESUME=false"
    return f"to resume, rerun with config.CHECKPOINT.RESUME_FROM={path} (the same command would not: {why})"


class PreemptionVote:
    """Whether any rank was asked to stop, agreed on by all ranks without a blocking collective.

    One process reads its own flag. With several ranks, each step starts a non-blocking MAX
    all-reduce of the local flags and reads the one started the step before (long finished by
    then), so every rank learns the same answer at the same iteration, one step after the
    signal, and no step waits on the network for it.
    """

    def __init__(self) -> None:
        self._flag: Optional[torch.Tensor] = None
        self._work: Any = None
        self._world_size = 0  # read at the first vote (the process group is up by then), not every step

    def agreed(self) -> bool:
        if not self._world_size:
            self._world_size = du.get_world_size()
        if self._world_size == 1:
            return preemption.requested()
        stop = False
        if self._work is not None:
            self._work.wait()
            stop = bool(self._flag.item())  # type: ignore[union-attr]
        self._flag = torch.tensor([1 if preemption.requested() else 0], dtype=torch.int32)
        self._work = torch.distributed.all_reduce(self._flag, op=torch.distributed.ReduceOp.MAX, async_op=True)
        return stop

    def finish(self) -> None:
        """Wait for the vote in flight (at the end of the run, before the group goes away)."""
        if self._work is not None:
            self._work.wait()
            self._work = None


@HOOKS.register("CheckpointHook")
class CheckpointHook(SSLHook):
    """model_phase{N}, model_iteration{I}, model_final_checkpoint_phase{N} and preemption saves."""

    priority = Priority.VERY_LOW

    def __init__(self, phase_frequency: int = 1, iteration_frequency: int = -1) -> None:
        super().__init__()
        self.phase_frequency = phase_frequency
        self.iteration_frequency = iteration_frequency
        self._vote = PreemptionVote()
        self._stopping = self._iteration_save_due = False

    def on_start(self, task: Any) -> None:
        self._vote = PreemptionVote()  # this run's process group (a hook object may serve several runs)
        self._stopping = self._iteration_save_due = False

    def on_step(self, task: Any) -> None:
        """The preemption save and the iteration checkpoints, each at a step that ends an
        optimizer update: with gradient accumulation, a save between updates would lose the
        gradients accumulated so far, so it waits for the accumulation's last batch (at most
        GRAD_ACCUMULATION_STEPS - 1 steps; every rank reaches it at the same iteration)."""
        self._stopping = self._stopping or self._vote.agreed()
        if task.train and self.iteration_frequency > 0 and task.iteration % self.iteration_frequency == 0:
            self._iteration_save_due = True
        if not (self._stopping or self._iteration_save_due) or not ends_an_update(task):
            return
        if self._stopping:  # written before the process exits (code 3)
            write_checkpoint(task, iteration_checkpoint_name(task.iteration), "iteration", wait=True)
            raise preemption.Preempted(
                f"stopped on a preemption signal at iteration {task.iteration}; {how_to_resume(task)}"
            )
        self._iteration_save_due = False
        write_checkpoint(task, iteration_checkpoint_name(task.iteration), "iteration")

    def on_phase_end(self, task: Any) -> None:
        if task.done_training():  # nothing is left to overlap it with: on disk before later hooks run
            write_checkpoint(task, final_checkpoint_name(task.train_phase_idx), "final", wait=True)
        elif task.train and (task.train_phase_idx + 1) % self.phase_frequency == 0:
            write_checkpoint(task, phase_checkpoint_name(task.train_phase_idx), "phase")

    def on_end(self, task: Any) -> None:
        """The run ends with every checkpoint on disk (or the write's error raised)."""
        self._vote.finish()
        wait_for_checkpoint_writes()

    def on_exception(self, task: Any) -> None:
        """A failed run still finishes the write in flight (a second Ctrl-C abandons it)."""
        settle_checkpoint_writes()
