"""W-resnet50 (GPU): ResNet-50 at 224x224 with AMP, images per second, engine against a plain loop.

Skipped (status SKIP) when CUDA is not available. Engine: ``resnet`` trunk (DEPTH 50) +
``mlp`` head [2048, 1000], cross entropy, SGD momentum 0.9, ``MODEL.AMP_PARAMS.USE_AMP=true``
(float16 autocast + GradScaler on CUDA), default hooks, ``MACHINE.DEVICE=gpu``, batch
$BENCH_GPU_BATCH (128), $BENCH_GPU_WORKERS (8) loader workers with pinned memory, one train
phase of $BENCH_GPU_ITERS (60) iterations. Plain: torchvision's ``resnet50()`` in the
hand-written loop with the same autocast + GradScaler, DataLoader, workers and pinning.
Samples are drawn from a pool of 256 random 224x224 images (``bench_generated`` on the engine
side), so both sides pay the same host-side collation and host-to-device copies.

Figure: batch size / median iteration time (after 10 warm-up iterations), images/s; ratio is
engine / plain throughput. ``BENCH_GPU_AMP=0`` runs both sides in float32 (no autocast, no
GradScaler, whose per-step overflow read is then gone too). ``BENCH_GPU_SMOKE=1`` runs the same code on the CPU at 64x64, batch
4, for 8 iterations, to check the code path on a machine without a GPU (figures meaningless).
"""

import os
from typing import Any, Dict, List

import torch

from benchmarks import plain
from benchmarks.common import (
    Row,
    _POOL_SIZE,
    compose_config,
    engine_train,
    iteration_times,
    median,
    pool_sample,
    random_data,
    rotate,
    sgd_overrides,
)

WORKLOAD = "W-resnet50-gpu"


def settings() -> Dict[str, Any]:
    smoke = os.environ.get("BENCH_GPU_SMOKE", "") not in ("", "0")
    if smoke:
        return {"smoke": True, "device": "cpu", "amp": False, "size": 64, "batch": 4, "iters": 8,
                "workers": int(os.environ.get("BENCH_GPU_WORKERS", 0)), "warmup": 2}
    return {"smoke": False, "device": "gpu", "amp": os.environ.get("BENCH_GPU_AMP", "1") not in ("", "0"),
            "size": 224, "batch": int(os.environ.get("BENCH_GPU_BATCH", 128)),
            "iters": int(os.environ.get("BENCH_GPU_ITERS", 60)), "workers": int(os.environ.get("BENCH_GPU_WORKERS", 8)),
            "warmup": 10}


def overrides(s: Dict[str, Any]) -> List[str]:
    return [
        f"config.MACHINE.DEVICE={s['device']}",
        f"config.DATA.NUM_DATALOADER_WORKERS={s['workers']}",
        f"config.DATA.PIN_MEMORY={str(s['device'] == 'gpu').lower()}",
        "config.DATA.TRAIN.DATA_SOURCES=[bench_generated]",
        "config.DATA.TRAIN.LABEL_SOURCES=[bench_generated]",
        f"config.DATA.TRAIN.DATA_LIMIT={s['batch'] * s['iters']}",
        f"config.DATA.TRAIN.SYNTHETIC_IMAGE_SIZE={s['size']}",
        f"config.DATA.TRAIN.BATCHSIZE_PER_REPLICA={s['batch']}",
        "config.DATA.TRAIN.DROP_LAST=true",
        "config.TEST_MODEL=false",
        "config.MODEL.TRUNK.NAME=resnet",
        "config.MODEL.TRUNK.RESNETS.DEPTH=50",
        "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[2048,1000]}]]",
        f"config.MODEL.AMP_PARAMS.USE_AMP={str(s['device'] == 'gpu' and s['amp']).lower()}",
        "config.LOSS.name=cross_entropy_multiple_output_single_target",
    ] + sgd_overrides(momentum=0.9)


class PoolImages(torch.utils.data.Dataset):
    """The plain side's data: the same pool images and labels as the ``bench_generated`` source."""

    def __init__(self, n: int, size: int) -> None:
        self.n = n
        self.pool, _ = random_data(_POOL_SIZE, (3, size, size), 10, seed=1)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return pool_sample(self.pool, i), i % 10


def run(repeats: int = 2, **_: Any) -> List[Row]:
    s = settings()
    if not s["smoke"] and not torch.cuda.is_available():
        return [Row(WORKLOAD, "images / s (engine vs plain)", None, "img/s", status="SKIP", note="no CUDA device")]
    import torchvision

    cfg = compose_config(overrides(s))
    device = torch.device("cuda" if s["device"] == "gpu" else "cpu")
    amp_dtype = torch.float16 if device.type == "cuda" and s["amp"] else None
    per: Dict[str, List[float]] = {"plain": [], "engine": []}
    data_wait_ms: List[float] = []
    for r in range(repeats):
        for side in rotate(["plain", "engine"], r):
            torch.manual_seed(0)
            if side == "plain":
                loader = plain.dataset_loader(PoolImages(s["batch"] * s["iters"], s["size"]), s["batch"], True,
                                              s["workers"], pin_memory=device.type == "cuda",
                                              mp_context=str(cfg.MULTI_PROCESSING_METHOD))
                out = plain.train_and_test(torchvision.models.resnet50(num_classes=1000), loader, None, 1, lr=0.1,
                                           momentum=0.9, device=device, amp_dtype=amp_dtype)
                it = getattr(loader, "_iterator", None)
                if it is not None and hasattr(it, "_shutdown_workers"):
                    it._shutdown_workers()
            else:
                wait = data_wait_hook(s["warmup"])
                out = engine_train(cfg, default_hooks=True, extra_hooks=[wait])
                data_wait_ms.append(1e3 * median(wait.seconds))
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            per[side].append(s["batch"] / median(iteration_times(out["steps"], True, warmup=s["warmup"])))
    ratio = median([e / p for e, p in zip(per["engine"], per["plain"])])
    note = "CPU smoke run (BENCH_GPU_SMOKE=1): not a measurement" if s["smoke"] else torch.cuda.get_device_name(0)
    precision = "AMP" if amp_dtype is not None else "float32"
    return [Row(WORKLOAD, f"images / s, batch {s['batch']}, {s['size']}px, {precision}", median(per["engine"]), "img/s",
                median(per["plain"]), ratio, "", "", note, extra={"per_repeat": per, "engine_data_wait_ms": data_wait_ms})]


def data_wait_hook(warmup: int) -> Any:
    """A hook recording how long each train step after the warm-up waited for its batch
    (``.seconds``): a loader that cannot keep up shows here. Built on call, so that importing
    this module (as loader workers do) does not import the engine's hooks."""
    from ssl_engine.hooks import SSLHook

    class DataWait(SSLHook):
        def __init__(self) -> None:
            super().__init__()
            self.seconds: List[float] = []

        def on_step(self, task: Any) -> None:
            if task.train and task.iteration > warmup:
                self.seconds.append(task.last_data_time)

    return DataWait()
