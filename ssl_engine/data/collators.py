"""Collators: turn a list of sample dicts into one batch dict (registry ``COLLATORS``).

A sample is ``{"data": [x0, ...], "label": [...], "data_valid": [...], "data_idx": [...]}``
where the lists hold one entry per data source, or per view after a replicating transform.
A collator is a callable on a list of samples; ``COLLATE_FUNCTION_PARAMS`` are passed to it as
keyword arguments by ``build_collator``.
"""

import functools
import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch.utils.data import default_collate as _torch_default_collate

from ssl_engine.errors import UserError
from ssl_engine.registry import COLLATORS, part_origin

SAMPLE_KEYS = ("data", "label", "data_valid", "data_idx")
_SAMPLE_KEY_SET = frozenset(SAMPLE_KEYS)


class CollatedBatch(dict):
    """A batch already in ``default_collate``'s layout, made by ``SSLDataset.read_batch`` from
    sources that read many samples at once; ``default_collate`` passes it through."""


def _stack(items: List[Any], what: str) -> torch.Tensor:
    """Stack tensors along a new batch dim, with a message a user can act on when it fails."""
    try:
        return torch.stack(items, dim=0)
    except (TypeError, RuntimeError):
        pass  # find out why, below, and say it in the config's terms
    for x in items:
        if not isinstance(x, torch.Tensor):
            raise UserError(
                f"cannot batch {what}: got a {type(x).__name__}, not a tensor; end "
                f"config.DATA.<split>.TRANSFORMS with ToTensor (and Normalize) so every view is a tensor"
            )
    shapes = {tuple(x.shape) for x in items}
    if len(shapes) > 1:
        raise UserError(
            f"cannot batch {what}: views have different shapes {sorted(shapes)}; add a fixed-size "
            f"Resize/CenterCrop/RandomResizedCrop to config.DATA.<split>.TRANSFORMS"
        )
    return torch.stack(items, dim=0)  # some other failure (e.g. mixed dtypes): torch's own message


def _ints(values: List[Any]) -> torch.Tensor:
    if type(values[0]) is int or (type(values[0]) is list and values[0] and type(values[0][0]) is int):  # the usual label / flag / index lists: one call, no per-element dispatch
        try:
            return torch.tensor(values, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError):
            pass  # mixed types: let torch's collate say what it makes of them
    return _torch_default_collate(values)


def _num_entries(batch: Sequence[Dict[str, Any]], key: str) -> int:
    return _entry_counts(batch, [key])[0]


def _entry_counts(batch: Sequence[Dict[str, Any]], keys: Sequence[str]) -> List[int]:
    """How many entries each of ``keys`` has, the same in every sample (one pass over the batch)."""
    first = [len(batch[0][key]) for key in keys]
    for s in batch:
        if [len(s[key]) for key in keys] != first:
            for key in keys:
                counts = sorted({len(t[key]) for t in batch})
                if len(counts) > 1:
                    raise UserError(f"cannot batch samples with different numbers of {key!r} entries: {counts}")
    return first


def _extra_keys(batch: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    if _SAMPLE_KEY_SET.issuperset(batch[0]):  # only the standard keys (the usual case)
        return {}
    keys = [k for k in batch[0] if k not in SAMPLE_KEYS]
    return {k: _torch_default_collate([s[k] for s in batch]) for k in keys}


@COLLATORS.register("default")
@COLLATORS.register("default_collate")
def default_collate(batch: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Stack each entry position across the batch: ``{"data": [Tensor N x C x H x W per entry], ...}``.

    With one data source and no replication every list has length 1. ``label``, ``data_valid``
    and ``data_idx`` become LongTensors of length N per position.
    """
    if isinstance(batch, CollatedBatch):
        return dict(batch)
    if not batch:
        raise ValueError("default_collate got an empty batch")
    out: Dict[str, Any] = {}
    int_keys = [key for key in ("label", "data_valid", "data_idx") if key in batch[0]]
    n, *counts = _entry_counts(batch, ["data", *int_keys])
    out["data"] = [_stack([s["data"][j] for s in batch], f"data entry {j}") for j in range(n)]
    if counts and all(c == 1 for c in counts) and all(type(batch[0][key][0]) is int for key in int_keys):
        # the usual case, one entry each: one tensor for the three int lists, one row per key
        rows = _ints([[s[key][0] for s in batch] for key in int_keys])
        if rows.ndim == 2:
            out.update({key: [row] for key, row in zip(int_keys, rows.unbind(0))})
            out.update(_extra_keys(batch))
            return out
    for key, m in zip(int_keys, counts):
        out[key] = [_ints([s[key][j] for s in batch]) for j in range(m)]
    out.update(_extra_keys(batch))
    return out


def _per_view(values: Sequence[Any], num_views: int, key: str, collator: str = "simclr_collator") -> List[Any]:
    if len(values) == num_views:
        return list(values)
    if len(values) == 1:
        return list(values) * num_views
    raise UserError(
        f"{collator}: a sample has {num_views} views but {len(values)} {key!r} entries; "
        f"expected one per view or a single one"
    )


def _view_major_ints(batch: List[Dict[str, Any]], num_views: int, collator: str) -> Dict[str, Any]:
    """``label``, ``data_valid`` and ``data_idx`` as one LongTensor each, view-major (all samples'
    view 0, then view 1, ...), the row order of the collated views."""
    out: Dict[str, Any] = {}
    for key in ("label", "data_valid", "data_idx"):
        if key in batch[0]:
            if len(batch[0][key]) == 0:
                out[key] = []
                continue
            per_sample = [_per_view(s[key], num_views, key, collator) for s in batch]
            out[key] = [_ints([per_sample[i][v] for v in range(num_views) for i in range(len(batch))])]
    return out


@COLLATORS.register("simclr_collator")
def simclr_collator(batch: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Concatenate the V views of N samples into one input: ``data = [Tensor (V*N) x C x H x W]``.

    Order is view-major, as in VISSL: all samples' view 0, then all samples' view 1, ... so
    rows ``i`` and ``i + N`` are the positive pair of sample ``i``. ``label``, ``data_valid`` and
    ``data_idx`` are repeated in the same order (one LongTensor of length V*N each).
    """
    if not batch:
        raise ValueError("simclr_collator got an empty batch")
    num_views = _num_entries(batch, "data")
    if num_views < 2:
        raise UserError(
            "simclr_collator needs at least 2 views per sample; add {name: ImgReplicatePil, num_times: 2} "
            "to the start of config.DATA.<split>.TRANSFORMS"
        )
    out: Dict[str, Any] = {
        "data": [_stack([s["data"][v] for v in range(num_views) for s in batch], "simclr views")]
    }
    out.update(_view_major_ints(batch, num_views, "simclr_collator"))
    out.update(_extra_keys(batch))
    return out


@COLLATORS.register("multicrop_collator")
def multicrop_collator(batch: List[Dict[str, Any]], create_multidimensional_tensor: bool = False) -> Dict[str, Any]:
    """SwAV's multi-crop batches: ``data = [[crop 0 of every sample, crop 1 of every sample, ...]]``.

    Each sample holds C crops (``ImgPilToMultiCrop``), possibly of several sizes (2x224 + 6x96).
    Crop ``c`` of the N samples is stacked into one ``N x C x H x W`` tensor, so the list has C
    tensors in crop order; the model runs each run of equally sized crops through the trunk at
    once and concatenates the features, so the rows of its output are crop-major (all samples'
    crop 0, then crop 1, ...), the order ``swav_loss`` expects. ``label``, ``data_valid`` and
    ``data_idx`` are repeated in the same order (one LongTensor of length C*N each), as VISSL does.

    ``create_multidimensional_tensor`` (VISSL's option) must stay false: the model groups crops
    by resolution itself.
    """
    if create_multidimensional_tensor:
        raise UserError(
            "config.DATA.<split>.COLLATE_FUNCTION_PARAMS: multicrop_collator's create_multidimensional_tensor=true "
            "is not supported (the model groups the crops by resolution itself); leave it out"
        )
    if not batch:
        raise ValueError("multicrop_collator got an empty batch")
    num_crops = _num_entries(batch, "data")
    out: Dict[str, Any] = {"data": [[_stack([s["data"][c] for s in batch], f"crop {c}") for c in range(num_crops)]]}
    out.update(_view_major_ints(batch, num_crops, "multicrop_collator"))
    out.update(_extra_keys(batch))
    return out


@COLLATORS.register("moco_collator")
def moco_collator(batch: List[Dict[str, Any]]) -> Dict[str, Any]:
    """MoCo's two views: ``data = [view 0 of every sample]`` (the query encoder's input) and
    ``data_momentum = [view 1 of every sample]`` (the momentum encoder's, see MoCoHook), as
    VISSL's moco_collator gives them; ``label``, ``data_valid`` and ``data_idx`` are those of
    view 0 (one LongTensor of length N each).
    """
    if not batch:
        raise ValueError("moco_collator got an empty batch")
    num_views = _num_entries(batch, "data")
    if num_views != 2:
        raise UserError(
            f"moco_collator needs exactly 2 views per sample, got {num_views}; start "
            "config.DATA.TRAIN.TRANSFORMS with {name: ImgReplicatePil, num_times: 2}"
        )
    out: Dict[str, Any] = {
        "data": [_stack([s["data"][0] for s in batch], "moco view 0")],
        "data_momentum": [_stack([s["data"][1] for s in batch], "moco view 1")],
    }
    for key in ("label", "data_valid", "data_idx"):
        if key in batch[0]:
            out[key] = [_ints([s[key][0] for s in batch])] if len(batch[0][key]) else []
    out.update(_extra_keys(batch))
    return out


def build_collator(name: str, params: Optional[Dict[str, Any]] = None, split: str = "<split>") -> Callable[[List[Dict[str, Any]]], Dict[str, Any]]:
    """The registered collator ``name`` with ``params`` bound as keyword arguments (picklable for workers)."""
    fn = COLLATORS.get(name)
    params = dict(params or {})
    if params:
        try:
            inspect.signature(fn).bind_partial([], **params)
        except TypeError as exc:
            raise UserError(
                f"config.DATA.{split}.COLLATE_FUNCTION_PARAMS {params!r} do not fit collator {name!r}: {exc}"
            ) from exc
        fn = functools.partial(fn, **params)
    return fn if split == "<split>" else _SplitCollator(fn, split, name)


class _SplitCollator:
    """A split's collator: its errors name that split's keys (``config.DATA.TEST.TRANSFORMS``)
    where the collator, shared by the splits, can only write ``config.DATA.<split>``; a batch
    that is not a dict with ``data`` (a collator of the user's that returns a list) is an error
    naming the collator, not a KeyError or AttributeError in the train step."""

    def __init__(self, fn: Callable[[List[Dict[str, Any]]], Dict[str, Any]], split: str, name: str = "") -> None:
        self.fn = fn
        self.split = split
        self.name = name

    def __call__(self, batch: List[Dict[str, Any]]) -> Dict[str, Any]:
        try:
            out = self.fn(batch)
        except UserError as e:  # no cost until raised (python >= 3.11)
            if "config.DATA.<split>." not in str(e):
                raise
            raise UserError(str(e).replace("config.DATA.<split>.", f"config.DATA.{self.split}.")) from None
        if not isinstance(out, dict) or "data" not in out:
            raise self._bad_batch(out)
        return out

    def _bad_batch(self, out: Any) -> UserError:
        got = f"a dict with keys {sorted(map(str, out))}" if isinstance(out, dict) else type(out).__name__
        fn = self.fn.func if isinstance(self.fn, functools.partial) else self.fn
        return UserError(
            f"collator {self.name!r} (config.DATA.{self.split}.COLLATE_FUNCTION) {part_origin(fn)} returned {got}; a "
            f"collator returns a dict with 'data' (a list with one batch tensor per input) and 'label' (a list of "
            f"label tensors), as default_collate does"
        )
