"""Batching and DataLoader construction for NuScenesBEV."""
from __future__ import annotations

from typing import Sequence

import torch
from torch.utils.data import DataLoader, DistributedSampler

from lss.config import Config
from lss.data.nuscenes import DatasetNotFoundError, NuScenesBEV, locate_dataroot


# Per-object fields stay lists even when every sample happens to hold the same number of objects.
VARIABLE_LENGTH_FIELDS = frozenset({"det_boxes", "det_labels"})


def collate(items: Sequence[dict]) -> dict:
    """Stack tensor fields of equal shape into a batch; keep strings, VARIABLE_LENGTH_FIELDS and tensors of
    differing shapes as lists with one entry per sample."""
    if not items:
        raise ValueError("collate needs at least one item")
    keys = list(items[0])
    for n, item in enumerate(items[1:], 1):
        if list(item) != keys:
            raise ValueError(f"collate: item {n} has fields {sorted(item)}, item 0 has {sorted(keys)}")
    batch = {}
    for key in keys:
        values = [item[key] for item in items]
        if (key not in VARIABLE_LENGTH_FIELDS and all(isinstance(v, torch.Tensor) for v in values)
                and len({tuple(v.shape) for v in values}) == 1):
            batch[key] = torch.stack(values)
        else:
            batch[key] = values
    return batch


def ensure_dataset(config: Config) -> None:
    """Generate the synthetic set into data.dataroot when it holds no dataset and make_synthetic_if_missing."""
    data = config.data
    try:
        locate_dataroot(data.dataroot, data.version)
    except DatasetNotFoundError:
        if not data.make_synthetic_if_missing:
            raise
        from lss.data.synthetic import generate

        syn = data.synthetic
        print(f"no nuScenes {data.version} at {data.dataroot}: generating a synthetic set there "
              f"({syn.scenes} scenes x {syn.samples_per_scene} samples, data.make_synthetic_if_missing)")
        generate(data.dataroot, version=data.version, scenes=syn.scenes, samples_per_scene=syn.samples_per_scene,
                 image_size=tuple(syn.image_size), seed=syn.seed)


def build_dataloader(config: Config, split: str, is_train: bool, distributed: bool = False) -> DataLoader:
    """DataLoader over NuScenesBEV(config.data.dataroot, config.data.version, split).

    Batch size per process: config.train.batch_size when training, else config.eval.batch_size. Training
    shuffles and drops the last partial batch; `distributed` shards with a DistributedSampler (call its
    set_epoch through `loader.sampler` each epoch)."""
    ensure_dataset(config)
    dataset = NuScenesBEV(config.data.dataroot, config.data.version, split, config, is_train=is_train)
    batch_size = config.train.batch_size if is_train else config.eval.batch_size
    sampler = DistributedSampler(dataset, shuffle=is_train, drop_last=is_train) if distributed else None
    workers = config.data.workers
    return DataLoader(dataset, batch_size=batch_size, shuffle=is_train and sampler is None, sampler=sampler,
                      num_workers=workers, collate_fn=collate, pin_memory=torch.cuda.is_available(),
                      drop_last=is_train, persistent_workers=workers > 0,
                      prefetch_factor=4 if workers > 0 else None)
