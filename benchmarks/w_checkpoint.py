"""W-checkpoint: saving and loading a ResNet-50 checkpoint with optimizer state.

The engine's task for a ResNet-50 trunk + Linear(2048, 1000) head with SGD momentum 0.9, after
one update (so every parameter has a momentum buffer): about 25.6M parameters, ~205 MB on disk.

- engine save, training thread blocked: ``CheckpointHook``'s ``write_checkpoint`` with
  CHECKPOINT.ASYNC_WRITE (the default): build the state through ``task.get_classy_state``,
  snapshot it (a CPU copy) and hand it to the background writer. This is what a training
  run waits for, and what the issue's "<= 1.2x torch.save" target is about;
- engine save, until durable: from the same call until the background writer has written the
  temporary file, fsynced it, renamed it, fsynced the folder and swapped the
  ``checkpoint.torch`` link (``wait_for_checkpoint_writes`` returns). No target: it shows
  what the write costs in total, off the training thread;
- engine save, synchronous: the same with CHECKPOINT.ASYNC_WRITE=false (everything on the
  training thread, as before the background writer);
- bare save: ``torch.save`` of the very same checkpoint dict to a path (no fsync);
- engine load: ``load_checkpoint`` (``torch.load(weights_only=True)`` with its checks), and
  resume: that plus ``task.set_classy_state``;
- bare load: ``torch.load(path, weights_only=True)``.

No write is in flight while another figure is taken. The files are in the page cache when
read back (both sides alike). Repeats alternate the order; figures are medians, ratios the
median of per-repeat ratios.
"""

import os
import tempfile
import time
from typing import Any, Dict, List

import torch

from benchmarks.common import (
    Row,
    at_most,
    compose_config,
    engine_logging,
    median,
    memory_train_overrides,
    random_data,
    remove_tree,
    rotate,
    set_memory_data,
    sgd_overrides,
)

WORKLOAD = "W-checkpoint"


def overrides() -> List[str]:
    return memory_train_overrides(2) + [
        "config.MODEL.TRUNK.NAME=resnet",
        "config.MODEL.TRUNK.RESNETS.DEPTH=50",
        "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[2048,1000]}]]",
        "config.LOSS.name=cross_entropy_multiple_output_single_target",
    ] + sgd_overrides(momentum=0.9, weight_decay=None)


def build_task(folder: str) -> Any:
    """The engine's task, prepared, with a momentum buffer for every parameter."""
    from ssl_engine.hooks import CheckpointHook
    from ssl_engine.trainer import SelfSupervisionTrainer

    set_memory_data("TRAIN", *random_data(4, (3, 32, 32), 1000, seed=0))
    cfg = compose_config(overrides())
    cfg.CHECKPOINT.DIR = folder
    trainer = SelfSupervisionTrainer(cfg, checkpoint_folder=folder, hooks=[CheckpointHook()])
    task = trainer.setup()
    for p in task.base_model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    task.optimizer.step()
    task.optimizer.zero_grad()
    return task


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def timed_save(task: Any, name: str, background: bool) -> Dict[str, float]:
    """Seconds the training thread spends in ``write_checkpoint`` and, with ``background``,
    until the background write is durable (fsynced, renamed, pointer swapped)."""
    from ssl_engine.checkpoint import wait_for_checkpoint_writes
    from ssl_engine.hooks.checkpoint_hook import write_checkpoint

    t0 = time.perf_counter()
    write_checkpoint(task, name, "phase", wait=not background)
    t1 = time.perf_counter()
    wait_for_checkpoint_writes()
    t2 = time.perf_counter()
    return {"blocked": t1 - t0, "durable": t2 - t0}


def run(repeats: int = 3, **_: Any) -> List[Row]:
    from ssl_engine.checkpoint import load_checkpoint
    from ssl_engine.hooks.checkpoint_hook import build_checkpoint

    folder = tempfile.mkdtemp(prefix="bench_ckpt_", dir=os.environ.get("BENCH_CHECKPOINT_DIR"))
    times: Dict[str, List[float]] = {}
    try:
        with engine_logging(folder):
            task = build_task(folder)
            ckpt = build_checkpoint(task, "phase")
            bare = os.path.join(folder, "bare.torch")
            engine_name = "model_phase0.torch"
            size_mb = 0.0
            path = os.path.join(folder, engine_name)
            for r in range(repeats):
                # the saves, then both loads in the same order: a load never comes straight
                # after the write of its own file
                for side in rotate(["bare", "async", "sync"], r):
                    if side == "bare":
                        times.setdefault("bare_save", []).append(timed(lambda: torch.save(ckpt, bare)))
                    elif side == "async":
                        t = timed_save(task, engine_name, background=True)
                        times.setdefault("engine_save_blocked", []).append(t["blocked"])
                        times.setdefault("engine_save_durable", []).append(t["durable"])
                    else:
                        t = timed_save(task, engine_name, background=False)
                        times.setdefault("engine_save_sync", []).append(t["blocked"])
                for side in rotate(["bare", "engine"], r):
                    if side == "bare":
                        times.setdefault("bare_load", []).append(
                            timed(lambda: torch.load(bare, map_location="cpu", weights_only=True)))
                    else:
                        times.setdefault("engine_load", []).append(timed(lambda: load_checkpoint(path)))
                state = load_checkpoint(path)["classy_state_dict"]
                times.setdefault("engine_apply", []).append(timed(lambda: task.set_classy_state(state)))
                size_mb = os.path.getsize(bare) / 2**20
                os.remove(bare)
                os.remove(path)
    finally:
        remove_tree(folder)

    def pair_ratio(a: str, b: str) -> float:
        return median([x / y for x, y in zip(times[a], times[b])])

    blocked_ratio = pair_ratio("engine_save_blocked", "bare_save")
    load_ratio = pair_ratio("engine_load", "bare_load")
    resume = [a + b for a, b in zip(times["engine_load"], times["engine_apply"])]
    note = f"{size_mb:.0f} MB file"
    bare_save = median(times["bare_save"])
    return [
        Row(WORKLOAD, "save, training thread blocked (state + CPU snapshot + hand-over; ASYNC_WRITE)",
            median(times["engine_save_blocked"]), "s", bare_save, blocked_ratio, "<= 1.2x",
            at_most(blocked_ratio, 1.2), note, extra={k: v for k, v in times.items()}),
        Row(WORKLOAD, "save, until durable (background write: temp file + fsync + rename + pointer)",
            median(times["engine_save_durable"]), "s", bare_save, pair_ratio("engine_save_durable", "bare_save"),
            "", "", note),
        Row(WORKLOAD, "save, synchronous (ASYNC_WRITE=false: state + atomic write + fsync)",
            median(times["engine_save_sync"]), "s", bare_save, pair_ratio("engine_save_sync", "bare_save"),
            "", "", note),
        Row(WORKLOAD, "load (engine load_checkpoint vs torch.load)", median(times["engine_load"]), "s",
            median(times["bare_load"]), load_ratio, "", "", note),
        Row(WORKLOAD, "resume (load_checkpoint + set_classy_state)", median(resume), "s",
            median(times["bare_load"]), median([a / b for a, b in zip(resume, times["bare_load"])]), "", "", note),
    ]
