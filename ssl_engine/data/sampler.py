"""A distributed sampler whose order is a pure function of (seed, epoch) and that can start mid-epoch.

It yields ``(epoch, idx)`` tuples rather than bare indices so that dataloader workers, which
persist across phases and hold their own copy of the dataset, know which epoch a sample
belongs to without being told (the dataset seeds augmentation from (seed, epoch, idx)).
Resuming at batch ``k`` slices the permutation: the skipped samples are never loaded.

When the data does not divide evenly among the ranks, the shares are padded by repeating
indices (as torch's DistributedSampler does) so that every rank runs the same number of
steps. Those repeats are yielded as :class:`PaddedIndex` keys, which unpack like any
``(epoch, idx)`` pair; the dataset marks them ``data_valid = 0`` so that meters and the
logged loss count every real sample exactly once, whatever the number of ranks.
"""

import math
from typing import Any, Dict, Iterator, List, Tuple

import torch
from torch.utils.data import Sampler


class PaddedIndex(tuple):
    """An ``(epoch, idx)`` key that repeats a sample only to even out the ranks' shares."""

    __slots__ = ()

    def __new__(cls, epoch: int, idx: int) -> "PaddedIndex":
        return super().__new__(cls, (epoch, idx))

    def __getnewargs__(self) -> Tuple[int, int]:  # pickles to dataloader workers as itself
        return (self[0], self[1])

    def __repr__(self) -> str:
        return f"PaddedIndex{tuple(self)!r}"


def is_padded(key: Any) -> bool:
    """True for a key the sampler added as padding (see :class:`PaddedIndex`)."""
    return isinstance(key, PaddedIndex)


class StatefulDistributedSampler(Sampler):
    """Like torch's DistributedSampler (same permutation, padding and rank striding), plus a start batch.

    - ``set_epoch(e)`` picks the permutation (seeded with ``seed + e``) and resets the start
      batch to 0, so a new epoch starts at its beginning unless ``set_start_iter`` follows.
    - ``set_start_iter(k)`` makes the next iteration begin at batch ``k`` of this rank's share
      (``k * batch_size`` samples skipped).
    - ``__len__`` is the number of samples the next iteration yields.
    - ``pad=False`` (used by feature extraction, which has no per-step collectives) gives
      uneven shares instead of padding: rank r gets samples r, r + R, r + 2R, ... so every
      index appears exactly once across ranks. It has no effect with ``drop_last``.
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
        pad: bool = True,
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
        self.pad = bool(pad)
        self.epoch = 0
        self.start_iter = 0
        if self.drop_last and self.dataset_len % self.num_replicas != 0:
            self.num_samples = math.ceil((self.dataset_len - self.num_replicas) / self.num_replicas)
        else:
            self.num_samples = math.ceil(self.dataset_len / self.num_replicas)
        self.num_samples = max(self.num_samples, 0)
        self.total_size = self.num_samples * self.num_replicas
        if not self.pad and not self.drop_last:
            self.num_samples = len(range(self.rank, self.dataset_len, self.num_replicas))
            self.total_size = self.dataset_len

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
        start = self.start_iter * self.batch_size
        share = self.rank_indices()[start:]
        # Positions of this rank's share at or beyond dataset_len in the padded global order
        # are repeats: global position of share[j] is (start + j) * num_replicas + rank.
        first_pad = max(0, math.ceil((self.dataset_len - self.rank) / self.num_replicas) - start)
        return iter([(epoch, idx) if j < first_pad else PaddedIndex(epoch, idx) for j, idx in enumerate(share)])

    def __len__(self) -> int:
        return max(self.num_samples - self.start_iter * self.batch_size, 0)

    def state_dict(self) -> Dict[str, Any]:
        """Plain ints (loadable with ``torch.load(weights_only=True)``)."""
        return {"epoch": self.epoch, "start_iter": self.start_iter, "seed": self.seed}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore ``epoch`` and ``start_iter`` (the seed comes from the config, not the checkpoint)."""
        self.epoch = int(state["epoch"])
        self.start_iter = int(state.get("start_iter", 0))
