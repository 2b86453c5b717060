"""The sensor rig: the real nuScenes cameras (lss/data/nuscenes_rig.json) and a LIDAR_TOP on the
roof."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .reproducible import matmul, quaternion_matrix

CAMERAS = (
    "CAM_FRONT",
    "CAM_FRONT_RIGHT",
    "CAM_BACK_RIGHT",
    "CAM_BACK",
    "CAM_BACK_LEFT",
    "CAM_FRONT_LEFT",
)
LIDAR = "LIDAR_TOP"
NATIVE_SIZE = (1600, 900)  # width, height of the nuScenes images the intrinsics belong to
# The nuScenes LIDAR_TOP extrinsics (sensor -> ego): on the roof, x axis pointing to the ego's
# right.
LIDAR_TRANSLATION = (0.943713, 0.0, 1.84023)
LIDAR_ROTATION = (
    0.7077955119163518,
    -0.006492242056004365,
    0.010646214713995808,
    -0.7063073142877817,
)
RIG_FILE = Path(__file__).resolve().parent.parent / "nuscenes_rig.json"


@dataclass(frozen=True)
class Sensor:
    """One calibrated sensor: sensor -> ego translation (m) and rotation (w, x, y, z); intrinsics
    for cameras."""

    channel: str
    translation: tuple[float, float, float]
    rotation: tuple[float, float, float, float]
    intrinsic: np.ndarray | None = None  # 3 x 3, for the generated image size
    size: tuple[int, int] | None = None  # width, height

    @property
    def rotation_matrix(self) -> np.ndarray:
        """3 x 3 sensor -> ego rotation."""
        return quaternion_matrix(self.rotation)


def scaled_intrinsic(k: np.ndarray, image_size: tuple[int, int]) -> np.ndarray:
    """Intrinsics of a 1600 x 900 camera resized to `image_size` (width, height): focal lengths and
    principal point scale with the image. Returns 3 x 3."""
    sx, sy = image_size[0] / NATIVE_SIZE[0], image_size[1] / NATIVE_SIZE[1]
    out = np.array(k, dtype=np.float64).copy()
    out[0] *= sx
    out[1] *= sy
    return out


def load_rig(image_size: tuple[int, int] = NATIVE_SIZE) -> dict[str, Sensor]:
    """The six cameras (for images of `image_size`) and LIDAR_TOP, by channel."""
    if not RIG_FILE.exists():
        raise FileNotFoundError(
            f"camera rig file {RIG_FILE} is missing: it ships with lss (lss/data/); "
            "reinstall or restore it from the repository"
        )
    with open(RIG_FILE) as f:
        rig = json.load(f)
    out = {}
    for ch in CAMERAS:
        rec = rig[ch]
        out[ch] = Sensor(
            ch,
            tuple(rec["translation"]),
            tuple(rec["rotation"]),
            scaled_intrinsic(np.array(rec["camera_intrinsic"]), image_size),
            tuple(image_size),
        )
    out[LIDAR] = Sensor(LIDAR, LIDAR_TRANSLATION, LIDAR_ROTATION)
    return out


def sensor_pose(
    sensor: Sensor, ego_x: float, ego_y: float, ego_yaw: float
) -> tuple[np.ndarray, np.ndarray]:
    """Sensor -> global rotation (3 x 3) and sensor position (3,) for an ego pose on the ground
    plane."""
    c, s = math.cos(ego_yaw), math.sin(ego_yaw)
    ego_rot = np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])
    rot = matmul(ego_rot, sensor.rotation_matrix)
    pos = matmul(ego_rot, sensor.translation) + np.array([ego_x, ego_y, 0.0])
    return rot, pos
