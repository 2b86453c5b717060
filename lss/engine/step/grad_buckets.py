"""GradientBuckets: every gradient of a model in one flat buffer per dtype, so that processes
average them with one all-reduce per dtype (DistributedDataParallel's gradient_as_bucket_view,
without its hooks: the backward can then be captured whole).

The parameters' `.grad` become views into the buffers (each with its parameter's strides): the
backward adds into them in place, and clipping and the optimizer read them there. The buffer of
float32 holds two more things behind the gradients, averaged by the same all-reduce: the step's loss
terms, and the BatchNorm running statistics, so that every process keeps the statistics of the
global batch and evaluates and saves the same model."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lss.engine.distributed import DistInfo

BATCHNORM_STATISTICS = ("running_mean", "running_var")


def batchnorm_statistics(model: nn.Module) -> list[torch.Tensor]:
    """The floating-point running statistics of every normalization layer that tracks them."""
    found = []
    for module in model.modules():
        for name in BATCHNORM_STATISTICS:
            value = getattr(module, name, None)
            if torch.is_tensor(value) and value.is_floating_point():
                found.append(value)
    return found


def grad_view(buffer: torch.Tensor, offset: int, param: torch.Tensor) -> torch.Tensor:
    """buffer[offset : offset + param.numel()] as a tensor of `param`'s shape and layout
    (channels-last stays channels-last, so the backward's add needs no transposition)."""
    strides = torch.empty_like(param, device="meta").stride()  # dense: the param's own
    return buffer.as_strided(param.shape, strides, buffer.storage_offset() + offset)


class GradientBuckets:
    """The gradients of the parameters of `optimizer` that have one now (after a backward: a
    parameter without one stays without, as in eager steps) moved into one flat buffer per dtype.
    `loss_names`: the loss terms carried to every process (gather's dict keys). `statistics`:
    tensors averaged over the processes at every step (batchnorm_statistics of the model).

    Per step: zero_() before the backward, gather(losses) after it, all_reduce() (a sum over the
    processes), then average_and_clip(max_norm) and scatter() around the optimizer step. Every call
    but all_reduce can be captured in a CUDA graph."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        loss_names: list[str],
        statistics: list[torch.Tensor],
        dist_info: DistInfo,
    ):
        self.dist_info, self.loss_names, self.statistics = dist_info, list(loss_names), statistics
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not params:
            raise ValueError(
                "GradientBuckets: no parameter of the optimizer has a gradient; run a backward "
                "of a loss that depends on the model first"
            )
        device = params[0].device
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        extra = len(self.loss_names) + sum(t.numel() for t in statistics)
        if extra:
            by_dtype.setdefault(torch.float32, [])  # the losses and statistics ride in float32
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.grads: list[torch.Tensor] = []  # the gradient part of each buffer
        self.views: list[torch.Tensor] = []  # each parameter's .grad
        for dtype, group in by_dtype.items():
            size = sum(p.numel() for p in group)
            tail = extra if dtype == torch.float32 else 0
            buffer = torch.zeros(size + tail, dtype=dtype, device=device)
            offset = 0
            for p in group:
                view = grad_view(buffer, offset, p)
                view.copy_(p.grad)
                p.grad = view
                self.views.append(view)
                offset += p.numel()
            self.buffers[dtype] = buffer
            if size:
                self.grads.append(buffer[:size])
        carried = self.buffers[torch.float32][-extra:] if extra else None
        self._carried = carried
        n = len(self.loss_names)
        self._losses = {k: carried[i] for i, k in enumerate(self.loss_names)} if n else {}
        self._statistics_views, offset = [], n
        for t in statistics:
            self._statistics_views.append(carried[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    @property
    def world_size(self) -> int:
        return self.dist_info.world_size

    def zero_(self) -> None:
        """Gradients to zero before the backward adds into them (set_to_none would drop the
        views)."""
        for grad in self.grads:
            grad.zero_()

    def gather(self, losses: dict) -> None:
        """The step's loss terms (this process's means) and the statistics into the float32
        buffer."""
        if self._carried is None:
            return
        if sorted(losses) != sorted(self.loss_names):
            raise ValueError(
                f"the loss terms changed from {sorted(self.loss_names)} to {sorted(losses)}; "
                "every step must return the same terms"
            )
        terms = torch.stack([losses[k].detach().float().reshape(()) for k in self.loss_names])
        parts = [terms, *(t.detach().reshape(-1).float() for t in self.statistics)]
        torch.cat(parts, out=self._carried)

    def all_reduce(self) -> None:
        """Sum every buffer over the processes (in place; queued on the current stream on a GPU)."""
        if self.world_size > 1:
            for buffer in self.buffers.values():
                dist.all_reduce(buffer)

    def average_and_clip(self, max_norm: float) -> torch.Tensor:
        """Divide the sums by the number of processes and clip the gradients to `max_norm` (inf:
        no clipping) as torch.nn.utils.clip_grad_norm_ does; returns the norm before clipping."""
        scale = 1.0 / self.world_size
        # per tensor, then over the tensors: one sum over millions of floats loses digits on a CPU
        total = torch.nn.utils.get_total_norm(self.views) * scale
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0) * scale
        for grad in self.grads:
            grad.mul_(coef.to(grad.dtype))
        if self._carried is not None and self.world_size > 1:
            self._carried.mul_(scale)
        return total

    def scatter(self) -> dict:
        """The averaged statistics back into the model; returns the averaged loss terms (0-dim views
        into the buffer, overwritten by the next step)."""
        if self._statistics_views:
            torch._foreach_copy_(self.statistics, self._statistics_views)
        return dict(self._losses)


def broadcast_state(model: nn.Module, dist_info: DistInfo, src: int = 0) -> None:
    """Rank `src`'s parameters and buffers into every process's model (each process built and
    seeded its own)."""
    if not dist_info.enabled:
        return
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.detach(), src=src)
