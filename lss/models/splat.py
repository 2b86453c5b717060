"""Splat: camera-frustum points -> BEV cells (a LUT built in float32) -> pooled BEV features (our
bev_pool op)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lss.geometry import RIG_KEYS, BevGrid, FrustumLUT, FrustumLUTCache, frustum
from lss.geometry.ego_motion import previous_rig
from lss.ops import bev_pool, bev_pool_reference


class Splat(nn.Module):
    """Pools per-pixel depth x context outer products into the BEV grid.

    lut(batch) -> FrustumLUT for the batch's camera rig and augmentation (float32 geometry, autocast
    off);
    forward(depth B x N x D x fH x fW, context B x N x C x fH x fW, lut) -> B x (nz*C) x nx x ny.
    impl is model.splat ("bev_pool" or "reference", checked when the config loads); frustum_pixels
    and binning are model.frustum_pixels (lss.geometry.frustum) and model.splat_binning
    (lss.geometry.lut.cell_indices).
    """

    def __init__(
        self,
        grid: BevGrid,
        final_dim: tuple[int, int],
        downsample: int,
        dbound: tuple[float, float, float],
        impl: str = "bev_pool",
        frustum_pixels: str = "centres",
        binning: str = "floor",
    ):
        super().__init__()
        self.grid = grid
        self.impl = impl
        self.binning = binning
        # D x fH x fW x 3 (u, v, depth) in augmented-image pixels; a constant that follows the
        # module's device
        self.register_buffer(
            "frustum",
            frustum(final_dim, downsample, dbound, frustum_pixels).float(),
            persistent=False,
        )
        self.lut_cache = FrustumLUTCache()
        self.previous_lut_cache = FrustumLUTCache()  # model.temporal.frames: 2

    @property
    def depth_bins(self) -> int:
        return self.frustum.shape[0]

    def lut(self, batch: dict) -> FrustumLUT:
        rig = [batch[k].to(device=self.frustum.device, dtype=torch.float32) for k in RIG_KEYS]
        with torch.autocast(device_type=self.frustum.device.type, enabled=False):
            return self.lut_cache.get(self.frustum.contiguous(), *rig, self.grid, self.binning)

    def previous_lut(self, batch: dict, rig: Optional[dict] = None) -> FrustumLUT:
        """The previous frame's LUT into the current grid (model.temporal.frames: 2): its rig
        (PREVIOUS_RIG_KEYS) with camera -> ego replaced by ego_motion @ camera -> prev ego (`rig`:
        that rig when the caller has composed it already, lss.geometry.ego_motion.previous_rig);
        cached apart from the current frame's, by that calibration and pose."""
        device = self.frustum.device
        if rig is None:
            rig = previous_rig(batch, device)
        with torch.autocast(device_type=device.type, enabled=False):
            return self.previous_lut_cache.get(
                self.frustum.contiguous(), *(rig[k] for k in RIG_KEYS), self.grid, self.binning
            )

    def forward(self, depth: torch.Tensor, context: torch.Tensor, lut: FrustumLUT) -> torch.Tensor:
        if self.impl == "reference":
            return bev_pool_reference(depth, context, lut)
        return bev_pool(depth, context, lut)
