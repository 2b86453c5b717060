"""Training targets of the detection head's first stage: a gaussian centre heatmap per class and the box
regression (lss.boxes.REGRESSION_CHANNELS) at each object's centre cell, on the H x W map of a lss.geometry.BevGrid."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from lss.boxes import BOX_DIM, boxes_to_regression, centre_cells, check_boxes, gaussian_radius
from lss.config import DETECTION_CLASSES
from lss.geometry import BevGrid


def encode_targets(boxes: Sequence[torch.Tensor], labels: Sequence[torch.Tensor], grid: BevGrid,
                   num_classes: int = len(DETECTION_CLASSES), min_overlap: float = 0.1, min_radius: int = 2,
                   device: Optional[torch.device] = None) -> dict:
    """Training targets of the first stage for a batch of ground-truth boxes (one M_b x 9 tensor per sample).

    Returns a dict: "heatmap" B x num_classes x H x W (a gaussian per box, exactly 1 at its centre cell, max where
    gaussians overlap); for the N boxes whose centre lies on the map: "batch", "row", "col", "labels" (N int64),
    "regression" N x 10 (REGRESSION_CHANNELS) and "regression_mask" N x 10 (0 where the velocity is unknown, NaN).
    """
    if len(boxes) != len(labels):
        raise ValueError(f"encode_targets: got {len(boxes)} box tensors but {len(labels)} label tensors; expected "
                         "one of each per sample")
    device = device if device is not None else (boxes[0].device if len(boxes) else torch.device("cpu"))
    B, H, W = len(boxes), grid.nx, grid.ny
    heatmap = torch.zeros(B, num_classes, H, W, device=device)
    for b, (bx, lb) in enumerate(zip(boxes, labels)):
        check_boxes(bx, lb, f"encode_targets (sample {b})")
    all_boxes = torch.cat([bx.to(device, torch.float32) for bx in boxes]) if B else torch.zeros(0, BOX_DIM)
    all_labels = torch.cat([lb.to(device, torch.long) for lb in labels]) if B else torch.zeros(0, dtype=torch.long)
    batch = torch.cat([torch.full((len(bx),), b, dtype=torch.long, device=device) for b, bx in enumerate(boxes)]) \
        if B else torch.zeros(0, dtype=torch.long)

    row, col, keep = centre_cells(all_boxes, all_labels, grid, num_classes)
    all_boxes, all_labels, batch, row, col = (t[keep] for t in (all_boxes, all_labels, batch, row, col))

    if len(all_boxes):
        # Radius from the footprint in cells: l along the heading, w across it (CenterPoint's rule).
        radius = gaussian_radius(all_boxes[:, 4] / grid.cell_size[0], all_boxes[:, 3] / grid.cell_size[1],
                                 min_overlap)
        radius = torch.clamp(torch.floor(radius), min=min_radius).long()
        reach = int(radius.max())
        offsets = torch.arange(-reach, reach + 1, device=device)
        d_row, d_col = offsets.view(1, -1, 1), offsets.view(1, 1, -1)
        sigma = ((2 * radius + 1).float() / 6).view(-1, 1, 1)
        values = torch.exp(-(d_row ** 2 + d_col ** 2).float() / (2 * sigma ** 2))
        rows, cols = row.view(-1, 1, 1) + d_row, col.view(-1, 1, 1) + d_col
        r = radius.view(-1, 1, 1)
        inside = (d_row.abs() <= r) & (d_col.abs() <= r) & (rows >= 0) & (rows < H) & (cols >= 0) & (cols < W)
        plane = (batch * num_classes + all_labels).view(-1, 1, 1)
        flat = (plane * H + rows.clamp(0, H - 1)) * W + cols.clamp(0, W - 1)
        heatmap.view(-1).scatter_reduce_(0, flat[inside], values[inside], reduce="amax", include_self=True)

    regression = boxes_to_regression(all_boxes, row, col, grid)
    velocity_known = torch.isfinite(regression[:, 8:10])
    regression[:, 8:10] = torch.where(velocity_known, regression[:, 8:10], 0.0)
    mask = torch.ones_like(regression)
    mask[:, 8:10] = velocity_known.float()
    return {"heatmap": heatmap, "batch": batch, "row": row, "col": col, "labels": all_labels,
            "regression": regression, "regression_mask": mask}
