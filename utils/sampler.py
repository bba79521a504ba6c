"""Which samples each data-parallel rank takes, in which order, from which batch on."""

from __future__ import annotations

import math

import torch
from torch.utils.data import Sampler


class ShardedSampler(Sampler[int]):
    """Each of ``num_shards`` ranks takes every num_shards-th index of one shared order.

    The order is a permutation seeded by (seed, epoch), identical on every rank, when
    ``shuffle``; the natural order otherwise. With ``drop_last`` the order is cut to a
    multiple of num_shards * batch_size so every rank runs the same number of full
    batches; without it, ranks may hold one sample fewer (no padding, so validation
    sees each sample exactly once). ``start_batch`` skips the batches already trained
    in this epoch, for an exact resume from a mid-epoch checkpoint.
    """

    def __init__(self, n_samples: int, num_shards: int = 1, shard_id: int = 0,
                 shuffle: bool = False, seed: int = 0, drop_last: bool = False,
                 batch_size: int = 1) -> None:
        if not 0 <= shard_id < num_shards:
            raise ValueError(f"shard_id {shard_id} not in [0, {num_shards})")
        self.n_samples, self.num_shards, self.shard_id = n_samples, num_shards, shard_id
        self.shuffle, self.seed, self.drop_last, self.batch_size = shuffle, seed, drop_last, batch_size
        self.epoch = 0
        self.start_batch = 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def epoch_order(self) -> list[int]:
        """This rank's indices for the current epoch, before skipping."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
            order = torch.randperm(self.n_samples, generator=g).tolist()
        else:
            order = list(range(self.n_samples))
        if self.drop_last:
            per_step = self.num_shards * self.batch_size
            order = order[: (len(order) // per_step) * per_step]
        return order[self.shard_id :: self.num_shards]

    def __iter__(self):
        return iter(self.epoch_order()[self.start_batch * self.batch_size :])

    def __len__(self) -> int:
        return max(0, len(self.epoch_order()) - self.start_batch * self.batch_size)

    def batches_per_epoch(self) -> int:
        """Batches of this rank in a whole epoch (the last one partial without drop_last)."""
        n = len(self.epoch_order())
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)
