"""PreciseBNHook (HOOKS.PRECISE_BN): recompute BatchNorm running statistics with fvcore's
``update_bn_stats`` over NUM_ITERATIONS training batches, every EVERY_N_PHASES train phases
and after the last one.

It runs at the end of the train phase, before the checkpoint is written (and so before the
next test phase), on the unwrapped model with the weights fixed. Batches come from a fresh
pass over the training data (the phase's own sampler order), so the training data stream and
the RNG streams of the run are left as they were. With several ranks, each rank computes the
statistics of its shard and the ranks then pool them (mean of means, and the pooled variance),
so every rank ends with the same buffers.
"""

import logging
from typing import Any, Dict, Iterator, List

import torch
import torch.nn as nn
from fvcore.nn.precise_bn import get_bn_modules, update_bn_stats

from ssl_engine import distributed as du
from ssl_engine.errors import UserError
from ssl_engine.hooks.base import Priority, SSLHook
from ssl_engine.registry import HOOKS

log = logging.getLogger(__name__)


def model_inputs(batch: Dict[str, Any], device: torch.device) -> Any:
    """The model input of a collated batch (VISSL's {'data': [...], ...} format) on ``device``."""
    data = batch["data"]
    if isinstance(data, (list, tuple)):
        data = [d.to(device, non_blocking=True) for d in data]
        return data[0] if len(data) == 1 else data
    return data.to(device, non_blocking=True)


def pool_bn_stats(bn_layers: List[nn.Module]) -> None:
    """Average running mean/var over ranks: mean of means, var = mean(var + mean^2) - mean^2."""
    world = du.get_world_size()
    if world == 1 or not bn_layers:
        return
    means = [bn.running_mean for bn in bn_layers]
    seconds = [bn.running_var + bn.running_mean.square() for bn in bn_layers]
    flat = torch.cat([t.flatten().double() for t in means + seconds])
    torch.distributed.all_reduce(flat)
    flat /= world
    out, i = [], 0
    for t in means + seconds:
        out.append(flat[i:i + t.numel()].view_as(t))
        i += t.numel()
    n = len(bn_layers)
    for bn, mean, second in zip(bn_layers, out[:n], out[n:]):
        bn.running_mean.copy_(mean.to(bn.running_mean.dtype))
        bn.running_var.copy_((second - mean.square()).clamp_min(0).to(bn.running_var.dtype))


@HOOKS.register("PreciseBNHook")
class PreciseBNHook(SSLHook):
    """Precise BN statistics at the end of every N-th train phase and of the last one."""

    # before the MetricsHook/writers and well before the CheckpointHook (VERY_LOW)
    priority = Priority.NORMAL

    def __init__(self, num_iters: int = 200, every_n_phases: int = 1) -> None:
        super().__init__()
        for key, value in (("NUM_ITERATIONS", num_iters), ("EVERY_N_PHASES", every_n_phases)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                # 0 batches would leave every BatchNorm with zero mean and variance
                raise UserError(f"config.HOOKS.PRECISE_BN.{key}={value!r} must be an integer >= 1")
        self.num_iters = int(num_iters)
        self.every_n_phases = int(every_n_phases)
        self.runs = 0  # how many times the statistics were recomputed (this process)

    def _due(self, task: Any) -> bool:
        if not task.train:
            return False
        last_train_phase = task.train_phase_idx + 1 >= task.num_train_phases
        return last_train_phase or (task.train_phase_idx + 1) % self.every_n_phases == 0

    def on_phase_end(self, task: Any) -> None:
        if self._due(task):
            self.update(task)

    @staticmethod
    def _whole_epoch(task: Any) -> Any:
        """The train loader set to the whole of this phase's epoch, from its first batch: a phase
        resumed from a checkpoint taken inside it left the sampler at the checkpoint's batch."""
        loader = task.dataloaders["TRAIN"]
        loader.sampler.set_epoch(max(task.train_phase_idx, 0))
        loader.sampler.set_start_iter(0)
        return loader

    def _batches(self, task: Any, n: int) -> Iterator[Any]:
        loader = self._whole_epoch(task)
        for i, batch in enumerate(loader):
            if i >= n:
                break
            yield model_inputs(batch, task.device)

    @torch.no_grad()
    def update(self, task: Any) -> None:
        """Recompute the BN statistics of task.base_model now."""
        model = task.base_model
        was_training = model.training
        model.train(True)  # BN layers of a frozen trunk stay in eval mode and are left alone
        try:
            bn_layers = get_bn_modules(model)
            if not bn_layers:
                return
            # the batches of the whole epoch, not those left after a resume's start (none at all
            # for a checkpoint taken at the phase's last step, which left zero statistics)
            n = min(self.num_iters, len(self._whole_epoch(task)))
            if n < self.num_iters and du.is_primary():
                log.info("PreciseBN: the training data has %d batches per rank; using all of them", n)
            devices = [task.device] if task.device.type == "cuda" else []
            buffers = [(bn, bn.running_mean, bn.running_var) for bn in bn_layers]
            with torch.random.fork_rng(devices=devices), task.autocast():
                update_bn_stats(model, self._batches(task, n), num_iters=n)
            # fvcore sets new tensors as the buffers: the statistics go into the model's own
            # ones, which others hold on to (the EMA's average, DDP's buffer broadcast)
            for bn, mean, var in buffers:
                mean.copy_(bn.running_mean)
                var.copy_(bn.running_var)
                bn.running_mean, bn.running_var = mean, var
            pool_bn_stats(bn_layers)
            self.runs += 1
            if du.is_primary():
                log.info("PreciseBN: recomputed the statistics of %d BN layers over %d batches at train phase %d",
                         len(bn_layers), n, task.train_phase_idx)
        finally:
            model.train(was_training)

    def get_classy_state(self) -> Dict[str, Any]:
        return {}

    def set_classy_state(self, state: Dict[str, Any]) -> None:
        pass
