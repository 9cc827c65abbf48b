"""Process-group setup and teardown, and the rank helpers the engine uses.

Rank queries reuse classy_vision's distributed_util; this module adds what it lacks:
initialising the group from a RankInfo, per-rank device and seed, and teardown.
"""

import datetime
import logging
import os
import random
from dataclasses import dataclass
from typing import Any, Iterable, List

import numpy as np
import torch
import torch.distributed as dist

from ssl_engine import preemption
from ssl_engine.errors import UserError

log = logging.getLogger(__name__)


@dataclass
class RankInfo:
    """Where one process sits in the job."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    init_method: str = ""  # e.g. tcp://127.0.0.1:29500, file:///tmp/x, env://
    backend: str = "gloo"


def get_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_primary() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if get_world_size() > 1:
        dist.barrier()


def all_gather_object(obj: Any) -> List[Any]:
    """The object of every rank, in rank order (one-element list when not distributed)."""
    if get_world_size() == 1:
        return [obj]
    out: List[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices) of this process."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def device_for(device: str, local_rank: int) -> torch.device:
    """The torch device of a rank: cuda:<local_rank> on gpu, cpu otherwise."""
    if device == "gpu":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_process_group(info: RankInfo, timeout_minutes: float) -> None:
    """Join the job's process group (nothing to do for a one-process run).

    With nccl the rank's GPU (cuda:<local_rank>) is made current first, so that NCCL's
    communicators and every later ``.cuda()`` land on it, and CPU tensors use a gloo backend
    of the same group. ``timeout_minutes`` bounds how
    long a collective waits for a rank that never arrives.
    """
    if info.world_size <= 1 or dist.is_initialized():
        return
    backend = info.backend
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)
        # CUDA tensors go through NCCL; the small CPU-tensor collectives (preemption vote, loss
        # sums, logged scalars) through gloo, which NCCL alone would refuse
        backend = "cuda:nccl,cpu:gloo"
    waiting_for = f"the {info.world_size} ranks to join at {info.init_method}"
    log.info("rank %d: waiting for %s (at most config.DISTRIBUTED.TIMEOUT_MINUTES=%s)", info.rank, waiting_for,
             timeout_minutes)
    with preemption.stop_while_blocked(waiting_for):  # a Ctrl-C or preemption must not wait for the timeout
        try:
            dist.init_process_group(
                backend=backend,
                init_method=info.init_method,
                rank=info.rank,
                world_size=info.world_size,
                timeout=datetime.timedelta(minutes=timeout_minutes),
            )
        except dist.DistNetworkError as e:
            if "EADDRINUSE" not in str(e):
                raise
            where = ("MASTER_PORT" if info.init_method.startswith("env://") else "config.DISTRIBUTED.RUN_ID")
            raise UserError(
                f"the port of {info.init_method} ({where}) is in use on this node, by another "
                "job or a run of this one that has not ended; pick a free port, or leave "
                "config.DISTRIBUTED.RUN_ID=auto on one node"
            ) from None
    log.debug("rank %d/%d joined %s (%s)", info.rank, info.world_size, info.init_method, info.backend)


@torch.no_grad()
def broadcast_from_rank0(tensors: Iterable[torch.Tensor]) -> None:
    """Overwrite ``tensors`` in place with rank 0's (every rank must call it with the same
    tensors, in the same order); a no-op on one process. Gives every rank the state that rank 0
    holds and a checkpoint keeps: weights of a model only tested, BatchNorm statistics of copies
    of the model that each rank updated with its own batches."""
    if get_world_size() == 1:
        return
    for tensor in tensors:
        dist.broadcast(tensor, src=0)


def destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def reduce_mean_scalars(values: List[float]) -> List[float]:
    """Average a few python floats over ranks (one small all_reduce)."""
    if get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / get_world_size()).tolist()


def reduce_max_scalars(values: List[float]) -> List[float]:
    """Maximum of a few python floats over ranks."""
    if get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def env_rank_info() -> RankInfo:
    """RankInfo from torchrun's environment variables (set by hand, they are checked: a RANK of
    'x' was a ValueError traceback, and RANK=1 with WORLD_SIZE=1 trained as if it were rank 0)."""
    values = {}
    for name, default in (("RANK", None), ("LOCAL_RANK", "0"), ("WORLD_SIZE", None)):
        text = os.environ.get(name, default)
        if text is None or not text.strip().isdigit():
            raise UserError(f"environment variable {name}={text!r} is not a whole number >= 0; torchrun sets "
                            "RANK, LOCAL_RANK and WORLD_SIZE (unset them to let the tool start its own ranks)")
        values[name] = int(text)
    if not values["RANK"] < values["WORLD_SIZE"]:
        raise UserError(f"environment variable RANK={values['RANK']} must be below WORLD_SIZE={values['WORLD_SIZE']}; "
                        "torchrun sets them (unset them to let the tool start its own ranks)")
    return RankInfo(rank=values["RANK"], local_rank=values["LOCAL_RANK"], world_size=values["WORLD_SIZE"],
                    init_method="env://")
