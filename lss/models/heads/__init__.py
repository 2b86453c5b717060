"""Heads on the BEV features, as peers, each with its loss beside it: a head's forward sees features
(and, for the detection head's second stage, the ground-truth boxes it is handed), its loss sees the
targets."""

from lss.models.heads.detection import DetectionHead
from lss.models.heads.detection_loss import DetectionLoss
from lss.models.heads.segmentation import SegmentationHead, SegmentationLoss

__all__ = ["DetectionHead", "DetectionLoss", "SegmentationHead", "SegmentationLoss"]
