"""The ``mlp`` head: a stack of Linear layers, used as projection head or linear classifier.

``["mlp", {"dims": [2048, 2048, 128], "use_bn": False, "use_relu": True}]`` is SimCLR's
projection head; ``["mlp", {"dims": [2048, 1000]}]`` is a linear classifier. BN and ReLU follow
every Linear except the last one (``skip_last_layer_relu_bn``, default True), so the output is
the raw projection / logits. BatchNorm eps and momentum come from ``MODEL.HEAD.BATCHNORM_EPS``
and ``MODEL.HEAD.BATCHNORM_MOMENTUM``.
"""

from typing import Any, Dict, List, Sequence

import torch
import torch.nn as nn

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.errors import UserError
from ssl_engine.registry import HEADS


def head_bn_kwargs(model_config: AttrDict) -> Dict[str, float]:
    """``eps`` and ``momentum`` for head BatchNorms; the eps may be a string such as '1e-5'.

    yaml reads ``1e-5`` (no dot) as a string, which is why VISSL's default is the string '1e-5'.
    """
    head_cfg = model_config.get("HEAD", {}) or {}
    out = {}
    for key, name, default in (("BATCHNORM_EPS", "eps", 1e-5), ("BATCHNORM_MOMENTUM", "momentum", 0.1)):
        value = head_cfg.get(key, default)
        try:
            out[name] = float(value)
        except (TypeError, ValueError):
            raise UserError(f"config.MODEL.HEAD.{key}={value!r} is not a number (e.g. 1e-5 or '1e-5')") from None
    return out


def check_dims(dims: Any, head: str) -> List[int]:
    """``dims`` as a list of >= 2 positive ints, or a UserError naming the head."""
    if not (
        isinstance(dims, (list, tuple))
        and len(dims) >= 2
        and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims)
    ):
        raise UserError(
            f"config.MODEL.HEAD.PARAMS: head {head!r} needs 'dims', a list of at least two positive integers "
            f"(input dim, ..., output dim), e.g. [2048, 128]; got {dims!r}"
        )
    return list(dims)


def head_where(head: nn.Module, name: str) -> str:
    """How messages name ``head``: the ``MODEL.HEAD.PARAMS[i]`` entry it was built from (set by the
    model's builder as ``config_key``), or the head's name when it was built by hand."""
    return getattr(head, "config_key", None) or f"config.MODEL.HEAD.PARAMS ({name})"


def flatten_head_input(batch: Any, expected_dim: int, head: nn.Module, name: str) -> torch.Tensor:
    """[N, D] or [N, D, 1, 1] (or a one-element list of them) -> [N, D], checking D against dims[0].

    The trunk's output size is checked before launch where the config shows it; where it does
    not (a user trunk, a layer whose size depends on the image size) this check names the head's
    key (:func:`head_where`) instead of letting the Linear fail with a matrix-multiply shape error.
    """
    if isinstance(batch, (list, tuple)):
        if len(batch) != 1:
            raise UserError(f"{head_where(head, name)} takes one tensor, got a list of {len(batch)}")
        batch = batch[0]
    flat = batch.reshape(batch.shape[0], -1) if batch.dim() != 2 else batch
    if flat.shape[1] != expected_dim:
        raise UserError(
            f"{head_where(head, name)} has dims[0]={expected_dim} but its input has {flat.shape[1]} features "
            f"per sample (shape {list(batch.shape)}); set dims[0] to {flat.shape[1]}"
        )
    return flat


@HEADS.register("mlp")
class MLPHead(nn.Module):
    """Linear layers with optional BN / ReLU / Dropout between them."""

    def __init__(
        self,
        model_config: AttrDict,
        dims: Sequence[int],
        use_bn: bool = False,
        use_relu: bool = False,
        use_dropout: bool = False,
        use_bias: bool = True,
        skip_last_layer_relu_bn: bool = True,
    ) -> None:
        super().__init__()
        self.dims = check_dims(dims, "mlp")
        bn_kwargs = head_bn_kwargs(model_config)
        layers: List[nn.Module] = []
        n_linear = len(self.dims) - 1
        for i, (d_in, d_out) in enumerate(zip(self.dims[:-1], self.dims[1:])):
            layers.append(nn.Linear(d_in, d_out, bias=use_bias))
            if i == n_linear - 1 and skip_last_layer_relu_bn:
                break
            if use_bn:
                layers.append(nn.BatchNorm1d(d_out, **bn_kwargs))
            if use_relu:
                layers.append(nn.ReLU(inplace=True))
            if use_dropout:
                layers.append(nn.Dropout())
        self.clf = nn.Sequential(*layers)
        self._init_weights()
        self._scale_weights(model_config)

    @property
    def input_dim(self) -> int:
        """Flattened features this head reads (dims[0])."""
        return self.dims[0]

    #: the input dim counts flattened features (not channels before pooling).
    input_is_channels = False

    def _init_weights(self) -> None:
        """Small normal init (std 0.01), as is usual for linear-evaluation classifiers."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=0.01)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm1d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    @torch.no_grad()
    def _scale_weights(self, model_config: AttrDict) -> None:
        """``MODEL.HEAD.PARAMS_MULTIPLIER``: every Linear's initial weight and bias times this
        factor, as VISSL's mlp head scales its initialisation (eval_mlp's classifier included)."""
        value = (model_config.get("HEAD", {}) or {}).get("PARAMS_MULTIPLIER", 1.0)
        try:
            factor = float(value)
        except (TypeError, ValueError):
            raise UserError(f"config.MODEL.HEAD.PARAMS_MULTIPLIER={value!r} must be a number") from None
        if factor == 1.0:
            return
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.weight.mul_(factor)
                if m.bias is not None:
                    m.bias.mul_(factor)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.clf(flatten_head_input(batch, self.dims[0], self, "mlp"))
