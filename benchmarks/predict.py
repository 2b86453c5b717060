"""`lss predict`: samples/s through a nuScenes-format scene (the data reading, the model and the .npz files; the
pictures in a second row), and the model's latency at batch 1, PyTorch (on a GPU: bf16 replayed as one CUDA graph, and
eager beside it) next to onnxruntime running the export with rig inputs.

Case: the default recipe with random weights on a synthetic scene of nuScenes-size images (1600 x 900, 40 samples)
generated into a temporary folder, or the set at LSS_BENCH_DATAROOT (version LSS_BENCH_VERSION, default v1.0-mini;
the first scene of its val split); quick: the 32 x 96
model, 400 x 225 images, 3 samples. Each scene row is the second of two passes (the first starts the loader and
captures the graph; quick: one pass). Opt-in: `lss bench --suite predict`."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

import torch

from lss.config import Config, load_config

QUICK = ["data.final_dim=[32, 96]", "grid.xbound=[-16.0, 16.0, 1.0]", "grid.ybound=[-16.0, 16.0, 1.0]",
         "grid.dbound=[4.0, 20.0, 2.0]", "model.context_channels=8", "data.workers=0"]


def _onnxruntime_installed() -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def _backends(device: torch.device) -> list[tuple[str, str, dict]]:
    """(impl name, notes, Predictor options) of every path timed on `device`."""
    if device.type == "cuda":
        torch_paths = [("lss", "PyTorch bf16, CUDA graph", {}),
                       ("lss eager", "PyTorch bf16, eager", {"cuda_graph": False})]
    else:
        torch_paths = [("lss", f"PyTorch fp32, {torch.get_num_threads()} CPU threads", {})]
    if _onnxruntime_installed():
        torch_paths.append(("onnxruntime", "the export with rig inputs", {"backend": "onnxruntime"}))
    return torch_paths


def measure(ctx, cfg: Config, checkpoint: Path, scene: str) -> list[dict]:
    """The rows of checkpoint `checkpoint` (trained with `cfg`) on scene `scene` of cfg.data.dataroot."""
    from lss.data import collate
    from lss.data.camera_inputs import scene_samples
    from lss.engine.predictor import Predictor, write_predictions
    from lss.viz.render import render_sample

    from benchmarks import BenchContext

    dataset = scene_samples(cfg, scene)
    one = collate([dataset[0]])
    size = tuple(int(v) for v in dataset.dataset.image_sizes[dataset.indices[0], 0])
    where = f"{scene} ({len(dataset)} samples, {size[0]}x{size[1]} images, batch {cfg.eval.batch_size})"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for impl, notes, options in _backends(ctx.device):
            predictor = Predictor(checkpoint, ctx.device, config=cfg, **options)
            for pictures in (False, True) if impl == "lss" else (False,):
                render = None
                if pictures:
                    def render(item, p, predictor=predictor):
                        return render_sample(item, p.probabilities, predictor.cfg, "", p.detections).image
                for _ in range(1 if ctx.quick else 2):
                    done = write_predictions(predictor, dataset, Path(tmp) / impl, render_fn=render, progress=False)
                what = ".npz and .png" if pictures else ".npz"
                rows.append({"case": f"scene {where}, {what}", "impl": impl, "ms": 1e3 / done["samples_per_s"],
                             "notes": f"{done['samples_per_s']:.2f} samples/s, ms per sample; {notes}"})
            # onnxruntime returns host arrays: timed on the host whatever the device
            timer = BenchContext(torch.device("cpu"), quick=ctx.quick) if impl == "onnxruntime" else ctx
            ms = timer.time(lambda predictor=predictor: predictor.predict_batch(one), warmup=3, reps=20)
            rows.append({"case": "batch-1 latency, the model's input ready", "impl": impl, "ms": ms,
                         "notes": notes + "; probabilities back on the host"})
    return rows


def run(ctx) -> list[dict]:
    from lss.data.loader import build_dataset
    from lss.data.synthetic import generate
    from lss.data.tables import load_tables
    from lss.engine.checkpoint import save_checkpoint
    from lss.models.build import build_model

    with tempfile.TemporaryDirectory() as tmp:
        root = os.environ.get("LSS_BENCH_DATAROOT")
        if root is None:
            root = Path(tmp) / "synthetic"
            size, samples = ((400, 225), 3) if ctx.quick else ((1600, 900), 40)
            generate(root, scenes=2, samples_per_scene=samples, image_size=size, seed=0)
        version = os.environ.get("LSS_BENCH_VERSION", "v1.0-mini")
        cfg = load_config(None, (QUICK if ctx.quick else []) + [f"data.version={version}"])
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dataroot=str(root)))
        val = build_dataset(cfg, cfg.data.val_split, False, verbose=False)
        nusc = load_tables(val.root, val.version)
        scene = nusc.get("scene", nusc.get("sample", val.sample_tokens[0])["scene_token"])["name"]
        torch.manual_seed(0)
        checkpoint = Path(tmp) / "random.pt"
        save_checkpoint(checkpoint, build_model(cfg).eval(), step=0, config=cfg)
        return measure(ctx, cfg, checkpoint, scene)
