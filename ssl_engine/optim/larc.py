"""LARC: layer-wise adaptive rate control (You et al., 2017), in plain PyTorch.

Large-batch SimCLR/SwAV training scales each parameter tensor's step by a trust ratio so
that no layer moves too far relative to its own norm. This replaces apex's LARC wrapper:
it rewrites the gradients in place just before the inner optimizer steps, and the caller
runs that step with the group's weight_decay set to 0 (the decay is already inside the
rewritten gradient). Norms are computed for a whole param group at once with
``torch._foreach_norm``, since this runs every step.
"""

from typing import Any, Dict, List, Mapping

import torch

from ssl_engine.errors import UserError

LARC_KEY = "config.OPTIMIZER.larc_config"


def parse_larc_config(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    """``{clip, eps, trust_coefficient}`` from ``config.OPTIMIZER.larc_config``.

    ``eps`` may be the string '1e-08' (VISSL's default is a string in yaml).
    """
    out: Dict[str, Any] = {"clip": bool(cfg.get("clip", False))}
    for key, default in (("eps", 1e-8), ("trust_coefficient", 0.001)):
        value = cfg.get(key, default)
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            raise UserError(f"{LARC_KEY}.{key}={value!r} must be a number") from None
        if out[key] < 0:
            raise UserError(f"{LARC_KEY}.{key}={value!r} must be >= 0")
    return out


@torch.no_grad()
def apply_larc_(param_groups: List[Dict[str, Any]], trust_coefficient: float, eps: float, clip: bool) -> None:
    """Rewrite each gradient g of parameter p in place as ``(g + wd * p) * ratio``.

    ``ratio = trust_coefficient * ||p|| / (||g|| + wd * ||p|| + eps)``; with ``clip`` it
    becomes ``min(ratio / lr, 1)`` so LARC only ever lowers the group's lr. A parameter
    whose norm or gradient norm is zero keeps ratio 1. ``wd`` and ``lr`` are the group's
    own values.
    """
    for group in param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        if any(p.grad.is_sparse for p in params):
            raise RuntimeError("LARC does not support sparse gradients")
        grads = [p.grad for p in params]
        wd = float(group.get("weight_decay", 0.0))
        lr = float(group["lr"])
        p_norm = torch.stack([n.float() for n in torch._foreach_norm(params)])
        g_norm = torch.stack([n.float() for n in torch._foreach_norm(grads)])
        ratio = trust_coefficient * p_norm / (g_norm + wd * p_norm + eps)
        if clip:
            ratio = torch.clamp(ratio / lr, max=1.0) if lr > 0 else torch.ones_like(ratio)
        ratio = torch.where((p_norm > 0) & (g_norm > 0), ratio, torch.ones_like(ratio))
        if wd != 0:
            torch._foreach_add_(grads, params, alpha=wd)
        torch._foreach_mul_(grads, [r.to(g.dtype) for r, g in zip(ratio.unbind(0), grads)])
