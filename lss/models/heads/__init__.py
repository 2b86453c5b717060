"""Heads on the BEV features, as peers: each forward sees features only, its loss (lss.engine) sees the targets."""

from lss.models.heads.detection import DetectionHead
from lss.models.heads.segmentation import SegmentationHead

__all__ = ["DetectionHead", "SegmentationHead"]
