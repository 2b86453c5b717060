"""The second stage's camera depth cues (detection.refine_depth).

A camera-only BEV grid blurs each object along the camera rays: the splat spreads a pixel's
features over that pixel's depth distribution. The distribution itself, read at the pixel that a
box's centre projects to, says where along that ray the camera puts a surface, so the second stage
can compare it with the box's depth. Per box, averaged over the cameras that see its centre:
whether any does, the expected depth minus the box's camera depth, the probability within 1 m of
the box's depth, the ray's direction in ego x/y, and the depth difference along that direction.
Fixed shapes, no host sync (the captured step runs it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lss.geometry import RIG_KEYS, project_to_cameras

# seen, depth difference (m), probability within NEAR_M, ray x, ray y, difference x ray x, y
CUE_CHANNELS = 7
NEAR_M = 1.0
MAX_DIFFERENCE_M = 10.0


def depth_cues(boxes: torch.Tensor, valid: torch.Tensor, cameras: dict) -> torch.Tensor:
    """B x P x CUE_CHANNELS cues of boxes B x P x 9 (ego frame; zeros where not `valid`) from
    `cameras`: "depth", the camera depth distributions B x N x D x fH x fW (softmax over D);
    "frustum", D x fH x fW x 3 (its (u, v, d): evenly spaced pixels, the depth bins); and the
    batch's calibration (lss.geometry.RIG_KEYS). The distributions are read by bilinear
    interpolation between the feature cells; gradients reach them."""
    depth, frustum = cameras["depth"], cameras["frustum"]
    B, N, D, fH, fW = depth.shape
    if frustum.shape[:3] != (D, fH, fW):
        raise ValueError(
            f"depth_cues: depth is {tuple(depth.shape)} but the frustum is "
            f"{tuple(frustum.shape)}: the camera encoder's maps must be the splat's"
        )
    centres = boxes[..., :3].float()
    calibration = [cameras[k].to(device=boxes.device, dtype=torch.float32) for k in RIG_KEYS]
    pixels, z = project_to_cameras(centres, *calibration)  # B x N x P x 2, B x N x P
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
    probs = F.grid_sample(
        depth.flatten(0, 1).float(),
        where.flatten(0, 1).unsqueeze(2),
        mode="bilinear",
        padding_mode="zeros",
        align_corners=True,
    )  # B*N x D x P x 1
    probs = probs.squeeze(-1).unflatten(0, (B, N)).transpose(-1, -2)  # B x N x P x D
    expected = (probs * bins).sum(-1)
    near = (probs * ((bins - z.unsqueeze(-1)).abs() <= NEAR_M).float()).sum(-1)
    difference = (expected - z).clamp(-MAX_DIFFERENCE_M, MAX_DIFFERENCE_M)
    ray = centres[:, None, :, :2] - calibration[2][:, :, None, :2]
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
