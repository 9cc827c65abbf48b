"""Writers of tiny data sets in the on-disk formats torchvision's downloads leave (CIFAR-10/100,
MNIST, STL-10, SVHN), for the tests of the torchvision_dataset source.

Each writer takes N x H x W x C (or N x H x W for MNIST) uint8 images and integer labels per
split and writes them byte for byte as the real files hold them. CIFAR batches are written as
the originals were, by Python 2's cPickle at protocol 2 (str keys and data as 8-bit strings,
numpy.core.multiarray._reconstruct), by a small opcode writer: Python 3's pickle would write
other globals (_codecs.encode, numpy._core).
"""

import gzip
import struct
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np

Split = Tuple[np.ndarray, np.ndarray]  # (images, labels)


# ------------------------------------------------------------------------------ CIFAR (py2 pickle)


def _py2_str(b: bytes) -> bytes:
    return (b"U" + bytes([len(b)]) + b) if len(b) < 256 else (b"T" + struct.pack("<i", len(b)) + b)


def _py2_int(i: int) -> bytes:
    if 0 <= i < 256:
        return b"K" + bytes([i])
    if 0 <= i < 65536:
        return b"M" + struct.pack("<H", i)
    return b"J" + struct.pack("<i", i)


def _py2_value(v: Any) -> bytes:
    if isinstance(v, bytes):
        return _py2_str(v)
    if isinstance(v, str):
        return _py2_str(v.encode("latin1"))
    if isinstance(v, (int, np.integer)):
        return _py2_int(int(v))
    if isinstance(v, list):
        return b"](" + b"".join(_py2_value(x) for x in v) + b"e"
    if isinstance(v, np.ndarray):
        assert v.dtype == np.uint8 and v.ndim == 2
        shape = _py2_int(v.shape[0]) + _py2_int(v.shape[1]) + b"\x86"
        dtype = (b"cnumpy\ndtype\n" + _py2_str(b"u1") + b"K\x00K\x01\x87R"
                 + b"(K\x03" + _py2_str(b"|") + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb")
        return (b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85" + _py2_str(b"b") + b"\x87R"
                + b"(K\x01" + shape + dtype + b"\x89" + _py2_str(v.tobytes()) + b"tb")
    raise TypeError(type(v))


def py2_pickle(entry: Dict[str, Any]) -> bytes:
    """``entry`` as Python 2's ``cPickle.dump(entry, f, 2)`` wrote it (keys in the given order)."""
    body = b"".join(_py2_value(k) + _py2_value(v) for k, v in entry.items())
    return b"\x80\x02}(" + body + b"u."


def cifar_rows(images: np.ndarray) -> np.ndarray:
    """N x 32 x 32 x 3 images as CIFAR's rows: the R, G and B planes, each row-major."""
    return np.ascontiguousarray(images.transpose(0, 3, 1, 2).reshape(len(images), 3072))


def write_cifar(root: Path, name: str, train: Split, test: Split, train_batches: int = 5) -> None:
    """CIFAR10 (``cifar-10-batches-py``, ``train_batches`` data_batch_i) or CIFAR100
    (``cifar-100-python``, train / test with fine_labels) under ``root``."""
    c10 = name == "CIFAR10"
    folder = root / ("cifar-10-batches-py" if c10 else "cifar-100-python")
    folder.mkdir(parents=True, exist_ok=True)

    def batch(images: np.ndarray, labels: np.ndarray, label: str) -> bytes:
        entry: Dict[str, Any] = {"data": cifar_rows(images)} if c10 else {"filenames": [f"f{i}.png" for i in range(len(images))]}
        if c10:
            entry["labels"] = [int(x) for x in labels]
            entry["batch_label"] = label
            entry["filenames"] = [f"f{i}.png" for i in range(len(images))]
        else:
            entry["batch_label"] = label
            entry["fine_labels"] = [int(x) for x in labels]
            entry["coarse_labels"] = [int(x) // 5 for x in labels]
            entry["data"] = cifar_rows(images)
        return py2_pickle(entry)

    if c10:
        parts = np.array_split(np.arange(len(train[0])), train_batches)
        for i, idx in enumerate(parts, 1):
            (folder / f"data_batch_{i}").write_bytes(batch(train[0][idx], train[1][idx], f"training batch {i} of 5"))
        (folder / "test_batch").write_bytes(batch(test[0], test[1], "testing batch 1 of 1"))
        (folder / "batches.meta").write_bytes(py2_pickle({"label_names": [f"c{i}" for i in range(10)]}))
    else:
        (folder / "train").write_bytes(batch(train[0], train[1], "training batch 1 of 1"))
        (folder / "test").write_bytes(batch(test[0], test[1], "testing batch 1 of 1"))
        (folder / "meta").write_bytes(py2_pickle({"fine_label_names": [f"c{i}" for i in range(100)]}))


# ------------------------------------------------------------------------------------- MNIST (idx)


def idx_bytes(arr: np.ndarray) -> bytes:
    """An idx file: 0 0 0x08 <ndim>, the dims as big-endian uint32, then the uint8 data."""
    assert arr.dtype == np.uint8
    return bytes([0, 0, 8, arr.ndim]) + np.asarray(arr.shape, dtype=">u4").tobytes() + arr.tobytes()


def write_mnist(root: Path, train: Split, test: Split, gz: bool = False) -> None:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, (images, labels) in (("train", train), ("t10k", test)):
        for kind, arr in (("images-idx3", images), ("labels-idx1", labels.astype(np.uint8))):
            data = idx_bytes(arr)
            name = f"{prefix}-{kind}-ubyte"
            if gz:
                (raw / (name + ".gz")).write_bytes(gzip.compress(data))
            else:
                (raw / name).write_bytes(data)


# ------------------------------------------------------------------------------------------ STL10


def write_stl10(root: Path, train: Split, test: Split) -> None:
    """stl10_binary/{train,test}_{X,y}.bin: each channel of each 96 x 96 image column-major; labels 1..10."""
    folder = root / "stl10_binary"
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, (images, labels) in (("train", train), ("test", test)):
        # images[n, y, x, c] stored at [n, c, x, y]
        (folder / f"{prefix}_X.bin").write_bytes(np.ascontiguousarray(images.transpose(0, 3, 2, 1)).tobytes())
        (folder / f"{prefix}_y.bin").write_bytes((labels + 1).astype(np.uint8).tobytes())


# ------------------------------------------------------------------------------------------- SVHN


def write_svhn(root: Path, train: Split, test: Split, compress: bool = True) -> None:
    """train_32x32.mat / test_32x32.mat: X 32 x 32 x 3 x N uint8, y N x 1 with 10 for the digit 0."""
    import scipy.io

    root.mkdir(parents=True, exist_ok=True)
    for name, (images, labels) in (("train_32x32.mat", train), ("test_32x32.mat", test)):
        y = np.where(labels == 0, 10, labels).astype(np.uint8).reshape(-1, 1)
        scipy.io.savemat(str(root / name), {"X": np.ascontiguousarray(images.transpose(1, 2, 3, 0)), "y": y},
                         do_compression=compress)


# ---------------------------------------------------------------------------------------- data


def make_split(n: int, size: int, classes: int, seed: int, channels: int = 3) -> Split:
    """``n`` random images (N x size x size [x channels]) and labels spread over ``classes``,
    label 0 among them (SVHN stores it as 10, STL-10 as 1)."""
    rng = np.random.RandomState(seed)
    shape = (n, size, size, channels) if channels else (n, size, size)
    images = rng.randint(0, 256, size=shape, dtype=np.uint8)
    labels = np.roll((np.arange(n) * 7) % classes, seed)
    return images, labels.astype(np.int64)


SIZES = {"CIFAR10": (32, 10), "CIFAR100": (32, 100), "MNIST": (28, 10), "STL10": (96, 10), "SVHN": (32, 10)}


def write_dataset(name: str, root: Path, n_train: int = 6, n_test: int = 4) -> Tuple[Split, Split]:
    """A tiny ``name`` data set under ``root``; returns the (images, labels) written per split."""
    size, classes = SIZES[name]
    channels = 0 if name == "MNIST" else 3
    train = make_split(n_train, size, classes, 1, channels)
    test = make_split(n_test, size, classes, 2, channels)
    if name in ("CIFAR10", "CIFAR100"):
        write_cifar(root, name, train, test)
    elif name == "MNIST":
        write_mnist(root, train, test)
    elif name == "STL10":
        write_stl10(root, train, test)
    else:
        write_svhn(root, train, test)
    return train, test


def files_of(root: Path) -> List[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())

