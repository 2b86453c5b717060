"""The training and evaluation orders: per-epoch shuffles sharded over ranks (EpochSampler) and
their full batches as one stream across epochs (StreamSampler)."""

from __future__ import annotations

import math
from typing import Iterator

import torch
from torch.utils.data import Sampler


class EpochSampler(Sampler[int]):
    """Per-epoch shuffled indices, sharded over ranks, that can start mid-epoch (for exact
    resume).

    The order is a function of (seed, epoch) only. With `pad` each rank gets ceil(len /
    world_size) indices (the list wraps around, as DistributedSampler does); without it
    (evaluation) every sample is seen exactly once. The first `start` indices of the rank's share
    are skipped."""

    def __init__(
        self,
        length: int,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        pad: bool = True,
    ):
        self.length, self.shuffle, self.seed, self.pad = length, shuffle, seed, pad
        self.rank, self.world_size = rank, world_size
        if pad:
            self.per_rank = math.ceil(length / world_size) if length else 0
        else:
            self.per_rank = len(range(rank, length, world_size))
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        return max(self.per_rank - self.start, 0)

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
            order = torch.randperm(self.length, generator=g).tolist()
        else:
            order = list(range(self.length))
        if self.pad:
            total = self.per_rank * self.world_size
            order = (order * math.ceil(total / max(len(order), 1)))[:total]
        yield from order[self.rank :: self.world_size][self.start :]


class StreamSampler(Sampler[int]):
    """The full batches of EpochSampler's epochs one after another, from (epoch, start): one
    loader pass spans all epochs, so the workers prefetch across epoch boundaries, and every
    batch holds the samples it held when each epoch was a pass of its own (each epoch's last
    partial batch is left out, as drop_last did)."""

    def __init__(self, epochs: EpochSampler, batch_size: int):
        self.epochs, self.batch_size = epochs, batch_size
        self.full = epochs.per_rank // batch_size * batch_size
        self.epoch, self.start = 0, 0

    def set_start(self, epoch: int, start: int) -> None:
        self.epoch, self.start = epoch, start

    def __iter__(self) -> Iterator[int]:
        epoch, start = self.epoch, self.start
        while True:
            self.epochs.set_epoch(epoch)
            yield from list(self.epochs)[start : self.full]
            epoch, start = epoch + 1, 0
