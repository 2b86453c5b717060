"""Losses of the 3D detection head (lss.models.heads.detection): the first stage's heatmap focal
loss and box regression against the targets of lss.geometry.boxes.encode_targets, and the second
stage's score and residuals of the proposals matched to the ground truth."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from torch import nn

from lss.geometry.boxes import (
    BOX_DIM,
    DENSE_TARGET_KEYS,
    RESIDUAL_WEIGHT_CHANNELS,
    Proposals,
    box_residuals,
    encode_targets,
    pad_targets,
)
from lss.config import Config
from lss.geometry import BevGrid
from lss.ops import sigmoid_focal_loss


def _pad_ground_truth(
    gt_boxes: Sequence[torch.Tensor], gt_labels: Sequence[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """B x M x 9 boxes and B x M labels (-1 for padding)."""
    B, M = len(gt_boxes), max((len(b) for b in gt_boxes), default=0)
    boxes = torch.zeros(B, M, BOX_DIM, device=device)
    labels = torch.full((B, M), -1, dtype=torch.long, device=device)
    for b, (bx, lb) in enumerate(zip(gt_boxes, gt_labels)):
        boxes[b, : len(bx)] = bx.to(device, torch.float32)
        labels[b, : len(lb)] = lb.to(device, torch.long)
    return boxes, labels


def match_proposals(
    proposals: Proposals,
    gt_boxes: Sequence[torch.Tensor],
    gt_labels: Sequence[torch.Tensor],
    match_distance: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Nearest same-class ground truth (BEV centre distance) of every proposal.

    Returns the matched boxes B x P x 9, the distances B x P (inf without a same-class box) and the
    positives B x P (valid and closer than match_distance)."""
    boxes, labels = _pad_ground_truth(gt_boxes, gt_labels, proposals.boxes.device)
    B, P = proposals.valid.shape
    if boxes.shape[1] == 0 or P == 0:
        return (
            proposals.boxes.new_zeros(B, P, BOX_DIM),
            proposals.boxes.new_full((B, P), math.inf),
            torch.zeros(B, P, dtype=torch.bool, device=proposals.boxes.device),
        )
    distance = torch.cdist(proposals.boxes[..., :2], boxes[..., :2])
    same_class = proposals.labels.unsqueeze(2) == labels.unsqueeze(1)
    distance = torch.where(same_class, distance, math.inf)
    nearest, index = distance.min(dim=2)
    matched = boxes.gather(1, index.unsqueeze(2).expand(-1, -1, BOX_DIM))
    return matched, nearest, proposals.valid & (nearest < match_distance)


def first_stage_targets(
    batch: dict, heatmap_logits: torch.Tensor, config: Config
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first stage's targets on the device: heatmap B x K x H x W, centre cells B x M
    (row * W + col), regression B x M x 10 and its mask B x M x 10 (0 on padding rows). From the
    batch's dense targets when the dataset made them (lss.geometry.boxes.dense_targets, while
    training), else encoded from "det_boxes" / "det_labels" by the same encoder
    (lss.geometry.boxes.encode_targets)."""
    device = heatmap_logits.device
    if DENSE_TARGET_KEYS[0] in batch:
        heat, index, target, mask = (batch[k] for k in DENSE_TARGET_KEYS)
        if tuple(heat.shape) != tuple(heatmap_logits.shape):
            raise ValueError(
                f"detection targets {tuple(heat.shape)} and heatmap logits "
                f"{tuple(heatmap_logits.shape)} differ; the dataset and the model must use the "
                "same grid and detection classes"
            )
        return (
            heat.to(device, torch.float32),
            index.to(device),
            target.to(device, torch.float32),
            mask.to(device, torch.float32),
        )
    cfg = config.detection
    grid = BevGrid.from_config(config.grid).with_shape(heatmap_logits.shape[-2:])
    targets = encode_targets(
        batch["det_boxes"],
        batch["det_labels"],
        grid,
        heatmap_logits.shape[1],
        cfg.gaussian_overlap,
        cfg.min_radius,
        device=device,
    )
    dense = pad_targets(targets, heatmap_logits.shape[0], heatmap_logits.shape[-1])
    return tuple(dense[k] for k in DENSE_TARGET_KEYS)


def detection_loss(
    outputs: dict,
    batch: dict,
    config: Config,
    code_weights: Optional[torch.Tensor] = None,
    class_weights: Optional[torch.Tensor] = None,
) -> dict[str, torch.Tensor]:
    """Weighted detection losses (sum them for the total): "det_heatmap" (penalty-reduced focal loss
    of the heatmap logits on the gaussian targets, per object), "det_regression" (weighted L1 at the
    object centres, per object) and, with the second stage, "det_refine_score" (BCE towards
    1 - distance / match_distance) and "det_refine_box" (weighted L1 of the residuals of the
    positive proposals).

    `code_weights`, `class_weights`: detection.code_weights and detection.heatmap_class_weights as
    tensors on the device (made here when None; a captured training step passes buffers, as it
    cannot copy from the host)."""
    cfg = config.detection
    refine = "det_refine_scores" in outputs
    if (refine or DENSE_TARGET_KEYS[0] not in batch) and (
        "det_boxes" not in batch or "det_labels" not in batch
    ):
        raise KeyError(
            "detection_loss: the batch has no 'det_boxes'/'det_labels'; set "
            "data.detection_targets: true so that the dataset provides the detection targets"
        )
    heatmap_logits, regression = outputs["det_heatmap"], outputs["det_regression"]
    heat, index, target, mask = first_stage_targets(batch, heatmap_logits, config)
    # without a host sync: a captured training step reads the object count on the device
    num_objects = mask[..., 0].sum().clamp(min=1)

    # CornerNet's penalty-reduced focal loss: positives at the centres, negatives down-weighted near
    centres = (heat == 1).float()
    penalty = torch.where(centres.bool(), 1.0, (1 - heat) ** 4)
    if class_weights is None and cfg.heatmap_class_weights is not None:
        class_weights = heatmap_logits.new_tensor(cfg.heatmap_class_weights, dtype=torch.float32)
    focal = sigmoid_focal_loss(
        heatmap_logits.float(),
        centres,
        alpha=cfg.focal_alpha,
        gamma=cfg.focal_gamma,
        reduction="none",
        class_weight=class_weights,
    )
    heatmap_loss = (focal * penalty).sum() / num_objects

    channels = regression.shape[1]
    predicted = (
        regression.float()
        .flatten(2)
        .gather(2, index.unsqueeze(1).expand(-1, channels, -1))
        .transpose(1, 2)
    )
    code_weights = (
        predicted.new_tensor(cfg.code_weights) if code_weights is None else code_weights.float()
    )
    l1 = (predicted - target).abs() * mask * code_weights
    losses = {
        "det_heatmap": cfg.heatmap_weight * heatmap_loss,
        "det_regression": cfg.regression_weight * l1.sum() / num_objects,
    }

    if refine:
        proposals = outputs["det_proposals"]
        matched, distance, positive = match_proposals(
            proposals, batch["det_boxes"], batch["det_labels"], cfg.match_distance
        )
        valid = proposals.valid
        score_target = torch.clamp(1 - distance / cfg.match_distance, min=0.0)
        logits = outputs["det_refine_scores"]
        score_loss = F.binary_cross_entropy_with_logits(
            logits[valid], score_target[valid], reduction="sum"
        ) / max(int(valid.sum()), 1)
        residual_target = box_residuals(proposals.boxes[positive], matched[positive])
        residual_weight = (
            code_weights[list(RESIDUAL_WEIGHT_CHANNELS)] * torch.isfinite(residual_target).float()
        )
        box_l1 = (
            outputs["det_refine_residuals"][positive] - torch.nan_to_num(residual_target)
        ).abs() * residual_weight
        losses["det_refine_score"] = cfg.refine_weight * score_loss
        losses["det_refine_box"] = cfg.refine_weight * box_l1.sum() / max(int(positive.sum()), 1)
    return losses


class DetectionLoss(nn.Module):
    """forward(outputs, batch) -> {"loss": the sum of `detection_loss`'s terms, "loss/<term>": each
    term (detached)}; detection.code_weights and heatmap_class_weights are buffers, so a captured
    training step copies nothing from the host."""

    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        det = config.detection
        self.register_buffer(
            "code_weights", torch.tensor(det.code_weights, dtype=torch.float32), persistent=False
        )
        self.register_buffer(
            "class_weights",
            None
            if det.heatmap_class_weights is None
            else torch.tensor(det.heatmap_class_weights, dtype=torch.float32),
            persistent=False,
        )

    def forward(self, outputs: dict, batch: dict) -> dict:
        terms = detection_loss(outputs, batch, self.config, self.code_weights, self.class_weights)
        out = {"loss": sum(terms.values())}
        out.update({f"loss/{k}": v.detach() for k, v in terms.items()})
        return out
