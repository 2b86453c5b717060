"""`lss demo`: generate the synthetic set if missing, train, evaluate and render, in minutes on a
CPU. An application over the engine (train, eval) and the pictures (lss.viz)."""

from __future__ import annotations

import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Optional, Sequence

from lss.config import Config, load_config

# The packaged copy of configs/synthetic_demo.yaml (an installed lss has no configs/ folder); a test
# keeps them equal.
DEMO_CONFIG_YAML = resources.files("lss.engine").joinpath("demo.yaml").read_text()


def demo_config(overrides: Sequence[str] = ()) -> Config:
    """The demo's config (DEMO_CONFIG_YAML) with `overrides` ("section.key=value") applied."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "synthetic_demo.yaml"
        path.write_text(DEMO_CONFIG_YAML)
        return load_config(path, overrides)


def demo(
    config: Optional[str] = None, overrides: Sequence[str] = (), out_dir: str = "runs/demo"
) -> dict:
    """Train on the synthetic set (generated at data.dataroot when missing), evaluate the best
    checkpoint and render pictures into `out_dir`/viz. Returns {"train": ..., "eval": ...,
    "pictures": [...], "seconds": ...}."""
    from lss.engine.eval import evaluate_checkpoint
    from lss.engine.train import train
    from lss.viz import render_batch, render_checkpoint

    start = time.perf_counter()
    cfg = load_config(config, overrides) if config else demo_config(overrides)
    cfg.data.make_synthetic_if_missing = True
    run_dir = Path(out_dir)
    # a demo run replaces the previous demo run in the same directory
    final = train(cfg, out_dir=str(run_dir), render_fn=render_batch, overwrite=True)
    best = run_dir / "checkpoints" / "best.pt"
    ckpt = best if best.is_file() else run_dir / "checkpoints" / "last.pt"
    result = evaluate_checkpoint(cfg, str(ckpt), str(run_dir))
    pictures = render_checkpoint(cfg, str(ckpt), str(run_dir / "viz"))
    seconds = time.perf_counter() - start
    iou = ", ".join(f"{c} {100 * v:.1f}%" for c, v in result["iou"].items())
    print(
        f"demo done in {seconds / 60:.1f} min: val IoU {iou}; run directory {run_dir} (tensorboard "
        f"--logdir {run_dir / 'tensorboard'}), pictures in {run_dir / 'viz'}"
    )
    return {
        "train": final,
        "eval": result,
        "pictures": [str(p) for p in pictures],
        "seconds": seconds,
    }
