"""Two frames (model.temporal.frames: 2): the previous sample's camera features, splatted into the
current BEV grid through the ego motion, fused with the current sample's before the BEV encoder
(BEVDet4D), optionally with a local correlation volume between the two grids (FlowNet's
correlation layer in BEV) that shows each cell where its features were one frame before."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models.resnet import BasicBlock

from lss.models.blocks import conv_bn_relu


def local_correlation(current: torch.Tensor, previous: torch.Tensor, radius: int) -> torch.Tensor:
    """B x C x H x W, B x C x H x W -> B x (2r+1)^2 x H x W: channel i*(2r+1)+j at (y, x) is the
    mean over channels of current[:, :, y, x] * previous[:, :, y + i - r, x + j - r], zero where
    the offset leaves the map. Offsets run row by row (dy outer, dx inner). Slices and sums only,
    so it differentiates, captures in a CUDA graph and exports to ONNX as it is."""
    if current.dim() != 4 or previous.shape != current.shape:
        raise ValueError(
            f"local_correlation: expected two B x C x H x W maps of one shape, got "
            f"{tuple(current.shape)} and {tuple(previous.shape)}"
        )
    if radius < 1:
        raise ValueError(f"local_correlation: radius={radius}, expected >= 1 cell")
    h, w = current.shape[-2:]
    window = 2 * radius + 1
    padded = F.pad(previous, (radius, radius, radius, radius))
    rows = []
    for dy in range(window):
        band = padded[:, :, dy : dy + h]  # B x C x H x (W + 2r)
        shifted = torch.stack([band[..., dx : dx + w] for dx in range(window)], dim=2)
        rows.append((current.unsqueeze(2) * shifted).mean(dim=1))  # B x window x H x W
    return torch.cat(rows, dim=1)


class MotionCorrelation(nn.Module):
    """model.temporal.correlation: both grids through one learnt 3x3 conv-BN-ReLU to `channels`,
    averaged over `stride` x `stride` cells, normalised per cell (cosine similarity), correlated
    within +-radius coarse cells, and the volume repeated back to the grid's cells.

    forward(current, previous: B x Cin x nx x ny) -> B x (2*radius+1)^2 x nx x ny.
    """

    def __init__(self, in_channels: int, radius: int, channels: int = 32, stride: int = 2):
        super().__init__()
        self.radius, self.stride = radius, stride
        self.embed = nn.Sequential(*conv_bn_relu(in_channels, channels))
        self.out_channels = (2 * radius + 1) ** 2

    def forward(self, current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        size = current.shape[-2:]
        if size[0] % self.stride or size[1] % self.stride:
            raise ValueError(
                f"model.temporal.correlation: the grid's {size[0]} x {size[1]} cells do not "
                f"divide into {self.stride} x {self.stride} blocks; choose grid bounds with an "
                "even number of cells per side"
            )
        embedded = [
            F.normalize(F.avg_pool2d(self.embed(grid), self.stride).float(), dim=1, eps=1e-6)
            for grid in (current, previous)
        ]
        volume = local_correlation(*embedded, self.radius) * embedded[0].shape[1]  # cosine
        volume = volume.to(current.dtype)
        return F.interpolate(volume, size=size, mode="nearest")


class TemporalFusion(nn.Module):
    """Concatenate the current and the previous frame's splatted grids, then one 3x3 conv-BN-ReLU
    back to the BEV encoder's input channels. With `frame_blocks` > 0 each grid first goes through
    that many residual blocks (torchvision's BasicBlock, the same weights for both frames):
    BEVDet4D's extra BEV encoder, since a splatted grid is sparse and smeared along the camera
    rays, so that the concatenation compares the objects' two positions in denser features. With
    `correlation` > 0 the local correlation volume of the two grids (MotionCorrelation, that
    radius in cells of twice the grid's cell size) joins the concatenation: where each cell's
    features were one frame before, which a moving object's displacement shows directly.

    forward(current B x C x nx x ny, previous B x C x nx x ny) -> B x C x nx x ny.
    """

    def __init__(self, channels: int, frame_blocks: int = 0, correlation: int = 0):
        super().__init__()
        # empty (no parameters, the identity) without frame blocks: the state dict as before
        self.frame = nn.Sequential(*(BasicBlock(channels, channels) for _ in range(frame_blocks)))
        self.correlation = MotionCorrelation(channels, correlation) if correlation else None
        extra = self.correlation.out_channels if self.correlation is not None else 0
        self.conv = nn.Sequential(*conv_bn_relu(2 * channels + extra, channels))

    def forward(self, current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        if previous.shape != current.shape:
            raise ValueError(
                f"TemporalFusion: the previous frame's grid is {tuple(previous.shape)} but the "
                f"current frame's {tuple(current.shape)}; both must be B x C x nx x ny of one grid"
            )
        previous = self.frame(previous.to(current.dtype))
        current = self.frame(current)
        grids = [current, previous]
        if self.correlation is not None:
            grids.append(self.correlation(current, previous))
        return self.conv(torch.cat(grids, dim=1))
