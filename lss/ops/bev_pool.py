"""bev_pool: the splat of Lift-Splat-Shoot. Sums depth x feature over the frustum points of every
BEV cell, without materialising the B x N x D x fH x fW x C frustum tensor.

out[b, z*C + c, i, j] = sum over kept points (n, d, h, w) in cell (i, j, z) of
depth[b,n,d,h,w] * feat[b,n,c,h,w].

The output's memory layout follows feat's (`output_channels_last`): channels-last feat (as a
channels-last camera feature map viewed as B x N x C x fH x fW) gives a torch.channels_last output,
written so directly by the kernel, which a channels-last BEV encoder consumes without a copy and
whose gradient the backward reads in place. The gradient of feat comes back in the same layout
(channels-last for channels-last feat, contiguous otherwise).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lss.geometry import FrustumLUT
from lss.ops import _ext

# Leaf functions for torch.fx.symbolic_trace (as torchvision's ops): a traced model keeps one call
# node per op.
torch.fx.wrap("bev_pool")

__all__ = ["bev_pool", "bev_pool_reference", "output_channels_last"]


def output_channels_last(feat: Tensor) -> bool:
    """Whether bev_pool returns its output in torch.channels_last memory format: feat
    B x N x C x fH x fW has its C values per pixel contiguous (stride 1 along C) and C > 1. The
    kernels use the same rule (csrc/ops/bev_pool.h)."""
    return feat.shape[2] > 1 and feat.stride(2) == 1


def _check_inputs(depth: Tensor, feat: Tensor, lut: FrustumLUT) -> None:
    if not isinstance(lut, FrustumLUT):
        raise TypeError(
            "bev_pool: lut must be a lss.geometry.FrustumLUT (FrustumLUT.build), got "
            f"{type(lut).__name__}"
        )
    lut.check_unchanged()
    for name, t in (("depth", depth), ("feat", feat)):
        if not isinstance(t, Tensor):
            raise TypeError(f"bev_pool: {name} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(
                f"bev_pool: {name} must be floating point (float32, float16, bfloat16 or float64), "
                f"got {t.dtype}"
            )
    if depth.dim() != 5:
        raise ValueError(
            f"bev_pool: depth must be B x N x D x fH x fW, got shape {tuple(depth.shape)}"
        )
    if feat.dim() != 5:
        raise ValueError(
            f"bev_pool: feat must be B x N x C x fH x fW, got shape {tuple(feat.shape)}"
        )
    want = (lut.B, lut.N, lut.D, lut.fH, lut.fW)
    if tuple(depth.shape) != want:
        raise ValueError(
            f"bev_pool: depth has shape {tuple(depth.shape)} but the LUT was built for "
            f"B x N x D x fH x fW = {want}; rebuild the LUT from these cameras or fix the "
            "depth head"
        )
    B, N, C, fH, fW = feat.shape
    if (B, N, fH, fW) != (lut.B, lut.N, lut.fH, lut.fW):
        raise ValueError(
            f"bev_pool: feat has shape {tuple(feat.shape)} but depth/LUT need B x N x C x fH x fW "
            f"with B={lut.B}, N={lut.N}, fH={lut.fH}, fW={lut.fW}"
        )
    if depth.device != feat.device or depth.device != lut.device:
        raise ValueError(
            f"bev_pool: depth ({depth.device}), feat ({feat.device}) and the LUT ({lut.device}) "
            "must be on the same device; build the LUT from points on that device or use "
            "lut.to(device)"
        )


def _common_dtype(depth: Tensor, feat: Tensor) -> tuple[Tensor, Tensor]:
    """Mixed dtypes (e.g. a bf16 depth head under autocast with a float32 context) run in the
    promoted dtype."""
    if depth.dtype == feat.dtype:
        return depth, feat
    dtype = torch.promote_types(depth.dtype, feat.dtype)
    return depth.to(dtype), feat.to(dtype)


def bev_pool(depth: Tensor, feat: Tensor, lut: FrustumLUT) -> Tensor:
    """Splat depth-weighted camera features into the BEV grid.

    depth B x N x D x fH x fW (a distribution over the D bins), feat B x N x C x fH x fW (any
    strides, e.g. a channels-last camera feature map viewed as B x N x C x fH x fW), lut from
    `FrustumLUT.build`.
    Returns B x (nz*C) x nx x ny (row i = ego x, column j = ego y), accumulated in float32, in the
    inputs' dtype; torch.channels_last in memory when feat is channels-last (see
    `output_channels_last`), contiguous otherwise. Differentiable in depth and feat; cells without
    points are 0.
    """
    _check_inputs(depth, feat, lut)
    depth, feat = _common_dtype(depth, feat)
    if _ext.use_reference("bev_pool"):
        out = bev_pool_reference(depth, feat, lut)
        return (
            out.contiguous(memory_format=torch.channels_last) if output_channels_last(feat) else out
        )
    _ext.check_device("bev_pool", depth, feat)
    return torch.ops.lss.bev_pool(
        depth, feat, lut.sorted_points, lut.cell_start, lut.point_cell, lut.nz, lut.nx, lut.ny
    )


def bev_pool_reference(depth: Tensor, feat: Tensor, lut: FrustumLUT) -> Tensor:
    """Pure-PyTorch bev_pool (index_add over the LUT's point cells; materialises P x C). Same values
    as bev_pool, differentiable through autograd; accumulates half types in float32. Always returns
    a contiguous (NCHW) tensor, whatever feat's layout."""
    _check_inputs(depth, feat, lut)
    depth, feat = _common_dtype(depth, feat)
    B, N, C, fH, fW = feat.shape
    D, nz, nx, ny = lut.D, lut.nz, lut.nx, lut.ny
    acc = torch.float32 if depth.dtype in (torch.float16, torch.bfloat16) else depth.dtype
    # B x N x D x fH x fW x C products of every frustum point, in point order
    values = depth.to(acc).unsqueeze(-1) * feat.to(acc).permute(0, 1, 3, 4, 2).unsqueeze(2)
    cells = lut.num_cells
    target = torch.where(
        lut.point_cell >= 0, lut.point_cell, cells
    ).long()  # dropped points go to a spare row
    grid = values.new_zeros(cells + 1, C).index_add(0, target, values.reshape(-1, C))[:cells]
    return (
        grid.view(B, nz, nx, ny, C)
        .permute(0, 1, 4, 2, 3)
        .reshape(B, nz * C, nx, ny)
        .to(depth.dtype)
    )


if _ext.has_ext():

    @torch.library.register_fake("lss::bev_pool")
    def _bev_pool_fake(depth, feat, sorted_points, cell_start, point_cell, nz, nx, ny):
        B, N, C, fH, fW = feat.shape
        layout = torch.channels_last if output_channels_last(feat) else torch.contiguous_format
        return torch.empty(
            (B, nz * C, nx, ny), dtype=depth.dtype, device=depth.device, memory_format=layout
        )

    @torch.library.register_fake("lss::_bev_pool_backward")
    def _bev_pool_backward_fake(grad_out, depth, feat, cell_start, point_cell, nz, nx, ny):
        B, N, C, fH, fW = feat.shape
        # grad_feat in feat's layout: channels-last (B x N x fH x fW x C in memory) or contiguous
        if output_channels_last(feat):
            return depth.new_empty(depth.shape), feat.new_empty((B, N, fH, fW, C)).permute(
                0, 1, 4, 2, 3
            )
        return depth.new_empty(depth.shape), feat.new_empty((B, N, C, fH, fW))

    # Autograd is registered in C++ (csrc/ops/autograd.cpp): no Python runs in an eager call.
