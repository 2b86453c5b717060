"""Training-mode batch norm: lss.ops.batch_norm_train against torch.nn.functional.batch_norm, forward + backward.

Cases: shapes of the default recipe's camera trunk (B4 x 6 cameras at 256x704: the stem's 24 x 32 x 128 x 352, a
stride-4 expansion's 24 x 144 x 64 x 176, the head's 24 x 1280 x 8 x 22), NCHW, in bfloat16 and float32 with float32
weights (as under autocast). The floor counts x read twice, y written, the gradient read twice, x again and dx written.
`scripts/probe_batch_norm.py` times the trunk's 50 batch norms together."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lss.ops import batch_norm_train

CASES = [(24, 32, 128, 352), (24, 144, 64, 176), (24, 1280, 8, 22)]
QUICK_CASES = [(2, 8, 6, 10), (3, 5, 4, 3)]


def _impls() -> dict:
    return {
        "lss": lambda x, w, b: batch_norm_train(x, w, b)[0],
        "F.batch_norm": lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
    }


def run(ctx) -> list[dict]:
    rows = []
    for shape in QUICK_CASES if ctx.quick else CASES:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(shape, device=ctx.device, dtype=dtype)
            grad = torch.randn(shape, device=ctx.device, dtype=dtype)
            c = shape[1]
            w = torch.rand(c, device=ctx.device) + 0.5
            b = torch.randn(c, device=ctx.device)
            moved = 7 * x.numel() * x.element_size()
            name = f"{'x'.join(map(str, shape))} {str(dtype).replace('torch.', '')} NCHW"
            for impl, fn in _impls().items():
                xg = x.detach().requires_grad_()
                ms = ctx.time(lambda: torch.autograd.grad(fn(xg, w, b), xg, grad))
                rows.append(
                    {
                        "case": f"{name} fwd+bwd",
                        "impl": impl,
                        "ms": ms,
                        "floor_ms": ctx.floor_ms(moved),
                        "notes": "training mode, the input gradient",
                    }
                )
    return rows


def smoke(device) -> None:
    """Forward and backward once on small inputs, vectorised and scalar paths (for compute-sanitizer)."""
    for shape in ((4, 6, 8, 16), (3, 5, 7, 3)):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(shape, device=device, dtype=dtype).requires_grad_()
            w = torch.rand(shape[1], device=device, requires_grad=True)
            b = torch.randn(shape[1], device=device, requires_grad=True)
            y = batch_norm_train(x, w, b)[0]
            torch.autograd.grad(y, (x, w, b), torch.randn_like(y))
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
