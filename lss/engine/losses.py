"""Training losses: BEV segmentation (our sigmoid focal loss by default, or the LSS paper's BCE with pos_weight),
the lidar depth loss of the camera depth distribution when loss.depth_weight > 0, and their sum with the 3D
detection losses (lss.engine.detection_loss) when "detection" is in model.heads."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lss.config import Config
from lss.engine.detection_loss import detection_loss
from lss.ops import sigmoid_focal_loss


class SegmentationLoss(nn.Module):
    """forward(outputs {"segmentation": B x K x nx x ny logits}, batch {"targets", optional "visibility_mask"})
    -> {"loss": scalar, "loss/<class>": per-class scalars (detached)}.

    With a visibility mask (nx x ny per sample, 1 = counted) the loss is the mean over the visible cells only.
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
        # per class (K x 1 x 1, broadcast over B x K x nx x ny): each class's positives weigh so much that its
        # probabilities are calibrated for the 0.5 threshold (docs/accuracy.md)
        pos_weights = cfg.class_pos_weights or (float(self.pos_weight),) * len(self.classes)
        # a buffer, not a tensor made per call: no host-to-device copy inside a captured training step
        self.register_buffer(
            "pos_weight_tensor",
            torch.tensor(pos_weights, dtype=torch.float32).view(-1, 1, 1),
            persistent=False,
        )

    def forward(self, outputs: dict, batch: dict) -> dict:
        logits = outputs["segmentation"].float()
        targets = batch["targets"].to(device=logits.device, dtype=torch.float32)
        if logits.shape != targets.shape:
            raise ValueError(
                f"segmentation logits {tuple(logits.shape)} and targets {tuple(targets.shape)} differ; "
                "the model's classes and grid must match the data config"
            )
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
            return F.binary_cross_entropy_with_logits(
                logits, targets, pos_weight=self.pos_weight_tensor, reduction="none"
            )
        return sigmoid_focal_loss(
            logits, targets, alpha=self.alpha, gamma=self.gamma, reduction="none"
        )


def _masked_mean(values: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Per-class mean of B x K x nx x ny values over the batch and grid -> K (visible cells only with a mask)."""
    dims = (0, 2, 3)
    if mask is None:
        return values.mean(dim=dims)
    return (values * mask).sum(dim=dims) / mask.sum(dim=dims).clamp(min=1.0)


def depth_loss(outputs: dict, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the camera depth distribution against lidar depth-bin targets, in float32.

    outputs: "depth_logits" B x N x D x fH x fW (preferred: log_softmax is stable), else "depth" probabilities of
    the same shape; targets B x N x fH x fW int64 bin indices, -1 = no lidar return (ignored). Returns the mean
    over the valid cells (0, still differentiable, when there are none)."""
    if "depth_logits" in outputs:
        scores, from_logits = outputs["depth_logits"], True
    elif "depth" in outputs:
        scores, from_logits = outputs["depth"], False
    else:
        raise ValueError(
            "loss.depth_weight > 0 needs the model's depth distribution: its outputs must hold "
            f"'depth_logits' (or 'depth') B x N x D x fH x fW; got keys {sorted(outputs)}"
        )
    if scores.dim() != 5 or targets.shape != scores.shape[:2] + scores.shape[3:]:
        raise ValueError(
            f"depth scores {tuple(scores.shape)} (B x N x D x fH x fW) and depth_targets "
            f"{tuple(targets.shape)} (B x N x fH x fW) do not match; data.final_dim, model.downsample "
            "and grid.dbound must be the same for the data and the model"
        )
    if targets.dtype != torch.int64:
        raise ValueError(f"depth_targets must be int64 bin indices, got {targets.dtype}")
    targets = targets.to(scores.device)
    if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        check_depth_targets(
            targets, scores.shape[2]
        )  # a captured step checks its CPU batch before each replay
    with torch.autocast(device_type=scores.device.type, enabled=False):
        scores = scores.float().flatten(0, 1)  # B*N x D x fH x fW
        log_prob = scores.log_softmax(dim=1) if from_logits else scores.clamp_min(1e-12).log()
        total = F.nll_loss(log_prob, targets.flatten(0, 1), ignore_index=-1, reduction="sum")
        return total / (targets >= 0).sum().clamp(min=1)


def check_depth_targets(targets: torch.Tensor, bins: int) -> None:
    """Raise unless every depth target is a bin index in [0, bins) or -1 (no lidar return); syncs with the device
    when the targets live there."""
    if bool(((targets < -1) | (targets >= bins)).any()):
        raise ValueError(
            f"depth_targets hold values outside [-1, {bins}) for {bins} depth bins; the targets and "
            "the model must use the same grid.dbound"
        )


class TotalLoss(nn.Module):
    """forward(outputs, batch) -> {"loss": the sum of every head's loss, plus each term for logging (detached)}.

    With data.depth_targets the lidar depth cross-entropy is logged as "depth_loss" and, weighted by
    loss.depth_weight, added to "loss" (with weight 0 it is only logged, when the model outputs a depth
    distribution: how well depth is learned implicitly)."""

    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.segmentation = SegmentationLoss(config)
        self.detection = "detection" in config.model.heads
        # buffers: no host-to-device copy inside a captured training step
        det = config.detection
        self.register_buffer(
            "det_code_weights",
            torch.tensor(det.code_weights, dtype=torch.float32),
            persistent=False,
        )
        self.register_buffer(
            "det_class_weights",
            None
            if det.heatmap_class_weights is None
            else torch.tensor(det.heatmap_class_weights, dtype=torch.float32),
            persistent=False,
        )
        self.depth_weight = config.loss.depth_weight
        self.depth = config.data.depth_targets

    def forward(self, outputs: dict, batch: dict) -> dict:
        out = self.segmentation(outputs, batch)
        if self.detection or self.depth:
            out["loss/segmentation"] = out["loss"].detach()
        if self.detection:
            terms = detection_loss(
                outputs, batch, self.config, self.det_code_weights, self.det_class_weights
            )
            out["loss"] = out["loss"] + sum(terms.values())
            out.update({f"loss/{k}": v.detach() for k, v in terms.items()})
        if self.depth:
            if "depth_targets" not in batch:
                raise ValueError(
                    "data.depth_targets is set but the batch has no 'depth_targets'; the dataset must "
                    "provide them (lss.data.NuScenesBEV does with data.depth_targets: true)"
                )
            if self.depth_weight > 0:
                depth = depth_loss(outputs, batch["depth_targets"])
                out["loss"] = out["loss"] + self.depth_weight * depth
                out["depth_loss"] = depth.detach()
            elif "depth_logits" in outputs or "depth" in outputs:
                with torch.no_grad():
                    out["depth_loss"] = depth_loss(outputs, batch["depth_targets"])
        return out
