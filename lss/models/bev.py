"""BEV encoder: ResNet-18 trunk over the splatted grid, Up blocks back to full resolution (the last
one optionally fed the splatted grid itself); the heads (lss.models.heads) read its features."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torchvision.models import resnet18

from lss.models.blocks import Up, conv_bn_relu
from lss.ops import UpsampleBilinear


class BevEncoder(nn.Module):
    """forward(bev B x in_channels x nx x ny) -> features B x 128 x nx x ny; nx, ny divisible
    by 8."""

    feature_channels = 128

    def __init__(
        self,
        in_channels: int,
        upsample_mode: str = "pytorch_half_pixel",
        zero_init_residual: bool = False,
        full_res_skip: bool = False,
    ):
        super().__init__()
        # model.bev_zero_init_residual: every residual block starts as the identity
        trunk = resnet18(weights=None, zero_init_residual=zero_init_residual)
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False),
            trunk.bn1,
            trunk.relu,
        )
        self.layer1 = trunk.layer1  # stride 2, 64 channels
        self.layer2 = trunk.layer2  # stride 4, 128 channels
        self.layer3 = trunk.layer3  # stride 8, 256 channels
        self.up1 = Up(64 + 256, 256, scale_factor=4, upsample_mode=upsample_mode)
        # model.bev_full_res_skip: the last upsampling also reads the splatted grid at full
        # resolution, where objects of one or two cells (pedestrians) are still sharp; else it reads
        # only the stride-2 features
        self.full_res_skip = full_res_skip
        self.up2 = self.last_stage(in_channels, upsample_mode, full_res_skip)

    @classmethod
    def last_stage(
        cls,
        in_channels: int,
        upsample_mode: str,
        full_res_skip: bool,
        out_channels: Optional[int] = None,
    ) -> nn.Module:
        """The decoder's last stage: stride-2 features B x 256 (and with `full_res_skip` the grid)
        -> B x out_channels (default feature_channels) x nx x ny (detection.decoder: own builds a
        second one, detection.decoder_channels wide)."""
        out_channels = out_channels or cls.feature_channels
        if full_res_skip:
            return Up(in_channels + 256, out_channels, scale_factor=2, upsample_mode=upsample_mode)
        return nn.Sequential(
            UpsampleBilinear(scale_factor=2, mode=upsample_mode),
            *conv_bn_relu(256, out_channels),
        )

    def stride2(self, bev: torch.Tensor) -> torch.Tensor:
        """The stride-2 map the last stage upsamples (B x 256 x nx/2 x ny/2)."""
        x1 = self.layer1(self.stem(bev))
        return self.up1(self.layer3(self.layer2(x1)), x1)

    def forward(self, bev: torch.Tensor) -> torch.Tensor:
        joined = self.last_stage_input(self.up2, self.stride2(bev), bev)
        return self.last_stage_convs(self.up2, joined)

    def last_stage_input(
        self, stage: nn.Module, x: torch.Tensor, bev: torch.Tensor
    ) -> torch.Tensor:
        """What a last stage's convolutions read: the stride-2 map upsampled (and with
        full_res_skip the grid beside it)."""
        return stage.join(x, bev) if self.full_res_skip else stage[0](x)

    def last_stage_convs(self, stage: nn.Module, joined: torch.Tensor) -> torch.Tensor:
        return stage.conv(joined) if self.full_res_skip else stage[1:](joined)

    def for_heads(self, bev: torch.Tensor, detection_stage=None, branch=None) -> tuple:
        """(the segmentation head's features, the detection head's): with `detection_stage` (the
        detection head's own copy of the last stage, detection.decoder: own) its output on the
        shared stride-2 map and the grid, else the same features. `branch` wraps what the detection
        branch takes from the shared encoder (detection.trunk_grad_scale)."""
        branch = branch or (lambda t: t)
        if detection_stage is None:
            features = self(bev)
            return features, branch(features)
        # both last stages read the same map: upsampled and concatenated once, the detection
        # branch taken from it (the same gradients as two copies: both operations are linear)
        joined = self.last_stage_input(self.up2, self.stride2(bev), bev)
        return (
            self.last_stage_convs(self.up2, joined),
            self.last_stage_convs(detection_stage, branch(joined)),
        )
