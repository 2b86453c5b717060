"""The autograd and fake (meta) kernels of the fused focal loss ops (lss.ops.focal_loss): the
forward op saves the logits' gradient, the backward scales it by grad_output, in place where
autograd will not read it again (the only use of private torch state, with a public fallback)."""

from __future__ import annotations

import torch
from torch import Tensor

from lss.host_sync import tracing
from lss.ops import _ext


def compute_dtype(logits: Tensor) -> torch.dtype:
    """The dtype the kernels and the references compute in: float64 for float64 logits, else
    float32."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _fake_outputs(logits: Tensor, loss_shape, save_grad: bool):
    loss = logits.new_empty(loss_shape)
    grad = logits.new_empty(logits.shape if save_grad else (0,))
    return loss, grad, logits.new_empty((), dtype=compute_dtype(logits))


def _setup_context(ctx, inputs, output) -> None:
    _, grad, grad_scale = output
    ctx.reuse_grad = inputs[-1]
    ctx.save_grad = inputs[-2]
    ctx.reduction = inputs[-3]
    ctx.num_inputs = len(inputs)
    ctx.loss_dim = output[0].dim()
    ctx.mark_non_differentiable(grad, grad_scale)
    # The backward reads only the loss's grad_output: no zero-filled gradients for grad
    # (logits-sized) and grad_scale.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(grad, grad_scale)


def _private(module, name: str):
    """A private torch function, or None where this torch release has none (callers then take the
    public path)."""
    return getattr(module, name, None)


def _keeps_graph() -> bool:
    """Whether the running backward keeps the graph (retain_graph / create_graph); True outside a
    backward, and True where torch cannot tell (the safe answer: the saved gradient is then never
    overwritten)."""
    keep_graph = _private(torch._C._autograd, "_get_current_graph_task_keep_graph")
    return True if keep_graph is None else keep_graph()


def _can_scale_in_place(grad_loss: Tensor, grad: Tensor) -> bool:
    """The saved gradient may become the result when this backward is its last use (the graph is
    freed after it) in plain eager mode (no compiler, no tracing or other dispatch mode, no tensor
    subclass) and grad_output is one number of its dtype. This is an optimisation that reads private
    torch state; without it the backward writes a new tensor (the public path), which is always
    correct."""
    dispatch_depth = _private(torch._C, "_len_torch_dispatch_stack")
    if dispatch_depth is None or type(grad) is not Tensor or tracing() or dispatch_depth() != 0:
        return False
    return (
        grad_loss.numel() == 1
        and grad_loss.dtype == grad.dtype
        and grad_loss.device == grad.device
        and not _keeps_graph()
    )


def _backward(ctx, grad_loss, *_):
    if not ctx.save_grad:
        raise RuntimeError(
            "lss focal loss: the forward ran with save_grad=False, so it kept no gradient; call "
            "the op with save_grad=True (lss.ops.sigmoid_focal_loss / softmax_focal_loss do this "
            "when the logits need a gradient)"
        )
    if grad_loss is None:  # no gradient reached the loss (grads are not materialized)
        return (None,) * ctx.num_inputs
    grad, grad_scale = ctx.saved_tensors
    if ctx.reduction == "none" and ctx.loss_dim < grad.dim():
        grad_loss = grad_loss.unsqueeze(-1)  # softmax "none": one loss per row of N x C
    if ctx.reuse_grad and _can_scale_in_place(grad_loss, grad):
        torch.ops.lss._focal_loss_backward_(grad, grad_loss, grad_scale)
        grad_logits = grad
    else:
        grad_logits = torch.ops.lss._focal_loss_backward(grad_loss, grad, grad_scale)
    return (grad_logits,) + (None,) * (ctx.num_inputs - 1)


if _ext.has_ext():

    @torch.library.register_fake("lss::sigmoid_focal_loss")
    def _sigmoid_focal_loss_fake(
        logits, targets, weight, mask, alpha, gamma, reduction, save_grad, reuse_grad=False
    ):
        return _fake_outputs(logits, logits.shape if reduction == "none" else (), save_grad)

    @torch.library.register_fake("lss::softmax_focal_loss")
    def _softmax_focal_loss_fake(
        logits, targets, weight, alpha, gamma, reduction, save_grad, reuse_grad=False
    ):
        return _fake_outputs(logits, logits.shape[:1] if reduction == "none" else (), save_grad)

    @torch.library.register_fake("lss::_focal_loss_backward")
    def _focal_loss_backward_fake(grad_output, grad, grad_scale):
        return torch.empty_like(grad)

    @torch.library.register_fake("lss::_focal_loss_backward_")
    def _focal_loss_backward_inplace_fake(grad, grad_output, grad_scale):
        return None

    torch.library.register_autograd(
        "lss::sigmoid_focal_loss", _backward, setup_context=_setup_context
    )
    torch.library.register_autograd(
        "lss::softmax_focal_loss", _backward, setup_context=_setup_context
    )
