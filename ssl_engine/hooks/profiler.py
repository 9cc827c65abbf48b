"""TorchProfilerHook (PROFILING.*): torch.profiler over a window of training iterations.

The window starts at train iteration PROFILING.START_ITERATION, records
WARMUP_ITERATIONS iterations without keeping them, then NUM_ITERATIONS iterations. Each
rank listed in PROFILED_RANKS writes, under ``CHECKPOINT.DIR/<OUTPUT_FOLDER>/profiling/``:

- ``chrome_trace_rank{R}.json``  (open in chrome://tracing or https://ui.perfetto.dev)
- ``tb/rank{R}.<time>.pt.trace.json``  (the same trace where TensorBoard's profiler plugin looks for it:
  ``tensorboard --logdir .../profiling/tb``)
- ``summary_rank{R}.txt``         (operator table, top 40 by self time)

RUNTIME_PROFILING.PROFILE_CPU / PROFILE_GPU pick the activities (GPU only where CUDA is
used); MEMORY_PROFILING.TRACK_BY_LAYER_MEMORY also records tensor allocations and shapes.
With STOP_TRAINING_AFTER_PROFILING the hook sets ``task.stop_requested`` once the window is
written.
"""

import logging
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from ssl_engine import distributed as du
from ssl_engine.hooks.base import Priority, SSLHook
from ssl_engine.registry import HOOKS

log = logging.getLogger(__name__)


def profiling_folder(cfg: Any) -> Path:
    """CHECKPOINT.DIR/<PROFILING.OUTPUT_FOLDER>/profiling (an absolute OUTPUT_FOLDER replaces CHECKPOINT.DIR)."""
    return Path(cfg.CHECKPOINT.DIR) / str(cfg.PROFILING.OUTPUT_FOLDER) / "profiling"


@HOOKS.register("TorchProfilerHook")
class TorchProfilerHook(SSLHook):
    """Profiles train iterations [start, start + warmup + num) on the profiled ranks."""

    priority = Priority.VERY_HIGH

    def __init__(
        self,
        folder: str,
        start_iteration: int = 0,
        warmup_iterations: int = 0,
        num_iterations: int = 10,
        ranks: Optional[List[int]] = None,
        profile_cpu: bool = True,
        profile_gpu: bool = True,
        profile_memory: bool = False,
        stop_after: bool = False,
    ) -> None:
        super().__init__()
        self.folder = Path(folder)
        self.start_iteration = max(0, int(start_iteration))
        self.warmup_iterations = max(0, int(warmup_iterations))
        self.num_iterations = max(1, int(num_iterations))
        self.ranks = None if ranks is None else [int(r) for r in ranks]
        self.profile_cpu = profile_cpu
        self.profile_gpu = profile_gpu
        self.profile_memory = profile_memory
        self.stop_after = stop_after
        self.profiler: Any = None
        self.done = False
        self._task: Any = None

    def on_start(self, task: Any) -> None:
        rank = du.get_rank()
        if self.ranks is not None and rank not in self.ranks:
            return
        end = self.start_iteration + self.warmup_iterations + self.num_iterations
        if task.iteration >= end:
            return  # the window was profiled before this run resumed
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = []
        if self.profile_cpu:
            activities.append(ProfilerActivity.CPU)
        if self.profile_gpu and task.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        if not activities:
            log.warning("PROFILING: neither PROFILE_CPU nor (on GPU) PROFILE_GPU is set; nothing to profile")
            return
        skip = max(0, self.start_iteration - task.iteration)
        warmup = max(0, self.warmup_iterations - max(0, task.iteration - self.start_iteration))
        self._task = task
        with warnings.catch_warnings():  # torch warns that a 0 warm-up may skew results: the user chose it
            warnings.simplefilter("ignore")
            when = schedule(skip_first=skip, wait=0, warmup=warmup, active=self.num_iterations, repeat=1)
        self.profiler = profile(
            activities=activities,
            schedule=when,
            on_trace_ready=self._write,
            record_shapes=self.profile_memory,
            profile_memory=self.profile_memory,
        )
        self.profiler.start()
        log.info("profiling train iterations %d-%d on rank %d into %s", task.iteration + skip + warmup,
                 task.iteration + skip + warmup + self.num_iterations - 1, rank, self.folder)

    def on_step(self, task: Any) -> None:
        if self.profiler is not None and task.train:
            self.profiler.step()
            if self.done:
                self._stop()  # the window is written: no profiler overhead from here on

    def _write(self, prof: Any) -> None:
        rank = du.get_rank()
        self.folder.mkdir(parents=True, exist_ok=True)
        chrome = self.folder / f"chrome_trace_rank{rank}.json"
        prof.export_chrome_trace(str(chrome))  # a trace can be exported only once: copy it for TensorBoard
        (self.folder / "tb").mkdir(exist_ok=True)
        shutil.copyfile(chrome, self.folder / "tb" / f"rank{rank}.{time.time_ns()}.pt.trace.json")
        sort = "self_cuda_time_total" if self.profile_gpu and torch.cuda.is_available() else "self_cpu_time_total"
        try:
            table = prof.key_averages().table(sort_by=sort, row_limit=40)
        except Exception:  # noqa: BLE001 - an unknown sort key on some builds
            table = prof.key_averages().table(row_limit=40)
        (self.folder / f"summary_rank{rank}.txt").write_text(table)
        self.done = True
        log.info("profiler traces written to %s", self.folder)
        if self.stop_after and self._task is not None:
            self._task.stop_requested = True
            log.info("PROFILING.STOP_TRAINING_AFTER_PROFILING: asking the trainer to stop")

    def _stop(self) -> None:
        if self.profiler is not None:
            prof, self.profiler = self.profiler, None
            prof.stop()

    def on_end(self, task: Any) -> None:
        self._stop()

    def on_exception(self, task: Any) -> None:
        self._stop()

    def get_classy_state(self) -> Dict[str, Any]:
        return {}

    def set_classy_state(self, state: Dict[str, Any]) -> None:
        pass
