"""Roi format conversion and validation shared by roi_align and roi_pool."""
from __future__ import annotations

from typing import Sequence, Union

import torch

Rois = Union[torch.Tensor, Sequence[torch.Tensor]]


def output_hw(output_size, op: str) -> tuple[int, int]:
    """(PH, PW) from an int or an (h, w) pair."""
    if isinstance(output_size, int):
        size = (output_size, output_size)
    else:
        size = tuple(output_size)
    if len(size) != 2 or not all(isinstance(s, int) and s > 0 for s in size):
        raise ValueError(f"lss.ops.{op}: output_size must be a positive int or an (h, w) pair of positive ints, "
                         f"got {output_size!r}")
    return size


def check_input(input: torch.Tensor, op: str) -> None:
    if not isinstance(input, torch.Tensor) or input.dim() != 4:
        shape = tuple(input.shape) if isinstance(input, torch.Tensor) else type(input).__name__
        raise ValueError(f"lss.ops.{op}: input must be an N x C x H x W tensor, got {shape}")
    if not input.is_floating_point():
        raise TypeError(f"lss.ops.{op}: input must be float32, float16, bfloat16 or float64, got {input.dtype}")


def roi_tensor(rois: Rois, input: torch.Tensor, op: str) -> torch.Tensor:
    """K x 5 (batch index, x1, y1, x2, y2) rois from a K x 5 tensor or a list of L_i x 4 boxes (one per image),
    in float32 (float64 for float64 features) on the features' device. Values are checked by check_roi_values."""
    dtype = torch.float64 if input.dtype == torch.float64 else torch.float32
    if isinstance(rois, torch.Tensor):
        if rois.dim() != 2 or rois.shape[1] != 5:
            raise ValueError(f"lss.ops.{op}: rois must be K x 5 (batch index, x1, y1, x2, y2) or a list of "
                             f"L_i x 4 boxes per image, got a tensor of shape {tuple(rois.shape)}")
        if not rois.is_floating_point():
            raise TypeError(f"lss.ops.{op}: rois must be floating point, got {rois.dtype}")
        if rois.device != input.device:
            raise ValueError(f"lss.ops.{op}: rois are on {rois.device} but input is on {input.device}; "
                             "move them to the same device")
        return rois.to(dtype)
    if not isinstance(rois, (list, tuple)):
        raise TypeError(f"lss.ops.{op}: rois must be a K x 5 tensor or a list of L_i x 4 tensors, got "
                        f"{type(rois).__name__}")
    if len(rois) > input.shape[0]:
        raise ValueError(f"lss.ops.{op}: got boxes for {len(rois)} images but the input batch has "
                         f"{input.shape[0]}")
    for i, boxes in enumerate(rois):
        if not isinstance(boxes, torch.Tensor) or boxes.dim() != 2 or boxes.shape[1] != 4:
            shape = tuple(boxes.shape) if isinstance(boxes, torch.Tensor) else type(boxes).__name__
            raise ValueError(f"lss.ops.{op}: rois[{i}] must be an L x 4 tensor (x1, y1, x2, y2), got {shape}")
        if boxes.device != input.device:
            raise ValueError(f"lss.ops.{op}: rois[{i}] is on {boxes.device} but input is on {input.device}")
    # One copy per image into a preallocated K x 5 tensor and one fill per image for its index column.
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
    """Raise on non-finite coordinates or batch indices that are not integers in [0, batch_size).
    Used for CPU rois and the reference; the CUDA forward kernels run the same check on the device and raise the
    same errors. Skipped while tracing (torch.compile), where the kernels zero such rois instead."""
    if rois.shape[0] == 0 or torch.compiler.is_compiling():
        return
    index = rois[:, 0]
    bad_index = (index < 0) | (index >= batch_size) | (index != index.floor())
    finite, index_ok = torch.stack([torch.isfinite(rois).all(), ~bad_index.any()]).tolist()
    if not finite:
        row = int((~torch.isfinite(rois)).any(dim=1).nonzero()[0])
        raise ValueError(f"lss.ops.{op}: rois must be finite; roi {row} is {rois[row].tolist()}. "
                         "Filter out boxes with NaN/inf coordinates first")
    if not index_ok:
        row = int(bad_index.nonzero()[0])
        raise ValueError(f"lss.ops.{op}: roi {row} has batch index {rois[row, 0].item()}, expected an integer in "
                         f"[0, {batch_size}) (the input batch size)")
