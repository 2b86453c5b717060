"""The per-sample cost of the previous frame's LUT (model.temporal.frames: 2, docs/temporal.md): a
cache miss of Splat.previous_lut (compose the rig with the ego motion, lift the frustum, bin and
sort its points), next to the current frame's LUT, on the nuScenes rig at the default config
(6 cameras, 128 x 352 input, stride 16, 41 depth bins, 200 x 200 grid). Prints one JSON line per
batch size with the median of --repeats builds in milliseconds.

    PYTHONPATH=. python scripts/temporal_lut_cost.py --threads 1   # CPU, batch sizes 1 and 4
    PYTHONPATH=. python scripts/temporal_lut_cost.py --device cuda --batch-sizes 1 4 8
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from benchmarks.train_step import random_batches
from demo_seeds import machine
from lss.config import Config
from lss.geometry import RIG_KEYS, BevGrid
from lss.models.splat import Splat


def ego_motion(batch: int, step: int) -> torch.Tensor:
    """B x 4 x 4: the ego drove about 4 m forward and turned a little, different at every step (so
    that every build misses the cache)."""
    yaw = 0.01 * (step + 1)
    motion = torch.eye(4).repeat(batch, 1, 1)
    motion[:, 0, 0], motion[:, 0, 1] = math.cos(yaw), -math.sin(yaw)
    motion[:, 1, 0], motion[:, 1, 1] = math.sin(yaw), math.cos(yaw)
    motion[:, 0, 3] = -4.0 - 0.001 * step
    return motion


def batch_of(cfg: Config, batch: int, device: torch.device) -> dict:
    """Random images on the nuScenes rig (benchmarks.train_step), the previous frame on the same."""
    inputs = random_batches(cfg, batch, device, variants=1)[0]
    return {**inputs, **{f"prev_{key}": inputs[key] for key in RIG_KEYS}}


def median_ms(build, repeats: int, device: torch.device) -> float:
    times = []
    for step in range(repeats + 2):  # two warm-up builds
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        build(step)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfg = Config()
    grid = BevGrid.from_config(cfg.grid)
    splat = Splat(grid, cfg.data.final_dim, cfg.model.downsample, cfg.grid.dbound).to(device)
    for batch in args.batch_sizes:
        inputs = batch_of(cfg, batch, device)

        def previous(step: int) -> None:
            splat.previous_lut({**inputs, "ego_motion": ego_motion(batch, step).to(device)})

        def current(step: int) -> None:
            splat.lut_cache = type(splat.lut_cache)()  # a miss every time
            splat.lut(inputs)

        before = splat.previous_lut_cache.misses
        previous_ms = median_ms(previous, args.repeats, device)
        assert splat.previous_lut_cache.misses - before == args.repeats + 2
        record = {
            "batch_size": batch,
            "previous_lut_ms": round(previous_ms, 2),
            "current_lut_ms": round(median_ms(current, args.repeats, device), 2),
            "points_per_sample": splat.frustum[..., 0].numel() * len(cfg.data.cameras),
            "device": str(device),
            "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
            **machine(),
        }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
