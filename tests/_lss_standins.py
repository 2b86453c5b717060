"""Temporary test-only stand-in for lss.ops.sigmoid_focal_loss, used until the focal-loss op lands on main.

install() adds the name only when it is missing, so the real op wins as soon as it is merged.
"""
from __future__ import annotations

import torch.nn.functional as F


def sigmoid_focal_loss(logits, targets, alpha=0.25, gamma=2.0, weight=None, reduction="mean", mask=None):
    p = logits.sigmoid()
    ce = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
    p_t = p * targets + (1 - p) * (1 - targets)
    loss = ce * (1 - p_t) ** gamma
    if alpha >= 0:
        loss = (alpha * targets + (1 - alpha) * (1 - targets)) * loss
    return loss if reduction == "none" else loss.mean() if reduction == "mean" else loss.sum()


def install() -> None:
    import lss.ops

    if not hasattr(lss.ops, "sigmoid_focal_loss"):
        lss.ops.sigmoid_focal_loss = sigmoid_focal_loss
