"""The lidar depth loss of the camera encoder's depth distribution (depth supervision as in
BEVDepth): cross-entropy against the depth-bin targets of lss.data.depth."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lss.config import Config
from lss.host_sync import may_sync


def depth_loss(outputs: dict, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the camera depth distribution against lidar depth-bin targets, in float32.

    outputs: "depth_logits" B x N x D x fH x fW (preferred: log_softmax is stable), else "depth"
    probabilities of the same shape; targets B x N x fH x fW int64 bin indices, -1 = no lidar
    return (ignored). Returns the mean over the valid cells (0, still differentiable, when there
    are none)."""
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
            f"{tuple(targets.shape)} (B x N x fH x fW) do not match; data.final_dim, "
            "model.downsample and grid.dbound must be the same for the data and the model"
        )
    if targets.dtype != torch.int64:
        raise ValueError(f"depth_targets must be int64 bin indices, got {targets.dtype}")
    targets = targets.to(scores.device)
    if may_sync(targets):  # else a captured step checks its CPU batch before each replay
        check_depth_targets(targets, scores.shape[2])
    with torch.autocast(device_type=scores.device.type, enabled=False):
        scores = scores.float().flatten(0, 1)  # B*N x D x fH x fW
        log_prob = scores.log_softmax(dim=1) if from_logits else scores.clamp_min(1e-12).log()
        total = F.nll_loss(log_prob, targets.flatten(0, 1), ignore_index=-1, reduction="sum")
        return total / (targets >= 0).sum().clamp(min=1)


def check_depth_targets(targets: torch.Tensor, bins: int) -> None:
    """Raise unless every depth target is a bin index in [0, bins) or -1 (no lidar return); syncs
    with the device when the targets live there."""
    if bool(((targets < -1) | (targets >= bins)).any()):
        raise ValueError(
            f"depth_targets hold values outside [-1, {bins}) for {bins} depth bins; the targets "
            "and the model must use the same grid.dbound"
        )


class DepthLoss(nn.Module):
    """forward(outputs, batch {"depth_targets"}) -> {"loss": loss.depth_weight x the lidar depth
    cross-entropy, "depth_loss": the cross-entropy (detached)}. With weight 0 only "depth_loss" is
    returned, and only when the model outputs a depth distribution: how well depth is learned
    implicitly."""

    def __init__(self, config: Config):
        super().__init__()
        self.weight = config.loss.depth_weight

    def forward(self, outputs: dict, batch: dict) -> dict:
        if "depth_targets" not in batch:
            raise ValueError(
                "data.depth_targets is set but the batch has no 'depth_targets'; the dataset must "
                "provide them (lss.data.NuScenesBEV does with data.depth_targets: true)"
            )
        if self.weight > 0:
            depth = depth_loss(outputs, batch["depth_targets"])
            return {"loss": self.weight * depth, "depth_loss": depth.detach()}
        if "depth_logits" in outputs or "depth" in outputs:
            with torch.no_grad():
                return {"depth_loss": depth_loss(outputs, batch["depth_targets"])}
        return {}
