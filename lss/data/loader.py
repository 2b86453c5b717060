"""The datasets of a config's splits (their indexes built ahead in the background for `lss train`),
the synthetic set generated where the config asks for it, batching of NuScenesBEV items and the
loaders that feed training and evaluation (workers, their threads and niceness)."""

from __future__ import annotations

import dataclasses
import functools
import os
import random
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from lss.config import Config
from lss.data.index_cache import build_in_background
from lss.data.nuscenes import DatasetNotFoundError, NuScenesBEV, locate_dataroot
from lss.data.samplers import EpochSampler
from lss.errors import DatasetError

DatasetFn = Callable[[Config, str, bool], Dataset]


# Per-object fields stay lists even when every sample happens to hold the same number of objects.
VARIABLE_LENGTH_FIELDS = frozenset({"det_boxes", "det_labels"})


def collate(items: Sequence[dict]) -> dict:
    """Stack tensor fields of equal shape into a batch; keep strings, VARIABLE_LENGTH_FIELDS and
    tensors of differing shapes as lists with one entry per sample."""
    if not items:
        raise ValueError("collate needs at least one item")
    keys = list(items[0])
    for n, item in enumerate(items[1:], 1):
        if list(item) != keys:
            raise ValueError(
                f"collate: item {n} has fields {sorted(item)}, item 0 has {sorted(keys)}"
            )
    batch = {}
    for key in keys:
        values = [item[key] for item in items]
        if (
            key not in VARIABLE_LENGTH_FIELDS
            and all(isinstance(v, torch.Tensor) for v in values)
            and len({tuple(v.shape) for v in values}) == 1
        ):
            batch[key] = torch.stack(values)
        else:
            batch[key] = values
    return batch


def build_dataset(cfg: Config, split: str, is_train: bool, verbose: bool = True) -> NuScenesBEV:
    """NuScenesBEV of `split`. Evaluation reads no lidar: its depth targets feed only the training
    loss."""
    if not is_train and cfg.data.depth_targets:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, depth_targets=False))
    return NuScenesBEV(
        cfg.data.dataroot,
        version=cfg.data.version,
        split=split,
        config=cfg,
        is_train=is_train,
        verbose=verbose,
    )


def index_splits_in_background(cfg: Config) -> bool:
    """Build the dataset indexes of cfg's train and val splits into the on-disk index cache in a
    child process (lss.data.index_cache.build_in_background), while this one goes on starting up:
    `lss train` calls it before it imports the trainer and builds the model, so a run whose index is
    not cached yet does not wait for nuscenes-devkit's import and the walk over the tables (seconds)
    on its own. The datasets built afterwards wait for the child and load what it wrote; if it
    failed (no dataset yet, a bad table), they build the index themselves and raise the error. No
    child without a dataset at data.dataroot. Returns whether the child started."""
    try:
        locate_dataroot(cfg.data.dataroot, cfg.data.version)
    except (
        DatasetNotFoundError
    ):  # generated (or reported) by the run itself, which then builds the index
        return False

    def build() -> None:
        build_dataset(cfg, cfg.data.train_split, True, verbose=False)
        build_dataset(cfg, cfg.data.val_split, False, verbose=False)

    return build_in_background(build)


def ensure_dataset(config: Config) -> None:
    """Generate the synthetic set into data.dataroot when it holds no dataset and
    make_synthetic_if_missing."""
    data = config.data
    try:
        locate_dataroot(data.dataroot, data.version)
    except DatasetNotFoundError:
        if not data.make_synthetic_if_missing:
            raise
        from lss.data.synthetic import generate
        from lss.data.synthetic.pipeline import STAGING

        syn = data.synthetic
        root = Path(data.dataroot)
        # a staging folder is what a killed generate left: generate removes it
        if root.is_dir() and any(not p.name.startswith(STAGING) for p in root.iterdir()):
            raise DatasetError(
                f"no nuScenes {data.version} at {root}, and the directory holds other files, so no "
                "synthetic set is generated there (data.make_synthetic_if_missing): set "
                "data.dataroot to the nuScenes root or to a new directory"
            ) from None
        print(
            f"no nuScenes {data.version} at {data.dataroot}: generating a synthetic set there "
            f"({syn.scenes} scenes x {syn.samples_per_scene} samples, "
            "data.make_synthetic_if_missing)"
        )
        generate(
            data.dataroot,
            version=data.version,
            scenes=syn.scenes,
            samples_per_scene=syn.samples_per_scene,
            image_size=tuple(syn.image_size),
            seed=syn.seed,
        )


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


def build_eval_loader(
    cfg: Config,
    dataset: Dataset,
    device: torch.device,
    collate_fn: Callable = collate,
    persistent: bool = False,
    rank: int = 0,
    world_size: int = 1,
) -> DataLoader:
    """Every sample of `dataset` once, in order, in eval.batch_size batches (the share of `rank`
    of `world_size` under torchrun). `persistent`: keep the workers between passes (the trainer's
    periodic evaluations; starting and stopping them cost seconds per evaluation)."""
    sampler = EpochSampler(len(dataset), shuffle=False, rank=rank, world_size=world_size, pad=False)
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
    """One BLAS/OpenMP thread and one OpenCV thread in a loader worker (DataLoader already sets
    torch's): the workers are the parallelism, and every worker's numpy or OpenCV starting a pool
    of one thread per core oversubscribes the machine many times over (12 workers x 16 threads on
    16 cores). OpenCV's own pthreads pool is not one threadpoolctl reaches."""
    import cv2
    from threadpoolctl import threadpool_limits

    threadpool_limits(1)
    cv2.setNumThreads(1)
