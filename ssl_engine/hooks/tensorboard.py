"""TensorBoard output (HOOKS.TENSORBOARD_SETUP): a Writer for the PeriodicWriterHook and the
MetricsHook, and a hook that writes parameter / gradient histograms every N iterations.

Events go to ``CHECKPOINT.DIR/tb_logs`` (or ``LOG_DIR/EXPERIMENT_LOG_DIR/tb_logs`` when
``LOG_DIR`` is set). Only rank 0 writes. Scalars, at the global iteration as step:

- ``Training/{loss, avg_loss, lr, data_time, batch_time, samples_per_sec, peak_mem_mb}``
  every LOG_FREQUENCY iterations (``Testing/...`` for test phases when those are logged);
- ``Phase/{train|test}_{meter}/...`` and ``Phase/{train|test}_loss`` at each phase end.
"""

import contextlib
import logging
from pathlib import Path
from typing import Any, Dict, Iterator

from ssl_engine import distributed as du
from ssl_engine.hooks.base import Priority, SSLHook
from ssl_engine.hooks.metrics_hook import flatten_metrics
from ssl_engine.hooks.periodic_writer import Writer
from ssl_engine.registry import HOOKS

log = logging.getLogger(__name__)

_ITER_SCALARS = ("loss", "avg_loss", "lr", "data_time", "batch_time", "samples_per_sec", "peak_mem_mb")
_RECORD_COUNTERS = ("iteration", "phase_idx", "train_phase_idx")


def events_in_checkpoint_dir(cfg: Any) -> bool:
    """Whether TENSORBOARD_SETUP.LOG_DIR leaves the events to CHECKPOINT.DIR ('' or '.')."""
    return str(cfg.HOOKS.TENSORBOARD_SETUP.LOG_DIR) in ("", ".")


def tensorboard_dir(cfg: Any) -> Path:
    """Where the events of a run go (see the module docstring)."""
    tb = cfg.HOOKS.TENSORBOARD_SETUP
    if events_in_checkpoint_dir(cfg):
        return Path(cfg.CHECKPOINT.DIR) / "tb_logs"
    return Path(str(tb.LOG_DIR)).expanduser() / str(tb.EXPERIMENT_LOG_DIR) / "tb_logs"


def _quiet_event_writer_threads() -> None:
    """TensorBoard's event writer thread that stops on an OSError (a full disk) printed the error's
    traceback on stderr; the SummaryWriter raises the same error at its next call on the training
    thread, which reports it in one line (see TensorboardWriter). Leave that echo out."""
    import threading

    from tensorboard.summary.writer import event_file_writer

    previous = threading.excepthook
    if getattr(previous, "_ssl_engine", False):
        return

    def hook(args: Any) -> None:
        if isinstance(args.thread, event_file_writer._AsyncWriterThread) and isinstance(args.exc_value, OSError):
            return
        previous(args)

    hook._ssl_engine = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class TensorboardWriter(Writer):
    """Scalars into one SummaryWriter, created on the first write (rank 0 only writes)."""

    def __init__(self, log_dir: Path, flush_secs: int = 300) -> None:
        self.log_dir = Path(log_dir)
        self.flush_secs = int(flush_secs)
        self._writer: Any = None
        self._purge_step: Any = None

    def rewind(self, logged_before: Any, iteration: int = 0) -> None:
        """A resumed run (or a rerun in a folder with events): the events a killed run wrote
        past the checkpoint's iteration are hidden (SummaryWriter's purge_step), so the redone
        train iterations show once instead of twice. Test-phase events carry the step of the
        train iteration before them, the checkpoint's own step when it was written at the end
        of a train phase: a test phase redone after such a resume shows twice at that step
        (purging that step would also hide the train events the checkpoint holds)."""
        if any(self.log_dir.glob("events.out.tfevents.*")):
            self._purge_step = int(iteration) + 1

    @property
    def summary_writer(self) -> Any:
        """The torch SummaryWriter (opened, or reopened after close, on first use)."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            _quiet_event_writer_threads()
            self.log_dir.mkdir(parents=True, exist_ok=True)
            with self._naming_the_folder():
                self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=self.flush_secs,
                                             purge_step=self._purge_step)
            self._purge_step = None  # once: a later reopen (after close) appends
        return self._writer

    @contextlib.contextmanager
    def _naming_the_folder(self) -> Iterator[None]:
        """An OSError of the SummaryWriter (its writer thread's, a full disk) names no file: with
        the events folder, it is the run's one line of a file-system error, not a traceback."""
        try:
            yield
        except OSError as e:
            if e.filename:
                raise
            raise OSError(e.errno, e.strerror, str(self.log_dir)) from None

    def write(self, stats: Dict[str, Any]) -> None:
        with self._naming_the_folder():
            self._write(stats)

    def _write(self, stats: Dict[str, Any]) -> None:
        group = "Training" if stats.get("phase_type", "train") == "train" else "Testing"
        step = int(stats["iteration"])
        w = self.summary_writer
        for key in _ITER_SCALARS:
            if key in stats:
                w.add_scalar(f"{group}/{key}", float(stats[key]), global_step=step)

    def write_phase(self, record: Dict[str, Any]) -> None:
        with self._naming_the_folder():
            self._write_phase(record)

    def _write_phase(self, record: Dict[str, Any]) -> None:
        step = int(record.get("iteration", 0))
        w = self.summary_writer
        values = {k: v for k, v in record.items() if k not in _RECORD_COUNTERS}
        for key, value in flatten_metrics(values).items():
            w.add_scalar(f"Phase/{key}", value, global_step=step)
        w.flush()

    def close(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            with self._naming_the_folder():
                writer.close()


@HOOKS.register("TensorboardParamsHook")
class TensorboardParamsHook(SSLHook):
    """Histograms of the weights (LOG_PARAMS) and of their gradients (LOG_PARAMS_GRADIENTS)
    at the first train iteration and every LOG_PARAMS_EVERY_N_ITERS iterations."""

    priority = Priority.LOW

    def __init__(self, writer: TensorboardWriter, every_n_iters: int = 310, params: bool = True,
                 gradients: bool = True) -> None:
        super().__init__()
        self.writer = writer
        self.every_n_iters = max(1, int(every_n_iters))
        self.params = params
        self.gradients = gradients

    def _due(self, task: Any) -> bool:
        return task.train and du.is_primary() and task.iteration % self.every_n_iters == 0

    def on_backward(self, task: Any) -> None:
        # gradients exist only between backward and the optimizer's zero_grad
        if self.gradients and self._due(task):
            w = self.writer.summary_writer
            with self.writer._naming_the_folder():
                for name, p in task.base_model.named_parameters():
                    if p.grad is not None:
                        w.add_histogram(f"Gradients/{name}", p.grad.detach().float().cpu(), global_step=task.iteration)

    def on_step(self, task: Any) -> None:
        # task.iteration already counts this step: step s = iteration - 1, the weights after its update
        step = task.iteration - 1
        if self.params and task.train and du.is_primary() and step % self.every_n_iters == 0:
            w = self.writer.summary_writer
            with self.writer._naming_the_folder():
                for name, p in task.base_model.named_parameters():
                    w.add_histogram(f"Parameters/{name}", p.detach().float().cpu(), global_step=step)


def read_scalars(log_dir: Path) -> Dict[str, list]:
    """{tag: [(step, value), ...]} of the events under ``log_dir`` (for tests and tools), read
    per folder as TensorBoard reads a run: its files in order, a later file's purge_step hiding
    the earlier files' events from that step on."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: Dict[str, list] = {}
    for folder in sorted({p.parent for p in Path(log_dir).rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out



def find_tensorboard_writer(task: Any) -> Any:
    """The TensorboardWriter of a run, if one of its hooks writes through one (else None)."""
    for hook in getattr(task, "hooks", []):
        for w in getattr(hook, "writers", []) or []:
            if isinstance(w, TensorboardWriter):
                return w
    return None
