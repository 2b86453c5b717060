"""LiftSplatShoot: camera images -> depth-weighted frustum features -> BEV grid -> per-class BEV logits."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lss.boxes import Proposals, ground_truth_proposals
from lss.config import Config
from lss.geometry import BevGrid
from lss.models.bev import BevEncoder
from lss.models.camera import CameraEncoder
from lss.models.heads import DetectionHead, SegmentationHead
from lss.models.splat import Splat


class LiftSplatShoot(nn.Module):
    """forward(batch) -> {"segmentation": B x K x nx x ny logits, "depth_logits": B x N x D x fH x fW (the camera
    depth distribution before its softmax, for lidar depth supervision)}, K = len(config.data.classes); with
    "detection" in model.heads also the DetectionHead outputs ("det_heatmap", "det_regression", ...;
    lss.models.heads.detection).

    batch holds "images" B x N x 3 x H x W and the rig: "intrinsics", "sensor2ego_rot", "post_rot" (B x N x 3 x 3),
    "sensor2ego_trans", "post_trans" (B x N x 3), as produced by lss.data.collate; while training with the
    detection head's second stage, its "det_boxes"/"det_labels" (when present) give the jittered ground-truth
    proposals (detection.refine_gt_proposals).
    """

    def __init__(self, config: Config):
        super().__init__()
        model, data = config.model, config.data
        grid = BevGrid.from_config(
            config.grid
        )  # its sizes were checked when the config loaded (lss.config.validate)
        self.classes = tuple(data.classes)
        self.grid = grid
        self.refine_gt_proposals = config.detection.refine and config.detection.refine_gt_proposals
        self.splat = Splat(grid, data.final_dim, model.downsample, config.grid.dbound, model.splat)
        self.camera = CameraEncoder(
            self.splat.depth_bins,
            model.context_channels,
            model.backbone,
            model.pretrained,
            model.upsample_mode,
        )
        self.bev = BevEncoder(grid.nz * model.context_channels, model.upsample_mode)
        self.segmentation = SegmentationHead(BevEncoder.feature_channels, len(self.classes))
        self.detection = (
            DetectionHead(BevEncoder.feature_channels, config)
            if "detection" in model.heads
            else None
        )

    def forward(self, batch: dict) -> dict:
        images = batch["images"]
        if images.dim() != 5 or images.shape[2] != 3:
            raise ValueError(
                f"batch['images'] must be B x N x 3 x H x W, got {tuple(images.shape)}"
            )
        b, n = images.shape[:2]
        lut = self.splat.lut(batch)
        depth, context, depth_logits = self.camera(images.flatten(0, 1), return_logits=True)
        depth = depth.unflatten(0, (b, n))
        context = context.unflatten(0, (b, n))
        features = self.bev(self.splat(depth, context, lut))
        outputs = {
            "segmentation": self.segmentation(features),
            "depth_logits": depth_logits.unflatten(0, (b, n)),
        }
        if self.detection is not None:
            outputs.update(self.detection(features, self._ground_truth_proposals(batch, features)))
        return outputs

    def _ground_truth_proposals(self, batch: dict, features: torch.Tensor) -> Optional[Proposals]:
        """The batch's jittered ground-truth boxes for the detection head's second stage, only while training."""
        if not (self.training and self.refine_gt_proposals and "det_boxes" in batch):
            return None
        grid = self.grid.with_shape(features.shape[-2:])
        with torch.no_grad():
            return ground_truth_proposals(
                batch["det_boxes"],
                batch["det_labels"],
                grid,
                self.detection.num_classes,
                features.device,
            )
