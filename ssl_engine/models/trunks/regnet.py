"""RegNet trunk: classy_vision's RegNet / AnyNet, exposed as VISSL's ``regnet`` trunk.

Config (``MODEL.TRUNK.REGNET``, VISSL's lower-case names), one of:

- ``name``: a classy_vision preset, e.g. ``regnet_y_400mf`` (440-dim output), ``regnet_y_16gf``,
  ``regnet_x_3.2gf``, ``regnet_z_500mf``. As in VISSL, a preset takes no other key (any other key
  given beside it is ignored, with a warning).
- explicit RegNet parameters (no ``name``, or ``name: regnet``): ``depth``, ``w_0``, ``w_a``,
  ``w_m``, ``group_width`` (required) and ``bottleneck_multiplier`` (1.0), ``stem_type``
  (simple_stem_in | res_stem_in | res_stem_cifar), ``stem_width`` (32), ``block_type``
  (res_bottleneck_block | res_basic_block | vanilla_block | res_bottleneck_linear_block),
  ``activation`` (relu | silu), ``use_se`` (true), ``se_ratio`` (0.25), ``bn_epsilon`` (1e-5),
  ``bn_momentum`` (0.1): classy_vision's ``RegNet.from_config``, as VISSL's SEER configs write them.
- ``name: anynet`` with ``depths``, ``widths``, ``group_widths``, ``bottleneck_multipliers``,
  ``strides`` (one entry per stage) and the stem/block/activation/SE/BN keys above.

``stage_checkpoints`` (VISSL's regnet_fsdp activation checkpointing) is accepted and not acted on.

Named layers, as VISSL names them: conv1 (the stem), res2, res3, ... (one per stage, so res2..res5
for the presets), avgpool ([N, C, 1, 1]) and flatten ([N, C]); flatten is the default output.
The state dict is VISSL's: ``_feature_blocks.conv1.stem.0.weight``,
``_feature_blocks.res2.block1-0.f.a.0.weight``, ... so VISSL RegNet checkpoints load as they are.
"""

import logging
import math
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn
from classy_vision.models import MODEL_REGISTRY
from classy_vision.models.anynet import ActivationType, AnyNet, AnyNetParams, BlockType, StemType
from classy_vision.models.regnet import RegNet as ClassyRegNet
from classy_vision.models.regnet import RegNetParams

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.errors import UserError, closest
from ssl_engine.models.input_type import input_type, stem_channels, to_model_input
from ssl_engine.models.trunks import FeatureTrunk
from ssl_engine.registry import TRUNKS

logger = logging.getLogger(__name__)

KEY = "config.MODEL.TRUNK.REGNET"

# the RegNet presets registered with classy_vision (regnet_y_400mf, ..., regnet_z_4gf)
PRESETS: Dict[str, type] = {
    name: cls
    for name, cls in sorted(MODEL_REGISTRY.items())
    if isinstance(cls, type) and issubclass(cls, ClassyRegNet) and cls is not ClassyRegNet
}

REGNET_REQUIRED = ("depth", "w_0", "w_a", "w_m", "group_width")
ANYNET_REQUIRED = ("depths", "widths", "group_widths", "bottleneck_multipliers", "strides")
COMMON_OPTIONAL = (
    "stem_type", "stem_width", "block_type", "activation", "use_se", "se_ratio", "bn_epsilon", "bn_momentum",
)
REGNET_OPTIONAL = ("bottleneck_multiplier",) + COMMON_OPTIONAL
NOT_ACTED_ON = ("stage_checkpoints",)


def _where(key: str) -> str:
    return f"{KEY}.{key}"


def _number(cfg: Dict[str, Any], key: str, default: Any, ok: Callable[[float], bool], what: str) -> float:
    """A float from yaml (which reads ``1e-5`` as a string), checked by ``ok``."""
    value = cfg.get(key, default)
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not (math.isfinite(number) and ok(number)):
        raise UserError(f"{_where(key)}={value!r} must be {what}")
    return number


def _int(cfg: Dict[str, Any], key: str, default: Any, ok: Callable[[int], bool], what: str) -> int:
    value = cfg.get(key, default)
    good = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not (good and value == int(value) and ok(int(value))):
        raise UserError(f"{_where(key)}={value!r} must be {what}")
    return int(value)


def _int_list(cfg: Dict[str, Any], key: str, ok: Callable[[float], bool], what: str, floats: bool = False) -> List[Any]:
    value = cfg.get(key)
    good = isinstance(value, (list, tuple)) and len(value) > 0
    out: List[Any] = []
    for v in value if good else []:
        number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not (number and ok(v) and (floats or v == int(v))):
            good = False
            break
        out.append(float(v) if floats else int(v))
    if not good:
        raise UserError(f"{_where(key)}={value!r} must be a non-empty list of {what}, one per stage")
    return out


def _enum(cfg: Dict[str, Any], key: str, default: str, enum: Any) -> Any:
    value = cfg.get(key, default)
    names = [m.name.lower() for m in enum]
    if not isinstance(value, str) or value.lower() not in names:
        raise UserError(f"{_where(key)}={value!r} is not supported; valid: {', '.join(names)}")
    return enum[value.upper()]


def _common_params(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """The stem/block/activation/SE/BN options shared by RegNet and AnyNet (classy's defaults)."""
    use_se = cfg.get("use_se", True)
    if not isinstance(use_se, bool):
        raise UserError(f"{_where('use_se')}={use_se!r} must be true or false")
    return {
        "stem_type": _enum(cfg, "stem_type", "simple_stem_in", StemType),
        "stem_width": _int(cfg, "stem_width", 32, lambda v: v > 0, "a positive integer"),
        "block_type": _enum(cfg, "block_type", "res_bottleneck_block", BlockType),
        "activation": _enum(cfg, "activation", "relu", ActivationType),
        "use_se": use_se,
        "se_ratio": _number(cfg, "se_ratio", 0.25, lambda v: 0 < v <= 1, "a number in (0, 1]"),
        "bn_epsilon": _number(cfg, "bn_epsilon", 1e-5, lambda v: v > 0, "a number > 0"),
        "bn_momentum": _number(cfg, "bn_momentum", 0.1, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    }


def _check_keys(cfg: Dict[str, Any], allowed: List[str], what: str) -> None:
    for key in cfg:
        if key not in allowed and key not in NOT_ACTED_ON:
            near = closest(str(key), allowed)
            hint = f"did you mean {', '.join(near)}? " if near else ""
            raise UserError(f"{_where(str(key))} is not an option of {what}; {hint}valid: {', '.join(allowed)}")
    for key in NOT_ACTED_ON:
        if key in cfg:
            logger.warning("%s (VISSL's regnet_fsdp activation checkpointing) is not acted on", _where(key))


def _regnet_params(cfg: Dict[str, Any]) -> RegNetParams:
    _check_keys(cfg, ["name", *REGNET_REQUIRED, *REGNET_OPTIONAL], "an explicit RegNet")
    missing = [k for k in REGNET_REQUIRED if k not in cfg]
    if missing:
        raise UserError(
            f"{KEY} needs {', '.join(missing)} for an explicit RegNet (depth, w_0, w_a, w_m, group_width), "
            f"or name: one of {', '.join(PRESETS)}"
        )
    return RegNetParams(
        depth=_int(cfg, "depth", None, lambda v: v > 0, "a positive integer (the number of blocks)"),
        w_0=_int(cfg, "w_0", None, lambda v: v > 0 and v % 8 == 0, "a positive multiple of 8"),
        w_a=_number(cfg, "w_a", None, lambda v: v >= 0, "a number >= 0"),
        w_m=_number(cfg, "w_m", None, lambda v: v > 1, "a number > 1"),
        group_width=_int(cfg, "group_width", None, lambda v: v > 0, "a positive integer"),
        bottleneck_multiplier=_number(cfg, "bottleneck_multiplier", 1.0, lambda v: v > 0, "a number > 0"),
        **_common_params(cfg),
    )


def _anynet_params(cfg: Dict[str, Any]) -> AnyNetParams:
    _check_keys(cfg, ["name", *ANYNET_REQUIRED, *COMMON_OPTIONAL], "an AnyNet (name: anynet)")
    missing = [k for k in ANYNET_REQUIRED if k not in cfg]
    if missing:
        raise UserError(f"{KEY} with name: anynet needs {', '.join(missing)} (one entry per stage)")
    lists = {
        "depths": _int_list(cfg, "depths", lambda v: v > 0, "positive integers"),
        "widths": _int_list(cfg, "widths", lambda v: v > 0, "positive integers"),
        "group_widths": _int_list(cfg, "group_widths", lambda v: v > 0, "positive integers"),
        "bottleneck_multipliers": _int_list(cfg, "bottleneck_multipliers", lambda v: v > 0, "numbers > 0", floats=True),
        "strides": _int_list(cfg, "strides", lambda v: v > 0, "positive integers"),
    }
    if len({len(v) for v in lists.values()}) != 1:
        sizes = ", ".join(f"{k}: {len(v)}" for k, v in lists.items())
        raise UserError(f"{KEY}: depths, widths, group_widths, bottleneck_multipliers and strides need one entry "
                        f"per stage, the same number each ({sizes})")
    return AnyNetParams(**lists, **_common_params(cfg))


def build_classy_regnet(trunk_config: Optional[Dict[str, Any]]) -> AnyNet:
    """The classy_vision network that ``MODEL.TRUNK.REGNET`` describes (see the module docstring)."""
    cfg = dict(trunk_config or {})
    if not cfg:
        raise UserError(
            f"{KEY} is empty: set name (one of {', '.join(PRESETS)}) or the RegNet parameters "
            "depth, w_0, w_a, w_m, group_width"
        )
    name = cfg.get("name")
    if name is not None and name not in PRESETS and name not in ("regnet", "anynet"):
        near = closest(str(name), PRESETS)
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        raise UserError(f"{_where('name')}={name!r} is not a known RegNet{hint}; known: {', '.join(PRESETS)}, "
                        "or regnet / anynet with explicit parameters")
    try:
        if name in PRESETS:
            ignored = sorted(str(k) for k in cfg if k != "name")
            if ignored:
                logger.warning("%s: %s ignored beside the preset name %r, as in VISSL; leave out name to set "
                               "the parameters yourself", KEY, ", ".join(ignored), name)
            return PRESETS[name]()
        if name == "anynet":
            return AnyNet(_anynet_params(cfg))
        return ClassyRegNet(_regnet_params(cfg))
    except UserError:
        raise
    except (ValueError, ZeroDivisionError, AssertionError, RuntimeError, KeyError) as err:
        # e.g. parameters whose widths round to zero channels
        raise UserError(f"{KEY}={cfg!r} does not give a valid network: {type(err).__name__}: {err}") from None


def _out_channels(module: nn.Module) -> int:
    """Channels a stem or stage gives: those of its last BatchNorm (each block ends with one)."""
    bns = [m for m in module.modules() if isinstance(m, nn.BatchNorm2d)]
    return bns[-1].num_features


@TRUNKS.register("regnet")
class RegNetTrunk(FeatureTrunk):
    """classy_vision's RegNet with VISSL's block names: conv1, res2.., avgpool, flatten."""

    def __init__(self, model_config: AttrDict, model_name: str = "regnet") -> None:
        super().__init__()
        self.model_name = model_name
        self.input_type = input_type(model_config)
        if stem_channels(self.input_type) != 3:
            raise UserError(
                f"config.MODEL.INPUT_TYPE={model_config.get('INPUT_TYPE')!r} is not supported by the regnet trunk "
                "(its stem takes 3 channels); valid: 'rgb', 'bgr'"
            )
        net = build_classy_regnet((model_config.get("TRUNK", {}) or {}).get("REGNET", {}))
        blocks: "OrderedDict[str, nn.Module]" = OrderedDict()
        blocks["conv1"] = net.stem
        dims = {"conv1": _out_channels(net.stem)}
        for i, (name, stage) in enumerate(net.trunk_output.named_children()):
            if not name.startswith("block"):
                raise ValueError(f"unexpected RegNet stage name {name!r}")
            blocks[f"res{i + 2}"] = stage
            dims[f"res{i + 2}"] = _out_channels(stage)
        last = dims[next(reversed(blocks))]
        blocks["avgpool"] = nn.AdaptiveAvgPool2d((1, 1))
        blocks["flatten"] = nn.Flatten(1)
        dims["avgpool"] = dims["flatten"] = last
        self.trunk_depth = net.trunk_depth
        self._set_blocks(blocks, OrderedDict((b, b) for b in blocks), dims, vector_layers=("avgpool", "flatten"))

    def _prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        return to_model_input(x, self.input_type, "regnet")
