"""The ``torchvision_dataset`` data source: CIFAR-10, CIFAR-100, MNIST, STL-10 and SVHN, read from
the folder torchvision's ``download=True`` left them in, as VISSL's source of that name reads them.

A split names it as VISSL does::

    DATA_SOURCES: [torchvision_dataset]
    LABEL_SOURCES: [torchvision_dataset]
    DATASET_NAMES: [CIFAR10]          # CIFAR10 | CIFAR100 | MNIST | STL10 | SVHN (any case)
    DATA_PATHS: [/data/cifar]         # the ``root`` given to torchvision

TRAIN reads torchvision's training set (``train=True``, or ``split="train"`` for STL10 and
SVHN), any other split its test set. Samples are the images and labels torchvision's classes
give, pixel for pixel, but the files are read here with small readers of their own formats:
torchvision's classes hash every file (md5) on every construction, which costs seconds per
process for CIFAR and STL-10. Nothing is ever downloaded: a missing folder or file is a
UserError that says how to fetch it with torchvision once, outside the engine.

The files each data set needs, under the root (as torchvision's downloads leave them):

- CIFAR10: ``cifar-10-batches-py/data_batch_1`` .. ``data_batch_5`` (TRAIN), ``test_batch``;
  pickled dicts, read with an unpickler that allows only numpy array reconstruction, so a
  hostile file cannot run code.
- CIFAR100: ``cifar-100-python/train``, ``test`` (the ``fine_labels``: 100 classes).
- MNIST: ``MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte`` (the ``.gz`` files are read
  where only those are there). MNIST is grayscale; its images are returned as RGB (R = G = B),
  as every data source returns RGB, where torchvision returns mode "L".
- STL10: ``stl10_binary/{train,test}_{X,y}.bin`` (the labelled splits; no unlabeled, no folds).
- SVHN: ``train_32x32.mat``, ``test_32x32.mat`` (digit 0, stored as 10, is label 0).

Loader workers get the source by pickling: the decoded images stay out of the pickle and each
process reads them on its first ``get``; the length and labels are read when the source is
built (the launcher's check and the rank need them before any worker starts) and travel with it.
"""

import codecs
import gzip
import os
import pickle
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
from PIL import Image

from ssl_engine.data.sources import data_key, split_cfg
from ssl_engine.errors import UserError, did_you_mean
from ssl_engine.registry import DATA_SOURCES

TORCHVISION_DATASETS = ("CIFAR10", "CIFAR100", "MNIST", "STL10", "SVHN")


class BadFile(Exception):
    """A data file that exists but is not what its format says: truncated, foreign or hostile."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path!r} {problem}")
        self.path = path
        self.problem = problem


class _Format:
    """How one data set lies on disk. ``files(train)``: the files a split reads, relative to the
    root; ``resolve(path)``: the file to read for one of them; ``labels(paths)``: (labels int64,
    the images when reading the labels decoded them anyway, else None); ``images(paths)``: the
    images, indexable per sample; ``count(images)``; ``image(images, idx)``: one RGB image.
    Problems with a file are ``BadFile``."""

    def files(self, train: bool) -> List[str]:
        raise NotImplementedError

    def resolve(self, path: str) -> str:
        return path

    def labels(self, paths: List[str]) -> Tuple[np.ndarray, Any]:
        raise NotImplementedError

    def images(self, paths: List[str]) -> Any:
        raise NotImplementedError

    def count(self, images: Any) -> int:
        return len(images)

    def image(self, images: Any, idx: int) -> Image.Image:
        raise NotImplementedError


# ------------------------------------------------------------------------------------ CIFAR


class _Refused(pickle.UnpicklingError):
    """The pickle asks for a global (or an argument) a CIFAR batch never needs."""


def _latin1_encode(obj: Any, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    """``_codecs.encode`` as Python 3 pickles bytes at protocol 2 (latin-1 only)."""
    if str(encoding).lower().replace("-", "") != "latin1":
        raise _Refused(f"refused _codecs.encode with encoding {encoding!r}")
    return codecs.encode(obj, "latin1", errors)


_ARRAY = np.zeros(1, dtype=np.uint8)
_RECONSTRUCT = _ARRAY.__reduce__()[0]  # numpy's _reconstruct, wherever this numpy keeps it
_FROMBUFFER = _ARRAY.__reduce_ex__(5)[0]  # numpy's _frombuffer (protocol-5 pickles)

# What a CIFAR batch needs: the original files (Python 2 pickles) name numpy.core.multiarray's
# _reconstruct, numpy.ndarray and numpy.dtype; the numpy 2 spellings and what numpy writes at
# protocols 2 to 5 let a batch re-saved by Python 3 load too. Nothing else is ever looked up.
_CIFAR_GLOBALS: Dict[Tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("numpy.core.numeric", "_frombuffer"): _FROMBUFFER,
    ("numpy._core.numeric", "_frombuffer"): _FROMBUFFER,
    ("_codecs", "encode"): _latin1_encode,
}


class _CifarUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _CIFAR_GLOBALS[(module, name)]
        except KeyError:
            raise _Refused(f"refused the global {module}.{name}") from None


def _load_cifar_batch(path: str, label_key: str) -> Tuple[np.ndarray, np.ndarray]:
    """(data N x 3072 uint8, labels N int64) of one CIFAR batch file."""
    try:
        with open(path, "rb") as f:
            entry = _CifarUnpickler(f, encoding="latin1").load()
    except _Refused as exc:
        raise BadFile(path, f"is not a CIFAR batch: its pickle asks for more than numpy arrays ({exc}; never "
                            f"loaded, it could run code)") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError, MemoryError, OverflowError) as exc:
        raise BadFile(path, f"is truncated or corrupt ({type(exc).__name__}: {exc})") from None
    if not isinstance(entry, dict):
        raise BadFile(path, f"is not a CIFAR batch: it holds a {type(entry).__name__}, not a dict")
    data = entry.get("data")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        shown = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise BadFile(path, f"is not a CIFAR batch: its 'data' is {shown}, expected a uint8 array of N x 3072")
    if label_key not in entry:
        raise BadFile(path, f"is not a CIFAR batch of this data set: it has no {label_key!r} (keys: "
                            f"{', '.join(sorted(map(str, entry)))})")
    labels = np.asarray(entry[label_key])
    if labels.ndim != 1 or labels.dtype.kind not in "iu" or len(labels) != len(data):
        raise BadFile(path, f"is not a CIFAR batch: its {label_key!r} are {labels.dtype} {labels.shape}, expected "
                            f"{len(data)} integers (one per image)")
    return data, labels.astype(np.int64)


class _Cifar(_Format):
    """CIFAR-10 / CIFAR-100: pickled batches of N x 3072 uint8 rows (R, G, B planes of 32 x 32)."""

    def __init__(self, folder: str, train_files: Sequence[str], test_files: Sequence[str], label_key: str) -> None:
        self.folder = folder
        self.train_files = list(train_files)
        self.test_files = list(test_files)
        self.label_key = label_key

    def files(self, train: bool) -> List[str]:
        return [os.path.join(self.folder, n) for n in (self.train_files if train else self.test_files)]

    def read(self, paths: List[str]) -> Tuple[np.ndarray, Any]:
        batches = [_load_cifar_batch(p, self.label_key) for p in paths]
        data = np.concatenate([b[0] for b in batches]) if len(batches) > 1 else batches[0][0]
        labels = np.concatenate([b[1] for b in batches])
        # N x H x W x C, as torchvision's CIFAR10 holds them
        return labels, data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)

    def images(self, paths: List[str]) -> Any:
        return self.read(paths)[1]

    def labels(self, paths: List[str]) -> Tuple[np.ndarray, Any]:
        return self.read(paths)  # the labels live beside the images: keep what was decoded

    def image(self, images: Any, idx: int) -> Image.Image:
        return Image.fromarray(np.ascontiguousarray(images[idx]))


# ------------------------------------------------------------------------------------ MNIST


_IDX_UINT8 = 0x08


def _read_exact(f: Any, n: int, path: str, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise BadFile(path, f"is truncated: it ends inside its {what}")
    return data


def _idx_header(f: Any, path: str, ndim: int) -> Tuple[Tuple[int, ...], int]:
    """(dims, header bytes) of an idx file open at its start: magic 0 0 <type> <ndim>, then the
    dims as big-endian uint32 (the format torchvision's read_sn3_pascalvincent_tensor reads)."""
    magic = _read_exact(f, 4, path, "header")
    if magic[0] != 0 or magic[1] != 0:
        raise BadFile(path, f"is not an idx file (it starts with {magic!r}, expected 0 0 <type> <ndim>)")
    if magic[2] != _IDX_UINT8 or magic[3] != ndim:
        raise BadFile(path, f"is an idx file of type 0x{magic[2]:02x} with {magic[3]} dims; MNIST's is uint8 "
                            f"(0x08) with {ndim} dims")
    dims = tuple(int(d) for d in np.frombuffer(_read_exact(f, 4 * ndim, path, "header"), dtype=">u4"))
    return dims, 4 + 4 * ndim


def _gzip_size(path: str) -> int:
    """The uncompressed size (mod 2**32) a .gz file records in its last 4 bytes."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() < 18:
            raise BadFile(path, "is truncated: too short for a gzip file")
        f.seek(-4, os.SEEK_END)
        return int.from_bytes(f.read(4), "little")


def _read_idx(path: str, ndim: int, load: bool) -> Tuple[Tuple[int, ...], Optional[np.ndarray]]:
    """(dims, the array or None when not ``load``) of an idx file, plain or .gz; its size is
    checked against its header (a .gz against the size its trailer records)."""
    gz = path.endswith(".gz")
    try:
        with (gzip.open(path, "rb") if gz else open(path, "rb")) as f:
            dims, offset = _idx_header(f, path, ndim)
            expected = offset + int(np.prod(dims, dtype=np.int64))
            size = _gzip_size(path) if gz else os.path.getsize(path)
            if size != (expected % (1 << 32) if gz else expected):  # gzip records the size mod 2**32
                raise BadFile(path, f"is truncated or corrupt: its header says {' x '.join(map(str, dims))} uint8 "
                                    f"({expected} bytes with the header) but it has {size}{' uncompressed' if gz else ''}")
            if not load:
                return dims, None
            if not gz:
                return dims, np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=dims)
            data = f.read()
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise BadFile(path, f"is truncated or corrupt ({type(exc).__name__}: {exc})") from None
    if len(data) != expected - offset:
        raise BadFile(path, f"is truncated or corrupt: {len(data)} data bytes, its header says {expected - offset}")
    return dims, np.frombuffer(data, dtype=np.uint8).reshape(dims)


class _Mnist(_Format):
    """MNIST: idx files under MNIST/raw (plain, or .gz where only those are there)."""

    folder = os.path.join("MNIST", "raw")

    def files(self, train: bool) -> List[str]:
        prefix = "train" if train else "t10k"
        return [os.path.join(self.folder, f"{prefix}-images-idx3-ubyte"),
                os.path.join(self.folder, f"{prefix}-labels-idx1-ubyte")]

    def resolve(self, path: str) -> str:
        """``path``, or its .gz where only that exists (torchvision reads only the plain one)."""
        return path + ".gz" if not os.path.isfile(path) and os.path.isfile(path + ".gz") else path

    def labels(self, paths: List[str]) -> Tuple[np.ndarray, Any]:
        (n_images, *_), _ = _read_idx(paths[0], 3, load=False)
        (n_labels,), labels = _read_idx(paths[1], 1, load=True)
        if n_labels != n_images:
            raise BadFile(paths[1], f"holds {n_labels} labels but {paths[0]!r} holds {n_images} images")
        return np.asarray(labels, dtype=np.int64), None

    def images(self, paths: List[str]) -> Any:
        return _read_idx(paths[0], 3, load=True)[1]

    def image(self, images: Any, idx: int) -> Image.Image:
        return Image.fromarray(np.array(images[idx])).convert("RGB")


# ------------------------------------------------------------------------------------ STL10


_STL_IMAGE_BYTES = 3 * 96 * 96


class _Stl10(_Format):
    """STL-10's labelled splits: N x 3 x 96 x 96 uint8, each channel stored column-major, and
    labels 1..10 (one byte each)."""

    folder = "stl10_binary"

    def files(self, train: bool) -> List[str]:
        prefix = "train" if train else "test"
        return [os.path.join(self.folder, f"{prefix}_X.bin"), os.path.join(self.folder, f"{prefix}_y.bin")]

    @staticmethod
    def _count(path: str) -> int:
        size = os.path.getsize(path)
        if size == 0 or size % _STL_IMAGE_BYTES:
            raise BadFile(path, f"is truncated or corrupt: {size} bytes is not a whole number of 3 x 96 x 96 "
                                f"images ({_STL_IMAGE_BYTES} bytes each)")
        return size // _STL_IMAGE_BYTES

    def labels(self, paths: List[str]) -> Tuple[np.ndarray, Any]:
        n = self._count(paths[0])
        raw = np.fromfile(paths[1], dtype=np.uint8)
        if len(raw) != n:
            raise BadFile(paths[1], f"holds {len(raw)} labels (one byte each) but {paths[0]!r} holds {n} images")
        bad = (raw < 1) | (raw > 10)
        if bad.any():
            i = int(np.argmax(bad))
            raise BadFile(paths[1], f"holds the label {int(raw[i])} at index {i}; STL-10's labels are 1..10")
        return raw.astype(np.int64) - 1, None

    def images(self, paths: List[str]) -> Any:
        n = self._count(paths[0])
        return np.memmap(paths[0], dtype=np.uint8, mode="r", shape=(n, 3, 96, 96))

    def image(self, images: Any, idx: int) -> Image.Image:
        # channel planes are column-major: pixel (y, x) of channel c is stored at [c, x, y]
        return Image.fromarray(np.ascontiguousarray(np.asarray(images[idx]).transpose(2, 1, 0)))


# ------------------------------------------------------------------------------------ SVHN


class _Svhn(_Format):
    """SVHN's cropped digits: MATLAB files holding X (32 x 32 x 3 x N uint8) and y (N x 1)."""

    def files(self, train: bool) -> List[str]:
        return ["train_32x32.mat" if train else "test_32x32.mat"]

    @staticmethod
    def _loadmat(path: str, name: str) -> Any:
        import scipy.io  # only SVHN needs scipy: imported on use

        try:
            found = scipy.io.loadmat(path, variable_names=[name])
        except Exception as exc:  # scipy raises many kinds (ValueError, TypeError, MatReadError, ...) on a bad file
            raise BadFile(path, f"is truncated or not a MATLAB file ({type(exc).__name__}: {exc})") from None
        if name not in found:
            raise BadFile(path, f"is truncated or not an SVHN file: it holds no {name!r} (SVHN's .mat files hold "
                                f"'X' and then 'y')")
        return found[name]

    def labels(self, paths: List[str]) -> Tuple[np.ndarray, Any]:
        import scipy.io

        path = paths[0]
        try:
            shapes = {name: shape for name, shape, _ in scipy.io.whosmat(path)}
        except Exception as exc:  # as in _loadmat
            raise BadFile(path, f"is truncated or not a MATLAB file ({type(exc).__name__}: {exc})") from None
        shape = shapes.get("X")
        if shape is None or len(shape) != 4 or tuple(shape[:3]) != (32, 32, 3):
            raise BadFile(path, f"is not an SVHN file: its X is {shape}, expected 32 x 32 x 3 x N")
        y = np.asarray(self._loadmat(path, "y"))
        if y.size != shape[3] or y.dtype.kind not in "iuf":
            raise BadFile(path, f"is not an SVHN file: its y is {y.dtype} {y.shape}, expected {shape[3]} labels")
        labels = y.astype(np.int64).reshape(-1)
        labels[labels == 10] = 0  # as torchvision: SVHN stores digit 0 as 10
        return labels, None

    def images(self, paths: List[str]) -> Any:
        x = self._loadmat(paths[0], "X")
        if x.ndim != 4 or x.shape[:3] != (32, 32, 3) or x.dtype != np.uint8:
            raise BadFile(paths[0], f"is not an SVHN file: its X is {x.dtype} {x.shape}, expected uint8 32 x 32 x 3 x N")
        return x

    def count(self, images: Any) -> int:
        return int(images.shape[3])

    def image(self, images: Any, idx: int) -> Image.Image:
        return Image.fromarray(np.ascontiguousarray(images[:, :, :, idx]))


_FORMATS: Dict[str, Any] = {
    "CIFAR10": _Cifar("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"], "labels"),
    "CIFAR100": _Cifar("cifar-100-python", ["train"], ["test"], "fine_labels"),
    "MNIST": _Mnist(),
    "STL10": _Stl10(),
    "SVHN": _Svhn(),
}


def dataset_name(cfg: Any, split: str, source_index: int) -> str:
    """``DATASET_NAMES[source_index]`` of the split, upper-cased; a UserError if missing or unknown."""
    key = data_key(split, "DATASET_NAMES")
    names = split_cfg(cfg, split).get("DATASET_NAMES", []) or []
    if isinstance(names, str):
        names = [names]
    valid = ", ".join(TORCHVISION_DATASETS)
    if source_index >= len(names):
        raise UserError(
            f"{key} has {len(names)} name(s), so {key}[{source_index}] is missing: the torchvision_dataset source "
            f"at position {source_index} needs the name of its data set there, one of {valid}"
        )
    name = str(names[source_index])
    if name.upper() not in TORCHVISION_DATASETS:
        raise UserError(
            f"{key}[{source_index}]={name!r} is not a data set the torchvision_dataset source reads"
            f"{did_you_mean(name, TORCHVISION_DATASETS)}; valid: {valid} (any case)"
        )
    return name.upper()


@DATA_SOURCES.register("torchvision_dataset")
class TorchvisionDatasetSource:
    """CIFAR10 / CIFAR100 / MNIST / STL10 / SVHN from torchvision's download folder (see the module
    docstring): ``DATASET_NAMES[source_index]`` picks the data set (any case), ``DATA_PATHS`` is
    torchvision's ``root``. Images are RGB (MNIST's grayscale too); labels are torchvision's targets.
    """

    def __init__(self, cfg: Any, path: str, split: str, source_index: int) -> None:
        self.name = dataset_name(cfg, split, source_index)
        self.root = path
        self.split = split
        self.train = split == "TRAIN"  # as VISSL: the TRAIN split is the training set, any other the test set
        self.key = f"{data_key(split, 'DATA_PATHS')}[{source_index}]"
        self._format = _FORMATS[self.name]
        self.paths = self._find_files()
        try:
            labels, images = self._format.labels(self.paths)
        except BadFile as exc:
            raise self._bad_file(exc) from None
        self._labels = labels
        self._images = images  # what reading the labels decoded anyway (CIFAR); else read on first get
        self._len = len(labels)

    # -- files and messages -------------------------------------------------------------------

    def _fetch_hint(self) -> str:
        which = ("train=True" if self.train else "train=False") if self.name in ("CIFAR10", "CIFAR100", "MNIST") \
            else ("split='train'" if self.train else "split='test'")
        return (
            f"ssl_engine never downloads: fetch it once, outside the engine, with "
            f"torchvision.datasets.{self.name}({self.root!r}, {which}, download=True)"
        )

    def _expected(self) -> str:
        return ", ".join(self._format.files(self.train))

    def _find_files(self) -> List[str]:
        what = f"{self.name} ({'training' if self.train else 'test'} set)"
        if not self.root:
            raise UserError(
                f"{self.key} is missing: the torchvision_dataset source needs the folder torchvision downloaded "
                f"{self.name} into (its root), which holds {self._expected()}"
            )
        if not os.path.isdir(self.root):
            state = "is not a folder" if os.path.exists(self.root) else "does not exist"
            raise UserError(
                f"{self.key}: {self.root!r} {state}; {what} expects {self._expected()} under it. {self._fetch_hint()}"
            )
        paths = [self._format.resolve(os.path.join(self.root, rel)) for rel in self._format.files(self.train)]
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing:
            gz = " (or the same names with .gz)" if self.name == "MNIST" else ""
            raise UserError(
                f"{self.key}: {', '.join(repr(p) for p in missing)} {'is' if len(missing) == 1 else 'are'} missing; "
                f"{what} expects {self._expected()}{gz} in {self.root!r}. {self._fetch_hint()}"
            )
        return paths

    def _bad_file(self, exc: BadFile) -> UserError:
        return UserError(
            f"{self.key}: {self.name} file {exc.path!r} {exc.problem}; remove it and fetch the data again "
            f"with torchvision.datasets.{self.name}(..., download=True) outside the engine"
        )

    # -- the contract -------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._len

    def labels(self) -> np.ndarray:
        return self._labels.copy()

    def get(self, idx: int) -> Image.Image:
        if not 0 <= idx < self._len:
            raise IndexError(f"{self.name} image index {idx} out of range [0, {self._len})")
        if self._images is None:
            try:
                images = self._format.images(self.paths)
            except BadFile as exc:
                raise self._bad_file(exc) from None
            n = self._format.count(images)
            if n != self._len:  # the files changed since the labels were read
                raise UserError(f"{self.key}: {self.name} now holds {n} images but held {self._len} when the run "
                                f"started ({', '.join(self.paths)}); do not change the data during a run")
            self._images = images
        return self._format.image(self._images, int(idx))

    def __getstate__(self) -> Dict[str, Any]:
        """Without the decoded images: a loader worker reads its own on first use (CIFAR-10's
        training set is 150 MB, which would otherwise be pickled to every worker)."""
        state = dict(self.__dict__)
        state["_images"] = None
        return state

    def __repr__(self) -> str:
        return f"TorchvisionDatasetSource({self.name}, root={self.root!r}, split={self.split}, len={self._len})"
