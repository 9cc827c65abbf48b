"""Weighted k-nearest-neighbour classification of extracted features (InstDisc / VISSL style).

With ``l2_norm`` (``NEAREST_NEIGHBOR.L2_NORM_FEATS: true``) features are L2-normalised, so the
similarity is the cosine; without, it is the raw dot product, as in VISSL. Each test sample's
``topk`` most similar train samples vote for their label with weight ``exp(similarity / sigma)``;
classes are ranked by their summed votes and top-k accuracies are read off that ranking.
The test set is processed ``chunk_size`` samples at a time, so memory holds the train
features plus one [chunk_size, N_train] similarity block, whatever the test set's size.
"""

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ssl_engine.errors import UserError, first_few
from ssl_engine.resume_state import is_int

log = logging.getLogger(__name__)


def _as_tensor(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)).to(dtype)


def _rows(x: Any) -> np.ndarray:
    """``x`` as [N, D] rows (flattened); the row size spelled out, as -1 cannot be inferred for 0 rows."""
    x = np.asarray(x)
    return x.reshape(len(x), int(np.prod(x.shape[1:], dtype=np.int64)))


def _labels(y: np.ndarray, split: str = "") -> np.ndarray:
    """[N] labels; of [N, L] targets (several label sources) the first column. Targets of more
    dimensions (a file written as [N, 1, 1]) are read as [N, L] rows; rows of no label are a
    UserError naming the split (a column of [N, 1, 1] gave [N, 1] labels, and the vote a traceback)."""
    y = np.asarray(y)
    if y.ndim <= 1:
        return y.reshape(-1)
    rows = y.reshape(len(y), int(np.prod(y.shape[1:], dtype=np.int64)))
    if rows.shape[1] == 0:
        raise UserError(f"kNN: the {split or 'given'} targets have shape {tuple(y.shape)}: no label per sample; "
                        f"targets are [N] class ids, or [N, L] with the class id first")
    return rows[:, 0]


def _integer_labels(split: str, y: np.ndarray) -> np.ndarray:
    """``y`` when its values are integers (of any dtype); a UserError naming the split otherwise:
    a fractional or non-numeric target is not a class, and casting would merge classes silently."""
    if y.dtype.kind in "iub":
        return y
    if y.dtype.kind != "f" or not np.isfinite(y).all() or not np.array_equal(y, np.round(y)):
        shown = next((v for v in y.tolist() if not (isinstance(v, float) and v.is_integer())), None)
        raise UserError(f"kNN: the {split} targets are not class ids ({y.dtype} values such as {shown!r}); they must be "
                        f"integers: extract the features again from a data set with class labels")
    return y


def align_test_labels(
    train_classes: Optional[Sequence[str]], test_classes: Optional[Sequence[str]], test_labels: np.ndarray
) -> Tuple[np.ndarray, Optional[str]]:
    """Test labels numbered as the train split numbers its classes, and a line saying what was done.

    Each split extracted from class folders numbers its own sorted folders (VISSL's numbering,
    kept in the shards): a test folder that lacks one of the train folder's classes gives every
    later class another id than the train features carry for it, and a kNN comparing ids would
    score the wrong classes. When the extraction recorded both splits' class names and the
    test's are a subset of the train's, the test labels are renumbered by name; when the test
    has classes the train lacks, the ids are compared as they are and the line says so.
    """
    if train_classes is None or test_classes is None or list(train_classes) == list(test_classes):
        return test_labels, None
    train_classes, test_classes = list(train_classes), list(test_classes)
    unknown = [c for c in test_classes if c not in train_classes]
    if unknown:
        shown = first_few(unknown)
        return test_labels, (
            f"the test split has class folder(s) the train split lacks ({shown}); labels are compared by their ids "
            f"(each split numbers its own sorted class folders), which match classes only where the two folders "
            f"list the same classes in the same order"
        )
    y = np.asarray(test_labels)
    column = _labels(y)
    lookup = np.asarray([train_classes.index(c) for c in test_classes], dtype=np.int64)
    known = (column >= 0) & (column < len(lookup))
    renumbered = np.where(known, lookup[np.clip(column, 0, len(lookup) - 1)], column)
    if y.ndim > 1:
        y = y.copy()
        y[:, 0] = renumbered
    else:
        y = renumbered.reshape(y.shape)
    missing = [c for c in train_classes if c not in test_classes]
    return y, (
        f"the test split's {len(test_classes)} class folders are numbered as the train split's {len(train_classes)} "
        f"by name (no test images of: {', '.join(missing) or 'none'})"
    )


def check_settings(topk: Any, sigma: Any, topk_list: Any, chunk_size: Any) -> None:
    """The kNN options (config.NEAREST_NEIGHBOR.*, checked before launch with the rest of the
    config; here for callers of :func:`knn_accuracy`): a UserError naming the first out of range."""
    key = "config.NEAREST_NEIGHBOR"
    for name, value in (("TOPK", topk), ("TEST_CHUNK_SIZE", chunk_size)):
        if not is_int(value) or value < 1:
            raise UserError(f"{key}.{name}={value!r} must be an integer >= 1")
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not sigma > 0 or sigma == float("inf"):
        raise UserError(f"{key}.SIGMA={sigma!r} must be a number > 0 (the vote temperature, e.g. 0.1)")
    ks = list(topk_list) if isinstance(topk_list, (list, tuple)) else None
    if not ks or any(not is_int(k) or k < 1 for k in ks):
        raise UserError(f"{key}.TOPK_LIST={topk_list!r} must list the k of each top-k accuracy to report, each an "
                        f"integer >= 1, e.g. [1, 5]")


def knn_accuracy(
    train_features: np.ndarray,
    train_labels: np.ndarray,
    test_features: np.ndarray,
    test_labels: np.ndarray,
    topk: int = 200,
    sigma: float = 0.1,
    topk_list: Sequence[int] = (1, 5),
    chunk_size: int = 1024,
    num_classes: Optional[int] = None,
    device: str = "cpu",
    l2_norm: bool = True,
) -> Dict[int, float]:
    """Top-k accuracies in percent, ``{k: accuracy}`` for each k of ``topk_list``.

    ``train_features`` [N, D] and ``test_features`` [M, D] (flattened if not), integer labels
    [N] and [M]. ``topk`` is capped at N. Votes go to the classes the train labels hold (their
    ids may be any integers; a test label no train sample has is never predicted);
    ``num_classes`` caps how many of them a top-k ranking counts (default: all).
    ``l2_norm``: compare L2-normalised features (cosine); False: raw dot products.
    """
    train_rows = _rows(train_features)
    test = _rows(test_features)
    ytrain = _as_tensor(_integer_labels("train", _labels(train_labels, "train")), torch.int64).to(device)
    ytest = _as_tensor(_integer_labels("test", _labels(test_labels, "test")), torch.int64)
    if len(ytrain) != len(train_rows) or len(ytest) != len(test):
        raise UserError(
            f"kNN: {len(train_rows)} train features with {len(ytrain)} labels, {len(test)} test features with "
            f"{len(ytest)} labels; each feature needs one label"
        )
    if len(train_rows) == 0 or len(test) == 0:
        raise UserError(f"kNN: needs train and test features; got {len(train_rows)} train and {len(test)} test samples")
    if train_rows.shape[1] != test.shape[1]:
        raise UserError(f"kNN: train features have dim {train_rows.shape[1]} but test features have dim {test.shape[1]}")
    if train_rows.shape[1] == 0:  # no value to compare: numpy's max of an empty row was a ValueError traceback
        raise UserError(f"kNN: the features have dim 0 (train shape {tuple(np.shape(train_features))}): no value to "
                        f"compare; extract a layer with values")
    if l2_norm and train_rows.shape[1] == 1:
        log.warning("kNN: the features have dim 1: L2-normalised, each is -1, 0 or +1, so only their sign is compared; "
                    "set config.NEAREST_NEIGHBOR.L2_NORM_FEATS=false to compare their values")
    if int(ytrain.min()) < 0:
        raise UserError("kNN: the train features have no labels (negative targets); extract with LABEL_SOURCES set")
    _check_finite("train", train_rows, chunk_size)
    _check_finite("test", test, chunk_size)
    check_settings(topk, sigma, topk_list, chunk_size)
    # votes per class present in the train labels (compact ids): the vote table's width does not
    # follow the size of the label ids (an id of 10**12 asked for a table that size)
    class_ids, ytrain = torch.unique(ytrain, return_inverse=True)
    classes = len(class_ids) if not num_classes else min(int(num_classes), len(class_ids))
    class_ids = class_ids.cpu()
    train = torch.from_numpy(_float32_rows("train", train_rows, l2_norm, chunk_size)).to(device)
    k = min(int(topk), len(train))
    ks = sorted({int(x) for x in topk_list})
    correct = {kk: 0 for kk in ks}
    for start in range(0, len(test), chunk_size):
        q = torch.from_numpy(_float32_rows("test", test[start:start + chunk_size], l2_norm, chunk_size)).to(device)
        sim, idx = (q @ train.T).topk(k, dim=1)                       # [c, k], most similar first
        if not l2_norm and not bool(torch.isfinite(sim).all()):
            raise UserError(
                "kNN: the dot products of the test and train features overflow float32 (features as large as "
                f"{float(np.abs(train_rows).max()):.3g}); compare them by cosine: config.NEAREST_NEIGHBOR.L2_NORM_FEATS=true")
        votes = torch.zeros(len(q), classes, device=device)
        # weight exp(sim / sigma), scaled per test sample by exp(-max sim / sigma), which leaves
        # its class ranking as it is, so that no sigma (or raw dot product) overflows float32
        votes.scatter_add_(1, ytrain[idx], ((sim - sim[:, :1]) / sigma).exp())
        ranked = class_ids[votes.topk(min(max(ks), classes), dim=1).indices.cpu()]  # [c, max k] label ids
        hit = ranked == ytest[start:start + chunk_size, None]
        for kk in ks:
            correct[kk] += int(hit[:, :kk].any(dim=1).sum())
    return {kk: 100.0 * correct[kk] / len(test) for kk in ks}


def _float32_rows(split: str, rows: np.ndarray, l2_norm: bool, chunk_size: int) -> np.ndarray:
    """``rows`` as float32, L2-normalised with ``l2_norm``. The norm is taken in float64 before the
    cast, chunk by chunk: in float32 a row with values beyond ~1e19 has an infinite norm (it became
    all zeros) and float64 values beyond float32's range became inf or 0, so every such row was
    equally similar to everything and the accuracy meant nothing."""
    out = np.empty(rows.shape, dtype=np.float32)
    step = max(1, int(chunk_size))
    for start in range(0, len(rows), step):
        block = np.asarray(rows[start:start + step])
        if l2_norm:
            block = block.astype(np.float64)
            scale = np.abs(block).max(axis=1, keepdims=True)  # first to ~1, so that no square overflows
            block = np.divide(block, scale, out=np.zeros_like(block), where=scale > 0)
            norm = np.linalg.norm(block, axis=1, keepdims=True)
            block = np.divide(block, norm, out=np.zeros_like(block), where=norm > 0)
        with np.errstate(over="ignore"):
            out[start:start + step] = block
    if not l2_norm and not np.isfinite(out).all():
        raise UserError(
            f"kNN: {split} features hold values beyond float32's range (as large as {float(np.abs(rows).max()):.3g}); "
            f"compare them by cosine: config.NEAREST_NEIGHBOR.L2_NORM_FEATS=true")
    return out


def _check_finite(split: str, features: np.ndarray, chunk_size: int) -> None:
    """A UserError when rows of ``features`` hold NaN or inf: no neighbour of such a row can be
    ranked, and the accuracy would be a number that means nothing. Checked chunk by chunk (no
    second full-size array)."""
    bad, first = 0, -1
    step = max(1, int(chunk_size))
    for start in range(0, len(features), step):
        rows = ~np.isfinite(features[start:start + step]).all(axis=1)
        if rows.any():
            if first < 0:
                first = start + int(np.argmax(rows))
            bad += int(rows.sum())
    if bad:
        raise UserError(
            f"kNN: {bad} of {len(features)} {split} features hold NaN or inf values (the first is row {first}); the "
            f"model that gave them does not compute finite outputs (did its training diverge?), so no neighbour can "
            f"be ranked: extract them again from finite weights"
        )


def knn_on_folder(
    folder: Path,
    layer: str,
    topk: int = 200,
    sigma: float = 0.1,
    topk_list: Sequence[int] = (1, 5),
    chunk_size: int = 1024,
    train_split: str = "train",
    test_split: str = "test",
    l2_norm: bool = True,
) -> Dict[int, float]:
    """:func:`knn_accuracy` on the train and test shards of ``layer`` in a features folder."""
    train, test = load_train_and_test(folder, layer, train_split, test_split)
    return knn_of_layer(train, test, layer, folder, topk=topk, sigma=sigma, topk_list=topk_list,
                        chunk_size=chunk_size, l2_norm=l2_norm)


def knn_of_layer(train: Dict[str, np.ndarray], test: Dict[str, np.ndarray], layer: str, folder: Path,
                 **options: Any) -> Dict[int, float]:
    """:func:`knn_accuracy` (``options``: its keyword arguments) of the loaded shards of ``layer``
    (:func:`load_train_and_test`); an error says which layer of which folder, as a folder may hold several."""
    try:
        return knn_accuracy(train["features"], train["targets"], test["features"], test["targets"], **options)
    except UserError as e:
        text = str(e)
        raise UserError(f"kNN {layer} in {folder}: " + (text[len("kNN: "):] if text.startswith("kNN: ") else text)) \
            from None


def paired_layers(folder: Path, pairs: Sequence[Tuple[str, str]], train_split: str = "train",
                  test_split: str = "test") -> List[str]:
    """The layers of ``pairs`` (``features.available``) with shards of both splits. A layer that
    only one split has cannot be evaluated; it is named in a warning with the split that lacks it,
    rather than left out without a word (a user reading the results would miss it)."""
    layers = [layer for s, layer in pairs if s == train_split and (test_split, layer) in pairs]
    for have, lack in ((train_split, test_split), (test_split, train_split)):
        lonely = [layer for s, layer in pairs if s == have and (lack, layer) not in pairs]
        if lonely and layers:  # with no pair at all the caller's error lists what there is
            log.warning("kNN: %s in %s %s %s features but no %s features: not evaluated; extract both splits of "
                        "%s (EXTRACT_FEATURES.SPLITS: [TRAIN, TEST]) into one folder", first_few(lonely), folder,
                        "has" if len(lonely) == 1 else "have", have, lack, "it" if len(lonely) == 1 else "them")
    return layers


def targets_of(label_type: str) -> str:
    """What the targets of features extracted with ``DATA.<split>.LABEL_TYPE=label_type`` are,
    when that is not 'standard' (the source's class labels)."""
    return "sample indices" if label_type == "sample_index" else "all 0"


def load_train_and_test(
    folder: Path, layer: str, train_split: str = "train", test_split: str = "test"
) -> Tuple[Dict[str, np.ndarray], Dict[str, np.ndarray]]:
    """The train and test features of ``layer`` in ``folder`` (see ssl_engine.features.load_features),
    the test targets numbered as the train split numbers its classes (:func:`align_test_labels`;
    what was done is logged)."""
    from ssl_engine.features import extraction_status, load_features, split_classes, split_label_type

    for split in (train_split, test_split):
        label_type = split_label_type(folder, split)
        if label_type != "standard":
            raise UserError(
                f"kNN: the {split} features in {folder} were extracted with config.DATA.{split.upper()}.LABEL_TYPE="
                f"{label_type}, so their targets are {targets_of(label_type)}, not classes; extract them again "
                f"with config.DATA.{split.upper()}.LABEL_TYPE=standard"
            )
    train = load_features(folder, train_split, layer)
    test = load_features(folder, test_split, layer)
    weights = [(extraction_status(folder, split) or {}).get("weights") for split in (train_split, test_split)]
    if all(weights) and weights[0] != weights[1]:
        log.warning("kNN %s: the %s and %s features in %s come from different weights (%s; %s): their neighbours "
                    "mean nothing; extract both splits with the same weights (one command with both in "
                    "EXTRACT_FEATURES.SPLITS)", layer, train_split, test_split, folder, weights[0], weights[1])
    targets, note = align_test_labels(split_classes(folder, train_split), split_classes(folder, test_split),
                                      test["targets"])
    if note:
        renumbered = targets is not test["targets"]
        (log.info if renumbered else log.warning)("kNN %s: %s", layer, note)
        test = dict(test, targets=targets)
    return train, test
