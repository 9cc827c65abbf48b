"""W-phases: what a phase change costs, with 2 loader workers.

The W-tiny model, 10 epochs of 10 train iterations (batch 64), each followed by a test phase
of 5 batches, ``NUM_DATALOADER_WORKERS=2`` started with the config's
``MULTI_PROCESSING_METHOD`` (forkserver by default), against a plain loop whose two
DataLoaders keep their workers alive between epochs (``persistent_workers=True``, same start
method).

Figures: total wall time (building the loaders and model, starting the workers, all phases,
stopping the workers: the engine's ``train()`` stops them before it returns),
and the phase change: the time from the last iteration of one phase to the first iteration of
the next, minus one typical iteration of the new phase (median over the run's 19 phase
changes; see ``common.phase_changes``). The engine runs with no hooks (the loop's own phase
change: meters, sampler epoch, new iterator) and with its default hooks (adds metrics.json and
a checkpoint at every train phase end, each written with fsync).
"""

import time
from typing import Any, Dict, List

import torch

from benchmarks import plain
from benchmarks.common import (
    Row,
    at_most,
    compose_config,
    engine_train,
    median,
    median_ratio,
    phase_changes,
    random_data,
    rotate,
    set_memory_data,
)
from benchmarks.w_tiny import engine_overrides, plain_model

WORKLOAD = "W-phases"

CASE: Dict[str, Any] = {"shape": (3, 32, 32), "trunk": [3072, 256], "relu": True, "head": [256, 10], "classes": 10,
                        "batch": 64, "train_iters": 10, "test_iters": 5, "epochs": 10}
WORKERS = 2
VARIANTS = ("plain", "engine_no_hooks", "engine_default_hooks")


def run_plain(data: Dict[str, Any], mp_context: str) -> Dict[str, Any]:
    t0 = time.perf_counter()
    train = plain.tensor_loader(*data["train"], CASE["batch"], True, WORKERS, mp_context=mp_context)
    test = plain.tensor_loader(*data["test"], CASE["batch"], False, WORKERS, mp_context=mp_context)
    out = plain.train_and_test(plain_model(CASE), train, test, CASE["epochs"], lr=0.1)
    for loader in (train, test):  # stop the persistent workers, as the engine's train() does before it returns
        it = getattr(loader, "_iterator", None)
        if it is not None:
            it._shutdown_workers()
    out["seconds"] = time.perf_counter() - t0
    return out


def run(repeats: int = 7, **_: Any) -> List[Row]:
    n_train, n_test = CASE["batch"] * CASE["train_iters"], CASE["batch"] * CASE["test_iters"]
    data = {"train": random_data(n_train, CASE["shape"], CASE["classes"], 0),
            "test": random_data(n_test, CASE["shape"], CASE["classes"], 1)}
    set_memory_data("TRAIN", *data["train"])
    set_memory_data("TEST", *data["test"])
    cfg = compose_config(engine_overrides(CASE, workers=WORKERS))
    mp_context = str(cfg.MULTI_PROCESSING_METHOD)
    if mp_context == "forkserver":  # start the fork server now, not inside the first measured run
        from multiprocessing import forkserver

        forkserver.ensure_running()
    run_plain(data, mp_context)  # warm-up, not measured: first worker start, first-use costs
    totals: Dict[str, List[float]] = {v: [] for v in VARIANTS}
    changes: Dict[str, List[float]] = {v: [] for v in VARIANTS}
    worst: Dict[str, List[float]] = {v: [] for v in VARIANTS}
    for r in range(repeats):
        for variant in rotate(list(VARIANTS), r):
            torch.manual_seed(0)
            if variant == "plain":
                out = run_plain(data, mp_context)
            else:
                out = engine_train(cfg, default_hooks=(variant == "engine_default_hooks"))
            excess = [c["excess"] for c in phase_changes(out["steps"])]
            totals[variant].append(out["seconds"])
            changes[variant].append(median(excess))
            worst[variant].append(max(excess))

    rows = [
        Row(WORKLOAD, "plain loop, total wall time", median(totals["plain"]), "s",
            extra={"per_repeat": totals["plain"]}),
        Row(WORKLOAD, "plain loop, phase change", median(changes["plain"]) * 1e3, "ms",
            extra={"per_repeat_ms": [c * 1e3 for c in changes["plain"]],
                   "worst_ms": [w * 1e3 for w in worst["plain"]]}),
    ]
    for variant, label in (("engine_no_hooks", "engine, no hooks"), ("engine_default_hooks", "engine, default hooks")):
        ratio = median_ratio(list(zip(totals[variant], totals["plain"])))
        rows.append(Row(WORKLOAD, f"{label}, total wall time", median(totals[variant]), "s", median(totals["plain"]),
                        ratio, "<= 1.1x", at_most(ratio, 1.1), extra={"per_repeat": totals[variant]}))
        change_ms = median(changes[variant]) * 1e3
        rows.append(Row(WORKLOAD, f"{label}, phase change", change_ms, "ms", median(changes["plain"]) * 1e3, None,
                        "<= 50 ms", at_most(change_ms, 50.0),
                        extra={"per_repeat_ms": [c * 1e3 for c in changes[variant]],
                               "worst_ms": [w * 1e3 for w in worst[variant]]}))
    return rows
