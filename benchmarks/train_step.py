"""Train step and inference of the whole LSS model at the paper's configuration (B4, 6 cameras at 128x352, D41,
200x200 grid): ours (bev_pool op, bf16 autocast, channels_last) vs the pure-PyTorch splat in fp32.

Random images with the real nuScenes rig (lss/data/nuscenes_rig.json); a slightly different augmentation every
step, so the frustum LUT is rebuilt as in training. Peak memory (torch.cuda.max_memory_allocated) goes in notes."""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace

import torch

from lss.config import Config, load_config
from lss.engine.optim import build_optimizer
from lss.models.build import apply_channels_last
from lss.engine.step import compile_encoders
from lss.geometry import image_augmentation, load_nuscenes_rig, val_augmentation

LSS_CONFIG = ["data.classes=[vehicle]", "loss.type=bce"]  # the defaults are the paper's sizes
QUICK_CONFIG = LSS_CONFIG + [
    "data.final_dim=[32, 96]",
    "grid.xbound=[-8.0, 8.0, 1.0]",
    "grid.ybound=[-8.0, 8.0, 1.0]",
    "grid.dbound=[4.0, 12.0, 2.0]",
]
IMPLS = {  # name -> (model.splat, autocast dtype on CUDA, channels_last, torch.compile mode of the encoders or None)
    "lss_cuda_graph": (
        "bev_pool",
        torch.bfloat16,
        True,
        None,
    ),  # the whole step as one CUDA graph (train.cuda_graph)
    "lss_cuda_graph_compiled": (
        "bev_pool",
        torch.bfloat16,
        True,
        "default",
    ),  # ... with train.compile: true
    "lss_cuda_graph_compiled_budget": (
        "bev_pool",
        torch.bfloat16,
        True,
        "default",
    ),  # ... and a memory budget
    "lss": ("bev_pool", torch.bfloat16, True, None),
    "lss_compiled": ("bev_pool", torch.bfloat16, True, "default"),
    "lss_cudagraphs": ("bev_pool", torch.bfloat16, True, "reduce-overhead"),
    "lss_fp32": ("bev_pool", None, False, None),
    "reference_splat_fp32": ("reference", None, False, None),
}
AUG_VARIANTS = 4
MEMORY_BUDGET = 0.5  # train.compile_memory_budget of the *_budget rows


def random_batches(
    cfg: Config, batch_size: int, device: torch.device, variants: int = AUG_VARIANTS
) -> list[dict]:
    """`variants` batches of random images on the real rig, each with its own small crop jitter (a new LUT); with the
    detection head (model.heads) also the dense detection targets of random boxes, as the training dataset yields
    them."""
    g = torch.Generator().manual_seed(0)
    h, w = cfg.data.final_dim
    K, rot, trans = load_nuscenes_rig(cfg.data.cameras)
    n = K.shape[0]
    aug = val_augmentation((1600, 900), (h, w), cfg.data.bot_pct_lim)
    x0, y0 = aug.crop
    images = torch.randn(batch_size, n, 3, h, w, generator=g).to(device)
    targets = (
        torch.rand(batch_size, len(cfg.data.classes), *_grid_shape(cfg), generator=g) > 0.9
    ).float()
    batches = []
    for v in range(variants):
        post_rot, post_trans = image_augmentation(
            replace(aug, crop=(x0 + v, y0 + v)), (1600, 900), (h, w)
        )
        rig = {
            "intrinsics": K,
            "sensor2ego_rot": rot,
            "sensor2ego_trans": trans,
            "post_rot": post_rot.expand(n, 3, 3),
            "post_trans": post_trans.expand(n, 3),
        }
        batch = {
            k: t.unsqueeze(0).expand(batch_size, *t.shape).contiguous().to(device)
            for k, t in rig.items()
        }
        batch.update(images=images, targets=targets.to(device))
        if "detection" in cfg.model.heads:
            batch.update({k: v.to(device) for k, v in detection_targets(cfg, batch_size, g).items()})
        batches.append(batch)
    return batches


def detection_targets(cfg: Config, batch_size: int, generator: torch.Generator, per_sample: int = 24) -> dict:
    """The dense detection targets (lss.geometry.boxes.dense_targets, collated) of `per_sample` random boxes in each
    sample: centres on a jittered lattice inside the grid (so the objects stay apart), car-to-bus sizes, any yaw
    and velocity, random classes."""
    from lss.data import collate
    from lss.geometry import BevGrid
    from lss.geometry.boxes import DETECTION_CLASSES, dense_targets

    grid = BevGrid.from_config(cfg.grid)
    (x0, x1, _), (y0, y1, _) = cfg.grid.xbound, cfg.grid.ybound
    side = max(1, int(per_sample**0.5 + 0.999))
    lattice = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij"), -1).reshape(-1, 2)
    step = torch.tensor([(x1 - x0) / side, (y1 - y0) / side])
    low = torch.tensor([x0, y0])
    samples = []
    for _ in range(batch_size):
        cells = lattice[torch.randperm(len(lattice), generator=generator)[:per_sample]].float()
        centre = low + (cells + 0.25 + 0.5 * torch.rand(len(cells), 2, generator=generator)) * step
        n = len(centre)
        z = torch.rand(n, 1, generator=generator) - 0.5
        size = torch.rand(n, 3, generator=generator) * torch.tensor([1.5, 8.0, 2.0]) + torch.tensor([0.5, 0.5, 1.0])
        yaw = (torch.rand(n, 1, generator=generator) * 2 - 1) * 3.14
        velocity = torch.randn(n, 2, generator=generator) * 3
        boxes = torch.cat([centre, z, size, yaw, velocity], 1)
        labels = torch.randint(0, len(DETECTION_CLASSES), (n,), generator=generator)
        samples.append(dense_targets(boxes, labels, grid, max_objects=cfg.detection.max_objects))
    return collate(samples)


def _grid_shape(cfg: Config) -> tuple[int, int]:
    from lss.geometry import BevGrid

    return BevGrid.from_config(cfg.grid).shape


def _build(cfg: Config, impl: str, device: torch.device, channels_last=None):
    """The model of `impl` (channels_last: train.channels_last's values; None: the impl's own), its loss and
    autocast."""
    from lss.models.losses import TotalLoss
    from lss.models import LiftSplatShoot

    splat, dtype, impl_channels_last, compile_mode = IMPLS[impl]
    cfg.model.splat = splat
    torch.manual_seed(0)
    model = apply_channels_last(
        LiftSplatShoot(cfg).to(device),
        impl_channels_last if channels_last is None else channels_last,
    )
    if compile_mode is not None:  # as `train.compile: true` with `train.compile_mode` does
        compile_encoders(model, compile_mode, MEMORY_BUDGET if impl.endswith("_budget") else 1.0)
    use_amp = dtype is not None and device.type == "cuda"

    def autocast():
        return torch.autocast(device.type, dtype=dtype) if use_amp else contextlib.nullcontext()

    return model, TotalLoss(cfg).to(device), autocast


def make_train_step(cfg: Config, model, loss_fn, autocast, batches: list[dict]):
    """A closure running one training step (forward, loss, backward, clipping, Adam as the trainer builds it) on
    the next of `batches` in turn; returns it and its optimizer."""
    optimizer = build_optimizer(cfg, model)  # as the trainer: fused Adam on the GPU
    counter = [0]

    def train_step():
        batch = batches[counter[0] % len(batches)]
        counter[0] += 1
        with autocast():
            out = model(batch)
        loss = loss_fn(out, batch)["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return train_step, optimizer


def make_graphed_train_step(cfg: Config, model, loss_fn, batches: list[dict]):
    """As make_train_step, with the whole step captured once as a CUDA graph (what `train.cuda_graph: true` runs);
    the first call captures. Also returns a function describing the memory the captured step holds."""
    from lss.engine.step import GraphedTrainStep

    optimizer = build_optimizer(cfg, model)
    step = GraphedTrainStep(model, loss_fn, optimizer, torch.bfloat16, cfg.optim.grad_clip)
    counter = [0]

    def train_step():
        step(batches[counter[0] % len(batches)])
        counter[0] += 1

    def memory() -> str:
        device = next(model.parameters()).device
        torch.cuda.synchronize(device)
        pool = tuple(step.graph.pool())
        graph_bytes = sum(
            seg["total_size"]
            for seg in torch.cuda.memory_snapshot()
            if tuple(seg.get("segment_pool_id", ())) == pool
        )
        return (
            f"peak {step.peak_bytes / 1e9:.2f} GB allocated (measured over the capture), "
            f"{torch.cuda.memory_reserved(device) / 1e9:.2f} GB reserved in all after the capture (graph pool "
            f"{graph_bytes / 1e9:.2f} GB, parameters, optimizer state, inputs), "
            f"{torch.cuda.memory_allocated(device) / 1e9:.2f} GB allocated between steps"
        )

    return train_step, optimizer, memory


def _peak_memory(device: torch.device, fn) -> str:
    """Peak allocated device memory during one call of `fn`, as text for the notes."""
    if device.type != "cuda":
        return "peak memory n/a on CPU"
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    # CUDA-graph replays allocate nothing, so their memory shows in the reserved peak only (the graphs' pools)
    return (
        f"peak {torch.cuda.max_memory_allocated(device) / 1e9:.2f} GB allocated, "
        f"{torch.cuda.max_memory_reserved(device) / 1e9:.2f} GB reserved"
    )


def run(ctx) -> list[dict]:
    device = ctx.device
    overrides = QUICK_CONFIG if ctx.quick else LSS_CONFIG
    shape = "B{b}, 6 cams {h}x{w}, D{d}, {nx}x{ny} grid"
    rows = []
    chosen = os.environ.get(
        "LSS_TRAIN_STEP_IMPLS"
    )  # comma-separated subset of IMPLS, e.g. "lss_cudagraphs"
    unknown = sorted(set(chosen.split(",")) - set(IMPLS)) if chosen else []
    if unknown:
        raise ValueError(f"LSS_TRAIN_STEP_IMPLS names {unknown}; choose from {', '.join(IMPLS)}")
    for impl in chosen.split(",") if chosen else IMPLS:
        graphed = impl.startswith("lss_cuda_graph")
        if (IMPLS[impl][3] is not None and (ctx.quick or device.type != "cuda")) or (
            graphed and device.type != "cuda"
        ):
            continue  # compilation takes minutes on CPU; CUDA graphs need a GPU
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        cfg = load_config(None, overrides)
        model, loss_fn, autocast = _build(cfg, impl, device)
        batches = random_batches(cfg, 1 if ctx.quick else 4, device)
        if graphed:
            train_step, optimizer, memory = make_graphed_train_step(cfg, model, loss_fn, batches)
        else:
            train_step, optimizer = make_train_step(cfg, model, loss_fn, autocast, batches)
        model.train()
        for _ in range(
            1 if ctx.quick else 3
        ):  # compilation, capture and cuDNN autotuning happen outside the timing
            train_step()
        ms = ctx.time(train_step, warmup=5, reps=20)
        peak = memory() if graphed else _peak_memory(device, train_step)
        b, n, _, h, w = batches[0]["images"].shape
        nx, ny = _grid_shape(cfg)
        desc = shape.format(b=b, h=h, w=w, d=model.splat.depth_bins, nx=nx, ny=ny)
        rows.append(
            {
                "case": "train_step_B4" if not ctx.quick else "train_step_quick",
                "impl": impl,
                "ms": ms,
                "floor_ms": None,
                "notes": f"{desc}; {peak}; fwd+bwd+Adam, LUT rebuilt per step",
            }
        )

        if graphed:  # its inference is the eager `lss` (or `lss_compiled`) row's
            del model, optimizer, batches, train_step
            if IMPLS[impl][3] is not None:
                torch._dynamo.reset()
            torch.cuda.empty_cache()
            continue
        model.eval()
        one = {k: v[:1] for k, v in batches[0].items()}

        def infer():
            with torch.no_grad(), autocast():
                model(one)

        for _ in range(1 if ctx.quick else 3):
            infer()
        ms = ctx.time(infer, warmup=5, reps=30)
        peak = _peak_memory(device, infer)
        rows.append(
            {
                "case": "inference_B1",
                "impl": impl,
                "ms": ms,
                "floor_ms": None,
                "notes": f"{shape.format(b=1, h=h, w=w, d=model.splat.depth_bins, nx=nx, ny=ny)}; {peak}; "
                "fixed rig (cached LUT)",
            }
        )
        del model, optimizer, batches
        if IMPLS[impl][3] is not None:
            torch._dynamo.reset()  # drops the compiled graphs and their CUDA-graph memory pools
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def smoke(device) -> None:
    """One tiny training step (forward + backward) of the whole model."""
    device = torch.device(device)
    cfg = load_config(None, QUICK_CONFIG)
    model, loss_fn, autocast = _build(cfg, "lss", device)
    batch = random_batches(cfg, 1, device, variants=1)[0]
    with autocast():
        out = model(batch)
    loss_fn(out, batch)["loss"].backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
