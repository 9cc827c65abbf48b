"""SwAVHook: the model-side duties of SwAV training, added by default_hooks when
``config.LOSS.name`` is ``swav_loss``.

- At the start of a run it checks the swav_head against ``config.LOSS.swav_loss``
  (num_prototypes, embedding_dim) and binds the head's prototype layers to the loss, which
  scores its queue with them at every step (VISSL's SwAVUpdateQueueScoresHook does that
  scoring at on_forward; the loss doing it right after the forward uses the same weights).
- With ``normalize_last_layer`` (VISSL's NormalizePrototypesHook) it rescales every
  prototype (each row of ``prototypes{i}.weight``) to unit L2 norm after each optimizer
  update, so checkpoints hold unit-norm prototypes; and once at the start of a new run, so
  that the first step also scores with unit-norm prototypes, as the SwAV paper does (VISSL
  does not normalise before its first update).
"""

from typing import Any, Dict, List

import torch
import torch.nn.functional as F

from ssl_engine.hooks.base import Priority, SSLHook
from ssl_engine.registry import HOOKS


@torch.no_grad()
def normalize_prototypes(layers: List[torch.nn.Linear]) -> None:
    """Each prototype (row of each layer's weight) to unit L2 norm, in place."""
    for layer in layers:
        layer.weight.copy_(F.normalize(layer.weight, dim=1, p=2))


@HOOKS.register("SwAVHook")
class SwAVHook(SSLHook):
    """Binds the swav_head's prototypes to swav_loss; normalises them after each update."""

    priority = Priority.HIGH  # after the update, before hooks that copy or save the weights (EMA, checkpoints)

    def __init__(self, normalize_last_layer: bool = True) -> None:
        super().__init__()
        self.normalize_last_layer = bool(normalize_last_layer)
        self._prototypes: List[torch.nn.Linear] = []

    def on_start(self, task: Any) -> None:
        from ssl_engine.models.heads.swav_head import find_swav_head

        bind = getattr(task.loss, "bind_model", None)
        if callable(bind):
            bind(task.base_model)
        head = find_swav_head(task.base_model)
        self._prototypes = head.prototype_layers() if head is not None else []
        if self.normalize_last_layer and task.iteration == 0:
            normalize_prototypes(self._prototypes)

    def on_update(self, task: Any) -> None:
        if self.normalize_last_layer:
            normalize_prototypes(self._prototypes)

    def get_classy_state(self) -> Dict[str, Any]:
        return {}

    def set_classy_state(self, state: Dict[str, Any]) -> None:
        pass
