"""Process-group setup for `torchrun --nproc_per_node=K -m lss train ...`; a single process needs
none of it."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch.utils.data import Sampler


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str) -> DistInfo:
    """Join the process group that torchrun describes in RANK/WORLD_SIZE/LOCAL_RANK (NCCL on GPU,
    gloo on CPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistInfo()
    info = DistInfo(int(os.environ["RANK"]), world_size, int(os.environ.get("LOCAL_RANK", "0")))
    if device_type == "cuda":
        torch.cuda.set_device(info.local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return info


# what gloo's TCP transport says when the process at the other end of a collective is gone
GLOO_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Timed out waiting")


def lost_peer(error: BaseException, info: DistInfo) -> bool:
    """Whether `error` is a collective operation of a torchrun run that failed (a process of the
    run ended or cannot be reached), as opposed to an error of this process's own."""
    if not info.enabled:
        return False
    return isinstance(error, dist.DistError) or any(s in str(error) for s in GLOO_PEER_LOST)


def lost_peer_message(error: BaseException, info: DistInfo, step: int, checkpoint: str) -> str:
    """The message of ProcessGroupError for `error` (lost_peer), raised at `step` on rank
    `info.rank`; `checkpoint`: what is on disk and how to continue (rank 0 writes checkpoints)."""
    reason = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    where = checkpoint if info.is_main else "rank 0 writes the checkpoints (its message says which)"
    return (
        f"rank {info.rank} of {info.world_size} stops at step {step}: a collective operation "
        f"with the other processes failed ({type(error).__name__}: {reason[:300]}). Most likely "
        "another process of this run has ended or cannot be reached; its own error comes first "
        f"in the log. {where}"
    )


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


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
