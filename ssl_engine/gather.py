"""All-gather that lets gradients flow back to the rank that produced each slice.

Contrastive losses (SimCLR, MoCo-style negatives across GPUs) compare each local
embedding with the embeddings of every rank. ``torch.distributed.all_gather`` cuts the
autograd graph, and ``torch.distributed.nn.functional.all_gather`` is deprecated and on
gloo emulates reduce-scatter with one scatter per rank. This module provides one
autograd Function that works on gloo and NCCL with a single collective each way.

Gradient convention: the backward pass *sums* over ranks the gradient each rank computed
for a slice and hands the sum to the slice's owner. When every rank's loss is the mean
over its own rows and DDP averages parameter gradients over ranks, the parameters
receive exactly the gradient of the mean loss over the global batch.
"""

from typing import Optional

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """True when a process group is initialised and has more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _uses_nccl(group: Optional[dist.ProcessGroup], tensor: torch.Tensor) -> bool:
    """True when ``tensor``'s collective goes through NCCL.

    A GPU rank's group is ``cuda:nccl,cpu:gloo`` (see distributed.init_process_group), whose
    backend name is that whole string, so the name is searched, and the device decides.
    """
    return tensor.is_cuda and "nccl" in str(dist.get_backend(group))


class _GatherWithGrad(torch.autograd.Function):
    """Concatenate ``tensor`` from all ranks along dim 0; backward sums and scatters."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, tensor: torch.Tensor, group: Optional[dist.ProcessGroup]
    ) -> torch.Tensor:
        tensor = tensor.contiguous()
        world_size = dist.get_world_size(group)
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        ctx.rows = tensor.shape[0]
        if _uses_nccl(group, tensor):
            out = tensor.new_empty((world_size * tensor.shape[0],) + tuple(tensor.shape[1:]))
            dist.all_gather_into_tensor(out, tensor, group=group)
            return out
        parts = [torch.empty_like(tensor) for _ in range(world_size)]
        dist.all_gather(parts, tensor, group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):  # type: ignore[override]
        # Clone: the collective works in place and autograd may share grad_output.
        grad = grad_output.contiguous().clone()
        if _uses_nccl(ctx.group, grad):
            out = grad.new_empty((ctx.rows,) + tuple(grad.shape[1:]))
            dist.reduce_scatter_tensor(out, grad, op=dist.ReduceOp.SUM, group=ctx.group)
            return out, None
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        start = ctx.rank * ctx.rows
        return grad[start : start + ctx.rows], None


def gather_with_grad(tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """``tensor`` from every rank, concatenated along dim 0 in rank order, differentiable.

    Every rank must pass a tensor of the same shape (use ``drop_last`` in the sampler).
    Without an initialised process group of more than one rank, returns ``tensor`` itself.
    """
    if not is_distributed():
        return tensor
    return _GatherWithGrad.apply(tensor, group)


class _AllReduceSumWithGrad(torch.autograd.Function):
    """Sum ``tensor`` over all ranks; backward sums the ranks' gradients (same convention as above)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        out = tensor.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):  # type: ignore[override]
        grad = grad_output.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def all_reduce_sum_with_grad(tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """``tensor`` summed over every rank, differentiable; ``tensor`` itself on one process.

    When every rank goes on to compute the same loss from the sum, the backward hands each rank
    the sum of all ranks' (equal) gradients, i.e. world size times its own; DDP's averaging of the
    parameter gradients then gives exactly the gradient of that loss (as with
    :func:`gather_with_grad`).
    """
    if not is_distributed():
        return tensor
    return _AllReduceSumWithGrad.apply(tensor, group)
