"""ParamGroupsHook (HOOKS.LOG_PARAM_GROUPS): the lr, weight decay and momentum of every
optimizer param group at every training iteration.

Values are read from the optimizer after its step (python floats: no device sync), kept in
memory and flushed every ``flush_every`` iterations and at phase ends to
CHECKPOINT.DIR/param_groups.json (one json line per iteration:
``{"iteration": i, "train_phase_idx": p, "groups": [{"lr": ..., "weight_decay": ...}, ...]}``)
and, when the run writes TensorBoard events, to scalars ``ParamGroups/{group}/{key}``. Every
checkpoint flushes them first (and syncs the file before itself), so the lines of the iterations
a checkpoint covers survive a kill after it; a resumed run first drops the lines of iterations it
will run again.
"""

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

from ssl_engine import distributed as du
from ssl_engine.checkpoint import atomic_write_text
from ssl_engine.hooks.base import Priority, SSLHook
from ssl_engine.hooks.metrics_hook import append_line
from ssl_engine.registry import HOOKS

GROUP_KEYS = ("lr", "weight_decay", "momentum")
FILE_NAME = "param_groups.json"


def group_values(optimizer: Any) -> List[Dict[str, float]]:
    """The GROUP_KEYS of each param group (betas[0] stands for momentum in Adam-like optimizers)."""
    out = []
    for group in optimizer.param_groups:
        row = {k: float(group[k]) for k in GROUP_KEYS if isinstance(group.get(k), (int, float))}
        if "momentum" not in row and isinstance(group.get("betas"), (list, tuple)):
            row["momentum"] = float(group["betas"][0])
        out.append(row)
    return out


@HOOKS.register("ParamGroupsHook")
class ParamGroupsHook(SSLHook):
    """Per-iteration param group values to param_groups.json (and TensorBoard)."""

    priority = Priority.BELOW_NORMAL + 5  # flushes before the PeriodicWriterHook closes the TensorBoard writer

    def __init__(self, folder: Optional[str] = None, flush_every: int = 10) -> None:
        super().__init__()
        self.folder = folder  # default: the task's checkpoint folder
        self.flush_every = max(1, int(flush_every))
        self.tensorboard: Any = None  # the run's TensorboardWriter, found at start
        self.rows: List[Dict[str, Any]] = []
        self.path = Path(folder or ".") / FILE_NAME

    def on_start(self, task: Any) -> None:
        from ssl_engine.hooks.tensorboard import find_tensorboard_writer

        self.path = Path(self.folder or task.checkpoint_folder) / FILE_NAME
        self.tensorboard = find_tensorboard_writer(task)
        if du.is_primary() and self.path.exists():
            keep = []
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if row.get("iteration", -1) < task.iteration:
                    keep.append(line + "\n")
            atomic_write_text(self.path, "".join(keep))

    def on_update(self, task: Any) -> None:
        if not du.is_primary():
            return
        self.rows.append({
            "iteration": task.iteration,
            "train_phase_idx": task.train_phase_idx,
            "groups": group_values(task.optimizer),
        })
        if len(self.rows) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        # one write, undone when cut short; its OSError names the file (a full disk: the run's one line)
        append_line(self.path, "".join(json.dumps(r) + "\n" for r in self.rows))
        if self.tensorboard is not None:
            w = self.tensorboard.summary_writer
            for r in self.rows:
                for i, g in enumerate(r["groups"]):
                    for k, v in g.items():
                        w.add_scalar(f"ParamGroups/{i}/{k}", v, global_step=r["iteration"])
        self.rows = []

    def on_phase_end(self, task: Any) -> None:
        if du.is_primary():
            self.flush()

    def on_end(self, task: Any) -> None:
        if du.is_primary():
            self.flush()

    def on_exception(self, task: Any) -> None:
        if du.is_primary():
            self.flush()

    @property
    def synced_by_checkpoints(self) -> List[Path]:
        """param_groups.json: each checkpoint syncs it before itself (see get_classy_state)."""
        return [self.path]

    def get_classy_state(self) -> Dict[str, Any]:
        """No state; called while a checkpoint is built, it writes the rows kept in memory, which
        belong to iterations that checkpoint covers: a run killed after it resumes there and does
        not log those iterations again."""
        if du.is_primary():
            self.flush()
        return {}

    def set_classy_state(self, state: Dict[str, Any]) -> None:
        pass
