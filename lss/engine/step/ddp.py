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

from typing import Optional

import torch

from lss.engine.distributed import DistInfo
from lss.engine.step.base import StepParts
from lss.engine.step.captured import CapturedStep
from lss.engine.step.grad_buckets import GradientBuckets, batchnorm_statistics, broadcast_state
from lss.engine.step.graph import GraphedTrainStep


class DistributedGraphedStep(GraphedTrainStep):
    """GraphedTrainStep split at the gradient all-reduce: step(batch) -> the same values, the loss
    terms averaged over the `dist_info` processes and grad_norm the norm of the averaged gradients.
    The warm-up steps run the whole step (all-reduce included); the first of them also finds the
    parameters that get a gradient and moves their gradients into the flat buffers (`buckets`).
    `capture=False` runs the same split step without graphs (CPU tests under gloo). The arguments:
    GraphedTrainStep's and, by keyword, `dist_info`."""

    def __init__(self, *args, dist_info: DistInfo, **kwargs):
        super().__init__(*args, **kwargs)
        self.dist_info = dist_info
        self.buckets: Optional[GradientBuckets] = None
        self.graphs: Optional[tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]] = None

    @classmethod
    def from_parts(cls, parts: StepParts, **options) -> DistributedGraphedStep:
        return super().from_parts(parts, dist_info=parts.dist, **options)

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
        self._allocate_static(batch)
        broadcast_state(self.model, self.dist_info)
        self.optimizer.zero_grad(set_to_none=True)
        self._warm_up(self._step)
        if self.capture:
            self._timed_capture()

    def _capture(self) -> None:
        backward, update = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        # two pools: the update's outputs must not share blocks that the backward graph reuses
        with torch.cuda.graph(backward, capture_error_mode="thread_local"):
            self._forward_backward()
        with torch.cuda.graph(update, capture_error_mode="thread_local"):
            self.outputs = self._update()
        self.graphs = (backward, update)


class CapturedDDPStep(CapturedStep):
    """CapturedStep's loop (the loss read one step late) over DistributedGraphedStep: the step of
    train.cuda_graph under torchrun. `parts.net` must be the plain model (no DDP wrapper)."""

    graphed_step = DistributedGraphedStep

    def __init__(self, parts: StepParts, *args, **kwargs):
        if parts.net is not parts.model:
            raise ValueError(
                "CapturedDDPStep all-reduces the gradients itself: give it the plain model, not "
                f"a {type(parts.net).__name__} wrapper"
            )
        super().__init__(parts, *args, **kwargs)
