"""SSLDataset: the sample dicts the engine trains on, reproducible from (seed, epoch, index).

``build_dataset(cfg, split)`` reads ``cfg.DATA[split]``: one data source per input
(``DATA_SOURCES`` / ``DATA_PATHS``), optional label sources (``LABEL_SOURCES`` /
``LABEL_PATHS``), a label type, a data limit and the transform list.

``dataset[(epoch, idx)]`` (or ``dataset[idx]`` with the dataset's own ``epoch``) returns VISSL's
sample dict ``{"data": [...], "label": [...], "data_valid": [...], "data_idx": [...]}``.
Transforms run with torch / python ``random`` / numpy global generators reseeded from
(SEED_VALUE, epoch, idx) and restored afterwards, so a sample is the same in any worker, with
any number of workers, before or after a resume (DESIGN rule 8), and the caller's generators
are left exactly as they were.
"""

import contextlib
import logging
import os
import random
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Union

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from ssl_engine.data.collators import CollatedBatch
from ssl_engine.data.sources import (
    UnreadableImageError,
    build_source,
    class_folders,
    data_key,
    load_filelist_labels,
    normalize_paths,
    source_path,
)
from ssl_engine.data.sampler import PaddedIndex, is_padded
from ssl_engine.data.transforms import SSLTransformsWrapper, TransformFailed, build_transforms
from ssl_engine.errors import UserError, did_you_mean, first_few
from ssl_engine.registry import DATA_SOURCES

logger = logging.getLogger(__name__)

LABEL_TYPES = ("standard", "sample_index", "zero")
ON_CORRUPT_CHOICES = ("skip", "error")


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-mixed 64-bit permutation."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def sample_seed(seed: int, epoch: int, idx: int) -> int:
    """A 63-bit seed that is a well-mixed pure function of (seed, epoch, idx) (about a microsecond)."""
    h = _mix64((int(seed) & _MASK64) + 0x9E3779B97F4A7C15)
    h = _mix64((h ^ (int(epoch) & _MASK64)) + 0x9E3779B97F4A7C15)
    h = _mix64((h ^ (int(idx) & _MASK64)) + 0x9E3779B97F4A7C15)
    return h >> 1


def seed_all(seed: int) -> None:
    """Seed torch's CPU generator, python ``random`` and numpy's global generator."""
    torch.random.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % (1 << 32))


@contextlib.contextmanager
def seeded_rng(seed: int) -> Iterator[None]:
    """Seed torch's CPU generator, python ``random`` and numpy's global generator; restore them after.

    Only the CPU torch generator is touched (``torch.manual_seed`` would also reseed CUDA).
    """
    with preserved_rng():
        seed_all(seed)
        yield


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore the caller's torch CPU, python and numpy generator states on exit."""
    py_state = random.getstate()
    np_state = np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


class SSLDataset(Dataset):
    """Images from one or more data sources, labels, and a seeded transform pipeline.

    ``__getitem__`` accepts ``idx`` or ``(epoch, idx)`` (what ``StatefulDistributedSampler``
    yields). ``num_skipped`` counts samples served with a replacement because an image could not
    be decoded (``ON_CORRUPT_IMAGE: skip``); with dataloader workers that count lives in each
    worker's copy, so every skip is also logged as a warning naming the file.
    """

    def __init__(
        self,
        sources: Sequence[Any],
        transforms: Optional[SSLTransformsWrapper] = None,
        label_arrays: Sequence[np.ndarray] = (),
        label_type: str = "standard",
        seed: int = 0,
        split: str = "TRAIN",
        subset: Optional[np.ndarray] = None,
        on_corrupt_image: str = "skip",
        source_names: Sequence[str] = (),
    ) -> None:
        if not sources:
            raise UserError(f"{data_key(split, 'DATA_SOURCES')} is empty; name at least one data source")
        if label_type not in LABEL_TYPES:
            raise UserError(f"{data_key(split, 'LABEL_TYPE')} is {label_type!r}; valid: {', '.join(LABEL_TYPES)}")
        if on_corrupt_image not in ON_CORRUPT_CHOICES:
            raise UserError(
                f"{data_key(split, 'ON_CORRUPT_IMAGE')} is {on_corrupt_image!r}; valid: {', '.join(ON_CORRUPT_CHOICES)}"
            )
        self.sources = list(sources)
        self.source_names = list(source_names) or [type(s).__name__ for s in self.sources]
        self.transforms = transforms if transforms is not None else SSLTransformsWrapper([])
        self.label_arrays = [np.asarray(a) for a in label_arrays]
        # standard integer labels: a whole batch's labels are one array index per label source
        self._int_labels = all(a.dtype.kind in "iu" and a.ndim == 1 for a in self.label_arrays)
        self.label_type = label_type
        self.seed = int(seed)
        self.split = split
        self.subset = None if subset is None else np.asarray(subset, dtype=np.int64)
        self.on_corrupt_image = on_corrupt_image
        self.epoch = 0
        self.num_skipped = 0
        self._rng_preserved = False  # set by __getitems__ while it holds the caller's RNG states
        # set by build_dataloader when its collator is default_collate and reads_batches() holds:
        # __getitems__ then returns the collated batch itself (see read_batch)
        self.collated_reads = False
        self._bad: Set[int] = set()
        self._warned: Set[str] = set()
        # sizes are fixed once built: __getitem__ reads these instead of asking the sources each time
        self._len = len(self.subset) if self.subset is not None else len(self.sources[0])

    @property
    def transforms(self) -> SSLTransformsWrapper:
        return self._transforms

    @transforms.setter
    def transforms(self, transforms: SSLTransformsWrapper) -> None:
        # what the pipeline needs per sample, looked up once rather than on every __getitem__
        self._transforms = transforms
        self._has_transforms = len(transforms) > 0
        self._draws_randomness = bool(transforms.draws_randomness)

    # -- size and labels ------------------------------------------------------------------

    def __len__(self) -> int:
        return self._len

    def source_index(self, idx: int) -> int:
        """The index into the data sources of dataset sample ``idx`` (differs under DATA_LIMIT)."""
        return int(self.subset[idx]) if self.subset is not None else int(idx)

    def get_labels(self, label_source: int = 0) -> np.ndarray:
        """The labels of every sample, in dataset order, for label source ``label_source``."""
        if self.label_type == "sample_index":
            return np.arange(len(self), dtype=np.int64)
        if self.label_type == "zero":
            return np.zeros(len(self), dtype=np.int64)
        if not self.label_arrays:
            raise UserError(f"{data_key(self.split, 'LABEL_SOURCES')} is empty: this dataset has no labels")
        arr = self.label_arrays[label_source]
        return np.asarray(arr[self.subset] if self.subset is not None else arr)

    def set_epoch(self, epoch: int) -> None:
        """The epoch used for bare-int keys (the sampler's ``(epoch, idx)`` keys override it)."""
        self.epoch = int(epoch)

    # -- loading --------------------------------------------------------------------------

    def _labels_for(self, idx: int, used_idx: int) -> List[int]:
        if self.label_type == "sample_index":
            return [idx] * len(self.sources)
        if self.label_type == "zero":
            return [0] * len(self.sources)
        j = self.source_index(used_idx)
        return [int(arr.item(j)) for arr in self.label_arrays]

    def _read(self, idx: int) -> List[Any]:
        j = self.source_index(idx)
        return [src.get(j) for src in self.sources]

    def _load(self, idx: int) -> Tuple[List[Any], int]:
        """The images of sample ``idx``, or of the next readable sample when ``idx`` cannot be decoded."""
        if idx not in self._bad:
            try:
                return self._read(idx), idx  # the common case, without the search below
            except UnreadableImageError:
                pass  # handled (error or skip, with its warning) by the search, which retries idx first
        n = self._len
        for step in range(n):
            j = (idx + step) % n
            if j in self._bad:
                continue
            try:
                return self._read(j), j
            except UnreadableImageError as exc:
                if self.on_corrupt_image == "error":
                    raise UserError(
                        f"{self.split} image {exc.path!r} cannot be read ({exc.reason}); remove it from "
                        f"the data, or set {data_key(self.split, 'ON_CORRUPT_IMAGE')}=skip to replace "
                        f"unreadable images with the next readable one"
                    ) from None
                self._bad.add(j)
                if exc.path not in self._warned:
                    self._warned.add(exc.path)
                    logger.warning(
                        "skipping unreadable %s image %r (%s); the next readable image fills sample %d's place "
                        "in the batch, marked so that meters, the logged loss and feature extraction leave it out "
                        "(%s=skip)",
                        self.split,
                        exc.path,
                        exc.reason,
                        j,
                        data_key(self.split, "ON_CORRUPT_IMAGE"),
                    )
        raise UserError(f"none of the {n} {self.split} images can be read (see the warnings above for the files)")

    def __getitem__(self, key: Union[int, Tuple[int, int]]) -> Dict[str, Any]:
        return self._sample(key, None)

    def _sample(self, key: Union[int, Tuple[int, int]], labels: Optional[List[Any]]) -> Dict[str, Any]:
        """Sample ``key``; ``labels`` are its labels when the caller looked them up already."""
        if isinstance(key, (tuple, list)):
            epoch, idx = int(key[0]), int(key[1])
        else:
            epoch, idx = self.epoch, int(key)
        if not 0 <= idx < self._len:
            raise IndexError(f"sample index {idx} out of range for a dataset of {self._len}")
        images, used = self._load(idx)
        if used != idx:
            self.num_skipped += 1
            labels = None  # the replacement's labels
        k = len(images)
        # 1: the sample itself; -1: an unreadable image replaced by the next readable one;
        # 0: a repeat the sampler added to even out the ranks' shares (not counted by meters).
        valid = 0 if is_padded(key) else (1 if used == idx else -1)
        sample: Dict[str, Any] = {
            "data": images,
            "label": labels if labels is not None else self._labels_for(idx, used),
            "data_valid": [valid] * k,
            "data_idx": [idx] * k,
        }
        if not self._has_transforms:
            return sample
        try:
            if self._draws_randomness:
                if get_worker_info() is not None:
                    seed_all(sample_seed(self.seed, epoch, idx))  # a worker's own generators: nothing to restore
                elif self._rng_preserved:
                    seed_all(sample_seed(self.seed, epoch, idx))  # __getitems__ restores once per batch
                else:
                    with seeded_rng(sample_seed(self.seed, epoch, idx)):
                        return self._transforms(sample)
            return self._transforms(sample)
        except TransformFailed as e:
            raise e.of_sample(self._origin(used)) from e

    def _origin(self, idx: int) -> str:
        """Which sample a transform failed on, with its files where the sources have them."""
        j = self.source_index(idx)
        files = [repr(src.path(j)) for src in self.sources if callable(getattr(src, "path", None))]
        return f" of {self.split} sample {idx}" + (f" ({', '.join(files)})" if files else "")

    def _batch_labels(self, keys: Sequence[Any]) -> List[Optional[List[Any]]]:
        """The labels of every key, looked up with one array index per label source (standard
        integer labels), or ``None`` per key where each sample must look up its own."""
        nothing: List[Optional[List[Any]]] = [None] * len(keys)
        if self.label_type != "standard" or not self._int_labels:
            return nothing
        try:
            idx = np.fromiter((k[1] if isinstance(k, (tuple, list)) else k for k in keys), dtype=np.int64, count=len(keys))
        except (TypeError, ValueError):
            return nothing
        if idx.size and (idx.min() < 0 or idx.max() >= self._len):
            return nothing  # the sample itself raises the error that names the index
        j = self.subset[idx] if self.subset is not None else idx
        columns = [arr[j].tolist() for arr in self.label_arrays]
        return [list(row) for row in zip(*columns)] if columns else [[] for _ in keys]

    def reads_batches(self) -> bool:
        """True when a batch can be read with one ``get_batch`` call per source: every source
        offers ``get_batch`` (sources.py) and no transform runs per sample. Labels must be
        integer arrays (or ``sample_index`` / ``zero``); the rest is checked per batch."""
        if self._has_transforms or not all(callable(getattr(s, "get_batch", None)) for s in self.sources):
            return False
        return self.label_type != "standard" or self._int_labels

    def read_batch(self, keys: Sequence[Any]) -> Optional[Dict[str, Any]]:
        """The batch of ``keys`` as ``default_collate`` would make it from their sample dicts,
        read with one ``get_batch`` per source and one array index per label source, without
        a dict per sample. ``None`` where this batch needs the per-sample path (an unreadable
        image, a key that is not a sampler key); that path then gives the same batch."""
        if not self.reads_batches():
            return None
        return self._read_batch(keys)

    def _read_batch(self, keys: Sequence[Any]) -> Optional[Dict[str, Any]]:
        """:meth:`read_batch` once ``reads_batches()`` is known to hold (``collated_reads``)."""
        if self._bad or not keys:
            return None
        try:
            ids = [int(k[1]) if isinstance(k, (tuple, list)) else int(k) for k in keys]
        except (TypeError, ValueError, IndexError):
            return None
        if min(ids) < 0 or max(ids) >= self._len:
            return None  # the per-sample path raises the IndexError that names the index
        idx = np.array(ids, dtype=np.int64)
        j = self.subset[idx] if self.subset is not None else idx
        try:
            data = [src.get_batch(j) for src in self.sources]
        except UnreadableImageError:
            return None  # the per-sample path applies ON_CORRUPT_IMAGE to it
        k, n = len(self.sources), len(keys)
        n_labels = len(self.label_arrays) if self.label_type == "standard" else k
        # the int rows in one tensor (views of one storage, as default_collate makes them): one
        # shared-memory block per batch when it comes from a loader worker
        rows = np.empty((n_labels + 2 * k, n), dtype=np.int64)
        if self.label_type == "standard":
            for r, arr in enumerate(self.label_arrays):
                rows[r] = arr[j]
        else:
            rows[:n_labels] = idx if self.label_type == "sample_index" else 0
        rows[n_labels:n_labels + k] = 1
        padded = [i for i, key in enumerate(keys) if isinstance(key, PaddedIndex)]  # is_padded, inlined: per sample
        if padded:
            rows[n_labels:n_labels + k, padded] = 0
        rows[n_labels + k:] = idx
        out = torch.from_numpy(rows).unbind(0)
        return {
            "data": data,
            "label": list(out[:n_labels]),
            "data_valid": list(out[n_labels:n_labels + k]),
            "data_idx": list(out[n_labels + k:]),
        }

    def _samples(self, keys: Sequence[Any]) -> List[Dict[str, Any]]:
        return [self._sample(k, labels) for k, labels in zip(keys, self._batch_labels(keys))]

    def __getitems__(self, keys: Sequence[Any]) -> List[Dict[str, Any]]:
        """A batch of samples: labels looked up for the whole batch at once and, in the training
        process, the caller's RNG states saved and restored once per batch, not once per sample.
        With ``collated_reads`` set, the collated batch itself where ``read_batch`` can make it."""
        if self.collated_reads:
            batch = self._read_batch(keys)
            if batch is not None:
                return CollatedBatch(batch)  # type: ignore[return-value]
        if not self._draws_randomness or get_worker_info() is not None:
            return self._samples(keys)
        with preserved_rng():
            self._rng_preserved = True
            try:
                return self._samples(keys)
            finally:
                self._rng_preserved = False

    def __repr__(self) -> str:
        return (
            f"SSLDataset(split={self.split}, sources={self.source_names}, len={len(self)}, "
            f"label_type={self.label_type}, transforms={self.transforms!r})"
        )


# ------------------------------------------------------------------------------------ build


def _data_limit_subset(
    n: int, scfg: Any, split: str, label_arrays: Sequence[np.ndarray]
) -> Optional[np.ndarray]:
    """Indices kept by ``DATA_LIMIT``: the first N of a ``DATA_LIMIT_SAMPLING.SEED`` permutation (sorted)."""
    limit = int(scfg.get("DATA_LIMIT", -1))
    if limit == -1:
        sampling = scfg.get("DATA_LIMIT_SAMPLING", {}) or {}
        ignored = [f"SKIP_NUM_SAMPLES={sampling['SKIP_NUM_SAMPLES']}"] if int(sampling.get("SKIP_NUM_SAMPLES", 0) or 0) else []
        if sampling.get("IS_BALANCED", False):
            ignored.append("IS_BALANCED=True")
        from ssl_engine import distributed as du

        if ignored and du.is_primary():  # VISSL applies them to a DATA_LIMIT subset only, and so does this
            logger.warning("%s %s: no effect with DATA_LIMIT=-1 (all samples); set %s to the number of samples to draw",
                           data_key(split, "DATA_LIMIT_SAMPLING"), " and ".join(ignored), data_key(split, "DATA_LIMIT"))
        return None
    if limit <= 0:
        raise UserError(f"{data_key(split, 'DATA_LIMIT')} is {limit}; use -1 for all samples or a positive number")
    sampling = scfg.get("DATA_LIMIT_SAMPLING", {}) or {}
    skip = int(sampling.get("SKIP_NUM_SAMPLES", 0))
    balanced = bool(sampling.get("IS_BALANCED", False))
    if limit >= n and skip == 0:
        if limit > n:
            from ssl_engine import distributed as du

            if du.is_primary():  # VISSL would fail drawing more samples than there are: say what is used
                logger.warning("%s=%d is more than the %d samples of the %s data: using all %d",
                               data_key(split, "DATA_LIMIT"), limit, n, split, n)
        return None
    if skip < 0 or skip + limit > n:
        raise UserError(
            f"{data_key(split, 'DATA_LIMIT')}={limit} with DATA_LIMIT_SAMPLING.SKIP_NUM_SAMPLES={skip} needs "
            f"{skip + limit} samples but the {split} data has {n}"
        )
    perm = np.random.RandomState(int(sampling.get("SEED", 0)) % (1 << 32)).permutation(n)[skip:]
    if not balanced:
        return np.sort(perm[:limit])
    if not label_arrays:
        raise UserError(
            f"{data_key(split, 'DATA_LIMIT_SAMPLING.IS_BALANCED')} needs labels; set "
            f"{data_key(split, 'LABEL_SOURCES')} or IS_BALANCED=False"
        )
    labels = np.asarray(label_arrays[0])
    classes = np.unique(labels)
    quota = {c: limit // len(classes) + (1 if i < limit % len(classes) else 0) for i, c in enumerate(classes)}
    taken: List[int] = []
    for j in perm:
        c = labels[j]
        if quota[c] > 0:
            quota[c] -= 1
            taken.append(int(j))
    short = {int(c): q for c, q in quota.items() if q > 0}
    if short:
        raise UserError(
            f"{data_key(split, 'DATA_LIMIT')}={limit} with IS_BALANCED needs {limit // len(classes)}+ samples per "
            f"class; classes short by {short}"
        )
    return np.sort(np.asarray(taken, dtype=np.int64))


def _source_length(src: Any, name: str, split: str, index: int) -> int:
    """``len(src)``; a source whose ``__len__`` is missing or gives no integer is a UserError naming it."""
    try:
        return len(src)
    except TypeError as e:
        from ssl_engine.registry import part_origin

        raise UserError(
            f"{data_key(split, 'DATA_SOURCES')}[{index}]: data source {name!r} {part_origin(type(src))} has no "
            f"length ({e}); a data source's __len__ returns its number of samples"
        ) from None


def _check_label_values(arr: np.ndarray, origin: str, src: Any) -> None:
    """A source's ``labels()`` gives class indices: strings (class names) or None are a UserError
    naming the source, not a ValueError in the loader at the first batch."""
    flat = arr.reshape(-1)
    if arr.dtype.kind in "US":
        found = flat[:1].tolist()
    elif arr.dtype.kind == "O":
        found = [next((v for v in flat if v is None or isinstance(v, (str, bytes))), ...)]
        found = [] if found[0] is ... else found
    else:
        return
    if found:
        from ssl_engine.registry import part_origin

        raise UserError(
            f"{origin}: labels() of {type(src).__name__} {part_origin(type(src))} gives {type(found[0]).__name__} "
            f"values such as {found[0]!r}; labels are one integer class index per sample (number your class names "
            f"0, 1, ...)"
        )


def _label_arrays(cfg: Any, scfg: Any, split: str, names: List[str], sources: List[Any], n: int) -> List[np.ndarray]:
    label_names = list(scfg.get("LABEL_SOURCES", []) or [])
    label_paths = normalize_paths(scfg.get("LABEL_PATHS", []), split, "LABEL_PATHS")
    data_paths = normalize_paths(scfg.get("DATA_PATHS", []), split, "DATA_PATHS")
    arrays: List[np.ndarray] = []
    for j, name in enumerate(label_names):
        where = f"{data_key(split, 'LABEL_SOURCES')}[{j}]"
        lpath = source_path(label_paths, j)
        if name == "disk_filelist":
            arr = load_filelist_labels(lpath, split, j)
            origin = f"{data_key(split, 'LABEL_PATHS')}[{j}] ({lpath!r})"
        else:
            if name not in DATA_SOURCES:
                raise UserError(
                    f"{where}: unknown label source {name!r}{did_you_mean(str(name), DATA_SOURCES.names())}; "
                    f"known: {', '.join(DATA_SOURCES.names())}"
                )
            same = j < len(names) and names[j] == name and (not lpath or lpath == source_path(data_paths, j))
            src = sources[j] if same else _label_source(cfg, split, j, name, lpath, names, data_paths)
            if not callable(getattr(src, "labels", None)):
                raise UserError(f"{where}: data source {name!r} provides no labels; use a source that has labels")
            arr = np.asarray(src.labels())
            origin = f"{where} ({name}{', ' + repr(lpath) if lpath else ''})"
            _check_label_values(arr, origin, src)
            if name == "disk_folder" and split == "TEST" and getattr(src, "classes", None) is not None:
                arr = _number_as_training(cfg, j, list(src.classes), arr, getattr(src, "root", lpath))
        if len(arr) != n:
            raise UserError(
                f"{origin} has {len(arr)} labels but the {split} data ({data_key(split, 'DATA_PATHS')}) has "
                f"{n} samples; they must match one to one"
            )
        arrays.append(arr)
    return arrays


def class_folder_of(cfg: Any, split: str, j: int = 0) -> Tuple[str, str]:
    """(folder, its config key) whose class subfolders number ``LABEL_SOURCES[j]`` of ``split``
    when that label source is disk_folder (LABEL_PATHS[j], else DATA_PATHS[j]); ('', '') otherwise."""
    scfg = (cfg.get("DATA") or {}).get(split) or {}
    labels = list(scfg.get("LABEL_SOURCES") or [])
    if j >= len(labels) or labels[j] != "disk_folder":
        return "", ""
    paths = normalize_paths(scfg.get("LABEL_PATHS"), split, "LABEL_PATHS")
    if source_path(paths, j):
        return source_path(paths, j), f"{data_key(split, 'LABEL_PATHS')}[{j}]"
    return (source_path(normalize_paths(scfg.get("DATA_PATHS"), split, "DATA_PATHS"), j),
            f"{data_key(split, 'DATA_PATHS')}[{j}]")


def label_class_names(cfg: Any, split: str) -> Optional[List[str]]:
    """The class names that the label ids of ``split``'s first label source stand for (id i is
    name i) when they come from class folders; None otherwise. Written next to extracted
    features, so that a kNN test can tell whether two splits number their classes alike."""
    folder, _ = class_folder_of(cfg, split)
    return class_folders(folder) if folder and os.path.isdir(folder) else None


def _number_as_training(cfg: Any, j: int, classes: List[str], labels: np.ndarray, folder: str) -> np.ndarray:
    """TEST labels of class folders numbered as the TRAIN folder numbers its classes.

    disk_folder numbers the sorted class folders of each folder on its own: a TEST folder
    without one of the training's classes would give every later class another label than the
    model learned for it. Where TRAIN's labels come from class folders too, TEST's classes are
    looked up in TRAIN's list; a TEST class that TRAIN does not have is a UserError. Training
    only: an extraction writes each folder's own numbering whichever splits it extracts
    (retrieval sets have disjoint classes), as VISSL does; the kNN test compares them by name
    (see ssl_engine.knn.align_test_labels).
    """
    if str(cfg.get("engine_name", "train")) != "train":
        return labels
    train_folder, train_key = class_folder_of(cfg, "TRAIN", j)
    if not train_folder or not os.path.isdir(train_folder):
        return labels
    reference = class_folders(train_folder)
    if reference == classes:
        return labels
    _, test_key = class_folder_of(cfg, "TEST", j)
    unknown = [c for c in classes if c not in reference]
    if unknown:
        shown = first_few(unknown)
        raise UserError(
            f"{test_key}: class folder(s) {shown} of {folder!r} are not classes of {train_key} ({train_folder!r}), "
            f"whose class folders number the labels the model learns; give the test folder the training's class "
            f"folders only"
        )
    logger.info("%s: its %d class folders are numbered as the %d of %s (no test images of: %s)",
                test_key, len(classes), len(reference), train_key, ", ".join(c for c in reference if c not in classes))
    return np.asarray([reference.index(c) for c in classes], dtype=np.int64)[labels]


def _label_source(cfg: Any, split: str, j: int, name: str, lpath: str, names: List[str], data_paths: List[str]) -> Any:
    """The label source ``name`` of LABEL_SOURCES[j], built on LABEL_PATHS[j] or else DATA_PATHS[j];
    an error of that path names the label source that read it (not only the data path)."""
    try:
        return build_source(name, cfg, lpath or source_path(data_paths, j), split, j)
    except UserError as e:
        data = names[j] if j < len(names) else None
        read = data_key(split, "LABEL_PATHS" if lpath else "DATA_PATHS") + f"[{j}]"
        hint = ""
        if data == "disk_filelist":
            hint = (f"; labels of a disk_filelist come from {data_key(split, 'LABEL_SOURCES')}=[disk_filelist] with "
                    f"{data_key(split, 'LABEL_PATHS')}=[<.npy or .txt of labels, one per file>]")
        raise UserError(f"{data_key(split, 'LABEL_SOURCES')}[{j}]={name} reads its labels from {read}"
                        f"{f' (DATA_SOURCES[{j}] is {data})' if data and data != name else ''}, and: {e}{hint}") from None


def build_dataset(cfg: Any, split: str) -> SSLDataset:
    """The ``SSLDataset`` of ``cfg.DATA[split]`` (``split`` is "TRAIN" or "TEST"); ``cfg`` is the full config."""
    data = cfg.get("DATA", {}) or {}
    if split not in data:
        raise UserError(f"config.DATA.{split} is missing; the {split} split needs DATA_SOURCES, DATA_PATHS, ...")
    scfg = data[split]
    names = list(scfg.get("DATA_SOURCES", []) or [])
    if not names:
        raise UserError(
            f"{data_key(split, 'DATA_SOURCES')} is empty but the {split} split is used; name one source per "
            f"input, known: {', '.join(DATA_SOURCES.names())}"
        )
    paths = normalize_paths(scfg.get("DATA_PATHS", []), split, "DATA_PATHS")
    sources = [build_source(name, cfg, source_path(paths, i), split, i) for i, name in enumerate(names)]
    lengths = [_source_length(s, nm, split, i) for i, (s, nm) in enumerate(zip(sources, names))]
    if len(set(lengths)) > 1:
        detail = ", ".join(f"{nm}={ln}" for nm, ln in zip(names, lengths))
        raise UserError(f"{data_key(split, 'DATA_SOURCES')}: all sources must have the same length, got {detail}")
    n = lengths[0]
    if n == 0:
        from ssl_engine.registry import part_origin

        raise UserError(f"{data_key(split, 'DATA_PATHS')}: the {split} data is empty (data source {names[0]!r} "
                        f"{part_origin(type(sources[0]))} has 0 samples)")
    label_type = str(scfg.get("LABEL_TYPE", "standard"))
    if label_type not in LABEL_TYPES:
        raise UserError(f"{data_key(split, 'LABEL_TYPE')} is {label_type!r}; valid: {', '.join(LABEL_TYPES)}")
    labels = _label_arrays(cfg, scfg, split, names, sources, n)
    subset = _data_limit_subset(n, scfg, split, labels)
    return SSLDataset(
        sources=sources,
        transforms=build_transforms(cfg, split),
        label_arrays=labels,
        label_type=label_type,
        seed=int(cfg.get("SEED_VALUE", 0)),
        split=split,
        subset=subset,
        on_corrupt_image=str(scfg.get("ON_CORRUPT_IMAGE", "skip")),
        source_names=names,
    )
