"""W-tiny: the engine's overhead per training iteration, against a plain loop and classy_vision.

Model: flatten + Linear(3072, 256) + ReLU (the engine's ``mlp`` trunk), Linear(256, 10) (an
``mlp`` head); cross entropy, SGD lr 0.1 (no momentum, no weight decay, constant lr), batch 64,
one process, no loader workers, 3x32x32 random tensors held in memory; 2 epochs of 100
iterations, each followed by a test phase of 20 batches, top-1 accuracy.

Variants: the plain loop (``DataLoader(TensorDataset)``), the engine with no hooks, the engine
with its default hooks, classy_vision's LocalTrainer. The figure is the median time per train
iteration after warm-up; repeats run the variants in rotating order and ratios are taken
within a repeat.

The same with a single Linear(32, 2) on batch 8 (an ``mlp`` trunk with DIMS [32, 2], no ReLU,
no head), where the work is so small that the difference to the plain loop is the engine's
fixed cost per iteration, in microseconds.
"""

from typing import Any, Dict, List, Sequence

import torch
import torch.nn as nn

from benchmarks import plain
from benchmarks.common import (
    Row,
    at_most,
    compose_config,
    engine_train,
    iteration_times,
    median,
    median_ratio,
    random_data,
    rotate,
    set_memory_data,
    sgd_overrides,
)
from benchmarks.peers import classy_train, ignite_train, installed, lightning_train

WORKLOAD = "W-tiny"

CASES: Dict[str, Dict[str, Any]] = {
    "tiny": {"shape": (3, 32, 32), "trunk": [3072, 256], "relu": True, "head": [256, 10], "classes": 10,
             "batch": 64, "train_iters": 100, "test_iters": 20, "epochs": 2},
    "overhead": {"shape": (32,), "trunk": [32, 2], "relu": False, "head": None, "classes": 2,
                 "batch": 8, "train_iters": 100, "test_iters": 20, "epochs": 2},
}

# peers with their package (ignite and lightning come with the project's `bench` extra)
PEERS = {"classy_vision": "classy_vision", "ignite": "ignite", "lightning": "lightning"}
VARIANTS = ("plain", "engine_no_hooks", "engine_default_hooks") + tuple(
    name for name, package in PEERS.items() if installed(package)
)


def engine_overrides(case: Dict[str, Any], workers: int = 0) -> List[str]:
    """Config overrides that make the engine run ``case`` on the ``bench_memory`` source."""
    head = f"[[mlp,{{dims:[{case['head'][0]},{case['head'][1]}]}}]]" if case["head"] else "[]"
    trunk = ",".join(str(d) for d in case["trunk"])
    out = [
        "config.MACHINE.DEVICE=cpu",
        f"config.DATA.NUM_DATALOADER_WORKERS={workers}",
        "config.DATA.PIN_MEMORY=false",
        "config.TEST_MODEL=true",
        "config.TEST_EVERY_NUM_EPOCH=1",
        "config.MODEL.TRUNK.NAME=mlp",
        f"config.MODEL.TRUNK.MLP.DIMS=[{trunk}]",
        f"config.MODEL.TRUNK.MLP.USE_RELU={str(case['relu']).lower()}",
        f"config.MODEL.HEAD.PARAMS={head}",
        "config.LOSS.name=cross_entropy_multiple_output_single_target",
        "config.METERS.names=[accuracy_list_meter]",
        "config.DISTRIBUTED.NUM_PROC_PER_NODE=1",
    ] + sgd_overrides(momentum=0.0, epochs=case["epochs"])
    for split in ("TRAIN", "TEST"):
        out += [
            f"config.DATA.{split}.DATA_SOURCES=[bench_memory]",
            f"config.DATA.{split}.LABEL_SOURCES=[bench_memory]",
            f"config.DATA.{split}.BATCHSIZE_PER_REPLICA={case['batch']}",
        ]
    return out


def plain_model(case: Dict[str, Any]) -> nn.Module:
    """The same network as the engine's trunk + head, written out."""
    d_in, d_out = case["trunk"]
    layers: List[nn.Module] = [nn.Flatten(), nn.Linear(d_in, d_out)]
    if case["relu"]:
        layers.append(nn.ReLU(inplace=True))
    if case["head"]:
        layers.append(nn.Linear(*case["head"]))
    return nn.Sequential(*layers)


def make_data(case: Dict[str, Any]) -> Dict[str, Any]:
    """Train and test tensors for ``case``, also served by the engine's ``bench_memory`` source."""
    n_train, n_test = case["batch"] * case["train_iters"], case["batch"] * case["test_iters"]
    train = random_data(n_train, case["shape"], case["classes"], seed=0)
    test = random_data(n_test, case["shape"], case["classes"], seed=1)
    set_memory_data("TRAIN", *train)
    set_memory_data("TEST", *test)
    return {"train": train, "test": test}


def run_variant(variant: str, case: Dict[str, Any], data: Dict[str, Any], cfg: Any) -> Dict[str, Any]:
    """One run of ``variant``; returns its step clock record."""
    torch.manual_seed(0)
    if variant == "plain":
        train = plain.tensor_loader(*data["train"], case["batch"], shuffle=True)
        test = plain.tensor_loader(*data["test"], case["batch"], shuffle=False)
        return plain.train_and_test(plain_model(case), train, test, case["epochs"], lr=0.1)
    peer = {"classy_vision": classy_train, "ignite": ignite_train, "lightning": lightning_train}.get(variant)
    if peer is not None:
        return peer(plain_model(case), data["train"], data["test"], case["batch"], case["epochs"], lr=0.1)
    return engine_train(cfg, default_hooks=(variant == "engine_default_hooks"))


def measure(case: Dict[str, Any], repeats: int, variants: Sequence[str] = VARIANTS) -> Dict[str, List[float]]:
    """Median seconds per train iteration of each variant, one value per repeat."""
    data = make_data(case)
    cfg = compose_config(engine_overrides(case))
    per_variant: Dict[str, List[float]] = {v: [] for v in variants}
    for r in range(repeats):
        for variant in rotate(list(variants), r):
            out = run_variant(variant, case, data, cfg)
            per_variant[variant].append(median(iteration_times(out["steps"], train=True)))
    return per_variant


def run(repeats: int = 3, **_: Any) -> List[Row]:
    rows: List[Row] = []
    t = measure(CASES["tiny"], repeats)
    base = median(t["plain"])
    rows.append(Row(WORKLOAD, "plain loop, s / train iteration", base, "s"))
    labels = {
        "engine_no_hooks": "engine, no hooks",
        "engine_default_hooks": "engine, default hooks",
        "classy_vision": "classy_vision LocalTrainer (peer)",
        "ignite": "PyTorch Ignite supervised trainer (peer)",
        "lightning": "PyTorch Lightning Trainer (peer)",
    }
    labels = {v: label for v, label in labels.items() if v in VARIANTS}
    for variant, label in labels.items():
        ratio = median_ratio(list(zip(t[variant], t["plain"])))
        target, status = "", ""
        if variant == "engine_default_hooks":
            target, status = "<= 1.05x", at_most(ratio, 1.05)
        rows.append(Row(WORKLOAD, f"{label}, s / train iteration", median(t[variant]), "s", base, ratio, target,
                        status, extra={"per_repeat": t[variant], "plain_per_repeat": t["plain"]}))

    o = measure(CASES["overhead"], max(repeats, 3))
    base = median(o["plain"])
    rows.append(Row(WORKLOAD + " Linear(32,2) b8", "plain loop, us / train iteration", base * 1e6, "us"))
    for variant, label in labels.items():
        over = median([(a - b) * 1e6 for a, b in zip(o[variant], o["plain"])])
        target, status = "", ""
        if variant == "engine_default_hooks":
            target, status = "<= 20 us", at_most(over, 20.0)
        rows.append(Row(WORKLOAD + " Linear(32,2) b8", f"{label}, overhead us / iteration", over, "us",
                        base * 1e6, median_ratio(list(zip(o[variant], o["plain"]))), target, status,
                        extra={"per_repeat_s": o[variant], "plain_per_repeat_s": o["plain"]}))
    return rows
