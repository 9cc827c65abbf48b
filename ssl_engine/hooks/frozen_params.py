"""TempFrozenParamsHook (MODEL.TEMP_FROZEN_PARAMS_ITER_MAP): named parameters are not updated
during the first N training iterations (e.g. SwAV's prototypes for the first epoch).

Each entry is ``[name, N]``; a name is a parameter of the model (``heads.0.clf.0.weight``) or a
module prefix (``heads.0``) that covers every parameter under it (see models.param_names).
After backward, the frozen parameters' gradients are set to None, so the optimizer skips them
entirely: no gradient step, no weight decay, no momentum. With DDP the gradients are still
reduced (the buckets need them), then dropped. From iteration N on, nothing is done.
"""

import logging
from typing import Any, Dict, List, Sequence, Tuple

import torch

from ssl_engine import distributed as du
from ssl_engine.errors import UserError
from ssl_engine.hooks.base import Priority, SSLHook
from ssl_engine.models.param_names import match_params, no_such_params
from ssl_engine.registry import HOOKS

log = logging.getLogger(__name__)

KEY = "config.MODEL.TEMP_FROZEN_PARAMS_ITER_MAP"


def parse_iter_map(entries: Sequence[Any]) -> List[Tuple[str, int]]:
    """[[name, iterations], ...] checked: a name string and an int >= 0."""
    out = []
    for e in entries:
        if not isinstance(e, (list, tuple)) or len(e) != 2 or not isinstance(e[0], str) \
                or isinstance(e[1], bool) or not isinstance(e[1], int) or e[1] < 0:
            raise UserError(f"{KEY} entry {e!r} is not [parameter name, iterations >= 0]")
        out.append((e[0], int(e[1])))
    return out


def frozen_params(entries: Sequence[Tuple[str, int]], model: torch.nn.Module
                  ) -> List[Tuple[str, int, List[torch.nn.Parameter]]]:
    """(name, iterations, the parameters it names) of each entry; a UserError for a name that
    names nothing. Run on the model built before launch too, so a wrong name never starts a run."""
    out = []
    for i, (name, iters) in enumerate(entries):
        params = match_params(model, name)
        if not params:
            raise no_such_params(f"{KEY}[{i}]", name, model)
        out.append((name, iters, [p for _, p in params]))
    return out


@HOOKS.register("TempFrozenParamsHook")
class TempFrozenParamsHook(SSLHook):
    """Drops the gradients of the named parameters while task.iteration < N."""

    priority = Priority.VERY_HIGH  # before any hook that reads gradients after backward

    def __init__(self, param_iter_map: Sequence[Any]) -> None:
        super().__init__()
        self.entries = parse_iter_map(param_iter_map)
        self._frozen: List[Tuple[int, List[torch.nn.Parameter]]] = []
        self._until = 0

    def on_start(self, task: Any) -> None:
        self._frozen = []
        for name, iters, params in frozen_params(self.entries, task.base_model):
            self._frozen.append((iters, params))
            if du.is_primary():
                log.info("%s: %d parameter tensors under %r frozen for the first %d iterations",
                         KEY.split(".")[-1], len(params), name, iters)
        self._until = max((it for it, _ in self._frozen), default=0)

    def on_backward(self, task: Any) -> None:
        if task.iteration >= self._until:
            return
        for iters, params in self._frozen:
            if task.iteration < iters:
                for p in params:
                    p.grad = None

    def get_classy_state(self) -> Dict[str, Any]:
        return {}

    def set_classy_state(self, state: Dict[str, Any]) -> None:
        pass
