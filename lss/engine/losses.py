"""Training losses: BEV segmentation (our sigmoid focal loss by default, or the LSS paper's BCE with pos_weight),
plus the 3D detection losses when "detection" is in model.heads."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lss.config import Config, ConfigError
from lss.ops import sigmoid_focal_loss

LOSS_TYPES = ("focal", "bce")


class SegmentationLoss(nn.Module):
    """forward(outputs {"segmentation": B x K x nx x ny logits}, batch {"targets", optional "visibility_mask"})
    -> {"loss": scalar, "loss/<class>": per-class scalars (detached)}.

    With a visibility mask (nx x ny per sample, 1 = counted) the loss is the mean over the visible cells only.
    """

    def __init__(self, config: Config):
        super().__init__()
        cfg = config.loss
        if cfg.type not in LOSS_TYPES:
            raise ConfigError(f"loss.type={cfg.type!r}: expected one of {LOSS_TYPES}")
        self.type = cfg.type
        self.alpha, self.gamma, self.pos_weight = cfg.focal_alpha, cfg.focal_gamma, cfg.pos_weight
        self.classes = tuple(config.data.classes)
        weights = cfg.class_weights if cfg.class_weights is not None else (1.0,) * len(self.classes)
        if len(weights) != len(self.classes):
            raise ConfigError(f"loss.class_weights has {len(weights)} values but data.classes has "
                              f"{len(self.classes)} ({list(self.classes)})")
        self.register_buffer("class_weights", torch.tensor(weights, dtype=torch.float32), persistent=False)

    def forward(self, outputs: dict, batch: dict) -> dict:
        logits = outputs["segmentation"].float()
        targets = batch["targets"].to(device=logits.device, dtype=torch.float32)
        if logits.shape != targets.shape:
            raise ValueError(f"segmentation logits {tuple(logits.shape)} and targets {tuple(targets.shape)} differ; "
                             "the model's classes and grid must match the data config")
        mask = batch.get("visibility_mask")
        if mask is not None:
            mask = mask.to(device=logits.device, dtype=torch.float32).unsqueeze(1).expand_as(logits)
        elementwise = self._elementwise(logits, targets)  # B x K x nx x ny
        per_class = _masked_mean(elementwise, mask)
        loss = (per_class * self.class_weights).sum() / self.class_weights.sum()
        out = {"loss": loss}
        out.update({f"loss/{c}": per_class[k].detach() for k, c in enumerate(self.classes)})
        return out

    def _elementwise(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.type == "bce":
            pos_weight = torch.tensor(self.pos_weight, device=logits.device)
            return F.binary_cross_entropy_with_logits(logits, targets, pos_weight=pos_weight, reduction="none")
        return sigmoid_focal_loss(logits, targets, alpha=self.alpha, gamma=self.gamma, reduction="none")


def _masked_mean(values: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Per-class mean of B x K x nx x ny values over the batch and grid -> K (visible cells only with a mask)."""
    dims = (0, 2, 3)
    if mask is None:
        return values.mean(dim=dims)
    return (values * mask).sum(dim=dims) / mask.sum(dim=dims).clamp(min=1.0)


class TotalLoss(nn.Module):
    """forward(outputs, batch) -> {"loss": the sum of every head's loss, plus each term for logging (detached)}."""

    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.segmentation = SegmentationLoss(config)
        self.detection = "detection" in config.model.heads

    def forward(self, outputs: dict, batch: dict) -> dict:
        out = self.segmentation(outputs, batch)
        if self.detection:
            from lss.models.detection import detection_loss

            terms = detection_loss(outputs, batch, self.config)
            out["loss/segmentation"] = out["loss"].detach()
            out["loss"] = out["loss"] + sum(terms.values())
            out.update({f"loss/{k}": v.detach() for k, v in terms.items()})
        return out
