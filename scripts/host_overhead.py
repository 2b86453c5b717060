"""Per-call host overhead of the RoI / NMS ops against torchvision's: microseconds per eager call on inputs so small
that the kernels cost next to nothing (one 2 x 8 x 8 map, one roi, one box), so the time is argument checks,
dispatch and autograd bookkeeping.

    python scripts/host_overhead.py [--device cpu|cuda] [--calls 3000] [--rounds 7]

On CUDA the call returns before the kernel runs (except where an op must read a size back), so the figure is the
host's share of an eager call there too. Ours and torchvision's are timed in alternating rounds and each figure is
the median over the rounds, so that a busy moment of the machine does not land on one side only."""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torchvision

import lss.ops as ops


def per_call_us(fn, calls: int, device: torch.device) -> float:
    for _ in range(max(calls // 10, 10)):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    x = torch.randn(1, 2, 8, 8, device=device, requires_grad=True)
    rois = torch.tensor([[0, 1.0, 1.0, 5.0, 5.0]], device=device)
    boxes, scores, idxs = rois[:, 1:], torch.ones(1, device=device), torch.zeros(1, dtype=torch.long, device=device)
    pairs = {
        "roi_pool fwd": (lambda m: m.roi_pool(x, rois, (2, 2), 1.0)),
        "roi_pool fwd+bwd": (lambda m: m.roi_pool(x, rois, (2, 2), 1.0).sum().backward()),
        "roi_align fwd": (lambda m: m.roi_align(x, rois, (2, 2), 1.0, 2, True)),
        "roi_align fwd+bwd": (lambda m: m.roi_align(x, rois, (2, 2), 1.0, 2, True).sum().backward()),
        "nms": (lambda m: m.nms(boxes, scores, 0.5)),
        "batched_nms": (lambda m: m.batched_nms(boxes, scores, idxs, 0.5)),
    }
    print(f"{device.type}, torch {torch.__version__}, torchvision {torchvision.__version__}; us per call, median of "
          f"{args.rounds} alternating rounds of {args.calls} calls")
    print("| call | lss | torchvision | torchvision / lss |\n|---|---|---|---|")
    for name, call in pairs.items():
        times = {ops: [], torchvision.ops: []}
        for _ in range(args.rounds):
            for impl, got in times.items():
                got.append(per_call_us(lambda: call(impl), args.calls, device))
        ours, theirs = (statistics.median(times[impl]) for impl in (ops, torchvision.ops))
        print(f"| {name} | {ours:.1f} | {theirs:.1f} | {theirs / ours:.2f} |")


if __name__ == "__main__":
    main()
