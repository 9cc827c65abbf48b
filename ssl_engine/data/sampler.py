"""A distributed sampler whose order is a pure function of (seed, epoch) and that can start mid-epoch.

It yields ``(epoch, idx)`` tuples rather than bare indices so that dataloader workers, which
persist across phases and hold their own copy of the dataset, know which epoch a sample
belongs to without being told (the dataset seeds augmentation from (seed, epoch, idx)).
Resuming at batch ``k`` slices the permutation: the skipped samples are never loaded.
"""

import math
from typing import Any, Dict, Iterator, List, Tuple

import torch
from torch.utils.data import Sampler


class StatefulDistributedSampler(Sampler):
    """Like torch's DistributedSampler (same permutation, padding and rank striding), plus a start batch.

    - ``set_epoch(e)`` picks the permutation (seeded with ``seed + e``) and resets the start
      batch to 0, so a new epoch starts at its beginning unless ``set_start_iter`` follows.
    - ``set_start_iter(k)`` makes the next iteration begin at batch ``k`` of this rank's share
      (``k * batch_size`` samples skipped).
    - ``__len__`` is the number of samples the next iteration yields.
    """

    def __init__(
        self,
        dataset_len: int,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        batch_size: int = 1,
    ) -> None:
        if dataset_len < 0:
            raise ValueError(f"dataset_len must be >= 0, got {dataset_len}")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"invalid rank {rank} for num_replicas {num_replicas}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset_len = int(dataset_len)
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.batch_size = int(batch_size)
        self.epoch = 0
        self.start_iter = 0
        if self.drop_last and self.dataset_len % self.num_replicas != 0:
            self.num_samples = math.ceil((self.dataset_len - self.num_replicas) / self.num_replicas)
        else:
            self.num_samples = math.ceil(self.dataset_len / self.num_replicas)
        self.num_samples = max(self.num_samples, 0)
        self.total_size = self.num_samples * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch`` and start from its first batch."""
        self.epoch = int(epoch)
        self.start_iter = 0

    def set_start_iter(self, start_iter: int) -> None:
        """Begin the next iteration at batch ``start_iter`` of this rank's share of the epoch."""
        if start_iter < 0:
            raise ValueError(f"start_iter must be >= 0, got {start_iter}")
        self.start_iter = int(start_iter)

    def rank_indices(self) -> List[int]:
        """This rank's full share of the current epoch (before skipping ``start_iter`` batches)."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(self.dataset_len, generator=g).tolist()
        else:
            indices = list(range(self.dataset_len))
        if not self.drop_last:
            padding = self.total_size - len(indices)
            if padding > 0 and indices:
                indices += (indices * math.ceil(padding / len(indices)))[:padding]
        else:
            indices = indices[: self.total_size]
        return indices[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[Tuple[int, int]]:
        epoch = self.epoch
        share = self.rank_indices()[self.start_iter * self.batch_size :]
        return iter([(epoch, idx) for idx in share])

    def __len__(self) -> int:
        return max(self.num_samples - self.start_iter * self.batch_size, 0)

    def state_dict(self) -> Dict[str, Any]:
        """Plain ints (loadable with ``torch.load(weights_only=True)``)."""
        return {"epoch": self.epoch, "start_iter": self.start_iter, "seed": self.seed}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore ``epoch`` and ``start_iter`` (the seed comes from the config, not the checkpoint)."""
        self.epoch = int(state["epoch"])
        self.start_iter = int(state.get("start_iter", 0))
