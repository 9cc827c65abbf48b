"""A small fully connected trunk, for tiny images (digits, CIFAR-sized tests) and quick runs.

Config (``MODEL.TRUNK.MLP``, our own keys):

- ``DIMS``: layer widths; the first is the flattened input size (C*H*W, e.g. 3072 for 3x32x32),
  each following number is one Linear layer, e.g. [3072, 256] or [64, 128, 64].
- ``USE_BN``: BatchNorm1d after every Linear (default False).
- ``USE_RELU``: ReLU after every Linear (default True), the last one included, since the
  trunk's output feeds a head.

Named layers: fc1 .. fcK (K = len(DIMS) - 1), all [N, D]; the default output is fcK.
"""

from collections import OrderedDict
from typing import List

import torch
import torch.nn as nn

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.errors import UserError
from ssl_engine.models.trunks import FeatureTrunk
from ssl_engine.registry import TRUNKS

KEY = "config.MODEL.TRUNK.MLP"


@TRUNKS.register("mlp")
class MLPTrunk(FeatureTrunk):
    """Flatten, then Linear (+BN) (+ReLU) per entry of DIMS after the first."""

    def __init__(self, model_config: AttrDict, model_name: str = "mlp") -> None:
        super().__init__()
        self.model_name = model_name
        cfg = model_config.get("TRUNK", {}).get("MLP", {}) or {}
        dims = cfg.get("DIMS", None)
        if not (
            isinstance(dims, (list, tuple))
            and len(dims) >= 2
            and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims)
        ):
            raise UserError(
                f"{KEY}.DIMS={dims!r} must be a list of at least two positive integers: "
                "the flattened input size (C*H*W) then each layer's width, e.g. [3072, 256]"
            )
        self.dims: List[int] = list(dims)
        use_bn = bool(cfg.get("USE_BN", False))
        use_relu = bool(cfg.get("USE_RELU", True))
        blocks: "OrderedDict[str, nn.Module]" = OrderedDict()
        names: "OrderedDict[str, str]" = OrderedDict()
        feat_dims = {}
        for i, (d_in, d_out) in enumerate(zip(self.dims[:-1], self.dims[1:]), start=1):
            layers: List[nn.Module] = [nn.Linear(d_in, d_out)]
            if use_bn:
                layers.append(nn.BatchNorm1d(d_out))
            if use_relu:
                layers.append(nn.ReLU(inplace=True))
            blocks[f"fc{i}"] = nn.Sequential(*layers)
            names[f"fc{i}"] = f"fc{i}"
            feat_dims[f"fc{i}"] = d_out
        self._set_blocks(blocks, names, feat_dims, vector_layers=list(names))

    def _prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.ndim == 2 else x.reshape(x.shape[0], -1)
        if flat.shape[1] != self.dims[0]:
            raise UserError(
                f"{KEY}.DIMS[0]={self.dims[0]} but the input batch {list(x.shape)} flattens to "
                f"{flat.shape[1]} features per sample; set DIMS[0] to {flat.shape[1]}"
            )
        return flat
