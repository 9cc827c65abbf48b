"""ResNet / ResNeXt trunk built from torchvision's residual blocks, never with pretrained weights.

Config (``MODEL.TRUNK.RESNETS``, VISSL names):

- ``DEPTH``: 18, 34 (basic blocks) or 50, 101, 152, 200 (bottleneck blocks).
- ``WIDTH_MULTIPLIER``: scales every stage's width, stem included, as VISSL and SimCLR's
  ResNet-50 (2x/4x) do, so a ResNet-50 w2 gives 4096-dim features and VISSL yamls carry over.
- ``GROUPS`` / ``WIDTH_PER_GROUP``: ResNeXt grouping of the bottleneck 3x3 conv (e.g. 32 / 4).
- ``ZERO_INIT_RESIDUAL``: last BN of each residual branch starts at gamma = 0, so each block
  starts as the identity (helps large-batch training).
- ``NORM``: only 'BatchNorm'.
- ``LAYER4_STRIDE``: stride of the res5 stage (2, or 1 for a denser last map).

``MODEL.INPUT_TYPE`` says how the trunk reads its input (see ssl_engine.models.input_type): the
stem takes 3 channels for 'rgb'/'bgr' (BGR reverses the RGB batch), 1 for 'gray'/'lab' (LAB keeps
the L channel of a 3-channel batch).

Named layers: conv1 (after stem ReLU), res1 (after max-pool), res2..res5, res5avg ([N, C, 1, 1]),
flatten ([N, C]). Any input of 8x8 pixels or more works; res5avg pools whatever map is left.
"""

from collections import OrderedDict
from typing import Dict, List, Tuple, Type, Union

import torch
import torch.nn as nn
from torchvision.models.resnet import BasicBlock, Bottleneck

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.errors import UserError
from ssl_engine.models.input_type import input_type, stem_channels, to_model_input
from ssl_engine.models.trunks import FeatureTrunk
from ssl_engine.registry import TRUNKS

Block = Type[Union[BasicBlock, Bottleneck]]

DEPTHS: Dict[int, Tuple[Block, Tuple[int, int, int, int]]] = {
    18: (BasicBlock, (2, 2, 2, 2)),
    34: (BasicBlock, (3, 4, 6, 3)),
    50: (Bottleneck, (3, 4, 6, 3)),
    101: (Bottleneck, (3, 4, 23, 3)),
    152: (Bottleneck, (3, 8, 36, 3)),
    200: (Bottleneck, (3, 24, 36, 3)),
}

KEY = "config.MODEL.TRUNK.RESNETS"


def _positive_int(cfg: AttrDict, key: str, default: int) -> int:
    value = cfg.get(key, default)
    try:
        ivalue = int(value)
        ok = ivalue == float(value) and ivalue > 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise UserError(f"{KEY}.{key}={value!r} must be a positive integer")
    return ivalue


@TRUNKS.register("resnet")
class ResNetTrunk(FeatureTrunk):
    """ResNet/ResNeXt exposing conv1, res1..res5, res5avg and flatten as feature layers."""

    def __init__(self, model_config: AttrDict, model_name: str = "resnet") -> None:
        super().__init__()
        self.model_name = model_name
        cfg = model_config.get("TRUNK", {}).get("RESNETS", {}) or {}
        depth = cfg.get("DEPTH", 50)
        if depth not in DEPTHS:
            raise UserError(f"{KEY}.DEPTH={depth!r} is not supported; valid: {', '.join(map(str, DEPTHS))}")
        norm = cfg.get("NORM", "BatchNorm")
        if norm != "BatchNorm":
            raise UserError(f"{KEY}.NORM={norm!r} is not supported; only 'BatchNorm' is")
        width_mult = _positive_int(cfg, "WIDTH_MULTIPLIER", 1)
        groups = _positive_int(cfg, "GROUPS", 1)
        width_per_group = _positive_int(cfg, "WIDTH_PER_GROUP", 64)
        layer4_stride = cfg.get("LAYER4_STRIDE", 2)
        if layer4_stride not in (1, 2):
            raise UserError(f"{KEY}.LAYER4_STRIDE={layer4_stride!r} must be 1 or 2")
        zero_init = bool(cfg.get("ZERO_INIT_RESIDUAL", False))
        block, stage_blocks = DEPTHS[depth]
        if block is BasicBlock and (groups != 1 or width_per_group != 64):
            raise UserError(
                f"{KEY}.GROUPS={groups} / WIDTH_PER_GROUP={width_per_group}: depth {depth} uses basic blocks, "
                "which need GROUPS=1 and WIDTH_PER_GROUP=64; use DEPTH 50 or more for ResNeXt"
            )

        self.depth = depth
        self.input_type = input_type(model_config)
        self.in_channels = stem_channels(self.input_type)
        stem = 64 * width_mult
        self._inplanes = stem
        blocks: "OrderedDict[str, nn.Module]" = OrderedDict()
        blocks["conv1"] = nn.Conv2d(self.in_channels, stem, kernel_size=7, stride=2, padding=3, bias=False)
        blocks["bn1"] = nn.BatchNorm2d(stem)
        blocks["conv1_relu"] = nn.ReLU(inplace=True)
        blocks["maxpool"] = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        strides = (1, 2, 2, layer4_stride)
        stage_dims: List[int] = []
        for i, (n_blocks, stride) in enumerate(zip(stage_blocks, strides)):
            planes = 64 * width_mult * (2**i)
            blocks[f"layer{i + 1}"] = self._make_stage(block, planes, n_blocks, stride, groups, width_per_group)
            stage_dims.append(planes * block.expansion)
        blocks["avgpool"] = nn.AdaptiveAvgPool2d((1, 1))
        blocks["flatten"] = nn.Flatten(1)

        feature_to_block = OrderedDict(
            [
                ("conv1", "conv1_relu"),
                ("res1", "maxpool"),
                ("res2", "layer1"),
                ("res3", "layer2"),
                ("res4", "layer3"),
                ("res5", "layer4"),
                ("res5avg", "avgpool"),
                ("flatten", "flatten"),
            ]
        )
        dims = {"conv1": stem, "res1": stem}
        dims.update({f"res{i + 2}": d for i, d in enumerate(stage_dims)})
        dims["res5avg"] = dims["flatten"] = stage_dims[-1]
        self._set_blocks(blocks, feature_to_block, dims, vector_layers=("res5avg", "flatten"))
        self._init_weights(zero_init)

    def _make_stage(
        self, block: Block, planes: int, n_blocks: int, stride: int, groups: int, width_per_group: int
    ) -> nn.Sequential:
        """One stage of ``n_blocks`` residual blocks; the first one changes stride/width."""
        out_dim = planes * block.expansion
        downsample = None
        if stride != 1 or self._inplanes != out_dim:
            downsample = nn.Sequential(
                nn.Conv2d(self._inplanes, out_dim, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(out_dim),
            )
        layers = [
            block(self._inplanes, planes, stride, downsample, groups=groups, base_width=width_per_group)
        ]
        self._inplanes = out_dim
        for _ in range(1, n_blocks):
            layers.append(block(out_dim, planes, groups=groups, base_width=width_per_group))
        return nn.Sequential(*layers)

    def _init_weights(self, zero_init_residual: bool) -> None:
        """He init for convs, unit BN; optionally zero the last BN gamma of each residual branch."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, Bottleneck):
                    nn.init.zeros_(m.bn3.weight)
                elif isinstance(m, BasicBlock):
                    nn.init.zeros_(m.bn2.weight)

    def _prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        return to_model_input(x, self.input_type, "resnet")
