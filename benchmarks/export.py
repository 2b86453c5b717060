"""Inference latency at batch 1 of the exported segmentation network: onnxruntime (CPU; CUDA where its execution
provider is installed) next to PyTorch eager and, on a GPU, the PyTorch forward replayed as one CUDA graph.

Case: the LSS paper's sizes (6 cameras 128 x 352, a 200 x 200 grid, 41 depth bins, 64 context channels), random
weights, the nuScenes rig with the evaluation augmentation baked in (fixed rig, bev_pool in standard ONNX ops);
quick: 6 cameras 32 x 96, a 32 x 32 grid. The PyTorch forward reuses its cached lookup table (the rig is fixed)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from lss.config import Config
from lss.export.graph import RIG_KEYS
from lss.geometry import image_augmentation, load_nuscenes_rig, val_augmentation

NUSCENES_IMAGE = (1600, 900)


def bench_config(quick: bool) -> Config:
    cfg = Config()
    if quick:
        cfg.data.final_dim = (32, 96)
        cfg.grid.xbound = cfg.grid.ybound = (-16.0, 16.0, 1.0)
        cfg.grid.dbound = (4.0, 20.0, 2.0)
        cfg.model.context_channels = 8
    return cfg


def nominal_rig(cfg: Config) -> dict:
    """The nuScenes rig (lss/data/nuscenes_rig.json) with the evaluation augmentation to data.final_dim: N x ..."""
    K, rot, trans = load_nuscenes_rig(cfg.data.cameras)
    post_rot, post_trans = image_augmentation(
        val_augmentation(NUSCENES_IMAGE, cfg.data.final_dim, cfg.data.bot_pct_lim),
        NUSCENES_IMAGE,
        cfg.data.final_dim,
    )
    n = K.shape[0]
    return dict(
        zip(
            RIG_KEYS,
            (K, rot, trans, post_rot.expand(n, 3, 3).clone(), post_trans.expand(n, 3).clone()),
        )
    )


def _onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        return None
    return onnxruntime


def run(ctx) -> list[dict]:
    from lss.export import export_model
    from lss.models import LiftSplatShoot

    cfg = bench_config(ctx.quick)
    torch.manual_seed(0)
    model = LiftSplatShoot(cfg).eval()
    rig = nominal_rig(cfg)
    H, W = cfg.data.final_dim
    n = len(cfg.data.cameras)
    images = torch.randn(1, n, 3, H, W)
    sizes = f"{n}x{H}x{W} -> {cfg.grid.xbound[1] - cfg.grid.xbound[0]:g} m / {cfg.grid.xbound[2]:g} m grid"
    case = f"segmentation b1 {sizes}"
    rows = []
    threads = torch.get_num_threads()
    ort = _onnxruntime()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lss.onnx"
        if ort is not None:
            export_model(model, path, cfg, rig=rig)
        dev_model = model.to(ctx.device)
        batch = {
            "images": images.to(ctx.device),
            **{k: v[None].to(ctx.device) for k, v in rig.items()},
        }
        with torch.no_grad():
            eager = ctx.time(lambda: dev_model(batch), warmup=3, reps=20)
            rows.append(
                {
                    "case": case,
                    "impl": "lss",
                    "ms": eager,
                    "notes": f"PyTorch eager, {ctx.device.type}, {threads} CPU threads",
                }
            )
            if ctx.device.type == "cuda":
                try:
                    graphed = ctx.time_graphed(lambda: dev_model(batch))
                    rows.append(
                        {
                            "case": case,
                            "impl": "lss cuda-graph",
                            "ms": graphed,
                            "notes": "PyTorch forward replayed as one CUDA graph",
                        }
                    )
                except RuntimeError as e:
                    rows.append(
                        {
                            "case": case,
                            "impl": "lss cuda-graph",
                            "ms": None,
                            "notes": f"not capturable: {e}",
                        }
                    )
        if ort is None:
            rows.append(
                {
                    "case": case,
                    "impl": "onnxruntime",
                    "ms": None,
                    "notes": "onnxruntime not installed",
                }
            )
            return rows
        feeds = {"images": images.numpy()}
        providers = ["CPUExecutionProvider"]
        if ctx.device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        for provider in providers:
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads  # the same CPU threads as PyTorch
            session = ort.InferenceSession(str(path), options, providers=[provider])
            ms = _time_host(ctx, lambda: session.run(["segmentation"], feeds))
            rows.append(
                {
                    "case": case,
                    "impl": f"onnxruntime {provider.replace('ExecutionProvider', '')}",
                    "ms": ms,
                    "notes": f"onnxruntime {ort.__version__}, opset 17, fixed rig, {threads} CPU threads",
                }
            )
    return rows


def _time_host(ctx, fn) -> float:
    """onnxruntime returns host arrays (synchronised): wall time on the host, whatever ctx.device is."""
    from benchmarks import BenchContext

    return BenchContext(torch.device("cpu"), quick=ctx.quick).time(fn, warmup=3, reps=20)
