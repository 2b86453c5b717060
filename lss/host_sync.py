"""What code outside the training step may do with device values right now: the one place that
asks torch.compile and CUDA-graph capture for their state, so that ops, the LUT and the losses
ask a question of their own ("may I read this value on the host?") instead."""

from __future__ import annotations

import torch


def tracing() -> bool:
    """True while torch.compile (or torch.export) traces: tensors are symbolic, with no values and
    no version counters to read."""
    return torch.compiler.is_compiling()


def may_sync(tensor: torch.Tensor) -> bool:
    """Whether the host may read `tensor`'s values now: not while tracing, nor while a CUDA graph is
    being captured on the current stream (a host sync would end the capture with an error). Checks
    that cannot run then are skipped; their callers validate elsewhere or let kernels mark bad
    values."""
    if tracing():
        return False
    return not (tensor.is_cuda and torch.cuda.is_current_stream_capturing())
