"""`lss demo`: generate the synthetic set if missing, train, evaluate and render, in minutes on a CPU."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from lss.config import Config, load_config

# The packaged copy of configs/synthetic_demo.yaml (an installed lss has no configs/ folder); a test keeps them equal.
DEMO_CONFIG_YAML = """\
# The `lss demo` settings (embedded in lss/engine/demo.py; tests keep the two identical).
# Small enough for 2 CPU cores: 704x396 synthetic images, 64x192 network input, a 48x48 grid of 1 m cells.
data:
  dataroot: data/synthetic-demo
  version: v1.0-mini
  make_synthetic_if_missing: true
  synthetic:
    scenes: 8
    samples_per_scene: 15
    image_size: [704, 396]
    seed: 0
  final_dim: [64, 192]
  resize_lim: [0.273, 0.31]
  bot_pct_lim: [0.0, 0.1]
  rot_lim: [-3.0, 3.0]
  rand_flip: true
  num_train_cameras: 5  # random cameras per training sample, as LSS (4: BatchNorm statistics far from 6-camera eval)
  classes: [vehicle, drivable_area]
  depth_targets: true  # lidar depth bins per camera feature cell, for loss.depth_weight
  decoded_cache: true  # camera images kept decoded on disk after epoch 1 (about 1.6 MB per sample; docs/data.md)
  workers: 1
grid:
  xbound: [-24.0, 24.0, 1.0]
  ybound: [-24.0, 24.0, 1.0]
  zbound: [-10.0, 10.0, 20.0]
  dbound: [4.0, 36.0, 1.0]
loss:
  type: bce
  pos_weight: 5.0  # rare vehicle cells: pushes their probabilities past the 0.5 threshold sooner
  depth_weight: 1.0  # lidar depth supervision of the camera depth distribution (docs/training.md)
optim:
  name: adamw
  lr: 0.003
  weight_decay: 0.0001
  schedule: onecycle
train:
  batch_size: 2
  max_steps: 400  # val IoU vehicle 10.8 %, drivable_area 58.0 %; the demo 4.2-4.4 min on 2 cores (docs/training.md)
  device: auto
  out_dir: runs/demo
  log_every: 10
  eval_every: 200  # each evaluation, picture and checkpoint costs seconds on a CPU
  ckpt_every: 200
  viz_every: 200
eval:
  batch_size: 4
viz:
  num: 6
  gif: true
"""


def demo_config(overrides: Sequence[str] = ()) -> Config:
    """The demo's config (DEMO_CONFIG_YAML) with `overrides` ("section.key=value") applied."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "synthetic_demo.yaml"
        path.write_text(DEMO_CONFIG_YAML)
        return load_config(path, overrides)


def demo(
    config: Optional[str] = None, overrides: Sequence[str] = (), out_dir: str = "runs/demo"
) -> dict:
    """Train on the synthetic set (generated at data.dataroot when missing), evaluate the best checkpoint and render
    pictures into `out_dir`/viz. Returns {"train": ..., "eval": ..., "pictures": [...], "seconds": ...}."""
    from lss.engine.eval import evaluate_checkpoint
    from lss.engine.train import train
    from lss.viz import bev_grid_image, render_checkpoint

    start = time.perf_counter()
    cfg = load_config(config, overrides) if config else demo_config(overrides)
    cfg.data.make_synthetic_if_missing = True
    run_dir = Path(out_dir)
    # a demo run replaces the previous demo run in the same directory
    final = train(cfg, out_dir=str(run_dir), render_fn=bev_grid_image, overwrite=True)
    ckpt = (
        run_dir
        / "checkpoints"
        / ("best.pt" if (run_dir / "checkpoints" / "best.pt").is_file() else "last.pt")
    )
    result = evaluate_checkpoint(cfg, str(ckpt), str(run_dir))
    pictures = render_checkpoint(cfg, str(ckpt), str(run_dir / "viz"))
    seconds = time.perf_counter() - start
    iou = ", ".join(f"{c} {100 * v:.1f}%" for c, v in result["iou"].items())
    print(
        f"demo done in {seconds / 60:.1f} min: val IoU {iou}; run directory {run_dir} (tensorboard --logdir "
        f"{run_dir / 'tensorboard'}), pictures in {run_dir / 'viz'}"
    )
    return {
        "train": final,
        "eval": result,
        "pictures": [str(p) for p in pictures],
        "seconds": seconds,
    }
