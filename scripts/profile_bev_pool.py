"""GPU kernel time of bev_pool fwd+bwd, per kernel, at the benchmark's configurations (torch.profiler).

    python scripts/profile_bev_pool.py [--iters 50]

Prints, for each configuration and feature layout (contiguous feat and grad_out; channels-last feat and grad_out,
as training runs), every CUDA kernel launched by one fwd+bwd with its mean device time, and the total: the GPU
time that the op costs without the host-side launch overhead."""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from lss.benchmarks.bev_pool import CASES, camera_feature_map, camera_inputs
from lss.geometry import FrustumLUT, frustum_to_ego
from lss.ops import bev_pool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    device = torch.device("cuda")
    for case in CASES:
        cam = camera_inputs(case, device)
        lut = FrustumLUT.build(frustum_to_ego(*cam), case.grid)
        depth = torch.rand(case.B, case.N, lut.D, lut.fH, lut.fW, device=device).softmax(2).requires_grad_()
        feat = torch.randn(case.B, case.N, case.C, lut.fH, lut.fW, device=device)
        grad_out = torch.randn(case.B, lut.nz * case.C, lut.nx, lut.ny, device=device)
        for layout in ("contiguous", "channels_last"):
            if layout == "channels_last":
                leaf = camera_feature_map(feat).requires_grad_()
                grad = grad_out.contiguous(memory_format=torch.channels_last)
            else:
                leaf = feat.clone().requires_grad_()
                grad = grad_out

            def step():
                return torch.autograd.grad(bev_pool(depth, leaf.view(feat.shape), lut), (depth, leaf), grad)

            for _ in range(10):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.iters):
                    step()
                torch.cuda.synchronize()
            total = 0.0
            print(f"{case.name}, {layout}: mean device time per fwd+bwd, by kernel")
            for ev in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
                if ev.device_time_total <= 0:
                    continue
                us = ev.device_time_total / args.iters
                total += us
                print(f"  {us:9.2f} us  x{ev.count / args.iters:.0f}  {ev.key[:110]}")
            print(f"  {total:9.2f} us  total GPU time per fwd+bwd")


if __name__ == "__main__":
    main()
