"""GPU time per kernel of nms / batched_nms, ours against torchvision, on the roi benchmark's boxes.

    python scripts/profile_nms.py [--iters 10]      per-kernel table at 5k / 20k / 100k boxes and batched 20k
    python scripts/profile_nms.py --smoke           small calls only, for compute-sanitizer (memcheck, racecheck)

Each table lists every CUDA kernel (and memset / memcpy) of one call with its mean GPU time (the bitmask kernel,
the one-block reduction, the score sort and the gathers), their sum and the eager time of the call."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torchvision
from profile_roi import report

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's benchmarks/
from benchmarks.roi import _boxes
from lss.ops import batched_nms, nms


def smoke(dev) -> None:
    """Sizes around the word (64) and band (512) boundaries, 0 and 1 boxes, every dtype path, classes, negative
    coordinates, NaN coordinates and a negative threshold."""
    for n in (0, 1, 2, 63, 64, 65, 513, 1000):
        boxes, scores = _boxes(n, dev, seed=n, extent=200.0)
        idxs = torch.randint(0, 4, (n,), generator=torch.Generator().manual_seed(n)).to(dev)
        nms(boxes, scores, 0.5)
        nms(boxes.half(), scores, 0.5)
        nms(boxes.double(), scores, 0.5)
        batched_nms(boxes - 100.0, scores, idxs, 0.5)
        nms(boxes, scores, -0.1)
        if n > 2:
            boxes[::3, n % 4] = float("nan")
            nms(boxes, scores, 0.3)
    torch.cuda.synchronize()
    print("profile_nms: smoke done")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    dev = torch.device("cuda")
    if args.smoke:
        smoke(dev)
        return
    for n in (5000, 20000, 100000):
        boxes, scores = _boxes(n, dev)
        iters = max(2, args.iters // 3) if n >= 100000 else args.iters
        print(f"nms {n} boxes: kept {len(nms(boxes, scores, 0.5))}")
        for impl, fn in [("lss", nms), ("torchvision", torchvision.ops.nms)]:
            report(f"nms {n} boxes, IoU 0.5", impl, lambda: fn(boxes, scores, 0.5), iters, warmup=1)
    boxes, scores = _boxes(20000, dev, seed=1)
    boxes = boxes - 500.0
    idxs = torch.randint(0, 10, (20000,), generator=torch.Generator().manual_seed(0)).to(dev)
    for impl, fn in [("lss", batched_nms), ("torchvision", torchvision.ops.batched_nms)]:
        report("batched_nms 20000 boxes, 10 classes, IoU 0.5", impl, lambda: fn(boxes, scores, idxs, 0.5),
               args.iters, warmup=1)


if __name__ == "__main__":
    main()
