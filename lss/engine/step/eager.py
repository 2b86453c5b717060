"""The eager training step: micro-batches -> autocast forward -> loss -> backward -> unscale, clip,
step, schedule. Under torchrun the gradients of the last micro-batch are all-reduced by DDP."""

from __future__ import annotations

import contextlib

import torch

from lss.engine.build import to_device
from lss.engine.step.base import TrainStep, check_finite
from lss.engine.step.logs import StepLogs


class EagerStep(TrainStep):
    """One optimizer step over `train.grad_accum` micro-batches; a NaN or inf loss stops before the
    update."""

    def run_step(self, micro_batches: list[dict], step: int) -> StepLogs:
        self.train_mode()
        device = self.parts.device
        totals = self._forward_backward([to_device(b, device) for b in micro_batches])
        check_finite(float(totals["loss"]), step)
        grad_norm = self._optimizer_step()
        return StepLogs(**{k: float(v) for k, v in totals.items()}, grad_norm=float(grad_norm))

    def _forward_backward(self, micro_batches: list[dict]) -> dict:
        """Gradients of the mean loss over `micro_batches`; returns the mean loss terms (over all
        ranks)."""
        p, totals = self.parts, {}
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            # DDP all-reduces the gradients at the last micro-batch only
            sync = p.net.no_sync() if p.dist.enabled and not last else contextlib.nullcontext()
            with sync:
                with p.autocast():
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

    def _optimizer_step(self) -> torch.Tensor:
        """Unscale, clip (optim.grad_clip), step, schedule; returns the gradient norm before
        clipping."""
        p = self.parts
        p.scaler.unscale_(p.optimizer)
        clip = p.grad_clip if p.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(p.model.parameters(), clip)
        p.scaler.step(p.optimizer)
        p.scaler.update()
        p.optimizer.zero_grad(set_to_none=True)
        p.scheduler.step()
        return grad_norm
