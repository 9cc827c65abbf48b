"""PerfStatsHook (HOOKS.PERF_STATS): where the time of an iteration goes: data, forward, loss,
backward, optimizer step and the rest (counters, end-of-step hooks), averaged per phase.

Marks are taken at the step's hook events (on_forward, on_loss_and_meter, on_backward,
on_update, on_step); each part includes the hooks that run at its event. On the CPU the marks
are host times; on a GPU they are CUDA events, read in batches (every PERF_STAT_FREQUENCY
iterations, at most every 256, and at the phase end), so timing never syncs the device
every step. Data time is the host time spent waiting for the batch, and is taken out of the
forward part. The phase averages (milliseconds per iteration, averaged over ranks) are logged
and written into metrics.json as ``{phase}_perf_stats``.
"""

import logging
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from ssl_engine import distributed as du
from ssl_engine.hooks.base import SSLHook
from ssl_engine.registry import HOOKS

log = logging.getLogger(__name__)

PARTS = ("data", "forward", "loss", "backward", "step", "other")
# (part, mark that ends it), in the order of the events of a step
_SEGMENTS = (("forward", "forward"), ("loss", "loss"), ("backward", "backward"), ("step", "update"), ("other", "end"))
_MAX_PENDING = 256


class _HostClock:
    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, a: float, b: float) -> float:
        return b - a

    def ready(self, last: Any) -> None:
        pass


class _CudaClock:
    def mark(self) -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1000.0

    def ready(self, last: Any) -> None:
        last.synchronize()


@HOOKS.register("PerfStatsHook")
class PerfStatsHook(SSLHook):
    """Per-phase breakdown of the iteration time; a log line every ``frequency`` iterations if > 0."""

    priority = 100  # last at every event: a part ends after the hooks of its event
    rank_local_state = True  # each rank's own timings: a checkpoint keeps every rank's sums

    def __init__(self, frequency: int = -1) -> None:
        super().__init__()
        self.frequency = int(frequency)
        self.clock: Any = _HostClock()
        self.sums: Dict[str, float] = {p: 0.0 for p in PARTS}
        self.count = 0
        self._pending: List[Tuple[float, Dict[str, Any]]] = []
        self._marks: Dict[str, Any] = {}
        self._window: Dict[str, float] = {p: 0.0 for p in PARTS}
        self._window_count = 0
        self._resumed: Optional[Dict[str, Any]] = None  # a checkpoint's sums of the phase it stopped in
        self._data_time = 0.0  # the current step's data time (read at on_forward)

    def on_start(self, task: Any) -> None:
        self.clock = _CudaClock() if task.device.type == "cuda" else _HostClock()

    def on_phase_start(self, task: Any) -> None:
        resumed, self._resumed = self._resumed, None
        if task.phase_resumed and resumed is not None:  # the phase goes on: so do its sums
            self.sums = {p: float(resumed["sums"].get(p, 0.0)) for p in PARTS}
            self.count = int(resumed["count"])
        else:
            self.sums = {p: 0.0 for p in PARTS}
            self.count = 0
        self._pending = []
        self._window = {p: 0.0 for p in PARTS}
        self._window_count = 0
        self._marks = {"start": self.clock.mark()}

    def on_forward(self, task: Any) -> None:
        self._marks["forward"] = self.clock.mark()
        self._data_time = float(task.last_data_time)

    def on_loss_and_meter(self, task: Any) -> None:
        self._marks["loss"] = self.clock.mark()

    def on_backward(self, task: Any) -> None:
        self._marks["backward"] = self.clock.mark()

    def on_update(self, task: Any) -> None:
        self._marks["update"] = self.clock.mark()

    def on_step(self, task: Any) -> None:
        end = self.clock.mark()
        self._marks["end"] = end
        self._pending.append((float(task.last_data_time), self._marks))
        self._marks = {"start": end}
        counter = task.iteration if task.train else task.local_iteration_num
        if self.frequency > 0 and counter % self.frequency == 0:
            self._resolve()
            if du.is_primary() and self._window_count:
                n = self._window_count
                log.info("perf stats (%s, last %d iterations, ms/it): %s", task.phase_type, n,
                         " | ".join(f"{p} {1000 * self._window[p] / n:.2f}" for p in PARTS))
            self._window = {p: 0.0 for p in PARTS}
            self._window_count = 0
        elif len(self._pending) >= _MAX_PENDING:
            self._resolve()

    def _resolve(self) -> None:
        """Turn the pending marks into seconds per part (one device sync on GPU)."""
        if not self._pending:
            return
        self.clock.ready(self._pending[-1][1]["end"])
        for data, marks in self._pending:
            parts = self._parts(data, marks)
            for p in PARTS:
                self.sums[p] += parts[p]
                self._window[p] += parts[p]
        self.count += len(self._pending)
        self._window_count += len(self._pending)
        self._pending = []

    def _parts(self, data: float, marks: Dict[str, Any]) -> Dict[str, float]:
        """Seconds of each part of one step from its marks (its ``end`` mark ready)."""
        parts = {p: 0.0 for p in PARTS}
        parts["data"] = data
        prev = marks["start"]
        for part, key in _SEGMENTS:
            if key in marks:
                parts[part] = self.clock.seconds(prev, marks[key])
                prev = marks[key]
        parts["forward"] = max(0.0, parts["forward"] - data)
        return parts

    def phase_averages(self) -> Dict[str, float]:
        """Milliseconds per iteration of each part in the current phase (this rank)."""
        self._resolve()
        n = max(1, self.count)
        return {f"{p}_ms": 1000.0 * self.sums[p] / n for p in PARTS}

    def phase_metrics(self, task: Any) -> Dict[str, Any]:
        """``perf_stats``: the phase averages over ranks (called by the MetricsHook on every rank)."""
        avg = self.phase_averages()
        keys = list(avg)
        values = du.reduce_mean_scalars([avg[k] for k in keys])
        out = {k: round(v, 4) for k, v in zip(keys, values)}
        out["iterations"] = self.count
        return {"perf_stats": out}

    def get_classy_state(self) -> Dict[str, Any]:
        """The current phase's sums, so that a run resumed inside the phase averages all of it."""
        self._resolve()
        sums, count = dict(self.sums), int(self.count)
        if "forward" in self._marks:  # an iteration checkpoint: its step ran, but on_step (last) has not recorded it
            end = self.clock.mark()
            self.clock.ready(end)
            step = self._parts(self._data_time, {**self._marks, "end": end})
            sums, count = {p: sums[p] + step[p] for p in PARTS}, count + 1
        return {"sums": sums, "count": count}

    def set_classy_state(self, state: Dict[str, Any]) -> None:
        self._resumed = dict(state) if state and "sums" in state else None  # older checkpoints: {}

