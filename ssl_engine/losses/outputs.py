"""The model output a single-embedding loss works on (SimCLR, multi-crop SimCLR, Barlow Twins, MoCo).

The model gives a list of head outputs; these losses need exactly one tensor, the last head's
embedding. One helper, so that every such loss says the same thing when the heads do not fit.
"""

from typing import Any, Optional, Sequence, Union

import torch
import torch.nn as nn

from ssl_engine.errors import UserError


def single_output(output: Union[torch.Tensor, Sequence[Any]], loss_name: str) -> torch.Tensor:
    """``output`` itself, or the one tensor of a one-element list; a UserError naming ``loss_name``
    and config.MODEL.HEAD.PARAMS otherwise."""
    if isinstance(output, torch.Tensor):
        return output
    items = list(output)
    if len(items) != 1 or not isinstance(items[0], torch.Tensor):
        raise UserError(
            f"{loss_name} expects one head output (the embedding), got {len(items)}; check config.MODEL.HEAD.PARAMS"
        )
    return items[0]


def last_head_dims(model: nn.Module) -> Optional[Sequence[int]]:
    """``dims`` of the model's last head (its last part, for a sequence of heads), where it has
    them (mlp-style heads); None otherwise."""
    heads = list(getattr(model, "heads", []) or [])
    if not heads:
        return None
    last = heads[-1]
    if isinstance(last, nn.Sequential) and len(last):
        last = last[-1]
    dims = getattr(last, "dims", None)
    return dims if isinstance(dims, (list, tuple)) and dims else None


def check_embedding_dim(model: nn.Module, embedding_dim: int, key: str) -> None:
    """A UserError naming ``key`` when the last head's output size (``dims[-1]``) is not
    ``embedding_dim`` (checked before launch, on the model the config builds)."""
    dims = last_head_dims(model)
    if dims is not None and int(dims[-1]) != int(embedding_dim):
        heads = list(getattr(model, "heads", []) or [])
        last = heads[-1][-1] if isinstance(heads[-1], nn.Sequential) and len(heads[-1]) else heads[-1]
        where = getattr(last, "config_key", None) or "the last entry of config.MODEL.HEAD.PARAMS"
        raise UserError(f"{key}={embedding_dim} does not match the embedding size dims[-1]={dims[-1]} of {where}; "
                        f"make them equal")
