"""Temporary test-only stand-ins for lss.geometry and the lss.ops the model needs, used until those land on main.

install() adds only the names that are missing, so the real implementations win as soon as they are merged.
"""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class UpsampleBilinear(nn.Module):
    def __init__(self, size=None, scale_factor=None, mode="pytorch_half_pixel"):
        super().__init__()
        self.size, self.scale_factor = size, scale_factor

    def forward(self, x):
        return F.interpolate(x, size=self.size, scale_factor=self.scale_factor, mode="bilinear", align_corners=False)


def sigmoid_focal_loss(logits, targets, alpha=0.25, gamma=2.0, weight=None, reduction="mean", mask=None):
    p = logits.sigmoid()
    ce = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
    p_t = p * targets + (1 - p) * (1 - targets)
    loss = ce * (1 - p_t) ** gamma
    if alpha >= 0:
        loss = (alpha * targets + (1 - alpha) * (1 - targets)) * loss
    return loss if reduction == "none" else loss.mean() if reduction == "mean" else loss.sum()


class BevGrid:
    def __init__(self, xbound, ybound, zbound):
        self.bounds = (xbound, ybound, zbound)
        self.nx, self.ny, self.nz = (round((b[1] - b[0]) / b[2]) for b in self.bounds)
        self.lower = tuple(b[0] for b in self.bounds)
        self.cell_size = tuple(b[2] for b in self.bounds)
        self.shape = (self.nx, self.ny)

    @classmethod
    def from_config(cls, g):
        return cls(g.xbound, g.ybound, g.zbound)


def frustum(final_dim, downsample, dbound):
    h, w = final_dim
    fh, fw = h // downsample, w // downsample
    d = torch.arange(*dbound, dtype=torch.float32)
    u = (torch.arange(fw) + 0.5) * w / fw - 0.5
    v = (torch.arange(fh) + 0.5) * h / fh - 0.5
    dd, vv, uu = torch.meshgrid(d, v, u, indexing="ij")
    return torch.stack([uu, vv, dd], dim=-1)


def frustum_to_ego(fr, intrinsics, rot, trans, post_rot, post_trans):
    pts = fr.float()[None, None] - post_trans[:, :, None, None, None]
    pts = (torch.inverse(post_rot)[:, :, None, None, None] @ pts.unsqueeze(-1)).squeeze(-1)
    pts = torch.cat([pts[..., :2] * pts[..., 2:3], pts[..., 2:3]], -1)
    combine = rot @ torch.inverse(intrinsics)
    pts = (combine[:, :, None, None, None] @ pts.unsqueeze(-1)).squeeze(-1)
    return pts + trans[:, :, None, None, None]


@dataclass
class FrustumLUT:
    cell: torch.Tensor  # B x N x D x fH x fW flat index b*nz*nx*ny + z*nx*ny + x*ny + y, or -1
    batch: int
    nx: int
    ny: int
    nz: int

    @classmethod
    def build(cls, points, grid):
        lower = torch.tensor(grid.lower, device=points.device)
        size = torch.tensor(grid.cell_size, device=points.device)
        idx = ((points - lower) / size).floor().long()
        keep = ((idx >= 0) & (idx < torch.tensor([grid.nx, grid.ny, grid.nz], device=points.device))).all(-1)
        b = torch.arange(points.shape[0], device=points.device).view(-1, 1, 1, 1, 1)
        flat = ((b * grid.nz + idx[..., 2]) * grid.nx + idx[..., 0]) * grid.ny + idx[..., 1]
        return cls(torch.where(keep, flat, -1), points.shape[0], grid.nx, grid.ny, grid.nz)


class FrustumLUTCache:
    def get(self, fr, intrinsics, rot, trans, post_rot, post_trans, grid):
        return FrustumLUT.build(frustum_to_ego(fr, intrinsics, rot, trans, post_rot, post_trans), grid)


def bev_pool_reference(depth, feat, lut):
    b, n, d, fh, fw = depth.shape
    c = feat.shape[2]
    x = (depth.unsqueeze(2) * feat.unsqueeze(3)).permute(0, 1, 3, 4, 5, 2).reshape(-1, c)
    cell = lut.cell.reshape(-1)
    keep = cell >= 0
    out = torch.zeros(b * lut.nz * lut.nx * lut.ny, c, dtype=x.dtype, device=x.device)
    out = out.index_add(0, cell[keep], x[keep])
    out = out.view(b, lut.nz, lut.nx, lut.ny, c).permute(0, 1, 4, 2, 3)
    return out.reshape(b, lut.nz * c, lut.nx, lut.ny)


def install() -> None:
    import lss.ops

    for name, obj in (("UpsampleBilinear", UpsampleBilinear), ("sigmoid_focal_loss", sigmoid_focal_loss),
                      ("bev_pool", bev_pool_reference), ("bev_pool_reference", bev_pool_reference)):
        if not hasattr(lss.ops, name):
            setattr(lss.ops, name, obj)
    try:
        import lss.geometry  # noqa: F401
    except ImportError:
        geometry = types.ModuleType("lss.geometry")
        for obj in (BevGrid, frustum, frustum_to_ego, FrustumLUT, FrustumLUTCache):
            setattr(geometry, obj.__name__, obj)
        sys.modules["lss.geometry"] = geometry
