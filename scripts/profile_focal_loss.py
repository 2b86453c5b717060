"""GPU kernel time of the dense sigmoid focal loss fwd+bwd, per kernel (torch.profiler), at the benchmark's size.

    python scripts/profile_focal_loss.py [--shape 16 10 512 512] [--iters 50]

Prints, for float32 and bfloat16 logits (float32 targets, reduction "mean", as in benchmarks/focal_loss.py),
every CUDA kernel launched by one fwd+bwd with its mean GPU time and the total, then the step time measured the
way the benchmark does (CUDA events around one synchronized step): the difference is host-side overhead. Each dtype
runs twice: the loss itself (grad_output 1, nothing left for the backward to scale) and the loss times 2 (the
in-place scaling pass of a loss weight or loss scale)."""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's benchmarks/
from benchmarks import kernel_table
from lss.ops import sigmoid_focal_loss
from profile_bev_pool import print_kernel_table


def event_ms(step, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", type=int, nargs="+", default=[16, 10, 512, 512])
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    device = torch.device("cuda")
    shape = tuple(args.shape)
    for dtype, factor in ((torch.float32, 1.0), (torch.float32, 2.0), (torch.bfloat16, 1.0), (torch.bfloat16, 2.0)):
        logits = (torch.randn(shape, device=device) * 3).to(dtype).requires_grad_(True)
        targets = (torch.rand(shape, device=device) > 0.9).float()

        def step():
            loss = sigmoid_focal_loss(logits, targets, reduction="mean")
            return torch.autograd.grad(loss if factor == 1.0 else loss * factor, logits)

        for _ in range(10):
            step()
        torch.cuda.synchronize()
        name = str(dtype).replace("torch.", "")
        print(f"{'x'.join(map(str, shape))} {name} logits, loss x {factor:g}: mean GPU time per fwd+bwd, by kernel")
        print_kernel_table(kernel_table(step, args.iters))
        print(f"  {event_ms(step, args.iters) * 1e3:9.2f} us  step time (CUDA events around a synchronized step)")


if __name__ == "__main__":
    main()
