"""Builders shared by training, evaluation, pictures and the demo: device, seeding and RNG state,
autocast, model, datasets, loaders, optimizer, learning-rate schedule, channels-last layout."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import random
from typing import Callable, ContextManager, Iterator, Optional, Union

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from lss.config import Config, ConfigError
from lss.data import collate
from lss.data.loader import ensure_dataset as generate_if_missing, split_dataset
from lss.engine.distributed import DistInfo, EpochSampler, barrier
from lss.models import LiftSplatShoot

ModelFn = Callable[[Config], nn.Module]
DatasetFn = Callable[[Config, str, bool], Dataset]
AutocastFn = Callable[[], ContextManager]


# -------------------------------------------------------------------------------- device, RNG, amp
def device_type(cfg: Config) -> str:
    """ "cuda" or "cpu", as train.device asks ("auto": CUDA when a GPU is visible)."""
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "train.device='cuda' but no CUDA GPU is visible; use --set train.device=cpu"
        )
    return "cuda" if want == "cuda" or (want == "auto" and torch.cuda.is_available()) else "cpu"


def select_device(cfg: Config, dist_info: Optional[DistInfo] = None) -> torch.device:
    """The device of this process: its torchrun local rank's GPU, the current GPU, or the CPU."""
    if device_type(cfg) == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", dist_info.local_rank if dist_info else torch.cuda.current_device())


def seed_everything(seed: int, deterministic: bool, cudnn_benchmark: bool = True) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault(
            "CUBLAS_WORKSPACE_CONFIG", ":4096:8"
        )  # cuBLAS needs it for deterministic GEMMs
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    else:
        torch.backends.cudnn.benchmark = cudnn_benchmark


def rng_state() -> dict:
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    # RNG states must be CPU byte tensors; a checkpoint's map_location may have moved them
    torch.set_rng_state(state["torch"].cpu())
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


@contextlib.contextmanager
def preserved_rng():
    """Evaluation and pictures inside leave the training RNG stream as it was (the curve does not
    depend on how often they run)."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


def autocast_dtype(cfg: Config, device: torch.device) -> Optional[torch.dtype]:
    """The autocast dtype for the camera/BEV networks, or None (fp32). Autocast applies on CUDA
    only."""
    amp = cfg.train.amp
    if device.type != "cuda" or amp == "none":
        return None
    return torch.bfloat16 if amp == "bf16" else torch.float16


def build_autocast(cfg: Config, device: torch.device) -> AutocastFn:
    """A factory of the forward pass's autocast context (train.amp on CUDA; a no-op context
    otherwise)."""
    dtype = autocast_dtype(cfg, device)
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def to_device(batch: dict, device: torch.device) -> dict:
    return {
        k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()
    }


# ------------------------------------------------------------------------------------- model, data
def build_model(cfg: Config) -> nn.Module:
    return LiftSplatShoot(cfg)


def build_dataset(cfg: Config, split: str, is_train: bool) -> Dataset:
    """NuScenesBEV of `split` (lss.data.loader.split_dataset)."""
    return split_dataset(cfg, split, is_train)


def ensure_dataset(cfg: Config, dist_info: Optional[DistInfo] = None) -> None:
    """Generate the synthetic dataset at data.dataroot when data.make_synthetic_if_missing and it
    is absent (on rank 0 while the other ranks wait)."""
    if dist_info is None or dist_info.is_main:
        generate_if_missing(cfg)
    if dist_info is not None:
        barrier(dist_info)


def loader_workers(cfg: Config) -> int:
    """data.workers, with "auto" resolved on this machine: this rank's share of the usable CPUs
    (torchrun's LOCAL_WORLD_SIZE ranks share the host) less 2 for the training process and the
    pinning thread, at most 12 (enough for the loop to keep up with the captured step,
    docs/training.md), at least 1."""
    if cfg.data.workers != "auto":
        return cfg.data.workers
    cpus = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )
    ranks = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    return max(1, min(12, cpus // ranks - 2))


def build_loader(
    cfg: Config,
    dataset: Dataset,
    sampler: Sampler,
    batch_size: int,
    drop_last: bool,
    device: torch.device,
    seed: int,
    persistent: bool = False,
    collate_fn: Callable = collate,
) -> DataLoader:
    """A loader of `dataset` in `sampler`'s order with data.workers workers. `persistent`: keep
    the worker processes from epoch to epoch (the training loader: starting them again every
    epoch stalls training on small sets, whose epochs last seconds)."""
    workers = loader_workers(cfg)
    # an own generator keeps the loaders from drawing on the global RNG (resume then continues the
    # same stream)
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        collate_fn=collate_fn,
        pin_memory=device.type == "cuda",
        drop_last=drop_last,
        generator=generator,
        persistent_workers=persistent and workers > 0,
        worker_init_fn=functools.partial(_init_worker, cfg.data.worker_niceness)
        if workers
        else None,
    )


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


def build_eval_loader(
    cfg: Config,
    dataset: Dataset,
    device: torch.device,
    dist_info: Optional[DistInfo] = None,
    collate_fn: Callable = collate,
    persistent: bool = False,
) -> DataLoader:
    """Every sample of `dataset` once, in order, in eval.batch_size batches (this rank's share
    under torchrun). `persistent`: keep the workers between passes (the trainer's periodic
    evaluations; starting and stopping them cost seconds per evaluation)."""
    dist_info = dist_info or DistInfo()
    sampler = EpochSampler(
        len(dataset), shuffle=False, rank=dist_info.rank, world_size=dist_info.world_size, pad=False
    )
    return build_loader(
        cfg,
        dataset,
        sampler,
        cfg.eval.batch_size,
        False,
        device,
        cfg.train.seed,
        persistent=persistent,
        collate_fn=collate_fn,
    )


def _init_worker(niceness: int, worker_id: int) -> None:
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)
    limit_native_threads()
    if niceness and hasattr(os, "nice"):
        os.nice(niceness)


def limit_native_threads() -> None:
    """One BLAS/OpenMP thread in a loader worker (DataLoader already sets torch's): the workers
    are the parallelism, and every worker's numpy starting a pool of one thread per core
    oversubscribes the machine many times over (12 workers x 16 spinning BLAS threads on 16
    cores)."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(1)


# ------------------------------------------------------------------------------------ optimization
def build_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    o = cfg.optim
    params = [p for p in model.parameters() if p.requires_grad]
    # on the GPU the fused implementation updates all parameters in a few kernels instead of several
    # per tensor
    fused = bool(params) and all(p.is_cuda for p in params)
    optimizer = torch.optim.Adam if o.name == "adam" else torch.optim.AdamW
    return optimizer(params, lr=o.lr, weight_decay=o.weight_decay, fused=fused or None)


def lr_factor(cfg: Config, step: int) -> float:
    """Multiplier of optim.lr at optimizer step `step`: linear warm-up, then constant, cosine or
    one-cycle decay."""
    o, total = cfg.optim, max(cfg.train.max_steps, 1)
    warmup = o.warmup_steps if o.schedule != "onecycle" or o.warmup_steps else int(0.3 * total)
    if step < warmup:
        start = 1.0 / 25 if o.schedule == "onecycle" else 0.0
        return start + (1.0 - start) * (step + 1) / warmup
    if o.schedule == "constant":
        return 1.0
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    end = 1e-4 if o.schedule == "onecycle" else 0.0
    return end + (1.0 - end) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    cfg: Config, optimizer: torch.optim.Optimizer
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg, s))


def apply_channels_last(model: nn.Module, setting: Union[bool, str]) -> nn.Module:
    """train.channels_last in place: True puts every convolution weight of `model` in
    torch.channels_last memory format (cuDNN then runs those convolutions channels-last),
    "camera" only the camera encoder's (`model.camera`), "bev" everything but the camera encoder
    (BEV encoder and heads), False none. Returns `model`."""
    if setting is False:
        return model
    if setting is True:
        return model.to(memory_format=torch.channels_last)
    camera = getattr(model, "camera", None)
    if not isinstance(camera, nn.Module):
        raise ConfigError(
            f"train.channels_last={setting!r} picks a part of the LSS model but "
            f"{type(model).__name__} has no camera encoder (.camera); use true or false"
        )
    parts = [camera] if setting == "camera" else [m for m in model.children() if m is not camera]
    for part in parts:
        part.to(memory_format=torch.channels_last)
    return model
