"""Data sources: where the images of one input come from.

A data source is registered in ``DATA_SOURCES`` under the name a user writes in
``config.DATA.<split>.DATA_SOURCES`` (or ``LABEL_SOURCES``). It is constructed as
``Source(cfg, path, split, source_index)`` with the FULL config, and provides

- ``__len__()``: the number of images,
- ``get(idx) -> PIL.Image.Image``: image ``idx`` in RGB (raise ``UnreadableImageError`` when
  the file cannot be decoded, so the dataset can apply ``ON_CORRUPT_IMAGE``),
- optionally ``labels() -> np.ndarray``: one integer label per image (makes it usable as a
  label source),
- optionally ``get_batch(indices: np.ndarray) -> torch.Tensor``: samples ``indices`` stacked
  along a new first dim, equal to ``torch.stack([get(i) for i in indices])``. A source whose
  samples are already tensors (features, arrays in memory) offers it so that, with no
  transforms and the default collator, a batch is read in one call instead of one sample dict
  per sample (``SSLDataset.read_batch``).

Sources are deterministic: ``get(idx)`` is the same image in every process, so that data
order and augmentation depend only on (seed, epoch, sample index) (DESIGN rule 8).
"""

import codecs
import errno
import functools
import logging
import os
from pathlib import Path
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

import numpy as np
from PIL import Image

from ssl_engine.errors import UserError, first_few
from ssl_engine.registry import DATA_SOURCES

logger = logging.getLogger(__name__)

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

_SPLIT_CODES = {"TRAIN": 1, "TEST": 2}


class UnreadableImageError(Exception):
    """An image file exists in the data list but cannot be opened or decoded."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"cannot read image {path!r}: {reason}")
        self.path = path
        self.reason = reason


def split_cfg(cfg: Any, split: str) -> Any:
    """``cfg.DATA[split]`` (an empty dict when absent), so sources can read their own keys."""
    data = cfg.get("DATA", {}) if hasattr(cfg, "get") else {}
    return data.get(split, {}) or {}


def data_key(split: str, key: str) -> str:
    """The dotted config path of a per-split data key, for error messages."""
    return f"config.DATA.{split}.{key}"


_SIXTEEN_BIT_GRAY = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})


def _to_rgb(img: Image.Image) -> Image.Image:
    """``img`` in RGB. A 16-bit grayscale image (a 16-bit PNG or TIFF: mode ``I;16``) keeps its
    high byte, as Pillow makes a 16-bit RGB PNG 8-bit; Pillow's own ``convert`` clips it at 255
    instead, which turns an image spanning 0..65535 white but for its darkest pixels."""
    if img.mode in _SIXTEEN_BIT_GRAY:
        high = (np.asarray(img).astype(np.uint16) >> 8).astype(np.uint8)
        return Image.fromarray(np.repeat(high[:, :, None], 3, axis=2), mode="RGB")
    return img.convert("RGB")


_WIDE_MODES_WARNED: Set[str] = set()  # the 32-bit modes (I, F) this process has warned of


def _warn_of_clipped_values(img: Image.Image, path: str) -> None:
    """A warning, once per loading process (rank or loader worker) and mode, when a 32-bit image
    (Pillow mode ``I`` or ``F``: a 32-bit integer or float TIFF) holds values that the conversion
    to 8-bit RGB changes. Pillow
    clips them to 0..255 (as VISSL's loader did, so the images stay as they were read there):
    a float image scaled to 0..1 trains as black, integer data above 255 as white."""
    if img.mode not in ("I", "F") or img.mode in _WIDE_MODES_WARNED:
        return
    if not logger.isEnabledFor(logging.WARNING):
        return  # silenced (the pre-launch checks read a batch so): the run's own reads name the image
    values = np.asarray(img)
    if values.size == 0:
        return
    low, high = float(values.min()), float(values.max())
    if low >= 0 and high <= 255 and (img.mode == "I" or bool((values == np.round(values)).all())):
        return  # 8-bit values held in a wider type: converted as they are
    _WIDE_MODES_WARNED.add(img.mode)
    logger.warning(
        "%s is a 32-bit %s image (Pillow mode %s) with values %.6g..%.6g; it is converted to 8-bit RGB by "
        "clipping to 0..255 (each loading process names the first image of this mode only): save the images as 8-bit, "
        "or read them with a data source of your own that scales them", path,
        "float" if img.mode == "F" else "integer", img.mode, low, high)


def open_rgb(path: str) -> Image.Image:
    """Open ``path`` with PIL, decode it fully and convert to RGB; ``UnreadableImageError`` if not."""
    try:
        with open(path, "rb") as f:
            img = Image.open(f)
            img.load()
            _warn_of_clipped_values(img, path)
            return _to_rgb(img)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise UnreadableImageError(path, f"{type(exc).__name__}: {exc}") from exc


def _split_code(split: str) -> int:
    return _SPLIT_CODES.get(split, sum(ord(c) for c in split) + 3)


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser: a fast, well-mixed hash of uint64 values (vectorised)."""
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return x


@DATA_SOURCES.register("synthetic")
class SyntheticSource:
    """Seeded random RGB images with learnable classes, for tests and quick runs (no files).

    Image ``i`` is a pure function of (SEED_VALUE, split, i). Its class decides a mean colour
    and a sinusoidal stripe pattern (orientation and frequency) that depend only on
    (SEED_VALUE, class), so a model trained on TRAIN generalises to TEST; per-image noise,
    brightness and phase make it less than trivial.

    Keys: ``DATA.<split>.SYNTHETIC_IMAGE_SIZE`` (32), ``DATA.<split>.SYNTHETIC_NUM_CLASSES`` (10);
    length is ``DATA.<split>.DATA_LIMIT`` or 1000 when it is -1.
    """

    def __init__(self, cfg: Any, path: str, split: str, source_index: int) -> None:
        scfg = split_cfg(cfg, split)
        self.seed = int(cfg.get("SEED_VALUE", 0)) % (1 << 63)
        self.split = split
        self.size = int(scfg.get("SYNTHETIC_IMAGE_SIZE", 32))
        self.num_classes = int(scfg.get("SYNTHETIC_NUM_CLASSES", 10))
        limit = int(scfg.get("DATA_LIMIT", -1))
        self.length = limit if limit > 0 else 1000
        if self.size < 1:
            raise UserError(f"{data_key(split, 'SYNTHETIC_IMAGE_SIZE')} must be >= 1, got {self.size}")
        if self.num_classes < 1:
            raise UserError(f"{data_key(split, 'SYNTHETIC_NUM_CLASSES')} must be >= 1, got {self.num_classes}")

    def __len__(self) -> int:
        return self.length

    def labels(self) -> np.ndarray:
        return self._hash_labels(np.arange(self.length, dtype=np.uint64))

    def _hash_labels(self, idx: np.ndarray) -> np.ndarray:
        key = np.uint64((self.seed * 1_000_003 + _split_code(self.split) * 7919) & 0xFFFFFFFFFFFFFFFF)
        with np.errstate(over="ignore"):
            h = _mix64(idx.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + key)
        return (h % np.uint64(self.num_classes)).astype(np.int64)

    def _class_style(self, label: int) -> Tuple[np.ndarray, float, float]:
        rng = np.random.default_rng([self.seed, 0xC1A55, label])
        colour = rng.uniform(40, 215, size=3)
        angle = np.pi * label / self.num_classes
        freq = 1.0 + (label % 4)
        return colour, angle, freq

    def get(self, idx: int) -> Image.Image:
        if not 0 <= idx < self.length:
            raise IndexError(f"synthetic image index {idx} out of range [0, {self.length})")
        label = int(self._hash_labels(np.array([idx]))[0])
        colour, angle, freq = self._class_style(label)
        rng = np.random.default_rng([self.seed, _split_code(self.split), idx])
        s = self.size
        yy, xx = np.mgrid[0:s, 0:s].astype(np.float64) / s
        phase = rng.uniform(0, 2 * np.pi)
        wave = np.sin(2 * np.pi * freq * (np.cos(angle) * xx + np.sin(angle) * yy) + phase)
        brightness = rng.uniform(0.8, 1.2)
        img = colour[None, None, :] * brightness + 45.0 * wave[:, :, None]
        img = img + rng.normal(0, 20.0, size=(s, s, 3))
        return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), mode="RGB")


_DIGITS_SPLIT_SEED = 20240601  # fixed: the TRAIN/TEST split of digits never depends on SEED_VALUE
_DIGITS_TRAIN_FRACTION = 0.8


@functools.lru_cache(maxsize=1)
def _load_digits() -> Tuple[np.ndarray, np.ndarray]:
    """(images N x 8 x 8 float32, targets N int64) of scikit-learn's bundled digits, no download.

    Read from the file scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``: 64 pixel
    columns and the label per row, as ``load_digits`` reads it) without importing
    ``sklearn.datasets``, which imports scipy and most of scikit-learn: 1.5 s of CPU in every
    process that builds the data set (the launcher's pre-launch check and each rank).
    """
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    files = [Path(f, "datasets", "data", "digits.csv.gz") for f in folders]
    if files and files[0].is_file():
        table = np.loadtxt(files[0], delimiter=",")
        return table[:, :-1].reshape(-1, 8, 8).astype(np.float32), table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits  # a packaging of scikit-learn that moved the file

    d = load_digits()
    return d.images.astype(np.float32), d.target.astype(np.int64)


@DATA_SOURCES.register("digits")
class DigitsSource:
    """scikit-learn's bundled 8x8 handwritten digits (1797 images), upscaled to RGB.

    TRAIN is the first 80% of a fixed-seed permutation and TEST the rest, so the split is the
    same for every run. Key: ``DATA.<split>.DIGITS_IMAGE_SIZE`` (32). Labels are the digits.
    """

    def __init__(self, cfg: Any, path: str, split: str, source_index: int) -> None:
        scfg = split_cfg(cfg, split)
        self.size = int(scfg.get("DIGITS_IMAGE_SIZE", 32))
        if self.size < 1:
            raise UserError(f"{data_key(split, 'DIGITS_IMAGE_SIZE')} must be >= 1, got {self.size}")
        images, targets = _load_digits()
        perm = np.random.RandomState(_DIGITS_SPLIT_SEED).permutation(len(images))
        n_train = int(round(_DIGITS_TRAIN_FRACTION * len(images)))
        if split == "TRAIN":
            self.indices = perm[:n_train]
        elif split == "TEST":
            self.indices = perm[n_train:]
        else:
            raise UserError(f"digits data source: unknown split {split!r}; valid: TRAIN, TEST")
        self.indices = np.sort(self.indices)
        self._images = images
        self._targets = targets

    def __len__(self) -> int:
        return len(self.indices)

    def labels(self) -> np.ndarray:
        return self._targets[self.indices].copy()

    def get(self, idx: int) -> Image.Image:
        arr = self._images[self.indices[idx]] * (255.0 / 16.0)
        img = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), mode="L")
        img = img.resize((self.size, self.size), Image.BILINEAR)
        return img.convert("RGB")


def _why_missing(path: str, what: str) -> str:
    """Why ``path``, which ``os.path.exists`` denies, cannot be read: a symlink that leads
    nowhere or loops, or nothing there at all (``what`` names what was expected: "folder", "file")."""
    if os.path.islink(path):
        try:
            os.stat(path)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return f"{what} {path!r} is a symlink loop (it leads back to itself)"
        return f"{what} {path!r} is a symlink to {os.path.realpath(path)!r}, which does not exist"
    return f"{what} {path!r} does not exist"


def _check_dir(path: str, split: str, source_index: int) -> None:
    key = f"{data_key(split, 'DATA_PATHS')}[{source_index}]"
    if not path:
        raise UserError(f"{key} is missing: the disk_folder source needs a folder path")
    if not os.path.exists(path):
        raise UserError(f"{key}: {_why_missing(path, 'folder')}")
    if not os.path.isdir(path):
        raise UserError(f"{key}: {path!r} is not a folder (disk_folder expects one subfolder per class)")


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMG_EXTENSIONS)


def _folder_id(path: str) -> Tuple[int, int]:
    """The identity of the real folder ``path`` leads to, through any symlinks: (st_dev, st_ino)."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _walk_images(top: str, chain: FrozenSet[Tuple[int, int]], skipped: List[str]) -> List[Tuple[str, List[str]]]:
    """(folder, sorted image names) of ``top`` and every folder below it, ordered by path.

    Symlinks are followed, as torchvision's ImageFolder follows them (a link to another folder
    of the tree lists its images there too), except a link back to a folder on its own path
    (``a/loop -> ..``, ``b/self -> .``): that is a loop, which would repeat the tree up to the
    kernel's 40-symlink limit (exponentially with two loops). Such a link is not entered and is
    appended to ``skipped``. ``chain`` holds the identities of the folders above ``top``.
    """
    found: List[Tuple[str, List[str]]] = []
    chains = {top: chain | {_folder_id(top)}}
    for root, dirs, files in os.walk(top, followlinks=True):
        above = chains.pop(root)
        entered = []
        for d in sorted(dirs):
            full = os.path.join(root, d)
            try:
                ident = _folder_id(full)
            except OSError:
                continue  # unreadable or a dangling link: os.walk would list nothing from it either
            if ident in above:
                skipped.append(full)
                continue
            chains[full] = above | {ident}
            entered.append(d)
        dirs[:] = entered
        found.append((root, sorted(n for n in files if _is_image(n))))
    return sorted(found, key=lambda entry: entry[0])


def _is_dir_entry(entry: "os.DirEntry[str]", loops: Optional[List[str]] = None) -> bool:
    """``entry.is_dir()``, following symlinks, except that a link that cannot be followed (a loop,
    ``c -> c``: ELOOP, which ``is_dir`` raises where it returns False for a dangling link) is no
    folder either; it is appended to ``loops``."""
    try:
        return entry.is_dir()
    except OSError:
        if loops is not None:
            loops.append(entry.path)
        return False


def class_folders(path: str, loops: Optional[List[str]] = None) -> List[str]:
    """The class names of a class-per-subfolder tree: its subfolders, sorted; a class's label id
    is its position (torchvision's ImageFolder numbering). A symlink that cannot be followed (a
    loop) is not a class, like a dangling one; it is appended to ``loops``."""
    found: List[str] = []
    with os.scandir(path) as entries:
        names = sorted(e.name for e in entries if _is_dir_entry(e, found))
    if loops is not None:
        loops.extend(sorted(found))
    return names


def scan_image_folder(path: str, split: str = "TRAIN", source_index: int = 0) -> Tuple[List[str], np.ndarray, List[str]]:
    """(image paths, labels, class names) of a class-per-subfolder tree, in sorted order.

    Like torchvision's ImageFolder: class names are the sorted subfolder names and their label
    ids are their positions; images are found recursively, in sorted order, following symlinks.
    A symlink loop (a link back to a folder on its own path, the root included) is skipped,
    with one warning naming the first.
    """
    _check_dir(path, split, source_index)
    key = f"{data_key(split, 'DATA_PATHS')}[{source_index}]"
    skipped: List[str] = []
    classes = class_folders(path, skipped)
    _warn_hidden_classes(classes, path, key)
    root_chain = frozenset([_folder_id(path)])
    paths: List[str] = []
    labels: List[int] = []
    same: Dict[str, List[str]] = {}
    for cls in classes:
        same.setdefault(os.path.realpath(os.path.join(path, cls)), []).append(cls)
    for names in (n for n in same.values() if len(n) > 1):
        logger.warning("%s: class folders %s are one folder (symlinks): its images are read once under each of these "
                       "classes, as torchvision's ImageFolder reads them", key, ", ".join(repr(n) for n in names))
    for label, cls in enumerate(classes):
        for root, names in _walk_images(os.path.join(path, cls), root_chain, skipped):
            paths.extend(os.path.join(root, name) for name in names)
            labels.extend([label] * len(names))
    if skipped:
        logger.warning(
            "%s: skipped %d symlink(s) that form a loop (lead back to a folder on their own path, or to themselves), "
            "first %r -> %r",
            key, len(skipped), skipped[0], os.path.realpath(skipped[0]),
        )
    if not paths:
        loose = [n for n in os.listdir(path) if _is_image(n)]
        hint = (
            f"; it holds {len(loose)} image(s) directly, but disk_folder expects one subfolder per class "
            f"(<folder>/<class>/<image>)"
            if loose
            else f"; expected <folder>/<class>/<image> with extensions {', '.join(IMG_EXTENSIONS)}"
        )
        raise UserError(f"{key}: folder {path!r} contains no images{hint}")
    label_array = np.asarray(labels, dtype=np.int64)
    _check_no_empty_class(classes, label_array, path, key)
    return paths, label_array, classes


def _warn_hidden_classes(classes: List[str], path: str, key: str) -> None:
    """A hidden subfolder (``.ipynb_checkpoints``, ``.cache``) is a class, as torchvision's
    ImageFolder (and so VISSL) reads it: dropping it would renumber the classes against VISSL's
    checkpoints. It sorts first, so it shifts the ids of the classes after it: say so once."""
    hidden = [c for c in classes if c.startswith(".")]
    if not hidden:
        return
    shifted = [(label, c, sum(h < c for h in hidden)) for label, c in enumerate(classes) if not c.startswith(".")]
    moved = next(((label, c, by) for label, c, by in shifted if by), None)
    effect = (f"they shift the label ids of the classes sorted after them (class {moved[1]!r} is {moved[0]}, "
              f"{moved[0] - moved[2]} without them)" if moved else "they take the last label ids")
    logger.warning(
        "%s: hidden folder(s) %s of %r are classes (label %s), as torchvision's ImageFolder and VISSL read them; "
        "%s; if they are not classes, move them out of the folders of every split alike",
        key, first_few(hidden), path, ", ".join(str(classes.index(h)) for h in hidden[:5]), effect,
    )


def _check_no_empty_class(classes: List[str], labels: np.ndarray, path: str, key: str) -> None:
    """Every class subfolder holds an image, as torchvision's ImageFolder (which VISSL used) requires:
    an empty one would still take a label id, a class no sample has, which silently shifts what a
    head's outputs mean against another split's or another run's folders."""
    counts = np.bincount(labels, minlength=len(classes))
    empty = [cls for cls, count in zip(classes, counts) if count == 0]
    if not empty:
        return
    shown = first_few(empty)
    raise UserError(
        f"{key}: {len(empty)} class folder(s) of {path!r} hold no images: {shown}; each subfolder is a class: put "
        f"images in them (extensions {', '.join(IMG_EXTENSIONS)}), or remove them from the folders of every split "
        f"alike (removing one renumbers the classes after it)"
    )


@DATA_SOURCES.register("disk_folder")
class DiskFolderSource:
    """Images in a class-per-subfolder tree (torchvision ImageFolder layout), opened lazily."""

    def __init__(self, cfg: Any, path: str, split: str, source_index: int) -> None:
        self.root = path
        self.paths, self._labels, self.classes = scan_image_folder(path, split, source_index)

    def __len__(self) -> int:
        return len(self.paths)

    def labels(self) -> np.ndarray:
        return self._labels.copy()

    def path(self, idx: int) -> str:
        return self.paths[idx]

    def get(self, idx: int) -> Image.Image:
        return open_rgb(self.paths[idx])


def load_list_file(path: str, what: str, key: str, mmap: bool = False, entries: str = "entries") -> np.ndarray:
    """Load a .npy array or a .txt list (one entry per line) named by config ``key``.

    ``what`` names the reader and ``entries`` what the file lists, for the messages.
    """
    if not path:
        raise UserError(f"{key} is missing: {what} needs a .npy or .txt file")
    if os.path.isdir(path):
        sources_key = key.split("[")[0].replace("_PATHS", "_SOURCES")
        raise UserError(
            f"{key}: {path!r} is a folder; {what} expects a .npy or .txt file listing {entries}, one per image "
            f"(for a folder with one subfolder per class, use the disk_folder source in {sources_key})"
        )
    if not os.path.exists(path):
        raise UserError(f"{key}: {_why_missing(path, 'file')}")
    if not os.path.isfile(path):  # a device, a named pipe (which would block np.load), a socket
        raise UserError(f"{key}: {path!r} is not a regular file; {what} expects a .npy or .txt file listing "
                        f"{entries}, one per image")
    if os.path.getsize(path) == 0:
        raise UserError(
            f"{key}: {path!r} is empty (0 bytes); expected a .npy array of {entries} or a .txt list, one per line"
        )
    ext = os.path.splitext(path)[1].lower()  # FILES.NPY, as a Windows share lists it, is a .npy file
    if ext == ".npy":
        return _load_npy(path, key, mmap)
    if ext == ".txt":
        return read_text_list(path)
    raise UserError(f"{key}: {path!r} must be a .npy or .txt file")


_SAVE_PLAIN = "save it as a plain array, e.g. np.save(path, np.array(entries, dtype=str))"


def _load_npy(path: str, key: str, mmap: bool) -> np.ndarray:
    """``np.load`` of a list file without pickle; a UserError saying what is wrong with the file."""
    try:
        loaded = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (ValueError, EOFError, OSError) as exc:
        problem = npy_problem(path) or f"cannot be loaded without pickle ({exc}); {_SAVE_PLAIN}"
        raise UserError(f"{key}: {path!r} {problem}") from exc
    if not isinstance(loaded, np.ndarray):  # np.load opens a .npz archive whatever the file's name
        close = getattr(loaded, "close", None)
        if close is not None:
            close()
        raise UserError(f"{key}: {path!r} {npy_problem(path) or 'is not one .npy array; ' + _SAVE_PLAIN}")
    return loaded


def npy_problem(path: str) -> str:
    """Why ``path`` cannot be loaded as a plain .npy array, compared against its own header:
    not a .npy file, a corrupt header, Python objects (pickle), or fewer data bytes than the
    header's shape x itemsize (truncated). '' when the file looks whole."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        start = f.read(6)
        if start[:1] == b"\x80":
            return f"holds pickled Python data, which is never loaded (it could run code); {_SAVE_PLAIN}"
        if start[:4] == b"PK\x03\x04":
            return f"is a .npz archive of arrays (np.savez), not one .npy array; {_SAVE_PLAIN}"
        if start != b"\x93NUMPY":
            return "is not a .npy file (no NumPy header); write it with np.save, or use a .txt list, one per line"
        f.seek(0)
        try:
            version = np.lib.format.read_magic(f)
            read_header = np.lib.format.read_array_header_1_0 if version[0] == 1 else np.lib.format.read_array_header_2_0
            shape, _, dtype = read_header(f)
        except (ValueError, EOFError, OSError) as exc:
            return f"has a truncated or corrupt NumPy header ({exc}); write it again with np.save"
        offset = f.tell()
    if dtype.hasobject:
        return f"holds Python objects, which load only with pickle (never done here: it could run code); {_SAVE_PLAIN}"
    expected = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size < expected:
        return (
            f"is truncated or corrupt: its header says shape {tuple(shape)} of {dtype.str} "
            f"({expected} bytes with the header) but the file has {size} bytes; write it again with np.save"
        )
    return ""


def read_text_list(path: str) -> np.ndarray:
    """The non-blank lines of a .txt list, stripped, as a str array.

    Lines are decoded as the OS decodes file names (``os.fsdecode``: UTF-8, and a byte that is
    not UTF-8 kept as a surrogate escape), since file names on Linux are bytes: a list of
    non-UTF-8 names (latin-1 from an old machine) still names the files on disk, because
    ``open`` encodes such a str back to the same bytes. A UTF-8 byte-order mark is dropped.
    """
    with open(path, "rb") as f:
        data = f.read()
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]
    lines = (os.fsdecode(line).strip() for line in data.splitlines())
    return np.asarray([line for line in lines if line])


def _not_utf8_hint(path: str) -> str:
    """For a listed path that was not UTF-8 in its list: a hint naming the first such byte, else ''."""
    try:
        raw = os.fsencode(path)
        raw.decode("utf-8")
    except UnicodeEncodeError:
        return ""  # not a name the OS could have given: nothing to say about its bytes
    except UnicodeDecodeError as exc:
        return (
            f" (the name is not UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start}; if the names on disk "
            f"are UTF-8, save the list as UTF-8)"
        )
    return ""


@DATA_SOURCES.register("disk_filelist")
class DiskFilelistSource:
    """Images listed in a file (.npy array of paths, or .txt with one path per line).

    Keys: ``DATA.<split>.MMAP_MODE`` (True: memory-map the .npy list),
    ``REMOVE_IMG_PATH_PREFIX`` / ``NEW_IMG_PATH_PREFIX`` ('': rewrite path prefixes, e.g. when
    the list was made on another machine). As a label source, ``LABEL_PATHS[i]`` is a .npy
    (or .txt) of integer labels; see ``load_filelist_labels``.
    """

    def __init__(self, cfg: Any, path: str, split: str, source_index: int) -> None:
        scfg = split_cfg(cfg, split)
        key = f"{data_key(split, 'DATA_PATHS')}[{source_index}]"
        self.list_path = path
        self._paths = load_list_file(
            path, "disk_filelist", key, mmap=bool(scfg.get("MMAP_MODE", True)), entries="image paths"
        )
        if self._paths.ndim != 1:
            raise UserError(f"{key}: {path!r} must hold a 1-D list of image paths, got shape {self._paths.shape}")
        if len(self._paths) == 0:
            raise UserError(f"{key}: file list {path!r} is empty")
        self.remove_prefix = str(scfg.get("REMOVE_IMG_PATH_PREFIX", "") or "")
        self.new_prefix = str(scfg.get("NEW_IMG_PATH_PREFIX", "") or "")
        first = self.path(0)
        if not os.path.exists(first):
            raise UserError(
                f"{key}: the first image listed in {path!r}, {first!r}, does not exist{_not_utf8_hint(first)}; "
                f"fix the list or "
                f"rewrite prefixes with {data_key(split, 'REMOVE_IMG_PATH_PREFIX')} / "
                f"{data_key(split, 'NEW_IMG_PATH_PREFIX')}"
            )

    def __len__(self) -> int:
        return len(self._paths)

    def path(self, idx: int) -> str:
        p = self._paths[idx]
        # a list of bytes (np.array([p.encode() ...]), dtype 'S') holds file names as the OS stores them
        p = os.fsdecode(p) if isinstance(p, bytes) else str(p)
        if self.remove_prefix and p.startswith(self.remove_prefix):
            p = p[len(self.remove_prefix):]
            p = self.new_prefix + p
        elif self.new_prefix and not self.remove_prefix:
            p = self.new_prefix + p
        return p

    def get(self, idx: int) -> Image.Image:
        p = self.path(idx)
        if not os.path.exists(p):
            raise UnreadableImageError(p, "file does not exist")
        return open_rgb(p)


def load_filelist_labels(path: str, split: str, label_index: int) -> np.ndarray:
    """Integer labels from ``LABEL_PATHS[label_index]`` (.npy or .txt, one label per image)."""
    key = f"{data_key(split, 'LABEL_PATHS')}[{label_index}]"
    arr = np.asarray(load_list_file(path, "the disk_filelist label source", key, entries="integer labels"))
    if arr.ndim != 1:
        raise UserError(f"{key}: {path!r} must hold a 1-D array of integer labels, got shape {arr.shape}")
    return integer_labels(arr, key, path)


_VALID_LABELS = "labels must be integer class indices (0, 1, 2, ...; integer-valued floats such as 1.0 are read as ints)"


def integer_labels(arr: np.ndarray, key: str, path: str) -> np.ndarray:
    """The 1-D label array ``arr`` of file ``path`` (config ``key``) as int64 class indices.

    Integer-valued floats (1.0: labels kept in a float array) become ints, so the label-range
    check before launch applies to them. A fractional, NaN or infinite label is a UserError
    naming the first one: a cast would silently truncate 0.5 to class 0 and turn NaN into a
    huge negative class. Text labels (.txt) may be written either way.
    """
    kind = arr.dtype.kind
    if kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
        i = int(np.argmax(arr))  # a cast would wrap it to a negative class
        raise UserError(f"{key}: {path!r} holds the label {int(arr[i])} at index {i}; {_VALID_LABELS}")
    if kind in "iub":
        return arr.astype(np.int64)
    if kind in "US":
        try:
            return arr.astype(np.int64)
        except (ValueError, OverflowError):
            arr, kind = _text_to_floats(arr, key, path), "f"
    if kind != "f":
        raise UserError(f"{key}: {path!r} holds {arr.dtype} values; {_VALID_LABELS}")
    if arr.dtype.itemsize < 8:  # float16 / float32: compared with 2**53, float16 printed an overflow warning
        arr = arr.astype(np.float64)
    with np.errstate(invalid="ignore"):
        ok = np.isfinite(arr) & (np.abs(arr) < 2.0**53) & (arr == np.round(arr))
    if not ok.all():
        i = int(np.argmin(ok))
        raise UserError(f"{key}: {path!r} holds the label {float(arr[i])!r} at index {i}; {_VALID_LABELS}")
    return arr.astype(np.int64)


def _text_to_floats(arr: np.ndarray, key: str, path: str) -> np.ndarray:
    """Text labels as float64; a UserError naming the first entry that is not a number."""
    out = np.empty(len(arr), dtype=np.float64)
    for i, text in enumerate(arr.tolist()):
        try:
            out[i] = float(text)
        except ValueError:
            raise UserError(f"{key}: {path!r} holds {text!r} at index {i}, not a number; {_VALID_LABELS}") from None
    return out


def normalize_paths(paths: Any, split: str, key: str) -> List[str]:
    """Turn ``DATA_PATHS`` / ``LABEL_PATHS`` (list of str, or list of one-element lists) into a list of str."""
    if paths is None:
        return []
    if isinstance(paths, str):
        return [paths]
    out: List[str] = []
    for i, p in enumerate(paths):
        if isinstance(p, (list, tuple)):
            if len(p) == 0:
                out.append("")
            elif len(p) == 1:
                out.append(str(p[0]))
            else:
                raise UserError(
                    f"{data_key(split, key)}[{i}] lists {len(p)} paths; give one path per source "
                    f"(a folder for disk_folder, a .npy/.txt list for disk_filelist)"
                )
        else:
            out.append("" if p is None else str(p))
    return out


def source_path(paths: Sequence[str], i: int) -> str:
    """``paths[i]`` or '' when the list is shorter (synthetic/digits need no path)."""
    return paths[i] if i < len(paths) else ""


def build_source(name: str, cfg: Any, path: str, split: str, index: int) -> Any:
    """Construct the registered source ``name`` (unknown names are a UserError from the registry;
    a class whose constructor does not take ``(cfg, path, split, source_index)`` is one naming it)."""
    from ssl_engine.registry import check_call

    cls = DATA_SOURCES.get(name)
    check_call(cls, (cfg, path, split, index), name, f"{data_key(split, 'DATA_SOURCES')}[{index}]: data source {name!r}",
               "built as {}(cfg, path, split, source_index)", "a data source's constructor takes those four")
    return cls(cfg, path, split, index)

