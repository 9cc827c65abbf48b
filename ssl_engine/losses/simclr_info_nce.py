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
from ssl_engine.losses.outputs import single_output
from ssl_engine.registry import LOSSES


@LOSSES.register("simclr_info_nce_loss")
class SimclrInfoNCELoss(ClassyLoss):
    """NT-Xent over the global batch, computed in float32 whatever the autocast dtype.

    Args:
        temperature: similarities (cosine, in [-1, 1]) are divided by it.
        buffer_params: accepted for VISSL config compatibility (``embedding_dim``,
            ``world_size``, ``effective_batch_size``); the loss derives the batch layout
            from the tensors it receives, so it needs no precomputed masks.
    """

    CONFIG_KEY = "config.LOSS.simclr_info_nce_loss"

    def __init__(self, temperature: float = 0.1, buffer_params: Union[Dict[str, Any], None] = None) -> None:
        super().__init__()
        if not temperature > 0:
            raise UserError(f"{self.CONFIG_KEY}.temperature={temperature!r} must be > 0")
        self.temperature = float(temperature)
        self.buffer_params = dict(buffer_params or {})

    @classmethod
    def from_config(cls, loss_config: AttrDict) -> "SimclrInfoNCELoss":
        """Build from ``config.LOSS.simclr_info_nce_loss``."""
        cfg = loss_config or {}
        return cls(temperature=cfg.get("temperature", 0.1), buffer_params=cfg.get("buffer_params", {}))

    @staticmethod
    def _embedding(output: Union[torch.Tensor, Sequence[torch.Tensor]]) -> torch.Tensor:
        output = single_output(output, "simclr_info_nce_loss")
        if output.ndim != 2 or output.shape[0] % 2:
            raise ValueError(
                f"simclr_info_nce_loss expects embeddings of shape [2n, D] (two views per image), "
                f"got {tuple(output.shape)}"
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
