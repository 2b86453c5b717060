"""Bilinear upsampling (and downsampling) of N x C x H x W feature maps with the ONNX Resize
coordinate modes.

Along each axis, output index o reads the input at the source coordinate x(o) of `mode` (the ONNX
Resize `coordinate_transformation_mode` names for linear interpolation), clamped to [0, in - 1]:

- "pytorch_half_pixel": F.interpolate(align_corners=False): x = (o + 0.5) * s - 0.5, and x = o (a
                        copy) when the output length equals the input length, whatever the scale
                        factor; an output of length 1 samples the centre. (ONNX Resize's rule of
                        this name samples index 0 there instead: `onnx_rule=True` of the reference,
                        what an exported graph computes.)
- "half_pixel":         x = (o + 0.5) * s - 0.5;
- "align_corners":      x = o * (in - 1) / (out - 1), and x = 0 when the output length is 1;
- "asymmetric":         x = o * s (TensorFlow 1.x `resize_bilinear` without align_corners).

The step s is 1 / scale_factor when the output size comes from `scale_factor` (as in F.interpolate
without recompute_scale_factor, and in ONNX Resize given `scales`), else in / out (ONNX Resize given
`sizes`). The value is (1 - f) * x[floor(x)] + f * x[min(floor(x) + 1, in - 1)] with
f = x - floor(x), per axis.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
from torch import nn

from lss.ops import _ext

# Leaf functions for torch.fx.symbolic_trace (as torchvision's ops): a traced model keeps one call
# node per op.
torch.fx.wrap("upsample_bilinear")

MODES = ("pytorch_half_pixel", "half_pixel", "align_corners", "asymmetric")

_Size = Union[int, Sequence[int]]
_Scale = Union[float, Sequence[float]]


def _pair(value, name: str) -> tuple:
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ValueError(
                f"upsample_bilinear: {name} must be one value or a pair (H, W), got {value!r}"
            )
        return tuple(value)
    return (value, value)


def _wants_channels_last(x: torch.Tensor) -> bool:
    """The kernels keep channels_last inputs channels_last and return every other input
    contiguous."""
    return not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


def memory_format_of(x: torch.Tensor) -> torch.memory_format:
    """channels_last for a channels-last map (not also contiguous), else contiguous_format: the
    layout the kernels give an input's output and gradient."""
    return torch.channels_last if _wants_channels_last(x) else torch.contiguous_format


def resolve_output(
    input: torch.Tensor, size: Optional[_Size], scale_factor: Optional[_Scale], mode: str
):
    """Validates the arguments. Returns ((out_h, out_w), (scale_h, scale_w)); the scales are None
    with `size`."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(
            f"upsample_bilinear: input must be a torch.Tensor, got {type(input).__name__}"
        )
    if input.dim() != 4:
        raise ValueError(
            "upsample_bilinear: input must be 4-D (N x C x H x W), got shape "
            f"{tuple(input.shape)}; add a batch dimension with input[None] for a single C x H x W "
            "map"
        )
    if not input.is_floating_point():
        raise TypeError(
            "upsample_bilinear: input must be float32, float16, bfloat16 or float64, got "
            f"{input.dtype}; convert it with input.float()"
        )
    if mode not in MODES:
        raise ValueError(
            f"upsample_bilinear: unknown mode {mode!r}; expected one of {', '.join(MODES)}"
        )
    if (size is None) == (scale_factor is None):
        raise ValueError(
            "upsample_bilinear: give exactly one of size and scale_factor, got "
            f"size={size!r}, scale_factor={scale_factor!r}"
        )
    in_h, in_w = input.shape[2], input.shape[3]
    if in_h == 0 or in_w == 0:
        raise ValueError(
            "upsample_bilinear: input height and width must be positive, got shape "
            f"{tuple(input.shape)}"
        )
    if size is not None:
        out = _pair(size, "size")
        if not all(
            isinstance(s, (int, torch.SymInt)) and not isinstance(s, bool) for s in out
        ) or any(s <= 0 for s in out):
            raise ValueError(
                f"upsample_bilinear: size must be positive integers (H, W), got {size!r}"
            )
        return (out[0], out[1]), (None, None)
    scales = _pair(scale_factor, "scale_factor")
    if not all(
        isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and s > 0
        for s in scales
    ):
        raise ValueError(
            f"upsample_bilinear: scale_factor must be positive finite numbers, got {scale_factor!r}"
        )
    scales = (float(scales[0]), float(scales[1]))
    out = tuple(math.floor(float(n) * s) for n, s in zip((in_h, in_w), scales))
    if out[0] <= 0 or out[1] <= 0:
        raise ValueError(
            f"upsample_bilinear: scale_factor={scale_factor!r} turns the input of spatial size "
            f"{(in_h, in_w)} into {out}; every output size must be at least 1"
        )
    return out, scales


def _axis_taps(
    n_in: int, n_out: int, scale: Optional[float], mode: str, device, dtype, onnx_rule: bool
):
    """Per output index along one axis: (i0, i1, w0, w1) with value = w0 * x[i0] + w1 * x[i1]."""
    o = torch.arange(n_out, device=device, dtype=dtype)
    onnx_pytorch = onnx_rule and mode == "pytorch_half_pixel"
    if mode == "align_corners":
        step = (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
        x = o * step
    elif mode == "pytorch_half_pixel" and n_in == n_out and not onnx_rule:
        x = o  # F.interpolate copies an axis that keeps its length, even when scale_factor != 1
    elif onnx_pytorch and n_out == 1:
        x = torch.zeros_like(o)
    else:
        step = 1.0 / scale if scale is not None else n_in / n_out
        x = o * step if mode == "asymmetric" else (o + 0.5) * step - 0.5
    x = x.clamp(0, n_in - 1)
    i0 = x.floor().long()
    i1 = (i0 + 1).clamp(max=n_in - 1)
    w1 = x - i0.to(dtype)
    return i0, i1, 1 - w1, w1


def upsample_bilinear_reference(
    input: torch.Tensor,
    size: Optional[_Size] = None,
    scale_factor: Optional[_Scale] = None,
    mode: str = "pytorch_half_pixel",
    *,
    onnx_rule: bool = False,
) -> torch.Tensor:
    """Pure-PyTorch bilinear resize (gathers along H, then W; differentiable). Same contract as
    upsample_bilinear. `onnx_rule`: ONNX Resize's arithmetic of `mode`, what an exported graph
    computes (it differs only for "pytorch_half_pixel", which in ONNX samples index 0 on an output
    axis of length 1 and resamples an axis whose length a scale factor != 1 leaves unchanged)."""
    (out_h, out_w), (scale_h, scale_w) = resolve_output(input, size, scale_factor, mode)
    compute = torch.float64 if input.dtype == torch.float64 else torch.float32
    x = input.to(compute)
    in_h, in_w, device = input.shape[2], input.shape[3], input.device
    h0, h1, hw0, hw1 = _axis_taps(in_h, out_h, scale_h, mode, device, compute, onnx_rule)
    w0, w1, ww0, ww1 = _axis_taps(in_w, out_w, scale_w, mode, device, compute, onnx_rule)
    rows = x.index_select(2, h0) * hw0[:, None] + x.index_select(2, h1) * hw1[:, None]
    out = rows.index_select(3, w0) * ww0 + rows.index_select(3, w1) * ww1
    return out.to(input.dtype).contiguous(memory_format=memory_format_of(input))


def upsample_bilinear(
    input: torch.Tensor,
    size: Optional[_Size] = None,
    scale_factor: Optional[_Scale] = None,
    mode: str = "pytorch_half_pixel",
) -> torch.Tensor:
    """Bilinear resize of `input` (N x C x H x W, float32/float16/bfloat16/float64, CPU or CUDA).

    Give exactly one of `size` (int or (H, W)) and `scale_factor` (float or (sh, sw); the output
    size is floor(in * scale_factor)). `mode` is one of MODES (see the module docstring). Returns
    N x C x H' x W' in the input's dtype; channels_last inputs give channels_last outputs.
    Differentiable. "pytorch_half_pixel" equals F.interpolate(mode="bilinear", align_corners=False)
    (with or without recompute_scale_factor), an output axis of length 1 included; "half_pixel"
    equals it except that it resamples an axis whose length a scale factor != 1 leaves unchanged
    (ONNX Resize's rule, which F.interpolate does not follow); "align_corners" equals
    align_corners=True.
    """
    out_size, (scale_h, scale_w) = resolve_output(input, size, scale_factor, mode)
    if _ext.use_reference("upsample_bilinear"):
        return upsample_bilinear_reference(input, size, scale_factor, mode)
    _ext.check_device("upsample_bilinear", input)
    return torch.ops.lss.upsample_bilinear(input, list(out_size), scale_h, scale_w, mode)


class UpsampleBilinear(nn.Module):
    """Module form of upsample_bilinear, e.g. UpsampleBilinear(scale_factor=2,
    mode="align_corners")."""

    def __init__(
        self,
        size: Optional[_Size] = None,
        scale_factor: Optional[_Scale] = None,
        mode: str = "pytorch_half_pixel",
    ):
        super().__init__()
        if (size is None) == (scale_factor is None):
            raise ValueError(
                "UpsampleBilinear: give exactly one of size and scale_factor, got "
                f"size={size!r}, scale_factor={scale_factor!r}"
            )
        if mode not in MODES:
            raise ValueError(
                f"UpsampleBilinear: unknown mode {mode!r}; expected one of {', '.join(MODES)}"
            )
        self.size = size
        self.scale_factor = scale_factor
        self.mode = mode

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return upsample_bilinear(input, self.size, self.scale_factor, self.mode)

    def extra_repr(self) -> str:
        what = (
            f"size={self.size!r}"
            if self.size is not None
            else f"scale_factor={self.scale_factor!r}"
        )
        return f"{what}, mode={self.mode!r}"


def _backward(ctx, grad_output: torch.Tensor):
    grad_input = torch.ops.lss._upsample_bilinear_backward(
        grad_output, ctx.input_size, ctx.scale_h, ctx.scale_w, ctx.mode
    )
    return grad_input, None, None, None, None


def _setup_context(ctx, inputs, output):
    input, _, scale_h, scale_w, mode = inputs
    ctx.input_size = list(input.shape)
    ctx.scale_h, ctx.scale_w, ctx.mode = scale_h, scale_w, mode


def _backward_backward(ctx, grad_grad_input: torch.Tensor):
    # The backward is linear in grad_output, and its adjoint is the forward resize.
    grad = torch.ops.lss.upsample_bilinear(
        grad_grad_input, ctx.output_size, ctx.scale_h, ctx.scale_w, ctx.mode
    )
    return grad, None, None, None, None


def _setup_backward_context(ctx, inputs, output):
    grad_output, _, scale_h, scale_w, mode = inputs
    ctx.output_size = list(grad_output.shape[2:])
    ctx.scale_h, ctx.scale_w, ctx.mode = scale_h, scale_w, mode


if _ext.has_ext():

    @torch.library.register_fake("lss::upsample_bilinear")
    def _upsample_bilinear_fake(input, output_size, scales_h, scales_w, mode):
        torch._check(
            input.dim() == 4,
            lambda: f"upsample_bilinear: input must be 4-D, got {tuple(input.shape)}",
        )
        shape = (input.shape[0], input.shape[1], output_size[0], output_size[1])
        return input.new_empty(shape).contiguous(memory_format=memory_format_of(input))

    @torch.library.register_fake("lss::_upsample_bilinear_backward")
    def _upsample_bilinear_backward_fake(grad_output, input_size, scales_h, scales_w, mode):
        return grad_output.new_empty(tuple(input_size)).contiguous(
            memory_format=memory_format_of(grad_output)
        )

    torch.library.register_autograd(
        "lss::upsample_bilinear", _backward, setup_context=_setup_context
    )
    torch.library.register_autograd(
        "lss::_upsample_bilinear_backward",
        _backward_backward,
        setup_context=_setup_backward_context,
    )
