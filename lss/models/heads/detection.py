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
    DETECTION_CLASSES,
    REGRESSION_CHANNELS,
    Proposals,
    apply_residuals,
    bev_envelopes,
    ground_truth_proposals,
    regression_to_boxes,
)
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


def score_by_heatmap(
    proposals: Proposals, heatmap_logits: torch.Tensor, grid: BevGrid
) -> Proposals:
    """The proposals with the first-stage score (sigmoid of the heatmap B x K x H x W at their class
    and centre cell) as their score; each valid proposal's centre must lie on the grid's H x W
    map."""
    sample, slot = torch.nonzero(proposals.valid, as_tuple=True)
    boxes = proposals.boxes[sample, slot]
    u, v = grid.xy_to_cells(boxes[:, 0], boxes[:, 1])
    row, col = torch.floor(u).long(), torch.floor(v).long()
    peak = heatmap_logits[sample, proposals.labels[sample, slot], row, col].float()
    scores = proposals.scores.index_put((sample, slot), torch.sigmoid(peak))
    return Proposals(proposals.boxes, scores, proposals.labels, proposals.valid)


def decode_detections(outputs: dict, config: Config) -> list[dict]:
    """Final boxes of each sample from the head's outputs (in eval mode): a list of dicts with
    "boxes" M x 9 (ego frame), "scores" M (descending) and "labels" M (int64 into
    DETECTION_CLASSES).

    With the second stage the proposals' boxes get the residuals and the score is
    sqrt(first stage x second stage); without it the first-stage proposals are the detections."""
    cfg = config.detection
    if "det_refine_scores" in outputs:
        proposals = outputs["det_proposals"]
        boxes = apply_residuals(proposals.boxes, outputs["det_refine_residuals"].detach())
        scores = torch.sqrt(proposals.scores * torch.sigmoid(outputs["det_refine_scores"].detach()))
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoIAlign boxes R x 5 [batch, x1, y1, x2, y2] for the valid proposals, in the cell units of
    the grid's map with RoIAlign's x along the columns (ego y) and y along the rows (ego x); each
    the proposal's axis-aligned envelope scaled by `enlarge` and at least `min_cells` wide. Also
    returns the (sample, slot) index of each row."""
    sample, slot = torch.nonzero(proposals.valid, as_tuple=True)
    env = bev_envelopes(proposals.boxes[sample, slot], enlarge)
    centre_x, centre_y = (env[:, 0] + env[:, 2]) / 2, (env[:, 1] + env[:, 3]) / 2
    half_rows = torch.clamp((env[:, 2] - env[:, 0]) / (2 * grid.cell_size[0]), min=min_cells / 2)
    half_cols = torch.clamp((env[:, 3] - env[:, 1]) / (2 * grid.cell_size[1]), min=min_cells / 2)
    u, v = grid.xy_to_cells(centre_x, centre_y)
    rois = torch.stack(
        [sample.float(), v - half_cols, u - half_rows, v + half_cols, u + half_rows], dim=1
    )
    return rois, torch.stack([sample, slot])


class BoxRefiner(nn.Module):
    """Second stage: RoIAlign pools the BEV features over each proposal's envelope; an MLP on the
    pooled features, the class and the proposal's own geometry predicts a score logit and box
    residuals (lss.geometry.boxes.box_residuals)."""

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        roi_size: int = 7,
        hidden: int = 256,
        enlarge: float = 1.5,
    ):
        super().__init__()
        self.num_classes = num_classes
        self.roi_size = roi_size
        self.enlarge = enlarge
        geometry = (
            num_classes + 9
        )  # one-hot class, sin/cos yaw, log size, z, velocity, first-stage score
        self.mlp = nn.Sequential(
            nn.Linear(in_channels * roi_size * roi_size + geometry, hidden),
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
        self, bev_features: torch.Tensor, proposals: Proposals, grid: BevGrid
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """bev_features B x C x H x W (the H x W map of `grid`). Returns score logits B x P and
        residuals B x P x 9 (zero where invalid)."""
        B, P = proposals.valid.shape
        rois, (sample, slot) = proposal_rois(proposals, grid, self.enlarge)
        score_logits = bev_features.new_zeros(B, P, dtype=torch.float32)
        residuals = bev_features.new_zeros(B, P, BOX_DIM, dtype=torch.float32)
        if not len(rois):
            # Zero-valued use of every parameter: DDP expects gradients for all of them every step.
            unused = sum(p.sum() for p in self.parameters()).float() * 0
            return score_logits + unused, residuals + unused
        # float32: in bf16 a roi corner near cell 200 would be off by a whole cell. validate=False
        # skips a host sync: the rois are our own decoding (batch indices from nonzero(), boxes
        # finite unless the network's outputs are not, and then the loss stops training anyway).
        pooled = roi_align(
            bev_features.float(),
            rois,
            (self.roi_size, self.roi_size),
            spatial_scale=1.0,
            sampling_ratio=2,
            aligned=True,
            validate=False,
        )
        boxes = proposals.boxes[sample, slot]
        geometry = torch.cat(
            [
                F.one_hot(proposals.labels[sample, slot], self.num_classes).float(),
                torch.sin(boxes[:, 6:7]),
                torch.cos(boxes[:, 6:7]),
                torch.log(boxes[:, 3:6].clamp(min=1e-3)),
                boxes[:, 2:3],
                boxes[:, 7:9],
                proposals.scores[sample, slot].unsqueeze(1),
            ],
            dim=1,
        )
        hidden = self.mlp(torch.cat([pooled.flatten(1), geometry.to(pooled.dtype)], dim=1))
        score_logits = score_logits.index_put((sample, slot), self.score(hidden).squeeze(1).float())
        residuals = residuals.index_put((sample, slot), self.residual(hidden).float())
        return score_logits, residuals


# --------------------------------------------------------------------------------------------------
# The head
# --------------------------------------------------------------------------------------------------


class DetectionHead(nn.Module):
    """CenterPoint-style head on B x C x H x W BEV features (H x W covering the x/y bounds of
    `grid`), configured by `cfg` (config.detection).

    forward(bev_features, extra_proposals=None, gt_boxes=None, gt_labels=None) returns
    "det_heatmap" B x K x H x W logits and "det_regression" B x 10 x H x W (REGRESSION_CHANNELS);
    with cfg.refine also "det_proposals" (Proposals: the detached first-stage boxes, followed by
    `extra_proposals` and, while training with cfg.refine_gt_proposals, jittered copies of the
    ground truth gt_boxes / gt_labels (one M_b x 9 / M_b tensor per sample,
    lss.geometry.boxes.ground_truth_proposals), all scored by the heatmap), "det_refine_scores"
    B x P logits and "det_refine_residuals" B x P x 9.
    """

    def __init__(
        self,
        in_channels: int,
        cfg: DetectionConfig,
        grid: BevGrid,
        num_classes: int = len(DETECTION_CLASSES),
    ):
        super().__init__()
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
            BoxRefiner(hc, num_classes, cfg.roi_size, cfg.refine_hidden, cfg.roi_enlarge)
            if cfg.refine
            else None
        )

    def forward(
        self,
        bev_features: torch.Tensor,
        extra_proposals: Optional[Proposals] = None,
        gt_boxes: Optional[Sequence[torch.Tensor]] = None,
        gt_labels: Optional[Sequence[torch.Tensor]] = None,
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
        limit = self.cfg.refine_proposals if self.training else self.cfg.max_detections
        with torch.no_grad():
            proposals = propose(out["det_heatmap"], out["det_regression"], grid, self.cfg, limit)
            truth = self._ground_truth(gt_boxes, gt_labels, grid, bev_features.device)
            for extra in (extra_proposals, truth):
                if extra is not None:
                    proposals = proposals.cat(score_by_heatmap(extra, out["det_heatmap"], grid))
        out["det_proposals"] = proposals
        out["det_refine_scores"], out["det_refine_residuals"] = self.refiner(
            features, proposals, grid
        )
        return out

    def _ground_truth(self, gt_boxes, gt_labels, grid: BevGrid, device) -> Optional[Proposals]:
        """Jittered ground-truth proposals: positives for the second stage early in training."""
        if not (self.training and self.cfg.refine_gt_proposals and gt_boxes is not None):
            return None
        if gt_labels is None:
            raise ValueError("DetectionHead: gt_boxes were given without gt_labels")
        return ground_truth_proposals(gt_boxes, gt_labels, grid, self.num_classes, device)
