"""EvalHook: run a user evaluation function every N iterations and/or every N train phases,
and once at the end of training, recording the flat metrics it returns.

The function takes the task and returns a dict of numbers (nested dicts are flattened with
"/"). It runs on every rank (so it may use collectives); rank 0 logs the metrics, keeps them
in CHECKPOINT.DIR/eval_metrics.json (one json line per evaluation, rewritten atomically)
and, when the run writes TensorBoard events, as scalars ``Eval/<metric>``. The history is
hook state, so a resumed run keeps it. From yaml::

    HOOKS:
      CUSTOM: [{name: EvalHook, params: {eval_function: "my_pkg.evals:knn", every_n_phases: 1}}]
"""

import json
import logging
from pathlib import Path
from typing import Any, Callable, Dict, List, Union

from ssl_engine import distributed as du
from ssl_engine.checkpoint import atomic_write_text
from ssl_engine.hooks.base import Priority, SSLHook
from ssl_engine.hooks.callback_hook import resolve_callable
from ssl_engine.hooks.metrics_hook import flatten_metrics
from ssl_engine.registry import HOOKS

log = logging.getLogger(__name__)

FILE_NAME = "eval_metrics.json"


@HOOKS.register("EvalHook")
class EvalHook(SSLHook):
    """Calls ``eval_function(task)`` on its schedule and records the metrics it returns."""

    # before the CheckpointHook (VERY_LOW), so that the checkpoint holds the latest results
    priority = Priority.LOW

    def __init__(
        self,
        eval_function: Union[str, Callable[[Any], Dict[str, Any]]],
        every_n_iters: int = 0,
        every_n_phases: int = 0,
        at_end: bool = True,
    ) -> None:
        super().__init__()
        self.eval_function = resolve_callable(eval_function, "EvalHook eval_function")
        self.every_n_iters = int(every_n_iters)
        self.every_n_phases = int(every_n_phases)
        self.at_end = bool(at_end)
        self.state.history = []

    @property
    def history(self) -> List[Dict[str, Any]]:
        return self.state.history

    def on_step(self, task: Any) -> None:
        if task.train and self.every_n_iters > 0 and task.iteration % self.every_n_iters == 0:
            self.evaluate(task)

    def on_phase_end(self, task: Any) -> None:
        due = task.train and self.every_n_phases > 0 and (task.train_phase_idx + 1) % self.every_n_phases == 0
        if due or (self.at_end and task.done_training()):
            self.evaluate(task)

    def evaluate(self, task: Any) -> Dict[str, float]:
        """Run the function now (once per iteration) and record its metrics."""
        if self.history and self.history[-1]["iteration"] == task.iteration:
            return {k: v for k, v in self.history[-1].items() if k not in ("iteration", "phase_idx", "train_phase_idx")}
        model = task.base_model
        was_training = model.training
        try:
            result = self.eval_function(task)
        finally:
            model.train(was_training)
        if not isinstance(result, dict):
            raise TypeError(f"EvalHook: the eval function must return a dict of numbers, got {type(result).__name__}")
        metrics = flatten_metrics(result)
        entry = {"iteration": int(task.iteration), "phase_idx": int(task.phase_idx),
                 "train_phase_idx": int(task.train_phase_idx), **metrics}
        self.history.append(entry)
        if du.is_primary():
            self._record(task, entry, metrics)
        return metrics

    def _record(self, task: Any, entry: Dict[str, Any], metrics: Dict[str, float]) -> None:
        from ssl_engine.hooks.tensorboard import find_tensorboard_writer

        log.info("evaluation at iteration %d: %s", entry["iteration"],
                 ", ".join(f"{k} {v:.6g}" for k, v in metrics.items()) or "(no metrics)")
        path = Path(task.checkpoint_folder) / FILE_NAME
        atomic_write_text(path, "".join(json.dumps(e) + "\n" for e in self.history))
        tb = find_tensorboard_writer(task)
        if tb is not None:
            for k, v in metrics.items():
                tb.summary_writer.add_scalar(f"Eval/{k}", v, global_step=entry["iteration"])

    def get_classy_state(self) -> Dict[str, Any]:
        return {"history": [dict(e) for e in self.history]}

    def set_classy_state(self, state: Dict[str, Any]) -> None:
        self.state.history = [dict(e) for e in state.get("history", [])]
