"""Roi format conversion and validation shared by roi_align and roi_pool."""

from __future__ import annotations

import math
from typing import Sequence, Union

import torch

from lss.host_sync import may_sync
from lss.ops._args import real_number, whole_number

Rois = Union[torch.Tensor, Sequence[torch.Tensor]]

# Most bilinear samples per bin side for an explicit sampling_ratio: 64 x 64 samples a bin is far
# beyond what any detector uses (0 or 2) and still finishes quickly; larger values only burn time.
MAX_SAMPLING_RATIO = 64


def output_hw(output_size, op: str) -> tuple[int, int]:
    """(PH, PW) from an int or an (h, w) pair."""
    if isinstance(output_size, int) and not isinstance(output_size, bool):
        if output_size > 0:  # the common case: no pair to check
            return output_size, output_size
        size = (output_size, output_size)
    else:
        size = tuple(output_size) if isinstance(output_size, (tuple, list, torch.Size)) else ()
    if len(size) != 2 or not all(
        isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in size
    ):
        raise ValueError(
            f"lss.ops.{op}: output_size must be a positive int or an (h, w) pair of positive ints, "
            f"got {output_size!r}"
        )
    return size


def check_spatial_scale(spatial_scale: float, op: str) -> float:
    """spatial_scale as a float, finite and > 0 (NaN would pool to NaN or zeros, <= 0 collapses
    every roi)."""
    scale = real_number(spatial_scale, "spatial_scale", op)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(
            f"lss.ops.{op}: spatial_scale must be a finite number > 0 (feature-map pixels per "
            f"input pixel, e.g. 1/8 for a stride-8 map), got {spatial_scale!r}"
        )
    return scale


def check_sampling_ratio(sampling_ratio: int, op: str) -> int:
    """sampling_ratio as an int, at most MAX_SAMPLING_RATIO (<= 0 is the adaptive rule)."""
    ratio = whole_number(sampling_ratio, "sampling_ratio", op)
    if ratio > MAX_SAMPLING_RATIO:
        raise ValueError(
            f"lss.ops.{op}: sampling_ratio must be <= {MAX_SAMPLING_RATIO} samples per bin side "
            f"(or <= 0 for ceil(roi size / output size)), got {ratio}"
        )
    return ratio


def check_input(input: torch.Tensor, op: str) -> None:
    if not isinstance(input, torch.Tensor) or input.dim() != 4:
        shape = tuple(input.shape) if isinstance(input, torch.Tensor) else type(input).__name__
        raise ValueError(f"lss.ops.{op}: input must be an N x C x H x W tensor, got {shape}")
    if not input.is_floating_point():
        raise TypeError(
            f"lss.ops.{op}: input must be float32, float16, bfloat16 or float64, got {input.dtype}"
        )


def roi_tensor(rois: Rois, input: torch.Tensor, op: str) -> torch.Tensor:
    """K x 5 (batch index, x1, y1, x2, y2) rois from a K x 5 tensor or a list of L_i x 4 boxes (one
    per image), in float32 (float64 for float64 features) on the features' device. Values are
    checked by the kernels (raise_on_bad_rois) or check_roi_values."""
    dtype = torch.float64 if input.dtype == torch.float64 else torch.float32
    if isinstance(rois, torch.Tensor):
        if rois.dim() != 2 or rois.shape[1] != 5:
            raise ValueError(
                f"lss.ops.{op}: rois must be K x 5 (batch index, x1, y1, x2, y2) or a list of "
                f"L_i x 4 boxes per image, got a tensor of shape {tuple(rois.shape)}"
            )
        if not rois.is_floating_point():
            raise TypeError(f"lss.ops.{op}: rois must be floating point, got {rois.dtype}")
        if rois.device != input.device:
            raise ValueError(
                f"lss.ops.{op}: rois are on {rois.device} but input is on {input.device}; "
                "move them to the same device"
            )
        return rois if rois.dtype == dtype else rois.to(dtype)
    if not isinstance(rois, (list, tuple)):
        raise TypeError(
            f"lss.ops.{op}: rois must be a K x 5 tensor or a list of L_i x 4 tensors, got "
            f"{type(rois).__name__}"
        )
    if len(rois) > input.shape[0]:
        raise ValueError(
            f"lss.ops.{op}: got boxes for {len(rois)} images but the input batch has "
            f"{input.shape[0]}"
        )
    for i, boxes in enumerate(rois):
        if not isinstance(boxes, torch.Tensor) or boxes.dim() != 2 or boxes.shape[1] != 4:
            shape = tuple(boxes.shape) if isinstance(boxes, torch.Tensor) else type(boxes).__name__
            raise ValueError(
                f"lss.ops.{op}: rois[{i}] must be an L x 4 tensor (x1, y1, x2, y2), got {shape}"
            )
        if boxes.device != input.device:
            raise ValueError(
                f"lss.ops.{op}: rois[{i}] is on {boxes.device} but input is on {input.device}"
            )
    # One copy per image into a preallocated K x 5 tensor and one fill per image for its index
    # column.
    out = torch.empty(sum(b.shape[0] for b in rois), 5, dtype=dtype, device=input.device)
    start = 0
    for i, boxes in enumerate(rois):
        end = start + boxes.shape[0]
        if end > start:
            out[start:end, 0].fill_(i)
            out[start:end, 1:].copy_(boxes)
        start = end
    return out


def check_roi_values(rois: torch.Tensor, batch_size: int, op: str) -> None:
    """Raise on non-finite coordinates or batch indices that are not integers in [0, batch_size),
    with the errors of raise_on_bad_rois. The references' check (the kernels report bad rois in
    their record instead). Skipped where the host may not read the device (lss.host_sync.may_sync:
    tracing, or capturing a CUDA graph)."""
    if rois.shape[0] == 0 or not may_sync(rois):
        return
    index = rois[:, 0]
    non_finite = ~torch.isfinite(rois).all(dim=1)
    bad_index = (index < 0) | (index >= batch_size) | (index != index.floor())
    first = [torch.where(m.any(), m.int().argmax(), -1) for m in (non_finite, bad_index)]
    _raise_first_bad_roi(rois, *torch.stack(first).tolist(), batch_size, op)


def should_validate(validate, input: torch.Tensor) -> bool:
    """validate=None (the ops' default) reads the bad-roi record only where that costs no host sync
    (CPU). The wrappers pass the answer to the forward op as record_bad_rois: a record nobody reads
    is not kept (on CUDA, no allocation and memset of it per call)."""
    return (not input.is_cuda) if validate is None else bool(validate)


def raise_on_bad_rois(bad_rois: torch.Tensor, rois: torch.Tensor, batch_size: int, op: str) -> None:
    """Raise for the first bad roi in a forward op's record (its third output with
    record_bad_rois=True: the first roi with non-finite coordinates and the first with a bad batch
    index, -1 for none), non-finite coordinates first. Reading the record waits for the kernel (a
    host sync); skipped where that sync may not happen (lss.host_sync.may_sync: tracing, or
    capturing a CUDA graph), where bad rois just pool to zeros."""
    if not may_sync(bad_rois):
        return
    _raise_first_bad_roi(rois, *bad_rois.tolist(), batch_size, op)


def _raise_first_bad_roi(
    rois: torch.Tensor, non_finite: int, bad_index: int, batch_size: int, op: str
) -> None:
    if non_finite >= 0:
        raise ValueError(
            f"lss.ops.{op}: rois must be finite; roi {non_finite} is {rois[non_finite].tolist()}. "
            "Filter out boxes with NaN/inf coordinates first"
        )
    if bad_index >= 0:
        raise ValueError(
            f"lss.ops.{op}: roi {bad_index} has batch index {rois[bad_index, 0].item()}, expected "
            f"an integer in [0, {batch_size}) (the input batch size)"
        )
