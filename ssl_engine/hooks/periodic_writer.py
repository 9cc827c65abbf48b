"""PeriodicWriterHook: every LOG_FREQUENCY iterations, gather the training stats and hand
them to pluggable writers (console line, stdout.json, TensorBoard).

The loss is kept on the device between log steps (no per-step sync). In multi-rank runs
the logged loss is averaged over ranks and the data time is the max over ranks.
"""

import datetime
import json
import logging
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from ssl_engine import distributed as du
from ssl_engine.checkpoint import atomic_write, free_name
from ssl_engine.hooks.base import Priority, SSLHook
from ssl_engine.hooks.deferred_sum import DeferredSum
from ssl_engine.hooks.metrics_hook import write_whole
from ssl_engine.hooks.resume_point import done_before_resume
from ssl_engine.registry import HOOKS

log = logging.getLogger(__name__)


# Linux reports the process's peak RSS for RUSAGE_THREAD too (the memory map is shared), without
# RUSAGE_SELF's sum of every thread's CPU time: with every core busy (loader workers) that sum
# stalled the log line for about 4 ms in one call of ten inside a training loop, against 2 us
_RUSAGE_PEAK = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
_MAXRSS_PER_MB = 2**20 if sys.platform == "darwin" else 1024.0  # macOS gives bytes, Linux kilobytes


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this rank: CUDA max allocated on GPU, max RSS of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(_RUSAGE_PEAK).ru_maxrss / _MAXRSS_PER_MB


class Writer:
    """Receives one dict of stats per logged iteration, and one record per phase (rank 0 only).

    ``write`` gets the PeriodicWriterHook's stats; ``write_phase`` gets the MetricsHook's
    per-phase record (the metrics.json line). Override the ones the writer cares about.
    """

    def start(self) -> None:
        """The run starts (rank 0): e.g. repair what a killed run left in the file."""

    def rewind(self, logged_before: Callable[[Dict[str, Any]], bool], iteration: int = 0) -> None:
        """After ``start``: forget what a killed run wrote past the checkpoint this run resumes
        from, since those iterations run (and are logged) again. ``logged_before(stats)`` says
        whether a ``write``'s stats belong to the iterations the checkpoint holds; ``iteration``
        is the checkpoint's global iteration (0 for a run that starts from scratch)."""

    def write(self, stats: Dict[str, Any]) -> None:
        pass

    def write_phase(self, record: Dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class ConsoleWriter(Writer):
    """The human log line."""

    def write(self, s: Dict[str, Any]) -> None:
        log.info(
            "%s phase %d | iter %d (%d/%d) | lr %.5g | loss %.5f (avg %.5f) | data %.4fs | batch %.4fs | "
            "eta %s | peak mem %.0f MB",
            s["phase_type"], s["phase_idx"], s["iteration"], s["local_iteration"], s["phase_iterations"],
            s["lr"], s["loss"], s["avg_loss"], s["data_time"], s["batch_time"], s["eta"], s["peak_mem_mb"],
        )


def drop_partial_last_line(fd: int) -> None:
    """Cut a file of json lines back to its last newline: what a killed writer left after it
    (half a line) would otherwise be glued to the next line written."""
    size = os.fstat(fd).st_size
    end = size
    while end > 0:
        start = max(0, end - 65536)
        block = os.pread(fd, end - start, start)
        nl = block.rfind(b"\n")
        if nl >= 0:
            end = start + nl + 1
            break
        end = start
    if end != size:
        os.ftruncate(fd, end)


def lines_from_end(fd: int, end: int, block: int = 65536) -> Iterator[Tuple[int, bytes]]:
    """(offset, line without its newline) of each line of the file's first ``end`` bytes, last
    line first; ``end`` is just past a newline. Reads blocks from the end: a resumed run looks at
    the few lines it redoes, not at the whole file."""
    stop, carry = end - 1, b""  # the newline ending the last line
    while stop >= 0:
        start = max(0, stop - block)
        data = os.pread(fd, stop - start, start) + carry  # the bytes [start, line end)
        line_end = len(data)
        cut = data.rfind(b"\n", 0, line_end)
        while cut >= 0:
            yield start + cut + 1, data[cut + 1:line_end]
            line_end = cut
            cut = data.rfind(b"\n", 0, line_end)
        if start == 0:
            yield 0, data[:line_end]
            return
        stop, carry = start, data[:line_end]


def is_iteration_record(record: Any) -> bool:
    """Whether a json value is one of stdout.json's lines: a dict with a phase number, which every
    logged line carries (``{"a": 1}`` appended by something else is not)."""
    if not isinstance(record, dict):
        return False
    try:
        int(record["phase_idx"])
    except (KeyError, TypeError, ValueError):
        return False
    return True


def drop_trailing_records(fd: int, keep: Callable[[Dict[str, Any]], bool]) -> Tuple[int, bytes]:
    """Cut the file's trailing json lines for which ``keep`` is False: (how many records, the
    bytes of the lines among them that are not iteration records, e.g. text something else
    appended, or a json object after the last record).

    Stops at the first record from the end that is kept, so lines before it are never touched;
    the cut is one ftruncate, made durable before the run appends again.
    """
    size = os.fstat(fd).st_size
    cut, dropped, foreign = size, 0, []
    for offset, line in lines_from_end(fd, size):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if is_iteration_record(record) or (isinstance(record, dict) and dropped):
            if keep(record):  # an object of someone else's between records stays, with what is before it
                break
            dropped += 1
        elif line.strip():
            foreign.append(line + b"\n")
        cut = offset
    if cut != size:
        os.ftruncate(fd, cut)
        os.fsync(fd)
    return dropped, b"".join(reversed(foreign))


class JsonLinesWriter(Writer):
    """One json line per logged iteration, appended to CHECKPOINT.DIR/stdout.json.

    The file stays open (append mode) from the first line to ``close()``: each line is one
    ``write`` call, so a crash never leaves half a line behind a whole one.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd: Optional[int] = None

    def start(self) -> None:
        if self._fd is None and self.path.is_file():
            self._open()  # a line a killed run left half written is cut off now, not after the next line

    def rewind(self, logged_before: Callable[[Dict[str, Any]], bool], iteration: int = 0) -> None:
        """Drop the trailing lines of iterations the resumed run redoes (a line per iteration, once)."""
        if self._fd is not None or self.path.is_file():
            dropped, foreign = drop_trailing_records(self._open(), logged_before)
            if foreign:  # nothing is lost: the lines that are not the run's are kept aside
                aside = free_name(self.path.with_name(self.path.name + ".unreadable"))
                atomic_write(aside, lambda f: f.write(foreign))
                log.warning("%s: %d line(s) at its end are not iteration records and are left out; they are kept "
                            "as %s", self.path, foreign.count(b"\n"), aside.name)
            if dropped:
                log.info("%s: dropped %d line(s) logged after the checkpoint; those iterations run again",
                         self.path.name, dropped)

    def _open(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            drop_partial_last_line(self._fd)
        return self._fd

    def write(self, s: Dict[str, Any]) -> None:
        write_whole(self._open(), (json.dumps(s) + "\n").encode(), self.path)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __getstate__(self) -> Dict[str, Any]:
        return {"path": self.path, "_fd": None}  # a copy opens its own


def logged_before(task: Any) -> Callable[[Dict[str, Any]], bool]:
    """Whether a logged iteration's stats come from the part of the run that the checkpoint
    ``task`` resumed from holds (see ssl_engine.hooks.resume_point): what is not done runs again."""
    return done_before_resume(task)


@HOOKS.register("PeriodicWriterHook")
class PeriodicWriterHook(SSLHook):
    """Logs loss, lr, data/batch time, ETA and peak memory every LOG_FREQUENCY iterations."""

    priority = Priority.LOW
    # each rank's loss window since the last log line: a run resumed inside that window logs the
    # same avg_loss as the uninterrupted run (see the task's rank-local state)
    rank_local_state = True

    def __init__(self, log_frequency: int, writers: List[Writer], log_test_phases: bool = False) -> None:
        super().__init__()
        self.log_frequency = log_frequency
        self.writers = writers
        self.log_test_phases = log_test_phases
        self._losses = DeferredSum()
        self._data_time = 0.0
        self._t_last = 0.0
        self._batch_time_sum = 0.0
        self._timed_steps = 0

    def on_start(self, task: Any) -> None:
        if du.is_primary():
            logged = logged_before(task)
            for w in self.writers:
                start = getattr(w, "start", None)
                if start is not None:
                    start()
                rewind = getattr(w, "rewind", None)
                if rewind is not None:
                    rewind(logged, task.iteration)

    def on_phase_start(self, task: Any) -> None:
        if not getattr(task, "phase_resumed", False):  # else the checkpoint's window goes on
            self._losses.clear()
        self._data_time = 0.0
        self._t_last = time.perf_counter()
        self._batch_time_sum, self._timed_steps = 0.0, 0

    def on_step(self, task: Any) -> None:
        now = time.perf_counter()
        self._batch_time_sum += now - self._t_last
        self._timed_steps += 1
        self._t_last = now
        if task.last_loss is not None:
            self._losses.add(task.last_loss)
        if task.last_data_time > self._data_time:
            self._data_time = task.last_data_time
        if task.train:
            it = task.iteration
            # VISSL's rule: every LOG_FREQUENCY iterations, and iteration 1 and every 5th up to 100
            # (a short or slow run shows that it trains before the first LOG_FREQUENCY)
            if it % self.log_frequency == 0 or it == 1 or (it <= 100 and it % 5 == 0):
                self._emit(task)
        elif self.log_test_phases and task.local_iteration_num % self.log_frequency == 0:
            self._emit(task)

    def get_classy_state(self) -> Dict[str, Any]:
        return {"loss_sum": self._losses.total(), "loss_weight": self._losses.weight}

    def set_classy_state(self, state: Dict[str, Any]) -> None:
        self._losses.restore(float(state.get("loss_sum", 0.0)), float(state.get("loss_weight", 0.0)))

    def _emit(self, task: Any) -> None:
        loss_now = float(task.last_loss.float().item()) if task.last_loss is not None else float("nan")
        avg = self._losses.mean()
        batch_time = self._batch_time_sum / max(1, self._timed_steps)
        loss_now, avg = du.reduce_mean_scalars([loss_now, avg])
        data_time, = du.reduce_max_scalars([self._data_time])
        if du.is_primary():
            remaining = max(0, task.max_iteration - task.progress_iteration) if task.train else 0
            stats = {
                "phase_type": task.phase_type,
                "phase_idx": task.phase_idx,
                "train_phase_idx": task.train_phase_idx,
                "iteration": task.iteration,
                "local_iteration": task.local_iteration_num,
                "phase_iterations": task.phase_iterations,
                "lr": task.optimizer.lr if task.optimizer is not None else 0.0,
                "loss": loss_now,
                "avg_loss": avg,
                "data_time": round(data_time, 6),
                "batch_time": round(batch_time, 6),
                "samples_per_sec": round(self._global_batch(task) / batch_time, 3) if batch_time > 0 else 0.0,
                "eta": str(datetime.timedelta(seconds=int(remaining * batch_time))),
                "peak_mem_mb": round(peak_memory_mb(task.device), 1),
            }
            for w in self.writers:
                w.write(stats)
        self._losses.clear()
        self._data_time = 0.0
        self._batch_time_sum, self._timed_steps = 0.0, 0

    @staticmethod
    def _global_batch(task: Any) -> int:
        split = "TRAIN" if task.train else "TEST"
        return int(task.config.DATA[split].BATCHSIZE_PER_REPLICA) * task.world_size

    def on_end(self, task: Any) -> None:
        for w in self.writers:
            w.close()

    def on_exception(self, task: Any) -> None:
        for w in self.writers:  # flush what was written so far (TensorBoard buffers events)
            try:
                w.close()
            except Exception as e:  # the run's own error is the one to report (a full disk fails both)
                log.warning("could not close the %s: %s", type(w).__name__, e)
