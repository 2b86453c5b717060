"""What every variant of the training step shares: its parts (StepParts) and its interface
(TrainStep)."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Optional

import torch
from torch import nn

from lss.engine.distributed import AutocastFn
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
        self._unchecked: Optional[tuple[int, StepLogs]] = None  # a deferred check's step (_defer)
        self._latest: Optional[StepLogs] = None

    @property
    def setup_seconds(self) -> dict[str, float]:
        return {}

    def run_step(self, micro_batches: list[dict], step: int) -> StepLogs:
        raise NotImplementedError

    def check(self) -> None:
        """FloatingPointError when the last unread step's loss was not finite (a step that defers
        its check: `_defer`); the host's wait for it counts in the latest step's logs ("wait")."""
        if self._unchecked is None:
            return
        step, logs = self._unchecked
        self._unchecked = None
        waited = time.perf_counter()
        loss = logs["loss"]  # waits for that step
        self._latest.host["wait"] += time.perf_counter() - waited
        check_finite(loss, step, deferred=True)

    def _defer(self, step: int, logs: StepLogs) -> StepLogs:
        """Check the previous step's loss now and this one's (`logs`, read from the device behind
        the step) at the next step or `check()`: the host then queues the next step while the device
        runs this one. A NaN loss stops the run at most one update later."""
        self._latest = logs
        self.check()
        self._unchecked = (step, logs)
        return logs

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
