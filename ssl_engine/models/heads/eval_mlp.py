"""The ``eval_mlp`` head: BatchNorm on the frozen features, flatten, then a linear classifier.

Used for linear evaluation on several trunk layers at once, one head per layer of
``LINEAR_EVAL_FEAT_POOL_OPS_MAP``::

    ["eval_mlp", {"in_channels": 1024, "dims": [4096, 1000]}]   # res4 pooled to 2x2

``in_channels`` is the layer's channel count (normalised by the BN), ``dims[0]`` the flattened
size after pooling (channels x pooled positions). The BN re-centres features whose scale varies a
lot between layers, which lets one learning rate work for all the classifiers.
"""

from typing import Sequence

import torch
import torch.nn as nn

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.errors import UserError
from ssl_engine.models.heads.mlp import MLPHead, check_dims, flatten_head_input, head_bn_kwargs, head_where
from ssl_engine.registry import HEADS


@HEADS.register("eval_mlp")
class LinearEvalMLPHead(nn.Module):
    """BatchNorm2d(in_channels) -> flatten -> mlp(dims)."""

    #: the input dim counts channels of the (pooled) layer.
    input_is_channels = True

    def __init__(
        self,
        model_config: AttrDict,
        in_channels: int,
        dims: Sequence[int],
        use_bn: bool = False,
        use_relu: bool = False,
    ) -> None:
        super().__init__()
        if not (isinstance(in_channels, int) and not isinstance(in_channels, bool) and in_channels > 0):
            raise UserError(
                f"config.MODEL.HEAD.PARAMS: head 'eval_mlp' needs 'in_channels', a positive integer (the trunk "
                f"layer's channels); got {in_channels!r}"
            )
        self.in_channels = in_channels
        self.dims = check_dims(dims, "eval_mlp")
        self.channel_bn = nn.BatchNorm2d(in_channels, **head_bn_kwargs(model_config))
        self.clf = MLPHead(model_config, self.dims, use_bn=use_bn, use_relu=use_relu)

    @property
    def input_dim(self) -> int:
        """Channels of the layer this head reads (in_channels)."""
        return self.in_channels

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        if isinstance(batch, (list, tuple)):
            if len(batch) != 1:
                raise UserError(f"{head_where(self, 'eval_mlp')} takes one tensor, got a list of {len(batch)}")
            batch = batch[0]
        if batch.dim() == 2:
            batch = batch[:, :, None, None]
        if batch.dim() != 4 or batch.shape[1] != self.in_channels:
            raise UserError(
                f"{head_where(self, 'eval_mlp')} has in_channels={self.in_channels} but got features of shape "
                f"{list(batch.shape)}; set in_channels to the layer's channel count"
            )
        # flattened and dims[0] checked here, naming this head; the inner mlp's Linears run directly
        return self.clf.clf(flatten_head_input(self.channel_bn(batch), self.dims[0], self, "eval_mlp"))
