"""The eager training step at the benchmark's sizes (benchmarks/train_step.py: B4, 6 cameras at
128x352, D41, 200x200 grid): the step the trainer takes where it cannot capture one
(lss.engine.step.EagerStep: batch copy from pinned memory, autocast forward, loss, backward, its
loss check, clipping, fused AdamW, schedule), its time, and where the host's part goes.

    python scripts/profile_eager_step.py [--amp bf16|fp16|none] [--channels-last bev|true|false]
        [--variants base,graphed,captured] [--steps 30] [--top 20]

Variants, each on a fresh model, each built by lss.engine.step.build_step as the trainer builds it:
  base      the plain eager step (EagerStep without CUDA graphs), for the ratio
  graphed   the eager step with train.eager_encoder_graphs: true: the camera trunk and the BEV encoder
            replay CUDA graphs captured after its first step (lss.engine.step.partial), the rest
            eager, as gradient accumulation, fp16 and the detection head's second stage need
  captured  the whole step as one CUDA graph (train.cuda_graph), for the ratio

One JSON line per variant: the step's median ms (synchronized after every step), the GPU's kernel
time per step, kernel launches, host syncs, casts (aten::_to_copy: autocast's weight casts and
their backward) and the host time of the optimizer and of the backward, all per step from
torch.profiler, and for the eager variants "encoder_graphs" ("captured", "off" or why not); then
each eager variant's top host operators (self CPU ms per step) and top kernels. On a CPU it runs
at the quick sizes (a smoke test); --amp fp16 leaves out the captured variant (no loss scaler)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's benchmarks/
from benchmarks.train_step import LSS_CONFIG, QUICK_CONFIG, random_batches  # noqa: E402
from lss.config import load_config  # noqa: E402
from lss.engine.distributed import DistInfo, autocast_dtype, build_autocast  # noqa: E402
from lss.engine.optim import build_optimizer, build_scheduler  # noqa: E402
from lss.models.build import apply_channels_last  # noqa: E402
from lss.engine.step import StepChoice, StepParts, build_step  # noqa: E402
from lss.models import LiftSplatShoot  # noqa: E402
from lss.models.losses import TotalLoss  # noqa: E402

SYNC_APIS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
LAUNCH_APIS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
VARIANTS = ("base", "graphed", "captured")


def build(cfg, device, variant: str):
    """The step of `variant` on a fresh model, with the trainer's parts and its step factory."""
    torch.manual_seed(0)
    model = apply_channels_last(LiftSplatShoot(cfg).to(device), cfg.train.channels_last).train()
    optimizer = build_optimizer(cfg, model)
    dtype = autocast_dtype(cfg, device)
    parts = StepParts(
        model,
        TotalLoss(cfg).to(device),
        optimizer,
        build_scheduler(cfg, optimizer),
        torch.amp.GradScaler(device.type, enabled=dtype == torch.float16),
        dtype,
        build_autocast(cfg, device),
        cfg.optim.grad_clip,
        device,
        DistInfo(),
    )
    if variant == "captured":
        return build_step(cfg, StepChoice("captured"), parts)
    return build_step(cfg, StepChoice("eager", encoder_graphs=variant == "graphed"), parts)


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
    p.add_argument("--amp", default="bf16", choices=("bf16", "fp16", "none"))
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
    overrides = (QUICK_CONFIG if quick else LSS_CONFIG) + [
        f"train.channels_last={channels}",
        f"train.amp={a.amp}",
    ]
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
    if a.amp == "fp16":  # the captured step has no loss scaler (train.cuda_graph refuses fp16)
        variants = [v for v in variants if v != "captured"]
    steps = 3 if quick else a.steps
    eager_events = {}
    for variant in variants:
        step = build(cfg, device, variant)
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
        if variant != "captured":
            graphs = step.graphs
            row["encoder_graphs"] = "off" if graphs is None else graphs.problem or "captured"
            eager_events[variant] = events
        print(json.dumps(row), flush=True)
        del step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for variant, events in eager_events.items():
        print_top(variant, events, a.profile_steps, a.top)


def print_top(variant: str, events, n: int, top: int) -> None:
    """The variant's top host operators and top kernels, per step."""
    print(f"{variant}: top host operators by self CPU time (ms per step, calls per step)")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"  {e.self_cpu_time_total / n / 1e3:8.3f}  x{e.count / n:6.0f}  {e.key[:90]}")
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    if kernels:
        print(f"{variant}: top kernels by GPU time (ms per step, launches per step)")
        for e in sorted(kernels, key=lambda e: -e.device_time_total)[:top]:
            print(f"  {e.device_time_total / n / 1e3:8.3f}  x{e.count / n:6.0f}  {e.key[:90]}")


if __name__ == "__main__":
    main()
