#!/usr/bin/env python
"""kNN top-1 / top-5 of extracted features: the standard check of a self-supervised model.

    python tools/nearest_neighbor_test.py config=extract/simclr_digits_trunk \\
        config.CHECKPOINT.DIR=./checkpoints/simclr_digits

With config.NEAREST_NEIGHBOR.FEATURES.PATH empty it first extracts the TRAIN and TEST
features of the config's model (the extract_features engine, any number of ranks), then reads
them from EXTRACT_FEATURES.OUTPUT_DIR (default CHECKPOINT.DIR); with a PATH it only reads.
Options: NEAREST_NEIGHBOR.TOPK (neighbours that vote), SIGMA (vote temperature), TOPK_LIST
(accuracies to report), TEST_CHUNK_SIZE (test samples compared at once). Every layer that has
train and test shards is evaluated. Exit code 2 with one line for anything the user can fix.
"""

import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from ssl_engine.errors import UserError


def extract(cfg, node_id: int = 0) -> int:
    """Run the extract_features engine on the TRAIN and TEST splits of ``cfg``; its exit code."""
    for split in ("TRAIN", "TEST"):
        if not cfg.DATA[split].DATA_SOURCES:
            raise UserError(f"the kNN test needs TRAIN and TEST features but config.DATA.{split}.DATA_SOURCES is empty")
    asked = [str(s).upper() for s in cfg.EXTRACT_FEATURES.SPLITS]
    if asked and not {"TRAIN", "TEST"} <= set(asked):
        raise UserError(f"the kNN test needs TRAIN and TEST features; config.EXTRACT_FEATURES.SPLITS={asked}")
    from ssl_engine.knn import targets_of

    for split in ("TRAIN", "TEST"):  # told now, not after every feature is extracted
        label_type = str(cfg.DATA[split].get("LABEL_TYPE", "standard"))
        if label_type != "standard":
            raise UserError(
                f"the kNN test compares class labels, but config.DATA.{split}.LABEL_TYPE={label_type} gives the "
                f"features {targets_of(label_type)} as targets; set config.DATA.{split}.LABEL_TYPE=standard")
    from ssl_engine.cli import check_before_launch
    from ssl_engine.launch import launch

    cfg.engine_name = "extract_features"
    check_before_launch(cfg, node_id)  # as run_distributed_engines.py checks an extraction, before any rank starts
    return launch(cfg, node_id=node_id)


def evaluate(cfg, folder: Path) -> Dict[str, Dict[int, float]]:
    """kNN accuracies of every layer with train and test shards in ``folder``, printed as they come."""
    from ssl_engine.errors import first_few
    from ssl_engine.features import SHARD_NAMING, FeatureShardError, available, check_finished, unnamed_arrays
    from ssl_engine.knn import knn_of_layer, load_train_and_test, paired_layers

    for split in ("train", "test"):
        check_finished(folder, split)  # an extraction that failed or was stopped says so, not "no shards"
    pairs = available(folder)
    layers = paired_layers(folder, pairs)
    if not layers:
        have = ", ".join(f"{s}/{l}" for s, l in pairs) or "no shards"
        others = unnamed_arrays(folder)
        raise FeatureShardError(
            f"{folder} has no layer with both train and test features ({have}); shards are named {SHARD_NAMING}"
            + (f", and its other .npy files ({first_few(others)}) are not: merged or renamed files are not read"
               if others else "")
        )
    nn = cfg.NEAREST_NEIGHBOR
    results = {}
    for layer in layers:
        train, test = load_train_and_test(folder, layer)
        acc = knn_of_layer(train, test, layer, folder, topk=nn.TOPK, sigma=nn.SIGMA, topk_list=nn.TOPK_LIST,
                           chunk_size=nn.TEST_CHUNK_SIZE, l2_norm=bool(nn.L2_NORM_FEATS))
        results[layer] = acc
        scores = " | ".join(f"top-{k} {v:.2f}%" for k, v in acc.items())
        k = min(int(nn.TOPK), len(train["inds"]))
        capped = f" (TOPK={nn.TOPK} capped at the train size)" if k < int(nn.TOPK) else ""
        similarity = "cosine" if nn.L2_NORM_FEATS else "dot product"
        print(
            f"kNN {layer} (k={k}{capped}, sigma={nn.SIGMA}, {similarity}; {len(train['inds'])} train / "
            f"{len(test['inds'])} test, dim {train['features'].shape[1]}): {scores}",
            flush=True,
        )
    return results


def run(cfg: Any, node_id: int) -> int:
    """Extract features (unless NEAREST_NEIGHBOR.FEATURES.PATH names them), then the kNN test."""
    from ssl_engine.engines.extract_features import output_dir

    folder = Path(str(cfg.NEAREST_NEIGHBOR.FEATURES.PATH)).expanduser()
    if cfg.NEAREST_NEIGHBOR.FEATURES.PATH and not folder.is_dir():
        from ssl_engine.errors import UserError

        raise UserError(f"config.NEAREST_NEIGHBOR.FEATURES.PATH: {folder} "
                        f"{'is not a folder' if folder.exists() else 'does not exist'}; name the folder the "
                        f"extract_features engine wrote (its EXTRACT_FEATURES.OUTPUT_DIR), or leave it empty to extract first")
    if not cfg.NEAREST_NEIGHBOR.FEATURES.PATH:
        code = extract(cfg, node_id)
        if code != 0:
            return code
        if node_id != 0 or int(os.environ.get("RANK", "0")) != 0:
            return 0  # under torchrun / multi-node, rank 0 of node 0 computes the kNN
        folder = output_dir(cfg)
    evaluate(cfg, folder)
    return 0


def checked(cfg: Any) -> Any:
    """What of ``cfg`` the test builds and reads: nothing but NEAREST_NEIGHBOR when FEATURES.PATH
    names the features (no data is read and no model built, so a VISSL config without DATA_PATHS,
    or one of a trunk ssl_engine lacks whose features VISSL extracted, is tested as it is)."""
    from ssl_engine.config.validate import without_unextracted_splits

    return None if cfg.NEAREST_NEIGHBOR.FEATURES.PATH else without_unextracted_splits(cfg)


def main(argv: Optional[List[str]] = None, tool_process: bool = False) -> int:
    from ssl_engine.cli import KNN_USAGE, run_command

    return run_command(argv, run, tool_process=tool_process, checked=checked, usage=KNN_USAGE, engine_option=False)


if __name__ == "__main__":
    sys.exit(main(tool_process=True))
