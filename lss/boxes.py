"""Box coding of 3D detection, shared by the targets (lss.data), the head (lss.models), the losses and evaluation
(lss.engine) and the pictures.

A box is M x 9 [x, y, z, w, l, h, yaw, vx, vy] in the ego frame (metres, radians, m/s): w across the heading, l
along it (the nuScenes size order), yaw about ego z from ego x. Maps are the H x W cells of a lss.geometry.BevGrid
(row = ego x, column = ego y); the first stage regresses REGRESSION_CHANNELS at a box's centre cell, the second
stage residuals of a proposal (box_residuals / apply_residuals).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from lss.geometry import BevGrid

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
# Which regression channel's code weight applies to each box residual of the second stage (yaw takes sin's).
RESIDUAL_WEIGHT_CHANNELS = (0, 1, 2, 3, 4, 5, 6, 8, 9)
# Sizes are clamped here when decoded so that an untrained head cannot produce inf boxes.
MAX_LOG_SIZE = 4.0


@dataclass
class Proposals:
    """Padded per-sample boxes: boxes B x P x 9, scores B x P, labels B x P (int64), valid B x P (bool)."""

    boxes: torch.Tensor
    scores: torch.Tensor
    labels: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def zeros(cls, batch: int, slots: int, device: torch.device) -> "Proposals":
        """batch x slots proposals, all invalid."""
        return cls(
            torch.zeros(batch, slots, BOX_DIM, device=device),
            torch.zeros(batch, slots, device=device),
            torch.zeros(batch, slots, dtype=torch.long, device=device),
            torch.zeros(batch, slots, dtype=torch.bool, device=device),
        )

    def cat(self, other: "Proposals") -> "Proposals":
        """These proposals followed by `other`'s in each sample: B x (P + Q)."""
        return Proposals(
            torch.cat([self.boxes, other.boxes], 1),
            torch.cat([self.scores, other.scores], 1),
            torch.cat([self.labels, other.labels], 1),
            torch.cat([self.valid, other.valid], 1),
        )


def check_boxes(boxes: torch.Tensor, labels: torch.Tensor, where: str) -> None:
    """Raise ValueError (prefixed by `where`) unless boxes are M x 9 and labels M integer class indices."""
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
    """Centre cells (row, col), int64 M each, of boxes M x 9 on the grid's map and whether each box can be encoded
    (M bool): centre on the map, a label in [0, num_classes), finite geometry and positive sizes."""
    u, v = grid.xy_to_cells(boxes[:, 0], boxes[:, 1])
    row, col = torch.floor(u).long(), torch.floor(v).long()
    ok = (
        (row >= 0)
        & (row < grid.nx)
        & (col >= 0)
        & (col < grid.ny)
        & (labels >= 0)
        & (labels < num_classes)
        & torch.isfinite(boxes[:, :7]).all(1)
        & (boxes[:, 3:6] > 0).all(1)
    )
    return row, col, ok


def gaussian_radius(length: torch.Tensor, width: torch.Tensor, min_overlap: float) -> torch.Tensor:
    """Largest centre shift (in the units of `length`/`width`) for which a box of that size still overlaps its
    shifted copy with IoU >= min_overlap, taking the worst of the three corner cases of CornerNet/CenterNet."""
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
    """Regression values N x 10 (REGRESSION_CHANNELS) of boxes N x 9 at their cells (row, col) of the grid's map:
    the sub-cell centre offset, z, log size, sin/cos yaw and the velocity (NaN where the box's is)."""
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
    """Boxes ... x 9 (ego frame) from regression values ... x 10 (REGRESSION_CHANNELS) read at cells (row, col) of
    the grid's map; the inverse of boxes_to_regression (log sizes clamped at MAX_LOG_SIZE)."""
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


def box_residuals(proposals: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """What the second stage learns, ... x 9: centre and velocity differences, log size ratios, wrapped yaw
    difference (so that apply_residuals(proposals, box_residuals(proposals, targets)) == targets)."""
    d_yaw = torch.remainder(targets[..., 6] - proposals[..., 6] + math.pi, 2 * math.pi) - math.pi
    return torch.cat(
        [
            targets[..., 0:3] - proposals[..., 0:3],
            torch.log(targets[..., 3:6] / proposals[..., 3:6]),
            d_yaw.unsqueeze(-1),
            targets[..., 7:9] - proposals[..., 7:9],
        ],
        dim=-1,
    )


def apply_residuals(proposals: torch.Tensor, residuals: torch.Tensor) -> torch.Tensor:
    """Refined boxes ... x 9 from proposals ... x 9 and second-stage residuals ... x 9 (see box_residuals)."""
    residuals = residuals.float()
    return torch.cat(
        [
            proposals[..., 0:3] + residuals[..., 0:3],
            proposals[..., 3:6] * torch.exp(residuals[..., 3:6].clamp(max=MAX_LOG_SIZE)),
            (proposals[..., 6] + residuals[..., 6]).unsqueeze(-1),
            proposals[..., 7:9] + residuals[..., 7:9],
        ],
        dim=-1,
    )


def bev_envelopes(boxes: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Axis-aligned BEV envelopes ... x 4 (x1, y1, x2, y2), ego metres, of rotated boxes ... x 9, scaled about the
    centre by `scale`."""
    cos, sin = torch.cos(boxes[..., 6]).abs(), torch.sin(boxes[..., 6]).abs()
    w, l = boxes[..., 3], boxes[..., 4]
    half_x = 0.5 * scale * (l * cos + w * sin)
    half_y = 0.5 * scale * (l * sin + w * cos)
    x, y = boxes[..., 0], boxes[..., 1]
    return torch.stack([x - half_x, y - half_y, x + half_x, y + half_y], dim=-1)


def ground_truth_proposals(
    gt_boxes: Sequence[torch.Tensor],
    gt_labels: Sequence[torch.Tensor],
    grid: BevGrid,
    num_classes: int,
    device: torch.device,
    generator: Optional[torch.Generator] = None,
    centre_jitter: float = 0.5,
    size_jitter: float = 0.1,
    yaw_jitter: float = 0.2,
) -> Proposals:
    """Jittered copies of the ground-truth boxes (one M_b x 9 tensor per sample) whose centre stays on the grid's
    map, as B x max(M_b) proposals with score 0 (the detection head scores them with its heatmap): positives for
    the second stage early in training. Jitter: centre std in metres, relative size std, yaw std in radians, one
    randn(M_b, 4) per non-empty sample from `generator` (default: the global CPU generator)."""
    M = max((len(b) for b in gt_boxes), default=0)
    out = Proposals.zeros(len(gt_boxes), M, device)
    for b, (boxes, labels) in enumerate(zip(gt_boxes, gt_labels)):
        if not len(boxes):
            continue
        boxes = boxes.to(device, torch.float32)
        noise = torch.randn(len(boxes), 4, generator=generator).to(device)
        jittered = boxes.clone()
        jittered[:, :2] += centre_jitter * noise[:, :2]
        jittered[:, 3:6] *= torch.exp(size_jitter * noise[:, 2:3])
        jittered[:, 6] += yaw_jitter * noise[:, 3]
        jittered[:, 7:9] = torch.nan_to_num(jittered[:, 7:9])
        labels = labels.to(device, torch.long)
        _, _, ok = centre_cells(jittered, labels, grid, num_classes)
        n = int(ok.sum())
        out.boxes[b, :n] = jittered[ok]
        out.labels[b, :n] = labels[ok]
        out.valid[b, :n] = True
    return out
