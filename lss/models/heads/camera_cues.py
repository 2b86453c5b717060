"""What the second stage reads from the cameras at each proposal (detection.refine_depth,
detection.refine_image).

A camera-only BEV grid blurs each object along the camera rays: the splat spreads a pixel's
features over that pixel's depth distribution. The distribution itself, read at the pixel that a
box's centre projects to, says where along that ray the camera puts a surface, so the second stage
can compare it with the box's depth (`depth_cues`). Per box, averaged over the cameras that see its
centre: whether any does, the expected depth minus the box's camera depth, the probability within
1 m of the box's depth, the ray's direction in ego x/y, and the depth difference along that
direction. `image_features` reads the cameras' context features (what the splat lifts) at the
pixels where the box's centre and its four face middles project, at its centre height: what the
object looks like there before the splat blurred it. Fixed shapes, no host sync (the captured step
runs both)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lss.geometry import RIG_KEYS, project_to_cameras

# seen, depth difference (m), probability within NEAR_M, ray x, ray y, difference x ray x, y
CUE_CHANNELS = 7
NEAR_M = 1.0
MAX_DIFFERENCE_M = 10.0


def read_cameras(
    points: torch.Tensor, valid: torch.Tensor, maps: torch.Tensor, cameras: dict
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`maps` B x N x K x fH x fW (the camera encoder's, on the frustum's pixels) read by bilinear
    interpolation where points B x P x 3 (ego frame) project: (samples B x N x P x K, seen
    B x N x P: valid, in front of the nearest depth bin and on the map, z B x N x P: the camera
    depth). Unseen points read zeros and pass no gradient to the maps."""
    frustum = cameras["frustum"]
    B, N, _, fH, fW = maps.shape
    if frustum.shape[1:3] != (fH, fW):
        raise ValueError(
            f"read_cameras: the maps are {tuple(maps.shape)} but the frustum is "
            f"{tuple(frustum.shape)}: the camera encoder's maps must be the splat's"
        )
    calibration = [cameras[k].to(device=points.device, dtype=torch.float32) for k in RIG_KEYS]
    pixels, z = project_to_cameras(points.float(), *calibration)  # B x N x P x 2, B x N x P
    u, v, bins = frustum[0, 0, :, 0], frustum[0, :, 0, 1], frustum[:, 0, 0, 2]
    # the frustum's pixels are evenly spaced: column j at u[0] + j (u[1] - u[0])
    col = (pixels[..., 0] - u[0]) / (u[1] - u[0]) if fW > 1 else torch.zeros_like(z)
    row = (pixels[..., 1] - v[0]) / (v[1] - v[0]) if fH > 1 else torch.zeros_like(z)
    seen = (
        valid[:, None] & (z > bins[0]) & (col >= 0) & (col <= fW - 1) & (row >= 0) & (row <= fH - 1)
    )
    where = torch.stack([2 * col / max(fW - 1, 1) - 1, 2 * row / max(fH - 1, 1) - 1], dim=-1)
    # points no camera sees (off the map, behind, invalid slots, non-finite) read zeros from
    # outside the map, so that neither they nor their gradients touch the distributions
    where = torch.where(seen.unsqueeze(-1), where, torch.full_like(where, -2.0))
    samples = F.grid_sample(
        maps.flatten(0, 1).float(),
        where.flatten(0, 1).unsqueeze(2),
        mode="bilinear",
        padding_mode="zeros",
        align_corners=True,
    )  # B*N x K x P x 1
    return samples.squeeze(-1).unflatten(0, (B, N)).transpose(-1, -2), seen, z


def depth_cues(boxes: torch.Tensor, valid: torch.Tensor, cameras: dict) -> torch.Tensor:
    """B x P x CUE_CHANNELS cues of boxes B x P x 9 (ego frame; zeros where not `valid`) from
    `cameras`: "depth", the camera depth distributions B x N x D x fH x fW (softmax over D);
    "frustum", D x fH x fW x 3 (its (u, v, d): evenly spaced pixels, the depth bins); and the
    batch's calibration (lss.geometry.RIG_KEYS). The distributions are read by bilinear
    interpolation between the feature cells; gradients reach them."""
    depth, frustum = cameras["depth"], cameras["frustum"]
    if frustum.shape[0] != depth.shape[2]:
        raise ValueError(
            f"depth_cues: depth is {tuple(depth.shape)} but the frustum is "
            f"{tuple(frustum.shape)}: the camera encoder's maps must be the splat's"
        )
    centres = boxes[..., :3].float()
    probs, seen, z = read_cameras(centres, valid, depth, cameras)  # B x N x P x D
    bins = frustum[:, 0, 0, 2]
    expected = (probs * bins).sum(-1)
    near = (probs * ((bins - z.unsqueeze(-1)).abs() <= NEAR_M).float()).sum(-1)
    difference = (expected - z).clamp(-MAX_DIFFERENCE_M, MAX_DIFFERENCE_M)
    origins = cameras["sensor2ego_trans"].to(device=boxes.device, dtype=torch.float32)
    ray = centres[:, None, :, :2] - origins[:, :, None, :2]
    ray = ray / ray.norm(dim=-1, keepdim=True).clamp(min=1e-3)
    count = seen.float().sum(1)

    def mean(t: torch.Tensor) -> torch.Tensor:  # over the cameras that see the centre
        return torch.where(seen, t, 0.0).sum(1) / count.clamp(min=1.0)

    cues = torch.stack(
        [
            (count > 0).float(),
            mean(difference),
            mean(near),
            mean(ray[..., 0]),
            mean(ray[..., 1]),
            mean(difference * ray[..., 0]),
            mean(difference * ray[..., 1]),
        ],
        dim=-1,
    )
    return torch.where(valid.unsqueeze(-1), cues, 0.0)


def image_features(points: torch.Tensor, valid: torch.Tensor, cameras: dict) -> torch.Tensor:
    """B x P x K (C + 1): the cameras' context features "context" B x N x C x fH x fW read where
    each proposal's K points B x P x K x 3 (ego frame) project, averaged over the cameras that see
    the point, and per point whether any does; zeros where not `valid`. Gradients reach the
    features around those pixels."""
    B, P, K, _ = points.shape
    samples, seen, _ = read_cameras(
        points.reshape(B, P * K, 3), valid.repeat_interleave(K, dim=1), cameras["context"], cameras
    )  # B x N x PK x C
    count = seen.float().sum(1)  # B x PK
    mean = torch.where(seen.unsqueeze(-1), samples, 0.0).sum(1) / count.clamp(min=1.0)[..., None]
    read = torch.cat([mean, (count > 0).float().unsqueeze(-1)], dim=-1)  # B x PK x (C + 1)
    return torch.where(valid.unsqueeze(-1), read.reshape(B, P, -1), 0.0)
