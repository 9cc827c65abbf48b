"""MetricsHook: at each phase end, log every meter value and the phase's mean loss, and
write them as one line of CHECKPOINT.DIR/metrics.json (VISSL's format)."""

import json
import logging
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from ssl_engine import distributed as du
from ssl_engine.checkpoint import atomic_write_text
from ssl_engine.hooks.base import Priority, SSLHook
from ssl_engine.registry import HOOKS

log = logging.getLogger(__name__)


def read_metrics(path: Path) -> list:
    """The json lines of a metrics.json (a partial last line is ignored)."""
    out = []
    if Path(path).exists():
        for line in Path(path).read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


@HOOKS.register("MetricsHook")
class MetricsHook(SSLHook):
    """Per-phase meter values: log line plus metrics.json, rewritten atomically."""

    priority = Priority.BELOW_NORMAL

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.path = Path(folder) / "metrics.json"
        self._loss_sum: Optional[torch.Tensor] = None
        self._count = 0
        self.state.loss_sum = 0.0
        self.state.count = 0

    def on_phase_start(self, task: Any) -> None:
        if not task.phase_resumed:
            self.state.loss_sum, self.state.count = 0.0, 0
        self._loss_sum, self._count = None, 0

    def on_loss_and_meter(self, task: Any) -> None:
        loss = task.last_loss.float()
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        self._count += 1

    def get_classy_state(self) -> Dict[str, Any]:
        self._fold()
        return {"loss_sum": float(self.state.loss_sum), "count": int(self.state.count)}

    def set_classy_state(self, state: Dict[str, Any]) -> None:
        self.state.loss_sum, self.state.count = float(state["loss_sum"]), int(state["count"])

    def _fold(self) -> None:
        if self._loss_sum is not None:
            self.state.loss_sum += float(self._loss_sum.item())
            self.state.count += self._count
            self._loss_sum, self._count = None, 0

    def on_phase_end(self, task: Any) -> None:
        self._fold()
        total = torch.tensor([self.state.loss_sum, float(self.state.count)], dtype=torch.float64)
        if du.get_world_size() > 1:
            torch.distributed.all_reduce(total)
        mean_loss = float(total[0] / max(1.0, float(total[1])))
        if not du.is_primary():
            return
        pt = task.phase_type
        record: Dict[str, Any] = {
            "iteration": task.iteration,
            "phase_idx": task.phase_idx,
            "train_phase_idx": task.train_phase_idx,
            f"{pt}_loss": mean_loss,
        }
        for meter in task.meters:
            record[f"{pt}_{meter.name}"] = meter.value
        log.info("%s phase %d done: loss %.5f%s", pt, task.phase_idx, mean_loss,
                 "".join(f" | {m.name} {json.dumps(m.value)}" for m in task.meters))
        lines = [r for r in read_metrics(self.path) if r.get("phase_idx") != task.phase_idx]
        lines.append(record)
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in lines))
