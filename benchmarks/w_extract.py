"""W-extract: feature extraction throughput and peak memory, engine against a plain no-grad loop.

The W-tiny trunk (flatten + Linear(3072, 256) + ReLU, random init) over 4,096 and 20,000
samples of 3x32x32, batch 256, no loader workers. Samples come from a pool of 256 images
(``bench_generated``), so the data set itself takes no memory that grows with its size.

- engine: the ``extract_features`` engine (``engine_name=extract_features``) in this process,
  writing VISSL's shards (``rank0_chunk{C}_train_fc1_{features,targets,inds}.npy``, a shard
  every 4,096 samples, each file written atomically and durably: temporary name, fsync,
  rename, folder fsync; the files of a chunk are written by background threads while the next
  chunk is computed, and the split's time ends when the last file is on disk);
- plain: ``model.eval()``, ``torch.no_grad()``, every batch's features, targets and indices
  appended to lists, concatenated and ``np.save``d once at the end (what a short script does:
  no fsync, so its files may still be in the page cache when its clock stops; the engine's
  durability is part of what it is measured with).

Each (side, size) runs in a fresh process so that its peak RSS (VmHWM) is its own.
Figures: samples/s of the extraction loop including writing the arrays (the engine's own
per-split time: clearing old shards, building the loader, the loop, waiting for the last
shard; the plain loop's time from its first batch to its saved files; model and data set are
built before either clock starts), peak RSS, and the RSS the extraction added over the
process's RSS before it started.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

from benchmarks.common import REPO, Row, at_least, at_most, median, rotate

WORKLOAD = "W-extract"
SIZES = (4096, 20000)
BATCH = 256


def engine_overrides(samples: int, folder: str) -> List[str]:
    return [
        "engine_name=extract_features",
        "config.MACHINE.DEVICE=cpu",
        "config.DATA.NUM_DATALOADER_WORKERS=0",
        "config.DATA.PIN_MEMORY=false",
        "config.DATA.TRAIN.DATA_SOURCES=[bench_generated]",
        "config.DATA.TRAIN.LABEL_SOURCES=[bench_generated]",
        f"config.DATA.TRAIN.DATA_LIMIT={samples}",
        f"config.DATA.TRAIN.BATCHSIZE_PER_REPLICA={BATCH}",
        "config.TEST_MODEL=false",
        "config.MODEL.TRUNK.NAME=mlp",
        "config.MODEL.TRUNK.MLP.DIMS=[3072,256]",
        "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[256,10]}]]",
        "config.MODEL.FEATURE_EVAL_SETTINGS.EVAL_MODE_ON=true",
        "config.MODEL.FEATURE_EVAL_SETTINGS.FREEZE_TRUNK_AND_HEAD=true",
        "config.MODEL.FEATURE_EVAL_SETTINGS.EXTRACT_TRUNK_FEATURES_ONLY=true",
        "config.EXTRACT_FEATURES.SPLITS=[TRAIN]",
        f"config.EXTRACT_FEATURES.OUTPUT_DIR={folder}",
        f"config.CHECKPOINT.DIR={folder}",
        "config.OPTIMIZER.num_epochs=1",
        "config.OPTIMIZER.param_schedulers.lr.name=constant",
        "config.OPTIMIZER.param_schedulers.lr.value=0.1",
    ]


def child_engine(samples: int, folder: str) -> Dict[str, Any]:
    from benchmarks.common import compose_config, current_rss_mb, engine_logging, peak_rss_mb
    from ssl_engine.distributed import RankInfo
    from ssl_engine.engines.extract_features import extract_features_engine

    cfg = compose_config(engine_overrides(samples, folder))
    rss0 = current_rss_mb()
    with engine_logging(folder):
        t0 = time.perf_counter()
        summaries = extract_features_engine(cfg, RankInfo())
        total = time.perf_counter() - t0
    s = summaries[0]
    return {"samples": s["samples"], "seconds": s["seconds"], "total_seconds": total, "rss_before_mb": rss0,
            "peak_rss_mb": peak_rss_mb(), "files": len(os.listdir(folder))}


def child_plain(samples: int, folder: str) -> Dict[str, Any]:
    import numpy as np
    import torch
    from torch.utils.data import DataLoader, Dataset

    from benchmarks.common import _POOL_SIZE, current_rss_mb, peak_rss_mb, pool_sample, random_data

    pool, _ = random_data(_POOL_SIZE, (3, 32, 32), 10, seed=1)

    class Samples(Dataset):
        def __len__(self) -> int:
            return samples

        def __getitem__(self, i: int) -> Any:
            return pool_sample(pool, i), i % 10, i

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3072, 256), torch.nn.ReLU()).eval()
    loader = DataLoader(Samples(), batch_size=BATCH, shuffle=False, num_workers=0)
    rss0 = current_rss_mb()
    t0 = time.perf_counter()
    feats, targets, inds = [], [], []
    with torch.no_grad():
        for x, y, i in loader:
            feats.append(model(x).float().numpy())
            targets.append(y.numpy())
            inds.append(i.numpy())
    np.save(os.path.join(folder, "train_fc1_features.npy"), np.concatenate(feats))
    np.save(os.path.join(folder, "train_fc1_targets.npy"), np.concatenate(targets))
    np.save(os.path.join(folder, "train_fc1_inds.npy"), np.concatenate(inds))
    seconds = time.perf_counter() - t0
    return {"samples": samples, "seconds": seconds, "total_seconds": seconds, "rss_before_mb": rss0,
            "peak_rss_mb": peak_rss_mb(), "files": len(os.listdir(folder))}


def run_child(side: str, samples: int, threads: int) -> Dict[str, Any]:
    """One extraction in a fresh python process; its measurements."""
    with tempfile.TemporaryDirectory(prefix="bench_extract_") as folder:
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        cmd = [sys.executable, "-m", "benchmarks.w_extract", "--child", side, "--samples", str(samples),
               "--folder", folder, "--threads", str(threads)]
        proc = subprocess.run(cmd, cwd=str(REPO), env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"{side} extraction of {samples} samples failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])


def run(repeats: int = 1, threads: int = 1, **_: Any) -> List[Row]:
    results: Dict[tuple, List[Dict[str, Any]]] = {}
    jobs = [(side, n) for n in SIZES for side in ("plain", "engine")]
    for r in range(repeats):
        for side, n in rotate(jobs, r):
            results.setdefault((side, n), []).append(run_child(side, n, threads))

    def rate(side: str, n: int) -> List[float]:
        return [x["samples"] / x["seconds"] for x in results[(side, n)]]

    def stat(side: str, n: int, key: str) -> float:
        return median([x[key] for x in results[(side, n)]])

    rows: List[Row] = []
    for n in SIZES:
        plain_rate, engine_rate = median(rate("plain", n)), median(rate("engine", n))
        ratio = median([e / p for e, p in zip(rate("engine", n), rate("plain", n))])
        rows.append(Row(WORKLOAD, f"{n} samples: samples / s (engine vs plain)", engine_rate, "samples/s",
                        plain_rate, ratio, ">= 0.9x", at_least(ratio, 0.9),
                        extra={"engine": results[("engine", n)], "plain": results[("plain", n)]}))
    for side in ("engine", "plain"):
        small, big = stat(side, SIZES[0], "peak_rss_mb"), stat(side, SIZES[1], "peak_rss_mb")
        growth = big / small
        grown_small = small - stat(side, SIZES[0], "rss_before_mb")
        grown_big = big - stat(side, SIZES[1], "rss_before_mb")
        target, status = ("<= 1.2x", at_most(growth, 1.2)) if side == "engine" else ("", "")
        rows.append(Row(WORKLOAD, f"{side}: peak RSS {SIZES[1]} vs {SIZES[0]} samples", big, "MiB", small, growth,
                        target, status,
                        note=f"added by extraction: {grown_big:.0f} vs {grown_small:.0f} MiB"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", choices=("engine", "plain"), required=True)
    parser.add_argument("--samples", type=int, required=True)
    parser.add_argument("--folder", required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    out = child_engine(args.samples, args.folder) if args.child == "engine" else child_plain(args.samples, args.folder)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
