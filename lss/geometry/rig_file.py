"""Rig files: a camera rig's calibration as JSON, in the fields of nuScenes' calibrated_sensor
table.

One object per camera channel:
    "CAM_FRONT": {"translation": [x, y, z],                 camera -> ego, metres
                  "rotation": [w, x, y, z],                 camera -> ego, unit quaternion
                  "camera_intrinsic": [[fx, 0, cx], [0, fy, cy], [0, 0, 1]],
                  "image_size": [width, height]}            optional: the images' size in pixels
Keys that start with "_" are notes. The camera frame is nuScenes' (x right, y down, z forward),
the ego frame x forward, y left, z up. lss/data/nuscenes_rig.json is one; `lss make-synthetic`
writes one next to its set (rig.json).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

from lss.errors import ArgumentError

FIELDS = ("translation", "rotation", "camera_intrinsic")


def _numbers(value, shape: tuple, what: str) -> np.ndarray:
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        array = None
    if array is None or array.shape != shape:
        want = " x ".join(str(v) for v in shape)
        raise ArgumentError(f"{what}: expected {want} numbers, got {value!r}")
    if not np.isfinite(array).all():
        raise ArgumentError(f"{what}: holds NaN or inf ({value!r}); give finite numbers")
    return array


def cam_to_ego_matrix(rotation: Sequence[float], translation: Sequence[float]) -> np.ndarray:
    """4 x 4 camera -> ego transform (float64) of a calibrated_sensor record's quaternion
    (w, x, y, z; normalised) and translation (metres)."""
    from pyquaternion import Quaternion

    matrix = np.eye(4)
    matrix[:3, :3] = Quaternion(*rotation).rotation_matrix
    matrix[:3, 3] = translation
    return matrix


def read_rig_file(
    path: Union[str, Path], cameras: Sequence[str]
) -> tuple[np.ndarray, np.ndarray, list[Optional[tuple[int, int]]]]:
    """The rig file at `path` for `cameras`, in that order: (intrinsics N x 3 x 3, camera -> ego
    N x 4 x 4, both float64, and each camera's image_size (width, height) or None where the file
    gives none). ArgumentError, naming the file and the camera, for a missing file or camera and
    for a field that is missing or not finite numbers of its shape."""
    path = Path(path)
    try:
        rig = json.loads(path.read_text())
    except FileNotFoundError:
        raise ArgumentError(
            f"rig file {path} does not exist: pass a JSON file of the cameras' calibration "
            "(docs/predict.md; `lss make-synthetic` writes an example, rig.json)"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArgumentError(f"rig file {path} cannot be read as JSON ({e})") from None
    if not isinstance(rig, dict):
        raise ArgumentError(f"rig file {path}: expected a JSON object of camera channels")
    have = [k for k in rig if not k.startswith("_")]
    missing = [c for c in cameras if c not in rig]
    if missing:
        raise ArgumentError(
            f"rig file {path} has no calibration of camera(s) {', '.join(missing)}; it has "
            f"{', '.join(have) or 'none'}: add them (the model takes {', '.join(cameras)})"
        )
    intrinsics, cam_to_ego, sizes = [], [], []
    for camera in cameras:
        record = rig[camera]
        where = f"rig file {path}, {camera}"
        if not isinstance(record, dict) or any(f not in record for f in FIELDS):
            raise ArgumentError(f"{where}: expected an object with the fields {', '.join(FIELDS)}")
        quaternion = _numbers(record["rotation"], (4,), f"{where}, rotation (w, x, y, z)")
        if not math.isclose(float(np.linalg.norm(quaternion)), 1.0, abs_tol=1e-3):
            raise ArgumentError(
                f"{where}, rotation: {quaternion.tolist()} is not a unit quaternion (norm "
                f"{np.linalg.norm(quaternion):.4g}); give the rotation as w, x, y, z of norm 1"
            )
        translation = _numbers(record["translation"], (3,), f"{where}, translation")
        intrinsics.append(_numbers(record["camera_intrinsic"], (3, 3), f"{where}, intrinsic"))
        cam_to_ego.append(cam_to_ego_matrix(quaternion, translation))
        size = record.get("image_size")
        sizes.append(None if size is None else tuple(int(v) for v in _numbers(size, (2,), where)))
    return np.stack(intrinsics), np.stack(cam_to_ego), sizes


def rig_record(
    intrinsic: np.ndarray,
    rotation: Sequence[float],
    translation: Sequence[float],
    image_size: Optional[Sequence[int]] = None,
) -> dict:
    """One camera's entry of a rig file (quaternion w, x, y, z)."""
    record = {
        "translation": [float(v) for v in translation],
        "rotation": [float(v) for v in rotation],
        "camera_intrinsic": np.asarray(intrinsic, dtype=np.float64).tolist(),
    }
    if image_size is not None:
        record["image_size"] = [int(v) for v in image_size]
    return record


def write_rig_file(path: Union[str, Path], records: dict, note: str = "") -> Path:
    """Write a rig file of `records` (camera channel -> rig_record), with `note` as its "_note"."""
    path = Path(path)
    content = ({"_note": note} if note else {}) | dict(records)
    path.write_text(json.dumps(content, indent=1) + "\n")
    return path
