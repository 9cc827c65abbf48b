"""W-resnet: a realistic small training step, ResNet-18 at 32x32, batch 32, 30 iterations.

Engine: ``resnet`` trunk (DEPTH 18) + ``mlp`` head [512, 10], cross entropy, SGD lr 0.1
momentum 0.9, in-memory 3x32x32 tensors, no loader workers, one train phase of 30
iterations, default hooks. Plain: torchvision's ``resnet18(num_classes=10)`` (the same layers)
in the hand-written loop. Figure: median time per iteration after 5 warm-up iterations.
"""

from typing import Any, Dict, List

import torch

from benchmarks import plain
from benchmarks.common import (
    Row,
    at_most,
    compose_config,
    engine_train,
    iteration_times,
    median,
    median_ratio,
    memory_train_overrides,
    random_data,
    rotate,
    set_memory_data,
    sgd_overrides,
)

WORKLOAD = "W-resnet"
BATCH, ITERS = 32, 30


def overrides() -> List[str]:
    return memory_train_overrides(BATCH) + [
        "config.MODEL.TRUNK.NAME=resnet",
        "config.MODEL.TRUNK.RESNETS.DEPTH=18",
        "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[512,10]}]]",
        "config.LOSS.name=cross_entropy_multiple_output_single_target",
        "config.METERS.names=[accuracy_list_meter]",
    ] + sgd_overrides(momentum=0.9)


def run(repeats: int = 3, **_: Any) -> List[Row]:
    import torchvision

    data = random_data(BATCH * ITERS, (3, 32, 32), 10, seed=0)
    set_memory_data("TRAIN", *data)
    cfg = compose_config(overrides())
    per: Dict[str, List[float]] = {"plain": [], "engine": []}
    for r in range(repeats):
        for side in rotate(["plain", "engine"], r):
            torch.manual_seed(0)
            if side == "plain":
                loader = plain.tensor_loader(*data, BATCH, shuffle=True)
                out = plain.train_and_test(torchvision.models.resnet18(num_classes=10), loader, None, 1,
                                           lr=0.1, momentum=0.9)
            else:
                out = engine_train(cfg, default_hooks=True)
            per[side].append(median(iteration_times(out["steps"], train=True)))
    ratio = median_ratio(list(zip(per["engine"], per["plain"])))
    return [
        Row(WORKLOAD, "plain loop, s / iteration", median(per["plain"]), "s", extra={"per_repeat": per["plain"]}),
        Row(WORKLOAD, "engine, default hooks, s / iteration", median(per["engine"]), "s", median(per["plain"]), ratio,
            "<= 1.02x", at_most(ratio, 1.02), extra={"per_repeat": per["engine"]}),
    ]
