"""Pictures of 3D boxes: footprints with a heading tick on the BEV panels, wireframes projected into
the (augmented) camera images. Used by lss.viz when the model has the detection head (BEV forward
up, ego left on the left; RGB uint8 images). Ground truth is green, predictions red."""

from __future__ import annotations

from typing import Optional, Sequence

import cv2
import numpy as np

from lss.geometry.boxes import box_corners
from lss.geometry import RIG_KEYS, ego_to_pixels

PREDICTION_COLOR = (230, 30, 30)
GROUND_TRUTH_COLOR = (20, 160, 20)
SCORE_THRESHOLD = 0.3  # the predicted boxes drawn score at least this
# Corner order: bottom face (front-left, rear-left, rear-right, front-right), then the top face in
# the same order.
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


def draw_bev_boxes(
    panel: np.ndarray,
    boxes: np.ndarray,
    view,
    color: Sequence[int],
    thickness: int = 1,
) -> np.ndarray:
    """Draw box footprints and a heading tick (centre to the front edge) in place on a BEV panel;
    `view` places ego metres on the panel (lss.viz.bev.BevView: forward up, ego left on the
    left)."""
    color = tuple(int(c) for c in color)

    def to_pixels(points: np.ndarray) -> np.ndarray:
        return np.floor(view.to_pixels(points)).astype(np.int32)

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
    """Draw box wireframes in place on one camera's H x W x 3 image (as augmented by the data
    pipeline); edges with an end behind the camera are left out."""
    corners = box_corners(boxes)
    if not len(corners):
        return image
    pixels, depth = ego_to_pixels(
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


def true_boxes(item: dict) -> np.ndarray:
    """The item's ground-truth boxes M x 9 (item["det_boxes"]; none where the item has no detection
    targets)."""
    return _as_numpy(item["det_boxes"]).reshape(-1, 9) if "det_boxes" in item else np.zeros((0, 9))


def confident_boxes(predictions: dict, score_threshold: float = SCORE_THRESHOLD) -> np.ndarray:
    """The predicted boxes M x 9 ({"boxes", "scores"} from decode_detections) scoring at least
    `score_threshold`."""
    keep = _as_numpy(predictions["scores"]) >= score_threshold
    return _as_numpy(predictions["boxes"]).reshape(-1, 9)[keep]


def draw_camera_detections(
    camera_images: np.ndarray,
    item: dict,
    predictions: Optional[dict],
    score_threshold: float = SCORE_THRESHOLD,
) -> np.ndarray:
    """Copies of the item's N x H x W x 3 camera images with its ground-truth boxes (green) and the
    predictions scoring at least `score_threshold` (red) projected through the item's rig and
    augmentation."""
    images = np.ascontiguousarray(camera_images).copy()
    rig = [_as_numpy(item[k]) for k in RIG_KEYS]
    layers = [(true_boxes(item), GROUND_TRUTH_COLOR)]
    if predictions is not None:
        layers.append((confident_boxes(predictions, score_threshold), PREDICTION_COLOR))
    for boxes, color in layers:
        for n, image in enumerate(images):
            draw_camera_boxes(image, boxes, *(r[n] for r in rig), color)
    return images
