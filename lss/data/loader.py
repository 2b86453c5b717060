"""Batching of NuScenesBEV items, the datasets of a config's splits (their indexes built ahead in
the background for `lss train`), and the synthetic set generated where the config asks for it (the
loaders themselves: lss.engine.build)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import torch

from lss.config import Config
from lss.data.index_cache import build_in_background
from lss.data.nuscenes import DatasetNotFoundError, NuScenesBEV, locate_dataroot
from lss.errors import DatasetError


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


def split_dataset(cfg: Config, split: str, is_train: bool, verbose: bool = True) -> NuScenesBEV:
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
        split_dataset(cfg, cfg.data.train_split, True, verbose=False)
        split_dataset(cfg, cfg.data.val_split, False, verbose=False)

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
