"""``MODEL.INPUT_TYPE``: how a trunk reads the batches the transforms give, with VISSL's meaning.

- ``rgb``: as is (3 channels).
- ``bgr``: the channels reversed, for weights trained on BGR input (the Caffe2-era models of
  VISSL's model zoo); the transforms still give RGB.
- ``lab``: the first (L) channel of a 3-channel LAB batch (VISSL's colorization trunks); a batch
  of one channel is taken as that channel already.
- ``gray``: one channel, as is.

The trunk's stem is built for :func:`stem_channels` channels and its forward passes every batch
through :func:`to_model_input`, as VISSL's trunks do, so training, testing and feature
extraction read the input the same way.
"""

from typing import Any, Dict, Tuple

import torch

from ssl_engine.errors import UserError

KEY = "config.MODEL.INPUT_TYPE"
STEM_CHANNELS: Dict[str, int] = {"rgb": 3, "bgr": 3, "gray": 1, "lab": 1}
BATCH_CHANNELS: Dict[str, Tuple[int, ...]] = {"rgb": (3,), "bgr": (3,), "gray": (1,), "lab": (3, 1)}


def input_type(model_config: Any) -> str:
    """``MODEL.INPUT_TYPE`` of ``model_config`` (default 'rgb'), checked."""
    value = str(model_config.get("INPUT_TYPE", "rgb")).lower()
    if value not in STEM_CHANNELS:
        raise UserError(f"{KEY}={model_config.get('INPUT_TYPE')!r} is not supported; valid: "
                        f"{', '.join(repr(k) for k in STEM_CHANNELS)}")
    return value


def stem_channels(kind: str) -> int:
    """Channels the trunk's first layer takes for input type ``kind``."""
    return STEM_CHANNELS[kind]


def to_model_input(x: torch.Tensor, kind: str, trunk: str) -> torch.Tensor:
    """The batch ``x`` ([N, C, H, W]) as the trunk reads it for input type ``kind``; a UserError
    naming the key and the fix when ``x`` has channels that type cannot read."""
    if x.dim() != 4 or x.shape[1] not in BATCH_CHANNELS[kind]:
        raise UserError(_channels_problem(x, kind, trunk))
    if kind == "bgr":
        return x.flip(1)
    if kind == "lab" and x.shape[1] == 3:
        return x[:, :1]
    return x


def _channels_problem(x: torch.Tensor, kind: str, trunk: str) -> str:
    wanted = " or ".join(str(c) for c in BATCH_CHANNELS[kind])
    said = f"the {trunk} trunk with {KEY}={kind} takes images [N, {wanted}, H, W], got a batch of shape {list(x.shape)}"
    channels = int(x.shape[1]) if x.dim() == 4 else None
    if channels == 1 and kind in ("rgb", "bgr"):
        return f"{said}; set {KEY}=gray for one-channel images, or give the images 3 channels"
    if channels == 3 and kind == "gray":
        return f"{said}; set {KEY}=rgb for colour images, or make them one channel (Grayscale with num_output_channels=1)"
    if x.dim() != 4:
        return f"{said}; the transforms must end with a tensor per image of [C, H, W] (e.g. ToTensor)"
    return f"{said}; give images with {wanted} channels"
