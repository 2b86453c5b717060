"""The optimizer and its learning-rate schedule (warm-up, then constant, cosine or one-cycle)."""

from __future__ import annotations

import math

import torch
from torch import nn

from lss.config import Config


def build_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    o = cfg.optim
    params = [p for p in model.parameters() if p.requires_grad]
    # on the GPU the fused implementation updates all parameters in a few kernels instead of several
    # per tensor
    fused = bool(params) and all(p.is_cuda for p in params)
    optimizer = torch.optim.Adam if o.name == "adam" else torch.optim.AdamW
    return optimizer(params, lr=o.lr, weight_decay=o.weight_decay, fused=fused or None)


def lr_factor(cfg: Config, step: int) -> float:
    """Multiplier of optim.lr at optimizer step `step`: linear warm-up, then constant, cosine or
    one-cycle decay."""
    o, total = cfg.optim, max(cfg.train.max_steps, 1)
    warmup = o.warmup_steps if o.schedule != "onecycle" or o.warmup_steps else int(0.3 * total)
    if step < warmup:
        start = 1.0 / 25 if o.schedule == "onecycle" else 0.0
        return start + (1.0 - start) * (step + 1) / warmup
    if o.schedule == "constant":
        return 1.0
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    end = 1e-4 if o.schedule == "onecycle" else 0.0
    return end + (1.0 - end) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    cfg: Config, optimizer: torch.optim.Optimizer
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg, s))
