"""SimCLR's NT-Xent with more than two crops per image (VISSL's ``multicrop_simclr_info_nce_loss``).

The model's output for a local batch of n images with C crops each is ``[C*n, D]`` in
crop-major order (all images' crop 0, then crop 1, ...), the order ``multicrop_collator`` and
the model give. For each row (crop c of image j) and each shift d in 1..C-1, the positive is
crop ``(c + d) mod C`` of the same image; the negatives are every row of the *global* batch
that belongs to another image. The loss is the mean over rows and shifts of
``-log(exp(s_pos) / (exp(s_pos) + sum_neg exp(s_neg)))``, with cosine similarities divided
by the temperature. With C = 2 it is ``simclr_info_nce_loss``.

VISSL's version takes the negatives of a multi-rank run from the rank's own rows only (its
mask leaves the other ranks' rows out, unlike its two-crop SimCLR loss); here they come from
every rank, as in the two-crop loss, so the loss of a global batch does not depend on how many
ranks share it. On one rank the two agree.
"""

from typing import Any, Dict, Sequence, Union

import torch
import torch.distributed as dist
from classy_vision.losses import ClassyLoss

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.errors import UserError
from ssl_engine.gather import gather_with_grad, is_distributed
from ssl_engine.losses.outputs import single_output
from ssl_engine.registry import LOSSES

KEY = "config.LOSS.multicrop_simclr_info_nce_loss"


@LOSSES.register("multicrop_simclr_info_nce_loss")
class MultiCropSimclrInfoNCELoss(ClassyLoss):
    """NT-Xent over C crops per image and the global batch, in float32 whatever the autocast dtype.

    Args:
        temperature: similarities (cosine, in [-1, 1]) are divided by it.
        num_crops: crops per image (C >= 2); set from ImgPilToMultiCrop's ``total_num_crops``
            when the config leaves it at its default (see ssl_engine/config/infer.py).
        buffer_params: accepted for VISSL config compatibility; the layout is read from the
            tensors, so no masks are precomputed.
    """

    #: images per step (all ranks) below which the loss has no gradient; checked before launch
    min_global_batch = 2

    def __init__(self, temperature: float = 0.1, num_crops: int = 2,
                 buffer_params: Union[Dict[str, Any], None] = None) -> None:
        super().__init__()
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
            raise UserError(f"{KEY}.temperature={temperature!r} must be a number > 0")
        if isinstance(num_crops, bool) or not isinstance(num_crops, int) or num_crops < 2:
            raise UserError(f"{KEY}.num_crops={num_crops!r} must be an integer >= 2 (crops per image)")
        self.temperature = float(temperature)
        self.num_crops = int(num_crops)
        self.buffer_params = dict(buffer_params or {})

    @classmethod
    def from_config(cls, loss_config: AttrDict) -> "MultiCropSimclrInfoNCELoss":
        """Build from ``config.LOSS.multicrop_simclr_info_nce_loss``."""
        cfg = loss_config or {}
        return cls(temperature=cfg.get("temperature", 0.1), num_crops=cfg.get("num_crops", 2),
                   buffer_params=cfg.get("buffer_params", {}))

    def _embedding(self, output: Union[torch.Tensor, Sequence[torch.Tensor]]) -> torch.Tensor:
        output = single_output(output, "multicrop_simclr_info_nce_loss")
        if output.ndim != 2 or output.shape[0] % self.num_crops:
            raise UserError(
                f"multicrop_simclr_info_nce_loss got embeddings of shape {tuple(output.shape)}, which is not "
                f"{KEY}.num_crops={self.num_crops} crops of equal batches; num_crops must be the number of "
                f"crops each image gives (ImgPilToMultiCrop's total_num_crops)"
            )
        return output

    def forward(self, output: Union[torch.Tensor, Sequence[torch.Tensor]], target: Any = None) -> torch.Tensor:
        """Mean loss of the local rows; ``target`` is unused (positives come from the layout)."""
        embedding = self._embedding(output)
        with torch.autocast(device_type=embedding.device.type, enabled=False):
            local = torch.nn.functional.normalize(embedding.float(), dim=1, p=2)
            everyone = gather_with_grad(local)
            rows, crops = local.shape[0], self.num_crops
            n = rows // crops
            offset = (dist.get_rank() if is_distributed() else 0) * rows
            logits = local @ everyone.t() / self.temperature  # [C*n, C*n*ranks]
            idx = torch.arange(rows, device=local.device)
            # every crop of the row's own image (itself and its positives) is left out of the negatives
            same = torch.zeros_like(logits, dtype=torch.bool)
            image = idx % n
            for c in range(crops):
                same[idx, offset + c * n + image] = True
            negatives = torch.logsumexp(logits.masked_fill(same, float("-inf")), dim=1)
            terms = []
            for d in range(1, crops):
                positive = logits[idx, offset + (idx + d * n) % rows]
                terms.append(torch.logaddexp(positive, negatives) - positive)
            return torch.stack(terms).mean()
