"""Depthwise convolution: lss.ops.depthwise_conv2d against what efficientnet-pytorch runs (torch.nn.functional.pad
to TensorFlow's "same" padding, then torch.nn.functional.conv2d with groups = C), forward + backward (the input and
weight gradients).

Cases: the default recipe's camera trunk (B4 x 6 cameras at 256x704, bfloat16 activations, float32 weights as under
autocast): one case per filter / stride kind at its largest map, and `trunk`: the trunk's 16 depthwise convolutions
one after the other. The floor counts x read three times (forward, input and weight gradients), y written and its
gradient read twice, dx written."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lss.models.camera import same_padding
from lss.ops import depthwise_conv2d

# (N, C, H, W, kernel, stride) of EfficientNet-B0's depthwise convolutions at 256 x 704, 24 images
TRUNK = [
    (24, 32, 128, 352, 3, 1),
    (24, 96, 128, 352, 3, 2),
    (24, 144, 64, 176, 3, 1),
    (24, 144, 64, 176, 5, 2),
    (24, 240, 32, 88, 5, 1),
    (24, 240, 32, 88, 3, 2),
    (24, 480, 16, 44, 3, 1),
    (24, 480, 16, 44, 3, 1),
    (24, 480, 16, 44, 5, 1),
    (24, 672, 16, 44, 5, 1),
    (24, 672, 16, 44, 5, 1),
    (24, 672, 16, 44, 5, 2),
    (24, 1152, 8, 22, 5, 1),
    (24, 1152, 8, 22, 5, 1),
    (24, 1152, 8, 22, 5, 1),
    (24, 1152, 8, 22, 3, 1),
]
CASES = [0, 1, 3, 9, 12]  # rows of TRUNK timed alone
QUICK_TRUNK = [(2, 4, 12, 20, 3, 1), (2, 6, 12, 20, 5, 2), (3, 5, 7, 9, 3, 2)]


def _impls() -> dict:
    def efficientnet(x, w, s, p):
        padded = F.pad(x, (p[2], p[3], p[0], p[1]))
        return F.conv2d(padded, w.to(x.dtype), None, s, groups=x.shape[1])

    return {
        "lss": lambda x, w, s, p: depthwise_conv2d(x, w, None, s, p),
        "F.pad + F.conv2d": efficientnet,
    }


def _tensors(shapes, device, dtype):
    out = []
    for n, c, h, w, k, s in shapes:
        x = torch.randn(n, c, h, w, device=device, dtype=dtype).requires_grad_()
        wt = (torch.randn(c, 1, k, k, device=device) * 0.1).requires_grad_()
        p = same_padding((h, w), (k, k), (s, s))
        oh, ow = -(-h // s), -(-w // s)
        grad = torch.randn(n, c, oh, ow, device=device, dtype=dtype)
        out.append((x, wt, s, p, grad))
    return out


def _bytes(tensors) -> int:
    return sum(5 * x.numel() * x.element_size() + 3 * g.numel() * g.element_size() for x, _, _, _, g in tensors)


def run(ctx) -> list[dict]:
    rows = []
    trunk = QUICK_TRUNK if ctx.quick else TRUNK
    groups = [(f"{'x'.join(map(str, trunk[i][:4]))} {trunk[i][4]}x{trunk[i][4]} stride {trunk[i][5]}", [trunk[i]])
              for i in (range(len(trunk)) if ctx.quick else CASES)]
    groups.append((f"trunk: {len(trunk)} convolutions", trunk))
    for name, shapes in groups:
        tensors = _tensors(shapes, ctx.device, torch.bfloat16)
        for impl, fn in _impls().items():
            def step():
                for x, w, s, p, g in tensors:
                    torch.autograd.grad(fn(x, w, s, p), (x, w), g)

            rows.append(
                {
                    "case": f"{name} bf16 fwd+bwd",
                    "impl": impl,
                    "ms": ctx.time(step),
                    "floor_ms": ctx.floor_ms(_bytes(tensors)),
                    "notes": "float32 weight, the input and weight gradients",
                }
            )
    return rows


def smoke(device) -> None:
    """Forward and backward once on small inputs, the compiled shapes and the generic path (for
    compute-sanitizer)."""
    for dtype in (torch.bfloat16, torch.float32):
        for x, w, s, p, g in _tensors(QUICK_TRUNK + [(2, 3, 9, 7, 4, 3)], device, dtype):
            torch.autograd.grad(depthwise_conv2d(x, w, None, s, p), (x, w), g)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
