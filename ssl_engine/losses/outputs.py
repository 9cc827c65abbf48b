"""The model output a single-embedding loss works on (SimCLR, multi-crop SimCLR, Barlow Twins, MoCo).

The model gives a list of head outputs; these losses need exactly one tensor, the last head's
embedding. One helper, so that every such loss says the same thing when the heads do not fit.
"""

from typing import Any, Sequence, Union

import torch

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
