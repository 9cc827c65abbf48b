"""Data: sources, the seeded dataset, transforms, collators, the stateful sampler and the loader.

Importing this package registers the built-in data sources (synthetic, digits, disk_folder,
disk_filelist, torchvision_dataset), every torchvision transform plus VISSL's PIL transforms, and the collators
(default_collate / default, simclr_collator).
"""

from ssl_engine.data.collators import build_collator, default_collate, simclr_collator
from ssl_engine.data.dataset import SSLDataset, build_dataset, sample_seed, seeded_rng
from ssl_engine.data.loader import (
    build_dataloader,
    get_loader_state,
    set_loader_position,
    set_loader_state,
    worker_init_fn,
)
from ssl_engine.data.sampler import StatefulDistributedSampler
from ssl_engine.data.sources import (
    DigitsSource,
    DiskFilelistSource,
    DiskFolderSource,
    SyntheticSource,
    UnreadableImageError,
)
from ssl_engine.data.torchvision_dataset import TorchvisionDatasetSource
from ssl_engine.data.transforms import SSLTransformsWrapper, build_transform, build_transforms

__all__ = [
    "SSLDataset",
    "SSLTransformsWrapper",
    "StatefulDistributedSampler",
    "UnreadableImageError",
    "DigitsSource",
    "DiskFilelistSource",
    "DiskFolderSource",
    "SyntheticSource",
    "TorchvisionDatasetSource",
    "build_collator",
    "build_dataloader",
    "build_dataset",
    "build_transform",
    "build_transforms",
    "default_collate",
    "get_loader_state",
    "sample_seed",
    "seeded_rng",
    "set_loader_position",
    "set_loader_state",
    "simclr_collator",
    "worker_init_fn",
]
