"""3D object detection on the BEV features: a CenterPoint-style head (centre heatmaps and box
regression) with an optional second stage (lss.models.heads.box_refiner) on its proposals
(lss.models.heads.detection_decode). Boxes and their coding: lss.geometry.boxes."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import nn

from lss.config import DetectionConfig
from lss.geometry import BevGrid
from lss.geometry.boxes import (
    BOX_DIM,
    DETECTION_CLASSES,
    REFINE_TARGET_KEYS,
    REGRESSION_CHANNELS,
    box_points,
)
from lss.geometry.ego_motion import KEY_FRAME_INTERVAL
from lss.geometry.proposals import Proposals, jitter_boxes, pad_boxes
from lss.models.blocks import conv_bn_relu
from lss.models.heads.box_refiner import BoxRefiner, motion_reads
from lss.models.heads.camera_cues import depth_cues, image_features
from lss.models.heads.detection_decode import propose, score_by_heatmap, training_proposals


class DetectionHead(nn.Module):
    """CenterPoint-style head on B x C x H x W BEV features (H x W covering the x/y bounds of
    `grid`), configured by `cfg` (config.detection).

    forward(bev_features, extra_proposals=None, gt_boxes=None, gt_labels=None) returns
    "det_heatmap" B x K x H x W logits and "det_regression" B x 10 x H x W (REGRESSION_CHANNELS);
    with cfg.refine also "det_proposals" (Proposals: the detached first-stage boxes (while
    training: training_proposals, fixed shapes; in eval: propose, with NMS), followed by
    `extra_proposals` and, while training with cfg.refine_gt_proposals, jittered copies of the
    ground truth (gt_boxes / gt_labels: padded B x M x 9 / B x M tensors with label -1 on padding,
    as the dataset's dense targets, or one M_b x 9 / M_b tensor per sample), all scored by the
    heatmap), "det_refine_scores" B x P logits and "det_refine_residuals" B x P x 9, with
    cfg.refine_reversal "det_refine_reversal" B x P logits (the proposal faces the wrong way).
    With cfg.refine_motion_grid the second stage also reads `frames` (this frame's and the
    previous frame's splatted grids, `grid_channels` channels each) around each proposal,
    `motion_interval` seconds apart (box_refiner.motion_reads).
    """

    def __init__(
        self,
        in_channels: int,
        cfg: DetectionConfig,
        grid: BevGrid,
        num_classes: int = len(DETECTION_CLASSES),
        image_channels: int = 0,
        grid_channels: int = 0,
        motion_interval: float = KEY_FRAME_INTERVAL,
    ):
        super().__init__()
        for setting, reads, argument, passed, channels in (
            (
                "refine_image",
                "the cameras' context features",
                "image_channels",
                "model.context_channels",
                image_channels,
            ),
            (
                "refine_motion_grid",
                "both frames' splatted grids",
                "grid_channels",
                "grid.nz x model.context_channels",
                grid_channels,
            ),
        ):
            if cfg.refine and getattr(cfg, setting) and channels < 1:
                raise ValueError(
                    f"DetectionHead: detection.{setting} reads {reads}; pass their channel count "
                    f"as {argument} (lss.models.LSS passes {passed})"
                )
        self.motion_interval = motion_interval
        self.cfg = cfg
        self.grid = grid
        self.num_classes = num_classes
        hc = cfg.head_channels
        self.shared = nn.Sequential(*conv_bn_relu(in_channels, hc))
        self.heatmap = nn.Sequential(*conv_bn_relu(hc, hc), nn.Conv2d(hc, num_classes, 1))
        self.regression = nn.Sequential(
            *conv_bn_relu(hc, hc), nn.Conv2d(hc, len(REGRESSION_CHANNELS), 1)
        )
        # Heatmap prior 0.1 (focal-loss practice): the loss starts small on the mostly empty map.
        nn.init.constant_(self.heatmap[-1].bias, -math.log((1 - 0.1) / 0.1))
        self.refiner = (
            BoxRefiner(
                hc,
                num_classes,
                cfg.roi_size,
                cfg.refine_hidden,
                cfg.roi_enlarge,
                cfg.refine_features,
                cfg.refine_depth,
                image_channels if cfg.refine_image else 0,
                cfg.refine_motion,
                cfg.refine_reversal,
                grid_channels if cfg.refine_motion_grid else 0,
            )
            if cfg.refine
            else None
        )

    def forward(
        self,
        bev_features: torch.Tensor,
        extra_proposals: Optional[Proposals] = None,
        gt_boxes: Optional[torch.Tensor | Sequence[torch.Tensor]] = None,
        gt_labels: Optional[torch.Tensor | Sequence[torch.Tensor]] = None,
        cameras: Optional[dict] = None,
        frames: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> dict:
        if bev_features.dim() != 4:
            raise ValueError(
                "DetectionHead: expected BEV features B x C x H x W, got "
                f"{tuple(bev_features.shape)}"
            )
        features = self.shared(bev_features)
        out = {"det_heatmap": self.heatmap(features), "det_regression": self.regression(features)}
        if self.refiner is None:
            return out
        grid = self.grid.with_shape(bev_features.shape[-2:])
        with torch.no_grad():
            heat, regression = out["det_heatmap"], out["det_regression"]
            if self.training:
                proposals = training_proposals(heat, regression, grid, self.cfg)
            else:
                proposals = propose(heat, regression, grid, self.cfg, self.cfg.max_detections)
            truth = self._ground_truth(gt_boxes, gt_labels, grid, bev_features.device)
            for extra in (extra_proposals, truth):
                if extra is not None:
                    proposals = proposals.cat(score_by_heatmap(extra, heat, grid))
        out["det_proposals"] = proposals
        for setting, key in (
            ("refine_depth", "depth"),
            ("refine_image", "context"),
            ("refine_motion", "previous"),
        ):
            if getattr(self.cfg, setting) and (cameras is None or key not in cameras):
                raise ValueError(
                    f"DetectionHead: detection.{setting} reads the cameras; pass cameras "
                    '{"depth": B x N x D x fH x fW and/or "context": B x N x C x fH x fW, '
                    '"frustum": D x fH x fW x 3, the batch\'s calibration (lss.geometry.RIG_KEYS) '
                    'and for refine_motion "previous": the previous frame\'s "depth", "frustum" '
                    "and calibration in the current ego frame} (lss.models.LSS does)"
                )
        boxes, valid = proposals.boxes, proposals.valid
        # this frame's cameras, then the previous frame's (BoxRefiner's order)
        sources = [cameras] if self.cfg.refine_depth else []
        sources += [cameras["previous"]] if self.cfg.refine_motion else []
        cues = torch.cat([depth_cues(boxes, valid, c) for c in sources], -1) if sources else None
        image = image_features(box_points(boxes), valid, cameras) if self.cfg.refine_image else None
        motion = None
        if self.cfg.refine_motion_grid:
            if frames is None or len(frames) != 2:
                raise ValueError(
                    "DetectionHead: detection.refine_motion_grid reads both frames' splatted "
                    "grids; pass frames=(this frame's, the previous frame's), each B x C x nx x ny "
                    "in this frame's ego frame (lss.models.LSS does)"
                )
            splat_grid = self.grid.with_shape(frames[0].shape[-2:])
            motion = motion_reads(*frames, boxes, splat_grid, self.motion_interval)
        scores, residuals, reversal = self.refiner(features, proposals, grid, cues, image, motion)
        out["det_refine_scores"], out["det_refine_residuals"] = scores, residuals
        if reversal is not None:
            out["det_refine_reversal"] = reversal
        return out

    def _ground_truth(self, gt_boxes, gt_labels, grid: BevGrid, device) -> Optional[Proposals]:
        """Jittered ground-truth proposals: positives for the second stage early in training."""
        if not (self.training and self.cfg.refine_gt_proposals and gt_boxes is not None):
            return None
        if gt_labels is None:
            raise ValueError("DetectionHead: gt_boxes were given without gt_labels")
        boxes, labels = padded_truth(gt_boxes, gt_labels, device)
        turn = self.cfg.refine_reversal_share if self.cfg.refine_reversal else 0.0
        return jitter_boxes(boxes, labels, grid, self.num_classes, turn_share=turn)


def batch_ground_truth(batch: dict) -> tuple:
    """A batch's ground truth for the second stage, (boxes, labels): the dataset's padded dense
    targets where present (REFINE_TARGET_KEYS, fixed shapes: what a captured step holds), else
    "det_boxes" / "det_labels" (one tensor per sample); (None, None) without either."""
    keys = REFINE_TARGET_KEYS if REFINE_TARGET_KEYS[0] in batch else ("det_boxes", "det_labels")
    return batch.get(keys[0]), batch.get(keys[1])


def padded_truth(
    gt_boxes: torch.Tensor | Sequence[torch.Tensor],
    gt_labels: torch.Tensor | Sequence[torch.Tensor],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ground truth as padded B x M x 9 boxes and B x M labels (-1 on padding) on `device`: given
    so (the dataset's dense targets) or as one M_b x 9 / M_b tensor per sample."""
    if torch.is_tensor(gt_boxes):
        if gt_boxes.dim() != 3 or gt_boxes.shape[-1] != BOX_DIM or not torch.is_tensor(gt_labels):
            raise ValueError(
                f"DetectionHead: padded ground truth must be B x M x {BOX_DIM} boxes with B x M "
                f"labels, got {tuple(gt_boxes.shape)}"
            )
        return gt_boxes.to(device, torch.float32), gt_labels.to(device, torch.long)
    return pad_boxes(gt_boxes, gt_labels, device)
