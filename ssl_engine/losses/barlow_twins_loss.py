"""Barlow Twins' redundancy-reduction loss (Zbontar et al. 2021), VISSL's ``barlow_twins_loss``.

The model's output for a local batch of n images is ``[2n, D]``: all images' view 0, then their
view 1 (the order ``simclr_collator`` and the model give). Each view's embeddings are
standardised per dimension over the *global* batch (mean and biased variance over the N = n *
world size images of every rank, ``eps`` = 1e-5 under the square root, as a batch norm without
affine parameters). The cross-correlation matrix ``c = z_a^T z_b / N`` (D x D) is the sum of the
ranks' partial products, and the loss is::

    scale_loss * ( sum_i (1 - c_ii)^2 + lambda_ * sum_{i != j} c_ij^2 )

Every rank returns the same value, the loss of the global batch. The sums over ranks (the
statistics and ``c``) go through :func:`ssl_engine.gather.all_reduce_sum_with_grad`, whose
backward sums the ranks' gradients: each rank's embeddings get world-size times their share of
the gradient, and DDP's averaging makes the parameter gradients those of one process over the
concatenated batch. (VISSL all-reduces ``c`` outside autograd, so its parameter gradient is the
single-process one divided by the world size.)

Computed in float32 whatever the autocast dtype.
"""

from typing import Any, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from classy_vision.losses import ClassyLoss

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.errors import UserError
from ssl_engine.gather import all_reduce_sum_with_grad, is_distributed
from ssl_engine.losses.outputs import check_embedding_dim, single_output
from ssl_engine.registry import LOSSES

KEY = "config.LOSS.barlow_twins_loss"

#: added to the variance under the square root (VISSL's and BatchNorm's value)
EPS = 1e-5


def _number(value: Any, key: str, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 if positive else value >= 0):
        raise UserError(f"{KEY}.{key}={value!r} must be a number {'> 0' if positive else '>= 0'}")
    return float(value)


@LOSSES.register("barlow_twins_loss")
class BarlowTwinsLoss(ClassyLoss):
    """Barlow Twins over the global batch; options under ``config.LOSS.barlow_twins_loss``.

    Args:
        lambda_: weight of the off-diagonal (redundancy) terms.
        scale_loss: the whole loss is multiplied by it.
        embedding_dim: D, the size of the embeddings (the last head's output); checked.
    """

    #: images per step (all ranks) below which the loss has no gradient; checked before launch
    min_global_batch = 2

    def __init__(self, lambda_: float = 0.0051, scale_loss: float = 0.024, embedding_dim: int = 8192) -> None:
        super().__init__()
        self.lambda_ = _number(lambda_, "lambda_", positive=False)
        self.scale_loss = _number(scale_loss, "scale_loss", positive=True)
        if isinstance(embedding_dim, bool) or not isinstance(embedding_dim, int) or embedding_dim <= 0:
            raise UserError(f"{KEY}.embedding_dim={embedding_dim!r} must be a positive integer")
        self.embedding_dim = int(embedding_dim)

    @classmethod
    def from_config(cls, loss_config: AttrDict) -> "BarlowTwinsLoss":
        """Build from ``config.LOSS.barlow_twins_loss``."""
        cfg = loss_config or {}
        return cls(lambda_=cfg.get("lambda_", 0.0051), scale_loss=cfg.get("scale_loss", 0.024),
                   embedding_dim=cfg.get("embedding_dim", 8192))

    def check_model(self, model: nn.Module) -> None:
        """The last head's output size (its ``dims[-1]``, where it has dims) is ``embedding_dim``."""
        check_embedding_dim(model, self.embedding_dim, f"{KEY}.embedding_dim")

    def _embedding(self, output: Union[torch.Tensor, Sequence[torch.Tensor]]) -> torch.Tensor:
        output = single_output(output, "barlow_twins_loss")
        if output.ndim != 2 or output.shape[1] != self.embedding_dim:
            raise UserError(
                f"{KEY}.embedding_dim={self.embedding_dim} does not match the embeddings of shape "
                f"{tuple(output.shape)}; make it the last head's output size"
            )
        if output.shape[0] % 2 or output.shape[0] < 2:
            raise UserError(
                f"barlow_twins_loss expects two views per image (rows: all view 0, then all view 1; "
                f"ImgReplicatePil num_times: 2 and simclr_collator), got {output.shape[0]} rows"
            )
        return output

    def forward(self, output: Union[torch.Tensor, Sequence[torch.Tensor]], target: Any = None) -> torch.Tensor:
        """The loss of the global batch (the same value on every rank); ``target`` is unused."""
        embedding = self._embedding(output)
        with torch.autocast(device_type=embedding.device.type, enabled=False):
            views = embedding.float().view(2, embedding.shape[0] // 2, self.embedding_dim)  # [2, n, D]
            n_global = views.shape[1] * (dist.get_world_size() if is_distributed() else 1)
            mean = all_reduce_sum_with_grad(views.sum(dim=1, keepdim=True)) / n_global
            centered = views - mean
            var = all_reduce_sum_with_grad(centered.pow(2).sum(dim=1, keepdim=True)) / n_global
            normed = centered / torch.sqrt(var + EPS)
            c = all_reduce_sum_with_grad(normed[0].t() @ normed[1]) / n_global  # [D, D]
            diag = torch.diagonal(c)
            on_diag = (diag - 1).pow(2).sum()
            d = self.embedding_dim
            # the entries after each diagonal one, up to the next: every off-diagonal entry once
            off_diag = c.flatten()[1:].view(d - 1, d + 1)[:, :d].pow(2).sum() if d > 1 else c.new_zeros(())
            return self.scale_loss * (on_diag + self.lambda_ * off_diag)

    def extra_repr(self) -> str:
        return f"lambda_={self.lambda_}, scale_loss={self.scale_loss}, embedding_dim={self.embedding_dim}"
