"""Depthwise 2-D convolution of contiguous N x C x H x W (NCHW) inputs through lss's kernels (the
camera trunk's, on CUDA by default: `model.depthwise_conv`, docs/ops.md).

PyTorch sends NCHW depthwise convolutions (groups = channels) to its own kernels, which compute one
output per thread and reduce the weight gradient one filter tap at a time; with the camera trunk's
batch norms they are the largest share of the default recipe's training step
(docs/benchmarks.md). `depthwise_conv2d` takes explicit top/bottom/left/right zero padding, so the
"same" padding of an even-sized input (EfficientNet's, one row more at the bottom than at the top)
needs no padded copy of the input; a float32 weight is read as it is under autocast (no cast
kernel), and its gradient comes back in float32.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from lss.ops import _ext

torch.fx.wrap("depthwise_conv2d")

__all__ = ["depthwise_conv2d", "depthwise_conv2d_reference", "MAX_KERNEL"]

# largest filter side the kernels take (the CUDA weight gradient keeps every tap's sum per thread)
MAX_KERNEL = 7

IntPair = Union[int, Sequence[int]]


def _pair(value: IntPair, name: str) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) for v in pair):
        raise ValueError(f"depthwise_conv2d: {name} must be an int or two ints, got {value!r}")
    return pair


def _padding(padding: Union[int, Sequence[int]]) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) from an int, (vertical, horizontal) or the four sides."""
    if isinstance(padding, int):
        return (padding,) * 4
    sides = tuple(padding)
    if len(sides) == 2:
        sides = (sides[0], sides[0], sides[1], sides[1])
    if len(sides) != 4 or not all(isinstance(v, int) and v >= 0 for v in sides):
        raise ValueError(
            "depthwise_conv2d: padding must be an int, (vertical, horizontal) or (top, bottom, "
            f"left, right), each >= 0, got {padding!r}"
        )
    return sides


def _check(input: Tensor, weight: Tensor, bias: Optional[Tensor], stride, padding):
    op = "depthwise_conv2d"
    if not isinstance(input, Tensor) or not input.is_floating_point():
        got = input.dtype if isinstance(input, Tensor) else type(input).__name__
        raise TypeError(f"{op}: input must be a floating-point tensor, got {got}")
    if input.dim() != 4:
        raise ValueError(f"{op}: input must be N x C x H x W, got {tuple(input.shape)}")
    c = input.shape[1]
    if not isinstance(weight, Tensor) or weight.dim() != 4 or weight.shape[:2] != (c, 1):
        got = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(
            f"{op}: weight must be C x 1 x KH x KW with C = {c} (one filter per channel), got {got}"
        )
    if weight.dtype not in (input.dtype, torch.float32):
        raise ValueError(
            f"{op}: weight must be {input.dtype} (the input's dtype) or float32, got {weight.dtype}"
        )
    if not 1 <= min(weight.shape[2:]) <= max(weight.shape[2:]) <= MAX_KERNEL:
        raise ValueError(
            f"{op}: filters from 1 x 1 to {MAX_KERNEL} x {MAX_KERNEL} are supported, got "
            f"{tuple(weight.shape[2:])}; use torch.nn.functional.conv2d for larger ones"
        )
    if weight.device != input.device:
        raise ValueError(f"{op}: weight is on {weight.device} but the input on {input.device}")
    if bias is not None and (not isinstance(bias, Tensor) or bias.shape != (c,)):
        got = tuple(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__
        raise ValueError(f"{op}: bias must be of shape ({c},) or None, got {got}")
    sh, sw = _pair(stride, "stride")
    if sh < 1 or sw < 1:
        raise ValueError(f"{op}: stride must be >= 1, got {stride!r}")
    pt, pb, pl, pr = _padding(padding)
    kh, kw = weight.shape[2:]
    if input.shape[2] + pt + pb < kh or input.shape[3] + pl + pr < kw:
        raise ValueError(
            f"{op}: the padded input ({input.shape[2] + pt + pb} x {input.shape[3] + pl + pr}) "
            f"is smaller than the filter ({kh} x {kw})"
        )
    return [sh, sw], [pt, pb, pl, pr]


def depthwise_conv2d(
    input: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    stride: IntPair = 1,
    padding: Union[int, Sequence[int]] = 0,
) -> Tensor:
    """torch.nn.functional.conv2d(input, weight, bias, stride, padding, groups=C) for a depthwise
    filter bank: input N x C x H x W (float32/float16/bfloat16/float64; made contiguous), weight
    C x 1 x KH x KW (KH, KW <= 7) in the input's dtype or float32 (read as it is: the product is
    summed in float32, or float64 for float64 input), optional bias of C. padding: an int,
    (vertical, horizontal) or (top, bottom, left, right) zeros. Returns N x C x OH x OW in the
    input's dtype, OH = (H + top + bottom - KH) // sH + 1. Differentiable in input and weight (and
    bias)."""
    stride, padding = _check(input, weight, bias, stride, padding)
    if _ext.use_reference("depthwise_conv2d"):
        out = _reference(input, weight, stride, padding)
    else:
        _ext.check_device("depthwise_conv2d", input)
        out = torch.ops.lss.depthwise_conv2d(
            input.contiguous(), weight.contiguous(), stride, padding
        )
    return _add_bias(out, bias)


def depthwise_conv2d_reference(
    input: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    stride: IntPair = 1,
    padding: Union[int, Sequence[int]] = 0,
) -> Tensor:
    """depthwise_conv2d through torch.nn.functional.pad and conv2d (groups = C), in the input's
    dtype."""
    stride, padding = _check(input, weight, bias, stride, padding)
    return _add_bias(_reference(input, weight, stride, padding), bias)


def _add_bias(out: Tensor, bias: Optional[Tensor]) -> Tensor:
    return out if bias is None else out + bias.to(out.dtype).view(1, -1, 1, 1)


def _reference(input: Tensor, weight: Tensor, stride, padding) -> Tensor:
    pt, pb, pl, pr = padding
    padded = F.pad(input, (pl, pr, pt, pb))
    return F.conv2d(padded, weight.to(input.dtype), None, stride, groups=input.shape[1])


def _backward(ctx, grad_output: Tensor):
    input, weight = ctx.saved_tensors
    grad_input, grad_weight = torch.ops.lss._depthwise_conv2d_backward(
        grad_output.contiguous(), input, weight, ctx.stride, ctx.padding
    )
    return (
        grad_input if ctx.needs_input_grad[0] else None,
        grad_weight if ctx.needs_input_grad[1] else None,
        None,
        None,
    )


def _setup_context(ctx, inputs, output) -> None:
    input, weight, stride, padding = inputs
    ctx.save_for_backward(input, weight)
    ctx.stride, ctx.padding = list(stride), list(padding)


if _ext.has_ext():

    @torch.library.register_fake("lss::depthwise_conv2d")
    def _depthwise_conv2d_fake(input, weight, stride, padding):
        n, c, h, w = input.shape
        oh = (h + padding[0] + padding[1] - weight.shape[2]) // stride[0] + 1
        ow = (w + padding[2] + padding[3] - weight.shape[3]) // stride[1] + 1
        return input.new_empty((n, c, oh, ow))

    @torch.library.register_fake("lss::_depthwise_conv2d_backward")
    def _depthwise_conv2d_backward_fake(grad_output, input, weight, stride, padding):
        return input.new_empty(input.shape), weight.new_empty(weight.shape)

    torch.library.register_autograd(
        "lss::depthwise_conv2d", _backward, setup_context=_setup_context
    )
