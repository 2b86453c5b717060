"""Training-mode batch normalization of contiguous N x C x ... (NCHW) inputs through lss's kernels
(the model's, on CUDA by default: `model.batch_norm`, docs/ops.md).

PyTorch sends bfloat16 NCHW batch norms to its own kernels, which read a channel one block row at a
time; on the default recipe's camera trunk they are the largest share of the training step
(docs/benchmarks.md). `batch_norm_train` computes the batch's statistics with partial sums spread
over the whole device and normalizes in one elementwise pass, forward and backward, in the input's
dtype with float32 statistics. `BatchNorm2d` is torch.nn.BatchNorm2d that trains through it (the
same parameters, buffers, running-statistics update and evaluation), and `use_lss_batch_norm`
turns a model's BatchNorm2d modules into it in place (the state dict is unchanged).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from lss.ops import _ext

torch.fx.wrap("batch_norm_train")

__all__ = ["batch_norm_train", "batch_norm_train_reference", "BatchNorm2d", "use_lss_batch_norm"]


def _check(input: Tensor, weight: Tensor, bias: Tensor, eps: float) -> None:
    op = "batch_norm_train"
    if not isinstance(input, Tensor) or not input.is_floating_point():
        got = input.dtype if isinstance(input, Tensor) else type(input).__name__
        raise TypeError(f"{op}: input must be a floating-point tensor, got {got}")
    if input.dim() < 2:
        raise ValueError(
            f"{op}: input must be N x C x ... (at least 2-D), got {tuple(input.shape)}"
        )
    c = input.shape[1]
    for name, t in (("weight", weight), ("bias", bias)):
        if not isinstance(t, Tensor) or t.shape != (c,) or t.dtype != torch.float32:
            got = (tuple(t.shape), t.dtype) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{op}: {name} must be float32 of shape ({c},), got {got}")
        if t.device != input.device:
            raise ValueError(f"{op}: {name} is on {t.device} but the input on {input.device}")
    if input.numel() < 2 * c or c == 0:
        raise ValueError(
            f"{op}: training needs at least two values per channel (the variance of one value is "
            f"undefined), got input of shape {tuple(input.shape)}"
        )
    if not eps > 0:
        raise ValueError(f"{op}: eps must be positive, got {eps}")


def batch_norm_train(
    input: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5
) -> tuple[Tensor, Tensor, Tensor]:
    """(output, mean, invstd) of training-mode batch norm over every dim but 1 of `input` (N x C x
    ..., float32/float16/bfloat16/float64; made contiguous), with float32 `weight` and `bias` of C:
    output = (input - mean) * invstd * weight + bias in the input's dtype, mean and invstd =
    1 / sqrt(biased variance + eps) float32 of C. Differentiable in input, weight and bias (mean and
    invstd are not). Equals torch.nn.functional.batch_norm(..., training=True) within rounding."""
    _check(input, weight, bias, eps)
    if _ext.use_reference("batch_norm_train"):
        return _reference(input, weight, bias, eps)
    _ext.check_device("batch_norm_train", input)
    return torch.ops.lss.batch_norm_train(input.contiguous(), weight, bias, float(eps))


def batch_norm_train_reference(
    input: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5
) -> tuple[Tensor, Tensor, Tensor]:
    """batch_norm_train in plain PyTorch (float32 statistics; float64 for float64 input)."""
    _check(input, weight, bias, eps)
    return _reference(input, weight, bias, eps)


def _reference(input: Tensor, weight: Tensor, bias: Tensor, eps: float):
    acc = torch.float64 if input.dtype == torch.float64 else torch.float32
    x = input.to(acc)
    dims = [0] + list(range(2, input.dim()))
    mean = x.mean(dims)
    var = x.var(dims, unbiased=False)
    invstd = torch.rsqrt(var + eps)
    shape = (1, -1) + (1,) * (input.dim() - 2)
    out = (x - mean.view(shape)) * (invstd * weight.to(acc)).view(shape) + bias.to(acc).view(shape)
    return out.to(input.dtype), mean.float().detach(), invstd.float().detach()


class BatchNorm2d(nn.BatchNorm2d):
    """torch.nn.BatchNorm2d whose training forward runs batch_norm_train where it can: a training
    module with running statistics (or without any), float32 affine parameters, a contiguous
    input and the compiled kernels for its device; anything else (evaluation, channels-last input,
    no affine, another weight dtype) runs torch.nn.BatchNorm2d's own forward. The running
    statistics are updated as torch.nn.BatchNorm2d updates them (momentum, or the cumulative
    average with momentum None; the unbiased variance). `on_cpu` False keeps CPU inputs on
    PyTorch's kernels (lss's CPU kernels are the exact reference, not faster than PyTorch's)."""

    on_cpu = True

    def _ours(self, input: Tensor) -> bool:
        return (
            self.training
            and _ext.kernels_take(input, self.on_cpu)
            and self.affine
            and self.weight.dtype == torch.float32
            and input.dim() == 4
            and input.is_contiguous()
            and input.is_floating_point()
            and (self.running_mean is None) == (self.running_var is None)
        )

    def forward(self, input: Tensor) -> Tensor:
        if not self._ours(input):
            return super().forward(input)
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / self.num_batches_tracked  # a 0-dim tensor: no host sync
        output, mean, invstd = batch_norm_train(input, self.weight, self.bias, self.eps)
        if self.running_mean is not None:
            with torch.no_grad():
                count = input.numel() // input.shape[1]
                var = invstd.pow(-2).sub_(self.eps).clamp_(min=0).mul_(count / max(count - 1, 1))
                self.running_mean.mul_(1 - factor).add_(mean * factor)
                self.running_var.mul_(1 - factor).add_(var * factor)
        return output


def use_lss_batch_norm(module: nn.Module, on_cpu: bool = True) -> int:
    """Turns every torch.nn.BatchNorm2d of `module` (exactly that class) into BatchNorm2d in place,
    keeping its parameters, buffers and state dict keys; returns how many. `on_cpu` False: CPU
    inputs keep PyTorch's kernels (BatchNorm2d.on_cpu)."""
    count = 0
    for m in module.modules():
        if type(m) is nn.BatchNorm2d:
            m.__class__ = BatchNorm2d
            m.on_cpu = on_cpu
            count += 1
    return count


def _backward(
    ctx, grad_output: Tensor, _grad_mean: Optional[Tensor], _grad_invstd: Optional[Tensor]
):
    input, weight, mean, invstd = ctx.saved_tensors
    grad_input, grad_weight, grad_bias = torch.ops.lss._batch_norm_train_backward(
        grad_output.contiguous(), input, weight, mean, invstd
    )
    return (
        grad_input if ctx.needs_input_grad[0] else None,
        grad_weight if ctx.needs_input_grad[1] else None,
        grad_bias if ctx.needs_input_grad[2] else None,
        None,
    )


def _setup_context(ctx, inputs, output) -> None:
    input, weight, _, _ = inputs
    _, mean, invstd = output
    ctx.save_for_backward(input, weight, mean, invstd)
    ctx.mark_non_differentiable(mean, invstd)


if _ext.has_ext():

    @torch.library.register_fake("lss::batch_norm_train")
    def _batch_norm_train_fake(input, weight, bias, eps):
        c = input.shape[1]
        stats = input.new_empty((c,), dtype=torch.float32)
        return input.new_empty(input.shape), stats, stats.new_empty((c,))

    @torch.library.register_fake("lss::_batch_norm_train_backward")
    def _batch_norm_train_backward_fake(grad_output, input, weight, mean, invstd):
        return (
            input.new_empty(input.shape),
            weight.new_empty(weight.shape),
            weight.new_empty(weight.shape),
        )

    torch.library.register_autograd(
        "lss::batch_norm_train", _backward, setup_context=_setup_context
    )
