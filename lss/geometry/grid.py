"""The BEV grid: where ego points fall on the bird's-eye-view map.

Conventions: ego frame x forward, y left, z up, metres. BEV cell i on an axis is
floor((p - min) / size), kept iff 0 <= i < n on all three axes (BevGrid.contains). Row i of the BEV
map is ego x, column j is ego y.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


class BevGrid:
    """The BEV grid: each bound is (min, max, cell size) in metres; n = round((max - min) / size)
    cells per axis."""

    def __init__(self, xbound: Sequence[float], ybound: Sequence[float], zbound: Sequence[float]):
        bounds = []
        for name, bound in (("xbound", xbound), ("ybound", ybound), ("zbound", zbound)):
            if len(bound) != 3:
                raise ValueError(
                    f"BevGrid: {name} must be (min, max, cell size), got {tuple(bound)}"
                )
            lo, hi, size = (float(v) for v in bound)
            if not (size > 0 and hi > lo and math.isfinite(lo) and math.isfinite(hi)):
                raise ValueError(
                    f"BevGrid: {name} = {tuple(bound)} needs finite min < max and cell size > 0"
                )
            n = round((hi - lo) / size)
            if n < 1:
                raise ValueError(
                    f"BevGrid: {name} = {tuple(bound)} gives no cell; make max - min >= cell size"
                )
            bounds.append((lo, hi, size, n))
        (self.xbound, self.ybound, self.zbound) = (tuple(b[:3]) for b in bounds)
        self.nx, self.ny, self.nz = (b[3] for b in bounds)
        self.lower = tuple(b[0] for b in bounds)
        self.cell_size = tuple(b[2] for b in bounds)

    @classmethod
    def from_config(cls, grid_cfg) -> "BevGrid":
        """From `lss.config.GridConfig` (its xbound, ybound, zbound)."""
        return cls(grid_cfg.xbound, grid_cfg.ybound, grid_cfg.zbound)

    @property
    def shape(self) -> tuple[int, int]:
        """(nx, ny): rows are ego x, columns ego y."""
        return (self.nx, self.ny)

    def cell_centers_x(self) -> torch.Tensor:
        """nx ego-x coordinates (metres) of the cell centres, float32."""
        return (
            self.lower[0]
            + self.cell_size[0] * (torch.arange(self.nx, dtype=torch.float64) + 0.5).float()
        )

    def cell_centers_y(self) -> torch.Tensor:
        """ny ego-y coordinates (metres) of the cell centres, float32."""
        return (
            self.lower[1]
            + self.cell_size[1] * (torch.arange(self.ny, dtype=torch.float64) + 0.5).float()
        )

    @classmethod
    def planar(cls, xbound: Sequence[float], ybound: Sequence[float]) -> "BevGrid":
        """The x-y grid of a 2-D raster (BEV targets, masks): one z cell."""
        return cls(xbound, ybound, (0.0, 1.0, 1.0))

    def to_cells(self, coord, axis: int):
        """Ego coordinates (metres, array or tensor) along `axis` (0 = x, 1 = y, 2 = z) ->
        continuous cell coordinates: cell i covers [i, i + 1), 0 is the grid's lower edge."""
        return (coord - self.lower[axis]) / self.cell_size[axis]

    def to_metres(self, cells, axis: int):
        """Inverse of `to_cells`: continuous cell coordinates along `axis` -> ego metres (i + 0.5 is
        a centre)."""
        return self.lower[axis] + self.cell_size[axis] * cells

    def contains(self, x, y, z=None):
        """Whether ego points (metres; arrays or tensors of one shape) fall in a cell of the grid:
        0 <= floor((p - min) / size) < n on x, y and, when z is given, z. NaN is outside."""
        inside = self._on_axis(x, 0) & self._on_axis(y, 1)
        return inside if z is None else inside & self._on_axis(z, 2)

    def _on_axis(self, coord, axis: int):
        cells = self.to_cells(coord, axis)
        return (cells >= 0) & (cells < (self.nx, self.ny, self.nz)[axis])

    def key(self) -> tuple:
        return (self.xbound, self.ybound, self.zbound)

    def __eq__(self, other) -> bool:
        return isinstance(other, BevGrid) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def __repr__(self) -> str:
        return f"BevGrid(xbound={self.xbound}, ybound={self.ybound}, zbound={self.zbound})"

    def with_shape(self, shape: Sequence[int]) -> "BevGrid":
        """The same x/y area cut into shape = (H, W) cells: where an H x W map of it lies (a head's
        map may be coarser than the grid, its cells then larger)."""
        H, W = int(shape[0]), int(shape[1])
        (x_lo, x_hi, _), (y_lo, y_hi, _) = self.xbound, self.ybound
        return BevGrid(
            (x_lo, x_hi, (x_hi - x_lo) / H), (y_lo, y_hi, (y_hi - y_lo) / W), self.zbound
        )

    def xy_to_cells(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Continuous cell coordinates of ego points x, y (metres): u along the rows, v along the
        columns; cell (i, j) covers [i, i + 1) x [j, j + 1)."""
        return self.to_cells(x, 0), self.to_cells(y, 1)
