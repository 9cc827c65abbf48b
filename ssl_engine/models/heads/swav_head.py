"""The ``swav_head``: SwAV's projection MLP, L2-normalised embedding and prototype layers.

``["swav_head", {"dims": [2048, 2048, 128], "use_bn": True, "num_clusters": [3000]}]`` is the
head of VISSL's SwAV configs. The projection is Linear (-> BN) -> ReLU per entry of ``dims``
after the first, without BN/ReLU after the last Linear (``skip_last_bn``, default True). Its
output is L2-normalised (``normalize_feats``) and scored against each set of prototypes: one
bias-free Linear ``prototypes{i}`` per entry of ``num_clusters``.

The forward returns a list: ``[embedding, scores_0, scores_1, ...]`` (the embedding only with
``return_embeddings``, default True), which the model passes on as its outputs and
``swav_loss`` reads. Parameter names are VISSL's (``heads.0.projection_head.0.weight``,
``heads.0.prototypes0.weight``), so VISSL SwAV checkpoints' heads load and VISSL's
``TEMP_FROZEN_PARAMS_ITER_MAP`` entries (``module.heads.0.prototypes0.weight``) name them.
Weights keep PyTorch's default init, as in VISSL.
"""

from typing import Any, List, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.errors import UserError
from ssl_engine.models.heads.mlp import flatten_head_input, head_bn_kwargs
from ssl_engine.registry import HEADS


def _positive_ints(value: Any, key: str, min_len: int, example: str) -> List[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not (
        isinstance(value, (list, tuple))
        and len(value) >= min_len
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise UserError(
            f"config.MODEL.HEAD.PARAMS: head 'swav_head' needs {key!r}, a list of positive integers, e.g. {example}; "
            f"got {value!r}"
        )
    return list(value)


@HEADS.register("swav_head")
class SwAVHead(nn.Module):
    """Projection MLP -> L2 normalisation -> prototypes (one Linear per entry of num_clusters)."""

    #: the input dim counts flattened features (not channels before pooling).
    input_is_channels = False

    def __init__(
        self,
        model_config: AttrDict,
        dims: Sequence[int],
        use_bn: bool = False,
        num_clusters: Union[int, Sequence[int]] = (3000,),
        use_bias: bool = True,
        return_embeddings: bool = True,
        skip_last_bn: bool = True,
        normalize_feats: bool = True,
    ) -> None:
        super().__init__()
        self.dims = _positive_ints(dims, "dims", 1, "[2048, 2048, 128] (input dim, ..., embedding dim)")
        empty = isinstance(num_clusters, (list, tuple)) and len(num_clusters) == 0
        self.num_clusters = [] if empty else _positive_ints(num_clusters, "num_clusters", 1, "[3000]")
        self.return_embeddings = bool(return_embeddings)
        self.normalize_feats = bool(normalize_feats)
        bn_kwargs = head_bn_kwargs(model_config)
        layers: List[nn.Module] = []
        n_linear = len(self.dims) - 1
        for i, (d_in, d_out) in enumerate(zip(self.dims[:-1], self.dims[1:])):
            layers.append(nn.Linear(d_in, d_out, bias=use_bias))
            if i == n_linear - 1 and skip_last_bn:
                break
            if use_bn:
                layers.append(nn.BatchNorm1d(d_out, **bn_kwargs))
            layers.append(nn.ReLU(inplace=True))
        self.projection_head = nn.Sequential(*layers)
        for i, k in enumerate(self.num_clusters):
            self.add_module(f"prototypes{i}", nn.Linear(self.dims[-1], k, bias=False))

    @property
    def input_dim(self) -> int:
        """Flattened features this head reads (dims[0])."""
        return self.dims[0]

    @property
    def embedding_dim(self) -> int:
        """Size of the embedding the prototypes score (dims[-1])."""
        return self.dims[-1]

    @property
    def nmb_heads(self) -> int:
        """Number of prototype sets (VISSL's attribute name)."""
        return len(self.num_clusters)

    def prototype_layers(self) -> List[nn.Linear]:
        """The ``prototypes{i}`` Linear layers, in order."""
        return [getattr(self, f"prototypes{i}") for i in range(len(self.num_clusters))]

    def forward(self, batch: torch.Tensor) -> List[torch.Tensor]:
        x = self.projection_head(flatten_head_input(batch, self.dims[0], self, "swav_head"))
        if self.normalize_feats:
            x = F.normalize(x, dim=1, p=2)
        out = [x] if self.return_embeddings else []
        out.extend(layer(x) for layer in self.prototype_layers())
        return out


def find_swav_head(model: nn.Module) -> Optional[SwAVHead]:
    """The SwAVHead that produces ``model``'s outputs (the last stage of its last head), or None."""
    heads = getattr(model, "heads", None)
    if heads is None or len(heads) == 0:
        return None
    last = heads[-1]
    if isinstance(last, nn.Sequential) and len(last) > 0:
        last = last[-1]
    return last if isinstance(last, SwAVHead) else None
