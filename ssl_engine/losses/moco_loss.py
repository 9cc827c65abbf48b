"""MoCo's contrastive loss against a queue of keys (He et al. 2020; VISSL's ``moco_loss``).

Input: the query encoder's output ``[n, D]`` (view 0 of each image, from ``moco_collator``)
and, set by :class:`ssl_engine.hooks.MoCoHook` at every forward, ``self.key``: the momentum
encoder's normalised output for view 1 of the same images. Each query's positive is its own
key; its negatives are the ``queue_size`` keys of earlier batches in the queue. The loss is the
cross entropy of ``[q.k, q.queue] / temperature`` with the positive as the class. After each
training step the batch's keys, gathered from every rank, replace the oldest ones in the queue
(round robin), so every rank holds the same queue.

The momentum encoder is a submodule of this loss (attached by the hook at the start of a run),
so the loss's ``state_dict`` holds it, the queue and the queue pointer: a checkpoint keeps them
and a resumed run goes on with the same keys and negatives.
"""

import logging
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from classy_vision.losses import ClassyLoss

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.errors import CheckpointError, UserError
from ssl_engine.gather import is_distributed
from ssl_engine.losses.outputs import single_output
from ssl_engine.registry import LOSSES

log = logging.getLogger(__name__)

KEY = "config.LOSS.moco_loss"


@torch.no_grad()
def gather_keys(keys: torch.Tensor) -> torch.Tensor:
    """Every rank's keys, concatenated in rank order (no gradient; one process: ``keys``)."""
    if not is_distributed():
        return keys
    parts: List[torch.Tensor] = [torch.empty_like(keys) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, keys.contiguous())
    return torch.cat(parts)


@LOSSES.register("moco_loss")
class MoCoLoss(ClassyLoss):
    """MoCo's loss; options under ``config.LOSS.moco_loss`` (embedding_dim, queue_size, momentum,
    temperature: VISSL's keys; ``momentum`` is the MoCoHook's)."""

    def __init__(self, embedding_dim: int = 128, queue_size: int = 65536, momentum: float = 0.999,
                 temperature: float = 0.2) -> None:
        super().__init__()
        for key, value in (("embedding_dim", embedding_dim), ("queue_size", queue_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise UserError(f"{KEY}.{key}={value!r} must be a positive integer")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
            raise UserError(f"{KEY}.temperature={temperature!r} must be a number > 0")
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum <= 1:
            raise UserError(f"{KEY}.momentum={momentum!r} must be a number in [0, 1]")
        self.embedding_dim = int(embedding_dim)
        self.queue_size = int(queue_size)
        self.momentum = float(momentum)
        self.temperature = float(temperature)
        # random unit keys to start with, as in MoCo; replaced batch by batch
        self.register_buffer("queue", F.normalize(torch.randn(self.embedding_dim, self.queue_size), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))
        # the pointer as a host int, so that a step on a GPU does not wait for the device to read it
        # (read from the buffer at the first step and after any state is loaded; None until then)
        self._ptr: Optional[int] = None
        self.moco_encoder: Optional[nn.Module] = None  # attached by MoCoHook (a submodule: checkpointed)
        self.key: Optional[torch.Tensor] = None  # the momentum encoder's keys of the current batch
        self._pending_state: Optional[Dict[str, Any]] = None

    @classmethod
    def from_config(cls, loss_config: AttrDict) -> "MoCoLoss":
        """Build from ``config.LOSS.moco_loss``."""
        cfg = loss_config or {}
        return cls(embedding_dim=cfg.get("embedding_dim", 128), queue_size=cfg.get("queue_size", 65536),
                   momentum=cfg.get("momentum", 0.999), temperature=cfg.get("temperature", 0.2))

    # ------------------------------------------------------------------ the momentum encoder
    def attach_encoder(self, encoder: nn.Module) -> None:
        """Take ``encoder`` (a copy of the model) as the momentum encoder; a checkpoint's state
        loaded before it existed (a resumed run) is applied now."""
        for p in encoder.parameters():
            p.requires_grad_(False)
        self.moco_encoder = encoder
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self._ptr = None
            try:
                super().load_state_dict(state)
            except RuntimeError as e:
                raise CheckpointError(f"the checkpoint's MoCo momentum encoder does not fit this model "
                                      f"({' '.join(str(e).split())[:300]})") from None

    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True, **kwargs: Any) -> Any:
        """A checkpoint's state; its momentum encoder waits until the hook has attached one. The
        queue is checked at once: one of another size is a CheckpointError naming the keys."""
        self._check_queue(state_dict)
        self._ptr = None
        if self.moco_encoder is None and any(k.startswith("moco_encoder.") for k in state_dict):
            self._pending_state = dict(state_dict)
            return None
        return super().load_state_dict(state_dict, strict=strict, **kwargs)

    def _check_queue(self, state_dict: Dict[str, Any]) -> None:
        queue = state_dict.get("queue")
        if isinstance(queue, torch.Tensor) and queue.shape != self.queue.shape:
            raise CheckpointError(
                f"the checkpoint's MoCo queue is {list(queue.shape)} (embedding_dim x queue_size) but {KEY} gives "
                f"{list(self.queue.shape)}; resume with the checkpoint's embedding_dim and queue_size"
            )

    def check_global_batches(self, batch: int, last: int, world_size: int) -> None:
        """Before launch: the keys of each training step (``batch`` over ``world_size`` ranks, and
        ``last`` in the short last step of an epoch, 0 when there is none) fill the queue in
        whole steps, as :meth:`_enqueue` needs: a short last step beside full ones is refused
        even when it divides the queue, since it leaves the pointer between two full steps' places.
        A UserError naming the keys to change."""
        ranks = f"{world_size} rank{'s' if world_size != 1 else ''}"
        if batch and self.queue_size % batch:
            raise UserError(
                f"{KEY}.queue_size={self.queue_size} must be a multiple of the global batch ({batch} keys per step: "
                f"config.DATA.TRAIN.BATCHSIZE_PER_REPLICA={batch // world_size} x {ranks}), as in VISSL"
            )
        if last and self.queue_size % last:
            raise UserError(
                f"{KEY}.queue_size={self.queue_size} must be a multiple of the keys of every step, but the last step "
                f"of each epoch holds {last} ({last // world_size} per rank x {ranks}, what is left of the data after "
                f"the full batches): set config.DATA.TRAIN.DROP_LAST=true to leave it out, or change "
                f"BATCHSIZE_PER_REPLICA or the number of samples"
            )
        if last and batch:
            # steps of `batch` keys fill the queue from multiples of `batch`; after the short step
            # the pointer is off them, and a later full step's keys would reach past the queue's end
            raise UserError(
                f"{KEY}.queue_size={self.queue_size} takes the keys of whole steps of {batch} from the start of the "
                f"queue, but the last step of each epoch holds {last} ({last // world_size} per rank x {ranks}, what "
                f"is left of the data after the full batches): after it the next epoch's steps would reach past "
                f"the queue's end; set config.DATA.TRAIN.DROP_LAST=true to leave it out, or change "
                f"BATCHSIZE_PER_REPLICA or the number of samples so that the batches divide them"
            )

    # ------------------------------------------------------------------ forward
    def forward(self, output: Union[torch.Tensor, Sequence[torch.Tensor]], target: Any = None) -> torch.Tensor:
        """The loss of this rank's queries; in training mode the keys then enter the queue."""
        query = single_output(output, "moco_loss")
        if query.ndim != 2 or query.shape[1] != self.embedding_dim:
            raise UserError(
                f"{KEY}.embedding_dim={self.embedding_dim} does not match the head's output of shape "
                f"{tuple(query.shape)}; make it equal to the last head's output size"
            )
        if self.key is None:
            raise UserError(
                "moco_loss has no keys: they come from the MoCoHook, which default_hooks adds when "
                "config.LOSS.name is moco_loss (and the data from COLLATE_FUNCTION: moco_collator)"
            )
        key, self.key = self.key, None
        with torch.autocast(device_type=query.device.type, enabled=False):
            q = F.normalize(query.float(), dim=1)
            k = key.float()
            positive = (q * k).sum(dim=1, keepdim=True)
            negatives = q @ self.queue.clone().detach().float()
            logits = torch.cat([positive, negatives], dim=1) / self.temperature
            loss = F.cross_entropy(logits, torch.zeros(q.shape[0], dtype=torch.long, device=q.device))
        if self.training:
            self._enqueue(key)
        return loss

    @torch.no_grad()
    def _enqueue(self, key: torch.Tensor) -> None:
        keys = gather_keys(key)
        n = keys.shape[0]
        if self.queue_size % n:
            raise UserError(
                f"{KEY}.queue_size={self.queue_size} must be a multiple of the global batch ({n} keys per step: "
                f"BATCHSIZE_PER_REPLICA x ranks), as in VISSL"
            )
        ptr = int(self.queue_ptr) if self._ptr is None else self._ptr
        if ptr + n > self.queue_size:  # a short step before left the pointer between two steps' places
            raise UserError(
                f"{KEY}.queue_size={self.queue_size}: this step's {n} keys, at queue position {ptr}, reach past the "
                f"queue's end: a short step before (the last batch of an epoch) left the position off the multiples "
                f"of the global batch; set config.DATA.TRAIN.DROP_LAST=true"
            )
        self.queue[:, ptr:ptr + n] = keys.t().to(self.queue.dtype)
        self._ptr = (ptr + n) % self.queue_size
        self.queue_ptr.fill_(self._ptr)  # the checkpointed copy: written, never read back per step

    def extra_repr(self) -> str:
        return (f"embedding_dim={self.embedding_dim}, queue_size={self.queue_size}, momentum={self.momentum}, "
                f"temperature={self.temperature}")

