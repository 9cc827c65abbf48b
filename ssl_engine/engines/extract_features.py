"""The extract_features engine: write features of chosen layers for each split.

``engine_name: extract_features`` (or ``--engine=extract_features`` on the command line) builds
the model of the config, loads its weights only (no optimizer, no counters, so a finished
training is no obstacle), sets eval mode and runs each split of EXTRACT_FEATURES.SPLITS once,
streaming shards to EXTRACT_FEATURES.OUTPUT_DIR (see ssl_engine.features). Weights come from,
in this order: MODEL.WEIGHTS_INIT.PARAMS_FILE, CHECKPOINT.RESUME_FROM, the newest good
checkpoint of CHECKPOINT.DIR; with none of them the model keeps its seeded random init (the
same on every rank), which is what a "random trunk" baseline needs.

Ranks get uneven shares of each split (no padding: extraction has no per-step collectives),
so every sample index is written exactly once.

A preemption signal (SIGTERM, SIGUSR1; see ssl_engine.preemption) stops the extraction after
the batch in hand: the shards already on disk stay complete, the split's status stays
"running" (readers refuse it) and the process ends with PREEMPTED_EXIT_CODE; rerunning the
command extracts the split again. Each rank reads its own flag between batches (ranks run
different numbers of batches, so they cannot agree on it with a per-batch collective) and
the ranks agree at the split's end, in the gather of their sample counts: a rank that had
already finished its share stops with the others instead of failing on a vanished peer.
"""

import copy
import logging
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from ssl_engine import distributed as du
from ssl_engine import preemption
from ssl_engine.checkpoint import (check_intact, checkpoint_entries, list_checkpoints, load_checkpoint,
                                   newest_good_checkpoint, resume_from_file)
from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.config.validate import without_unextracted_splits
from ssl_engine.distributed import RankInfo
from ssl_engine.errors import CheckpointError, UserError, first_few
from ssl_engine.features import ShardWriter, remove_shards, write_extraction_status
from ssl_engine.lock import EXTRACT_LOCK_NAME, held_by_rank0
from ssl_engine.registry import ENGINES
from ssl_engine.trainer import SelfSupervisionTrainer

log = logging.getLogger(__name__)

SPLITS = ("TRAIN", "TEST")


def extraction_splits(cfg: AttrDict) -> List[str]:
    """EXTRACT_FEATURES.SPLITS in upper case, default every split that has DATA_SOURCES."""
    with_data = [s for s in SPLITS if cfg.DATA[s].DATA_SOURCES]
    asked = [str(s).upper() for s in cfg.EXTRACT_FEATURES.SPLITS] or with_data
    for s in asked:
        if s not in SPLITS:
            raise UserError(f"config.EXTRACT_FEATURES.SPLITS has {s!r}; valid: {', '.join(SPLITS)}")
        if s not in with_data:
            raise UserError(
                f"config.EXTRACT_FEATURES.SPLITS asks for {s} but config.DATA.{s}.DATA_SOURCES is empty; "
                f"name its data or leave {s} out"
            )
    if not asked:
        raise UserError("nothing to extract: config.DATA.TRAIN.DATA_SOURCES and config.DATA.TEST.DATA_SOURCES are empty")
    return list(dict.fromkeys(asked))


def extraction_config(cfg: AttrDict) -> AttrDict:
    """The config the task of an extraction is built from.

    The splits that EXTRACT_FEATURES.SPLITS leaves out are dropped (their DATA reset to the
    defaults), so nothing of theirs is checked or built. No batch is dropped (DROP_LAST off).
    The task builds its model only (``prepare(data=False)``: no loader and no optimizer, so
    an OPTIMIZER section, or a model frozen for linear evaluation, never stops an
    extraction). A config with TEST data is marked TEST_ONLY, so the phases the task lists
    ask for no TRAIN data.
    """
    out = AttrDict(copy.deepcopy(without_unextracted_splits(cfg).to_dict()))
    for s in SPLITS:
        out.DATA[s].DROP_LAST = False
    if out.DATA.TEST.DATA_SOURCES:
        out.TEST_ONLY = True
    return out


def output_dir(cfg: AttrDict) -> Path:
    """EXTRACT_FEATURES.OUTPUT_DIR, or CHECKPOINT.DIR when it is empty."""
    return Path(str(cfg.EXTRACT_FEATURES.OUTPUT_DIR or cfg.CHECKPOINT.DIR)).expanduser()


def weights_checkpoint(cfg: AttrDict) -> Optional[str]:
    """The checkpoint whose model weights are extracted (None: PARAMS_FILE or random init)."""
    if cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE:
        return None
    if cfg.CHECKPOINT.RESUME_FROM:
        return str(resume_from_file(cfg.CHECKPOINT.RESUME_FROM))
    folder = Path(str(cfg.CHECKPOINT.DIR))
    found = newest_good_checkpoint(folder)
    if found:
        return str(found[0])
    # a trained run whose files are all damaged: never extract a random model in its place; that
    # includes a checkpoint.torch (VISSL's copy, or the pointer) that does not load or leads nowhere,
    # and a folder or a link to nothing under a checkpoint's name
    unusable = [p.name for p in list_checkpoints(folder)]  # newest first
    unusable += [name for name in checkpoint_entries(folder) if name not in unusable]
    if unusable:
        shown = first_few(unusable, 4, quote=False)
        raise CheckpointError(
            f"config.CHECKPOINT.DIR {folder}: none of its checkpoints can be used ({shown}; the warnings above say "
            f"why); name the weights to extract with config.CHECKPOINT.RESUME_FROM or "
            f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE, or use a folder without checkpoints for a randomly initialised model"
        )
    return None


def load_weights(task: Any, checkpoint_path: Optional[str]) -> str:
    """Put the weights to extract into ``task.base_model``; returns where they came from."""
    cfg = task.config
    if cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE:
        from ssl_engine.checkpoint import heads_not_set, init_model_from_weights

        heads_out = bool(getattr(task.base_model, "extracts_head_output", False))
        why = heads_not_set(init_model_from_weights(task.base_model, cfg.MODEL, heads_used_untrained=heads_out), cfg.MODEL)
        if why is not None and heads_out:
            log.warning("extracting the output of heads that config.MODEL.WEIGHTS_INIT.PARAMS_FILE did not set (random "
                        "init)%s; set EXTRACT_TRUNK_FEATURES_ONLY=true for trunk features", why)
        return str(cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE)
    if checkpoint_path:
        data = load_checkpoint(Path(checkpoint_path))
        if cfg.CHECKPOINT.RESUME_FROM:  # the folder's newest good checkpoint was checked when it was chosen
            check_intact(Path(checkpoint_path), "config.CHECKPOINT.RESUME_FROM")
        try:
            state = data["classy_state_dict"]["base_model"]
        except (KeyError, TypeError):
            named = "config.CHECKPOINT.RESUME_FROM: " if cfg.CHECKPOINT.RESUME_FROM else ""
            raise CheckpointError(
                f"{named}{checkpoint_path} holds no classy_state_dict.base_model (top-level keys: "
                f"{first_few([str(k) for k in data]) or 'none'}), so it is not a training checkpoint; to extract "
                f"from a file of weights (a model-only or torchvision file) use config.MODEL.WEIGHTS_INIT.PARAMS_FILE"
            ) from None
        # trunk features need the trunk's weights only: the config's heads may differ from the training's
        trunk_only = not getattr(task.base_model, "extracts_head_output", True)
        try:
            task.load_model_state(state, trunk_only=trunk_only, fix=(
                "use the MODEL of its training, or config.MODEL.WEIGHTS_INIT.PARAMS_FILE to load what matches"))
        except CheckpointError as e:
            raise CheckpointError(f"{checkpoint_path}: {e}") from None
        return checkpoint_path
    log.warning(
        "no MODEL.WEIGHTS_INIT.PARAMS_FILE and no checkpoint in %s: extracting features of a randomly "
        "initialised model (seed %d)", cfg.CHECKPOINT.DIR, cfg.SEED_VALUE,
    )
    return "random init"


def weights_identity(source: str, seed: int) -> str:
    """Which weights an extraction ran, as its status files record them: the file (resolved, with
    its size and modification time, so that a file trained on under the same name differs) or the
    seeded random init. The kNN test compares the two splits' (see ssl_engine.knn)."""
    if source == "random init":
        return f"random init (SEED_VALUE={seed})"
    path = Path(source).expanduser()
    try:
        st = path.stat()
        seconds, nanoseconds = divmod(st.st_mtime_ns, 10**9)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds)) + f".{nanoseconds:09d} UTC"
        return f"{path.resolve()} ({st.st_size} bytes, modified {when})"
    except OSError:
        return str(path)


def _targets(batch: Dict[str, Any], n: int) -> np.ndarray:
    labels = batch.get("label") or []
    if not labels:
        return np.full(n, -1, dtype=np.int64)
    if len(labels) == 1:
        return labels[0].cpu().numpy()
    return torch.stack([lab.reshape(n, -1)[:, 0] for lab in labels], dim=1).cpu().numpy()


def _num_unique(inds: np.ndarray) -> int:
    """Distinct values in ``inds`` (np.unique would import numpy.ma, ~10-20 ms, inside the timed loop)."""
    if len(inds) < 2:
        return len(inds)
    s = np.sort(inds)
    return len(s) - int(np.count_nonzero(s[1:] == s[:-1]))


def build_extraction_datasets(task: Any, splits: List[str]) -> None:
    """Build the data set of every split to extract, before the first is extracted: the time a
    split's summary reports is its extraction, and a data set that fails to build on a rank
    stops the run before any shard is written."""
    from ssl_engine.data import build_dataset

    for split in splits:
        if split not in task.datasets:
            task.datasets[split] = build_dataset(task.config, split)
            log.info("%s data: %d samples", split.lower(), len(task.datasets[split]))


def extraction_loader(task: Any, split: str) -> Any:
    """A loader over ``split`` in dataset order, each sample on exactly one rank (no padding)."""
    from ssl_engine.data import build_dataloader

    build_extraction_datasets(task, [split])
    return build_dataloader(
        task.datasets[split], task.config, split, task.rank, task.world_size, task.config.MACHINE.DEVICE,
        pad=False, shuffle=False,
    )


def extract_split(task: Any, split: str, folder: Path) -> Dict[str, Any]:
    """Run ``split`` through the model once, writing a shard every CHUNK_THRESHOLD samples.

    Returns this split's summary: samples on all ranks, per-layer feature shape and dtype,
    chunks of this rank, seconds.
    """
    from ssl_engine.data.dataset import label_class_names
    from ssl_engine.data.loader import stop_workers

    cfg = task.config
    t0 = time.perf_counter()
    if du.is_primary():
        write_extraction_status(folder, split, "running")  # readers refuse the split until it is complete
        removed = remove_shards(folder, split)
        if removed:
            log.info("removed %d shard files of an earlier %s extraction in %s", removed, split.lower(), folder)
    du.barrier()
    loader = extraction_loader(task, split)
    writer = ShardWriter(folder, task.rank, split, cfg.EXTRACT_FEATURES.CHUNK_THRESHOLD)
    batches = iter(loader)
    unreadable: List[int] = []
    try:
        stopped = _write_features(task, split, batches, writer, unreadable)
    except Exception as e:
        if du.is_primary():  # readers then say why the split is missing, not that it is still running
            reason = (str(e).strip().splitlines() or [""])[0][:300]
            write_extraction_status(folder, split, "failed", error=f"{type(e).__name__}: {reason}")
        raise
    finally:
        stop_workers(batches)  # now, also on an error (see stop_workers)
    # every rank's shards are on disk past this point
    layers = {k: {"shape": list(v), "dtype": str(writer.dtypes[k]), "targets_dtype": str(writer.target_dtype)}
              for k, v in writer.shapes.items()}
    gathered = du.all_gather_object((writer.num_samples, stopped, unreadable, layers))
    if any(stop for _, stop, _, _ in gathered):
        raise preemption.Preempted(
            f"stopped extracting {split.lower()} features on a preemption signal after "
            f"{sum(n for n, _, _, _ in gathered)} samples; rerun the same command to extract them again"
        )
    counts = [n for n, _, _, _ in gathered]
    left_out = sorted(i for _, _, rank_left_out, _ in gathered for i in rank_left_out)
    for _, _, _, rank_layers in gathered:  # a rank that wrote nothing (every sample unreadable) knows none
        layers = layers or rank_layers
    if left_out and du.is_primary():
        log.warning("%d unreadable %s image(s) left out of the features (sample indices %s; the warnings above name "
                    "their files): no other image's features are written under their indices", len(left_out),
                    split, first_few(left_out, quote=False))
    if du.is_primary():
        label_type = str(cfg.DATA[split].get("LABEL_TYPE", "standard"))
        classes = label_class_names(cfg, split) if label_type == "standard" else None
        extra: Dict[str, Any] = {"classes": classes} if classes is not None else {}
        if getattr(task, "extracted_weights", None):
            extra["weights"] = task.extracted_weights
        if left_out:
            extra["unreadable"] = left_out
        write_extraction_status(folder, split, "complete", samples=int(sum(counts)), layers=layers,
                                label_type=label_type, **extra)
    return {
        "split": split.lower(),
        "samples": int(sum(counts)),
        "samples_per_rank": counts,
        "layers": layers,
        "chunks": writer.chunk,
        "seconds": time.perf_counter() - t0,
        "folder": str(folder),
    }


def _write_features(task: Any, split: str, batches: Any, writer: Any, unreadable: List[int]) -> bool:
    """Run every batch through the model and hand its features to ``writer``; True when a
    preemption signal stopped it before the end of the data.

    A sample whose image could not be read (ON_CORRUPT_IMAGE: skip) arrives as another image
    marked ``data_valid`` -1: its row is left out (its index added to ``unreadable``), so that no
    image's features or label are written under another sample's index.
    """
    cfg = task.config
    non_blocking = task.device.type == "cuda" and cfg.DATA.ENABLE_ASYNC_GPU_COPY
    model = task.base_model
    with writer:  # waits for the shard files being written; on an error, stops the writer threads
        for batch in batches:
            views, inds = batch["data"], batch["data_idx"][0].numpy()
            # moco_collator hands a sample's second view over as data_momentum, beside data
            momentum = batch.get("data_momentum")
            inputs = len(views) + (len(momentum) if isinstance(momentum, (list, tuple)) else momentum is not None)
            unique = _num_unique(inds)
            if inputs != 1 or unique != len(inds):
                from ssl_engine.config.validate import inputs_origin

                raise UserError(
                    f"config.DATA.{split} gives {max(inputs, len(inds) // max(unique, 1))} inputs per sample; "
                    f"feature extraction needs one; they come from "
                    f"{inputs_origin(cfg, split, 'remove them and use COLLATE_FUNCTION default_collate')}"
                )
            with task.autocast():
                feats = model.extract_features(views[0].to(task.device, non_blocking=non_blocking))
            arrays = {name: f.detach().float().cpu().numpy() for name, f in feats.items()}
            targets = _targets(batch, len(inds))
            flags = batch.get("data_valid")
            if flags:
                keep = flags[0].numpy() > 0
                if not keep.all():
                    unreadable.extend(int(i) for i in inds[~keep])
                    arrays = {name: a[keep] for name, a in arrays.items()}
                    targets, inds = targets[keep], inds[keep]
            if len(inds):
                writer.add(arrays, targets, inds)
            if preemption.requested():
                return True
    return False


def log_summary(summaries: List[Dict[str, Any]], source: str) -> None:
    """One line per split and layer: samples, feature shape, seconds (rank 0)."""
    if not du.is_primary():
        return
    log.info("extracted features of %s", source)
    for s in summaries:
        rate = s["samples"] / max(s["seconds"], 1e-9)
        for layer, info in s["layers"].items():
            log.info(
                "  %s %s: %d samples, features %s %s, %d chunk(s) on rank 0, %.1f s (%.0f samples/s) -> %s",
                s["split"], layer, s["samples"], [s["samples"]] + info["shape"], info["dtype"], s["chunks"],
                s["seconds"], rate, s["folder"],
            )


@ENGINES.register("extract_features")
def extract_features_engine(cfg: AttrDict, info: RankInfo) -> Any:
    ext_cfg = extraction_config(cfg)
    extraction_splits(ext_cfg)  # check the splits before building anything
    trainer = SelfSupervisionTrainer(ext_cfg, info.init_method, weights_checkpoint(ext_cfg), str(cfg.CHECKPOINT.DIR), [],
                                     local_rank=info.local_rank)
    # one extraction writes a feature folder at a time: two would remove and mix each other's shards
    with held_by_rank0(output_dir(ext_cfg), EXTRACT_LOCK_NAME) as held:
        return trainer.extract() if held else None
