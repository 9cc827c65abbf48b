"""Losses, found by name through the LOSSES registry (``config.LOSS.name``).

Every loss is a classy_vision ``ClassyLoss`` with ``from_config(config.LOSS[name])`` and
``forward(output, target)``, where ``output`` is the model's list of head outputs (or a
tensor). Loss state (buffers) goes through ``get_classy_state`` / ``set_classy_state``.
"""

from classy_vision.losses import ClassyLoss

from ssl_engine.config.attr_dict import AttrDict

# Importing the loss modules registers their losses.
from ssl_engine.losses.barlow_twins_loss import BarlowTwinsLoss
from ssl_engine.losses.cross_entropy import CrossEntropyLoss, CrossEntropyMultipleOutputSingleTargetLoss
from ssl_engine.losses.moco_loss import MoCoLoss
from ssl_engine.losses.multicrop_simclr_info_nce import MultiCropSimclrInfoNCELoss
from ssl_engine.losses.simclr_info_nce import SimclrInfoNCELoss
from ssl_engine.losses.swav_loss import SwAVLoss, sinkhorn_knopp
from ssl_engine.registry import LOSSES, build_from_config


def build_loss(loss_cfg: AttrDict) -> ClassyLoss:
    """The loss named by ``config.LOSS.name``, built from ``config.LOSS[name]``.

    An unknown name is a UserError listing the registered losses.
    """
    name = loss_cfg.get("name", "CrossEntropyLoss")
    loss_cls = LOSSES.get(name)
    sub = loss_cfg.get(name) or {}
    options = sub if isinstance(sub, AttrDict) else AttrDict(sub)
    return build_from_config("loss", name, f"config.LOSS.{name}", loss_cls, options)


__all__ = [
    "BarlowTwinsLoss",
    "build_loss",
    "ClassyLoss",
    "CrossEntropyLoss",
    "CrossEntropyMultipleOutputSingleTargetLoss",
    "MoCoLoss",
    "MultiCropSimclrInfoNCELoss",
    "SimclrInfoNCELoss",
    "SwAVLoss",
    "sinkhorn_knopp",
]
