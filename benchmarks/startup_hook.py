"""A hook the startup benchmark adds to a real run (``config.USER_MODULES`` + ``config.HOOKS.CUSTOM``).

``BenchStartupClock`` appends ``{"event": ..., "time": time.time()}`` lines to the file named by
$BENCH_STARTUP_FILE at on_start, the first on_phase_start and the first on_step (the end of
the first training iteration), so the benchmark can compare them with the time it launched
the command. It imports nothing but the engine's hook base, and does nothing afterwards.
"""

import json
import os
import time
from typing import Any, Dict

from ssl_engine.hooks.base import Priority, SSLHook
from ssl_engine.registry import HOOKS


@HOOKS.register("BenchStartupClock")
class BenchStartupClock(SSLHook):
    priority = Priority.VERY_HIGH

    def __init__(self) -> None:
        super().__init__()
        self.path = os.environ.get("BENCH_STARTUP_FILE", "")
        self.seen: set = set()

    def _mark(self, event: str) -> None:
        if event in self.seen or not self.path:
            return
        self.seen.add(event)
        with open(self.path, "a") as f:
            f.write(json.dumps({"event": event, "time": time.time()}) + "\n")

    def on_start(self, task: Any) -> None:
        self._mark("on_start")

    def on_phase_start(self, task: Any) -> None:
        self._mark("first_phase_start")

    def on_step(self, task: Any) -> None:
        self._mark("first_step_end")

    def get_classy_state(self) -> Dict[str, Any]:
        return {}

    def set_classy_state(self, state: Dict[str, Any]) -> None:
        pass
