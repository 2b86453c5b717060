"""Lidar depth targets for the camera encoder's depth distribution (depth supervision as in
BEVDepth).

Every cell of a camera's stride-`downsample` feature map gets the depth-bin index of the NEAREST
lidar return that projects into it, or -1 (no return, or the nearest return outside grid.dbound).
Depth is the camera-frame z, the quantity the frustum's depth bins measure; bin k of dbound (lo, hi,
step) is [lo + k step, lo + (k + 1) step) (lss.geometry.depth_bin_index)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from pyquaternion import Quaternion

from lss.geometry import (
    NO_DEPTH_BIN,
    augment_pixels,
    camera_to_pixels,
    depth_bin_index,
    feature_cells,
)

IGNORE_DEPTH = NO_DEPTH_BIN


def lidar_to_camera_matrix(
    nusc, lidar_sample_data_token: str, camera_sample_data_token: str
) -> np.ndarray:
    """4 x 4 float64 map from the lidar frame to the camera frame through the devkit tables:
    lidar -> ego (lidar time) -> global -> ego (camera time) -> camera."""
    from nuscenes.utils.geometry_utils import transform_matrix

    def pose(record: dict, inverse: bool) -> np.ndarray:
        return transform_matrix(
            record["translation"], Quaternion(record["rotation"]), inverse=inverse
        )

    lidar = nusc.get("sample_data", lidar_sample_data_token)
    camera = nusc.get("sample_data", camera_sample_data_token)
    lidar_to_ego = pose(nusc.get("calibrated_sensor", lidar["calibrated_sensor_token"]), False)
    ego_to_global = pose(nusc.get("ego_pose", lidar["ego_pose_token"]), False)
    global_to_ego = pose(nusc.get("ego_pose", camera["ego_pose_token"]), True)
    ego_to_camera = pose(nusc.get("calibrated_sensor", camera["calibrated_sensor_token"]), True)
    return ego_to_camera @ global_to_ego @ ego_to_global @ lidar_to_ego


def load_lidar_points(path: str | Path, sample_token: str) -> np.ndarray:
    """P x 3 float64 finite points (lidar frame, metres) of a nuScenes .pcd.bin file: float32
    records of 5 values (x, y, z, intensity, ring), as the devkit's LidarPointCloud.from_file reads
    them (read here without the devkit, whose import would cost every fresh loader worker
    seconds)."""
    path = str(path)
    try:
        if not path.endswith(".bin"):
            raise ValueError("not a .bin file")
        points = np.fromfile(path, dtype=np.float32).reshape(-1, 5)[:, :3].astype(np.float64)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"lidar point cloud {path} not found (sample {sample_token}, channel LIDAR_TOP). "
            "data.depth_targets needs the LIDAR_TOP blobs (samples/LIDAR_TOP/*.pcd.bin) "
            "under the dataroot; unpack them or set data.depth_targets: false."
        ) from None
    except (ValueError, OSError) as e:
        raise OSError(
            f"lidar point cloud {path} could not be read (sample {sample_token}, channel "
            f"LIDAR_TOP): {type(e).__name__}: {e}. Expected float32 records of 5 values (x, y, z, "
            "intensity, ring) in a .pcd.bin file; re-extract the file."
        ) from None
    return points[np.isfinite(points).all(axis=1)]


def source_projection(
    points: np.ndarray, lidar_to_camera: np.ndarray, intrinsics: np.ndarray, image_size
) -> tuple[np.ndarray, np.ndarray]:
    """The returns of a sweep (points P x 3 float64, lidar frame) that lie in front of one camera
    (lidar_to_camera 4 x 4, intrinsics 3 x 3) and inside its source image (image_size W, H): their
    source pixels M x 2 and depths M, float64. The part of the depth targets that does not depend
    on the image augmentation."""
    to_camera = np.asarray(lidar_to_camera, np.float64)
    pixels, depth = camera_to_pixels(points @ to_camera[:3, :3].T + to_camera[:3, 3], intrinsics)
    src_w, src_h = image_size
    keep = (
        (depth > 0)
        & (pixels[:, 0] >= -0.5)
        & (pixels[:, 0] < src_w - 0.5)
        & (pixels[:, 1] >= -0.5)
        & (pixels[:, 1] < src_h - 0.5)
    )
    return pixels[keep], depth[keep]


def depth_targets_from_projections(
    projections: Sequence[tuple[np.ndarray, np.ndarray]],
    post_rot: np.ndarray,
    post_trans: np.ndarray,
    final_dim: Sequence[int],
    downsample: int,
    dbound: Sequence[float],
) -> np.ndarray:
    """Depth-bin targets of N cameras from one lidar sweep, given its returns in front of each
    camera and inside its source image (source_projection: pixels M x 2, depths M), under the image
    augmentation (post_rot N x 3 x 3, post_trans N x 3: pixel_aug = post_rot @ (u, v, d) +
    post_trans). A return counts when it also lies inside the final_dim = (H, W) augmented image.
    Returns N x fH x fW int64 bin indices in [0, D) (lss.geometry.depth_bin_index), IGNORE_DEPTH
    (-1) elsewhere; fH, fW = H // downsample, W // downsample."""
    height, width = (int(v) for v in final_dim)
    fh, fw = height // downsample, width // downsample
    count = len(projections)
    nearest = np.full(count * fh * fw, np.inf)
    for k, (pixels, depth) in enumerate(projections):
        augmented = augment_pixels(pixels, depth, post_rot[k], post_trans[k])
        row, col, inside = feature_cells(augmented, final_dim, downsample)
        np.minimum.at(nearest, (k * fh + row[inside]) * fw + col[inside], depth[inside])
    index = depth_bin_index(nearest, dbound)
    return index.reshape(count, fh, fw)
