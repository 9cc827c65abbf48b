"""LARS (You et al. 2017) as Barlow Twins trains with it: VISSL's ``OPTIMIZER.name: lars``.

For each parameter p with gradient g in a group with learning rate lr, weight decay wd and
momentum m::

    d = g + wd * p
    d = d * eta * ||p|| / ||d||      (left as is when ||p|| or ||d|| is 0, or when p is 1-d and
                                      exclude_bias_and_norm is set: biases and norm weights)
    mu = m * mu + d                  (mu starts at 0)
    p  = p - lr * mu

Weight decay is the group's: ``regularize_bn``, ``regularize_bias`` and
``non_regularized_parameters`` decide which parameters get it, as for every optimizer here
(VISSL's lars does the same; ``exclude_bias_and_norm`` only leaves 1-d parameters out of the
trust ratio). The momentum buffers are the optimizer's state (``state_dict``), so a run resumes
exactly. The group options are plain numbers and booleans, so the state loads with
``torch.load(weights_only=True)``.
"""

from typing import Any, Callable, Iterable, Mapping, Optional

import torch

from ssl_engine.errors import UserError
from ssl_engine.registry import OPTIMIZERS

KEY = "config.OPTIMIZER"


class LARS(torch.optim.Optimizer):
    """LARS with momentum; see the module docstring for the update."""

    def __init__(self, params: Iterable[Any], lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 0.0,
                 eta: float = 0.001, exclude_bias_and_norm: bool = False) -> None:
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "eta": eta,
                    "exclude_bias_and_norm": bool(exclude_bias_and_norm)}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            wd, eta, momentum, lr = group["weight_decay"], group["eta"], group["momentum"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LARS does not support sparse gradients")
                d = p.grad.add(p, alpha=wd) if wd != 0 else p.grad.clone()
                if not (group["exclude_bias_and_norm"] and p.ndim == 1):
                    p_norm, d_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(d)
                    ratio = torch.where((p_norm > 0) & (d_norm > 0), eta * p_norm / d_norm, torch.ones_like(p_norm))
                    d.mul_(ratio)
                state = self.state[p]
                if "mu" not in state:
                    state["mu"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                mu = state["mu"]
                mu.mul_(momentum).add_(d)
                p.add_(mu, alpha=-lr)
        return loss


def _float(cfg: Mapping[str, Any], key: str, default: float) -> float:
    value = cfg.get(key, default)
    if isinstance(value, bool):
        raise UserError(f"{KEY}.{key}={value!r} must be a number")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UserError(f"{KEY}.{key}={value!r} must be a number") from None


@OPTIMIZERS.register("lars")
def _lars(param_groups: list, cfg: Mapping[str, Any]) -> torch.optim.Optimizer:
    momentum = _float(cfg, "momentum", 0.9)
    if not 0.0 <= momentum < 1.0:
        raise UserError(f"{KEY}.momentum={momentum!r} must be in [0, 1)")
    eta = _float(cfg, "eta", 0.001)
    if not eta > 0:
        raise UserError(f"{KEY}.eta={eta!r} must be > 0 (LARS's trust coefficient)")
    if cfg.get("use_larc", False):
        raise UserError(
            f"{KEY}.use_larc=true with {KEY}.name=lars would scale every step twice (LARS has its own trust ratio, "
            f"{KEY}.eta); set use_larc to false, or use name: sgd with use_larc"
        )
    exclude = cfg.get("exclude_bias_and_norm", False)
    if not isinstance(exclude, bool):
        raise UserError(f"{KEY}.exclude_bias_and_norm={exclude!r} must be true or false")
    return LARS(param_groups, lr=0.0, momentum=momentum, eta=eta, exclude_bias_and_norm=exclude)

