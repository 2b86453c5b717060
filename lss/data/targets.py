"""BEV target rasterization: object footprints, map polygons and lines, camera visibility.

Raster convention (the model's output layout, lss.geometry.BevGrid, of which only x and y are
used): `raster[i, j]` with row i along ego x (forward) and column j along ego y (left); cell (i, j)
covers x in [xmin + i*dx, xmin + (i+1)*dx) and its centre is xmin + (i + 0.5)*dx (same for y).

OpenCV draws with integer pixel coordinates at pixel centres and (col, row) order, so an ego point
(x, y) is drawn at (col, row) = ((y - ymin)/dy - 0.5, (x - xmin)/dx - 0.5), with SHIFT fractional
bits of sub-cell precision. A filled shape marks every cell whose centre is inside it plus the cells
its outline passes through, so shapes grow by up to half a cell at their boundary (and a box smaller
than a cell still marks the cell it sits in)."""

from __future__ import annotations

from typing import Sequence

import cv2
import numpy as np

from lss.geometry import BevGrid, ego_to_pixels

SHIFT = 4
_SCALE = float(1 << SHIFT)


def cell_centers(grid: BevGrid) -> tuple[np.ndarray, np.ndarray]:
    """Cell-centre coordinates: (nx,) along ego x and (ny,) along ego y, metres (float64)."""
    return grid.to_metres(np.arange(grid.nx) + 0.5, 0), grid.to_metres(np.arange(grid.ny) + 0.5, 1)


def ego_to_raster_points(points_xy: np.ndarray, grid: BevGrid) -> np.ndarray:
    """... x 2 ego (x, y) metres -> ... x 2 int32 OpenCV points (col, row) with SHIFT fractional
    bits."""
    return _cells_to_points(_ego_to_cells(points_xy, grid))


def _ego_to_cells(points_xy: np.ndarray, grid: BevGrid) -> np.ndarray:
    """... x 2 ego (x, y) metres -> ... x 2 continuous (row, col) cell coordinates of `grid`."""
    return np.stack([grid.to_cells(points_xy[..., 0], 0), grid.to_cells(points_xy[..., 1], 1)], -1)


def rasterize_polygons(
    canvas: np.ndarray, polygons: Sequence[Sequence[np.ndarray]], grid: BevGrid
) -> np.ndarray:
    """Fill polygons (each a list of rings K x 2 in ego metres: exterior first, then holes) into
    `canvas` (nx x ny uint8) with 1. Polygons are drawn one by one, so overlaps stay filled and
    holes only cut their own polygon."""
    for rings in polygons:
        pts = [_cells_to_points(_ego_to_cells(np.asarray(r), grid)) for r in rings if len(r) >= 3]
        if pts:
            cv2.fillPoly(canvas, pts, 1, lineType=cv2.LINE_8, shift=SHIFT)
    return canvas


def rasterize_footprints(canvas: np.ndarray, footprints: np.ndarray, grid: BevGrid) -> np.ndarray:
    """Fill M x 4 x 2 box footprints (ego metres, lss.geometry.boxes.box_footprints) into `canvas`
    (nx x ny uint8) with 1."""
    for corners in ego_to_raster_points(np.asarray(footprints).reshape(-1, 4, 2), grid):
        cv2.fillConvexPoly(canvas, corners, 1, lineType=cv2.LINE_8, shift=SHIFT)
    return canvas


def rasterize_lines(
    canvas: np.ndarray, lines: Sequence[np.ndarray], grid: BevGrid, width: float
) -> np.ndarray:
    """Draw polylines (each K x 2 ego metres) as bands `width` cells wide into `canvas` (nx x ny
    uint8) with 1.

    Each segment is filled as a rectangle `width` cells across and each vertex as a disc, so cells
    whose centre lies within width/2 cells of the line are marked, whatever the line's direction.
    Like every fill here, OpenCV also marks the cells the outline passes through (up to about half a
    cell outside)."""
    if width <= 0:
        raise ValueError(f"line width must be > 0 cells, got {width}")
    half = width / 2.0
    radius = int(round(half * _SCALE))
    for line in lines:
        line = np.asarray(line, dtype=np.float64)
        if len(line) < 2:
            continue
        # Work in cell units so that the band width is the same along x and y.
        cells = _ego_to_cells(line, grid)
        start, end = cells[:-1], cells[1:]
        direction = end - start
        length = np.linalg.norm(direction, axis=1, keepdims=True)
        normal = np.stack([-direction[:, 1], direction[:, 0]], -1) / np.maximum(length, 1e-9) * half
        quads = np.stack([start + normal, end + normal, end - normal, start - normal], axis=1)
        for quad in _cells_to_points(quads[length[:, 0] > 0]):
            cv2.fillConvexPoly(canvas, quad, 1, lineType=cv2.LINE_8, shift=SHIFT)
        for joint in _cells_to_points(cells):
            cv2.circle(
                canvas,
                tuple(int(v) for v in joint),
                radius,
                1,
                thickness=-1,
                lineType=cv2.LINE_8,
                shift=SHIFT,
            )
    return canvas


def _cells_to_points(cells: np.ndarray) -> np.ndarray:
    """... x 2 (row, col) continuous cell coordinates (0 = grid edge) -> int32 OpenCV (col, row)
    fixed-point."""
    limit = float(1 << 26)
    pts = np.stack([cells[..., 1] - 0.5, cells[..., 0] - 0.5], axis=-1) * _SCALE
    return np.clip(np.rint(pts), -limit, limit).astype(np.int32)


def global_to_ego_xy(points_xy: np.ndarray, ego_xy: Sequence[float], ego_yaw: float) -> np.ndarray:
    """Planar transform of ... x 2 global map points into the ego frame given the ego position and
    yaw."""
    c, s = np.cos(ego_yaw), np.sin(ego_yaw)
    d = np.asarray(points_xy, dtype=np.float64) - np.asarray(ego_xy, dtype=np.float64)[:2]
    return np.stack([c * d[..., 0] + s * d[..., 1], -s * d[..., 0] + c * d[..., 1]], axis=-1)


def camera_visibility_mask(
    intrinsics: np.ndarray,
    sensor2ego_rot: np.ndarray,
    sensor2ego_trans: np.ndarray,
    post_rot: np.ndarray,
    post_trans: np.ndarray,
    final_dim: tuple[int, int],
    grid: BevGrid,
    depth_range: tuple[float, float],
    height: float = 0.0,
) -> np.ndarray:
    """Cells whose centre, at ego height `height`, some camera sees inside its (augmented) image
    within depth_range.

    Camera arrays are N x 3 x 3 / N x 3 (as in the dataset items). Depth is the camera-frame z, as
    for the lifted frustum, so the mask is the union of the cameras' frustum footprints on that
    plane. Returns nx x ny bool.
    """
    xs, ys = cell_centers(grid)
    gx, gy = np.meshgrid(xs, ys, indexing="ij")
    centres = np.stack([gx, gy, np.full_like(gx, height)], axis=-1)
    visible = np.zeros(gx.shape, dtype=bool)
    out_h, out_w = final_dim
    for k in range(len(intrinsics)):
        pixels, depth = ego_to_pixels(
            centres,
            intrinsics[k],
            sensor2ego_rot[k],
            sensor2ego_trans[k],
            post_rot[k],
            post_trans[k],
        )
        # A pixel centre at u covers [u - 0.5, u + 0.5).
        visible |= (
            (depth >= depth_range[0])
            & (depth < depth_range[1])
            & (pixels[..., 0] >= -0.5)
            & (pixels[..., 0] < out_w - 0.5)
            & (pixels[..., 1] >= -0.5)
            & (pixels[..., 1] < out_h - 0.5)
        )
    return visible
