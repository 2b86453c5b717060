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
    REFINE_TARGET_KEYS,
    RESIDUAL_WEIGHT_CHANNELS,
    box_residuals,
    encode_targets,
    pad_targets,
    reversed_heading,
    turn_around,
)
from lss.config import Config
from lss.geometry import BevGrid
from lss.geometry.proposals import Proposals
from lss.models.heads.detection import batch_ground_truth, padded_truth
from lss.ops import sigmoid_focal_loss


# the centre distances (m) at which the nuScenes detection evaluation matches a box to the truth
NUSCENES_MATCH_DISTANCES = (0.5, 1.0, 2.0, 4.0)


def match_proposals(
    proposals: Proposals,
    gt_boxes: torch.Tensor | Sequence[torch.Tensor],
    gt_labels: torch.Tensor | Sequence[torch.Tensor],
    match_distance: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Nearest same-class ground truth (BEV centre distance) of every proposal; the ground truth
    padded (B x M x 9, labels B x M, -1 on padding) or one M_b x 9 / M_b tensor per sample.

    Returns the matched boxes B x P x 9 (the proposal itself where there is no positive match), the
    distances B x P (inf without a same-class box) and the positives B x P (valid and closer than
    match_distance). Fixed shapes, no host sync."""
    boxes, labels = padded_truth(gt_boxes, gt_labels, proposals.boxes.device)
    B, P = proposals.valid.shape
    if boxes.shape[1] == 0 or P == 0:
        return (
            proposals.boxes.clone(),
            proposals.boxes.new_full((B, P), math.inf),
            torch.zeros(B, P, dtype=torch.bool, device=proposals.boxes.device),
        )
    distance = torch.cdist(proposals.boxes[..., :2], boxes[..., :2])
    same_class = proposals.labels.unsqueeze(2) == labels.unsqueeze(1)
    distance = torch.where(same_class, distance, math.inf)
    nearest, index = distance.min(dim=2)
    positive = proposals.valid & (nearest < match_distance)
    matched = boxes.gather(1, index.unsqueeze(2).expand(-1, -1, BOX_DIM))
    matched = torch.where(positive.unsqueeze(-1), matched, proposals.boxes)
    return matched, nearest, positive


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
    the quality target of detection.refine_quality) and "det_refine_box" (weighted L1 of the
    residuals of the positive proposals).

    `code_weights`, `class_weights`: detection.code_weights and detection.heatmap_class_weights as
    tensors on the device (made here when None; a captured training step passes buffers, as it
    cannot copy from the host)."""
    cfg = config.detection
    refine = "det_refine_scores" in outputs
    has_boxes = "det_boxes" in batch and "det_labels" in batch
    if not has_boxes and (
        DENSE_TARGET_KEYS[0] not in batch or (refine and REFINE_TARGET_KEYS[0] not in batch)
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
        losses.update(
            refine_loss(outputs, batch, cfg.match_distance, code_weights, cfg.refine_quality)
        )
        losses = {
            k: cfg.refine_weight * v if k.startswith("det_refine") else v for k, v in losses.items()
        }
    return losses


def quality_target(distance: torch.Tensor, match_distance: float, kind: str) -> torch.Tensor:
    """The second stage's score target from each proposal's distance (m, inf without a same-class
    box) to its nearest same-class ground truth: "distance", max(0, 1 - distance /
    match_distance); "thresholds", the share of NUSCENES_MATCH_DISTANCES within which the proposal
    would be a true positive (1, 0.75, 0.5, 0.25 or 0)."""
    if kind == "distance":
        return torch.clamp(1 - distance / match_distance, min=0.0)
    if kind == "thresholds":
        hits = [(distance < t).float() for t in NUSCENES_MATCH_DISTANCES]
        return torch.stack(hits).mean(0)
    raise ValueError(f"refine quality {kind!r}: expected distance or thresholds")


def refine_loss(
    outputs: dict,
    batch: dict,
    match_distance: float,
    code_weights: torch.Tensor,
    quality: str = "distance",
) -> dict[str, torch.Tensor]:
    """The second stage's terms, unweighted, in fixed shapes (no host sync): "det_refine_score",
    BCE of the quality logit towards quality_target (`quality`: detection.refine_quality) of the
    distance to the nearest same-class ground truth, per valid proposal; "det_refine_box", L1 of
    the residuals of the positive proposals (within match_distance) weighted by code_weights (the
    unknown velocities of some ground truth weigh 0), per positive. With "det_refine_reversal" in
    `outputs` also "det_refine_reversal", BCE of that logit towards whether the positive faces the
    wrong way (lss.geometry.boxes.reversed_heading), per positive; the residuals are then those of
    the proposal turned around where it does (what decode_detections applies them to)."""
    proposals = outputs["det_proposals"]
    gt_boxes, gt_labels = batch_ground_truth(batch)
    matched, distance, positive = match_proposals(proposals, gt_boxes, gt_labels, match_distance)
    valid = proposals.valid.float()
    score_target = quality_target(distance, match_distance, quality)
    score = F.binary_cross_entropy_with_logits(
        outputs["det_refine_scores"], score_target, reduction="none"
    )
    reversal = outputs.get("det_refine_reversal")
    start = proposals.boxes
    if reversal is not None:
        reversed_ = reversed_heading(proposals.boxes, matched) & positive
        start = turn_around(proposals.boxes, reversed_)
    residual_target = box_residuals(start, matched)
    # by slices: indexing by a list would copy the list from the host (a captured step cannot)
    weight = (
        torch.cat([code_weights[i : i + 1] for i in RESIDUAL_WEIGHT_CHANNELS])
        * torch.isfinite(residual_target).float()
        * positive.unsqueeze(-1).float()
    )
    box_l1 = (outputs["det_refine_residuals"] - torch.nan_to_num(residual_target)).abs() * weight
    positives = positive.sum().clamp(min=1)
    terms = {
        "det_refine_score": (score * valid).sum() / valid.sum().clamp(min=1),
        "det_refine_box": box_l1.sum() / positives,
    }
    if reversal is not None:
        turned = F.binary_cross_entropy_with_logits(
            reversal.float(), reversed_.float(), reduction="none"
        )
        terms["det_refine_reversal"] = (turned * positive.float()).sum() / positives
    return terms


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
