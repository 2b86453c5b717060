"""The captured step across DDP processes (train.cuda_graph under torchrun): in every process each
step is two CUDA graph replays with one all-reduce between them, so a step costs about what it costs
in one process plus the all-reduce, where eager DistributedDataParallel steps are bound by the host.

  1. graph: zero the gradients, forward, loss, backward into the flat gradient buffers
     (lss.engine.step.grad_buckets), the loss terms and BatchNorm statistics copied behind them;
  2. one all-reduce (sum) per buffer, queued on the current stream between the replays (NCCL);
  3. graph: divide by the number of processes, clip, optimizer step, statistics back into the model.

The model is not wrapped in DistributedDataParallel: the first step broadcasts rank 0's weights and
buffers, and the averaged gradients keep the processes' weights equal. BatchNorm running statistics
are averaged at every step, so every process holds the statistics of the global batch and evaluates
the model that rank 0 saves (the batch statistics used while training are each process's own, as
with DistributedDataParallel). The loss terms are the means over all processes' batches, so a
NaN loss stops every process at the same step."""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
from torch import nn

from lss.engine.distributed import DistInfo
from lss.engine.step.base import StepParts
from lss.engine.step.captured import CapturedStep
from lss.engine.step.grad_buckets import GradientBuckets, batchnorm_statistics, broadcast_state
from lss.engine.step.graph import GraphedTrainStep, _Snapshot, make_capturable


class DistributedGraphedStep(GraphedTrainStep):
    """GraphedTrainStep split at the gradient all-reduce: step(batch) -> the same values, the loss
    terms averaged over the `dist_info` processes and grad_norm the norm of the averaged gradients.
    The warm-up steps run the whole step (all-reduce included); the first of them also finds the
    parameters that get a gradient and moves their gradients into the flat buffers (`buckets`).
    `capture=False` runs the same split step without graphs (CPU tests under gloo)."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: nn.Module,
        optimizer: torch.optim.Optimizer,
        amp_dtype: Optional[torch.dtype],
        grad_clip: float,
        dist_info: DistInfo,
        warmup: int = 2,
        capture: bool = True,
        check_batch: Optional[Callable[[dict], None]] = None,
    ):
        super().__init__(
            model, loss_fn, optimizer, amp_dtype, grad_clip, warmup, capture, check_batch
        )
        self.dist_info = dist_info
        self.buckets: Optional[GradientBuckets] = None
        self.graphs: Optional[tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]] = None

    def replay(self) -> dict:
        if self.graphs is None:
            return self._step()
        backward, update = self.graphs
        backward.replay()
        self.buckets.all_reduce()
        update.replay()
        return self.outputs

    def _step(self) -> dict:
        self._forward_backward()
        self.buckets.all_reduce()
        return self._update()

    def _forward_backward(self) -> None:
        if self.buckets is not None:
            self.buckets.zero_()
        with self.autocast():
            outputs = self.model(self.static)
        losses = self.loss_fn(outputs, self.static)
        losses["loss"].backward()
        if self.buckets is None:  # the first warm-up step: its gradients say which parameters train
            stats = batchnorm_statistics(self.model)
            self.buckets = GradientBuckets(self.optimizer, sorted(losses), stats, self.dist_info)
        self.buckets.gather(losses)

    def _update(self) -> dict:
        grad_norm = self.buckets.average_and_clip(self.grad_clip)
        self.optimizer.step()
        return {**self.buckets.scatter(), "grad_norm": grad_norm.detach()}

    def _setup(self, batch: dict) -> None:
        device = self.device
        self.static = {k: v.to(device).clone() for k, v in batch.items() if torch.is_tensor(v)}
        if self.capture:
            make_capturable(self.optimizer, device)
        broadcast_state(self.model, self.dist_info)
        snapshot = _Snapshot(self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        side = torch.cuda.Stream(device) if self.capture else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for i in range(1, self.warmup + 1):
                start = self._clock()
                self._step()
                self.setup_seconds[f"warmup_step_{i}"] = self._clock() - start
        if side is not None:
            torch.cuda.current_stream(device).wait_stream(side)
        snapshot.restore()
        del snapshot  # its copies must not count in the captured step's peak
        if not self.capture:
            return
        backward, update = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        start = self._clock()
        torch.cuda.reset_peak_memory_stats(device)
        # two pools: the update's outputs must not share blocks that the backward graph reuses
        with torch.cuda.graph(backward, capture_error_mode="thread_local"):
            self._forward_backward()
        with torch.cuda.graph(update, capture_error_mode="thread_local"):
            self.outputs = self._update()
        self.peak_bytes = torch.cuda.max_memory_allocated(device)
        torch.cuda.empty_cache()
        self.graphs = (backward, update)
        self.setup_seconds["capture"] = self._clock() - start


class CapturedDDPStep(CapturedStep):
    """CapturedStep's loop (the loss read one step late) over DistributedGraphedStep: the step of
    train.cuda_graph under torchrun. `parts.net` must be the plain model (no DDP wrapper)."""

    def __init__(
        self,
        parts: StepParts,
        check_batch: Optional[Callable[[dict], None]] = None,
        warmup: int = 2,
        capture: bool = True,
    ):
        super().__init__(parts, check_batch, warmup, capture)
        if parts.net is not parts.model:
            raise ValueError(
                "CapturedDDPStep all-reduces the gradients itself: give it the plain model, not "
                f"a {type(parts.net).__name__} wrapper"
            )
        self.graph = DistributedGraphedStep(
            parts.model,
            parts.loss_fn,
            parts.optimizer,
            parts.amp_dtype,
            parts.grad_clip,
            parts.dist,
            warmup=warmup,
            capture=capture,
            check_batch=check_batch,
        )
