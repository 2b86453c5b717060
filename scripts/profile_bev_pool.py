"""GPU kernel time of bev_pool fwd+bwd, per kernel, at the benchmark's configurations (torch.profiler).

    python scripts/profile_bev_pool.py [--iters 50]

Prints, for each configuration and feature layout (contiguous feat and grad_out; channels-last feat and grad_out,
as training runs), every CUDA kernel launched by one fwd+bwd with its mean GPU time, and the total: the GPU
time that the op costs without the host-side launch overhead."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's benchmarks/
from benchmarks import kernel_table
from benchmarks.bev_pool import CASES, camera_feature_map, camera_inputs
from lss.geometry import FrustumLUT, frustum_to_ego
from lss.ops import bev_pool


def print_kernel_table(rows) -> None:
    for us, count, name in rows:
        print(f"  {us:9.2f} us  x{count:.0f}  {name[:110]}")
    print(f"  {sum(us for us, _, _ in rows):9.2f} us  total GPU time per fwd+bwd")


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
            print(f"{case.name}, {layout}: mean GPU time per fwd+bwd, by kernel")
            print_kernel_table(kernel_table(step, args.iters))


if __name__ == "__main__":
    main()
