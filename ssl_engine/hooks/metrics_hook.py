"""MetricsHook: at each phase end, log every meter value and the phase's mean loss, and
write them as one line of CHECKPOINT.DIR/metrics.json (VISSL's format).

The phase loss is the mean over samples (each batch's loss weighted by its number of real
samples, padding left out), summed over ranks: the same value for any number of ranks."""

import errno
import json
import logging
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from ssl_engine import distributed as du
from ssl_engine.checkpoint import atomic_write_text, free_name, sync_files
from ssl_engine.errors import UserError, first_few
from ssl_engine.hooks.base import Priority, SSLHook
from ssl_engine.hooks.deferred_sum import DeferredSum
from ssl_engine.hooks.resume_point import done_before_resume, record_position
from ssl_engine.registry import HOOKS

log = logging.getLogger(__name__)


def read_metrics(path: Path) -> list:
    """The json lines of a metrics.json (a partial last line is ignored)."""
    out = []
    if Path(path).is_file():
        for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):  # anything else is not a phase record
                out.append(record)
    return out


def _phase_idx_readable(record: Dict[str, Any]) -> bool:
    """False for a line without a phase_idx that is a number (``{"foo": 1}``, damaged bytes that
    parse): not a phase record, which always has one (here and in VISSL's metrics.json)."""
    try:
        int(record["phase_idx"])
    except (KeyError, TypeError, ValueError):
        return False
    return True


def append_line(path: Path, line: str) -> None:
    """Append ``line`` with one write, without rewriting the file.

    A write cut short (disk full) is undone, so the file never holds half a line. The line is
    not synced here: a kill leaves it in the page cache, and the next checkpoint (which is what
    a resumed run goes back to) makes it durable before itself (``synced_by_checkpoints``).
    """
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        write_whole(fd, line.encode(), path)
    finally:
        os.close(fd)


def write_whole(fd: int, data: bytes, path: Any) -> None:
    """``data`` appended to ``fd`` (opened with O_APPEND) with one write, or not at all: a write
    cut short (a full disk) is cut off again. The OSError names ``path`` (os.write's names no
    file), so a full disk is the run's one line of a file-system error."""
    try:
        written = os.write(fd, data)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None
    if written != len(data):
        os.ftruncate(fd, os.fstat(fd).st_size - written)
        raise OSError(errno.ENOSPC, f"only {written} of {len(data)} bytes of a line could be written", str(path))


def flatten_metrics(record: Dict[str, Any], sep: str = "/") -> Dict[str, float]:
    """The numeric leaves of a (nested) phase record, keyed like 'test_accuracy_list_meter/top_1/0'."""
    flat: Dict[str, float] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{sep}{k}" if prefix else str(k), v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}{sep}{i}", v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[prefix] = float(value)
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            flat[prefix] = float(value.item())

    walk("", record)
    return flat


@HOOKS.register("MetricsHook")
class MetricsHook(SSLHook):
    """Per-phase meter values: log line plus one appended line of metrics.json.

    Other hooks add values to the phase record by defining ``phase_metrics(task) -> dict``
    (called on every rank, so it may use collectives); each key ``k`` becomes ``{phase}_{k}``.
    The record is kept as ``last_record`` on every rank (BestCheckpointer reads it) and handed
    to the writers' ``write_phase`` on rank 0 (TensorBoard).
    """

    priority = Priority.BELOW_NORMAL
    rank_local_state = True  # each rank's loss sum: a checkpoint keeps every rank's (see the task)

    def __init__(self, folder: str, writers: Optional[List[Any]] = None) -> None:
        super().__init__()
        self.path = Path(folder) / "metrics.json"
        self.writers = list(writers or [])  # periodic_writer.Writer instances: write_phase(record)
        self.last_record: Dict[str, Any] = {}
        self._losses = DeferredSum()  # this phase's losses since the last fold, weighted by real samples
        self.state.loss_sum = 0.0
        self.state.count = 0

    def on_start(self, task: Any) -> None:
        """Drop what a crashed attempt left behind: lines of phases this run will (re)do (by what
        each line is, see ssl_engine.hooks.resume_point), and a partial last line. Rewrites the
        file (atomically) only when there is something to drop."""
        if not du.is_primary():
            return
        if not os.path.lexists(self.path):
            self._warn_lost_lines(task, [])
            return
        if not self.path.is_file():
            raise UserError(f"{self.path} is not a file; the run writes its phase metrics there: move it away")
        done = done_before_resume(task)
        text = self.path.read_text(encoding="utf-8", errors="replace")
        records = read_metrics(self.path)
        readable = [r for r in records if _phase_idx_readable(r)]
        kept = [r for r in readable if done(r)]
        partial = bool(text) and not text.endswith("\n")
        unreadable = text.count("\n") - len(readable)
        if unreadable > 0:  # damaged whole lines (a half last line is a kill's, and expected): kept aside
            aside = free_name(self.path.with_name(self.path.name + ".unreadable"))
            atomic_write_text(aside, text)
            log.warning("%s: %d line(s) are not phase records and are left out; the file as it was is kept as %s",
                        self.path, unreadable, aside.name)
        if len(kept) != len(records) or partial or len(records) != text.count("\n"):
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._warn_lost_lines(task, kept)

    def _warn_lost_lines(self, task: Any, kept: List[Dict[str, Any]]) -> None:
        """A resumed run does not run the train phases its checkpoint covers again: when their
        lines are missing (metrics.json emptied, replaced or deleted since), say so, once."""
        point = getattr(task, "resume_point", None)
        if point is None or getattr(task, "resumed_from_vissl", False):  # VISSL's own folder: its lines are its own
            return
        here, complete = (int(point[0]), 0 if point[1] else 1), bool(point[2])
        have = {pos for pos in map(record_position, kept) if pos is not None}
        missing, train_phase_idx = [], -1
        for phase in getattr(task, "phases", []):  # the phases before the checkpoint's position, and its own if done
            train_phase_idx += 1 if phase["train"] else 0
            pos = (train_phase_idx, 0 if phase["train"] else 1)
            if (pos < here or (pos == here and complete)) and pos not in have:
                missing.append(f"train phase {pos[0]}" if pos[1] == 0 else f"the test phase after train phase {pos[0]}")
        if missing:
            log.warning("%s has no line for %s, which the checkpoint covers (the file was emptied, replaced, cut or "
                        "deleted since): those phases are not run again, so their lines stay missing",
                        self.path, first_few(missing, quote=False))

    @property
    def synced_by_checkpoints(self) -> List[Path]:
        """metrics.json: each checkpoint syncs it before itself, so the lines of the phases a
        checkpoint covers survive whatever the checkpoint survives (one sync per checkpoint, off
        the training thread with CHECKPOINT.ASYNC_WRITE, instead of one per phase on it)."""
        return [self.path]

    def on_end(self, task: Any) -> None:
        if du.is_primary():
            sync_files([self.path])  # the lines of phases after the last checkpoint

    def on_phase_start(self, task: Any) -> None:
        if not task.phase_resumed:
            self.state.loss_sum, self.state.count = 0.0, 0
        self._losses.clear()

    def on_loss_and_meter(self, task: Any) -> None:
        # each batch's loss weighted by its real (not padded) samples; a batch that does not
        # say how many counts once
        n = getattr(task, "last_num_samples", None)
        self._losses.add(task.last_loss, 1 if n is None else n)

    def get_classy_state(self) -> Dict[str, Any]:
        self._fold()
        return {"loss_sum": float(self.state.loss_sum), "count": int(self.state.count)}

    def set_classy_state(self, state: Dict[str, Any]) -> None:
        self.state.loss_sum, self.state.count = float(state["loss_sum"]), int(state["count"])

    def _fold(self) -> None:
        if len(self._losses) or self._losses.weight:
            self.state.loss_sum += self._losses.total()
            self.state.count += int(self._losses.weight)
            self._losses.clear()

    def on_phase_end(self, task: Any) -> None:
        self._fold()
        total = torch.tensor([self.state.loss_sum, float(self.state.count)], dtype=torch.float64)
        if du.get_world_size() > 1:
            torch.distributed.all_reduce(total)
        mean_loss = float(total[0] / max(1.0, float(total[1])))
        pt = task.phase_type
        record: Dict[str, Any] = {
            "iteration": task.iteration,
            "phase_idx": task.phase_idx,
            "train_phase_idx": task.train_phase_idx,
            f"{pt}_loss": mean_loss,
        }
        meters = getattr(task, "phase_meters", task.meters)  # no train values without the training meter
        values: Dict[str, Any] = {m.name: m.value for m in meters}
        for hook in task.hooks:  # e.g. the EMA model's meters, the perf stats breakdown
            extra = getattr(hook, "phase_metrics", None)
            if extra is not None and hook is not self:
                values.update(extra(task) or {})
        for name, value in values.items():
            record[f"{pt}_{name}"] = value
        self.last_record = record  # the same on every rank (meters are synced, the loss reduced)
        if not du.is_primary():
            return
        log.info("%s phase %d done: loss %.5f%s", pt, task.phase_idx, mean_loss,
                 "".join(f" | {k} {json.dumps(v)}" for k, v in values.items()))
        append_line(self.path, json.dumps(record) + "\n")
        for w in self.writers:
            w.write_phase(record)
