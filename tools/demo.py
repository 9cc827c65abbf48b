#!/usr/bin/env python
"""`make demo`: pretrain SimCLR on digits on the CPU, then judge its features against a random trunk.

    python tools/demo.py --folder demo_run

1. trains configs/config/quick/simclr_digits.yaml (resnet18 at 32x32 on scikit-learn's digits)
   with the real tool in a subprocess, in <folder>/simclr_digits (a finished training is skipped,
   an interrupted one resumes);
2. extracts the res5avg features of its trunk for TRAIN and TEST (configs/config/extract/
   simclr_digits_trunk.yaml), and the same features of a randomly initialised trunk;
3. prints kNN top-1 (the config's NEAREST_NEIGHBOR options) and a logistic-regression linear
   probe for both, and writes them to <folder>/results.json.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "tools" / "run_distributed_engines.py"
TRAIN_CONFIG = "quick/simclr_digits"
EXTRACT_CONFIG = "extract/simclr_digits_trunk"
LAYER = "res5avg"


def run(args: List[str]) -> None:
    """Run the engine tool; its log goes straight to the console. A failure ends the demo with the
    tool's exit code (2: a user error, whose one line the tool printed; 130: Ctrl-C)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    code = subprocess.call([sys.executable, str(TOOL), *args], cwd=str(REPO), env=env)
    if code == 2:
        sys.exit(2)
    if code != 0:
        print(f"demo: `{TOOL.name} {' '.join(args)}` failed with exit code {code}", file=sys.stderr)
        sys.exit(code if 0 < code < 256 else 1)


def linear_probe(train: Dict, test: Dict) -> float:
    """Top-1 (%) of a logistic regression on standardised features."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000, C=0.1))
    clf.fit(train["features"], train["targets"])
    return 100.0 * float(clf.score(test["features"], test["targets"]))


def evaluate(folder: Path, nn_cfg) -> Dict[str, float]:
    from ssl_engine.features import load_features
    from ssl_engine.knn import knn_accuracy

    train = load_features(folder, "train", LAYER)
    test = load_features(folder, "test", LAYER)
    knn = knn_accuracy(train["features"], train["targets"], test["features"], test["targets"],
                       topk=nn_cfg.TOPK, sigma=nn_cfg.SIGMA, topk_list=[1, 5], chunk_size=nn_cfg.TEST_CHUNK_SIZE,
                       l2_norm=bool(nn_cfg.L2_NORM_FEATS))
    return {"knn_top1": knn[1], "knn_top5": knn[5], "linear_top1": linear_probe(train, test),
            "num_train": len(train["inds"]), "num_test": len(test["inds"])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--folder", default="demo_run", help="where the run and the features go")
    args = parser.parse_args()
    from ssl_engine.cli import check_working_folder
    from ssl_engine.config.validate import check_output_folder
    from ssl_engine.errors import UserError

    try:  # before anything starts: the folder is named as the user gave it, not as a run's CHECKPOINT.DIR
        check_working_folder()  # a relative --folder in a deleted working folder is no link loop
        check_output_folder(args.folder, "--folder")
    except UserError as e:
        parser.exit(2, f"error: {e}\n")
    folder = Path(args.folder).expanduser().resolve()
    run_dir, random_dir = folder / "simclr_digits", folder / "random_init"
    t0 = time.time()

    print(f"== 1/3 SimCLR pretraining ({TRAIN_CONFIG}) in {run_dir}", flush=True)
    run([f"config={TRAIN_CONFIG}", f"config.CHECKPOINT.DIR={run_dir}"])
    t_train = time.time() - t0
    print("== 2/3 features of the trained trunk and of a randomly initialised one", flush=True)
    run([f"config={EXTRACT_CONFIG}", f"config.CHECKPOINT.DIR={run_dir}",
         f"config.EXTRACT_FEATURES.OUTPUT_DIR={folder / 'features_trained'}"])
    run([f"config={EXTRACT_CONFIG}", f"config.CHECKPOINT.DIR={random_dir}",
         f"config.EXTRACT_FEATURES.OUTPUT_DIR={folder / 'features_random_init'}"])

    print("== 3/3 kNN and linear probe", flush=True)
    from ssl_engine.config import compose

    nn_cfg = compose([f"config={EXTRACT_CONFIG}"]).NEAREST_NEIGHBOR
    trained = evaluate(folder / "features_trained", nn_cfg)
    rand = evaluate(folder / "features_random_init", nn_cfg)
    results = {"layer": LAYER, "knn": {"topk": nn_cfg.TOPK, "sigma": nn_cfg.SIGMA},
               "trained": trained, "random_init": rand,
               "seconds": {"train": round(t_train, 1), "total": round(time.time() - t0, 1)}}
    (folder / "results.json").write_text(json.dumps(results, indent=2) + "\n")

    print(f"\ndigits, resnet18 trunk, {LAYER} features ({trained['num_train']} train / {trained['num_test']} test images):")
    print(f"  kNN top-1 (k={nn_cfg.TOPK}, sigma={nn_cfg.SIGMA}):      "
          f"trained {trained['knn_top1']:.1f}% | random init {rand['knn_top1']:.1f}%")
    print(f"  linear probe top-1 (logistic regression): "
          f"trained {trained['linear_top1']:.1f}% | random init {rand['linear_top1']:.1f}%")
    print(f"  ({time.time() - t0:.0f} s; results in {folder / 'results.json'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
