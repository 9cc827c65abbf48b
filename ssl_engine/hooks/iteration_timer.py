"""IterationTimer: time per training iteration, leaving out the first (warm-up) iterations,
and at the end the total time of the run with the share spent inside hooks.

Time is host wall time between consecutive steps (time.perf_counter, no device sync): over
many iterations it equals the device's pace. The task times each hook call only when this
hook is installed (``wants_hook_timing``).
"""

import datetime
import logging
import time
from typing import Any, Dict

from ssl_engine import distributed as du
from ssl_engine.hooks.base import Priority, SSLHook
from ssl_engine.registry import HOOKS

log = logging.getLogger(__name__)


def _fmt(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(seconds)))


@HOOKS.register("IterationTimer")
class IterationTimer(SSLHook):
    """Logs "N iterations in T (s / it)" and the total time with the time in hooks, at the end."""

    priority = Priority.VERY_HIGH
    wants_hook_timing = True

    def __init__(self, warmup_iters: int = 3) -> None:
        super().__init__()
        self.warmup_iters = max(0, int(warmup_iters))
        self.timed_iters = 0        # train iterations measured (after the warm-up)
        self.timed_seconds = 0.0    # their total time
        self._seen = 0              # train iterations run by this process
        self._t_start = 0.0
        self._t_last = 0.0

    def on_start(self, task: Any) -> None:
        self._t_start = time.perf_counter()
        self.timed_iters, self.timed_seconds, self._seen = 0, 0.0, 0

    def on_phase_start(self, task: Any) -> None:
        self._t_last = time.perf_counter()

    def on_step(self, task: Any) -> None:
        now = time.perf_counter()
        if task.train:
            self._seen += 1
            if self._seen > self.warmup_iters:
                self.timed_seconds += now - self._t_last
                self.timed_iters += 1
        self._t_last = now

    @property
    def seconds_per_iteration(self) -> float:
        return self.timed_seconds / self.timed_iters if self.timed_iters else float("nan")

    def summary(self, task: Any) -> Dict[str, Any]:
        """The numbers of the end-of-run log lines."""
        total = time.perf_counter() - self._t_start
        hooks = dict(getattr(task, "hook_seconds", {}) or {})
        hooks.pop(type(self).__name__, None)
        return {
            "iterations": self.timed_iters,
            "seconds": self.timed_seconds,
            "seconds_per_iteration": self.seconds_per_iteration,
            "warmup_iterations": min(self._seen, self.warmup_iters),
            "total_seconds": total,
            "hook_seconds": sum(hooks.values()),
            "per_hook_seconds": hooks,
        }

    def on_end(self, task: Any) -> None:
        if not du.is_primary():
            return
        s = self.summary(task)
        if s["iterations"]:
            log.info("overall training speed: %d iterations in %s (%.4f s / it), after %d warm-up iterations",
                     s["iterations"], _fmt(s["seconds"]), s["seconds_per_iteration"], s["warmup_iterations"])
        top = sorted(s["per_hook_seconds"].items(), key=lambda kv: -kv[1])[:5]
        log.info("total training time: %s (%.2f s in hooks%s)", _fmt(s["total_seconds"]), s["hook_seconds"],
                 ": " + ", ".join(f"{k} {v:.2f}" for k, v in top if v > 0) if top else "")

    def get_classy_state(self) -> Dict[str, Any]:
        return {}

    def set_classy_state(self, state: Dict[str, Any]) -> None:
        pass
