"""The camera side of the splat: the rig, the frustum, the pixel <-> ego projections and the image
augmentation convention.

Conventions (nuScenes):
- Ego frame: x forward, y left, z up, metres. Camera frame: x right, y down, z forward.
- sensor2ego rotation/translation come from `calibrated_sensor` (rotation quaternion w, x, y, z);
  intrinsics 3x3.
- Image augmentation is a 2-D affine per camera: pixel_aug = post_rot @ pixel + post_trans (post_rot
  3x3 with identity z row/column, post_trans 3 with z = 0). Pixel (0, 0) is the centre of the
  top-left pixel. A resize scales pixel EDGES (pixel k covers [k - 0.5, k + 0.5), so
  u -> s u + (s - 1) / 2), as the JPEG reduced decode and the area resize of the data path do;
  crop, flip and rotation act on pixel centres. This module owns the convention
  (ImageAugmentation and its affines) and the projections both ways (frustum_to_ego,
  ego_to_pixels); lss.data.transforms decodes the pixels through it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

NUSCENES_RIG_PATH = Path(__file__).resolve().parent.parent / "data" / "nuscenes_rig.json"
# The six nuScenes cameras in the order lss stacks them (the default of data.cameras).
NUSCENES_CAMERAS = (
    "CAM_FRONT_LEFT",
    "CAM_FRONT",
    "CAM_FRONT_RIGHT",
    "CAM_BACK_LEFT",
    "CAM_BACK",
    "CAM_BACK_RIGHT",
)
# The batch keys of a camera rig, in the order of frustum_to_ego's arguments after the frustum.
RIG_KEYS = ("intrinsics", "sensor2ego_rot", "sensor2ego_trans", "post_rot", "post_trans")
# The depth-bin index of a depth outside the bins (depth_bin_index).
NO_DEPTH_BIN = -1


def _dbound(dbound: Sequence[float]) -> tuple[float, float, float, int]:
    lo, hi, step = (float(v) for v in dbound)
    if not (step > 0 and hi > lo):
        raise ValueError(f"dbound = {tuple(dbound)} needs min < max and step > 0")
    return lo, hi, step, round((hi - lo) / step)


def depth_bin_count(dbound: Sequence[float]) -> int:
    """D of `depth_bins`, without making them; ValueError for a dbound without bins."""
    return _dbound(dbound)[3]


def depth_bins(dbound: Sequence[float]) -> torch.Tensor:
    """D depth-bin values (metres, float32): min, min + step, ... below max;
    D = round((max - min) / step)."""
    lo, _, step, count = _dbound(dbound)
    return (lo + step * torch.arange(count, dtype=torch.float64)).float()


def depth_bin_index(depth, dbound: Sequence[float]) -> np.ndarray:
    """Depth-bin index (int64, shape of `depth`) of camera-frame depths in metres: bin k of
    dbound = (lo, hi, step) covers [lo + k step, lo + (k + 1) step) for k < D (as `depth_bins`);
    NO_DEPTH_BIN (-1) outside the D bins and for NaN/inf."""
    lo, _, step, count = _dbound(dbound)
    with np.errstate(invalid="ignore"):
        index = np.floor((np.asarray(depth, np.float64) - lo) / step)
        valid = np.isfinite(index) & (index >= 0) & (index < count)
    return np.where(valid, index, NO_DEPTH_BIN).astype(np.int64)


FRUSTUM_PIXELS = ("centres", "linspace", "receptive_field")


def frustum(
    final_dim: Sequence[int], downsample: int, dbound: Sequence[float], pixels: str = "centres"
) -> torch.Tensor:
    """The camera frustum: D x fH x fW x 3 of (u, v, d), float32.

    u, v in augmented-image pixels (pixel centres at integer coordinates), fH = H // downsample,
    fW = W // downsample; d the depth bins of `depth_bins(dbound)` in metres. `pixels`
    (model.frustum_pixels): "centres" puts u, v at the centres of the feature-map cells,
    u = (j + 0.5) * W / fW - 0.5, v = (i + 0.5) * H / fH - 0.5; "linspace" spreads them evenly from
    the first to the last pixel, u = j * (W - 1) / (fW - 1), as the original LSS code does (up to
    half a feature cell off the cells' centres at the image edges); "receptive_field" puts them
    where the camera trunk's stride-`downsample` features are centred, u = (j + 1) * W / fW - 1:
    EfficientNet's "same" padding pads each stride-2 convolution by one pixel more on the right and
    bottom than on the left and top, so each halving moves a feature's receptive field half an
    input pixel right and down, 7.5 pixels at stride 16 (tests/test_ablation_switches.py measures
    it on the trunk)."""
    if pixels not in FRUSTUM_PIXELS:
        raise ValueError(f"frustum: pixels must be one of {FRUSTUM_PIXELS}, got {pixels!r}")
    H, W = (int(v) for v in final_dim)
    if H % downsample or W % downsample:
        raise ValueError(
            f"final_dim {tuple(final_dim)} must be divisible by downsample {downsample}"
        )
    fH, fW = H // downsample, W // downsample
    d = depth_bins(dbound)
    if pixels == "linspace":
        u = torch.linspace(0.0, W - 1.0, fW, dtype=torch.float64)
        v = torch.linspace(0.0, H - 1.0, fH, dtype=torch.float64)
    elif pixels == "receptive_field":
        u = (torch.arange(fW, dtype=torch.float64) + 1.0) * (W / fW) - 1.0
        v = (torch.arange(fH, dtype=torch.float64) + 1.0) * (H / fH) - 1.0
    else:
        u = (torch.arange(fW, dtype=torch.float64) + 0.5) * (W / fW) - 0.5
        v = (torch.arange(fH, dtype=torch.float64) + 0.5) * (H / fH) - 0.5
    D = d.numel()
    return torch.stack(
        [
            u.float().view(1, 1, fW).expand(D, fH, fW),
            v.float().view(1, fH, 1).expand(D, fH, fW),
            d.view(D, 1, 1).expand(D, fH, fW),
        ],
        dim=-1,
    ).contiguous()


def feature_cells(
    pixels: np.ndarray, final_dim: Sequence[int], downsample: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The feature-map cell (row, col; int64) of augmented-image pixels ... x 2 (u, v) and whether
    it lies on the fH x fW map (bool): cell j spans the pixels whose edges u + 0.5 lie in
    [j, j + 1) * W / fW, so `frustum`'s (u, v) of cell (i, j) falls in (i, j)."""
    H, W = (int(v) for v in final_dim)
    fH, fW = H // downsample, W // downsample
    pixels = np.asarray(pixels, np.float64)
    with np.errstate(invalid="ignore"):
        col = np.floor((pixels[..., 0] + 0.5) / (W / fW))
        row = np.floor((pixels[..., 1] + 0.5) / (H / fH))
        inside = (col >= 0) & (col < fW) & (row >= 0) & (row < fH)
    return (
        np.where(inside, row, -1).astype(np.int64),
        np.where(inside, col, -1).astype(np.int64),
        inside,
    )


def _check_rig(name: str, t: torch.Tensor, tail: tuple, B: int, N: int) -> None:
    if t.dim() != 2 + len(tail) or tuple(t.shape[2:]) != tail or tuple(t.shape[:2]) != (B, N):
        want = " x ".join(["B", "N"] + [str(v) for v in tail])
        raise ValueError(
            f"frustum_to_ego: {name} must be {want} (B={B}, N={N} from intrinsics), got "
            f"{tuple(t.shape)}"
        )


def inverse_3x3(m: torch.Tensor) -> torch.Tensor:
    """... x 3 x 3 -> ... x 3 x 3 inverses from the adjugate: a few elementwise kernels, no solver
    library, no host sync, safe inside a CUDA-graph capture (a singular matrix gives inf/NaN, which
    drops its points)."""
    a, b, c = m[..., 0, 0], m[..., 0, 1], m[..., 0, 2]
    d, e, f = m[..., 1, 0], m[..., 1, 1], m[..., 1, 2]
    g, h, i = m[..., 2, 0], m[..., 2, 1], m[..., 2, 2]
    cofactors = torch.stack(
        [
            e * i - f * h,
            c * h - b * i,
            b * f - c * e,
            f * g - d * i,
            a * i - c * g,
            c * d - a * f,
            d * h - e * g,
            b * g - a * h,
            a * e - b * d,
        ],
        dim=-1,
    )
    det = a * cofactors[..., 0] + b * cofactors[..., 3] + c * cofactors[..., 6]
    return (cofactors / det.unsqueeze(-1)).unflatten(-1, (3, 3))


def frustum_to_ego(
    frustum: torch.Tensor,
    intrinsics: torch.Tensor,
    sensor2ego_rot: torch.Tensor,
    sensor2ego_trans: torch.Tensor,
    post_rot: torch.Tensor,
    post_trans: torch.Tensor,
) -> torch.Tensor:
    """Ego-frame points of every frustum point: undo the augmentation, unproject at depth d, camera
    -> ego.

    frustum D x fH x fW x 3 (u, v, d), intrinsics / sensor2ego_rot / post_rot B x N x 3 x 3,
    sensor2ego_trans / post_trans B x N x 3. Returns B x N x D x fH x fW x 3 (ego frame, metres),
    float32 (also under autocast)."""
    if frustum.dim() != 4 or frustum.shape[-1] != 3:
        raise ValueError(
            f"frustum_to_ego: frustum must be D x fH x fW x 3, got {tuple(frustum.shape)}"
        )
    if intrinsics.dim() != 4 or intrinsics.shape[-2:] != (3, 3):
        raise ValueError(
            f"frustum_to_ego: intrinsics must be B x N x 3 x 3, got {tuple(intrinsics.shape)}"
        )
    B, N = intrinsics.shape[:2]
    _check_rig("sensor2ego_rot", sensor2ego_rot, (3, 3), B, N)
    _check_rig("post_rot", post_rot, (3, 3), B, N)
    _check_rig("sensor2ego_trans", sensor2ego_trans, (3,), B, N)
    _check_rig("post_trans", post_trans, (3,), B, N)
    device = intrinsics.device
    with torch.autocast(device_type=device.type, enabled=False):
        K, rot, trans, prot, ptrans = (
            t.to(device=device, dtype=torch.float32)
            for t in (intrinsics, sensor2ego_rot, sensor2ego_trans, post_rot, post_trans)
        )
        pts = frustum.to(device=device, dtype=torch.float32)
        D, fH, fW, _ = pts.shape
        # undo the image augmentation: pixel = post_rot^-1 (pixel_aug - post_trans)
        pts = pts.view(1, 1, D * fH * fW, 3) - ptrans.view(B, N, 1, 3)
        pts = pts @ inverse_3x3(prot).transpose(-1, -2)
        # (u, v, d) -> (u d, v d, d), then camera -> ego through rot @ K^-1
        pts = torch.cat([pts[..., :2] * pts[..., 2:3], pts[..., 2:3]], dim=-1)
        cam_to_ego = rot @ inverse_3x3(K)
        pts = pts @ cam_to_ego.transpose(-1, -2) + trans.view(B, N, 1, 3)
        return pts.view(B, N, D, fH, fW, 3)


def project_to_cameras(
    points: torch.Tensor,
    intrinsics: torch.Tensor,
    sensor2ego_rot: torch.Tensor,
    sensor2ego_trans: torch.Tensor,
    post_rot: torch.Tensor,
    post_trans: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ego points B x P x 3 and each camera's calibration (B x N x 3 x 3 matrices, B x N x 3
    vectors, as in a batch) -> (augmented-image pixels B x N x P x 2, camera depth B x N x P): the
    inverse of `frustum_to_ego`, in torch (`ego_to_pixels` is one camera in numpy). sensor2ego_rot
    is inverted by `inverse_3x3`, so the BEV augmentation's similarities (a scale, a mirror) are
    fine. Points within 1e-6 m of the image plane are divided by 1e-6: mask them by their depth."""
    offset = points[:, None] - sensor2ego_trans[:, :, None]  # B x N x P x 3
    camera = offset @ inverse_3x3(sensor2ego_rot).transpose(-1, -2)
    projected = camera @ intrinsics.transpose(-1, -2)
    depth = projected[..., 2]
    safe = torch.where(depth.abs() < 1e-6, torch.full_like(depth, 1e-6), depth)
    uvd = torch.cat([projected[..., :2] / safe[..., None], depth[..., None]], dim=-1)
    pixels = uvd @ post_rot.transpose(-1, -2) + post_trans[:, :, None]
    return pixels[..., :2], depth


def ego_to_camera(
    points: np.ndarray, sensor2ego_rot: np.ndarray, sensor2ego_trans: np.ndarray
) -> np.ndarray:
    """Ego points ... x 3 -> the camera frame ... x 3 (float64) of one camera:
    sensor2ego_rot^T (p - sensor2ego_trans)."""
    offset = np.asarray(points, np.float64) - np.asarray(sensor2ego_trans, np.float64)
    return offset @ np.asarray(sensor2ego_rot, np.float64)


def augment_pixels(
    pixels: np.ndarray, depth: np.ndarray, post_rot: np.ndarray, post_trans: np.ndarray
) -> np.ndarray:
    """Source-image pixels ... x 2 at camera depths ... -> augmented-image pixels ... x 2:
    (u, v, d)_aug = post_rot @ (u, v, d) + post_trans (float64)."""
    uvd = np.concatenate(
        [np.asarray(pixels, np.float64), np.asarray(depth, np.float64)[..., None]], axis=-1
    )
    return (uvd @ np.asarray(post_rot, np.float64).T + np.asarray(post_trans, np.float64))[..., :2]


def camera_to_pixels(
    camera_points: np.ndarray,
    intrinsics: np.ndarray,
    post_rot: Optional[np.ndarray] = None,
    post_trans: Optional[np.ndarray] = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Camera-frame points ... x 3 -> (pixels ... x 2, depth ...), float64: the pixel
    (K p)[:2] / (K p)[2] of the source image, or of the augmented image when post_rot (3 x 3) and
    post_trans (3) are given, and the depth (K p)[2] (the camera z for a pinhole K). Points closer
    to the image plane than 1e-6 m are divided by 1e-6: mask them by their depth."""
    projected = np.asarray(camera_points, np.float64) @ np.asarray(intrinsics, np.float64).T
    depth = projected[..., 2]
    pixels = projected[..., :2] / np.where(np.abs(depth) < 1e-6, 1e-6, depth)[..., None]
    if post_rot is None and post_trans is None:
        return pixels, depth
    if post_rot is None or post_trans is None:
        raise ValueError("camera_to_pixels: give both post_rot and post_trans, or neither")
    return augment_pixels(pixels, depth, post_rot, post_trans), depth


def ego_to_pixels(
    points: np.ndarray,
    intrinsics: np.ndarray,
    sensor2ego_rot: np.ndarray,
    sensor2ego_trans: np.ndarray,
    post_rot: np.ndarray,
    post_trans: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Ego points ... x 3 -> (augmented-image pixels ... x 2, camera depth ... in metres), float64,
    for one camera (3 x 3 matrices, 3-vectors as in a dataset item): the inverse of
    `frustum_to_ego`. Mask points behind the camera by their depth."""
    camera = ego_to_camera(points, sensor2ego_rot, sensor2ego_trans)
    return camera_to_pixels(camera, intrinsics, post_rot, post_trans)


def pixel_lut(mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """The network's value of every uint8 level per channel, (level / 255 - mean) / std computed in
    float64: 256 x 3 float32. The one table of the pixels' normalisation: the loader's
    (lss.data.nuscenes.normalize_images, data.image_dtype float32) and the model's on its device
    (lss.models.camera.normalize_pixels, uint8 batches)."""
    levels = np.arange(256, dtype=np.float64)[:, None] / 255.0
    return ((levels - np.asarray(mean)) / np.asarray(std)).astype(np.float32)


def load_nuscenes_rig(cameras: Optional[Sequence[str]] = None, path: Optional[Path] = None):
    """The real nuScenes camera rig (lss/data/nuscenes_rig.json, 1600 x 900 images), or the rig file
    at `path` (lss.geometry.rig_file).

    Returns (intrinsics N x 3 x 3, sensor2ego_rot N x 3 x 3, sensor2ego_trans N x 3), float32, in
    `cameras` order (default: the six cameras in NUSCENES_CAMERAS order)."""
    from lss.geometry.rig_file import read_rig_file

    cameras = tuple(cameras) if cameras is not None else NUSCENES_CAMERAS
    K, cam_to_ego, _ = read_rig_file(path if path is not None else NUSCENES_RIG_PATH, cameras)
    cam_to_ego = torch.from_numpy(cam_to_ego).float()
    return (
        torch.from_numpy(K).float(),
        cam_to_ego[:, :3, :3].contiguous(),
        cam_to_ego[:, :3, 3].contiguous(),
    )


@dataclass(frozen=True)
class ImageAugmentation:
    """One camera image's augmentation, in the order applied: resize, crop, flip, rotate.

    resize_dims: (width, height) of the resized image; crop: (left, top) of the final_dim window in
    the resized image; flip: mirror left-right; rotate: degrees, counter-clockwise as seen on
    screen, about the crop centre; resize: the drawn factor that gave resize_dims (truncated to
    whole pixels), None where unknown (data.post_matrices: original needs it)."""

    resize_dims: tuple[int, int]
    crop: tuple[int, int]
    flip: bool = False
    rotate: float = 0.0
    resize: Optional[float] = None


def resized_window(
    image_size: Sequence[int], final_dim: Sequence[int], resize: float, bot_pct: float
) -> tuple[int, int, int]:
    """(W', H', top): the (W, H) image resized by `resize` (truncated to whole pixels) and the top
    row of the final_dim = (H, W) window whose bottom edge lies bot_pct * H' above the resized
    image's bottom (the LSS crop)."""
    new_w, new_h = int(image_size[0] * resize), int(image_size[1] * resize)
    return new_w, new_h, int((1.0 - bot_pct) * new_h) - int(final_dim[0])


def val_augmentation(
    image_size: Sequence[int], final_dim: Sequence[int], bot_pct_lim: Sequence[float] = (0.0, 0.22)
) -> ImageAugmentation:
    """The deterministic LSS evaluation augmentation of a (W, H) image to final_dim = (H, W): the
    smallest resize that covers final_dim, the crop centred horizontally with its bottom edge at the
    mean of bot_pct_lim; no flip or rotation."""
    out_h, out_w = final_dim
    resize = max(out_h / image_size[1], out_w / image_size[0])
    new_w, new_h, top = resized_window(image_size, final_dim, resize, float(np.mean(bot_pct_lim)))
    left = int(max(0, new_w - out_w) / 2)
    return ImageAugmentation((max(new_w, 1), max(new_h, 1)), (left, top), False, 0.0, resize)


def resize_affine(scale_x: float, scale_y: float) -> np.ndarray:
    """3 x 3 affine of a resize whose pixel EDGES scale by (scale_x, scale_y) (area resize, JPEG
    scaling)."""
    return np.array(
        [
            [scale_x, 0.0, 0.5 * (scale_x - 1.0)],
            [0.0, scale_y, 0.5 * (scale_y - 1.0)],
            [0.0, 0.0, 1.0],
        ]
    )


def crop_flip_rotate_affine(aug: ImageAugmentation, final_dim: Sequence[int]) -> np.ndarray:
    """3 x 3 affine from resized-image pixels to final_dim pixels: crop, then flip, then rotate
    about the centre."""
    out_h, out_w = final_dim
    left, top = aug.crop
    m = np.array([[1.0, 0.0, -left], [0.0, 1.0, -top], [0.0, 0.0, 1.0]])
    if aug.flip:
        m = np.array([[-1.0, 0.0, out_w - 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]) @ m
    if aug.rotate:
        theta = math.radians(aug.rotate)
        c, s = math.cos(theta), math.sin(theta)
        cu, cv = (out_w - 1) / 2.0, (out_h - 1) / 2.0
        # v points down, so this matrix turns content counter-clockwise on screen.
        rot = np.array([[c, s, 0.0], [-s, c, 0.0], [0.0, 0.0, 1.0]])
        to_centre = np.array([[1.0, 0.0, -cu], [0.0, 1.0, -cv], [0.0, 0.0, 1.0]])
        from_centre = np.array([[1.0, 0.0, cu], [0.0, 1.0, cv], [0.0, 0.0, 1.0]])
        m = from_centre @ rot @ to_centre @ m
    return m


def affine_to_post(affine: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lift a 3 x 3 image affine to (post_rot 3 x 3, post_trans 3) acting on (u, v, depth);
    float32."""
    post_rot = np.eye(3, dtype=np.float32)
    post_rot[:2, :2] = affine[:2, :2]
    post_trans = np.zeros(3, dtype=np.float32)
    post_trans[:2] = affine[:2, 2]
    return post_rot, post_trans


def image_augmentation(
    aug: ImageAugmentation, image_size: Sequence[int], final_dim: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(post_rot 3 x 3, post_trans 3) float32 of `aug` applied to a (W, H) image: the matrices the
    data path reports for an image decoded at full size (lss.data.transforms.load_augmented_image),
    as torch tensors."""
    scale = (aug.resize_dims[0] / image_size[0], aug.resize_dims[1] / image_size[1])
    post_rot, post_trans = affine_to_post(
        crop_flip_rotate_affine(aug, final_dim) @ resize_affine(*scale)
    )
    return torch.from_numpy(post_rot), torch.from_numpy(post_trans)
