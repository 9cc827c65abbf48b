"""Models: trunks (feature networks), heads (projections / classifiers) and SSLModel joining them.

Importing this package registers the built-in trunks (``resnet``, ``mlp``) and heads
(``mlp``, ``eval_mlp``). Entry point: ``build_model(config.MODEL, config.OPTIMIZER)``.
"""

from ssl_engine.models import heads, trunks  # noqa: F401  (registers the built-in parts)
from ssl_engine.models.model import SSLModel, build_heads, build_model, build_trunk, convert_sync_batchnorm

__all__ = ["SSLModel", "build_heads", "build_model", "build_trunk", "convert_sync_batchnorm"]
