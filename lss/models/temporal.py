"""Two frames (model.temporal.frames: 2): the previous sample's camera features, splatted into the
current BEV grid through the ego motion, fused with the current sample's before the BEV encoder
(BEVDet4D)."""

from __future__ import annotations

import torch
from torch import nn
from torchvision.models.resnet import BasicBlock

from lss.models.blocks import conv_bn_relu


class TemporalFusion(nn.Module):
    """Concatenate the current and the previous frame's splatted grids, then one 3x3 conv-BN-ReLU
    back to the BEV encoder's input channels. With `frame_blocks` > 0 each grid first goes through
    that many residual blocks (torchvision's BasicBlock, the same weights for both frames):
    BEVDet4D's extra BEV encoder, since a splatted grid is sparse and smeared along the camera
    rays, so that the concatenation compares the objects' two positions in denser features.

    forward(current B x C x nx x ny, previous B x C x nx x ny) -> B x C x nx x ny.
    """

    def __init__(self, channels: int, frame_blocks: int = 0):
        super().__init__()
        # empty (no parameters, the identity) without frame blocks: the state dict as before
        self.frame = nn.Sequential(*(BasicBlock(channels, channels) for _ in range(frame_blocks)))
        self.conv = nn.Sequential(*conv_bn_relu(2 * channels, channels))

    def forward(self, current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        if previous.shape != current.shape:
            raise ValueError(
                f"TemporalFusion: the previous frame's grid is {tuple(previous.shape)} but the "
                f"current frame's {tuple(current.shape)}; both must be B x C x nx x ny of one grid"
            )
        previous = self.frame(previous.to(current.dtype))
        return self.conv(torch.cat([self.frame(current), previous], dim=1))
