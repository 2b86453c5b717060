"""Non-maximum suppression over axis-aligned boxes (x1, y1, x2, y2), as torchvision.ops.nms /
batched_nms.

Boxes are visited by decreasing score (a stable sort, so equal scores keep index order); a box is
dropped when its IoU with an already kept box is strictly greater than iou_threshold. IoU is
computed in float32 (float64 for float64 boxes), fp16/bf16 boxes included. NaN scores sort above
every number (torch.sort's order), so NaN-scored boxes are visited first; filter them out beforehand
if that is not wanted.
"""

from __future__ import annotations

import torch

from lss.ops import _ext
from lss.ops._args import real_number

# Leaf functions for torch.fx.symbolic_trace (as torchvision's ops): a traced model keeps one call
# node per op.
torch.fx.wrap("nms")
torch.fx.wrap("batched_nms")


def _check(boxes, scores, idxs, op):
    if not isinstance(boxes, torch.Tensor) or boxes.dim() != 2 or boxes.shape[1] != 4:
        shape = tuple(boxes.shape) if isinstance(boxes, torch.Tensor) else type(boxes).__name__
        raise ValueError(f"lss.ops.{op}: boxes must be N x 4 (x1, y1, x2, y2), got {shape}")
    if not isinstance(scores, torch.Tensor) or scores.dim() != 1:
        shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"lss.ops.{op}: scores must be 1-D (N), got {shape}")
    if boxes.shape[0] != scores.shape[0]:
        raise ValueError(
            f"lss.ops.{op}: boxes and scores must have the same length, got {boxes.shape[0]} boxes "
            f"and {scores.shape[0]} scores"
        )
    if not boxes.is_floating_point() or not scores.is_floating_point():
        raise TypeError(
            f"lss.ops.{op}: boxes and scores must be floating point, got {boxes.dtype} and "
            f"{scores.dtype}"
        )
    if scores.device != boxes.device:
        raise ValueError(f"lss.ops.{op}: boxes are on {boxes.device} but scores on {scores.device}")
    if idxs is not None:
        if not isinstance(idxs, torch.Tensor) or idxs.dim() != 1 or idxs.shape[0] != boxes.shape[0]:
            shape = tuple(idxs.shape) if isinstance(idxs, torch.Tensor) else type(idxs).__name__
            raise ValueError(
                f"lss.ops.{op}: idxs must be 1-D with one class per box ({boxes.shape[0]}), got "
                f"{shape}"
            )
        if idxs.is_floating_point() or idxs.is_complex() or idxs.dtype == torch.bool:
            raise TypeError(f"lss.ops.{op}: idxs must be an integer tensor, got {idxs.dtype}")
        if idxs.device != boxes.device:
            raise ValueError(f"lss.ops.{op}: idxs are on {idxs.device} but boxes on {boxes.device}")


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Greedy NMS of boxes (N x 4) with scores (N). Returns the kept indices (int64) by decreasing
    score. On CUDA the suppression bitmap (its upper triangle) takes about N^2 / 16 bytes (0.63 GB
    at 100k boxes)."""
    _check(boxes, scores, None, "nms")
    iou_threshold = real_number(iou_threshold, "iou_threshold", "nms")
    if _ext.use_reference("nms"):
        return nms_reference(boxes, scores, iou_threshold)
    _ext.check_device("nms", boxes, scores)
    return torch.ops.lss.nms(boxes, scores, iou_threshold)


def batched_nms(
    boxes: torch.Tensor, scores: torch.Tensor, idxs: torch.Tensor, iou_threshold: float
) -> torch.Tensor:
    """NMS where only boxes of the same category (idxs, N integers) suppress each other. Returns the
    kept indices by decreasing score. Classes are compared directly instead of shifting boxes apart
    by a class offset, so any coordinates work (negative BEV coordinates included) and no precision
    is lost to large offsets. On CUDA, from 2,048 boxes each class runs as a segment of its own, all
    classes at once (bitmap about sum N_c^2 / 16 bytes). As torchvision's, boxes with no elements (N
    x 4 with N = 0, or any empty tensor such as a 1-D one) give an empty int64 result whatever
    scores and idxs are."""
    if isinstance(boxes, torch.Tensor) and boxes.numel() == 0:
        return torch.empty((0,), dtype=torch.int64, device=boxes.device)
    _check(boxes, scores, idxs, "batched_nms")
    iou_threshold = real_number(iou_threshold, "iou_threshold", "batched_nms")
    if _ext.use_reference("batched_nms"):
        return nms_reference(boxes, scores, iou_threshold, idxs)
    _ext.check_device("batched_nms", boxes, scores, idxs)
    return torch.ops.lss.batched_nms(boxes, scores, idxs, iou_threshold)


def nms_reference(
    boxes: torch.Tensor,
    scores: torch.Tensor,
    iou_threshold: float,
    idxs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-PyTorch greedy NMS (test oracle and fallback): one vectorised IoU row per kept box, O(N)
    memory. With idxs, boxes of different classes never suppress each other."""
    _check(boxes, scores, idxs, "nms")
    iou_threshold = real_number(iou_threshold, "iou_threshold", "nms")
    n = boxes.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.long, device=boxes.device)
    acc = torch.float64 if boxes.dtype == torch.float64 else torch.float32
    order = torch.sort(scores, descending=True, stable=True).indices
    b = boxes.to(acc)[order]
    cls = idxs[order] if idxs is not None else None
    area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    threshold = torch.tensor(iou_threshold, dtype=acc)
    suppressed = torch.zeros(n, dtype=torch.bool, device=boxes.device)
    keep = []
    for i in range(n):
        if suppressed[i]:
            continue
        keep.append(i)
        rest = b[i + 1 :]
        w = (torch.minimum(b[i, 2], rest[:, 2]) - torch.maximum(b[i, 0], rest[:, 0])).clamp(min=0)
        h = (torch.minimum(b[i, 3], rest[:, 3]) - torch.maximum(b[i, 1], rest[:, 1])).clamp(min=0)
        inter = w * h
        over = inter / (area[i] + area[i + 1 :] - inter) > threshold.to(b.device)
        if cls is not None:
            over &= cls[i + 1 :] == cls[i]
        suppressed[i + 1 :] |= over
    return order[torch.tensor(keep, dtype=torch.long, device=boxes.device)]


if _ext.has_ext():

    def _nms_fake_impl(boxes, scores):
        torch._check(
            boxes.shape[0] == scores.shape[0],
            lambda: "nms: boxes and scores must have the same length",
        )
        n = torch.library.get_ctx().new_dynamic_size()
        return boxes.new_empty((n,), dtype=torch.long)

    @torch.library.register_fake("lss::nms")
    def _nms_fake(boxes, scores, iou_threshold):
        return _nms_fake_impl(boxes, scores)

    @torch.library.register_fake("lss::batched_nms")
    def _batched_nms_fake(boxes, scores, idxs, iou_threshold):
        return _nms_fake_impl(boxes, scores)
