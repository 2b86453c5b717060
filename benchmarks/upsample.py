"""Bilinear x2 upsampling: lss.ops.upsample_bilinear against F.interpolate, forward and forward + backward.

Cases: the BEV decoder's 4 x 256 x 100 x 100 map and the camera encoder's 24 x 320 x 4 x 11 map (LSS Up blocks,
align_corners), in float32 and bfloat16, plus the decoder map in channels_last."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lss.ops import upsample_bilinear
from lss.ops.upsample import MODES

CASES = [
    ((4, 256, 100, 100), torch.contiguous_format),
    ((24, 320, 4, 11), torch.contiguous_format),
    ((4, 256, 100, 100), torch.channels_last),
]
QUICK_CASES = [((2, 8, 10, 10), torch.contiguous_format), ((3, 5, 4, 11), torch.channels_last)]


def _impls(mode: str) -> dict:
    align_corners = mode == "align_corners"
    return {
        "lss": lambda x: upsample_bilinear(x, scale_factor=2, mode=mode),
        "F.interpolate": lambda x: F.interpolate(
            x, scale_factor=2, mode="bilinear", align_corners=align_corners
        ),
    }


def run(ctx) -> list[dict]:
    rows = []
    mode = "align_corners"
    for shape, fmt in QUICK_CASES if ctx.quick else CASES:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(shape, device=ctx.device, dtype=dtype).contiguous(memory_format=fmt)
            n, c, h, w = shape
            grad = torch.randn(n, c, 2 * h, 2 * w, device=ctx.device, dtype=dtype).contiguous(
                memory_format=fmt
            )
            moved = (
                x.numel() + grad.numel()
            ) * x.element_size()  # read the input, write the output
            layout = "channels_last" if fmt == torch.channels_last else "NCHW"
            name = f"{n}x{c}x{h}x{w} x2 {str(dtype).replace('torch.', '')} {layout} {mode}"
            for impl, fn in _impls(mode).items():
                with torch.no_grad():
                    ms = ctx.time(lambda: fn(x))
                rows.append(
                    {
                        "case": f"{name} fwd",
                        "impl": impl,
                        "ms": ms,
                        "floor_ms": ctx.floor_ms(moved),
                        "notes": "output only",
                    }
                )
                xg = x.detach().requires_grad_()
                ms = ctx.time(lambda: torch.autograd.grad(fn(xg), xg, grad))
                rows.append(
                    {
                        "case": f"{name} fwd+bwd",
                        "impl": impl,
                        "ms": ms,
                        "floor_ms": ctx.floor_ms(2 * moved),
                        "notes": "forward, then the input gradient",
                    }
                )
    return rows


def smoke(device) -> None:
    """Forward and backward of every mode and layout once on small inputs (for compute-sanitizer)."""
    for mode in MODES:
        for fmt in (torch.contiguous_format, torch.channels_last):
            for kwargs in (dict(scale_factor=2), dict(size=(3, 17))):
                x = (
                    torch.randn(2, 5, 4, 11, device=device)
                    .contiguous(memory_format=fmt)
                    .requires_grad_()
                )
                y = upsample_bilinear(x, mode=mode, **kwargs)
                torch.autograd.grad(y, x, torch.randn_like(y))
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
