"""Sigmoid and softmax focal loss (Lin et al., "Focal Loss for Dense Object Detection") as fused
one-pass kernels.

`sigmoid_focal_loss` takes torchvision.ops.sigmoid_focal_loss's arguments in its order and with its
defaults (inputs, targets, alpha=0.25, gamma=2, reduction="none"; our options are keyword-only) and
either dense float targets of the logits' shape (BEV masks B x K x X x Y, gaussian heatmaps, soft
labels: torchvision's value) or int64 class indices N for N x C logits (C is background, the
mmdetection convention; `weight` then has mmcv's meaning). `softmax_focal_loss` takes N x C logits
and int64 class indices N.

The kernels read logits and targets once, reduce "mean"/"sum" inside the kernel with deterministic
per-block partial sums, and, when the logits need a gradient, write it in the same pass (with the
reduction's 1 / N folded in where it is known on the host); the backward pass only scales it by
grad_output, in place on the device, and skips even that when the factor is 1 (loss.backward() of
the loss itself). Everything is computed in float32 (float64 for float64 logits) from
log-sigmoid / log-softmax forms, so logits of +-100 and gamma < 1 give neither NaN nor inf in any
dtype. No gradient flows to targets, weight or mask.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lss.host_sync import may_sync
from lss.ops import _ext
from lss.ops._args import real_number
from lss.ops._focal_autograd import compute_dtype

# Leaf functions for torch.fx.symbolic_trace (as torchvision's ops): a traced model keeps one call
# node per op.
torch.fx.wrap("sigmoid_focal_loss")
torch.fx.wrap("softmax_focal_loss")

__all__ = [
    "sigmoid_focal_loss",
    "softmax_focal_loss",
    "sigmoid_focal_loss_reference",
    "softmax_focal_loss_reference",
    "SigmoidFocalLoss",
    "SoftmaxFocalLoss",
]

_REDUCTIONS = ("none", "mean", "sum")


def _check_common(op: str, logits: Tensor, alpha: float, gamma: float, reduction: str) -> None:
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        got = logits.dtype if isinstance(logits, Tensor) else type(logits).__name__
        raise TypeError(f"{op}: logits must be a floating-point tensor, got {got}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not math.isfinite(real_number(alpha, "alpha", op)):
        raise ValueError(
            f"{op}: alpha must be finite (a negative alpha disables the class balancing), got "
            f"{alpha}"
        )
    gamma = real_number(gamma, "gamma", op)
    if not (math.isfinite(gamma) and gamma >= 0):
        raise ValueError(f"{op}: gamma must be a finite number >= 0, got {gamma}")


def _check_no_grad(op: str, **tensors: Optional[Tensor]) -> None:
    for name, t in tensors.items():
        if t is not None and t.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"{op}: no gradient flows to {name}, but it requires grad; pass {name}.detach()"
            )


def _prepare_weight(
    op: str, weight: Optional[Tensor], logits: Tensor, name: str = "weight"
) -> Optional[Tensor]:
    if weight is None:
        return None
    if not isinstance(weight, Tensor) or not weight.is_floating_point():
        raise TypeError(f"{op}: {name} must be a floating-point tensor of one entry per class")
    classes = logits.shape[1] if logits.dim() >= 2 else None
    if weight.dim() != 1 or classes is None or weight.shape[0] != classes:
        raise ValueError(
            f"{op}: {name} must be 1-D with one entry per class (logits dim 1 = {classes}), got "
            f"{name} of shape {tuple(weight.shape)} for logits of shape {tuple(logits.shape)}"
        )
    if weight.device != logits.device:
        raise ValueError(f"{op}: {name} is on {weight.device} but logits are on {logits.device}")
    return weight


def _is_index(targets: Tensor) -> bool:
    """Class-index targets (integers), as opposed to dense float or bool targets of the logits'
    shape."""
    return not (targets.is_floating_point() or targets.dtype == torch.bool)


def _label_weight(weight: Tensor) -> Tensor:
    """mmcv's per-class sample weight as the kernels take it: C + 1 entries, entry C (background
    rows) equal to 1."""
    return torch.cat([weight, weight.new_ones(1)])


def _check_class_range(op, targets, lowest, highest, expected):
    """Class indices outside [lowest, highest] (lowest None: no lower bound) raise before any kernel
    runs; on CUDA this reads two numbers back (one sync). Skipped where that sync may not happen
    (lss.host_sync.may_sync): the kernels then mark bad rows with NaN."""
    if targets.numel() == 0 or not may_sync(targets):
        return
    lo, hi = (int(v) for v in torch.aminmax(targets))
    if (lowest is not None and lo < lowest) or hi > highest:
        raise ValueError(f"{op}: targets must lie in {expected}, got values in [{lo}, {hi}]")


def _prepare_sigmoid_args(logits, targets, alpha, gamma, weight, class_weight, reduction, mask):
    """Validates the arguments; returns (targets, weight, mask) as the op takes them: the kernels'
    weight is class_weight (C entries, by column) or, for class-index targets, weight with a
    background entry 1 appended (C + 1 entries, by target label)."""
    op = "sigmoid_focal_loss"
    _check_common(op, logits, alpha, gamma, reduction)
    if not isinstance(targets, Tensor):
        raise TypeError(f"{op}: targets must be a tensor, got {type(targets).__name__}")
    if targets.device != logits.device:
        raise ValueError(f"{op}: targets are on {targets.device} but logits are on {logits.device}")
    if not _is_index(targets):
        if targets.shape != logits.shape:
            raise ValueError(
                f"{op}: dense targets must have the logits' shape {tuple(logits.shape)}, got "
                f"{tuple(targets.shape)} (for class indices pass an int64 tensor of shape N with "
                "N x C logits)"
            )
        if targets.dtype != logits.dtype:
            targets = targets.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    else:
        if logits.dim() != 2 or targets.dim() != 1 or targets.shape[0] != logits.shape[0]:
            raise ValueError(
                f"{op}: class-index targets need logits N x C and int64 targets N, got logits "
                f"{tuple(logits.shape)} and targets {tuple(targets.shape)} (for dense targets pass "
                "floats of the logits' shape)"
            )
        targets = targets.long()
        C = logits.shape[1]
        _check_class_range(op, targets, 0, C, f"[0, C] = [0, {C}] (C = background)")
    index_targets = _is_index(targets)
    if weight is not None and not index_targets:
        raise ValueError(
            f"{op}: weight scales sample n by weight[targets[n]] (mmcv's meaning) and needs int64 "
            "class-index targets; to weight the class columns of dense targets pass class_weight="
        )
    if weight is not None and class_weight is not None:
        raise ValueError(
            f"{op}: give weight (per sample, by its target class) or class_weight (per class "
            "column), not both; fold one into the other, e.g. "
            "class_weight * weight[targets][:, None] as a mask"
        )
    weight = _prepare_weight(op, weight, logits)
    class_weight = _prepare_weight(op, class_weight, logits, "class_weight")
    _check_no_grad(op, weight=weight, class_weight=class_weight)
    weight = _label_weight(weight) if weight is not None else class_weight
    if mask is not None:
        if not isinstance(mask, Tensor):
            raise TypeError(f"{op}: mask must be a tensor, got {type(mask).__name__}")
        if mask.device != logits.device:
            raise ValueError(f"{op}: mask is on {mask.device} but logits are on {logits.device}")
        try:
            shape = torch.broadcast_shapes(mask.shape, logits.shape)
        except RuntimeError:
            shape = None
        if shape != logits.shape:
            raise ValueError(
                f"{op}: mask of shape {tuple(mask.shape)} does not broadcast to the logits' shape "
                f"{tuple(logits.shape)} (for a B x X x Y visibility mask and B x K x X x Y logits "
                "use mask[:, None])"
            )
        mask = (mask if mask.dtype == torch.bool else mask > 0).expand(logits.shape)
    _check_no_grad(op, targets=targets)
    return targets, weight, mask


def sigmoid_focal_loss(
    inputs: Tensor,
    targets: Tensor,
    alpha: float = 0.25,
    gamma: float = 2.0,
    reduction: str = "none",
    *,
    weight: Optional[Tensor] = None,
    class_weight: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
) -> Tensor:
    """Sigmoid focal loss: ce(x, t) * (1 - p_t)^gamma * alpha_t, p = sigmoid(x). A drop-in for
    torchvision.ops.sigmoid_focal_loss (same positional arguments and defaults); the rest is
    keyword-only.

    inputs: the logits, any shape, float32/float16/bfloat16/float64; the class axis is
    dim 1 (B x K x X x Y, N x C).
    targets: either dense floats of the logits' shape (binary or soft, in [0, 1]), or int64 class
    indices N in [0, C] for N x C logits, C meaning background (every column negative).
    alpha: weight of positives, alpha_t = alpha t + (1 - alpha)(1 - t); a negative alpha disables
    it.
    reduction: "none" (loss of the logits' shape, the default as in torchvision), "sum", or "mean":
    over the elements (over the elements where mask > 0 when a mask is given; 0 when there are none)
    for dense targets, sum / N for class indices (as mmcv).
    weight: class-index targets only, C entries: the whole row of sample n is scaled by
    weight[targets[n]] (mmcv's sigmoid_focal_loss); background rows (target C) keep weight 1.
    class_weight: optional C per-class weights multiplying column c (either target form; not with
    weight).
    mask: optional bool or float tensor broadcastable to the logits; cells where mask <= 0 get zero
    loss and zero gradient (for example BEV cells that no camera sees).
    Returns a 0-dim tensor (or the logits' shape for "none") in the logits' dtype. Class indices
    outside [0, C] raise an error (on CUDA this check waits for the kernel).
    """
    logits = inputs
    targets, weight, mask = _prepare_sigmoid_args(
        logits, targets, alpha, gamma, weight, class_weight, reduction, mask
    )
    if _ext.use_reference("sigmoid_focal_loss"):
        return _sigmoid_reference(logits, targets, alpha, gamma, weight, reduction, mask)
    _ext.check_device("sigmoid_focal_loss", logits, targets, weight, mask)
    save_grad = torch.is_grad_enabled() and logits.requires_grad
    # reuse_grad: the gradient output is not handed out, so the backward may scale it in place.
    loss, _, _ = torch.ops.lss.sigmoid_focal_loss(
        logits, targets, weight, mask, float(alpha), float(gamma), reduction, save_grad, True
    )
    return loss


def softmax_focal_loss(
    logits: Tensor,
    targets: Tensor,
    alpha: float = 0.25,
    gamma: float = 2.0,
    weight: Optional[Tensor] = None,
    reduction: str = "mean",
) -> Tensor:
    """Softmax focal loss per sample: -alpha * (1 - p_t)^gamma * log(p_t), p = softmax(logits) along
    dim 1.

    logits: N x C float; targets: int64 N class indices in [0, C); negative targets are ignored
    (zero loss and gradient). weight: optional C per-class weights, sample n weighted by
    weight[targets[n]].
    reduction: "none" (N losses), "sum", or "mean" = sum / N (ignored samples count in N).
    Returns a 0-dim tensor (or N for "none") in the logits' dtype. Targets >= C raise an error (on
    CUDA this check waits for the kernel).
    """
    op = "softmax_focal_loss"
    _check_common(op, logits, alpha, gamma, reduction)
    if not isinstance(targets, Tensor) or not _is_index(targets):
        raise TypeError(f"{op}: targets must be an integer tensor of class indices (int64 N)")
    if logits.dim() != 2 or targets.dim() != 1 or targets.shape[0] != logits.shape[0]:
        raise ValueError(
            f"{op}: need logits N x C and targets N, got logits {tuple(logits.shape)} and targets "
            f"{tuple(targets.shape)}"
        )
    if targets.device != logits.device:
        raise ValueError(f"{op}: targets are on {targets.device} but logits are on {logits.device}")
    targets = targets.long()
    C = logits.shape[1]
    _check_class_range(op, targets, None, C - 1, f"[0, C) = [0, {C}) or < 0 (ignored)")
    weight = _prepare_weight(op, weight, logits)
    _check_no_grad(op, weight=weight)
    if _ext.use_reference(op):
        return softmax_focal_loss_reference(logits, targets, alpha, gamma, weight, reduction)
    _ext.check_device(op, logits, targets, weight)
    save_grad = torch.is_grad_enabled() and logits.requires_grad
    loss, _, _ = torch.ops.lss.softmax_focal_loss(
        logits, targets, weight, float(alpha), float(gamma), reduction, save_grad, True
    )
    return loss


def sigmoid_focal_loss_reference(
    inputs: Tensor,
    targets: Tensor,
    alpha: float = 0.25,
    gamma: float = 2.0,
    reduction: str = "none",
    *,
    weight: Optional[Tensor] = None,
    class_weight: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
) -> Tensor:
    """Pure-PyTorch `sigmoid_focal_loss` (same arguments and semantics), computed in float32 or
    float64."""
    if weight is not None:
        if not _is_index(targets):
            raise ValueError(
                "sigmoid_focal_loss: weight needs int64 class-index targets; use class_weight="
            )
        weight = _label_weight(weight)
    return _sigmoid_reference(
        inputs,
        targets,
        alpha,
        gamma,
        weight if weight is not None else class_weight,
        reduction,
        mask,
    )


def _sigmoid_reference(logits, targets, alpha, gamma, weight, reduction, mask):
    """The reference with the kernels' weight: C entries by column, or C + 1 by class-index
    target."""
    dtype = compute_dtype(logits)
    x = logits.to(dtype)
    index_targets = _is_index(targets)
    if index_targets:
        if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) > x.shape[1]):
            raise ValueError(
                f"sigmoid_focal_loss: class-index targets must lie in [0, C] = [0, {x.shape[1]}]"
            )
        t = F.one_hot(targets, x.shape[1] + 1)[:, : x.shape[1]].to(dtype)
    else:
        t = targets.to(dtype)
    ce = F.binary_cross_entropy_with_logits(x, t, reduction="none")
    q = torch.sigmoid(x) * (1 - t) + torch.sigmoid(-x) * t  # 1 - p_t without cancellation
    # The clamp keeps d q^gamma / dq finite at q = 0 (where the true limit of the product is 0).
    loss = ce * q.clamp_min(torch.finfo(dtype).tiny).pow(gamma)
    if alpha >= 0:
        loss = loss * (alpha * t + (1 - alpha) * (1 - t))
    if weight is not None and index_targets and weight.shape[0] == x.shape[1] + 1:
        loss = loss * weight.to(dtype)[targets][:, None]
    elif weight is not None:
        loss = loss * weight.to(dtype).view(-1, *([1] * (x.dim() - 2)))
    if mask is not None:
        keep = (mask if mask.dtype == torch.bool else mask > 0).expand(x.shape)
        loss = torch.where(keep, loss, torch.zeros((), dtype=dtype, device=x.device))
    if reduction == "none":
        return loss.to(logits.dtype)
    total = loss.sum()
    if reduction == "sum":
        return total.to(logits.dtype)
    if index_targets:
        count = x.shape[0]
    else:
        count = int(keep.sum()) if mask is not None else x.numel()
    return (total / max(count, 1)).to(logits.dtype)


def softmax_focal_loss_reference(
    logits: Tensor,
    targets: Tensor,
    alpha: float = 0.25,
    gamma: float = 2.0,
    weight: Optional[Tensor] = None,
    reduction: str = "mean",
) -> Tensor:
    """Pure-PyTorch `softmax_focal_loss` (same arguments and semantics), computed in float32 or
    float64."""
    dtype = compute_dtype(logits)
    x = logits.to(dtype)
    if targets.numel() and int(targets.max()) >= x.shape[1]:
        raise ValueError(
            f"softmax_focal_loss: targets must be < C = {x.shape[1]} (negative values are ignored)"
        )
    valid = targets >= 0
    t = targets.clamp_min(0)
    if x.shape[1] == 0:
        loss = x.new_zeros(x.shape[0])
    else:
        lpt = torch.log_softmax(x, dim=1).gather(1, t[:, None]).squeeze(1)
        u = -torch.expm1(lpt)  # 1 - p_t, exact near p_t = 1
        loss = -alpha * u.clamp_min(torch.finfo(dtype).tiny).pow(gamma) * lpt
        if weight is not None:
            loss = loss * weight.to(dtype)[t]
        loss = torch.where(valid, loss, torch.zeros((), dtype=dtype, device=x.device))
    if reduction == "none":
        return loss.to(logits.dtype)
    total = loss.sum()
    if reduction == "mean":
        total = total / max(x.shape[0], 1)
    return total.to(logits.dtype)


class SigmoidFocalLoss(nn.Module):
    """Module form of `sigmoid_focal_loss` (reduction "mean" by default, as mmcv's module);
    forward(logits, targets, mask=None). weight and class_weight have the function's meaning."""

    def __init__(
        self,
        alpha: float = 0.25,
        gamma: float = 2.0,
        weight: Optional[Tensor] = None,
        reduction: str = "mean",
        *,
        class_weight: Optional[Tensor] = None,
    ):
        super().__init__()
        self.alpha, self.gamma, self.reduction = alpha, gamma, reduction
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("class_weight", class_weight, persistent=False)

    def forward(self, logits: Tensor, targets: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        return sigmoid_focal_loss(
            logits,
            targets,
            self.alpha,
            self.gamma,
            self.reduction,
            weight=self.weight,
            class_weight=self.class_weight,
            mask=mask,
        )

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, gamma={self.gamma}, reduction={self.reduction!r}"


class SoftmaxFocalLoss(nn.Module):
    """Module form of `softmax_focal_loss`; forward(logits N x C, targets N)."""

    def __init__(
        self,
        alpha: float = 0.25,
        gamma: float = 2.0,
        weight: Optional[Tensor] = None,
        reduction: str = "mean",
    ):
        super().__init__()
        self.alpha, self.gamma, self.reduction = alpha, gamma, reduction
        self.register_buffer("weight", weight, persistent=False)

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
        return softmax_focal_loss(
            logits, targets, self.alpha, self.gamma, self.weight, self.reduction
        )

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, gamma={self.gamma}, reduction={self.reduction!r}"
