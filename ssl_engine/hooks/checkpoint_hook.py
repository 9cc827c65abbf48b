"""CheckpointHook: phase, iteration, final and preemption checkpoints (rank 0 writes).

Every rank takes part in building the state (RNG states are gathered from all ranks); only
rank 0 writes the file. A preemption request (SIGTERM/SIGUSR1) is agreed on by all ranks
at a step boundary, written as an iteration checkpoint, and ends the run.
"""

import logging
from typing import Any, Dict

import torch

from ssl_engine import distributed as du
from ssl_engine import preemption
from ssl_engine.checkpoint import final_checkpoint_name, iteration_checkpoint_name, phase_checkpoint_name, save_checkpoint
from ssl_engine.hooks.base import Priority, SSLHook
from ssl_engine.registry import HOOKS

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


def write_checkpoint(task: Any, name: str, kind: str) -> None:
    """Build the state on every rank; write it from rank 0."""
    ckpt = build_checkpoint(task, kind)
    if du.is_primary():
        keep = task.config.CHECKPOINT.KEEP_LAST
        path = save_checkpoint(task.checkpoint_folder, name, ckpt, keep_last=keep)
        log.info("saved checkpoint %s", path)
    du.barrier()


def preemption_agreed() -> bool:
    """True on every rank when any rank was asked to stop."""
    flag = preemption.requested()
    if du.get_world_size() > 1:
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        flag = bool(t.item())
    return flag


@HOOKS.register("CheckpointHook")
class CheckpointHook(SSLHook):
    """model_phase{N}, model_iteration{I}, model_final_checkpoint_phase{N} and preemption saves."""

    priority = Priority.VERY_LOW

    def __init__(self, phase_frequency: int = 1, iteration_frequency: int = -1) -> None:
        super().__init__()
        self.phase_frequency = phase_frequency
        self.iteration_frequency = iteration_frequency

    def on_step(self, task: Any) -> None:
        if preemption_agreed():
            write_checkpoint(task, iteration_checkpoint_name(task.iteration), "iteration")
            raise preemption.Preempted(
                f"stopped on a preemption signal at iteration {task.iteration}; rerun the same command to resume"
            )
        if task.train and self.iteration_frequency > 0 and task.iteration % self.iteration_frequency == 0:
            write_checkpoint(task, iteration_checkpoint_name(task.iteration), "iteration")

    def on_phase_end(self, task: Any) -> None:
        if task.done_training():
            write_checkpoint(task, final_checkpoint_name(task.train_phase_idx), "final")
        elif task.train and (task.train_phase_idx + 1) % self.phase_frequency == 0:
            write_checkpoint(task, phase_checkpoint_name(task.train_phase_idx), "phase")
