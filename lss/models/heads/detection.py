"""3D object detection on the BEV features: CenterPoint-style centre heatmaps and box regression,
decoding by top-K heatmap peaks and batched NMS, and a second stage that pools the BEV features
around each proposal with RoIAlign and refines its score and box with a small MLP. Boxes and their
coding: lss.geometry.boxes."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lss.geometry.boxes import (
    BOX_DIM,
    BOX_POINTS,
    DETECTION_CLASSES,
    REFINE_TARGET_KEYS,
    REGRESSION_CHANNELS,
    apply_residuals,
    bev_envelopes,
    box_points,
    regression_to_boxes,
)
from lss.geometry.proposals import Proposals, jitter_boxes, pad_boxes
from lss.models.heads.camera_cues import CUE_CHANNELS, depth_cues, image_features
from lss.config import Config, DetectionConfig
from lss.geometry import BevGrid
from lss.models.blocks import conv_bn_relu
from lss.ops import batched_nms, roi_align


# --------------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------------


def decode_peaks(
    heatmap_logits: torch.Tensor, regression: torch.Tensor, grid: BevGrid, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top_k local maxima (3 x 3) over all classes of each sample's heatmap.

    heatmap_logits B x K x H x W, regression B x 10 x H x W on the H x W map of `grid`. Returns
    boxes B x k x 9 (ego frame), scores B x k (sigmoid probabilities, descending), labels B x k
    (int64), with k = min(top_k, K H W)."""
    if (
        heatmap_logits.dim() != 4
        or regression.dim() != 4
        or regression.shape[1] != len(REGRESSION_CHANNELS)
        or heatmap_logits.shape[0] != regression.shape[0]
        or heatmap_logits.shape[2:] != regression.shape[2:]
    ):
        raise ValueError(
            f"decode_peaks: expected heatmap B x K x H x W and regression B x "
            f"{len(REGRESSION_CHANNELS)} x H x W, got {tuple(heatmap_logits.shape)} and "
            f"{tuple(regression.shape)}"
        )
    B, K, H, W = heatmap_logits.shape
    heat = torch.sigmoid(heatmap_logits.float())
    peaks = heat * (heat == F.max_pool2d(heat, 3, stride=1, padding=1))
    k = min(top_k, K * H * W)
    scores, index = peaks.reshape(B, -1).topk(k, dim=1)
    labels = index // (H * W)
    cell = index % (H * W)
    row, col = cell // W, cell % W
    values = regression.float().reshape(B, len(REGRESSION_CHANNELS), H * W)
    values = values.gather(2, cell.unsqueeze(1).expand(-1, len(REGRESSION_CHANNELS), -1)).transpose(
        1, 2
    )
    return regression_to_boxes(values, row, col, grid), scores, labels


def _pad_per_sample(
    batch_index: torch.Tensor, order_key: torch.Tensor, batch: int, limit: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slots for items grouped by sample and ranked by descending `order_key`: returns (item,
    sample, slot) for the first `limit` items of each sample."""
    order = torch.argsort(order_key, descending=True)
    order = order[torch.argsort(batch_index[order], stable=True)]
    sample = batch_index[order]
    counts = torch.bincount(sample, minlength=batch)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(len(order), device=order.device) - starts[sample]
    keep = slot < limit
    return order[keep], sample[keep], slot[keep]


def propose(
    heatmap_logits: torch.Tensor,
    regression: torch.Tensor,
    grid: BevGrid,
    cfg: DetectionConfig,
    max_per_sample: int,
) -> Proposals:
    """First-stage detections: top-K peaks, score threshold, per-class batched NMS on the BEV
    envelopes (ego metres, negative coordinates included), then the best `max_per_sample` of each
    sample."""
    B = heatmap_logits.shape[0]
    boxes, scores, labels = decode_peaks(heatmap_logits, regression, grid, cfg.top_k)
    num_classes = heatmap_logits.shape[1]
    batch_index = torch.arange(B, device=boxes.device).view(B, 1).expand_as(labels)
    keep = scores > cfg.score_threshold
    boxes, scores, labels, batch_index = boxes[keep], scores[keep], labels[keep], batch_index[keep]
    if cfg.nms_iou > 0 and len(scores):
        kept = batched_nms(
            bev_envelopes(boxes), scores, batch_index * num_classes + labels, cfg.nms_iou
        )
        boxes, scores, labels, batch_index = (
            boxes[kept],
            scores[kept],
            labels[kept],
            batch_index[kept],
        )
    item, sample, slot = _pad_per_sample(batch_index, scores, B, max_per_sample)
    P = int(slot.max()) + 1 if len(slot) else 0
    out = Proposals.zeros(B, P, boxes.device)
    out.boxes[sample, slot] = boxes[item]
    out.scores[sample, slot] = scores[item]
    out.labels[sample, slot] = labels[item]
    out.valid[sample, slot] = True
    return out


def training_proposals(
    heatmap_logits: torch.Tensor, regression: torch.Tensor, grid: BevGrid, cfg: DetectionConfig
) -> Proposals:
    """The second stage's proposals while training, in fixed shapes (a captured step can run
    them): the detection.refine_proposals best heatmap peaks of each sample, valid above
    detection.score_threshold, without NMS (overlapping proposals are more training examples)."""
    boxes, scores, labels = decode_peaks(heatmap_logits, regression, grid, cfg.refine_proposals)
    return Proposals(boxes, scores, labels, scores > cfg.score_threshold)


def score_by_heatmap(
    proposals: Proposals, heatmap_logits: torch.Tensor, grid: BevGrid
) -> Proposals:
    """The proposals with the first-stage score (sigmoid of the heatmap B x K x H x W at their class
    and centre cell) as the score of the valid ones; each valid proposal's centre must lie on the
    grid's H x W map. Fixed shapes, no host sync."""
    K, H, W = heatmap_logits.shape[1:]
    u, v = grid.xy_to_cells(proposals.boxes[..., 0], proposals.boxes[..., 1])
    row = torch.floor(u).long().clamp(0, H - 1)
    col = torch.floor(v).long().clamp(0, W - 1)
    cell = (proposals.labels.clamp(0, K - 1) * H + row) * W + col
    peak = heatmap_logits.detach().float().flatten(1).gather(1, cell)
    scores = torch.where(proposals.valid, torch.sigmoid(peak), proposals.scores)
    return Proposals(proposals.boxes, scores, proposals.labels, proposals.valid)


def decode_detections(outputs: dict, config: Config) -> list[dict]:
    """Final boxes of each sample from the head's outputs (in eval mode): a list of dicts with
    "boxes" M x 9 (ego frame), "scores" M (descending) and "labels" M (int64 into
    DETECTION_CLASSES).

    With the second stage the proposals' boxes get the residuals (of detection.refine_residuals)
    and the score is
    first stage^(1 - a) x second stage^a (a = detection.refine_score_alpha); without it the
    first-stage proposals are the detections."""
    cfg = config.detection
    if "det_refine_scores" in outputs:
        proposals = outputs["det_proposals"]
        boxes = apply_residuals(
            proposals.boxes, outputs["det_refine_residuals"].detach(), cfg.refine_residuals
        )
        alpha = cfg.refine_score_alpha
        quality = torch.sigmoid(outputs["det_refine_scores"].detach().float())
        scores = proposals.scores.clamp(min=0) ** (1 - alpha) * quality**alpha
        valid = proposals.valid
        labels = proposals.labels
    else:
        grid = BevGrid.from_config(config.grid).with_shape(outputs["det_heatmap"].shape[-2:])
        proposals = propose(
            outputs["det_heatmap"].detach(),
            outputs["det_regression"].detach(),
            grid,
            cfg,
            cfg.max_detections,
        )
        boxes, scores, valid, labels = (
            proposals.boxes,
            proposals.scores,
            proposals.valid,
            proposals.labels,
        )
    detections = []
    for b in range(valid.shape[0]):
        keep = valid[b]
        order = torch.argsort(scores[b][keep], descending=True)[: cfg.max_detections]
        detections.append(
            {
                "boxes": boxes[b][keep][order],
                "scores": scores[b][keep][order],
                "labels": labels[b][keep][order],
            }
        )
    return detections


# --------------------------------------------------------------------------------------------------
# Second stage
# --------------------------------------------------------------------------------------------------


def proposal_rois(
    proposals: Proposals, grid: BevGrid, enlarge: float, min_cells: float = 2.0
) -> torch.Tensor:
    """RoIAlign boxes (B P) x 5 [batch, x1, y1, x2, y2], one per proposal slot (valid or not), in
    the cell units of the grid's map with RoIAlign's x along the columns (ego y) and y along the
    rows (ego x): each the proposal's axis-aligned envelope scaled by `enlarge` and at least
    `min_cells` wide."""
    B, P = proposals.valid.shape
    env = bev_envelopes(proposals.boxes.reshape(B * P, BOX_DIM), enlarge)
    centre_x, centre_y = (env[:, 0] + env[:, 2]) / 2, (env[:, 1] + env[:, 3]) / 2
    half_rows = torch.clamp((env[:, 2] - env[:, 0]) / (2 * grid.cell_size[0]), min=min_cells / 2)
    half_cols = torch.clamp((env[:, 3] - env[:, 1]) / (2 * grid.cell_size[1]), min=min_cells / 2)
    u, v = grid.xy_to_cells(centre_x, centre_y)
    sample = torch.arange(B, device=env.device).repeat_interleave(P).float()
    return torch.stack([sample, v - half_cols, u - half_rows, v + half_cols, u + half_rows], dim=1)


def point_rois(proposals: Proposals, grid: BevGrid) -> torch.Tensor:
    """RoIAlign boxes (B P 5) x 5, one cell wide and centred on each BOX_POINTS point of every
    proposal slot: with a 1 x 1 output and one sample per bin, aligned RoIAlign reads the BEV
    features bilinearly at exactly that point."""
    B, P = proposals.valid.shape
    points = box_points(proposals.boxes.reshape(B * P, BOX_DIM))
    u, v = grid.xy_to_cells(points[..., 0].reshape(-1), points[..., 1].reshape(-1))
    sample = torch.arange(B, device=points.device).repeat_interleave(P * len(BOX_POINTS)).float()
    return torch.stack([sample, v - 0.5, u - 0.5, v + 0.5, u + 0.5], dim=1)


class BoxRefiner(nn.Module):
    """Second stage: BEV features read with RoIAlign for each proposal, at the box centre and its
    four face middles (features="points", CenterPoint's design) or over its enlarged axis-aligned
    envelope (features="envelope", roi_size x roi_size); an MLP on them, the class and the
    proposal's own geometry predicts a quality logit (the score) and box residuals
    (lss.geometry.boxes.box_residuals). With `camera_depth` it also reads the proposals' depth cues,
    with `image_channels` > 0 the cameras' context features (that many channels) at the box's
    BOX_POINTS (lss.models.heads.camera_cues)."""

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        roi_size: int = 7,
        hidden: int = 256,
        enlarge: float = 1.5,
        features: str = "points",
        camera_depth: bool = False,
        image_channels: int = 0,
    ):
        super().__init__()
        if features not in ("points", "envelope"):
            raise ValueError(f"BoxRefiner: features {features!r} is not one of points, envelope")
        self.num_classes = num_classes
        self.features = features
        self.roi_size = roi_size if features == "envelope" else 1
        self.enlarge = enlarge
        reads = len(BOX_POINTS) if features == "points" else roi_size * roi_size
        # one-hot class, sin/cos yaw, log size, z, velocity, score (and the camera depth cues, the
        # image features with whether a camera sees each point)
        self.camera_depth = camera_depth
        self.image_width = len(BOX_POINTS) * (image_channels + 1) if image_channels else 0
        geometry = num_classes + 9 + (CUE_CHANNELS if camera_depth else 0) + self.image_width
        self.mlp = nn.Sequential(
            nn.Linear(in_channels * reads + geometry, hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, hidden),
            nn.ReLU(inplace=True),
        )
        self.score = nn.Linear(hidden, 1)
        self.residual = nn.Linear(hidden, BOX_DIM)
        # Start as the identity on boxes, so that early training does not move the proposals around.
        nn.init.zeros_(self.residual.weight)
        nn.init.zeros_(self.residual.bias)

    def forward(
        self,
        bev_features: torch.Tensor,
        proposals: Proposals,
        grid: BevGrid,
        cues: Optional[torch.Tensor] = None,
        image: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """bev_features B x C x H x W (the H x W map of `grid`); with camera_depth the proposals'
        depth cues B x P x CUE_CHANNELS, with image_channels their image features B x P x
        len(BOX_POINTS) (image_channels + 1) (lss.models.heads.camera_cues). Returns score logits
        B x P and residuals B x P x 9, zero on invalid slots. Every slot is computed (fixed shapes,
        no host sync); invalid ones are masked."""
        B, P = proposals.valid.shape
        if self.camera_depth and (cues is None or cues.shape != (B, P, CUE_CHANNELS)):
            raise ValueError(
                f"BoxRefiner: detection.refine_depth needs the proposals' depth cues B x P x "
                f"{CUE_CHANNELS} (B x P = {B} x {P}), got "
                f"{None if cues is None else tuple(cues.shape)}: run the head through "
                "lss.models.LSS, which passes it the camera depth"
            )
        if self.image_width and (image is None or image.shape != (B, P, self.image_width)):
            raise ValueError(
                f"BoxRefiner: detection.refine_image needs the proposals' image features B x P x "
                f"{self.image_width} (B x P = {B} x {P}), got "
                f"{None if image is None else tuple(image.shape)}: run the head through "
                "lss.models.LSS, which passes it the camera features"
            )
        if P == 0:
            # Zero-valued use of every parameter: DDP expects gradients for all of them every step.
            unused = sum(p.sum() for p in self.parameters()).float() * 0
            return (
                bev_features.new_zeros(B, 0, dtype=torch.float32) + unused,
                bev_features.new_zeros(B, 0, BOX_DIM, dtype=torch.float32) + unused,
            )
        if self.features == "points":
            rois, sampling = point_rois(proposals, grid), 1
        else:
            rois, sampling = proposal_rois(proposals, grid, self.enlarge), 2
        # float32: in bf16 a roi corner near cell 200 would be off by a whole cell. validate=False
        # skips a host sync: the rois are our own decoding (batch indices by construction, boxes
        # finite unless the network's outputs are not, and then the loss stops training anyway).
        pooled = roi_align(
            bev_features.float(),
            rois,
            (self.roi_size, self.roi_size),
            spatial_scale=1.0,
            sampling_ratio=sampling,
            aligned=True,
            validate=False,
        ).reshape(B * P, -1)
        boxes = proposals.boxes.reshape(B * P, BOX_DIM)
        geometry = torch.cat(
            [
                F.one_hot(proposals.labels.reshape(-1), self.num_classes).float(),
                torch.sin(boxes[:, 6:7]),
                torch.cos(boxes[:, 6:7]),
                torch.log(boxes[:, 3:6].clamp(min=1e-3)),
                boxes[:, 2:3],
                boxes[:, 7:9],
                proposals.scores.reshape(-1, 1),
            ]
            + ([cues.reshape(B * P, CUE_CHANNELS).float()] if self.camera_depth else [])
            + ([image.reshape(B * P, self.image_width).float()] if self.image_width else []),
            dim=1,
        )
        hidden = self.mlp(torch.cat([pooled, geometry.to(pooled.dtype)], dim=1))
        valid = proposals.valid
        score_logits = torch.where(valid, self.score(hidden).float().view(B, P), 0.0)
        residuals = torch.where(
            valid.unsqueeze(-1), self.residual(hidden).float().view(B, P, BOX_DIM), 0.0
        )
        return score_logits, residuals


# --------------------------------------------------------------------------------------------------
# The head
# --------------------------------------------------------------------------------------------------


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
    heatmap), "det_refine_scores" B x P logits and "det_refine_residuals" B x P x 9.
    """

    def __init__(
        self,
        in_channels: int,
        cfg: DetectionConfig,
        grid: BevGrid,
        num_classes: int = len(DETECTION_CLASSES),
        image_channels: int = 0,
    ):
        super().__init__()
        if cfg.refine and cfg.refine_image and image_channels < 1:
            raise ValueError(
                "DetectionHead: detection.refine_image reads the cameras' context features; "
                "pass their channel count as image_channels (lss.models.LSS passes "
                "model.context_channels)"
            )
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
        for setting, key in (("refine_depth", "depth"), ("refine_image", "context")):
            if getattr(self.cfg, setting) and (cameras is None or key not in cameras):
                raise ValueError(
                    f"DetectionHead: detection.{setting} reads the cameras; pass cameras "
                    '{"depth": B x N x D x fH x fW and/or "context": B x N x C x fH x fW, '
                    '"frustum": D x fH x fW x 3, and the batch\'s calibration '
                    "(lss.geometry.RIG_KEYS)} (lss.models.LSS does)"
                )
        boxes, valid = proposals.boxes, proposals.valid
        cues = depth_cues(boxes, valid, cameras) if self.cfg.refine_depth else None
        image = image_features(box_points(boxes), valid, cameras) if self.cfg.refine_image else None
        out["det_refine_scores"], out["det_refine_residuals"] = self.refiner(
            features, proposals, grid, cues, image
        )
        return out

    def _ground_truth(self, gt_boxes, gt_labels, grid: BevGrid, device) -> Optional[Proposals]:
        """Jittered ground-truth proposals: positives for the second stage early in training."""
        if not (self.training and self.cfg.refine_gt_proposals and gt_boxes is not None):
            return None
        if gt_labels is None:
            raise ValueError("DetectionHead: gt_boxes were given without gt_labels")
        boxes, labels = padded_truth(gt_boxes, gt_labels, device)
        return jitter_boxes(boxes, labels, grid, self.num_classes)


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
