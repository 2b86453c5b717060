"""3D boxes of the detection head: the vocabulary, the box coding and the one target encoder,
shared by the dataset (lss.data), the head and its loss (lss.models.heads), evaluation and pictures.

A box is M x 9 [x, y, z, w, l, h, yaw, vx, vy] in the ego frame (metres, radians, m/s): z the
centre height, w across the heading, l along it (the nuScenes size order), yaw about ego z from ego
x. Maps are the H x W cells of a lss.geometry.BevGrid (row = ego x, column = ego y); the first
stage regresses REGRESSION_CHANNELS at a box's centre cell (encode_targets, dense_targets), the
second stage residuals of a proposal (box_residuals / apply_residuals).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch

from lss.geometry.grid import BevGrid

# The nuScenes detection benchmark's classes in label order (the heatmap channels of the head).
DETECTION_CLASSES = (
    "car",
    "truck",
    "bus",
    "trailer",
    "construction_vehicle",
    "pedestrian",
    "motorcycle",
    "bicycle",
    "traffic_cone",
    "barrier",
)
REGRESSION_CHANNELS = (
    "offset_x",
    "offset_y",
    "z",
    "log_w",
    "log_l",
    "log_h",
    "sin_yaw",
    "cos_yaw",
    "vx",
    "vy",
)
BOX_DIM = 9
# Where each quantity sits in a box's BOX_DIM values.
BOX_CENTRE = slice(0, 3)  # x, y, z
BOX_SIZE = slice(3, 6)  # w, l, h
BOX_YAW = 6
BOX_VELOCITY = slice(7, 9)  # vx, vy
# the parts of a box the second stage's residuals move (detection.refine_residuals)
RESIDUAL_PARTS = {
    "centre": BOX_CENTRE,
    "size": BOX_SIZE,
    "yaw": slice(6, 7),
    "velocity": BOX_VELOCITY,
}
# The regression channel whose code weight each second-stage box residual takes (yaw: sin's).
RESIDUAL_WEIGHT_CHANNELS = (0, 1, 2, 3, 4, 5, 6, 8, 9)
# Sizes are clamped here when decoded so that an untrained head cannot produce inf boxes.
MAX_LOG_SIZE = 4.0


def check_boxes(boxes: torch.Tensor, labels: torch.Tensor, where: str) -> None:
    """Raise ValueError (prefixed by `where`) unless boxes are M x 9 and labels M integer class
    indices."""
    if boxes.dim() != 2 or boxes.shape[1] != BOX_DIM:
        raise ValueError(
            f"{where}: expected boxes M x {BOX_DIM} [x, y, z, w, l, h, yaw, vx, vy], got "
            f"{tuple(boxes.shape)}"
        )
    if labels.dim() != 1 or labels.shape[0] != boxes.shape[0]:
        raise ValueError(
            f"{where}: expected labels of shape ({boxes.shape[0]},) matching the boxes, got "
            f"{tuple(labels.shape)}"
        )
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"{where}: expected integer labels (indices into DETECTION_CLASSES), got {labels.dtype}"
        )


def centre_cells(
    boxes: torch.Tensor, labels: torch.Tensor, grid: BevGrid, num_classes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Centre cells (row, col), int64 M each, of boxes M x 9 on the grid's map and whether each box
    can be encoded (M bool): centre on the map, a label in [0, num_classes), finite geometry and
    positive sizes."""
    u, v = grid.xy_to_cells(boxes[:, 0], boxes[:, 1])
    row, col = torch.floor(u).long(), torch.floor(v).long()
    ok = (
        grid.contains(boxes[:, 0], boxes[:, 1])
        & (labels >= 0)
        & (labels < num_classes)
        & torch.isfinite(boxes[:, :7]).all(1)
        & (boxes[:, 3:6] > 0).all(1)
    )
    return row, col, ok


def gaussian_radius(length: torch.Tensor, width: torch.Tensor, min_overlap: float) -> torch.Tensor:
    """Largest centre shift (in the units of `length`/`width`) for which a box of that size still
    overlaps its shifted copy with IoU >= min_overlap, taking the worst of the three corner cases of
    CornerNet/CenterNet."""
    b1 = length + width
    c1 = width * length * (1 - min_overlap) / (1 + min_overlap)
    r1 = (b1 + torch.sqrt((b1**2 - 4 * c1).clamp(min=0))) / 2
    b2 = 2 * (length + width)
    c2 = (1 - min_overlap) * width * length
    r2 = (b2 + torch.sqrt((b2**2 - 16 * c2).clamp(min=0))) / 2
    a3 = 4 * min_overlap
    b3 = -2 * min_overlap * (length + width)
    c3 = (min_overlap - 1) * width * length
    r3 = (b3 + torch.sqrt((b3**2 - 4 * a3 * c3).clamp(min=0))) / 2
    return torch.minimum(torch.minimum(r1, r2), r3)


def boxes_to_regression(
    boxes: torch.Tensor, row: torch.Tensor, col: torch.Tensor, grid: BevGrid
) -> torch.Tensor:
    """Regression values N x 10 (REGRESSION_CHANNELS) of boxes N x 9 at their cells (row, col) of
    the grid's map: the sub-cell centre offset, z, log size, sin/cos yaw and the velocity (NaN where
    the box's is)."""
    u, v = grid.xy_to_cells(boxes[:, 0], boxes[:, 1])
    yaw = boxes[:, 6]
    return torch.cat(
        [
            (u - row).unsqueeze(1),
            (v - col).unsqueeze(1),
            boxes[:, 2:3],
            torch.log(boxes[:, 3:6]),
            torch.sin(yaw).unsqueeze(1),
            torch.cos(yaw).unsqueeze(1),
            boxes[:, 7:9],
        ],
        dim=1,
    )


def regression_to_boxes(
    regression: torch.Tensor, row: torch.Tensor, col: torch.Tensor, grid: BevGrid
) -> torch.Tensor:
    """Boxes ... x 9 (ego frame) from regression values ... x 10 (REGRESSION_CHANNELS) read at cells
    (row, col) of the grid's map; the inverse of boxes_to_regression (log sizes clamped at
    MAX_LOG_SIZE)."""
    regression = regression.float()
    x = (row.float() + regression[..., 0]) * grid.cell_size[0] + grid.lower[0]
    y = (col.float() + regression[..., 1]) * grid.cell_size[1] + grid.lower[1]
    size = torch.exp(regression[..., 3:6].clamp(max=MAX_LOG_SIZE))
    yaw = torch.atan2(regression[..., 6], regression[..., 7])
    return torch.cat(
        [
            x.unsqueeze(-1),
            y.unsqueeze(-1),
            regression[..., 2:3],
            size,
            yaw.unsqueeze(-1),
            regression[..., 8:10],
        ],
        dim=-1,
    )


def wrap_angle(angle: torch.Tensor) -> torch.Tensor:
    """Angles (radians) wrapped to [-pi, pi)."""
    return torch.remainder(angle + math.pi, 2 * math.pi) - math.pi


def yaw_difference(proposals: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """... : each target's heading minus its proposal's, wrapped to [-pi, pi)."""
    return wrap_angle(targets[..., BOX_YAW] - proposals[..., BOX_YAW])


def box_residuals(proposals: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """What the second stage learns, ... x 9: centre and velocity differences, log size ratios,
    wrapped yaw difference (so that apply_residuals(proposals, box_residuals(proposals, targets)) ==
    targets)."""
    d_yaw = yaw_difference(proposals, targets)
    return torch.cat(
        [
            targets[..., BOX_CENTRE] - proposals[..., BOX_CENTRE],
            torch.log(targets[..., BOX_SIZE] / proposals[..., BOX_SIZE]),
            d_yaw.unsqueeze(-1),
            targets[..., BOX_VELOCITY] - proposals[..., BOX_VELOCITY],
        ],
        dim=-1,
    )


def turn_around(boxes: torch.Tensor, reversed_: torch.Tensor) -> torch.Tensor:
    """Boxes ... x 9 with those where `reversed_` (bool ...) turned around: heading + pi (wrapped
    to [-pi, pi)), velocity negated; the others unchanged."""
    yaw = boxes[..., BOX_YAW]
    flip = reversed_.unsqueeze(-1)
    return torch.cat(
        [
            boxes[..., :BOX_YAW],
            torch.where(reversed_, wrap_angle(yaw + math.pi), yaw).unsqueeze(-1),
            torch.where(flip, -boxes[..., BOX_VELOCITY], boxes[..., BOX_VELOCITY]),
        ],
        dim=-1,
    )


def reversed_heading(proposals: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """bool ...: whether each proposal's heading is more than 90 degrees from its target's."""
    return yaw_difference(proposals, targets).abs() > math.pi / 2


def apply_residuals(
    proposals: torch.Tensor, residuals: torch.Tensor, parts: Sequence[str] = tuple(RESIDUAL_PARTS)
) -> torch.Tensor:
    """Refined boxes ... x 9 from proposals ... x 9 and second-stage residuals ... x 9 (see
    box_residuals); only the residuals of `parts` (names of RESIDUAL_PARTS) are applied, the
    other values stay the proposals'."""
    residuals = residuals.float()
    if set(parts) != set(RESIDUAL_PARTS):
        unknown = set(parts) - set(RESIDUAL_PARTS)
        if unknown:
            raise ValueError(
                f"apply_residuals: unknown parts {sorted(unknown)}; expected names from "
                f"{list(RESIDUAL_PARTS)}"
            )
        keep = torch.zeros(BOX_DIM, dtype=torch.bool, device=residuals.device)
        for name in parts:
            keep[RESIDUAL_PARTS[name]] = True
        residuals = torch.where(keep, residuals, 0.0)
    return torch.cat(
        [
            proposals[..., BOX_CENTRE] + residuals[..., BOX_CENTRE],
            proposals[..., BOX_SIZE] * torch.exp(residuals[..., BOX_SIZE].clamp(max=MAX_LOG_SIZE)),
            (proposals[..., BOX_YAW] + residuals[..., BOX_YAW]).unsqueeze(-1),
            proposals[..., BOX_VELOCITY] + residuals[..., BOX_VELOCITY],
        ],
        dim=-1,
    )


def bev_envelopes(boxes: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Axis-aligned BEV envelopes ... x 4 (x1, y1, x2, y2), ego metres, of rotated boxes ... x 9,
    scaled about the centre by `scale`."""
    cos, sin = torch.cos(boxes[..., 6]).abs(), torch.sin(boxes[..., 6]).abs()
    w, l = boxes[..., 3], boxes[..., 4]
    half_x = 0.5 * scale * (l * cos + w * sin)
    half_y = 0.5 * scale * (l * sin + w * cos)
    x, y = boxes[..., 0], boxes[..., 1]
    return torch.stack([x - half_x, y - half_y, x + half_x, y + half_y], dim=-1)


def box_footprints(centers_xy, sizes_wl, yaws) -> np.ndarray:
    """Bottom rectangles of boxes: M x 2 centres, M x 2 (w, l), M yaws -> M x 4 x 2 corners (same
    frame, float64): front-left, rear-left, rear-right, front-right, with l along the heading (yaw
    from +x towards +y) and w across it, as in the nuScenes `size` field."""
    centers_xy = np.asarray(centers_xy, dtype=np.float64).reshape(-1, 2)
    sizes_wl = np.asarray(sizes_wl, dtype=np.float64).reshape(-1, 2)
    yaws = np.asarray(yaws, dtype=np.float64).reshape(-1)
    along = sizes_wl[:, 1:2] / 2 * np.array([1.0, -1.0, -1.0, 1.0])
    across = sizes_wl[:, 0:1] / 2 * np.array([1.0, 1.0, -1.0, -1.0])
    c, s = np.cos(yaws)[:, None], np.sin(yaws)[:, None]
    x = c * along - s * across + centers_xy[:, None, 0]
    y = s * along + c * across + centers_xy[:, None, 1]
    return np.stack([x, y], axis=-1)


# The points of a box whose features the "points" second stage reads: the centre and the middles of
# the front, rear, left and right faces (CenterPoint's second stage), in units of (l/2, w/2).
BOX_POINTS = ((0.0, 0.0), (1.0, 0.0), (-1.0, 0.0), (0.0, 1.0), (0.0, -1.0))


def box_points(boxes: torch.Tensor) -> torch.Tensor:
    """The BOX_POINTS of boxes ... x 9 (rotated with each box) at its centre height: ... x K x 3.
    From the boxes alone (no tensor from host data: a captured step cannot copy it)."""
    half_l, half_w = boxes[..., 4:5] / 2, boxes[..., 3:4] / 2
    along = torch.cat([half_l * a for a, _ in BOX_POINTS], -1)
    across = torch.cat([half_w * c for _, c in BOX_POINTS], -1)
    cos, sin = torch.cos(boxes[..., 6:7]), torch.sin(boxes[..., 6:7])
    x = boxes[..., 0:1] + cos * along - sin * across
    y = boxes[..., 1:2] + sin * along + cos * across
    return torch.stack([x, y, boxes[..., 2:3].expand_as(x)], dim=-1)


def box_corners(boxes) -> np.ndarray:
    """Corners M x 8 x 3 (float64, the boxes' frame) of boxes M x 9: the bottom face in
    box_footprints' order, then the top face in the same order."""
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, BOX_DIM)
    footprint = box_footprints(boxes[:, 0:2], boxes[:, 3:5], boxes[:, 6])
    half_h = boxes[:, 5:6] / 2
    bottom = np.broadcast_to((boxes[:, 2:3] - half_h)[:, :, None], (len(boxes), 4, 1))
    top = bottom + 2 * half_h[:, :, None]
    return np.concatenate(
        [np.concatenate([footprint, bottom], -1), np.concatenate([footprint, top], -1)], 1
    )


def encode_targets(
    boxes: Sequence[torch.Tensor],
    labels: Sequence[torch.Tensor],
    grid: BevGrid,
    num_classes: int = len(DETECTION_CLASSES),
    min_overlap: float = 0.1,
    min_radius: int = 2,
    device: Optional[torch.device] = None,
) -> dict:
    """Training targets of the first stage for a batch of ground-truth boxes (one M_b x 9 tensor per
    sample).

    Returns a dict: "heatmap" B x num_classes x H x W (a gaussian per box, exactly 1 at its centre
    cell, max where gaussians overlap); for the N boxes whose centre lies on the map: "batch",
    "row", "col", "labels" (N int64), "boxes" N x 9, "regression" N x 10 (REGRESSION_CHANNELS) and
    "regression_mask" N x 10 (0 where the velocity is unknown, NaN)."""
    if len(boxes) != len(labels):
        raise ValueError(
            f"encode_targets: got {len(boxes)} box tensors but {len(labels)} label tensors; "
            "expected one of each per sample"
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
        "boxes": all_boxes,
    }


# The keys of dense_targets in a batch (read by lss.models.heads.detection_loss).
DENSE_TARGET_KEYS = (
    "det_target_heatmap",
    "det_target_index",
    "det_target_regression",
    "det_target_mask",
)
# The padded ground truth of dense_targets (B x max_objects x 9 boxes, labels -1 on padding), read
# by the detection head's second stage while training.
REFINE_TARGET_KEYS = ("det_target_boxes", "det_target_labels")


def dense_targets(
    boxes: torch.Tensor,
    labels: torch.Tensor,
    grid: BevGrid,
    num_classes: int = len(DETECTION_CLASSES),
    min_overlap: float = 0.1,
    min_radius: int = 2,
    max_objects: int = 256,
) -> dict:
    """One sample's first-stage targets (M x 9 boxes, M labels) in fixed shapes, padded to
    `max_objects` objects: "det_target_heatmap" num_classes x H x W (as encode_targets),
    "det_target_index" max_objects int64 (the centre cell, row * W + col), "det_target_regression"
    and "det_target_mask" max_objects x 10 (the regression target and its mask; padding rows are 0
    in both), "det_target_boxes" max_objects x 9 and "det_target_labels" max_objects (-1 on
    padding). Raises ValueError when more than `max_objects` boxes lie on the map."""
    targets = encode_targets([boxes], [labels], grid, num_classes, min_overlap, min_radius)
    count = len(targets["labels"])
    if count > max_objects:
        raise ValueError(
            f"a training sample has {count} detection boxes on the {grid.nx} x {grid.ny} map, "
            f"more than detection.max_objects={max_objects}; raise detection.max_objects"
        )
    return {k: v[0] for k, v in pad_targets(targets, 1, grid.ny, slots=max_objects).items()}


def pad_targets(targets: dict, batch_size: int, width: int, slots: Optional[int] = None) -> dict:
    """encode_targets' output (a batch of samples, `width` = W of the map) in dense_targets'
    fixed-shape form, stacked over the batch, padded to `slots` objects per sample (default: the
    largest object count of a sample, at least 1)."""
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
    boxes = torch.zeros(batch_size, slots, BOX_DIM, device=device)
    boxes[sample, slot] = targets["boxes"]
    labels = torch.full((batch_size, slots), -1, dtype=torch.long, device=device)
    labels[sample, slot] = targets["labels"]
    return {
        "det_target_heatmap": targets["heatmap"],
        "det_target_index": index,
        "det_target_regression": regression,
        "det_target_mask": mask,
        "det_target_boxes": boxes,
        "det_target_labels": labels,
    }
