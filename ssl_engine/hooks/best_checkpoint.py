"""BestCheckpointer (HOOKS.BEST_CHECKPOINT): keep CHECKPOINT.DIR/model_best.torch for the phase
with the best value of one metric.

The metric is a key of the phase record in metrics.json, flattened with "/" (or "."):
``test_loss``, ``test_accuracy_list_meter/top_1/0``, ``train_accuracy_list_meter.top_1.0``;
a prefix with a single leaf under it (``test_accuracy_list_meter/top_1``) also works.
Its ``train_``/``test_`` prefix says which phases are compared. NaN and inf values are
ignored. The file is a full checkpoint (VISSL's keys, loadable as MODEL.WEIGHTS_INIT) plus
``best_metric: {name, value, mode, iteration, phase_idx, train_phase_idx}``, written
atomically by rank 0. It is never the target of checkpoint.torch, so it does not change what
a run resumes from; the best value so far is hook state and survives a resume.

The file is written on the training thread, after the background write in flight (see
CHECKPOINT.ASYNC_WRITE) has finished, so that it is on disk when the hook returns and the two
writes never overlap.
"""

import logging
import math
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from ssl_engine import distributed as du
from ssl_engine.checkpoint import atomic_write, wait_for_checkpoint_writes
from ssl_engine.errors import UserError, did_you_mean
from ssl_engine.hooks.base import Priority, SSLHook
from ssl_engine.hooks.checkpoint_hook import build_checkpoint
from ssl_engine.hooks.metrics_hook import MetricsHook, flatten_metrics
from ssl_engine.registry import HOOKS

log = logging.getLogger(__name__)

BEST_CHECKPOINT_NAME = "model_best.torch"
KEY = "config.HOOKS.BEST_CHECKPOINT"


def find_metric(record: Dict[str, Any], name: str) -> Optional[float]:
    """The value of ``name`` in a phase record (see the module docstring), None if absent."""
    flat = flatten_metrics(record)
    for key in (name, name.replace(".", "/")):
        if key in flat:
            return flat[key]
    prefix = name.replace(".", "/").rstrip("/") + "/"
    under = [v for k, v in flat.items() if k.startswith(prefix)]
    return under[0] if len(under) == 1 else None


def check_metric_before_launch(cfg: Any, meters: Any, splits: Any) -> None:
    """HOOKS.BEST_CHECKPOINT.METRIC checked against what the phases will record, so that a typo
    stops the run before its first phase, not after it: a test_ metric needs test phases, and a
    metric under a configured meter's name must be one of that meter's values (a train_ one also
    needs METERS.enable_training_meter). Metrics other hooks add (EMA meters, ...) are left to
    the run."""
    metric = str(cfg.HOOKS.BEST_CHECKPOINT.METRIC or "")
    phase_type = metric.split("_", 1)[0]
    if phase_type not in ("train", "test"):
        return  # the hook's own check says what a name must look like
    if phase_type.upper() not in splits:  # the splits the phases use (TEST_MODEL, TEST_ONLY, TEST data)
        other = "train_" if phase_type == "test" else "test_"
        flags = ", ".join(f"config.{k}={str(bool(cfg[k])).lower()}" for k in ("TEST_MODEL", "TEST_ONLY"))
        raise UserError(f"{KEY}.METRIC={metric!r} is a {phase_type} metric, but this run has no {phase_type} phase "
                        f"({flags}) to record it; name a {other} metric, or give the run {phase_type} phases")
    slashed = metric.replace(".", "/")
    for meter in meters or []:
        prefix = f"{phase_type}_{meter.name}"
        if slashed != prefix and not slashed.startswith(prefix + "/"):
            continue
        if phase_type == "train" and not cfg.METERS.enable_training_meter:
            raise UserError(f"{KEY}.METRIC={metric!r} needs the meter in train phases: set "
                            f"config.METERS.enable_training_meter=true, or name a test_ metric")
        try:
            record = {prefix: meter.value}
        except Exception:  # noqa: BLE001 - a meter that cannot give a value before any update: the run checks
            return
        if find_metric(record, metric) is None:
            keys = list(flatten_metrics(record))
            raise UserError(f"{KEY}.METRIC={metric!r} is not a value of the meter config.METERS.{meter.name}"
                            f"{did_you_mean(metric, keys)}; its values: {', '.join(keys)}")


@HOOKS.register("BestCheckpointer")
class BestCheckpointer(SSLHook):
    """Writes model_best.torch when the phase's metric beats the best so far."""

    # after the MetricsHook (which builds the phase record) and before the CheckpointHook
    # (VERY_LOW), so that the phase checkpoint holds the updated best value
    priority = Priority.VERY_LOW - 5

    def __init__(self, metric: str, mode: str = "max", file_name: str = BEST_CHECKPOINT_NAME) -> None:
        super().__init__()
        if mode not in ("max", "min"):
            raise UserError(f"{KEY}.MODE={mode!r} is not valid: use max or min")
        phase_type = str(metric).split("_", 1)[0]
        if phase_type not in ("train", "test") or "_" not in str(metric):
            raise UserError(
                f"{KEY}.METRIC={metric!r} must name a metrics.json key starting with train_ or test_ "
                f"(e.g. test_accuracy_list_meter/top_1/0 or test_loss)"
            )
        self.metric = str(metric)
        self.mode = mode
        self.phase_type = phase_type
        self.file_name = file_name
        self.state.best_value = None
        self.state.best_iteration = -1
        self.state.best_phase_idx = -1

    def _record(self, task: Any) -> Dict[str, Any]:
        hook = next((h for h in task.hooks if isinstance(h, MetricsHook)), None)
        if hook is None:
            raise RuntimeError("BestCheckpointer reads the phase record of the MetricsHook, which is not installed")
        if hook.last_record.get("phase_idx") != task.phase_idx:
            raise RuntimeError("BestCheckpointer must run after the MetricsHook at on_phase_end (check the priorities)")
        return hook.last_record

    def is_better(self, value: float) -> bool:
        best = self.state.best_value
        if best is None:
            return True
        return value > best if self.mode == "max" else value < best

    def on_phase_end(self, task: Any) -> None:
        if task.phase_type != self.phase_type:
            return
        record = self._record(task)
        value = find_metric(record, self.metric)
        if value is None:
            keys = [k for k in flatten_metrics(record) if k.startswith(self.phase_type)]
            raise UserError(
                f"{KEY}.METRIC={self.metric!r} is not in the {self.phase_type} phase's metrics"
                f"{did_you_mean(self.metric, keys)}; available: {', '.join(keys)}"
            )
        if not math.isfinite(value):
            if du.is_primary():
                log.warning("BestCheckpointer: %s is %s at iteration %d; ignored", self.metric, value, task.iteration)
            return
        if not self.is_better(value):
            return
        previous = self.state.best_value
        self.state.best_value = float(value)
        self.state.best_iteration = int(task.iteration)
        self.state.best_phase_idx = int(task.phase_idx)
        self._write(task, previous)

    def _write(self, task: Any, previous: Optional[float]) -> None:
        ckpt = build_checkpoint(task, "best")  # every rank takes part (RNG states are gathered)
        ckpt["best_metric"] = {
            "name": self.metric,
            "value": float(self.state.best_value),
            "mode": self.mode,
            "iteration": int(task.iteration),
            "phase_idx": int(task.phase_idx),
            "train_phase_idx": int(task.train_phase_idx),
        }
        if du.is_primary():
            path = Path(task.checkpoint_folder) / self.file_name
            path.parent.mkdir(parents=True, exist_ok=True)
            wait_for_checkpoint_writes()  # one writer at a time; raises the error of a failed one
            atomic_write(path, lambda f: torch.save(ckpt, f))
            log.info("new best %s = %.6g at iteration %d (was %s): saved %s", self.metric, self.state.best_value,
                     task.iteration, "none" if previous is None else f"{previous:.6g}", path)
        du.barrier()

    def get_classy_state(self) -> Dict[str, Any]:
        return {
            "metric": self.metric,
            "mode": self.mode,
            "best_value": self.state.best_value,
            "best_iteration": int(self.state.best_iteration),
            "best_phase_idx": int(self.state.best_phase_idx),
        }

    def set_classy_state(self, state: Dict[str, Any]) -> None:
        if state.get("metric") != self.metric or state.get("mode") != self.mode:
            log.warning("BestCheckpointer: the checkpoint tracked %s (%s); now %s (%s): starting afresh",
                        state.get("metric"), state.get("mode"), self.metric, self.mode)
            return
        self.state.best_value = state["best_value"]
        self.state.best_iteration = int(state["best_iteration"])
        self.state.best_phase_idx = int(state["best_phase_idx"])
