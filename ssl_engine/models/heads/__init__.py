"""Heads: modules applied to trunk features, registered in ``ssl_engine.registry.HEADS``.

A head is built as ``cls(model_config, **params)`` from one ``MODEL.HEAD.PARAMS`` entry
``[name, params]``. Heads may expose ``input_dim`` (and ``input_is_channels``) so that the
model can check them against the trunk layer they read before any data is seen.
"""

from ssl_engine.models.heads.eval_mlp import LinearEvalMLPHead
from ssl_engine.models.heads.mlp import MLPHead, head_bn_kwargs
from ssl_engine.models.heads.swav_head import SwAVHead, find_swav_head

__all__ = ["LinearEvalMLPHead", "MLPHead", "SwAVHead", "find_swav_head", "head_bn_kwargs"]
