"""Data loading throughput: NuScenesBEV samples per second at the LSS config (6 cameras, 1600 x 900 JPEGs ->
128 x 352, 200 x 200 targets with map classes), single process and through DataLoader workers.

Uses $LSS_BENCH_DATAROOT (a nuScenes dataroot, version $LSS_BENCH_VERSION or v1.0-mini) when set, otherwise
generates a small synthetic set at full image size into a temporary folder. Rows report ms per sample; the
notes give samples/s. The peer "PIL full decode" is the classic image path (full-resolution decode, PIL resize,
crop, flip, rotate) on the same samples."""
from __future__ import annotations

import os
import tempfile
import time

import numpy as np
import torch
from PIL import Image

from lss.config import Config
from lss.data import NuScenesBEV, collate
from lss.data.loader import _worker_init
from lss.data.transforms import sample_augmentation


def _dataset(quick: bool) -> tuple[NuScenesBEV, str]:
    root = os.environ.get("LSS_BENCH_DATAROOT")
    version = os.environ.get("LSS_BENCH_VERSION", "v1.0-mini")
    cfg = Config()
    if root is None:
        from lss.data.synthetic import generate

        root = tempfile.mkdtemp(prefix="lss_bench_data_")
        generate(root, version=version, scenes=2, samples_per_scene=3 if quick else 12, image_size=(1600, 900),
                 seed=0, workers=min(os.cpu_count() or 1, 16))
        source = "synthetic 1600x900"
    else:
        source = f"{version} at {root}"
    split = "train"
    return NuScenesBEV(root, version, split, cfg, is_train=True, verbose=False), source


def _pil_reference_images(ds: NuScenesBEV, index: int, rng: np.random.Generator) -> list[np.ndarray]:
    """The classic per-image path: full decode, then PIL resize / crop / flip / rotate."""
    data = ds.config.data
    out = []
    for path in ds.image_paths[index]:
        img = Image.open(path)
        aug = sample_augmentation(img.size, data.final_dim, data.resize_lim, data.bot_pct_lim, data.rot_lim,
                                  data.rand_flip, True, rng)
        img = img.resize(aug.resize_dims)
        left, top = aug.crop
        img = img.crop((left, top, left + data.final_dim[1], top + data.final_dim[0]))
        if aug.flip:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        out.append(np.asarray(img.rotate(aug.rotate)))
    return out


def _loader_rate(ds: NuScenesBEV, workers: int, batches: int, batch_size: int = 4) -> float:
    """Samples per second through a DataLoader after its workers have started."""
    loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=workers,
                                         collate_fn=collate, worker_init_fn=_worker_init if workers else None,
                                         persistent_workers=False, drop_last=True,
                                         sampler=torch.utils.data.RandomSampler(ds, replacement=True,
                                                                                num_samples=batch_size * (batches + 4)))
    it = iter(loader)
    for _ in range(min(4, batches)):
        next(it)  # worker start-up and first batches
    t0 = time.perf_counter()
    n = 0
    for batch in it:
        n += batch["images"].shape[0]
    return n / (time.perf_counter() - t0)


def run(ctx) -> list[dict]:
    ds, source = _dataset(ctx.quick)
    rows = []
    reps = 3 if ctx.quick else 20
    rng = np.random.default_rng(0)
    idx = iter(np.random.default_rng(1).integers(0, len(ds), 10_000))
    ms = ctx.time(lambda: ds[int(next(idx))], warmup=2, reps=reps)
    rows.append({"case": "sample, 1 process", "impl": "lss", "ms": ms, "floor_ms": None,
                 "notes": f"{1e3 / ms:.1f} samples/s; {source}"})
    t_ours = ctx.time(lambda: ds._load_images(int(next(idx)), np.arange(len(ds.cameras)), rng), warmup=2, reps=reps)
    rows.append({"case": "6 camera images, 1 process", "impl": "lss", "ms": t_ours, "floor_ms": None,
                 "notes": "JPEG DCT-scaled decode + area resize + one warpAffine"})
    t_pil = ctx.time(lambda: _pil_reference_images(ds, int(next(idx)), rng), warmup=2, reps=reps)
    rows.append({"case": "6 camera images, 1 process", "impl": "PIL full decode", "ms": t_pil, "floor_ms": None,
                 "notes": "full-resolution decode, PIL resize/crop/flip/rotate"})
    t_targets = ctx.time(lambda: ds.bev_targets(int(next(idx))), warmup=2, reps=reps)
    rows.append({"case": "BEV targets (4 classes), 1 process", "impl": "lss", "ms": t_targets, "floor_ms": None,
                 "notes": ", ".join(ds.classes)})
    cores = os.cpu_count() or 1
    for workers in sorted({min(4, cores), min(8, cores), cores}) if not ctx.quick else [min(2, cores)]:
        rate = _loader_rate(ds, workers, batches=4 if ctx.quick else 60)
        rows.append({"case": f"DataLoader, {workers} workers, batch 4", "impl": "lss", "ms": 1e3 / rate,
                     "floor_ms": None, "notes": f"{rate:.0f} samples/s on {cores} cores"})
    return rows
