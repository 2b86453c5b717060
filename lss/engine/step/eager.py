"""The eager training step: micro-batches -> autocast forward -> loss -> backward -> unscale, clip,
step, schedule. Under torchrun the gradients of the last micro-batch are all-reduced by DDP. On CUDA
the camera trunk and the BEV encoder replay CUDA graphs captured after the first step
(lss.engine.step.partial), which takes most kernel launches off the host."""

from __future__ import annotations

import contextlib
import sys
from typing import Optional

import torch

from lss.engine.distributed import to_device
from lss.engine.step.base import StepParts, TrainStep, check_finite
from lss.engine.step.logs import StepLogs
from lss.engine.step.partial import EncoderGraphs


class EagerStep(TrainStep):
    """One optimizer step over `train.grad_accum` micro-batches. On a CPU a NaN or inf loss stops
    before the update; on CUDA the step does not wait for the device, and its loss is checked at the
    next step or `check()` (at most one update later, as CapturedStep). `graphs`: the encoders as
    CUDA graphs (EncoderGraphs over `parts.model`), captured at the end of the first call; where
    they cannot be, one line on stderr says why and the steps run plain eager. `setup_seconds` then
    holds "encoder_capture"."""

    def __init__(self, parts: StepParts, graphs: Optional[EncoderGraphs] = None):
        super().__init__(parts)
        self.graphs = graphs
        self._setup: dict[str, float] = {}
        if graphs is not None and graphs.problem is not None:
            self._say(graphs.problem)

    @property
    def setup_seconds(self) -> dict[str, float]:
        return self._setup

    def run_step(self, micro_batches: list[dict], step: int) -> StepLogs:
        self.train_mode()
        device, graphs = self.parts.device, self.graphs
        # a graph's gradient buffers are adopted as .grad where none exists: accumulate into zeros
        keep_grads = graphs is not None and graphs.captured and len(micro_batches) > 1
        if keep_grads:
            graphs.keep_grads()
        totals = self._forward_backward([to_device(b, device) for b in micro_batches])
        # on CUDA the host queues the next step while the device runs this one (no sync here); on
        # a CPU reading the loss costs nothing: stop before the update
        deferred = device.type == "cuda"
        if not deferred:
            check_finite(float(totals["loss"]), step)
        grad_norm = self._optimizer_step(keep_grads)
        if deferred:
            logs = self._defer(step, StepLogs({**totals, "grad_norm": grad_norm}))
        else:
            logs = StepLogs(**{k: float(v) for k, v in totals.items()}, grad_norm=float(grad_norm))
        if graphs is not None and graphs.problem is None and not graphs.captured:
            self._capture()
        return logs

    def _capture(self) -> None:
        problem = self.graphs.capture()
        if problem is not None:
            self._say(problem)
        else:
            self._setup["encoder_capture"] = self.graphs.capture_seconds

    def _say(self, problem: str) -> None:
        """One line on stderr: why the encoders run without CUDA graphs."""
        who = f"lss (rank {self.parts.dist.rank})" if self.parts.dist.enabled else "lss"
        print(
            f"{who}: eager steps without CUDA graphs of the camera trunk and the BEV encoder: "
            f"{problem}",
            file=sys.stderr,
            flush=True,
        )

    def _forward_backward(self, micro_batches: list[dict]) -> dict:
        """Gradients of the mean loss over `micro_batches`; returns the mean loss terms (over all
        ranks)."""
        p, totals = self.parts, {}
        graphs = self.graphs.forward if self.graphs is not None else contextlib.nullcontext
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            # DDP all-reduces the gradients at the last micro-batch only
            sync = p.net.no_sync() if p.dist.enabled and not last else contextlib.nullcontext()
            with sync:
                with p.autocast(), graphs():
                    outputs = p.net(batch)
                losses = p.loss_fn(outputs, batch)
                p.scaler.scale(losses["loss"] / len(micro_batches)).backward()
            for k, v in losses.items():
                totals[k] = totals.get(k, 0.0) + v.detach() / len(micro_batches)
        if p.dist.enabled:  # the global batch's mean: every rank sees a non-finite loss together
            names = sorted(totals)
            stacked = torch.stack(
                [torch.as_tensor(totals[k], device=p.device, dtype=torch.float32) for k in names]
            )
            torch.distributed.all_reduce(stacked)
            totals = dict(zip(names, stacked / p.dist.world_size))
        return totals

    def _optimizer_step(self, keep_grads: bool = False) -> torch.Tensor:
        """Unscale, clip (optim.grad_clip), step, schedule; returns the gradient norm before
        clipping. `keep_grads`: zero the gradients in place instead of dropping them."""
        p = self.parts
        p.scaler.unscale_(p.optimizer)
        clip = p.grad_clip if p.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(p.model.parameters(), clip)
        p.scaler.step(p.optimizer)
        p.scaler.update()
        p.optimizer.zero_grad(set_to_none=not keep_grads)
        p.scheduler.step()
        return grad_norm
