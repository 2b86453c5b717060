"""Decoding the detection head's outputs into boxes: the top-K local maxima of the centre
heatmaps with their regressed boxes, per-class batched NMS on the BEV envelopes (the first stage's
proposals), the fixed-shape proposals the second stage trains on, and the final detections with
the second stage's residuals and score. Boxes and their coding: lss.geometry.boxes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lss.config import Config, DetectionConfig
from lss.geometry import BevGrid
from lss.geometry.boxes import (
    REGRESSION_CHANNELS,
    apply_residuals,
    bev_envelopes,
    regression_to_boxes,
    turn_around,
)
from lss.geometry.proposals import Proposals
from lss.ops import batched_nms


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

    With the second stage the proposals' boxes (turned around where the second stage calls them
    reversed, with detection.refine_reversal) get the residuals (of detection.refine_residuals)
    and the score is
    first stage^(1 - a) x second stage^a (a = detection.refine_score_alpha); without it the
    first-stage proposals are the detections."""
    cfg = config.detection
    if "det_refine_scores" in outputs:
        proposals = outputs["det_proposals"]
        start = proposals.boxes
        if "det_refine_reversal" in outputs:
            start = turn_around(start, outputs["det_refine_reversal"].detach() > 0)
        residuals = outputs["det_refine_residuals"].detach()
        boxes = apply_residuals(start, residuals, cfg.refine_residuals)
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
