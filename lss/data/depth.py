"""Lidar depth targets for the camera encoder's depth distribution (depth supervision as in BEVDepth).

Every cell of a camera's stride-`downsample` feature map gets the depth-bin index of the NEAREST lidar return that
projects into it, or -1 (no return, or the nearest return outside grid.dbound). Depth is the camera-frame z, the
quantity the frustum's depth bins measure; bin k of dbound (lo, hi, step) is [lo + k step, lo + (k + 1) step).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from pyquaternion import Quaternion

IGNORE_DEPTH = -1


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
    """P x 3 float64 finite points (lidar frame, metres) of a nuScenes .pcd.bin file: float32 records of 5 values
    (x, y, z, intensity, ring), as the devkit's LidarPointCloud.from_file reads them (read here without the devkit,
    whose import costs every fresh loader worker about 2 s)."""
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
            f"lidar point cloud {path} could not be read (sample {sample_token}, channel LIDAR_TOP): "
            f"{type(e).__name__}: {e}. Expected float32 records of 5 values (x, y, z, intensity, ring) "
            "in a .pcd.bin file; re-extract the file."
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

    points P x 3 (lidar frame), lidar_to_camera N x 4 x 4, intrinsics N x 3 x 3, post_rot N x 3 x 3 and post_trans
    N x 3 (the image augmentation: pixel_aug = post_rot @ (u, v, d) + post_trans), image_sizes N x 2 (source W, H).
    A return counts when it lies in front of the camera, inside the source image and inside the final_dim = (H, W)
    augmented image. Returns N x fH x fW int64 bin indices in [0, D), IGNORE_DEPTH (-1) elsewhere;
    fH, fW = H // downsample, W // downsample.
    """
    height, width = (int(v) for v in final_dim)
    fh, fw = height // downsample, width // downsample
    lo, hi, step = (float(v) for v in dbound)
    bins = round((hi - lo) / step)
    count = len(lidar_to_camera)
    nearest = np.full(count * fh * fw, np.inf)
    homogeneous = np.concatenate(
        [np.asarray(points, np.float64).reshape(-1, 3), np.ones((len(points), 1))], 1
    )
    # lidar -> (u d, v d, d) of every camera in one product: intrinsics @ the camera rows of lidar_to_camera
    # (the intrinsics' last row is (0, 0, 1), so the third value is the camera-frame depth)
    to_pixels = np.asarray(intrinsics, np.float64) @ np.asarray(lidar_to_camera, np.float64)[:, :3]
    projected = homogeneous @ to_pixels.reshape(-1, 4).T  # P x 3N
    for k in range(count):
        depth = projected[:, 3 * k + 2]
        front = depth > 0
        depth = depth[front]
        u, v = projected[front, 3 * k] / depth, projected[front, 3 * k + 1] / depth
        src_w, src_h = image_sizes[k]
        keep = (u >= -0.5) & (u < src_w - 0.5) & (v >= -0.5) & (v < src_h - 0.5)
        u, v, depth = u[keep], v[keep], depth[keep]
        r, t = np.asarray(post_rot[k], np.float64), np.asarray(post_trans[k], np.float64)
        u_aug = r[0, 0] * u + r[0, 1] * v + r[0, 2] * depth + t[0]
        v_aug = r[1, 0] * u + r[1, 1] * v + r[1, 2] * depth + t[1]
        # feature cell j spans augmented pixels whose edges (u + 0.5) lie in [j, j + 1) * downsample
        col = np.floor((u_aug + 0.5) / (width / fw)).astype(np.int64)
        row = np.floor((v_aug + 0.5) / (height / fh)).astype(np.int64)
        inside = (col >= 0) & (col < fw) & (row >= 0) & (row < fh)
        np.minimum.at(nearest, (k * fh + row[inside]) * fw + col[inside], depth[inside])
    index = np.floor((nearest - lo) / step)
    valid = np.isfinite(index) & (index >= 0) & (index < bins)
    return np.where(valid, index, IGNORE_DEPTH).astype(np.int64).reshape(count, fh, fw)
