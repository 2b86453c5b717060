"""Synthetic datasets in the exact nuScenes on-disk format (tables, camera images, lidar sweeps,
maps), on which an LSS model can learn: `generate(out_dir, ...)`, also `lss make-synthetic
OUT_DIR`."""

from .pipeline import generate, scene_names

__all__ = ["generate", "scene_names"]
