"""Pictures of 3D boxes: footprints with a heading tick on the BEV panel, wireframes projected into the (augmented)
camera images. Used by `lss viz` when the model has the detection head; conventions as in lss.viz (BEV forward up,
ego left on the left; RGB uint8 images). Ground truth is green, predictions red."""

from __future__ import annotations

from typing import Optional, Sequence

import cv2
import numpy as np

PREDICTION_COLOR = (230, 30, 30)
GROUND_TRUTH_COLOR = (20, 160, 20)
# Corner order: bottom face (front-left, rear-left, rear-right, front-right), then the top face in the same order.
_EDGES = (
    (0, 1),
    (1, 2),
    (2, 3),
    (3, 0),
    (4, 5),
    (5, 6),
    (6, 7),
    (7, 4),
    (0, 4),
    (1, 5),
    (2, 6),
    (3, 7),
)
# Boxes closer to a camera plane than this (metres) are not drawn in that camera.
_MIN_DEPTH = 0.5


def box_corners(boxes: np.ndarray) -> np.ndarray:
    """Corners M x 8 x 3 (ego frame) of boxes M x 9 [x, y, z, w, l, h, yaw, ...] (z the box centre)."""
    boxes = (
        np.asarray(boxes, dtype=np.float64).reshape(-1, 9) if np.size(boxes) else np.zeros((0, 9))
    )
    w, l, h = boxes[:, 3:4], boxes[:, 4:5], boxes[:, 5:6]
    sx = np.array([1, -1, -1, 1, 1, -1, -1, 1], dtype=np.float64) * 0.5
    sy = np.array([1, 1, -1, -1, 1, 1, -1, -1], dtype=np.float64) * 0.5
    sz = np.array([-1, -1, -1, -1, 1, 1, 1, 1], dtype=np.float64) * 0.5
    local = np.stack(
        [sx * l, sy * w, sz * h], axis=-1
    )  # M x 8 x 3 in the box frame (x along the heading)
    cos, sin = np.cos(boxes[:, 6]), np.sin(boxes[:, 6])
    rot = np.stack(
        [
            np.stack([cos, -sin, np.zeros_like(cos)], -1),
            np.stack([sin, cos, np.zeros_like(cos)], -1),
            np.tile([0.0, 0.0, 1.0], (len(boxes), 1)),
        ],
        axis=1,
    )  # M x 3 x 3
    return np.einsum("mij,mkj->mki", rot, local) + boxes[:, None, :3]


def draw_bev_boxes(
    panel: np.ndarray,
    boxes: np.ndarray,
    lower: Sequence[float],
    cell_size: Sequence[float],
    grid_shape: Sequence[int],
    color: Sequence[int],
    thickness: int = 1,
) -> np.ndarray:
    """Draw box footprints and a heading tick (centre to the front edge) in place on a BEV panel as lss.viz draws
    it: an nx x ny grid (lower / cell_size its x, y origin and cell size) scaled to the panel, forward up."""
    nx, ny = int(grid_shape[0]), int(grid_shape[1])
    scale = panel.shape[0] / nx
    color = tuple(int(c) for c in color)

    def to_pixels(points: np.ndarray) -> np.ndarray:
        rows = (nx - (points[..., 0] - lower[0]) / cell_size[0]) * scale
        cols = (ny - (points[..., 1] - lower[1]) / cell_size[1]) * scale
        return np.round(np.stack([cols, rows], -1)).astype(np.int32)

    boxes = (
        np.asarray(boxes, dtype=np.float64).reshape(-1, 9) if np.size(boxes) else np.zeros((0, 9))
    )
    for box, box_corner in zip(boxes, box_corners(boxes)):
        if not np.isfinite(box_corner).all():
            continue
        footprint = to_pixels(box_corner[:4, :2])
        cv2.polylines(panel, [footprint.reshape(-1, 1, 2)], True, color, thickness, cv2.LINE_AA)
        front = (box_corner[0, :2] + box_corner[3, :2]) / 2
        centre, tip = to_pixels(np.asarray(box[:2], np.float64)), to_pixels(front)
        cv2.line(
            panel,
            tuple(int(v) for v in centre),
            tuple(int(v) for v in tip),
            color,
            thickness,
            cv2.LINE_AA,
        )
    return panel


def project_to_image(
    points: np.ndarray,
    intrinsics: np.ndarray,
    sensor2ego_rot: np.ndarray,
    sensor2ego_trans: np.ndarray,
    post_rot: np.ndarray,
    post_trans: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Ego points ... x 3 -> augmented-image pixels ... x 2 and their camera depth ... (metres); the inverse of
    lss.geometry.frustum_to_ego for one camera (3 x 3 matrices, 3-vectors)."""
    camera = (np.asarray(points, np.float64) - sensor2ego_trans) @ np.asarray(
        sensor2ego_rot, np.float64
    )
    depth = camera[..., 2]
    pixels = camera @ np.asarray(intrinsics, np.float64).T
    uvd = np.concatenate(
        [
            pixels[..., :2] / np.where(np.abs(depth) < 1e-6, 1e-6, depth)[..., None],
            depth[..., None],
        ],
        axis=-1,
    )
    augmented = uvd @ np.asarray(post_rot, np.float64).T + post_trans
    return augmented[..., :2], depth


def draw_camera_boxes(
    image: np.ndarray,
    boxes: np.ndarray,
    intrinsics: np.ndarray,
    sensor2ego_rot: np.ndarray,
    sensor2ego_trans: np.ndarray,
    post_rot: np.ndarray,
    post_trans: np.ndarray,
    color: Sequence[int],
    thickness: int = 1,
) -> np.ndarray:
    """Draw box wireframes in place on one camera's H x W x 3 image (as augmented by the data pipeline); edges with
    an end behind the camera are left out."""
    corners = box_corners(boxes)
    if not len(corners):
        return image
    pixels, depth = project_to_image(
        corners, intrinsics, sensor2ego_rot, sensor2ego_trans, post_rot, post_trans
    )
    h, w = image.shape[:2]
    color = tuple(int(c) for c in color)
    for box_pixels, box_depth in zip(pixels, depth):
        if not np.isfinite(box_pixels).all() or (box_depth < _MIN_DEPTH).all():
            continue
        inside = (
            (box_pixels[:, 0] > -w)
            & (box_pixels[:, 0] < 2 * w)
            & (box_pixels[:, 1] > -h)
            & (box_pixels[:, 1] < 2 * h)
        )
        for a, b in _EDGES:
            if (
                box_depth[a] < _MIN_DEPTH
                or box_depth[b] < _MIN_DEPTH
                or not (inside[a] or inside[b])
            ):
                continue
            pa, pb = np.round(box_pixels[a]).astype(int), np.round(box_pixels[b]).astype(int)
            cv2.line(
                image,
                (int(pa[0]), int(pa[1])),
                (int(pb[0]), int(pb[1])),
                color,
                thickness,
                cv2.LINE_AA,
            )
    return image


def _as_numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def _box_layers(item: dict, predictions: Optional[dict], score_threshold: float) -> list:
    """(boxes, color) to draw: the ground truth when the item has it, then the confident predictions."""
    layers = []
    if "det_boxes" in item:
        layers.append((_as_numpy(item["det_boxes"]), GROUND_TRUTH_COLOR))
    if predictions is not None:
        keep = _as_numpy(predictions["scores"]) >= score_threshold
        layers.append((_as_numpy(predictions["boxes"])[keep], PREDICTION_COLOR))
    return layers


def draw_camera_detections(
    camera_images: np.ndarray, item: dict, predictions: Optional[dict], score_threshold: float = 0.3
) -> np.ndarray:
    """Copies of the item's N x H x W x 3 camera images with its ground-truth boxes (item["det_boxes"], when
    present, green) and the predictions ({"boxes", "scores"} from decode_detections, those scoring at least
    `score_threshold`, red) projected through the item's rig and augmentation."""
    images = np.ascontiguousarray(camera_images).copy()
    rig = [
        _as_numpy(item[k])
        for k in ("intrinsics", "sensor2ego_rot", "sensor2ego_trans", "post_rot", "post_trans")
    ]
    for boxes, color in _box_layers(item, predictions, score_threshold):
        for n, image in enumerate(images):
            draw_camera_boxes(image, boxes, *(r[n] for r in rig), color)
    return images


def draw_bev_detections(
    panel: np.ndarray, item: dict, grid, predictions: Optional[dict], score_threshold: float = 0.3
) -> np.ndarray:
    """A copy of the BEV panel (lss.viz.bev_panel of the lss.geometry.BevGrid `grid`) with the ground-truth and
    predicted boxes, as draw_camera_detections chooses them."""
    panel = np.ascontiguousarray(panel).copy()
    for boxes, color in _box_layers(item, predictions, score_threshold):
        draw_bev_boxes(panel, boxes, grid.lower, grid.cell_size, (grid.nx, grid.ny), color)
    return panel
