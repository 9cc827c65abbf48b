"""ProgressBarHook: a tqdm bar for each phase, on rank 0, when stdout is a terminal.

It stays off when the output goes to a file or pipe, under CI (``CI`` set) and inside SLURM
jobs (``SLURM_JOB_ID`` set), where a bar would only fill the log with carriage returns.
"""

import os
import sys
from typing import Any, Dict, Optional, TextIO

from ssl_engine import distributed as du
from ssl_engine.hooks.base import Priority, SSLHook
from ssl_engine.registry import HOOKS


def progress_bar_wanted(stream: Optional[TextIO] = None) -> bool:
    """True when a bar is useful: rank 0, an interactive terminal, not CI, not a SLURM job."""
    stream = stream or sys.stdout
    try:
        tty = bool(stream.isatty())
    except (AttributeError, ValueError):
        tty = False
    ci = os.environ.get("CI", "").lower() not in ("", "0", "false")
    return tty and not ci and "SLURM_JOB_ID" not in os.environ and du.is_primary()


def phase_batches(task: Any) -> int:
    """Batches in the task's current phase."""
    n = getattr(task, "phase_iterations", None)
    if n is None:
        n = len(task.dataloaders["TRAIN" if task.train else "TEST"])
    return int(n)


@HOOKS.register("ProgressBarHook")
class ProgressBarHook(SSLHook):
    """One tqdm bar per phase: position in the phase's batches, loss at log steps."""

    priority = Priority.LOW

    def __init__(self, stream: Optional[TextIO] = None, log_frequency: int = 10) -> None:
        super().__init__()
        self.stream = stream
        self.log_frequency = max(1, int(log_frequency))
        self.bar: Any = None

    def on_phase_start(self, task: Any) -> None:
        from tqdm import tqdm

        self._close()
        self.bar = tqdm(
            total=phase_batches(task),
            initial=task.local_iteration_num,
            desc=f"{task.phase_type} phase {task.phase_idx}",
            file=self.stream or sys.stdout,
            dynamic_ncols=True,
            leave=False,
        )

    def on_step(self, task: Any) -> None:
        if self.bar is None:
            return
        self.bar.update(1)
        if task.local_iteration_num % self.log_frequency == 0 and task.last_loss is not None:
            self.bar.set_postfix(loss=f"{float(task.last_loss.float()):.4f}", refresh=False)  # syncs every N steps

    def _close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def on_phase_end(self, task: Any) -> None:
        self._close()

    def on_end(self, task: Any) -> None:
        self._close()

    def on_exception(self, task: Any) -> None:
        self._close()

    def get_classy_state(self) -> Dict[str, Any]:
        return {}

    def set_classy_state(self, state: Dict[str, Any]) -> None:
        pass
