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


def project_depth_targets(
    points: np.ndarray,
    lidar_to_camera: np.ndarray,
    intrinsics: np.ndarray,
    post_rot: np.ndarray,
    post_trans: np.ndarray,
    image_sizes: np.ndarray,
    final_dim: Sequence[int],
    downsample: int,
    dbound: Sequence[float],
) -> np.ndarray:
    """Depth-bin targets of N cameras from one lidar sweep.

    points P x 3 (lidar frame), lidar_to_camera N x 4 x 4, intrinsics N x 3 x 3, post_rot N x 3 x 3
    and post_trans N x 3 (the image augmentation: pixel_aug = post_rot @ (u, v, d) + post_trans),
    image_sizes N x 2 (source W, H). A return counts when it lies in front of the camera, inside the
    source image and inside the final_dim = (H, W) augmented image. Returns N x fH x fW int64 bin
    indices in [0, D) (lss.geometry.depth_bin_index), IGNORE_DEPTH (-1) elsewhere;
    fH, fW = H // downsample, W // downsample.
    """
    height, width = (int(v) for v in final_dim)
    fh, fw = height // downsample, width // downsample
    count = len(lidar_to_camera)
    nearest = np.full(count * fh * fw, np.inf)
    points = np.asarray(points, np.float64).reshape(-1, 3)
    for k in range(count):
        to_camera = np.asarray(lidar_to_camera[k], np.float64)
        pixels, depth = camera_to_pixels(
            points @ to_camera[:3, :3].T + to_camera[:3, 3], intrinsics[k]
        )
        src_w, src_h = image_sizes[k]
        keep = (
            (depth > 0)
            & (pixels[:, 0] >= -0.5)
            & (pixels[:, 0] < src_w - 0.5)
            & (pixels[:, 1] >= -0.5)
            & (pixels[:, 1] < src_h - 0.5)
        )
        pixels, depth = pixels[keep], depth[keep]
        augmented = augment_pixels(pixels, depth, post_rot[k], post_trans[k])
        row, col, inside = feature_cells(augmented, final_dim, downsample)
        np.minimum.at(nearest, (k * fh + row[inside]) * fw + col[inside], depth[inside])
    index = depth_bin_index(nearest, dbound)
    return index.reshape(count, fh, fw)
