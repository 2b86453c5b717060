"""Focal loss forward + backward: lss kernels vs torchvision.ops.sigmoid_focal_loss and the pure-PyTorch reference.

floor_ms counts reading logits and targets once and writing the logits' gradient once, which is all that
forward + backward of the "mean" loss moves: the forward folds 1 / N into the gradient and the in-place backward
finds grad_output * grad_scale = 1 on the device and leaves it as is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torchvision

from lss.ops import (
    sigmoid_focal_loss,
    sigmoid_focal_loss_reference,
    softmax_focal_loss,
    softmax_focal_loss_reference,
)


def _fwd_bwd(loss_fn, logits):
    def step():
        return torch.autograd.grad(loss_fn(logits), logits)

    return step


def _dense_case(shape, dtype, device):
    logits = (torch.randn(shape, device=device) * 3).to(dtype).requires_grad_(True)
    targets = (torch.rand(shape, device=device) > 0.9).float()
    return logits, targets


def _dense_rows(ctx, name, shape, with_peers=True, dtype=torch.float32):
    logits, targets = _dense_case(shape, dtype, ctx.device)
    n = logits.numel()
    nbytes = n * (2 * logits.element_size() + targets.element_size())
    impls = {"lss": lambda x: sigmoid_focal_loss(x, targets, reduction="mean")}
    if with_peers:
        impls["torchvision"] = lambda x: torchvision.ops.sigmoid_focal_loss(
            x, targets, reduction="mean"
        )
        impls["reference"] = lambda x: sigmoid_focal_loss_reference(x, targets, reduction="mean")
    rows = []
    note = f"fwd+bwd, {str(dtype).replace('torch.', '')} logits, float32 targets, mean"
    for impl, fn in impls.items():
        ms = ctx.time(_fwd_bwd(fn, logits), warmup=5, reps=30)
        rows.append(
            {"case": name, "impl": impl, "ms": ms, "floor_ms": ctx.floor_ms(nbytes), "notes": note}
        )
    if (
        ctx.device.type == "cuda"
    ):  # GPU time alone: both replayed from CUDA graphs, no host overhead on either side
        for impl in ("lss", "torchvision") if with_peers else ("lss",):
            ms = ctx.time_graphed(_fwd_bwd(impls[impl], logits))
            rows.append(
                {
                    "case": name + ", CUDA graph",
                    "impl": impl,
                    "ms": ms,
                    "floor_ms": ctx.floor_ms(nbytes),
                    "notes": note + "; fwd+bwd captured once, replayed",
                }
            )
    return rows


def _class_index_rows(ctx, name, rows_, classes):
    logits = (torch.randn(rows_, classes, device=ctx.device) * 3).requires_grad_(True)
    labels = torch.randint(0, classes + 1, (rows_,), device=ctx.device)
    one_hot = F.one_hot(labels, classes + 1)[:, :classes].float()
    softmax_labels = torch.randint(-1, classes, (rows_,), device=ctx.device)
    nbytes = logits.numel() * 8 + labels.numel() * 8
    floor = ctx.floor_ms(nbytes)
    impls = {
        ("sigmoid " + name, "lss"): lambda x: sigmoid_focal_loss(x, labels, reduction="mean"),
        ("sigmoid " + name, "torchvision"): lambda x: (
            torchvision.ops.sigmoid_focal_loss(x, one_hot, reduction="sum") / rows_
        ),
        ("sigmoid " + name, "reference"): lambda x: sigmoid_focal_loss_reference(
            x, labels, reduction="mean"
        ),
        ("softmax " + name, "lss"): lambda x: softmax_focal_loss(x, softmax_labels),
        ("softmax " + name, "reference"): lambda x: softmax_focal_loss_reference(x, softmax_labels),
    }
    out = []
    for (case, impl), fn in impls.items():
        ms = ctx.time(_fwd_bwd(fn, logits), warmup=5, reps=30)
        note = "fwd+bwd, float32, class-index targets, mean = sum / N"
        if impl == "torchvision":
            note += "; one-hot targets built outside the timing"
        out.append({"case": case, "impl": impl, "ms": ms, "floor_ms": floor, "notes": note})
    return out


def run(ctx) -> list[dict]:
    if ctx.quick:
        dense = [("2x3x16x16", (2, 3, 16, 16))]
        index = ("1000x8", 1000, 8)
    else:
        dense = [("4x10x200x200", (4, 10, 200, 200)), ("16x10x512x512", (16, 10, 512, 512))]
        index = ("100000x80", 100000, 80)
    rows = []
    for name, shape in dense:
        rows += _dense_rows(ctx, name, shape)
    name, shape = dense[-1]
    rows += _dense_rows(ctx, name + " bf16", shape, with_peers=False, dtype=torch.bfloat16)
    rows += _class_index_rows(ctx, *index)
    return rows


def smoke(device) -> None:
    """Every focal loss op forward + backward once on small inputs (dense with weight and mask, class index,
    softmax with ignored rows), in float32 and bfloat16."""
    device = torch.device(device)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(2, 3, 17, 9, device=device).to(dtype).requires_grad_(True)
        targets = torch.rand(2, 3, 17, 9, device=device)
        mask = torch.rand(2, 1, 17, 9, device=device) > 0.3
        weight = torch.rand(3, device=device)
        for reduction in ("none", "mean", "sum"):
            sigmoid_focal_loss(
                logits, targets, 0.25, 0.5, reduction, class_weight=weight, mask=mask
            ).sum().backward()
        rows = torch.randn(37, 11, device=device).to(dtype).requires_grad_(True)
        labels = torch.randint(-1, 12, (37,), device=device)
        sigmoid_focal_loss(rows, labels.clamp_min(0), reduction="mean").backward()
        sigmoid_focal_loss(
            rows, labels.clamp_min(0), reduction="sum", weight=torch.rand(11, device=device)
        ).backward()
        softmax_focal_loss(
            rows, labels.clamp_max(10), weight=torch.rand(11, device=device)
        ).backward()
        softmax_focal_loss(rows, labels.clamp_max(10), reduction="none").sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
