"""NaNCheckHook (HOOKS.CHECK_NAN): stop the run when a model output holds a NaN or inf, naming
the tensor (and any bad input tensor), the iteration and the phase.

The train step already checks the loss (standard_train_step.check_finite_loss); this hook
checks what the loss is computed from, right after the forward pass: each output tensor is
reduced to one flag on the device and the flags are read once (one sync per step on GPU, next
to the loss check's). Only when an output is bad are the input tensors checked too, so the
message says whether the data brought the NaN in. The run
stops with NonFiniteLossError before anything of this step is checkpointed, so the last
good checkpoint stays the newest one.
"""

from typing import Any, Dict, List, Tuple

import torch

from ssl_engine.errors import NonFiniteLossError
from ssl_engine.hooks.base import Priority, SSLHook
from ssl_engine.registry import HOOKS


def named_tensors(x: Any, name: str) -> List[Tuple[str, torch.Tensor]]:
    """The floating-point tensors of a (nested) list/tuple/dict, with readable names."""
    if isinstance(x, torch.Tensor):
        return [(name, x)] if x.is_floating_point() else []
    if isinstance(x, (list, tuple)):
        if len(x) == 1:
            return named_tensors(x[0], name)
        return [t for i, v in enumerate(x) for t in named_tensors(v, f"{name}[{i}]")]
    if isinstance(x, dict):
        return [t for k, v in x.items() for t in named_tensors(v, f"{name}[{k!r}]")]
    return []


def describe(name: str, t: torch.Tensor) -> str:
    """'model output (shape [8, 10]): 3 NaN, 0 inf'."""
    t = t.detach()
    nan = int(torch.isnan(t).sum())
    inf = int(torch.isinf(t).sum())
    return f"{name} (shape {list(t.shape)}): {nan} NaN, {inf} inf of {t.numel()} values"


@HOOKS.register("NaNCheckHook")
class NaNCheckHook(SSLHook):
    """Raises NonFiniteLossError at on_forward if a model output has non-finite values."""

    priority = Priority.VERY_HIGH  # before any other hook looks at the outputs

    def __init__(self, check_inputs: bool = True) -> None:
        super().__init__()
        self.check_inputs = bool(check_inputs)

    def on_forward(self, task: Any) -> None:
        tensors = named_tensors(task.last_model_output, "model output")
        if not tensors:
            return
        flags = torch.stack([torch.isfinite(t.detach()).all() for _, t in tensors])
        if bool(flags.all()):  # the one sync of this check
            return
        bad = [describe(n, t) for (n, t), ok in zip(tensors, flags.tolist()) if not ok]
        if self.check_inputs and isinstance(task.last_batch, dict):  # only now: did the data bring it in?
            inputs = named_tensors(task.last_batch.get("data"), "input data")
            bad_inputs = [describe(n, t) for n, t in inputs if not bool(torch.isfinite(t).all())]
            bad = bad_inputs + bad if bad_inputs else bad + ["the input data is finite"]
        raise NonFiniteLossError(
            f"non-finite values at iteration {task.iteration} (phase {task.phase_idx}, {task.phase_type}, "
            f"local iteration {task.local_iteration_num}): {'; '.join(bad)}; "
            f"stopping without writing a checkpoint of this state"
        )

    def get_classy_state(self) -> Dict[str, Any]:
        return {}

    def set_classy_state(self, state: Dict[str, Any]) -> None:
        pass
