"""Building blocks shared by the camera and BEV encoders."""

from __future__ import annotations

import torch
from torch import nn

from lss.ops import UpsampleBilinear
from lss.ops.upsample import memory_format_of


def conv_bn_relu(in_channels: int, out_channels: int, kernel_size: int = 3) -> list[nn.Module]:
    return [
        nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    ]


class Up(nn.Module):
    """Upsample the coarse map (bilinear, our op, in the coordinate mode `upsample_mode`),
    concatenate the skip map, then two 3x3 conv-BN-ReLU.

    forward(coarse B x Cc x h x w, skip B x Cs x (h*s) x (w*s)) -> B x out_channels x (h*s) x (w*s).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        scale_factor: int = 2,
        upsample_mode: str = "pytorch_half_pixel",
    ):
        super().__init__()
        self.upsample = UpsampleBilinear(scale_factor=scale_factor, mode=upsample_mode)
        self.conv = nn.Sequential(
            *conv_bn_relu(in_channels, out_channels), *conv_bn_relu(out_channels, out_channels)
        )

    def forward(self, coarse: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(self.join(coarse, skip))

    def join(self, coarse: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        """What the convolutions read: the skip map and the upsampled coarse map, concatenated in
        the upsampled map's dtype and memory format. (Under autocast the convolutions read bf16
        anyway; a float32 skip would otherwise make the concatenation float32 and the layouts'
        mismatch an NCHW copy, which every convolution reading it then converts again.)"""
        coarse = self.upsample(coarse)
        if coarse.shape[-2:] != skip.shape[-2:]:
            raise ValueError(
                f"Up: upsampled map is {tuple(coarse.shape[-2:])} but the skip map is "
                f"{tuple(skip.shape[-2:])}; input sizes must be divisible by the encoder's total "
                "stride"
            )
        skip = skip.to(dtype=coarse.dtype, memory_format=memory_format_of(coarse))
        return torch.cat([skip, coarse], dim=1)


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def scale_gradient(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x in the forward; the gradient flowing back through it multiplied by `scale`."""
    return _ScaleGradient.apply(x, scale)
