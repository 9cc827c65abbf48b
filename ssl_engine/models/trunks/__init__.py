"""Trunks: the networks that compute features, registered in ``ssl_engine.registry.TRUNKS``.

A trunk is built as ``cls(model_config, model_name)`` and called as
``trunk(x, out_feat_keys=None) -> List[Tensor]``. It should also expose ``feature_dims()``
(channel/feature dim per named layer) so that heads can be checked against it at build time.

``FeatureTrunk`` is the shared base for trunks that are a chain of blocks: it keeps the blocks
in an ordered ``_feature_blocks`` ModuleDict (the same state-dict layout as VISSL, so VISSL
checkpoints load), maps public layer names (res2, res5avg, ...) onto block outputs, and stops
the forward at the deepest layer asked for.
"""

from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn as nn

from ssl_engine.errors import UserError, did_you_mean


class FeatureTrunk(nn.Module):
    """A trunk made of sequential blocks whose outputs can be returned by public name.

    Subclasses call :meth:`_set_blocks` in their constructor and may override
    :meth:`_prepare_input` to check or reshape the input.
    """

    def __init__(self) -> None:
        super().__init__()
        self._feature_blocks = nn.ModuleDict()
        self._feature_to_block: Dict[str, str] = {}
        self._feature_dims: Dict[str, int] = {}
        self._vector_layers: Set[str] = set()
        self._block_index: Dict[str, int] = {}

    def _set_blocks(
        self,
        blocks: "OrderedDict[str, nn.Module]",
        feature_to_block: "OrderedDict[str, str]",
        feature_dims: Dict[str, int],
        vector_layers: Sequence[str] = (),
    ) -> None:
        """Install the blocks and the name maps (public feature name -> block name, -> dim)."""
        self._feature_blocks = nn.ModuleDict(blocks)
        self.__dict__["_plans"] = {}
        self._block_index = {name: i for i, name in enumerate(blocks)}
        missing = [b for b in feature_to_block.values() if b not in self._block_index]
        if missing:
            raise ValueError(f"feature names map to unknown blocks {missing}")
        self._feature_to_block = dict(feature_to_block)
        self._feature_dims = dict(feature_dims)
        self._vector_layers = set(vector_layers)

    def feature_names(self) -> List[str]:
        """The public layer names, shallow to deep; the last one is the default output."""
        return list(self._feature_to_block)

    def feature_dims(self) -> Dict[str, int]:
        """Channel (for [N, C, H, W] layers) or feature (for [N, D] layers) dim of each named layer."""
        return dict(self._feature_dims)

    def vector_layers(self) -> Set[str]:
        """Layers that are [N, C] or [N, C, 1, 1] whatever the input size (e.g. res5avg, flatten)."""
        return set(self._vector_layers)

    @property
    def default_feature_name(self) -> str:
        return self.feature_names()[-1]

    def _prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def _plan(self, asked: Tuple[str, ...]) -> Tuple[List[str], Set[str], int]:
        """(layer names, their blocks, index of the last block to run) for ``asked`` (computed
        once per distinct request: the forward of every step asks the same)."""
        plans = self.__dict__.setdefault("_plans", {})
        plan = plans.get(asked)
        if plan is None:
            keys = list(asked) if asked else [self.default_feature_name]
            unknown = [k for k in keys if k not in self._feature_to_block]
            if unknown:
                valid = self.feature_names()
                raise UserError(
                    f"unknown trunk layer {unknown[0]!r}{did_you_mean(str(unknown[0]), valid)} for trunk "
                    f"{type(self).__name__}; valid layers: {', '.join(valid)}"
                )
            wanted_blocks = {self._feature_to_block[k] for k in keys}
            plan = plans[asked] = (keys, wanted_blocks, max(self._block_index[b] for b in wanted_blocks))
        return plan

    def forward(self, x: torch.Tensor, out_feat_keys: Optional[List[str]] = None) -> List[torch.Tensor]:
        """The outputs of the named layers, in the order asked (default: the last layer)."""
        keys, wanted_blocks, last = self._plan(tuple(out_feat_keys) if out_feat_keys else ())
        out = self._prepare_input(x)
        if len(keys) == 1:  # one layer (every training step): the output of block ``last``
            blocks = iter(self._feature_blocks.values())
            for _ in range(last + 1):
                out = next(blocks)(out)
            return [out]
        outputs: Dict[str, torch.Tensor] = {}
        for i, (name, block) in enumerate(self._feature_blocks.items()):
            out = block(out)
            if name in wanted_blocks:
                outputs[name] = out
            if i == last:
                break
        return [outputs[self._feature_to_block[k]] for k in keys]

from ssl_engine.models.trunks import mlp, regnet, resnet  # noqa: E402,F401  (registers the trunks)
from ssl_engine.models.trunks.mlp import MLPTrunk  # noqa: E402
from ssl_engine.models.trunks.regnet import RegNetTrunk  # noqa: E402
from ssl_engine.models.trunks.resnet import ResNetTrunk  # noqa: E402

__all__ = ["FeatureTrunk", "MLPTrunk", "RegNetTrunk", "ResNetTrunk"]
