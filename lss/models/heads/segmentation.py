"""BEV segmentation: the head (one logit map per class of data.classes from the BEV encoder's
features) and its loss (our sigmoid focal loss by default, or the LSS paper's BCE with pos_weight;
optionally a soft-IoU term per class, loss.soft_iou_weights).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lss.config import Config
from lss.ops import sigmoid_focal_loss


class SegmentationHead(nn.Module):
    """forward(features B x in_channels x nx x ny) -> logits B x num_classes x nx x ny (a 1 x 1
    convolution)."""

    def __init__(self, in_channels: int, num_classes: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, num_classes, kernel_size=1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.conv(features)


class SegmentationLoss(nn.Module):
    """forward(outputs {"segmentation": B x K x nx x ny logits}, batch {"targets", optional
    "visibility_mask"}) -> {"loss": scalar, "loss/<class>": per-class scalars (detached)}.

    With a visibility mask (nx x ny per sample, 1 = counted) the loss is the mean over the visible
    cells only.
    """

    def __init__(self, config: Config):
        super().__init__()
        cfg = config.loss
        self.type = cfg.type
        self.alpha, self.gamma, self.pos_weight = cfg.focal_alpha, cfg.focal_gamma, cfg.pos_weight
        self.classes = tuple(config.data.classes)
        weights = cfg.class_weights if cfg.class_weights is not None else (1.0,) * len(self.classes)
        self.register_buffer(
            "class_weights", torch.tensor(weights, dtype=torch.float32), persistent=False
        )
        # per class (K x 1 x 1, broadcast over B x K x nx x ny): each class's positives weigh so
        # much that its probabilities are calibrated for the 0.5 threshold (docs/accuracy.md)
        pos_weights = cfg.class_pos_weights or (float(self.pos_weight),) * len(self.classes)
        # a buffer, not a tensor made per call: no host-to-device copy inside a captured step
        self.register_buffer(
            "pos_weight_tensor",
            torch.tensor(pos_weights, dtype=torch.float32).view(-1, 1, 1),
            persistent=False,
        )
        soft_iou = cfg.soft_iou_weights
        self.use_soft_iou = soft_iou is not None and any(w > 0 for w in soft_iou)
        if self.use_soft_iou:
            self.register_buffer(
                "soft_iou_weights", torch.tensor(soft_iou, dtype=torch.float32), persistent=False
            )

    def forward(self, outputs: dict, batch: dict) -> dict:
        logits = outputs["segmentation"].float()
        targets = batch["targets"].to(device=logits.device, dtype=torch.float32)
        if logits.shape != targets.shape:
            raise ValueError(
                f"segmentation logits {tuple(logits.shape)} and targets {tuple(targets.shape)} "
                "differ; the model's classes and grid must match the data config"
            )
        mask = batch.get("visibility_mask")
        if mask is not None:
            mask = mask.to(device=logits.device, dtype=torch.float32).unsqueeze(1).expand_as(logits)
        elementwise = self._elementwise(logits, targets)  # B x K x nx x ny
        per_class = _masked_mean(elementwise, mask)
        loss = (per_class * self.class_weights).sum() / self.class_weights.sum()
        out = {"loss": loss}
        out.update({f"loss/{c}": per_class[k].detach() for k, c in enumerate(self.classes)})
        if self.use_soft_iou:
            iou_term = ((1.0 - soft_iou(logits, targets, mask)) * self.soft_iou_weights).sum()
            out["loss"] = loss + iou_term
            out["loss/soft_iou"] = iou_term.detach()
        return out

    def _elementwise(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.type == "bce":
            return F.binary_cross_entropy_with_logits(
                logits, targets, pos_weight=self.pos_weight_tensor, reduction="none"
            )
        return sigmoid_focal_loss(
            logits, targets, alpha=self.alpha, gamma=self.gamma, reduction="none"
        )


def soft_iou(
    logits: torch.Tensor, targets: torch.Tensor, mask: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Per-class soft IoU of B x K x nx x ny logits against 0/1 targets over the batch and grid ->
    K: sum(p t) / sum(p + t - p t) with p = sigmoid(logits), the IoU of the metric with
    probabilities in place of the thresholded masks (1 for a class absent from both). With a mask
    (B x K x nx x ny, 1 = counted) only the visible cells count."""
    probs = torch.sigmoid(logits.float())
    targets = targets.float()
    inter = probs * targets
    union = probs + targets - inter
    if mask is not None:
        inter, union = inter * mask, union * mask
    dims = (0, 2, 3)
    inter, union = inter.sum(dim=dims), union.sum(dim=dims)
    eps = 1.0
    return (inter + eps) / (union + eps)


def _masked_mean(values: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Per-class mean of B x K x nx x ny values over the batch and grid -> K (visible cells only
    with a mask)."""
    dims = (0, 2, 3)
    if mask is None:
        return values.mean(dim=dims)
    return (values * mask).sum(dim=dims) / mask.sum(dim=dims).clamp(min=1.0)
