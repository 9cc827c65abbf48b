"""Pool ops applied to trunk layers for linear evaluation and feature extraction.

VISSL names them in ``MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP`` as a list of
``[layer_name, [pool_op_name, [args]]]``, where ``pool_op_name`` is a ``torch.nn`` module name::

    [["res5avg", ["Identity", []]], ["res4", ["AdaptiveAvgPool2d", [[2, 2]]]]]

This module turns that list into ``(layer_name, nn.Module)`` pairs, with a UserError for each
thing the user can get wrong, and knows how many spatial positions a pool op leaves so that
head dimensions can be checked before the first batch.
"""

import math
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import torch.nn as nn

from ssl_engine.errors import UserError, did_you_mean

POOL_OPS_KEY = "config.MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP"


def _as_tuple(value: Any) -> Any:
    """yaml gives lists; torch pool ops want ints or tuples (``[2, 2]`` -> ``(2, 2)``)."""
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuple(v) for v in value)
    return value


def _nn_module_names() -> List[str]:
    return sorted(
        n for n in dir(nn) if isinstance(getattr(nn, n), type) and issubclass(getattr(nn, n), nn.Module)
    )


def build_pool_op(name: str, args: Sequence[Any], where: str = POOL_OPS_KEY) -> nn.Module:
    """The ``torch.nn`` module ``name`` built with positional ``args`` (lists become tuples)."""
    op_cls = getattr(nn, str(name), None)
    if not (isinstance(op_cls, type) and issubclass(op_cls, nn.Module)):
        raise UserError(
            f"{where}: pool op {name!r} is not a torch.nn module{did_you_mean(str(name), _nn_module_names())}; "
            "use e.g. 'Identity', 'AdaptiveAvgPool2d', 'AdaptiveMaxPool2d', 'AvgPool2d', 'MaxPool2d'"
        )
    if args is None:
        args = []
    if not isinstance(args, (list, tuple)):
        raise UserError(f"{where}: arguments of pool op {name!r} must be a list, got {args!r}")
    try:
        return op_cls(*[_as_tuple(a) for a in args])
    except (TypeError, ValueError) as err:
        raise UserError(f"{where}: cannot build pool op {name}({', '.join(map(repr, args))}): {err}") from None


def parse_feat_pool_ops_map(
    pool_ops_map: Optional[Iterable[Any]], valid_layers: Optional[Sequence[str]] = None
) -> List[Tuple[str, nn.Module]]:
    """``[[layer, [op_name, [args]]], ...]`` -> ``[(layer, op_module), ...]`` in the given order.

    ``valid_layers`` (the trunk's feature names), when given, is used to reject unknown layers
    at build time rather than at the first batch. A layer may appear more than once, as in
    VISSL (several heads on one layer); its outputs are then named by
    :func:`ssl_engine.config.infer.feature_output_names`.
    """
    result: List[Tuple[str, nn.Module]] = []
    for idx, entry in enumerate(pool_ops_map or []):
        where = f"{POOL_OPS_KEY}[{idx}]"
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], str)):
            raise UserError(
                f"{where} must be [layer_name, [pool_op_name, [args]]], "
                f"e.g. ['res5avg', ['Identity', []]]; got {entry!r}"
            )
        layer, op_spec = entry
        if valid_layers is not None and layer not in valid_layers:
            raise UserError(
                f"{where}: unknown trunk layer {layer!r}{did_you_mean(layer, valid_layers)}; "
                f"valid layers: {', '.join(valid_layers)}"
            )
        if isinstance(op_spec, str):
            op_name, args = op_spec, []
        elif isinstance(op_spec, (list, tuple)) and 1 <= len(op_spec) <= 2 and isinstance(op_spec[0], str):
            op_name = op_spec[0]
            args = op_spec[1] if len(op_spec) == 2 else []
        else:
            raise UserError(
                f"{where}: pool op must be [pool_op_name, [args]], e.g. ['AdaptiveAvgPool2d', [[2, 2]]]; "
                f"got {op_spec!r}"
            )
        result.append((layer, build_pool_op(op_name, args, where)))
    return result


def pooled_positions(op: nn.Module, input_is_vector: bool) -> Optional[int]:
    """How many spatial positions ``op`` leaves per channel, or None when it depends on the input size.

    ``input_is_vector`` says the layer is [N, C] or [N, C, 1, 1] whatever the image size
    (e.g. res5avg); then shape-keeping ops leave one position.
    """
    if isinstance(op, (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.AdaptiveAvgPool1d, nn.AdaptiveMaxPool1d)):
        size = op.output_size
        sizes = list(size) if isinstance(size, (tuple, list)) else [size] * (1 if "1d" in type(op).__name__ else 2)
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes):
            return None  # None (the input's size) or a bad value: the op says which when it runs
        return int(math.prod(sizes))
    if input_is_vector and isinstance(op, (nn.Identity, nn.Flatten)):
        return 1
    return None
