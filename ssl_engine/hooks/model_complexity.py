"""ModelComplexityHook (HOOKS.MODEL_COMPLEXITY): at start, fvcore's flop count of one forward
pass on a sample of HOOKS.MODEL_COMPLEXITY.INPUT_SHAPE, and the parameter counts.

fvcore counts one fused multiply-add as one flop (so "GFLOPs" here are GMACs, as in most
papers). The count runs on rank 0, on a copy-free eval-mode pass without gradients; the
model's mode is restored. A model that cannot be traced at that shape logs a warning naming
the key rather than stopping the run.
"""

import logging
from typing import Any, Dict, List, Optional

import torch

from ssl_engine import distributed as du
from ssl_engine.errors import UserError
from ssl_engine.hooks.base import Priority, SSLHook
from ssl_engine.registry import HOOKS

log = logging.getLogger(__name__)


def count_parameters(model: torch.nn.Module) -> Dict[str, int]:
    """Total and trainable parameter counts."""
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


@torch.no_grad()
def count_flops(model: torch.nn.Module, input_shape: List[int], device: torch.device) -> Dict[str, Any]:
    """fvcore's flop count of one sample of ``input_shape``: total and per top-level module."""
    from fvcore.nn import FlopCountAnalysis

    was_training = model.training
    model.eval()
    try:
        x = torch.zeros(1, *[int(s) for s in input_shape], device=device)
        analysis = FlopCountAnalysis(model, x)
        analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False).tracer_warnings("none")
        by_module = analysis.by_module()
        children = [n for n, _ in model.named_children()]
        return {
            "flops": int(analysis.total()),
            "flops_by_module": {n: int(by_module.get(n, 0)) for n in children},
            "unsupported_ops": dict(analysis.unsupported_ops()),
        }
    finally:
        model.train(was_training)


def _input_shape(value: Any) -> List[int]:
    """HOOKS.MODEL_COMPLEXITY.INPUT_SHAPE as a list of positive sizes (one sample, no batch dim)."""
    ok = isinstance(value, (list, tuple)) and len(value) > 0 and all(
        isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in value)
    if not ok:
        raise UserError(
            f"config.HOOKS.MODEL_COMPLEXITY.INPUT_SHAPE={value!r} must be a list of positive integers, the shape of "
            f"one sample without the batch dim, e.g. [3, 224, 224]"
        )
    return list(value)


@HOOKS.register("ModelComplexityHook")
class ModelComplexityHook(SSLHook):
    """Logs flops and parameter counts once, at start (rank 0)."""

    priority = Priority.HIGH

    def __init__(self, input_shape: List[int]) -> None:
        super().__init__()
        self.input_shape = _input_shape(input_shape)
        self.result: Optional[Dict[str, Any]] = None

    def on_start(self, task: Any) -> None:
        if not du.is_primary():
            return
        model = task.base_model
        result: Dict[str, Any] = count_parameters(model)
        shape = "x".join(map(str, self.input_shape))
        try:
            result.update(count_flops(model, self.input_shape, task.device))
        except Exception as e:  # noqa: BLE001 - a diagnostic must not stop the run
            log.warning("model complexity: cannot count flops for config.HOOKS.MODEL_COMPLEXITY.INPUT_SHAPE=%s: %s",
                        self.input_shape, str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
        self.result = result
        log.info("model complexity: %d params (%d trainable)%s", result["params"], result["trainable_params"],
                 f", {result['flops'] / 1e9:.4g} GFLOPs for one {shape} input (fvcore: multiply-add = 1 flop)"
                 if "flops" in result else "")
        if result.get("flops_by_module"):
            log.info("  flops by module: %s", ", ".join(f"{k} {v / 1e9:.4g} G" for k, v in result["flops_by_module"].items()))
        if result.get("unsupported_ops"):
            log.info("  ops fvcore does not count: %s", ", ".join(f"{k} x{v}" for k, v in result["unsupported_ops"].items()))

    def get_classy_state(self) -> Dict[str, Any]:
        return {}

    def set_classy_state(self, state: Dict[str, Any]) -> None:
        pass
