"""Non-finite values: the diagnosis the train step's loss check (HOOKS.CHECK_NAN) prints, and
NaNCheckHook, an opt-in per-step check of every model output.

When the loss is NaN/inf, ``diagnose`` names the output tensors and input tensors that hold
NaN/inf, so the message says whether the data brought it in. The run stops with
NonFiniteLossError before anything of that step is checkpointed, so the last good checkpoint
stays the newest one.
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


def diagnose(output: Any, batch: Any) -> str:
    """Which model outputs and input tensors hold NaN/inf, for the message that stops the run.

    Runs only once something was found non-finite, so it may read every tensor back.
    """
    bad = [describe(n, t) for n, t in named_tensors(output, "model output") if not bool(torch.isfinite(t.detach()).all())]
    inputs = named_tensors(batch.get("data"), "input data") if isinstance(batch, dict) else []
    bad_inputs = [describe(n, t) for n, t in inputs if not bool(torch.isfinite(t.detach()).all())]
    parts = bad_inputs + (bad or ["the model output is finite (the loss computation produced it)"])
    if inputs and not bad_inputs:
        parts.append("the input data is finite")
    labels = _integer_tensors(batch.get("label")) if isinstance(batch, dict) else []
    if not bad and labels and all(t.numel() and bool((t < 0).all()) for t in labels):
        values = sorted({int(v) for t in labels for v in t.flatten().tolist()})
        parts.append(f"every label of the batch is negative ({', '.join(map(str, values))}), the label a loss ignores "
                     f"(ignore_index): its mean over no counted sample is NaN; label these samples, or leave them out "
                     f"of the data")
    return "; ".join(parts)


def _integer_tensors(x: Any) -> List[torch.Tensor]:
    """The integer tensors of a (nested) list/tuple (a batch's labels, one per label source)."""
    if isinstance(x, torch.Tensor):
        return [x.detach()] if not x.is_floating_point() and not x.is_complex() else []
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _integer_tensors(v)]
    return []


@HOOKS.register("NaNCheckHook")
class NaNCheckHook(SSLHook):
    """Raises NonFiniteLossError at on_forward if a model output has non-finite values.

    Not in the default hooks: with HOOKS.CHECK_NAN the train step already stops on a
    non-finite loss and then names the bad outputs and inputs. Add this hook (HOOKS.CUSTOM)
    to also catch non-finite outputs that do not reach the loss (e.g. masked rows), at the
    cost of one device sync per step.
    """

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
        batch = task.last_batch if self.check_inputs else None
        raise NonFiniteLossError(
            f"non-finite values at iteration {task.iteration} (phase {task.phase_idx}, {task.phase_type}, "
            f"local iteration {task.local_iteration_num}): {diagnose(task.last_model_output, batch)}; "
            f"stopping without writing a checkpoint of this state"
        )

    def get_classy_state(self) -> Dict[str, Any]:
        return {}

    def set_classy_state(self, state: Dict[str, Any]) -> None:
        pass
