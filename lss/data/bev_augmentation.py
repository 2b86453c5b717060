"""BEV-space augmentation (as in BEVDet): one random similarity T of the ego frame per training
sample.

T = F @ (s * R_z(theta)) acts on ego points: rotate about z by theta (counter-clockwise seen from
above, x towards y), scale by s, then mirror ego x and/or ego y. Everything expressed in the ego
frame moves by T: the camera extrinsics (sensor2ego_rot <- T @ rot, sensor2ego_trans <- T @ trans),
so the lifted frustum lands in the augmented frame, and the box footprints, map geometry and
detection boxes the targets are drawn from, so the targets land in it too. Pixels and camera-frame
quantities (intrinsics, post_rot/post_trans, lidar depth targets: the lidar and the cameras move
together, so lidar -> camera is unchanged) stay as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from lss.geometry.boxes import BOX_CENTRE, BOX_DIM, BOX_SIZE, BOX_VELOCITY, BOX_YAW


@dataclass(frozen=True)
class BevAugmentation:
    """One draw: `rotate` degrees about z, ego frame scaled by `scale`, then ego x / ego y
    mirrored."""

    rotate: float = 0.0
    scale: float = 1.0
    flip_x: bool = False
    flip_y: bool = False

    def __post_init__(self):
        if not self.scale > 0:
            raise ValueError(
                f"BEV augmentation scale must be > 0, got {self.scale} (check data.bev_scale_lim)"
            )

    def matrix(self) -> np.ndarray:
        """3 x 3 float64 T acting on ego points (x, y, z)."""
        theta = math.radians(self.rotate)
        c, s = math.cos(theta), math.sin(theta)
        rotation = np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])
        flip = np.diag([-1.0 if self.flip_x else 1.0, -1.0 if self.flip_y else 1.0, 1.0])
        return flip @ (self.scale * rotation)

    def apply_to_extrinsics(
        self, sensor2ego_rot: np.ndarray, sensor2ego_trans: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """N x 3 x 3 rotations and N x 3 translations (camera -> ego) -> camera -> augmented ego,
        float32. The returned "rotation" is T @ rot: orthonormal times `scale`, with determinant -1
        under one flip."""
        m = self.matrix()
        rot = m @ np.asarray(sensor2ego_rot, np.float64)
        trans = np.asarray(sensor2ego_trans, np.float64) @ m.T
        return rot.astype(np.float32), trans.astype(np.float32)

    def apply_to_points_xy(self, points_xy: np.ndarray) -> np.ndarray:
        """... x 2 ego (x, y) metres -> the same points in the augmented frame (T keeps the plane
        z = 0)."""
        return np.asarray(points_xy, np.float64) @ self.matrix()[:2, :2].T

    def apply_to_yaw(self, yaw: np.ndarray) -> np.ndarray:
        """Headings (radians from +x towards +y) -> headings of the transformed heading vectors (not
        wrapped, so that the identity returns its input exactly)."""
        yaw = np.asarray(yaw, np.float64) + math.radians(self.rotate)
        yaw = math.pi - yaw if self.flip_x else yaw
        return -yaw if self.flip_y else yaw

    def apply_to_boxes(self, boxes: np.ndarray) -> np.ndarray:
        """M x 9 [x, y, z, w, l, h, yaw, vx, vy] ego-frame boxes -> augmented frame (centre by T,
        sizes and velocity scaled, heading and velocity mirrored and rotated), float32."""
        boxes = np.asarray(boxes, np.float64).reshape(-1, BOX_DIM)
        out = boxes.copy()
        out[:, BOX_CENTRE] = boxes[:, BOX_CENTRE] @ self.matrix().T
        out[:, BOX_SIZE] = boxes[:, BOX_SIZE] * self.scale
        out[:, BOX_YAW] = self.apply_to_yaw(boxes[:, BOX_YAW])
        out[:, BOX_VELOCITY] = self.apply_to_points_xy(boxes[:, BOX_VELOCITY])
        return out.astype(np.float32)


def sample_bev_augmentation(
    rot_lim: tuple[float, float],
    scale_lim: tuple[float, float],
    flip: bool,
    rng: Optional[np.random.Generator],
) -> Optional[BevAugmentation]:
    """Draw T: rotation U(rot_lim) degrees, scale U(scale_lim), each of the x and y flips with
    p = 0.5 when `flip`.

    Returns None, drawing nothing from `rng`, when every setting is off (rot_lim (0, 0),
    scale_lim (1, 1), no flip), so that configs without BEV augmentation see the same random stream
    and the same items as before.
    """
    if tuple(rot_lim) == (0.0, 0.0) and tuple(scale_lim) == (1.0, 1.0) and not flip:
        return None
    if rng is None:
        raise ValueError(
            "sample_bev_augmentation needs an rng (numpy Generator) when BEV augmentation is on"
        )
    rotate = float(rng.uniform(*rot_lim))
    scale = float(rng.uniform(*scale_lim))
    flip_x = bool(flip and rng.uniform() < 0.5)
    flip_y = bool(flip and rng.uniform() < 0.5)
    return BevAugmentation(rotate, scale, flip_x, flip_y)
