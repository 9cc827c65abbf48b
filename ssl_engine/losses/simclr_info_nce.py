"""SimCLR's NT-Xent (InfoNCE) loss with negatives from every rank.

The model's output for a local batch of n images is ``[2n, D]``: the first view of all n
images, then their second view (the order VISSL's simclr collator produces). Each row's
positive is the other view of the same image; its negatives are all other rows of the
*global* batch, gathered from every rank with a gradient-carrying all-gather.

Each rank returns the mean loss over its own 2n rows. With equal local batch sizes, the
mean of the ranks' values equals the single-process loss over the concatenated batch,
and (through :func:`ssl_engine.gather.gather_with_grad` and DDP's gradient averaging)
so do the parameter gradients.
"""

from typing import Any, Dict, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from classy_vision.losses import ClassyLoss

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.errors import UserError
from ssl_engine.gather import gather_with_grad, is_distributed
from ssl_engine.losses.outputs import check_embedding_dim, single_output
from ssl_engine.registry import LOSSES


@LOSSES.register("simclr_info_nce_loss")
class SimclrInfoNCELoss(ClassyLoss):
    """NT-Xent over the global batch, computed in float32 whatever the autocast dtype.

    Args:
        temperature: similarities (cosine, in [-1, 1]) are divided by it.
        buffer_params: VISSL's; ``embedding_dim`` is the last head's output size, checked
            against the model before launch and against the embeddings (VISSL asserts it);
            ``world_size`` and ``effective_batch_size`` are accepted for compatibility: the
            loss derives the batch layout from the tensors it receives.
    """

    #: images per step (all ranks) below which the loss has no gradient; checked before launch
    min_global_batch = 2

    CONFIG_KEY = "config.LOSS.simclr_info_nce_loss"

    def __init__(self, temperature: float = 0.1, buffer_params: Union[Dict[str, Any], None] = None) -> None:
        super().__init__()
        if not temperature > 0:
            raise UserError(f"{self.CONFIG_KEY}.temperature={temperature!r} must be > 0")
        self.temperature = float(temperature)
        self.buffer_params = dict(buffer_params or {})
        dim = self.buffer_params.get("embedding_dim")
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0):
            raise UserError(f"{self.CONFIG_KEY}.buffer_params.embedding_dim={dim!r} must be a positive integer")
        self.embedding_dim = dim

    def check_model(self, model: torch.nn.Module) -> None:
        """The last head's output size (``dims[-1]``, where it has dims) is buffer_params.embedding_dim."""
        if self.embedding_dim is not None:
            check_embedding_dim(model, self.embedding_dim, f"{self.CONFIG_KEY}.buffer_params.embedding_dim")

    @classmethod
    def from_config(cls, loss_config: AttrDict) -> "SimclrInfoNCELoss":
        """Build from ``config.LOSS.simclr_info_nce_loss``."""
        cfg = loss_config or {}
        return cls(temperature=cfg.get("temperature", 0.1), buffer_params=cfg.get("buffer_params", {}))

    def _embedding(self, output: Union[torch.Tensor, Sequence[torch.Tensor]]) -> torch.Tensor:
        output = single_output(output, "simclr_info_nce_loss")
        if output.ndim != 2 or output.shape[0] % 2:
            raise ValueError(
                f"simclr_info_nce_loss expects embeddings of shape [2n, D] (two views per image), "
                f"got {tuple(output.shape)}"
            )
        if self.embedding_dim is not None and output.shape[1] != self.embedding_dim:
            raise UserError(
                f"{self.CONFIG_KEY}.buffer_params.embedding_dim={self.embedding_dim} does not match the embeddings "
                f"of shape {tuple(output.shape)}; make it the last head's output size"
            )
        return output

    def forward(self, output: Union[torch.Tensor, Sequence[torch.Tensor]], target: Any = None) -> torch.Tensor:
        """Mean NT-Xent of the local rows; ``target`` is unused (positives come from the layout)."""
        embedding = self._embedding(output)
        with torch.autocast(device_type=embedding.device.type, enabled=False):
            local = F.normalize(embedding.float(), dim=1, p=2)
            everyone = gather_with_grad(local)
            rows = local.shape[0]
            half = rows // 2
            rank = dist.get_rank() if is_distributed() else 0
            offset = rank * rows

            logits = local @ everyone.t() / self.temperature  # [2n, 2N_global]
            idx = torch.arange(rows, device=local.device)
            # A row is never its own negative.
            self_mask = torch.zeros_like(logits, dtype=torch.bool)
            self_mask[idx, offset + idx] = True
            logits = logits.masked_fill(self_mask, float("-inf"))
            # Row i (view v of image j) pairs with the other view of image j on this rank.
            positives = offset + (idx + half) % rows
            return F.cross_entropy(logits, positives)
