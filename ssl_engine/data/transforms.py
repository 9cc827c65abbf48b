"""Image transforms found by name, and the wrapper that applies a yaml transform list to a sample.

Every class of ``torchvision.transforms`` is registered in ``TRANSFORMS`` under its own name,
next to VISSL's PIL transforms (``ImgReplicatePil``, ``ImgPilColorDistortion``,
``ImgPilGaussianBlur``, ``ImgPilToMultiCrop``, ``ImgPilRandomSolarize``, ``ImgRotatePil``,
which also sets the sample's label, and ``ImgPilMultiCropRandomApply``, which sees all the
sample's views at once to apply its transforms to view i with probability prob[i]). A config lists them as VISSL does::

    TRANSFORMS:
      - name: ImgReplicatePil
        num_times: 2
      - name: RandomResizedCrop
        size: 32
      - name: ImgPilGaussianBlur      # only on the first view
        indices: [0]
        p: 1.0
        radius_min: 0.1
        radius_max: 2.0
      - name: ToTensor

All randomness is drawn from torch's global generator (or python ``random`` / numpy for user
transforms); the dataset reseeds those around each call from (seed, epoch, index), which is
what makes augmentation independent of workers and resumption (DESIGN rule 8).
"""

import copy
import enum
import inspect
import logging
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torchvision.transforms as T
import torchvision.transforms.functional as TF
from PIL import Image, ImageFilter, ImageOps

from ssl_engine.errors import UserError, whole_number
from ssl_engine.registry import TRANSFORMS, accepted_params

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- torchvision


def _register_torchvision() -> None:
    for name in dir(T):
        obj = getattr(T, name)
        if not inspect.isclass(obj) or issubclass(obj, enum.Enum) or name.startswith("_"):
            continue
        if name not in TRANSFORMS:
            TRANSFORMS.register(name)(obj)


_register_torchvision()


# ----------------------------------------------------------------------------- VISSL's


def _require_pil(img: Any, name: str) -> None:
    if not isinstance(img, Image.Image):
        raise TypeError(f"{name} expects a PIL image, got {type(img).__name__}; list it before ToTensor")


def _copy_image(img: Any) -> Any:
    if isinstance(img, torch.Tensor):
        return img.clone()
    if isinstance(img, Image.Image):
        return img.copy()
    return copy.deepcopy(img)


@TRANSFORMS.register("ImgReplicatePil")
class ImgReplicatePil:
    """Return ``num_times`` copies of the image; the sample then holds that many views."""

    def __init__(self, num_times: int = 2) -> None:
        self.num_times = _whole(num_times, "num_times")

    def __call__(self, img: Any) -> List[Any]:
        return [_copy_image(img) for _ in range(self.num_times)]

    def __repr__(self) -> str:
        return f"ImgReplicatePil(num_times={self.num_times})"


class LabelledImage(NamedTuple):
    """What a transform that decides the sample's label returns (``sets_label = True``): the
    image, and the label that replaces its data entry's label (RotNet's rotation index)."""

    image: Any
    label: int


@TRANSFORMS.register("ImgRotatePil")
class ImgRotatePil:
    """RotNet's pretext: rotate the image by one of ``num_angles`` angles evenly spaced in
    [0, 360) (0, 90, 180, 270 by default), drawn per sample; the angle's index becomes the label."""

    sets_label = True

    def __init__(self, num_angles: int = 4, num_rotations_per_img: int = 1) -> None:
        if int(num_angles) < 1:
            raise ValueError(f"num_angles must be >= 1, got {num_angles}")
        if int(num_rotations_per_img) != 1:
            raise ValueError(f"num_rotations_per_img={num_rotations_per_img}: only 1 is supported (as in VISSL)")
        self.num_angles = int(num_angles)
        self.num_labels = self.num_angles  # labels 0..num_angles-1, for the check against the heads

    def __call__(self, img: Any) -> LabelledImage:
        k = int(torch.randint(self.num_angles, ()).item())
        return LabelledImage(TF.rotate(img, 360.0 * k / self.num_angles), k)

    def __repr__(self) -> str:
        return f"ImgRotatePil(num_angles={self.num_angles})"


@TRANSFORMS.register("ImgPilColorDistortion")
class ImgPilColorDistortion:
    """SimCLR's colour distortion: jitter (0.8s, 0.8s, 0.8s, 0.2s) with p 0.8, then grayscale with p 0.2."""

    def __init__(self, strength: float = 1.0) -> None:
        s = float(strength)
        if s < 0:
            raise ValueError(f"strength must be >= 0, got {strength}")
        self.strength = s
        self.transform = T.Compose(
            [
                T.RandomApply([T.ColorJitter(0.8 * s, 0.8 * s, 0.8 * s, 0.2 * s)], p=0.8),
                T.RandomGrayscale(p=0.2),
            ]
        )

    def __call__(self, img: Image.Image) -> Image.Image:
        return self.transform(img)

    def __repr__(self) -> str:
        return f"ImgPilColorDistortion(strength={self.strength})"


@TRANSFORMS.register("ImgPilGaussianBlur")
class ImgPilGaussianBlur:
    """With probability ``p``, blur a PIL image with a radius drawn uniformly in [radius_min, radius_max]."""

    def __init__(self, p: float = 0.5, radius_min: float = 0.1, radius_max: float = 2.0) -> None:
        if not 0.0 <= float(p) <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {p}")
        if float(radius_min) < 0 or float(radius_max) < float(radius_min):
            raise ValueError(f"need 0 <= radius_min <= radius_max, got {radius_min}, {radius_max}")
        self.p, self.radius_min, self.radius_max = float(p), float(radius_min), float(radius_max)

    def __call__(self, img: Image.Image) -> Image.Image:
        _require_pil(img, "ImgPilGaussianBlur")
        if torch.rand(()).item() >= self.p:
            return img
        radius = self.radius_min + (self.radius_max - self.radius_min) * torch.rand(()).item()
        return img.filter(ImageFilter.GaussianBlur(radius=radius))

    def __repr__(self) -> str:
        return f"ImgPilGaussianBlur(p={self.p}, radius_min={self.radius_min}, radius_max={self.radius_max})"


@TRANSFORMS.register("ImgPilRandomSolarize")
class ImgPilRandomSolarize:
    """With probability ``p``, solarize a PIL image (invert the pixels at or above a threshold), as in BYOL.

    As in VISSL, each solarized image draws its threshold uniformly from the integers 0..256
    (0 inverts every pixel, 256 none); ``threshold`` fixes it instead. ``p`` is VISSL's key (and
    default, 0.66); ``prob``, the argument name of VISSL's class, is accepted too.
    """

    def __init__(self, p: Optional[float] = None, threshold: Optional[int] = None, prob: Optional[float] = None) -> None:
        if p is not None and prob is not None:
            raise ValueError(f"give p (VISSL's key) or prob, not both; got p={p}, prob={prob}")
        value = 0.66 if p is None and prob is None else (p if p is not None else prob)
        if not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {value}")
        self.prob = float(value)
        self.threshold = None if threshold is None else _whole(threshold, "threshold", least=0)
        if self.threshold is not None and self.threshold > 256:
            raise ValueError(f"threshold={threshold!r} must be in 0..256")

    def __call__(self, img: Image.Image) -> Image.Image:
        _require_pil(img, "ImgPilRandomSolarize")
        if torch.rand(()).item() >= self.prob:
            return img
        threshold = self.threshold if self.threshold is not None else int(torch.randint(0, 257, ()).item())
        return ImageOps.solarize(img, threshold=threshold)

    def __repr__(self) -> str:
        drawn = "0..256 drawn" if self.threshold is None else self.threshold
        return f"ImgPilRandomSolarize(p={self.prob}, threshold={drawn})"


def _whole(value: Any, name: str, least: int = 1) -> int:
    """A count or a size in pixels: a whole number (``64.5`` was cut to 64 without a word)."""
    number = whole_number(value)
    if number is None or number < least:
        raise ValueError(f"{name}={value!r} must be a whole number of at least {least}")
    return number


def _groups(value: Any, name: str, example: str) -> List[Any]:
    """A per-group option of ImgPilToMultiCrop: a list with one entry per group of crops."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{name}={value!r} must be a list with one entry per group of crops, e.g. {name}: {example}")
    return list(value)


def _scale_pair(value: Any, i: int) -> List[float]:
    """``crop_scales[i]``: the [min, max] fraction of the image area a crop of group i covers."""
    if (isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
        raise ValueError(f"crop_scales[{i}]={value!r} must be a pair of numbers [min, max], e.g. [0.14, 1]")
    return [float(value[0]), float(value[1])]


@TRANSFORMS.register("ImgPilToMultiCrop")
class ImgPilToMultiCrop:
    """SwAV's multi-crop: ``num_crops[i]`` random resized crops of size ``size_crops[i]`` and scale ``crop_scales[i]``.

    Returns a list of ``total_num_crops`` views, group by group (e.g. 2 large then 6 small).
    """

    def __init__(
        self,
        total_num_crops: int,
        num_crops: Sequence[int],
        size_crops: Sequence[int],
        crop_scales: Sequence[Sequence[float]],
    ) -> None:
        num_crops = [_whole(n, f"num_crops[{i}]", least=0) for i, n in enumerate(_groups(num_crops, "num_crops", "[2, 6]"))]
        size_crops = [_whole(n, f"size_crops[{i}]") for i, n in enumerate(_groups(size_crops, "size_crops", "[224, 96]"))]
        total_num_crops = _whole(total_num_crops, "total_num_crops")
        crop_scales = [
            _scale_pair(sc, i) for i, sc in enumerate(_groups(crop_scales, "crop_scales", "[[0.14, 1], [0.05, 0.14]]"))
        ]
        if not (len(num_crops) == len(size_crops) == len(crop_scales)):
            raise ValueError(
                f"num_crops, size_crops and crop_scales must have the same length, got "
                f"{len(num_crops)}, {len(size_crops)}, {len(crop_scales)}"
            )
        if sum(int(n) for n in num_crops) != int(total_num_crops):
            raise ValueError(f"total_num_crops={total_num_crops} but sum(num_crops)={sum(num_crops)}")
        for sc in crop_scales:
            if len(sc) != 2 or not 0 < sc[0] <= sc[1]:
                raise ValueError(f"each crop_scales entry must be [min, max] with 0 < min <= max, got {sc}")
        self.total_num_crops = int(total_num_crops)
        self.crops: List[Tuple[int, T.RandomResizedCrop]] = [
            (int(n), T.RandomResizedCrop(int(size), scale=(float(sc[0]), float(sc[1]))))
            for n, size, sc in zip(num_crops, size_crops, crop_scales)
        ]

    def __call__(self, img: Image.Image) -> List[Image.Image]:
        out: List[Image.Image] = []
        for n, crop in self.crops:
            out.extend(crop(img) for _ in range(n))
        return out

    def __repr__(self) -> str:
        groups = ", ".join(f"{n}x{c.size}" for n, c in self.crops)
        return f"ImgPilToMultiCrop({groups})"


@TRANSFORMS.register("ImgPilMultiCropRandomApply")
class ImgPilMultiCropRandomApply:
    """Apply ``transforms`` (in order) to view i of the sample with probability ``prob[i]`` (BYOL and
    Barlow Twins: blur always on view 0 and with p 0.1 on view 1, solarize only on view 1, ...).

    Unlike the other transforms it sees the sample's views together (``takes_views``): the list of
    its data entries (those of ``indices``, in order), one probability per entry. Each view draws
    one uniform number from torch's global generator, which the dataset seeds from (seed, epoch,
    sample index), and is transformed when it is below ``prob[i]``; prob 0 never applies, prob 1
    always does.
    """

    takes_views = True

    def __init__(self, transforms: Sequence[Any], prob: Sequence[float]) -> None:
        if not isinstance(transforms, (list, tuple)) or not transforms:
            raise ValueError(f"transforms must be a non-empty list of transforms ({{name: ..., ...}}), got {transforms!r}")
        if not isinstance(prob, (list, tuple)) or not prob or not all(
            isinstance(p, (int, float)) and not isinstance(p, bool) and 0.0 <= p <= 1.0 for p in prob
        ):
            raise ValueError(f"prob must be a list of probabilities in [0, 1], one per view, got {prob!r}")
        built = [build_transform(t, f"transforms[{i}]")[1] if isinstance(t, dict) else t for i, t in enumerate(transforms)]
        self.transform = T.Compose(built)
        self.prob = [float(p) for p in prob]

    def __call__(self, views: Sequence[Any]) -> List[Any]:
        if not isinstance(views, (list, tuple)) or len(views) != len(self.prob):
            count = len(views) if isinstance(views, (list, tuple)) else "one image, not a list of"
            raise ValueError(
                f"prob={self.prob} gives {len(self.prob)} probabilities but the sample has {count} views "
                f"at this point; give one probability per view (list it after ImgReplicatePil / ImgPilToMultiCrop)"
            )
        out = []
        for view, p in zip(views, self.prob):
            apply = torch.rand(()).item() < p
            out.append(self.transform(view) if apply else view)
        return out

    def __repr__(self) -> str:
        return f"ImgPilMultiCropRandomApply({self.transform.transforms!r}, prob={self.prob})"


# ----------------------------------------------------------------------------- building

#: VISSL registers a RandAugment of its own (timm's ops, ``magnitude`` on a 0-10 scale; a later
#: one takes n, m, probabilistic) under torchvision's name; ``RandAugment`` here is torchvision's
#: (``magnitude`` on a 0..30 scale)
_VISSL_RANDAUGMENT = ("VISSL's RandAugment (timm's ops, magnitude on a 0-10 scale, magnitude_std, num_layers, "
                      "increasing_severity, weight_choice; in later VISSL n, m, probabilistic), which ssl_engine does "
                      "not implement")


def _check_randaugment(params: Dict[str, Any], where: str) -> None:
    """A ``RandAugment`` entry of a VISSL config means VISSL's transform, not torchvision's: keys
    only VISSL's takes are an error that says so; an entry that names none of torchvision's own
    keys (``num_ops``, ``num_magnitude_bins``) runs torchvision's, with a warning that its
    ``magnitude`` is on another scale than VISSL's (9 is 90% of VISSL's strongest, 30% of
    torchvision's)."""
    accepted = accepted_params(T.RandAugment)
    foreign = [k for k in params if k not in accepted]
    if foreign:
        raise UserError(
            f"{where}: RandAugment here is torchvision's ({', '.join(accepted)}), which does not take "
            f"{', '.join(foreign)}; a VISSL config's RandAugment is {_VISSL_RANDAUGMENT}: give torchvision's "
            f"parameters, or register your own with @TRANSFORMS.register('RandAugment') in a file listed in "
            f"config.USER_MODULES"
        )
    if any(k in params for k in ("num_ops", "num_magnitude_bins")):
        return
    from ssl_engine import distributed as du

    if du.is_primary():
        logger.warning(
            "%s: RandAugment runs torchvision's: num_ops=2, magnitude %s of num_magnitude_bins=31 (0-30); a VISSL "
            "config's RandAugment is %s, so this augments otherwise than VISSL did; set num_magnitude_bins (or "
            "num_ops) in the entry to say you mean torchvision's", where, params.get("magnitude", 9), _VISSL_RANDAUGMENT,
        )



def _interpolation(value: Any, where: str) -> Any:
    """An ``interpolation`` option as torchvision takes it: a mode's name (``bicubic``) or, as
    VISSL's configs write it (``interpolation: 3``), one of Pillow's integer filter codes,
    which torchvision maps to the mode of the same name. A name or code that is neither is one
    line naming the entry and the valid values (torchvision raises a bare KeyError for a code)."""
    valid = ", ".join(m.name.lower() for m in T.InterpolationMode)
    modes = {m.name for m in T.InterpolationMode}
    codes = ", ".join(f"{int(f)} ({f.name.lower()})" for f in sorted(Image.Resampling) if f.name in modes)
    if isinstance(value, str):
        try:
            return T.InterpolationMode[value.upper()]
        except KeyError:
            raise UserError(f"{where}: unknown interpolation {value!r}; valid: {valid}") from None
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return T.InterpolationMode[Image.Resampling(value).name]
        except (ValueError, KeyError):
            raise UserError(f"{where}: unknown interpolation {value!r}; valid: {valid}, or Pillow's codes "
                            f"{codes}") from None
    return value


def _convert_param(key: str, value: Any, where: str) -> Any:
    """Yaml-friendly parameter values: interpolation names and codes, nested transform lists."""
    if key == "interpolation":
        return _interpolation(value, where)
    if key == "transforms" and isinstance(value, (list, tuple)) and all(isinstance(v, dict) for v in value):
        return [build_transform(v, f"{where}.transforms[{i}]")[1] for i, v in enumerate(value)]
    return value


def build_transform(spec: Dict[str, Any], where: str = "transform") -> Tuple[str, Any, Optional[List[int]]]:
    """``(name, transform, indices)`` from one yaml entry ``{"name": ..., "indices": [...], **params}``.

    ``where`` names the config entry in error messages (e.g. ``config.DATA.TRAIN.TRANSFORMS[2]``).
    ``indices`` is None when the entry applies to every data entry: without the key, or with an
    empty list (VISSL's default for the key, which it reads as every entry).
    """
    if not isinstance(spec, dict) or "name" not in spec:
        raise UserError(f"{where} must be a mapping with a 'name' key (e.g. {{name: ToTensor}}), got {spec!r}")
    params = {k: v for k, v in dict(spec).items() if k not in ("name", "indices")}
    name = spec["name"]
    if not isinstance(name, str):
        raise UserError(f"{where}.name must be a transform name (a string), got {name!r}")
    try:
        cls = TRANSFORMS.get(name)
    except UserError as exc:  # the registry's message lists the known names
        raise UserError(f"{where}: {exc}") from None
    params = {k: _convert_param(k, v, where) for k, v in params.items()}
    if cls is T.RandAugment:
        _check_randaugment(params, where)
    try:
        transform = cls(**params)
    except (TypeError, ValueError, IndexError, AttributeError) as exc:
        # e.g. a one-value RandomResizedCrop scale; a yaml list where the transform wants a
        # tensor (LinearTransformation's matrix: 'list' object has no attribute 'size')
        accepted = accepted_params(cls)
        raise UserError(f"{where}: bad parameters for transform {name!r} {params!r}: {exc}"
                        + (f"; it accepts: {', '.join(accepted)}" if accepted else "")) from exc
    indices = spec.get("indices")
    if indices is not None:
        if isinstance(indices, int):
            indices = [indices]
        if not isinstance(indices, (list, tuple)) or not all(isinstance(i, int) for i in indices):
            raise UserError(f"{where}.indices must be a list of ints (data entry positions), got {indices!r}")
        indices = list(indices) or None  # an empty list means every entry, as in VISSL
    return name, transform, indices


def _replicate(values: List[Any], counts: List[int]) -> List[Any]:
    out: List[Any] = []
    for v, c in zip(values, counts):
        out.extend([v] * c)
    return out


# Transforms that draw no random numbers; any other (a user's included) is treated as random.
DETERMINISTIC_TRANSFORMS = frozenset({
    "ToTensor", "PILToTensor", "ToPILImage", "Normalize", "Resize", "CenterCrop", "Pad", "Grayscale",
    "ConvertImageDtype", "FiveCrop", "TenCrop",
})


class TransformFailed(UserError):
    """A transform of the list failed on a sample's image. ``parts`` splits the message where the
    caller that knows the sample (the dataset) puts which sample and file it was: a setting that
    works on every image but one (a RandomCrop larger than one tiny image) is otherwise blamed on
    the settings alone, with nothing to find the image by."""

    def __init__(self, message: str, parts: Optional[Tuple[str, str]] = None) -> None:
        super().__init__(message)  # one argument: a loader worker's error is rebuilt from its message
        self.parts = parts

    def of_sample(self, origin: str) -> "TransformFailed":
        """The same error with ``origin`` (e.g. " of TRAIN sample 5 ('/data/x.png')") after the entry."""
        if self.parts is None:
            return self
        return TransformFailed(self.parts[0] + origin + self.parts[1])


def _entry_description(entry: Any) -> str:
    """``Image 1x1 RGB`` for a PIL image (the size a crop failed on), else the entry's type."""
    if isinstance(entry, Image.Image):
        return f"Image {entry.width}x{entry.height} {entry.mode}"
    return type(entry).__name__


class SSLTransformsWrapper:
    """Applies a VISSL-style transform list to a sample dict, entry by entry.

    ``sample["data"]`` is a list (one entry per data source at first). Each transform applies to
    the entries named by its ``indices`` (all by default). A transform that returns a list or
    tuple (``ImgReplicatePil``, ``ImgPilToMultiCrop``, ``FiveCrop``) replaces its entry with that
    many views; ``data_idx``, ``data_valid`` and ``label`` are replicated to stay aligned with the
    views (``label`` when it has one entry per data entry, or a single entry).
    """

    def __init__(self, specs: Sequence[Dict[str, Any]], config_key: str = "config.DATA.<split>.TRANSFORMS") -> None:
        if specs is None:
            specs = []
        if not isinstance(specs, (list, tuple)):
            raise UserError(f"{config_key} must be a list of transforms, got {type(specs).__name__}")
        self.config_key = config_key
        self.transforms: List[Tuple[str, Any, Optional[List[int]]]] = [
            build_transform(spec, f"{config_key}[{i}]") for i, spec in enumerate(specs)
        ]
        # each entry's settings as given, for the error of a transform that fails on an image
        self._settings = [
            " with " + ", ".join(f"{k}={v!r}" for k, v in spec.items() if k not in ("name", "indices"))
            if isinstance(spec, dict) and len(set(spec) - {"name", "indices"}) else ""
            for spec in specs
        ]

    def __len__(self) -> int:
        return len(self.transforms)

    def label_setters(self) -> Tuple[Optional[int], bool]:
        """(the largest label the ``sets_label`` transforms give, or None without one; whether one
        of them relabels every data entry, so that the data set's own labels never reach a batch)."""
        setters = [(t, idx) for _, t, idx in self.transforms if getattr(t, "sets_label", False)]
        if not setters:
            return None, False
        top = max(int(t.num_labels) - 1 for t, _ in setters)
        return top, any(idx is None for _, idx in setters)

    @property
    def draws_randomness(self) -> bool:
        """False when every transform is deterministic: the dataset then skips per-sample seeding."""
        return any(name not in DETERMINISTIC_TRANSFORMS for name, _, _ in self.transforms)

    def __repr__(self) -> str:
        return "SSLTransformsWrapper([" + ", ".join(repr(t) for _, t, _ in self.transforms) + "])"

    def __call__(self, sample: Dict[str, Any]) -> Dict[str, Any]:
        for pos, (name, transform, indices) in enumerate(self.transforms):
            data = sample["data"]
            targets = range(len(data)) if indices is None else indices
            for i in targets:
                if not -len(data) <= i < len(data):
                    raise UserError(
                        f"{self.config_key}[{pos}] ({name}): index {i} in 'indices' is out of range; "
                        f"the sample has {len(data)} data entries at this point"
                    )
            targets = sorted({i % len(data) for i in targets}) if data else []
            outputs: Dict[int, Any] = {}
            if getattr(transform, "takes_views", False):
                try:
                    views = transform([data[i] for i in targets])
                except (TypeError, ValueError, IndexError, RuntimeError) as exc:
                    raise UserError(f"{self.config_key}[{pos}] ({name}): {exc}") from exc  # its errors name the setting
                for i, view in zip(targets, views):
                    data[i] = view
                continue
            for i in targets:
                try:
                    outputs[i] = transform(data[i])
                # values that fail only on an image, e.g. Normalize's mean against the channels
                except (TypeError, ValueError, IndexError, RuntimeError) as exc:
                    parts = (f"{self.config_key}[{pos}] ({name}{self._settings[pos]}) failed on data entry {i} "
                             f"({_entry_description(data[i])})", f": {exc}; check its settings")
                    raise TransformFailed("".join(parts), parts) from exc
            if getattr(transform, "sets_label", False):
                self._set_labels(sample, outputs)
                continue
            if any(isinstance(o, (list, tuple)) for o in outputs.values()):
                new_data: List[Any] = []
                counts: List[int] = []
                for i, entry in enumerate(data):
                    out = outputs.get(i, entry)
                    views = list(out) if i in outputs and isinstance(out, (list, tuple)) else [out]
                    new_data.extend(views)
                    counts.append(len(views))
                for key in ("data_idx", "data_valid"):
                    if key in sample and len(sample[key]) == len(data):
                        sample[key] = _replicate(sample[key], counts)
                labels = sample.get("label")
                if labels is not None:
                    if len(labels) == len(data):
                        sample["label"] = _replicate(labels, counts)
                    elif len(labels) == 1:
                        sample["label"] = list(labels) * len(new_data)
                sample["data"] = new_data
            else:
                for i, out in outputs.items():
                    data[i] = out
        return sample


    @staticmethod
    def _set_labels(sample: Dict[str, Any], outputs: Dict[int, Any]) -> None:
        """Put the images of a ``sets_label`` transform in place and its labels in ``label``,
        one per data entry (entries it did not touch keep theirs, or the sample's only one)."""
        data = sample["data"]
        old = list(sample.get("label") or [])
        labels = [old[i] if len(old) == len(data) else (old[0] if len(old) == 1 else -1) for i in range(len(data))]
        for i, out in outputs.items():
            data[i], labels[i] = out.image, int(out.label)
        sample["label"] = labels


def labelling_transform(specs: Any, every_entry: bool = False) -> Optional[str]:
    """The name of the first transform in a TRANSFORMS list that sets labels (``sets_label``,
    e.g. ImgRotatePil), or None; with ``every_entry`` only one that applies to every data entry
    (no ``indices``), so that the data set's own labels never reach a batch."""
    for spec in specs or []:
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or spec["name"] not in TRANSFORMS:
            continue
        if getattr(TRANSFORMS.get(spec["name"]), "sets_label", False) and not (every_entry and spec.get("indices") not in (None, [])):
            return spec["name"]
    return None


def build_transforms(cfg: Any, split: str) -> SSLTransformsWrapper:
    """The transform pipeline of ``cfg.DATA[split].TRANSFORMS``."""
    specs = cfg.get("DATA", {}).get(split, {}).get("TRANSFORMS", []) or []
    return SSLTransformsWrapper(specs, f"config.DATA.{split}.TRANSFORMS")
