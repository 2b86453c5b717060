"""Training targets of the detection head's first stage: a gaussian centre heatmap per class and the box
regression (lss.boxes.REGRESSION_CHANNELS) at each object's centre cell, on the H x W map of a lss.geometry.BevGrid.

`encode_targets` encodes a batch of box lists (any number of boxes per sample); `dense_targets` encodes one
sample in fixed shapes (objects padded to a maximum count), which the dataset yields while training so that the
loss needs no host work and the whole training step can be captured as one CUDA graph."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from lss.boxes import (
    BOX_DIM,
    REGRESSION_CHANNELS,
    boxes_to_regression,
    centre_cells,
    check_boxes,
    gaussian_radius,
)
from lss.config import DETECTION_CLASSES
from lss.geometry import BevGrid


def encode_targets(
    boxes: Sequence[torch.Tensor],
    labels: Sequence[torch.Tensor],
    grid: BevGrid,
    num_classes: int = len(DETECTION_CLASSES),
    min_overlap: float = 0.1,
    min_radius: int = 2,
    device: Optional[torch.device] = None,
) -> dict:
    """Training targets of the first stage for a batch of ground-truth boxes (one M_b x 9 tensor per sample).

    Returns a dict: "heatmap" B x num_classes x H x W (a gaussian per box, exactly 1 at its centre cell, max where
    gaussians overlap); for the N boxes whose centre lies on the map: "batch", "row", "col", "labels" (N int64),
    "regression" N x 10 (REGRESSION_CHANNELS) and "regression_mask" N x 10 (0 where the velocity is unknown, NaN).
    """
    if len(boxes) != len(labels):
        raise ValueError(
            f"encode_targets: got {len(boxes)} box tensors but {len(labels)} label tensors; expected "
            "one of each per sample"
        )
    device = (
        device if device is not None else (boxes[0].device if len(boxes) else torch.device("cpu"))
    )
    B, H, W = len(boxes), grid.nx, grid.ny
    heatmap = torch.zeros(B, num_classes, H, W, device=device)
    for b, (bx, lb) in enumerate(zip(boxes, labels)):
        check_boxes(bx, lb, f"encode_targets (sample {b})")
    all_boxes = (
        torch.cat([bx.to(device, torch.float32) for bx in boxes]) if B else torch.zeros(0, BOX_DIM)
    )
    all_labels = (
        torch.cat([lb.to(device, torch.long) for lb in labels])
        if B
        else torch.zeros(0, dtype=torch.long)
    )
    batch = (
        torch.cat(
            [
                torch.full((len(bx),), b, dtype=torch.long, device=device)
                for b, bx in enumerate(boxes)
            ]
        )
        if B
        else torch.zeros(0, dtype=torch.long)
    )

    row, col, keep = centre_cells(all_boxes, all_labels, grid, num_classes)
    all_boxes, all_labels, batch, row, col = (
        t[keep] for t in (all_boxes, all_labels, batch, row, col)
    )

    if len(all_boxes):
        # Radius from the footprint in cells: l along the heading, w across it (CenterPoint's rule).
        radius = gaussian_radius(
            all_boxes[:, 4] / grid.cell_size[0], all_boxes[:, 3] / grid.cell_size[1], min_overlap
        )
        radius = torch.clamp(torch.floor(radius), min=min_radius).long()
        reach = int(radius.max())
        offsets = torch.arange(-reach, reach + 1, device=device)
        d_row, d_col = offsets.view(1, -1, 1), offsets.view(1, 1, -1)
        sigma = ((2 * radius + 1).float() / 6).view(-1, 1, 1)
        values = torch.exp(-(d_row**2 + d_col**2).float() / (2 * sigma**2))
        rows, cols = row.view(-1, 1, 1) + d_row, col.view(-1, 1, 1) + d_col
        r = radius.view(-1, 1, 1)
        inside = (
            (d_row.abs() <= r)
            & (d_col.abs() <= r)
            & (rows >= 0)
            & (rows < H)
            & (cols >= 0)
            & (cols < W)
        )
        plane = (batch * num_classes + all_labels).view(-1, 1, 1)
        flat = (plane * H + rows.clamp(0, H - 1)) * W + cols.clamp(0, W - 1)
        heatmap.view(-1).scatter_reduce_(
            0, flat[inside], values[inside], reduce="amax", include_self=True
        )

    regression = boxes_to_regression(all_boxes, row, col, grid)
    velocity_known = torch.isfinite(regression[:, 8:10])
    regression[:, 8:10] = torch.where(velocity_known, regression[:, 8:10], 0.0)
    mask = torch.ones_like(regression)
    mask[:, 8:10] = velocity_known.float()
    return {
        "heatmap": heatmap,
        "batch": batch,
        "row": row,
        "col": col,
        "labels": all_labels,
        "regression": regression,
        "regression_mask": mask,
    }


# The keys of dense_targets, in the batch the training loss reads (lss.engine.detection_loss).
DENSE_TARGET_KEYS = (
    "det_target_heatmap",
    "det_target_index",
    "det_target_regression",
    "det_target_mask",
)


def dense_targets(
    boxes: torch.Tensor,
    labels: torch.Tensor,
    grid: BevGrid,
    num_classes: int = len(DETECTION_CLASSES),
    min_overlap: float = 0.1,
    min_radius: int = 2,
    max_objects: int = 256,
) -> dict:
    """One sample's first-stage targets (M x 9 boxes, M labels) in fixed shapes, padded to `max_objects` objects:
    "det_target_heatmap" num_classes x H x W (as encode_targets), "det_target_index" max_objects int64 (the centre
    cell, row * W + col), "det_target_regression" and "det_target_mask" max_objects x 10 (the regression target
    and its mask; padding rows are 0 in both). Raises ValueError when more than `max_objects` boxes lie on the map."""
    targets = encode_targets([boxes], [labels], grid, num_classes, min_overlap, min_radius)
    count = len(targets["labels"])
    if count > max_objects:
        raise ValueError(
            f"a training sample has {count} detection boxes on the {grid.nx} x {grid.ny} map, more than "
            f"detection.max_objects={max_objects}; raise detection.max_objects"
        )
    return {k: v[0] for k, v in pad_targets(targets, 1, grid.ny, slots=max_objects).items()}


def pad_targets(targets: dict, batch_size: int, width: int, slots: Optional[int] = None) -> dict:
    """encode_targets' output (a batch of samples, `width` = W of the map) in dense_targets' fixed-shape form,
    stacked over the batch, padded to `slots` objects per sample (default: the largest object count of a sample, at
    least 1)."""
    sample = targets["batch"]
    counts = torch.bincount(sample, minlength=batch_size)
    if slots is None:
        slots = max(int(counts.max()) if len(counts) else 0, 1)
    slot = (
        torch.arange(len(sample), device=sample.device) - (torch.cumsum(counts, 0) - counts)[sample]
    )
    device, channels = targets["heatmap"].device, len(REGRESSION_CHANNELS)
    index = torch.zeros(batch_size, slots, dtype=torch.long, device=device)
    index[sample, slot] = targets["row"] * width + targets["col"]
    regression = torch.zeros(batch_size, slots, channels, device=device)
    regression[sample, slot] = targets["regression"]
    mask = torch.zeros(batch_size, slots, channels, device=device)
    mask[sample, slot] = targets["regression_mask"]
    return {
        "det_target_heatmap": targets["heatmap"],
        "det_target_index": index,
        "det_target_regression": regression,
        "det_target_mask": mask,
    }
