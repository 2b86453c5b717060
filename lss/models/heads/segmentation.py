"""BEV segmentation head: one logit map per class of data.classes from the BEV encoder's features."""

from __future__ import annotations

import torch
from torch import nn


class SegmentationHead(nn.Module):
    """forward(features B x in_channels x nx x ny) -> logits B x num_classes x nx x ny (a 1 x 1 convolution)."""

    def __init__(self, in_channels: int, num_classes: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, num_classes, kernel_size=1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.conv(features)
