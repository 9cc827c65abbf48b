"""MoCoHook: MoCo's momentum encoder, added by default_hooks when ``config.LOSS.name`` is
``moco_loss`` (VISSL's MoCoHook).

- At the start of a run: a copy of the model becomes the momentum encoder, held by the loss
  (so checkpoints keep it; a resumed run gets the checkpoint's encoder back).
- At every forward: in a train phase the encoder's weights first move towards the model's,
  ``w_k = m * w_k + (1 - m) * w_q`` (m = ``LOSS.moco_loss.momentum``; its batch-norm statistics
  are its own, from its own forward passes, as in MoCo), then it encodes view 1 of the batch (``data_momentum``, from
  ``moco_collator``) into the normalised keys the loss uses. With several ranks and no
  SyncBatchNorm the key batch is shuffled across the ranks before the encoder and put back in
  order after it (MoCo's shuffled BN), so batch-norm statistics cannot pair a query with its key.
- Before a test phase (the encoder in eval mode, on its running statistics): every rank takes
  rank 0's encoder buffers, those a checkpoint holds.

Unlike VISSL, the update runs at every training step of a resumed run too (VISSL builds the
encoder at the first forward after a resume and skips that step's update), so a resumed run
computes what an uninterrupted one would.
"""

import copy
from typing import Any, Dict, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ssl_engine import distributed as du
from ssl_engine.errors import UserError
from ssl_engine.gather import is_distributed
from ssl_engine.hooks.base import Priority, SSLHook
from ssl_engine.losses.moco_loss import gather_keys
from ssl_engine.registry import HOOKS


@HOOKS.register("MoCoHook")
class MoCoHook(SSLHook):
    """Keeps the momentum encoder and hands the loss its keys at each forward."""

    priority = Priority.VERY_HIGH  # the keys must be there before any hook or the loss reads them

    def __init__(self, momentum: float, shuffle_batch: bool = True) -> None:
        super().__init__()
        self.momentum = float(momentum)
        self.shuffle_batch = bool(shuffle_batch)

    def on_start(self, task: Any) -> None:
        attach = getattr(task.loss, "attach_encoder", None)
        if not callable(attach):
            raise UserError("MoCoHook needs config.LOSS.name=moco_loss (the loss holds the momentum encoder)")
        if task.loss.moco_encoder is None:
            attach(copy.deepcopy(task.base_model))
        if is_distributed():
            # each rank drew its initial queue under its own seed; a checkpoint keeps rank 0's and
            # gives it to every rank, so every rank starts from rank 0's (a no-op on resume): the
            # run then computes the same whether or not it was resumed
            dist.broadcast(task.loss.queue, src=0)

    @torch.no_grad()
    def on_phase_start(self, task: Any) -> None:
        """Before a test phase, every rank takes rank 0's encoder buffers (BatchNorm statistics).

        In training the encoder normalises with batch statistics, and each rank's running ones
        follow its own share of the keys; a test phase runs the encoder in eval mode, on the running
        ones. Rank 0's are those a checkpoint holds, and those every rank of a resumed run starts
        from: without this, each rank tested with its own, and a resumed run's test loss differed
        from an uninterrupted one's."""
        encoder = getattr(task.loss, "moco_encoder", None)
        if task.train or encoder is None or not is_distributed():
            return
        du.broadcast_from_rank0(encoder.buffers())

    @torch.no_grad()
    def _update_encoder(self, task: Any) -> None:
        encoder, model = task.loss.moco_encoder, task.base_model
        keys = list(encoder.parameters())
        queries = list(model.parameters())
        torch._foreach_mul_(keys, self.momentum)
        torch._foreach_add_(keys, queries, alpha=1.0 - self.momentum)

    @torch.no_grad()
    def on_forward(self, task: Any) -> None:
        encoder = task.loss.moco_encoder
        batch = task.last_batch
        if not isinstance(batch, dict) or "data_momentum" not in batch:
            raise UserError(
                "moco_loss needs the momentum view of each image: set config.DATA.<split>.COLLATE_FUNCTION "
                "to moco_collator (with {name: ImgReplicatePil, num_times: 2} first in TRANSFORMS)"
            )
        if task.train:
            self._update_encoder(task)
        encoder.train(task.train)
        images = batch["data_momentum"]
        images = images[0] if isinstance(images, (list, tuple)) else images
        shuffle = self.shuffle_batch and is_distributed() and task.train
        if shuffle:
            images, restore = self._shuffle(images)
        out = encoder(images)
        keys = F.normalize((out[0] if isinstance(out, (list, tuple)) else out).float(), dim=1)
        if shuffle:
            keys = self._unshuffle(keys, restore)
        task.loss.key = keys

    @staticmethod
    def _shuffle(images: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the global key batch after one permutation drawn on rank 0."""
        everyone = gather_keys(images)
        order = torch.randperm(everyone.shape[0], device=images.device)
        dist.broadcast(order, src=0)
        mine = order.view(dist.get_world_size(), -1)[dist.get_rank()]
        return everyone[mine], torch.argsort(order)

    @staticmethod
    def _unshuffle(keys: torch.Tensor, restore: torch.Tensor) -> torch.Tensor:
        everyone = gather_keys(keys)
        return everyone[restore.view(dist.get_world_size(), -1)[dist.get_rank()]]

    def get_classy_state(self) -> Dict[str, Any]:
        return {}  # the encoder is the loss's state

    def set_classy_state(self, state: Dict[str, Any]) -> None:
        pass
