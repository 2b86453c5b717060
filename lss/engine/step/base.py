"""What every variant of the training step shares: its parts (StepParts) and its interface
(TrainStep)."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import nn

from lss.engine.build import AutocastFn
from lss.engine.distributed import DistInfo
from lss.engine.step.logs import StepLogs


@dataclasses.dataclass
class StepParts:
    """The objects a step works on. `model`: the plain model (weights, clipping, checkpoints);
    `net`: what the forward runs (the model, or its DistributedDataParallel wrapper under torchrun;
    the factory sets it)."""

    model: nn.Module
    loss_fn: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    amp_dtype: Optional[torch.dtype]  # None: no autocast
    autocast: AutocastFn
    grad_clip: float  # optim.grad_clip; <= 0: no clipping
    device: torch.device
    dist: DistInfo
    net: Optional[nn.Module] = None

    def __post_init__(self):
        self.net = self.net if self.net is not None else self.model


class TrainStep:
    """One optimizer step per `run_step(micro_batches, step)` (`step`: the number of the step it
    runs, for its messages), returning the step's StepLogs: the loss terms and grad_norm. Variants:
    EagerStep, CapturedStep and CompiledStep (either of them over compiled modules);
    lss.engine.step.factory picks one per run.

    `check()` raises FloatingPointError when a step whose loss has not been read yet was not finite
    (a step that defers its check to overlap host and device); `setup_seconds` splits the first call
    into its parts (empty where it has none); `hooks` are the hooks the variant needs beside the
    trainer's (registered last)."""

    def __init__(self, parts: StepParts):
        self.parts = parts
        self.hooks: list = []

    @property
    def setup_seconds(self) -> dict[str, float]:
        return {}

    def run_step(self, micro_batches: list[dict], step: int) -> StepLogs:
        raise NotImplementedError

    def check(self) -> None:
        """Nothing to check: this step reads its own loss before its update."""

    def train_mode(self) -> None:
        if not self.parts.model.training:  # Module.train() walks every submodule: only when needed
            self.parts.net.train()


def check_finite(loss: float, step: int, deferred: bool = False) -> None:
    """FloatingPointError naming the step when `loss` is NaN or inf. `deferred`: the step's update
    and at most one more were applied before the check (the captured step)."""
    if math.isfinite(loss):
        return
    applied = (
        " (train.cuda_graph: the updates of this step and at most one more were applied; the "
        "checkpoints on disk predate them)"
        if deferred
        else ""
    )
    raise FloatingPointError(
        f"loss is {loss} at step {step}{applied}; lower optim.lr, check the data, or resume from "
        "the last good checkpoint"
    )
