"""Extracted feature shards: writing them as the data streams by, and reading them back.

A rank writes, for each split and layer, one shard every ``EXTRACT_FEATURES.CHUNK_THRESHOLD``
samples, with VISSL's names::

    <folder>/rank{R}_chunk{C}_{split}_{layer}_features.npy   [n, D] (or [n, C, H, W] unflattened)
    <folder>/rank{R}_chunk{C}_{split}_{layer}_targets.npy    [n] (or [n, L] with several labels)
    <folder>/rank{R}_chunk{C}_{split}_{layer}_inds.npy       [n] int64 sample indices

(``split`` in lower case). Every file is written to a temporary name, fsynced and renamed into
place, so a reader never sees half a shard, even after a crash. A background thread appends each
batch's rows to the chunk's temporary files while the next batch is computed, so a rank holds
about one chunk of a split in memory at most, and the end of a chunk costs a header, fsyncs and
renames, not a concatenation and a whole write. :func:`load_features` merges the shards of all ranks and chunks,
sorted by index; :func:`iter_shards` walks them one at a time without loading the rest.

Each split also has a status file, ``<folder>/extraction_{split}.json``: ``{"status": "running"}``
from the moment its extraction starts, ``{"status": "complete", "samples": N, ...}`` once every
rank's shards are on disk, ``{"status": "failed", "error": ...}`` when rank 0 stopped on an
error (a kill leaves "running"). Readers refuse a split whose extraction did not finish and check the
sample count of a complete one; shards without a status file (written by VISSL) are read as
they are.
"""

import json
import os
import re
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ssl_engine.checkpoint import atomic_write_text, fsync_dir, write_failure
from ssl_engine.errors import UserError
from ssl_engine.resume_state import is_int

DEFAULT_CHUNK_THRESHOLD = 4096
KINDS = ("features", "targets", "inds")
_SHARD_RE = re.compile(r"^rank(\d+)_chunk(\d+)_([a-z0-9]+)_(.+)_(features|targets|inds)\.npy$")
# VISSL's extraction before it wrote chunks: one shard per rank, rank{R}_{split}_{layer}_{kind}.npy
_CHUNKLESS_RE = re.compile(r"^rank(\d+)_(train|test)_(.+)_(features|targets|inds)\.npy$")
_CHUNKLESS = -1  # the chunk of a chunk-less shard in the index (read as chunk 0)


class FeatureShardError(UserError):
    """A features folder has no shards for what was asked, or shards that do not fit together."""


def shard_path(folder: Path, rank: int, chunk: int, split: str, layer: str, kind: str) -> Path:
    """The file of one shard part: ``rank{R}_chunk{C}_{split}_{layer}_{kind}.npy``."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return Path(folder) / f"rank{int(rank)}_chunk{int(chunk)}_{split.lower()}_{layer}_{kind}.npy"


def status_path(folder: Path, split: str) -> Path:
    return Path(folder) / f"extraction_{split.lower()}.json"


def write_extraction_status(folder: Path, split: str, status: str, **details: object) -> None:
    """Record (atomically) that the extraction of ``split`` is ``running``, ``complete`` or ``failed``."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    atomic_write_text(status_path(folder, split), json.dumps({"status": status, "split": split.lower(), **details}) + "\n")


def extraction_status(folder: Path, split: str) -> Optional[Dict[str, object]]:
    """The status file of ``split`` (None when there is none: shards written by VISSL)."""
    path = status_path(folder, split)
    if not path.is_file():
        if path.exists() or path.is_symlink():  # a folder or a broken link where the status file belongs
            raise FeatureShardError(f"{path} is not a status file of this engine (not a readable file); extract "
                                    f"{split.lower()} again")
        return None
    try:
        status = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError):
        status = None
    if not isinstance(status, dict):
        raise FeatureShardError(f"{path} is not a status file of this engine; extract {split.lower()} again")
    problem = _status_problem(status)
    if problem:
        raise FeatureShardError(f"{path} is not a status file of this engine ({problem}); extract {split.lower()} again")
    return status


def _status_problem(status: Dict[str, object]) -> str:
    """What in a status file's fields is not what the engine writes ('' when nothing): a file edited
    by hand would otherwise be read as far as it goes (a missing shard unnoticed, labels renumbered)."""
    state = status.get("status")
    if state not in ("running", "complete", "failed"):
        return f"its status is {state!r}, not running, complete or failed" if "status" in status else "it has no status"
    if state != "complete":
        return ""
    samples, layers = status.get("samples"), status.get("layers")
    if not is_int(samples) or samples < 0:
        return f"its samples is {samples!r}, not a count" if "samples" in status else "it has no samples count"
    if "layers" in status and not isinstance(layers, (dict, list)):
        return f"its layers is {layers!r}, not the layers extracted"
    classes = status.get("classes")
    if classes is not None and (not isinstance(classes, list) or not all(isinstance(c, str) for c in classes)
                                or len(set(classes)) != len(classes)):
        return f"its classes is {classes!r}, not a list of distinct class names"
    label_type = status.get("label_type", "standard")
    if label_type not in ("standard", "sample_index", "zero"):
        return f"its label_type is {label_type!r}"
    unreadable = status.get("unreadable")
    if unreadable is not None and (not isinstance(unreadable, list) or not all(is_int(i) and i >= 0 for i in unreadable)):
        return f"its unreadable is {unreadable!r}, not a list of sample indices"
    return ""


def split_classes(folder: Path, split: str) -> Optional[List[str]]:
    """The class names the extraction of ``split`` recorded (label id i is name i), when its
    labels came from class folders; None otherwise (other labels, or shards written by VISSL)."""
    classes = (extraction_status(folder, split) or {}).get("classes")
    return [str(c) for c in classes] if isinstance(classes, list) else None


def split_label_type(folder: Path, split: str) -> str:
    """The LABEL_TYPE the extraction of ``split`` used for its targets ('standard' when it did
    not record one: shards written by VISSL or by an older version)."""
    return str((extraction_status(folder, split) or {}).get("label_type", "standard"))


def check_finished(folder: Path, split: str) -> Optional[Dict[str, object]]:
    """The status of ``split`` in ``folder`` (None for shards without one, e.g. VISSL's);
    FeatureShardError when its extraction failed or did not finish."""
    status = extraction_status(folder, split)
    if status is not None and status.get("status") == "failed":
        raise FeatureShardError(
            f"the {split.lower()} extraction in {folder} failed ({status.get('error', 'no reason recorded')}); "
            f"fix that and run the extract_features engine again"
        )
    if status is not None and status.get("status") != "complete":
        raise FeatureShardError(
            f"the {split.lower()} extraction in {folder} did not finish (it stopped while running, see "
            f"{status_path(folder, split).name}); run the extract_features engine again"
        )
    return status


def _shard_name(name: str) -> Optional[Tuple[int, int, str, str, str]]:
    """(rank, chunk, split, layer, kind) of a shard file's name; None for another file. VISSL's
    older chunk-less shards (``rank{R}_{split}_{layer}_{kind}.npy``) get chunk ``_CHUNKLESS``."""
    m = _SHARD_RE.match(name)
    if m:
        return int(m[1]), int(m[2]), m[3], m[4], m[5]
    m = _CHUNKLESS_RE.match(name)
    if m:
        return int(m[1]), _CHUNKLESS, m[2], m[3], m[4]
    return None


def _index(folder: Path) -> Dict[Tuple[str, str], Dict[Tuple[int, int], Dict[str, Path]]]:
    """{(split, layer): {(rank, chunk): {kind: path}}} of the shard files in ``folder``."""
    out: Dict[Tuple[str, str], Dict[Tuple[int, int], Dict[str, Path]]] = {}
    for p in Path(folder).iterdir():
        named = _shard_name(p.name)
        if named and p.is_file():
            rank, chunk, split, layer, kind = named
            out.setdefault((split, layer), {}).setdefault((rank, chunk), {})[kind] = p
    return out


SHARD_NAMING = "rank<R>_chunk<C>_<split>_<layer>_<features|targets|inds>.npy (or VISSL's older rank<R>_<split>_<layer>_...)"


def unnamed_arrays(folder: Path) -> List[str]:
    """The .npy files in ``folder`` not named as shards (SHARD_NAMING, or VISSL's older chunk-less
    names): merged or renamed feature files that no reader here takes, named in its errors."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.glob("*.npy") if p.is_file() and _shard_name(p.name) is None)


def available(folder: Path) -> List[Tuple[str, str]]:
    """The (split, layer) pairs that have shards in ``folder``, sorted."""
    folder = Path(folder)
    return sorted(_index(folder)) if folder.is_dir() else []


def remove_shards(folder: Path, split: str, layers: Optional[Sequence[str]] = None) -> int:
    """Delete the shards of ``split`` (and ``layers``, default all) so a new extraction starts clean.

    Without this, shards left by an earlier extraction with more ranks or chunks would be merged
    with the new ones. Returns the number of files removed.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return 0
    removed = 0
    for (s, layer), shards in _index(folder).items():
        if s != split.lower() or (layers is not None and layer not in layers):
            continue
        for parts in shards.values():
            for p in parts.values():
                p.unlink(missing_ok=True)
                removed += 1
    return removed


@dataclass
class FeatureShard:
    """One chunk of one rank: features, targets and inds of the same samples."""

    rank: int
    chunk: int
    features: np.ndarray
    targets: np.ndarray
    inds: np.ndarray
    name: str = ""  # the files' common part, e.g. rank0_chunk2_train_res5 (for messages)


def _shard_paths(folder: Path, split: str, layer: str) -> List[Tuple[Tuple[int, int], Dict[str, Path]]]:
    """The (rank, chunk) -> files of one split and layer, sorted; a clear error when none or partial."""
    folder = Path(folder)
    split = split.lower()
    if not folder.is_dir():  # a file (a shard itself, say) is named as one: "does not exist" misled
        what = "is a file, not the folder of shards" if folder.exists() else "does not exist"
        raise FeatureShardError(f"features folder {folder} {what}")
    check_finished(folder, split)
    index = _index(folder)
    shards = index.get((split, layer))
    if not shards:
        have = ", ".join(f"{s}/{l}" for s, l in sorted(index)) or "none"
        raise FeatureShardError(
            f"no feature shards for split {split!r} and layer {layer!r} in {folder} "
            f"(shards are named {SHARD_NAMING}; split/layer found: {have})"
        )
    for (rank, chunk), parts in sorted(shards.items()):
        missing = [k for k in KINDS if k not in parts]
        if missing:
            raise FeatureShardError(
                f"inconsistent feature shards in {folder}: {_stem(next(iter(parts.values())))} has no "
                f"{', '.join(missing)} file; extract again"
            )
    chunkless = sorted(r for r, c in shards if c == _CHUNKLESS)
    if chunkless and len(chunkless) != len(shards):
        raise FeatureShardError(
            f"inconsistent feature shards in {folder}: split {split!r} layer {layer!r} has chunk-less shards "
            f"(rank{chunkless[0]}_{split}_{layer}_*, VISSL's older naming) and chunked ones (rank<R>_chunk<C>_...): "
            f"two extractions are mixed; move one of them to another folder"
        )
    ranks = sorted({r for r, _ in shards})
    for rank in ranks:  # a chunk deleted from between two others would shorten the split unnoticed
        chunks = sorted(c for r, c in shards if r == rank and c != _CHUNKLESS)
        if chunks and chunks != list(range(len(chunks))):
            gone = sorted(set(range(chunks[-1])) - set(chunks))
            raise FeatureShardError(
                f"inconsistent feature shards in {folder}: split {split!r} layer {layer!r} has chunks {chunks} of "
                f"rank {rank}; chunk {gone[0]} is missing (removed, or not written); extract again"
            )
    # a rank all of whose samples were unreadable writes no shard: a complete extraction that left
    # samples out may lack a rank (the sample count, checked on loading, still has to match)
    left_out = (extraction_status(folder, split) or {}).get("unreadable")
    if ranks != list(range(len(ranks))) and not left_out:
        raise FeatureShardError(
            f"inconsistent feature shards in {folder}: split {split!r} layer {layer!r} has shards of ranks "
            f"{ranks}, not 0..{len(ranks) - 1}; extract again into an empty folder"
        )
    return sorted(shards.items())


def _stem(path: Path) -> str:
    """A shard file's name without its kind: rank0_chunk2_train_res5 (or rank0_train_res5)."""
    named = _shard_name(path.name)
    return path.name[: -len(f"_{named[4]}.npy")] if named else path.stem


def _read_shard(key: Tuple[int, int], parts: Dict[str, Path], mmap: bool) -> FeatureShard:
    mode = "r" if mmap else None
    stem = _stem(parts["features"])
    name = f"{parts['features'].parent}/{stem}_*"
    arrays = {}
    for k in KINDS:
        try:
            arrays[k] = np.load(parts[k], mmap_mode=mode, allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            if "pickled" in why or "allow_pickle" in why:  # numpy's advice would load a damaged file unsafely
                why = "its header is damaged (it does not describe a numeric array)"
            elif "mmap length is greater than file size" in why:
                why = "it is shorter than its header says (truncated)"
            raise FeatureShardError(f"cannot read feature shard {parts[k]}: {why}; extract again") from None
    for kind, array in arrays.items():
        # inds: one integer per sample; targets and features: numbers, one row per sample
        wrong_dtype = array.dtype.kind not in ("iu" if kind == "inds" else "iufb")
        if array.ndim == 0 or (kind == "inds" and array.ndim != 1) or wrong_dtype:
            raise FeatureShardError(
                f"feature shard {name}: its {kind} file holds a {array.dtype} array of shape {tuple(array.shape)}; "
                f"{'inds are one integer per sample' if kind == 'inds' else kind + ' are numbers, one row per sample'}, "
                f"extract again"
            )
    n = {k: len(a) for k, a in arrays.items()}
    if len(set(n.values())) != 1:
        raise FeatureShardError(
            f"inconsistent feature shard {parts['features'].name}: features, targets and inds have "
            f"{n['features']}, {n['targets']} and {n['inds']} rows; extract again"
        )
    return FeatureShard(key[0], max(key[1], 0), arrays["features"], arrays["targets"], arrays["inds"], stem)


def _inconsistent(folder: Path, split: str, layer: str) -> str:
    """The start of the error for shards of ``split`` / ``layer`` that do not fit together."""
    return f"inconsistent feature shards in {folder} for {split.lower()}/{layer}"


def _check_format(folder: Path, split: str, layer: str, shard: "FeatureShard", status: Dict[str, Any]) -> None:
    """A shard's features have the per-sample shape and dtype the extraction's status file gives
    for ``layer`` (a shard rewritten or edited since would otherwise be read as this layer's)."""
    info = (status.get("layers") or {}).get(layer) if isinstance(status.get("layers"), dict) else None
    if not isinstance(info, dict):
        return
    shape, dtype = info.get("shape"), info.get("dtype")
    got_shape, got_dtype = list(shard.features.shape[1:]), str(shard.features.dtype)
    if (isinstance(shape, list) and shape != got_shape) or (isinstance(dtype, str) and dtype != got_dtype):
        raise FeatureShardError(
            f"{_inconsistent(folder, split, layer)}: {shard.name} "
            f"holds {got_dtype} features of shape {got_shape} per sample, but the extraction wrote {dtype} of shape "
            f"{shape} (a shard was changed since), extract again"
        )
    targets_dtype = info.get("targets_dtype")  # status files of older extractions do not record it
    if isinstance(targets_dtype, str) and targets_dtype != str(shard.targets.dtype):
        raise FeatureShardError(
            f"{_inconsistent(folder, split, layer)}: {shard.name} holds {shard.targets.dtype} targets, but the "
            f"extraction wrote {targets_dtype} (a shard was changed since), extract again"
        )


def _check_sample_count(folder: Path, split: str, layer: str, rows: int, status: Dict[str, Any]) -> None:
    """The shards' ``rows`` are the samples the extraction's status file says it wrote."""
    expected = status.get("samples")
    if isinstance(expected, int) and expected != rows:
        raise FeatureShardError(
            f"{_inconsistent(folder, split, layer)}: {rows} samples, but the "
            f"extraction wrote {expected} (a shard was removed or added since), extract again"
        )


def _first_rows(folder: Path, split: str, layer: str, shards: Sequence[FeatureShard],
                status: Optional[Dict[str, Any]]) -> Tuple[Optional[np.ndarray], np.ndarray]:
    """Which rows of ``shards`` (taken in order, rank then chunk) to read: the first row of each
    sample index, as a boolean mask over all their rows (None when no index repeats), and the
    sorted indices of those rows.

    This engine's extraction writes every index once, so in its shards (``status`` is their
    status file) a repeat means shards of two extractions are mixed, or one was changed. VISSL's
    extraction ran a sampler that pads the ranks' shares to one length with samples again, so its
    shards repeat up to ranks - 1 indices, each copy on another rank than the sample's own share
    and with the same target. The row kept is the one of the lowest rank, the sample's own share
    (VISSL's readers differ: its older merge kept that one too, its ExtractedFeaturesLoader the
    copy of whichever file it listed last). More repeats than padding makes, a repeat within one
    rank or with another target, is refused for them too.
    """
    inds = np.concatenate([np.asarray(s.inds, dtype=np.int64) for s in shards])
    unique, first = np.unique(inds, return_index=True)
    repeats = len(inds) - len(unique)
    if not repeats:
        return None, unique
    keep = np.zeros(len(inds), dtype=bool)
    keep[first] = True
    repeated = inds[~keep]
    first_of = first[np.searchsorted(unique, repeated)]  # the kept row of each repeated one
    where = _inconsistent(folder, split, layer)
    rank = np.repeat([s.rank for s in shards], [len(s.inds) for s in shards])
    if status is not None or repeats > len({s.rank for s in shards}) - 1:
        raise FeatureShardError(
            f"{where}: sample index {int(repeated.min())} appears more than once ({repeats} repeats); shards of two "
            f"extractions are mixed, or a shard was changed: extract again into an empty folder"
        )
    same_rank = np.flatnonzero(rank[~keep] == rank[first_of])
    if len(same_rank):
        raise FeatureShardError(
            f"{where}: sample index {int(repeated[same_rank[0]])} appears twice in the shards of rank "
            f"{int(rank[first_of[same_rank[0]]])}; a shard was changed or two extractions are mixed: extract again "
            f"into an empty folder"
        )
    targets = np.concatenate([np.asarray(s.targets).reshape(len(s.inds), int(np.prod(s.targets.shape[1:], dtype=np.int64)))
                              for s in shards])
    differs = np.flatnonzero(np.any(targets[~keep] != targets[first_of], axis=1))
    if len(differs):
        raise FeatureShardError(
            f"{where}: sample index {int(repeated[differs[0]])} appears twice with different targets; shards of two "
            f"extractions are mixed: extract again into an empty folder"
        )
    return keep, unique


def _kept(shard: FeatureShard, keep: Optional[np.ndarray]) -> FeatureShard:
    """``shard`` without the rows ``keep`` (its part of the mask) leaves out: a view when they
    are its first or last rows (a memory-mapped shard stays mapped), else a copy of the rest."""
    if keep is None or keep.all():
        return shard
    kept = np.flatnonzero(keep)
    if not len(kept):  # a shard of padding copies only (a rank's last row, or fewer samples than ranks)
        rows: Any = slice(0, 0)
    else:
        rows = slice(kept[0], kept[-1] + 1) if kept[-1] - kept[0] + 1 == len(kept) else keep
    return FeatureShard(shard.rank, shard.chunk, shard.features[rows], shard.targets[rows], shard.inds[rows], shard.name)


def _check_split(folder: Path, split: str, layer: str, shards: Sequence[FeatureShard],
                 status: Optional[Dict[str, Any]]) -> Tuple[List[Optional[np.ndarray]], np.ndarray, Optional[np.ndarray]]:
    """What both readers check before they give anything: the shards' per-sample shapes agree
    (and are what the status file records), each index comes once (VISSL's padding aside, see
    :func:`_first_rows`), their samples are the number the extraction wrote, and the indices run
    from 0 with none missing but the samples the extraction left out.

    Returns each shard's rows to read (None: all), the sorted indices of those rows, and, when
    the extraction left samples out, the indices written (else None)."""
    where = _inconsistent(folder, split, layer)
    first = shards[0]
    for s in shards:
        if s.features.shape[1:] != first.features.shape[1:] or s.targets.shape[1:] != first.targets.shape[1:]:
            raise FeatureShardError(
                f"{where}: {s.name} has features {tuple(s.features.shape[1:])} and targets "
                f"{tuple(s.targets.shape[1:])} per sample, {first.name} has "
                f"{tuple(first.features.shape[1:])} and {tuple(first.targets.shape[1:])}; extract again into an empty folder"
            )
    # one extraction writes one dtype: merged, the rows of another would be cast (a target 2.5 read
    # as 2); a shard of no rows has nothing to cast
    typed = [s for s in shards if len(s.inds)]
    for s in typed:
        if s.features.dtype != typed[0].features.dtype or s.targets.dtype != typed[0].targets.dtype:
            raise FeatureShardError(
                f"{where}: {s.name} holds {s.features.dtype} features and {s.targets.dtype} targets, {typed[0].name} "
                f"{typed[0].features.dtype} and {typed[0].targets.dtype}; extract again into an empty folder"
            )
    keep, sorted_inds = _first_rows(folder, split, layer, shards, status)
    if keep is None:
        masks: List[Optional[np.ndarray]] = [None] * len(shards)
    else:
        ends = np.cumsum([len(s.inds) for s in shards])
        masks = [keep[end - len(s.inds):end] for s, end in zip(shards, ends)]
    n = len(sorted_inds)
    status = status or {}
    for s in shards:
        _check_format(folder, split, layer, s, status)
    _check_sample_count(folder, split, layer, n, status)
    # samples whose image could not be read were left out by the extraction, which names them
    left_out = np.asarray(sorted({int(i) for i in status.get("unreadable") or [] if isinstance(i, int)}), np.int64)
    written = np.setdiff1d(np.arange(n + len(left_out)), left_out) if len(left_out) else None
    if n and sorted_inds[0] < 0:  # was "indices run from -16 to 39; 0 are missing", which none are
        bad = next(s for s in shards if len(s.inds) and int(np.min(s.inds)) < 0)
        raise FeatureShardError(
            f"{where}: {bad.name} holds the sample index {int(np.min(bad.inds))}; a sample index is >= 0 (the shard was "
            f"changed, or written by another program), extract again"
        )
    if n and (not np.array_equal(sorted_inds, written) if written is not None
              else sorted_inds[0] != 0 or sorted_inds[-1] != n - 1):
        expected = int(sorted_inds[-1]) + 1
        raise FeatureShardError(
            f"{where}: {n} samples but indices run from {int(sorted_inds[0])} to {expected - 1}; "
            f"{expected - n - len(left_out)} are missing (a shard was removed or a rank did not finish), extract again"
        )
    return masks, sorted_inds, written


def iter_shards(folder: Path, split: str, layer: str, mmap: bool = True) -> Iterator[FeatureShard]:
    """The shards of ``split`` / ``layer`` one at a time, by rank then chunk.

    With ``mmap`` (default) the arrays are memory-mapped: only what is touched is read. Before
    the first shard, every shard's header and indices are read (8 bytes a sample; the targets too
    where an index repeats) and checked as
    :func:`load_features` checks them (shapes, each sample once, the samples the extraction
    wrote, no index missing), so that a reader never goes through part of a split as the whole.
    VISSL's padding repeats (see :func:`load_features`) are left out of the shards that hold
    them.
    """
    folder = Path(folder)
    paths = _shard_paths(folder, split, layer)
    status = extraction_status(folder, split)
    masks, _, _ = _check_split(folder, split, layer, [_read_shard(k, p, mmap=True) for k, p in paths], status)
    for (key, parts), mask in zip(paths, masks):
        yield _kept(_read_shard(key, parts, mmap), mask)


def load_features(folder: Path, split: str, layer: str, flatten: bool = True) -> Dict[str, np.ndarray]:
    """Every shard of ``split`` / ``layer`` merged across ranks and chunks, sorted by sample index.

    Returns ``{"features": [N, D] (or the stored shape with flatten=False), "targets": [N, ...],
    "inds": [N]}``. Raises FeatureShardError (a UserError) when the folder has no shards for
    them, or shards that disagree (missing parts, differing feature shapes, an index twice,
    missing indices). Shards written by VISSL (no status file) may repeat up to ranks - 1
    indices, the padding of its sampler: each sample's row is read from its own rank's share.
    """
    folder = Path(folder)
    shards = [_read_shard(k, p, mmap=True) for k, p in _shard_paths(folder, split, layer)]
    _, sorted_inds, written = _check_split(folder, split, layer, shards, extraction_status(folder, split))
    n = len(sorted_inds)
    typed = next((s for s in shards if len(s.inds)), shards[0])  # the dtypes every shard with rows has
    features = np.empty((n,) + tuple(shards[0].features.shape[1:]), dtype=typed.features.dtype)
    targets = np.empty((n,) + tuple(shards[0].targets.shape[1:]), dtype=typed.targets.dtype)
    # each shard straight to its sorted rows: one copy, no concatenation; the last ranks first, so
    # that a padding repeat is overwritten by its sample's own row (no rank repeats an index)
    for s in reversed(shards):
        dest = np.asarray(s.inds, dtype=np.int64)
        if written is not None:  # rows past a left-out sample move up
            dest = np.searchsorted(sorted_inds, dest)
        features[dest] = s.features
        targets[dest] = s.targets
    if flatten:  # the row size spelled out: -1 cannot be inferred for a split of 0 samples
        features = features.reshape(n, int(np.prod(features.shape[1:], dtype=np.int64)))
    return {"features": features, "targets": targets, "inds": sorted_inds}


def npy_header(dtype: np.dtype, shape: Tuple[int, ...], size: Optional[int] = None) -> bytes:
    """The header of a version 1.0 ``.npy`` file holding a C-ordered ``dtype`` array of ``shape``.

    ``size`` pads it to exactly that many bytes (a multiple of 64, so that the data stays
    aligned for memory mapping); by default the smallest multiple of 64 that holds it. A shard
    is written before its row count is known: its header's room is reserved for the largest
    count, and the header of the real count is padded to the same size at the end.
    """
    text = "{'descr': %r, 'fortran_order': False, 'shape': %r, }" % (np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                                                     tuple(int(d) for d in shape))
    needed = 10 + len(text) + 1  # magic, version, length field; the dict; its newline
    size = size if size is not None else -(-needed // 64) * 64
    if needed > size or size - 10 > 0xFFFF:
        raise ValueError(f"an .npy header for shape {tuple(shape)} needs {needed} bytes, more than {size}")
    body = text + " " * (size - needed) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body.encode("latin1")


class _ShardFile:
    """One shard file being written row block by row block, under a temporary name.

    Its header's room is reserved at the start; :meth:`finish` writes the header of the real
    row count, fsyncs and renames the file into place. Used by one writer thread only.
    """

    def __init__(self, path: Path, dtype: np.dtype, row_shape: Tuple[int, ...], max_rows: int) -> None:
        if dtype.hasobject:
            raise ValueError(f"{path.name}: cannot write an array of Python objects ({dtype}) as a shard")
        self.path, self.dtype, self.row_shape = path, dtype, row_shape
        self.tmp = path.parent / f".{path.name}.tmp.{os.getpid()}"
        self.header_size = len(npy_header(dtype, (max_rows,) + row_shape))
        self.rows = 0
        self._file = open(self.tmp, "wb")
        self._file.seek(self.header_size)

    def append(self, block: np.ndarray) -> None:
        self._file.write(memoryview(np.ascontiguousarray(block)).cast("B"))
        self.rows += len(block)

    def finish(self) -> None:
        self._file.seek(0)
        self._file.write(npy_header(self.dtype, (self.rows,) + self.row_shape, self.header_size))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        """Close and remove the temporary file (after an error, or when the extraction stops)."""
        try:
            self._file.close()  # closes the file even when flushing what it buffers fails (a full disk)
        except OSError:
            pass
        try:
            self.tmp.unlink()
        except OSError:
            pass


class ShardWriter:
    """Writes the features of one rank and split as they come, a shard every ``chunk_threshold`` samples.

    ``add`` takes a batch: ``{layer: [n, ...] array}``, targets ``[n, ...]`` and inds ``[n]``;
    the arrays must not be modified after ``add``: they are written later, by another thread.
    One writer thread appends each batch's rows to the chunk's files (temporary names) while
    the next batch is computed; when a chunk is full its files get their headers, are fsynced
    and renamed into place. ``add`` waits only when the batches not yet written hold more than
    a chunk, so memory stays below about one chunk whatever the size of the split. :meth:`close`
    finishes the last chunk and returns once every file is on disk. A failed write raises at
    the next ``add`` or at ``close``, with the temporary files removed and nothing more written.
    Use the writer as a context manager, or call :meth:`abort` on an error, so that no writer
    thread outlives the extraction.
    """

    def __init__(self, folder: Path, rank: int, split: str, chunk_threshold: int = DEFAULT_CHUNK_THRESHOLD) -> None:
        self.folder = Path(folder)
        self.rank = int(rank)
        self.split = split.lower()
        self.chunk_threshold = int(chunk_threshold) if chunk_threshold and chunk_threshold > 0 else DEFAULT_CHUNK_THRESHOLD
        self.chunk = 0  # chunks started so far (the last one may still be filling)
        self.num_samples = 0
        self.shapes: Dict[str, Tuple[int, ...]] = {}
        self.dtypes: Dict[str, np.dtype] = {}
        self.target_dtype: Optional[np.dtype] = None
        self._filled = 0  # rows in the chunk being filled
        self._pool: Optional[ThreadPoolExecutor] = None  # the writer thread, started at the first add
        self._pending: List[Tuple[Future, int]] = []  # (write, rows) handed to the writer thread, oldest first
        self._pending_rows = 0
        self._open: Dict[str, _ShardFile] = {}  # the chunk's files (writer thread only while it runs)
        self._failed = False

    @property
    def layers(self) -> List[str]:
        return list(self.shapes)

    def add(self, features: Dict[str, np.ndarray], targets: np.ndarray, inds: np.ndarray) -> None:
        inds = np.asarray(inds, dtype=np.int64)
        targets = np.asarray(targets)
        n = len(inds)
        if not self.shapes:
            self.shapes = {k: tuple(v.shape[1:]) for k, v in features.items()}
            self.dtypes = {k: v.dtype for k, v in features.items()}
            self.target_dtype = targets.dtype
        if set(features) != set(self.shapes):
            raise ValueError(f"batch has layers {sorted(features)}, earlier batches had {sorted(self.shapes)}")
        arrays = {k: self._conform(f"layer {k!r}", v, self.dtypes[k], self.shapes[k], n) for k, v in features.items()}
        targets = self._conform("targets", targets, self.target_dtype, None, n)
        start = 0
        while start < n:
            rows = min(n - start, self.chunk_threshold - self._filled)
            part = slice(start, start + rows)
            blocks = {k: v[part] for k, v in arrays.items()}
            self._submit(self._append, self.chunk, blocks, targets[part], inds[part], rows=rows)
            if self._filled == 0:
                self.chunk += 1
            self._filled += rows
            start += rows
            if self._filled == self.chunk_threshold:
                self._submit(self._finish_chunk, rows=0)
                self._filled = 0
        self.num_samples += n
        self._collect(limit=self.chunk_threshold)

    def close(self) -> None:
        """Finish the last (smaller) chunk and wait until every file is written."""
        try:
            if self._filled:
                self._submit(self._finish_chunk, rows=0)
                self._filled = 0
            self._collect(limit=0)
        except BaseException:
            self.abort()
            raise
        self._stop_threads()

    def abort(self) -> None:
        """Stop writing: the write under way ends, the chunk's temporary files are removed, the thread stops."""
        self._failed = True  # queued writes return at once
        for write, _ in self._pending:
            if not write.cancel():
                write.exception()  # running: let it end
        self._pending, self._pending_rows = [], 0
        self._stop_threads()
        for f in self._open.values():
            f.discard()
        self._open = {}
        self._filled = 0

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _stop_threads(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    @staticmethod
    def _conform(what: str, array: np.ndarray, dtype: np.dtype, row_shape: Optional[Tuple[int, ...]], n: int) -> np.ndarray:
        """``array`` as rows of the shard's dtype (and row shape), or a ValueError naming ``what``."""
        array = np.asarray(array)
        if len(array) != n:
            raise ValueError(f"{what} has {len(array)} rows for {n} sample indices")
        if row_shape is not None and tuple(array.shape[1:]) != row_shape:
            raise ValueError(f"{what} has rows of shape {tuple(array.shape[1:])}, earlier batches had {row_shape}")
        if array.dtype != dtype:  # the shard's dtype is the first batch's: only a cast that loses nothing
            if not np.can_cast(array.dtype, dtype, "safe"):
                raise ValueError(f"{what} is {array.dtype}, earlier batches were {dtype} (it would lose values)")
            array = array.astype(dtype)
        return array

    def _submit(self, fn: Callable[..., None], *args: Any, rows: int) -> None:
        if self._pool is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer")
        self._pending.append((self._pool.submit(fn, *args), rows))
        self._pending_rows += rows

    def _collect(self, limit: int) -> None:
        """Take the finished writes off the list, waiting for the oldest while more than ``limit``
        rows are not written yet; raise the first error (after which nothing more is written)."""
        while self._pending and (self._pending[0][0].done() or self._pending_rows > limit):
            write, rows = self._pending.pop(0)
            self._pending_rows -= rows
            error = write.exception()
            if error is not None:
                self.abort()
                raise error

    # ------------------------------------------------------------------ on the writer thread

    def _append(self, chunk: int, blocks: Dict[str, np.ndarray], targets: np.ndarray, inds: np.ndarray) -> None:
        if self._failed:
            return
        try:
            if not self._open:
                self._open_chunk(chunk, blocks, targets)
            for layer, block in blocks.items():
                self._open[f"{layer}/features"].append(block)
                self._open[f"{layer}/targets"].append(targets)
                self._open[f"{layer}/inds"].append(inds)
        except BaseException as e:
            self._fail(e)

    def _open_chunk(self, chunk: int, blocks: Dict[str, np.ndarray], targets: np.ndarray) -> None:
        for layer, block in blocks.items():
            for kind, dtype, row_shape in (("features", block.dtype, block.shape[1:]),
                                           ("targets", targets.dtype, targets.shape[1:]),
                                           ("inds", np.dtype(np.int64), ())):
                path = shard_path(self.folder, self.rank, chunk, self.split, layer, kind)
                self._open[f"{layer}/{kind}"] = _ShardFile(path, np.dtype(dtype), tuple(row_shape), self.chunk_threshold)

    def _finish_chunk(self) -> None:
        if self._failed:
            return
        try:
            while self._open:  # a file leaves the list once it is in place
                key = next(iter(self._open))
                self._open[key].finish()
                del self._open[key]
            fsync_dir(self.folder)
        except BaseException as e:
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        """Remove the chunk's temporary files and raise ``e`` as the error that says why."""
        self._failed = True
        path = next(iter(self._open.values())).path if self._open else self.folder / "shard"
        for f in self._open.values():
            f.discard()
        self._open = {}
        failure = write_failure(path, e)
        if failure is not None:
            raise failure from e
        raise e
