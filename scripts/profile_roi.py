"""GPU time per kernel of roi_align / roi_pool, ours against torchvision, at the roi benchmark's cases (NMS:
scripts/profile_nms.py, which imports `report` from here).

    python scripts/profile_roi.py [--iters 20]

For each case and implementation prints every CUDA kernel (and memset / memcpy) of one call with its mean GPU
time, their sum (GPU busy time) and the eager time of the call between CUDA events, as `python -m lss bench` measures
it. eager - busy is what host work (launches, syncs, Python) adds on the GPU's timeline."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's benchmarks/
from benchmarks import kernel_table
from benchmarks.roi import _fwd_bwd, _roi_cases, _rois
from lss.ops import roi_align, roi_pool


def eager_ms(step, iters: int) -> float:
    """Mean ms per call between CUDA events (host overhead included)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def report(case: str, impl: str, step, iters: int, warmup: int = 3) -> None:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    rows = kernel_table(step, iters)
    busy = sum(us for us, _, _ in rows)
    eager = eager_ms(step, iters) * 1e3
    print(f"{case} | {impl}: eager {eager:8.1f} us, GPU busy {busy:8.1f} us, gap {eager - busy:7.1f} us")
    for us, count, name in rows:
        print(f"    {us:8.1f} us  x{count:<4.3g} {name[:100]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    dev = torch.device("cuda")
    for case, shape, k, scale, sr, lo, hi, img_h, img_w in _roi_cases(quick=False):
        name = case.split(",")[0]
        torch.manual_seed(0)
        x = torch.randn(shape, device=dev, requires_grad=True)
        x_cl = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_(True)
        rois = _rois(k, shape[0], img_h, img_w, lo, hi, dev)
        grad_out = torch.randn(k, shape[1], 7, 7, device=dev)
        align = [("lss", lambda t: roi_align(t, rois, 7, scale, sr, True)),
                 ("lss_unvalidated", lambda t: roi_align(t, rois, 7, scale, sr, True, validate=False)),
                 ("torchvision", lambda t: torchvision.ops.roi_align(t, rois, 7, scale, sr, True))]
        layouts = [("NCHW", x), ("channels_last", x_cl)] if "BEV" in case else [("NCHW", x)]
        for layout, inp in layouts:
            for impl, fn in align:
                if "BEV" in case:
                    with torch.no_grad():
                        report(f"{name} {layout} fwd", impl, lambda: fn(inp), args.iters)
                report(f"{name} {layout} fwd+bwd", impl, _fwd_bwd(fn, inp, grad_out), args.iters)
        if "FPN" in case:
            pool = [("lss", lambda t: roi_pool(t, rois, 7, scale)),
                    ("lss_unvalidated", lambda t: roi_pool(t, rois, 7, scale, validate=False)),
                    ("torchvision", lambda t: torchvision.ops.roi_pool(t, rois, 7, scale))]
            for impl, fn in pool:
                report(f"{name.replace('roi_align', 'roi_pool')} NCHW fwd+bwd", impl, _fwd_bwd(fn, x, grad_out), args.iters)
        del x, x_cl, grad_out


if __name__ == "__main__":
    main()
