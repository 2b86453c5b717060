"""Where the time of one LSS train step goes (torch.profiler), at the benchmark's paper configuration.

    python scripts/profile_train_step.py [--impl lss] [--steps 10] [--top 30]

Prints the wall time per step, the summed GPU kernel time per step (when it is far below the wall time the step is
bound by host-side launch overhead, not by the GPU), the kernel launches per step, the top kernels by GPU time
and the top host operators by self CPU time."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's benchmarks/
from benchmarks.train_step import IMPLS, LSS_CONFIG, _build, make_train_step, random_batches
from lss.config import load_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--impl", default="lss", choices=sorted(IMPLS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--set", action="append", default=[], help="extra config overrides, k=v")
    args = parser.parse_args()
    device = torch.device("cuda")
    cfg = load_config(None, LSS_CONFIG + args.set)
    model, loss_fn, autocast = _build(cfg, args.impl, device)
    train_step, _ = make_train_step(cfg, model, loss_fn, autocast, random_batches(cfg, 4, device))

    model.train()
    for _ in range(5):
        train_step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        train_step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / args.steps * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            train_step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(e.device_time_total for e in kernels) / args.steps / 1e3
    launches = sum(e.count for e in kernels) / args.steps
    print(f"{args.impl}: wall {wall:.2f} ms/step (unprofiled), GPU kernel time {gpu_ms:.2f} ms/step, "
          f"{launches:.0f} kernels/step")
    print(f"top kernels by GPU time (ms/step, launches/step):")
    for e in sorted(kernels, key=lambda e: -e.device_time_total)[: args.top]:
        print(f"  {e.device_time_total / args.steps / 1e3:7.3f}  x{e.count / args.steps:5.0f}  {e.key[:100]}")
    print(f"top host operators by self CPU time (ms/step, calls/step):")
    host = [e for e in events if e.self_cpu_time_total > 0]
    for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[: args.top]:
        print(f"  {e.self_cpu_time_total / args.steps / 1e3:7.3f}  x{e.count / args.steps:5.0f}  {e.key[:100]}")


if __name__ == "__main__":
    main()
