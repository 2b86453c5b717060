"""`lss demo`: generate the synthetic set if missing, train, evaluate and render. On a CPU it runs
the demo recipe (configs/synthetic_demo.yaml, minutes on 2 cores); on a CUDA machine the
segmentation recipe (configs/synthetic_segmentation.yaml: the default recipe's segmentation head
alone). An application over the engine (train, eval) and the pictures
(lss.viz)."""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal, Optional, Sequence

from lss.config import Config, load_config
from lss.errors import ConfigError
from lss.geometry import BevGrid


@dataclass(frozen=True)
class DemoRecipe:
    """A config that `lss demo` runs on `device`: `packaged`, its copy inside lss/engine/ (an
    installed lss has no configs/ folder; a test keeps the two equal), `config`, the repository's
    file, and the demo's `overrides` of it."""

    device: Literal["cpu", "cuda"]
    name: str
    packaged: str
    config: str
    overrides: tuple[str, ...] = ()

    def yaml(self) -> str:
        return resources.files("lss.engine").joinpath(self.packaged).read_text()


CPU_RECIPE = DemoRecipe("cpu", "the CPU demo recipe", "demo.yaml", "configs/synthetic_demo.yaml")
# The segmentation recipe on a set of its own: 24 scenes of the trainval names (20 train, 4 val)
# rather than the 10 of v1.0-mini, whose 8 training scenes were too few for its 4,000 steps
# (docs/benchmarks.md#gpu-demo)
CUDA_RECIPE = DemoRecipe(
    "cuda",
    "the segmentation recipe",
    "demo_cuda.yaml",
    "configs/synthetic_segmentation.yaml",
    (
        "data.dataroot=data/synthetic-demo-cuda",
        "data.version=v1.0-trainval",
        "data.synthetic.scenes=24",
        "data.synthetic.samples_per_scene=20",
    ),
)

DEMO_CONFIG_YAML = CPU_RECIPE.yaml()


def choose_recipe(device: str, cuda_available: bool) -> DemoRecipe:
    """The recipe for `device` ("auto": the CUDA recipe where a GPU is visible, else the CPU
    one)."""
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"lss demo: device {device!r} is not one of auto, cpu, cuda")
    if device == "cuda" and not cuda_available:
        raise ConfigError("lss demo --device cuda: no CUDA GPU is visible; use --device cpu")
    return CUDA_RECIPE if device == "cuda" or (device == "auto" and cuda_available) else CPU_RECIPE


def recipe_config(recipe: DemoRecipe, overrides: Sequence[str] = ()) -> Config:
    """`recipe`'s config with its own overrides, then `overrides` ("section.key=value"),
    applied."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / Path(recipe.config).name
        path.write_text(recipe.yaml())
        return load_config(path, [*recipe.overrides, *overrides])


def demo_config(overrides: Sequence[str] = ()) -> Config:
    """The CPU demo recipe (DEMO_CONFIG_YAML) with `overrides` applied."""
    return recipe_config(CPU_RECIPE, overrides)


def describe(cfg: Config) -> str:
    """What a run of `cfg` trains, in one line: cameras, input size, grid, steps."""
    data, t = cfg.data, cfg.train
    grid = BevGrid.from_config(cfg.grid)
    cameras = f"{len(data.cameras)} cameras at {data.final_dim[0]}x{data.final_dim[1]}"
    if data.num_train_cameras is not None and data.num_train_cameras < len(data.cameras):
        cameras += f" ({data.num_train_cameras} per training sample)"
    cell = cfg.grid.xbound[2]
    return (
        f"{cameras}, {grid.nx} x {grid.ny} grid of {cell:g} m cells, {cfg.model.backbone} camera "
        f"trunk, {t.max_steps:,} steps of batch {t.batch_size} on {t.device}"
    )


def demo(
    config: Optional[str] = None,
    overrides: Sequence[str] = (),
    out_dir: str = "runs/demo",
    device: str = "auto",
) -> dict:
    """Train on the synthetic set (generated at data.dataroot when missing), evaluate the best
    checkpoint and render pictures into `out_dir`/viz. Without `config`, the recipe of `device`
    (choose_recipe). Returns {"recipe": ..., "train": ..., "eval": ..., "pictures": [...],
    "seconds": ...}."""
    import torch

    from lss.engine.eval import evaluate_checkpoint
    from lss.engine.train import train
    from lss.viz import render_batch, render_checkpoint

    start = time.perf_counter()
    if config:
        chosen = [f"train.device={device}"] if device != "auto" else []
        cfg, recipe = load_config(config, [*chosen, *overrides]), config
    else:
        picked = choose_recipe(device, torch.cuda.is_available())
        cfg = recipe_config(picked, [f"train.device={picked.device}", *overrides])
        recipe = f"{picked.name} ({picked.config})"
    cfg.data.make_synthetic_if_missing = True
    syn = cfg.data.synthetic
    print(
        f"lss demo: {recipe}: {describe(cfg)}; data in {cfg.data.dataroot} (where missing: "
        f"{syn.scenes} synthetic scenes x {syn.samples_per_scene} samples at "
        f"{syn.image_size[0]}x{syn.image_size[1]})",
        flush=True,
    )
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
        "recipe": recipe,
        "train": final,
        "eval": result,
        "pictures": [str(p) for p in pictures],
        "seconds": seconds,
    }
