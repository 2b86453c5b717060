"""The training and evaluation orders: per-epoch shuffles sharded over ranks (EpochSampler) and
their full batches as one stream across epochs (StreamSampler); the class-balanced pool an epoch
draws from (class_balanced_pool, CBGS)."""

from __future__ import annotations

import math
from typing import Iterator, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler

from lss.errors import ConfigError


class EpochSampler(Sampler[int]):
    """Per-epoch shuffled indices, sharded over ranks, that can start mid-epoch (for exact
    resume).

    The order is a function of (seed, epoch) only. With `pad` each rank gets ceil(len /
    world_size) indices (the list wraps around, as DistributedSampler does); without it
    (evaluation) every sample is seen exactly once. The first `start` indices of the rank's share
    are skipped. With `pool` (dataset indices, repeats allowed: class_balanced_pool) an epoch is
    a shuffle of the pool instead of range(length); `length` must be len(pool)."""

    def __init__(
        self,
        length: int,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        pad: bool = True,
        pool: Optional[Sequence[int]] = None,
    ):
        if pool is not None and len(pool) != length:
            raise ValueError(f"EpochSampler: the pool has {len(pool)} indices, length is {length}")
        self.pool = None if pool is None else list(pool)
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
        if self.pool is not None:
            order = [self.pool[i] for i in order]
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


def class_balanced_pool(sample_classes: Sequence[Sequence[int]], seed: int = 0) -> list[int]:
    """Class-balanced grouping and sampling (CBGS, Zhu et al. 2019, as CenterPoint and BEVDet
    train on nuScenes): the indices of the samples holding each class, drawn with replacement so
    that every class present fills an equal share of the pool (each class's draws: the total
    number of (sample, class) pairs over the number of classes present), followed by each sample
    that holds no class, once. Samples with rare classes come back many times an epoch, those
    with common ones fewer; the draw is a function of `seed` only (the same on every rank)."""
    holders: dict[int, list[int]] = {}
    empty = []
    for index, classes in enumerate(sample_classes):
        present = sorted(set(int(c) for c in classes))
        for c in present:
            holders.setdefault(c, []).append(index)
        if not present:
            empty.append(index)
    pairs = sum(len(v) for v in holders.values())
    rng = np.random.default_rng(seed)
    pool = []
    for c in sorted(holders):
        pool += rng.choice(holders[c], pairs // len(holders), replace=True).tolist()
    return pool + empty


def class_balanced_training_pool(dataset, seed: int) -> list[int]:
    """class_balanced_pool over a training set's samples, their classes from
    `dataset.detection_classes(index)` (lss.data.NuScenesBEV)."""
    classes = getattr(dataset, "detection_classes", None)
    if classes is None:
        raise ConfigError(
            f"data.class_balanced needs a dataset that lists each sample's detection classes "
            f"(detection_classes(index), as lss.data.NuScenesBEV); {type(dataset).__name__} does "
            "not: set data.class_balanced: false"
        )
    return class_balanced_pool([classes(i) for i in range(len(dataset))], seed)
