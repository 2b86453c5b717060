"""The eager training step at the benchmark's sizes (benchmarks/train_step.py: B4, 6 cameras at
128x352, D41, 200x200 grid): the step the trainer takes where it cannot capture one
(lss.engine.step.EagerStep: batch copy from pinned memory, autocast forward, loss, backward, its
loss check, clipping, fused AdamW, schedule), its time, and where the host's part goes.

    python scripts/profile_eager_step.py [--amp bf16|none] [--channels-last bev|true|false]
        [--variants base,graphed,captured] [--steps 30] [--top 20]

Variants, each on a fresh model:
  base      the step as the trainer runs it
  graphed   the camera trunk and the BEV encoder as CUDA graphs inside the eager step
            (torch.cuda.make_graphed_callables): a partial capture, which gradient accumulation,
            fp16 and the detection head's second stage allow; what it saves says whether the
            eager step should take it
  captured  the whole step as one CUDA graph (train.cuda_graph), for the ratio

One JSON line per variant: the step's median ms (synchronized after every step), the GPU's kernel
time per step (far below the step: the host bounds it), kernel launches, host syncs, casts
(aten::_to_copy: autocast's weight casts and their backward) and the host time of the optimizer
and of the backward, all per step from torch.profiler; then the base variant's top host operators
(self CPU ms per step) and top kernels. On a CPU it runs at the quick sizes (a smoke test)."""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's benchmarks/
from benchmarks.train_step import LSS_CONFIG, QUICK_CONFIG, random_batches  # noqa: E402
from lss.config import load_config  # noqa: E402
from lss.engine.build import apply_channels_last, build_optimizer, build_scheduler  # noqa: E402
from lss.engine.distributed import DistInfo  # noqa: E402
from lss.engine.step import CapturedStep, EagerStep, StepParts  # noqa: E402
from lss.models import LiftSplatShoot  # noqa: E402
from lss.models.losses import TotalLoss  # noqa: E402

SYNC_APIS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
LAUNCH_APIS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
VARIANTS = ("base", "graphed", "captured")


def build(cfg, device, amp: str, variant: str, batch: dict):
    torch.manual_seed(0)
    model = apply_channels_last(LiftSplatShoot(cfg).to(device), cfg.train.channels_last).train()
    dtype = torch.bfloat16 if amp == "bf16" and device.type == "cuda" else None
    if variant == "graphed":
        graph_encoders(model, batch, dtype)
    optimizer = build_optimizer(cfg, model)

    def autocast():
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=dtype, cache_enabled=variant != "graphed")

    parts = StepParts(
        model,
        TotalLoss(cfg).to(device),
        optimizer,
        build_scheduler(cfg, optimizer),
        torch.amp.GradScaler(device.type, enabled=False),
        dtype,
        autocast,
        cfg.optim.grad_clip,
        device,
        DistInfo(),
    )
    return CapturedStep(parts) if variant == "captured" else EagerStep(parts)


def graph_encoders(model: nn.Module, batch: dict, dtype) -> None:
    """The camera trunk and the BEV encoder replaced in place by their graphed versions (forward
    and backward each one graph), captured on `batch`'s shapes."""

    def autocast():  # make_graphed_callables refuses autocast's weight cache
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=dtype, cache_enabled=False)

    seen = {}
    hook = model.bev.register_forward_pre_hook(lambda m, args: seen.update(bev=args[0]))
    with autocast():
        model(batch)
    hook.remove()
    images = batch["images"].flatten(0, 1).detach()
    bev_in = seen["bev"].detach().clone().requires_grad_(True)
    with autocast():
        torch.cuda.make_graphed_callables(
            (model.camera.trunk, model.bev), ((images,), (bev_in,)), num_warmup_iters=3
        )


def timed_steps(step, batches, n: int, device) -> list[float]:
    times = []
    for i in range(n):
        start = time.perf_counter()
        step.run_step([batches[i % len(batches)]], i + 1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(1e3 * (time.perf_counter() - start))
    step.check()
    return times


def profiled(step, batches, n: int, device):
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        timed_steps(step, batches, n, device)
    return prof.key_averages()


def summary(events, n: int) -> dict:
    def total(names, field="cpu_time_total"):
        return sum(getattr(e, field) for e in events if e.key in names) / n / 1e3

    def count(names):
        return sum(e.count for e in events if e.key in names) / n

    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    backward = [e for e in events if e.key.startswith("autograd::engine::evaluate_function")]
    return {
        "gpu_kernel_ms": sum(e.device_time_total for e in kernels) / n / 1e3,
        "launches": count(LAUNCH_APIS) + count(("cudaGraphLaunch",)),
        "graph_launches": count(("cudaGraphLaunch",)),
        "host_sync_ms": total(SYNC_APIS),
        "host_syncs": count(SYNC_APIS),
        "casts": count(("aten::_to_copy",)),
        "cast_host_ms": total(("aten::_to_copy",)),
        "optimizer_host_ms": sum(
            e.cpu_time_total for e in events if e.key.startswith("Optimizer.step")
        )
        / n
        / 1e3,
        "backward_host_ms": sum(e.self_cpu_time_total for e in backward) / n / 1e3,
        "aten_ops": sum(e.count for e in events if e.key.startswith("aten::")) / n,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--amp", default="bf16", choices=("bf16", "none"))
    p.add_argument("--channels-last", default="true", choices=("true", "false", "bev", "camera"))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--set", action="append", default=[], help="more config overrides, k=v")
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quick = device.type != "cuda"
    channels = {"true": "true", "false": "false"}.get(a.channels_last, a.channels_last)
    overrides = (QUICK_CONFIG if quick else LSS_CONFIG) + [f"train.channels_last={channels}"]
    cfg = load_config(None, overrides + a.set)
    on_device = random_batches(cfg, 2 if quick else 4, device)
    # the trainer's batches come from the loader's pinned host memory
    host = [
        {k: v.cpu().pin_memory() if device.type == "cuda" else v.cpu() for k, v in b.items()}
        for b in on_device
    ]
    variants = [v for v in a.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if quick:  # CUDA graphs need a GPU
        variants = [v for v in variants if v not in ("graphed", "captured")]
    steps = 3 if quick else a.steps
    base_events = None
    for variant in variants:
        step = build(cfg, device, a.amp, variant, on_device[0])
        timed_steps(step, host, 3, device)  # warm-up: cuDNN autotuning, optimizer state, capture
        times = timed_steps(step, host, steps, device)
        events = profiled(step, host, a.profile_steps, device)
        row = {
            "variant": variant,
            "amp": a.amp,
            "channels_last": a.channels_last,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "step_ms": statistics.median(times),
            "step_ms_min": min(times),
            **{k: round(v, 3) for k, v in summary(events, a.profile_steps).items()},
        }
        print(json.dumps(row), flush=True)
        if variant == "base":
            base_events = events
        del step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if base_events is None:
        return
    n = a.profile_steps
    print("base: top host operators by self CPU time (ms per step, calls per step)")
    host_ops = sorted(base_events, key=lambda e: -e.self_cpu_time_total)[: a.top]
    for e in host_ops:
        print(f"  {e.self_cpu_time_total / n / 1e3:8.3f}  x{e.count / n:6.0f}  {e.key[:90]}")
    kernels = [e for e in base_events if e.device_type == torch.autograd.DeviceType.CUDA]
    if kernels:
        print("base: top kernels by device time (ms per step, launches per step)")
        for e in sorted(kernels, key=lambda e: -e.device_time_total)[: a.top]:
            print(f"  {e.device_time_total / n / 1e3:8.3f}  x{e.count / n:6.0f}  {e.key[:90]}")


if __name__ == "__main__":
    main()
