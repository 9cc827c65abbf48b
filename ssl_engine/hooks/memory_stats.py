"""TorchMemoryStatsHook (HOOKS.MEMORY_SUMMARY): CUDA memory of this rank.

- every LOG_EVERY_N_ITERS train iterations: allocated, reserved and peak allocated MiB;
- at train iteration LOG_ITERATION_NUM and after the last phase: torch.cuda.memory_summary();
- on an exception, with DUMP_MEMORY_ON_EXCEPTION: the summary, to find what filled the GPU.

The CUDA allocator counters are host-side (no device sync). On the CPU the hook does nothing
at all: it uses no events, so the task never calls it.
"""

import logging
from typing import Any, Dict, List

import torch

from ssl_engine import distributed as du
from ssl_engine.hooks.base import Priority, SSLHook
from ssl_engine.registry import HOOKS

log = logging.getLogger(__name__)

MiB = 2.0**20


def memory_line(device: torch.device) -> str:
    """Allocated / reserved / peak allocated MiB of ``device``."""
    return (f"allocated {torch.cuda.memory_allocated(device) / MiB:.0f} MiB, "
            f"reserved {torch.cuda.memory_reserved(device) / MiB:.0f} MiB, "
            f"peak {torch.cuda.max_memory_allocated(device) / MiB:.0f} MiB")


@HOOKS.register("TorchMemoryStatsHook")
class TorchMemoryStatsHook(SSLHook):
    """CUDA memory lines and summaries; a no-op on CPU."""

    priority = Priority.LOW

    def __init__(self, use_cuda: bool, log_every_n_iters: int = -1, summary_iteration: int = 0,
                 print_summary: bool = True, dump_on_exception: bool = False) -> None:
        super().__init__()
        self.enabled = bool(use_cuda) and torch.cuda.is_available()
        self.log_every_n_iters = int(log_every_n_iters)
        self.summary_iteration = int(summary_iteration)
        self.print_summary = bool(print_summary)
        self.dump_on_exception = bool(dump_on_exception)
        if not self.enabled:
            log.debug("TorchMemoryStatsHook: no CUDA device in use; the hook does nothing")

    def events_used(self) -> List[str]:
        return super().events_used() if self.enabled else []

    def _rank_prefix(self) -> str:
        return f"rank {du.get_rank()}: " if du.get_world_size() > 1 else ""

    def on_step(self, task: Any) -> None:
        if not task.train:
            return
        done = task.iteration  # iterations completed, this one included
        if self.log_every_n_iters > 0 and done % self.log_every_n_iters == 0:
            log.info("%sCUDA memory at iteration %d: %s", self._rank_prefix(), done, memory_line(task.device))
        if self.print_summary and done == self.summary_iteration:
            log.info("%sCUDA memory summary at iteration %d:\n%s", self._rank_prefix(), done,
                     torch.cuda.memory_summary(task.device, abbreviated=True))

    def on_end(self, task: Any) -> None:
        if self.print_summary:
            log.info("%sCUDA memory summary after the last phase:\n%s", self._rank_prefix(),
                     torch.cuda.memory_summary(task.device, abbreviated=True))

    def on_exception(self, task: Any) -> None:
        if self.dump_on_exception:
            log.error("%sCUDA memory summary at the exception (iteration %d):\n%s", self._rank_prefix(),
                      task.iteration, torch.cuda.memory_summary(task.device))

    def get_classy_state(self) -> Dict[str, Any]:
        return {}

    def set_classy_state(self, state: Dict[str, Any]) -> None:
        pass
