"""SwAV's swapped-prediction loss (Caron et al. 2020), with Sinkhorn-Knopp over all ranks and
an optional queue of past embeddings.

Input: the outputs of a ``swav_head``, ``[embedding, scores_0, scores_1, ...]`` (the embedding
is absent with ``return_embeddings: false``; then no queue), each with ``num_crops * n`` rows in
crop-major order (all n samples' crop 0, then crop 1, ...), the order ``multicrop_collator``
and the model give.

For each set of prototypes h and each crop ``a`` of ``crops_for_assign``: the scores of crop
``a`` (and, once the queue is in use, the scores of the queued embeddings of that crop
position, computed with the current prototypes) go through Sinkhorn-Knopp, which turns
``exp(scores / epsilon)`` into soft assignments whose prototypes are used equally over the
*global* batch (row and column sums all-reduced over the ranks). Every other crop ``p``
predicts crop ``a``'s assignment: ``-sum_k q_a[k] * log softmax(scores_p / temperature)[k]``,
averaged over rows, over the other crops, over ``crops_for_assign`` and over the prototype
sets. The assignments carry no gradient.

The queue (``queue.queue_length`` > 0): each rank keeps ``queue_length // world_size`` past
embeddings per entry of ``crops_for_assign`` and joins them to Sinkhorn-Knopp from
``queue.start_iter`` on. It is filled with the newest embeddings at every training step,
also before ``start_iter``, so that it holds real embeddings (not its random initial values)
when it is first used. The queue and the loss's count of training steps are resumable state
(``state_dict``, saved per rank through the task's rank-local state).

What VISSL does in two hooks is split here: scoring the queue with the current prototypes
happens inside this loss (the prototypes are bound by :class:`ssl_engine.hooks.SwAVHook` at
the start of a run; they are the weights the forward just used, as with VISSL's on_forward
hook), and the prototypes' normalisation to unit norm after each update
(``normalize_last_layer``) is done by that hook.
"""

import logging
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from classy_vision.losses import ClassyLoss

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.errors import UserError
from ssl_engine.gather import is_distributed
from ssl_engine.registry import LOSSES

log = logging.getLogger(__name__)

KEY = "config.LOSS.swav_loss"

#: added to every entry of Q when a prototype's total mass is exactly 0 (as VISSL does)
_STABILITY_EPS = 1e-12


def _all_reduce(tensor: torch.Tensor, op: Any = None) -> torch.Tensor:
    """In-place all-reduce over every rank (a no-op on one process)."""
    if is_distributed():
        dist.all_reduce(tensor, op=op if op is not None else dist.ReduceOp.SUM)
    return tensor


def _world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


@torch.no_grad()
def sinkhorn_knopp(
    scores: torch.Tensor, epsilon: float, num_iters: int, hard_assignment: bool = False
) -> torch.Tensor:
    """Soft assignments ``[n, K]`` of this rank's ``n`` rows to ``K`` prototypes.

    ``Q = exp(scores / epsilon)`` (transposed to ``[K, n]``) is normalised to total mass 1 over
    all ranks, then ``num_iters`` times its rows are scaled to sum to 1/K (sums over all ranks)
    and its columns to 1/N (N = rows over all ranks; each rank has the same n). Each row of the
    result sums to 1. ``hard_assignment`` turns each row into the one-hot of its largest entry.
    The global maximum is subtracted before the exponential (it cancels in the normalisation),
    so the exponential cannot overflow; no step reads a value back to the host.
    """
    logits = scores / epsilon
    top = logits.max().clone()
    _all_reduce(top, dist.ReduceOp.MAX if is_distributed() else None)
    q = torch.exp(logits - top).t()  # [K, n]
    total = q.sum()
    _all_reduce(total)
    q = q / total
    k, n = q.shape
    n_global = n * _world_size()
    for _ in range(num_iters):
        row = q.sum(dim=1)
        _all_reduce(row)
        # a prototype with no mass at all would divide by zero: give every entry a little
        empty = (row == 0).any()
        q = q + _STABILITY_EPS * empty
        row = row + (_STABILITY_EPS * n_global) * empty
        scale = (1.0 / k) / row
        inf = torch.isinf(scale)
        scale = torch.where(inf, scale.masked_fill(inf, 0).max(), scale)
        q = q * scale.unsqueeze(1)
        q = q * ((1.0 / n_global) / q.sum(dim=0)).unsqueeze(0)
    q = (q / q.sum(dim=0, keepdim=True)).t()  # [n, K], rows sum to 1
    if hard_assignment:
        q = torch.zeros_like(q).scatter_(1, q.argmax(dim=1, keepdim=True), 1.0)
    return q


def _int_list(value: Any, key: str, example: str) -> List[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not (isinstance(value, (list, tuple)) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        raise UserError(f"{KEY}.{key}={value!r} must be a non-empty list of integers, e.g. {example}")
    return list(value)


@LOSSES.register("swav_loss")
class SwAVLoss(ClassyLoss):
    """SwAV's loss; options under ``config.LOSS.swav_loss`` (VISSL's keys, see defaults.yaml).

    ``num_crops``, ``num_prototypes`` and ``embedding_dim`` are inferred from the config
    (ImgPilToMultiCrop's ``total_num_crops``, the swav_head's ``num_clusters`` and ``dims[-1]``)
    when left at their defaults; ``queue.local_queue_length`` is always
    ``queue.queue_length // world size``.
    """

    #: each rank has its own queue: a checkpoint keeps every rank's (see the task's rank-local state)
    rank_local_state = True

    def __init__(
        self,
        temperature: float = 0.1,
        crops_for_assign: Sequence[int] = (0, 1),
        num_crops: int = 2,
        num_iters: int = 3,
        epsilon: float = 0.05,
        use_double_precision: bool = False,
        num_prototypes: Sequence[int] = (3000,),
        embedding_dim: int = 128,
        temp_hard_assignment_iters: int = 0,
        queue_length: int = 0,
        queue_start_iter: int = 0,
        normalize_last_layer: bool = True,
        output_dir: str = ".",
    ) -> None:
        super().__init__()
        for key, value in (("temperature", temperature), ("epsilon", epsilon)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise UserError(f"{KEY}.{key}={value!r} must be a number > 0")
        for key, value in (("num_iters", num_iters), ("temp_hard_assignment_iters", temp_hard_assignment_iters),
                           ("queue.queue_length", queue_length), ("queue.start_iter", queue_start_iter)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UserError(f"{KEY}.{key}={value!r} must be an integer >= 0")
        if isinstance(num_crops, bool) or not isinstance(num_crops, int) or num_crops < 2:
            raise UserError(
                f"{KEY}.num_crops={num_crops!r} must be an integer >= 2 (crops per image: each crop predicts "
                f"another's assignment); it is set from ImgPilToMultiCrop's total_num_crops when left at 2"
            )
        self.crops_for_assign = _int_list(crops_for_assign, "crops_for_assign", "[0, 1]")
        bad = [c for c in self.crops_for_assign if not 0 <= c < num_crops]
        if bad:
            raise UserError(
                f"{KEY}.crops_for_assign={self.crops_for_assign} names crop {bad[0]}, but there are "
                f"num_crops={num_crops} crops per image (indices 0..{num_crops - 1})"
            )
        self.num_prototypes = _int_list(num_prototypes, "num_prototypes", "[3000]")
        if any(k <= 0 for k in self.num_prototypes):
            raise UserError(f"{KEY}.num_prototypes={self.num_prototypes} must be positive")
        if isinstance(embedding_dim, bool) or not isinstance(embedding_dim, int) or embedding_dim <= 0:
            raise UserError(f"{KEY}.embedding_dim={embedding_dim!r} must be a positive integer")
        self.temperature = float(temperature)
        self.epsilon = float(epsilon)
        self.num_crops = int(num_crops)
        self.num_iters = int(num_iters)
        self.use_double_precision = bool(use_double_precision)
        self.embedding_dim = int(embedding_dim)
        self.temp_hard_assignment_iters = int(temp_hard_assignment_iters)
        self.queue_length = int(queue_length)
        self.queue_start_iter = int(queue_start_iter)
        self.normalize_last_layer = bool(normalize_last_layer)
        self.output_dir = output_dir
        self.local_queue_length = self.queue_length // _world_size()
        self.num_iteration = 0  # training steps seen (resumable, in state_dict's _extra_state)
        self._prototypes: List[nn.Linear] = []  # bound by bind_model(); a plain list: not submodules
        if self.local_queue_length > 0:
            # VISSL's initial queue: uniform in +-1/sqrt(dim/3), embeddings of norm about 1
            bound = 1.0 / math.sqrt(self.embedding_dim / 3)
            init = torch.rand(len(self.crops_for_assign), self.local_queue_length, self.embedding_dim) * (2 * bound) - bound
            self.register_buffer("local_emb_queue", init)

    @classmethod
    def from_config(cls, loss_config: AttrDict) -> "SwAVLoss":
        """Build from ``config.LOSS.swav_loss``."""
        cfg = loss_config or {}
        queue = cfg.get("queue", {}) or {}
        return cls(
            temperature=cfg.get("temperature", 0.1),
            crops_for_assign=cfg.get("crops_for_assign", [0, 1]),
            num_crops=cfg.get("num_crops", 2),
            num_iters=cfg.get("num_iters", 3),
            epsilon=cfg.get("epsilon", 0.05),
            use_double_precision=cfg.get("use_double_precision", False),
            num_prototypes=cfg.get("num_prototypes", [3000]),
            embedding_dim=cfg.get("embedding_dim", 128),
            temp_hard_assignment_iters=cfg.get("temp_hard_assignment_iters", 0),
            queue_length=queue.get("queue_length", 0),
            queue_start_iter=queue.get("start_iter", 0),
            normalize_last_layer=cfg.get("normalize_last_layer", True),
            output_dir=cfg.get("output_dir", "."),
        )

    # ------------------------------------------------------------------ the model
    def check_model(self, model: nn.Module) -> Any:
        """The model's swav_head, checked against this loss's config (a UserError naming the key)."""
        from ssl_engine.models.heads.swav_head import find_swav_head

        head = find_swav_head(model)
        if head is None:
            names = ", ".join(getattr(model, "head_names", []) or []) or "none"
            raise UserError(
                f"config.LOSS.name=swav_loss needs a swav_head as the last entry of config.MODEL.HEAD.PARAMS "
                f"(it gives the embedding and the prototype scores); the heads are: {names}"
            )
        where = getattr(head, "config_key", "the swav_head")
        if list(head.num_clusters) != self.num_prototypes:
            raise UserError(
                f"{KEY}.num_prototypes={self.num_prototypes} does not match num_clusters={list(head.num_clusters)} "
                f"of {where}; make them equal (left at its default, num_prototypes is taken from the head)"
            )
        if head.embedding_dim != self.embedding_dim:
            raise UserError(
                f"{KEY}.embedding_dim={self.embedding_dim} does not match the embedding size dims[-1]="
                f"{head.embedding_dim} of {where}; make them equal (left at its default, it is taken from the head)"
            )
        if self.queue_length > 0 and not head.return_embeddings:
            raise UserError(
                f"{KEY}.queue.queue_length={self.queue_length} needs the embeddings, but {where} has "
                f"return_embeddings=false; set it to true or the queue length to 0"
            )
        return head

    def bind_model(self, model: nn.Module) -> None:
        """Check ``model``'s swav_head and keep its prototype layers to score the queue with."""
        self._prototypes = list(self.check_model(model).prototype_layers())

    # ------------------------------------------------------------------ forward
    def _split(self, output: Union[torch.Tensor, Sequence[Any]]) -> Tuple[Optional[torch.Tensor], List[torch.Tensor]]:
        items = [output] if isinstance(output, torch.Tensor) else list(output)
        if len(items) == 1 and isinstance(items[0], (list, tuple)):
            items = list(items[0])  # [[embedding, scores...]]: a head's list kept whole
        n_sets = len(self.num_prototypes)
        if len(items) == n_sets + 1:
            embedding, scores = items[0], items[1:]
        elif len(items) == n_sets:
            embedding, scores = None, items
        else:
            raise UserError(
                f"swav_loss expects the swav_head's outputs [embedding, scores_0, ..] with {n_sets} set(s) of "
                f"scores ({KEY}.num_prototypes={self.num_prototypes}); got {len(items)} outputs"
            )
        for i, (s, k) in enumerate(zip(scores, self.num_prototypes)):
            if not isinstance(s, torch.Tensor) or s.ndim != 2 or s.shape[1] != k:
                shape = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
                raise UserError(
                    f"{KEY}.num_prototypes[{i}]={k} does not match the swav_head's scores {i} of shape {shape}; "
                    f"make num_prototypes equal to the head's num_clusters"
                )
        if embedding is not None and (embedding.ndim != 2 or embedding.shape[1] != self.embedding_dim):
            raise UserError(
                f"{KEY}.embedding_dim={self.embedding_dim} does not match the swav_head's embedding of shape "
                f"{tuple(embedding.shape)}; make it equal to the head's dims[-1]"
            )
        return embedding, scores

    @property
    def queue_in_use(self) -> bool:
        """Whether the next training step joins the queue to Sinkhorn-Knopp."""
        return self.local_queue_length > 0 and self.num_iteration >= self.queue_start_iter

    def forward(self, output: Union[torch.Tensor, Sequence[Any]], target: Any = None) -> torch.Tensor:
        """The SwAV loss of this rank's rows; ``target`` is unused. In training mode, also pushes
        the embeddings into the queue and counts the step."""
        embedding, scores = self._split(output)
        rows = scores[0].shape[0]
        if rows % self.num_crops:
            raise UserError(
                f"swav_loss got {rows} rows per batch, which is not {KEY}.num_crops={self.num_crops} crops of "
                f"equal batches; num_crops must be the number of crops each image gives "
                f"(ImgPilToMultiCrop's total_num_crops)"
            )
        bs = rows // self.num_crops
        use_queue = self.training and self.queue_in_use
        if self.local_queue_length > 0 and embedding is None:
            raise UserError(f"{KEY}.queue.queue_length > 0 needs the swav_head's embeddings (return_embeddings: true)")
        dtype = torch.float64 if self.use_double_precision else torch.float32
        with torch.autocast(device_type=scores[0].device.type, enabled=False):
            queue_scores = self._queue_scores(dtype) if use_queue else [None] * len(scores)
            hard = self.num_iteration < self.temp_hard_assignment_iters
            total = sum(
                self._one_set(s.to(dtype), q, bs, hard) for s, q in zip(scores, queue_scores)
            ) / len(scores)
        if self.training:
            if self.local_queue_length > 0:
                self._push(embedding.detach(), bs)
            self.num_iteration += 1
        return total.float()

    def _queue_scores(self, dtype: torch.dtype) -> List[torch.Tensor]:
        """The queued embeddings scored by the current prototypes: per set, [assign crops, L, K]."""
        if len(self._prototypes) != len(self.num_prototypes):
            raise RuntimeError(
                "swav_loss's queue is scored with the swav_head's prototypes: call bind_model(model) first "
                "(the SwAVHook that default_hooks adds for swav_loss does)"
            )
        with torch.no_grad():
            return [(self.local_emb_queue @ layer.weight.float().t()).to(dtype) for layer in self._prototypes]

    def _one_set(self, scores: torch.Tensor, queue_scores: Optional[torch.Tensor], bs: int, hard: bool) -> torch.Tensor:
        total = scores.new_zeros(())
        for i, a in enumerate(self.crops_for_assign):
            with torch.no_grad():
                target_scores = scores[a * bs:(a + 1) * bs].detach()
                if queue_scores is not None:
                    target_scores = torch.cat([target_scores, queue_scores[i]])
                q = sinkhorn_knopp(target_scores, self.epsilon, self.num_iters, hard)[:bs]
            others = [p for p in range(self.num_crops) if p != a]
            term = scores.new_zeros(())
            for p in others:
                log_p = F.log_softmax(scores[p * bs:(p + 1) * bs] / self.temperature, dim=1)
                term = term - (q * log_p).sum(dim=1).mean()
            total = total + term / len(others)
        return total / len(self.crops_for_assign)

    @torch.no_grad()
    def _push(self, embedding: torch.Tensor, bs: int) -> None:
        """The newest embeddings of each assignment crop go to the front of its queue."""
        queue = self.local_emb_queue
        length = queue.shape[1]
        for i, a in enumerate(self.crops_for_assign):
            new = embedding[a * bs:(a + 1) * bs].to(queue.dtype)
            if bs >= length:
                queue[i].copy_(new[:length])
            else:
                queue[i].copy_(torch.cat([new, queue[i, : length - bs]]))

    # ------------------------------------------------------------------ state
    def get_extra_state(self) -> Dict[str, int]:
        return {"num_iteration": int(self.num_iteration)}

    def set_extra_state(self, state: Any) -> None:
        self.num_iteration = int((state or {}).get("num_iteration", 0))

    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True, **kwargs: Any) -> Any:
        """Load the queue and step count; a saved queue of another shape (another world size or
        queue length) is not used: the queue starts over, with a warning."""
        state = dict(state_dict)
        state.setdefault("_extra_state", {"num_iteration": 0})
        mine = getattr(self, "local_emb_queue", None)
        saved = state.get("local_emb_queue")
        if mine is None:
            state.pop("local_emb_queue", None)
        elif saved is None or tuple(saved.shape) != tuple(mine.shape):
            log.warning(
                "swav_loss: the checkpoint's queue has shape %s, this run's %s (queue_length %d over %d ranks): "
                "the queue starts over", None if saved is None else tuple(saved.shape), tuple(mine.shape),
                self.queue_length, _world_size(),
            )
            state["local_emb_queue"] = mine
        return super().load_state_dict(state, strict=strict, **kwargs)

    def extra_repr(self) -> str:
        return (
            f"temperature={self.temperature}, epsilon={self.epsilon}, num_iters={self.num_iters}, "
            f"num_crops={self.num_crops}, crops_for_assign={self.crops_for_assign}, "
            f"num_prototypes={self.num_prototypes}, queue={self.local_queue_length} per rank from step "
            f"{self.queue_start_iter}"
        )
