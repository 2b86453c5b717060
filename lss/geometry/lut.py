"""The frustum lookup table: which BEV cell every frustum point falls in, in the form
`lss.ops.bev_pool` consumes, and a cache that reuses it while the rig and the grid are unchanged.
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError, dataclass, fields
from typing import Optional

import numpy as np
import torch

from lss.geometry.camera import frustum_to_ego
from lss.geometry.grid import BevGrid
from lss.host_sync import may_sync, tracing

INDEX32_LIMIT = 2**31 - 1


def _version_of(t: torch.Tensor) -> Optional[int]:
    """t's version counter; None where there is none to read: an inference tensor, or any tensor
    while torch.compile traces (the compiled graph sees counters as unknown data)."""
    if tracing():
        return None
    try:
        return t._version
    except RuntimeError:  # an inference tensor: no version counter, and read-only outside inference
        return None


def _index_dtype(*counts: int) -> torch.dtype:
    return torch.int32 if max(counts) <= INDEX32_LIMIT else torch.int64


@dataclass(eq=False)
class FrustumLUT:
    """Where every frustum point goes in the BEV grid, in the form `lss.ops.bev_pool` consumes.

    Points are numbered in (b, n, d, h, w) order (p indexes depth B x N x D x fH x fW flattened;
    its feature pixel is (b, n, h, w)); cells in (b, z, x, y) order
    (c = ((b * nz + z) * nx + i) * ny + j, the output layout).
    - point_cell: P = B*N*D*fH*fW cell of every point, -1 where the point falls outside the grid
      (backward gather).
    - sorted_points: P point indices sorted by cell (stable: ascending p within a cell); the kept
      points come first.
    - cell_start: B*nz*nx*ny + 1 CSR offsets: the points of cell c are
      sorted_points[cell_start[c]:cell_start[c+1]] (the interval of c: start cell_start[c], length
      cell_start[c+1] - cell_start[c]); cell_start[-1] = kept count.
    Index tensors are int32 when P and the cell count fit, int64 otherwise, on the device of the
    points.

    The table is read-only: assigning or deleting a field raises FrozenInstanceError. A table
    constructed from tensors (`FrustumLUT(...)`, `dataclasses.replace`) is checked once by
    `validate`, so that bev_pool never indexes out of bounds; `build` makes valid tables by
    construction and skips the check (no host sync, capturable in a CUDA graph). bev_pool refuses a
    table whose index tensors were changed in place since (`check_unchanged`) until `validate()`
    has passed again.
    """

    point_cell: torch.Tensor
    sorted_points: torch.Tensor
    cell_start: torch.Tensor
    B: int
    N: int
    D: int
    fH: int
    fW: int
    nz: int
    nx: int
    ny: int

    def __post_init__(self):
        self.validate()

    def __setattr__(self, name, value):
        if "_versions" in self.__dict__:
            raise FrozenInstanceError(
                f"FrustumLUT is read-only: cannot assign {name!r} of a finished table; build a new "
                "one with FrustumLUT.build, or copy it with dataclasses.replace(lut, ...) (which "
                "validates the copy)"
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        raise FrozenInstanceError(f"FrustumLUT is read-only: cannot delete {name!r}")

    @classmethod
    def _valid_by_construction(cls, **values) -> "FrustumLUT":
        """An instance without `validate` (one host sync), for tables made by `build` or copied from
        a checked one."""
        lut = cls.__new__(cls)
        for name, value in values.items():
            object.__setattr__(lut, name, value)
        return lut._seal()

    def _index_tensors(self) -> tuple:
        return (self.point_cell, self.sorted_points, self.cell_start)

    def _seal(self) -> "FrustumLUT":
        # a table sealed while tracing has no versions to compare: validate checks such a table
        versions = tuple(_version_of(t) for t in self._index_tensors())
        object.__setattr__(self, "_versions", versions)
        return self

    def check_unchanged(self) -> None:
        """Raise ValueError if an index tensor was changed in place since the table was built or
        last validated (bev_pool could then read outside its inputs). No host sync; not checked
        inside torch.compile."""
        for t, seen in zip(self._index_tensors(), self._versions):
            now = _version_of(t)
            if seen is not None and now is not None and now != seen:
                raise ValueError(
                    "FrustumLUT: its index tensors were changed in place after the table was built "
                    "or validated, so bev_pool could read outside its inputs; call lut.validate() "
                    "to check them, or build a new table with FrustumLUT.build"
                )

    def validate(self) -> "FrustumLUT":
        """Checks that the table is consistent, so that bev_pool reads only inside its inputs:
        sizes >= 1; the three index tensors 1-D int32/int64 of one dtype and device with P, P and
        cells + 1 elements; cell_start non-decreasing from 0 to at most P; sorted_points in [0, P);
        point_cell -1 or in [0, cells); and the three describing the same assignment of points to
        cells. Raises ValueError naming the field, the bad value and the valid range. Synchronises
        with the device twice (more only to describe an error). Returns self."""
        for name in ("B", "N", "D", "fH", "fW", "nz", "nx", "ny"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"FrustumLUT: {name} must be an integer >= 1, got {value!r}")
        P, cells = self.num_points, self.num_cells
        first = self.cell_start
        for name, numel in (("cell_start", cells + 1), ("sorted_points", P), ("point_cell", P)):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"FrustumLUT: {name} must be a tensor, got {type(t).__name__}")
            if t.dtype not in (torch.int32, torch.int64) or t.dtype != first.dtype:
                raise ValueError(
                    f"FrustumLUT: {name} has dtype {t.dtype}; the index tensors must all be int32 "
                    "or "
                    f"all int64 (cell_start is {first.dtype})"
                )
            if t.dim() != 1 or t.numel() != numel:
                raise ValueError(
                    f"FrustumLUT: {name} must be 1-D with {numel} elements for B, N, D, fH, fW = "
                    f"{self.B}, {self.N}, {self.D}, {self.fH}, {self.fW} and nz, nx, ny = "
                    f"{self.nz}, "
                    f"{self.nx}, {self.ny}, got shape {tuple(t.shape)}"
                )
            if t.device != first.device:
                raise ValueError(
                    f"FrustumLUT: {name} is on {t.device} but cell_start is on {first.device}; "
                    "move "
                    "the tables to one device"
                )
        point_cell, sorted_points, cell_start = self.point_cell, self.sorted_points, self.cell_start
        steps = cell_start.diff()
        stats = torch.stack(
            [
                cell_start[0],
                cell_start[-1],
                (steps < 0).any(),
                sorted_points.min(),
                sorted_points.max(),
                point_cell.min(),
                point_cell.max(),
            ]
        ).tolist()
        start, kept, decreasing, sp_min, sp_max, pc_min, pc_max = stats
        if start != 0:
            raise ValueError(
                f"FrustumLUT: cell_start[0] is {start}, expected 0 (the first cell's points start "
                "at "
                "sorted_points[0]); build the table with FrustumLUT.build"
            )
        if not 0 <= kept <= P:
            raise ValueError(
                f"FrustumLUT: cell_start[-1] (the number of points inside the grid) is {kept}, "
                "expected "
                f"a value in [0, P] = [0, {P}]"
            )
        if decreasing:
            c = int(torch.nonzero(steps < 0)[0])
            raise ValueError(
                f"FrustumLUT: cell_start must be non-decreasing, but cell_start[{c}] = "
                f"{int(cell_start[c])} > cell_start[{c + 1}] = {int(cell_start[c + 1])}"
            )
        if sp_min < 0 or sp_max >= P:
            raise ValueError(
                f"FrustumLUT: sorted_points holds {sp_min if sp_min < 0 else sp_max}, expected "
                "point "
                f"indices in [0, P) = [0, {P})"
            )
        if pc_min < -1 or pc_max >= cells:
            raise ValueError(
                f"FrustumLUT: point_cell holds {pc_min if pc_min < -1 else pc_max}, expected -1 "
                "(outside "
                f"the grid) or a cell in [0, B*nz*nx*ny) = [0, {cells})"
            )
        # one assignment three ways: per-cell counts, each sorted position's cell, each point once
        counts = torch.bincount(point_cell.long() + 1, minlength=cells + 1)[1:]
        listed = sorted_points[:kept].long()
        position_cell = (
            torch.searchsorted(
                cell_start,
                torch.arange(kept, dtype=cell_start.dtype, device=cell_start.device),
                right=True,
            )
            - 1
        )
        wrong_count = counts != steps
        wrong_cell = point_cell[listed] != position_cell
        repeated = torch.bincount(listed, minlength=P) > 1
        if not any(torch.stack([wrong_count.any(), wrong_cell.any(), repeated.any()]).tolist()):
            return self._seal()
        if bool(wrong_count.any()):
            c = int(torch.nonzero(wrong_count)[0])
            raise ValueError(
                f"FrustumLUT: point_cell puts {int(counts[c])} points in cell {c} but cell_start "
                "gives it "
                f"cell_start[{c + 1}] - cell_start[{c}] = {int(steps[c])}; the tables disagree"
            )
        if bool(wrong_cell.any()):
            k = int(torch.nonzero(wrong_cell)[0])
            raise ValueError(
                f"FrustumLUT: sorted_points[{k}] = {int(listed[k])} is a point of cell "
                f"{int(point_cell[listed[k]])} (point_cell) but cell_start places position {k} in "
                "cell "
                f"{int(position_cell[k])}; the tables disagree"
            )
        p = int(torch.nonzero(repeated)[0])
        raise ValueError(
            f"FrustumLUT: sorted_points lists point {p} more than once in its first cell_start[-1] "
            "= "
            f"{kept} entries, expected every point inside the grid exactly once"
        )

    @property
    def num_points(self) -> int:
        return self.B * self.N * self.D * self.fH * self.fW

    @property
    def num_cells(self) -> int:
        return self.B * self.nz * self.nx * self.ny

    @property
    def device(self) -> torch.device:
        return self.point_cell.device

    def num_kept(self) -> int:
        """Number of points inside the grid (synchronises with the device)."""
        return int(self.cell_start[-1])

    def to(self, device) -> "FrustumLUT":
        return FrustumLUT._valid_by_construction(
            **{
                f.name: (
                    getattr(self, f.name).to(device)
                    if isinstance(getattr(self, f.name), torch.Tensor)
                    else getattr(self, f.name)
                )
                for f in fields(self)
            }
        )

    @classmethod
    def build(cls, points: torch.Tensor, grid: BevGrid, binning: str = "floor") -> "FrustumLUT":
        """From ego points B x N x D x fH x fW x 3 (metres) and the grid, on the points' device,
        without a host sync or host-to-device copy (capturable in a CUDA graph); `binning` as in
        `cell_indices`."""
        if points.dim() != 6 or points.shape[-1] != 3:
            raise ValueError(
                "FrustumLUT.build: points must be B x N x D x fH x fW x 3, got "
                f"{tuple(points.shape)}"
            )
        B, N, D, fH, fW, _ = points.shape
        nx, ny, nz = grid.nx, grid.ny, grid.nz
        P, cells = B * N * D * fH * fW, B * nz * nx * ny
        idx_dtype = _index_dtype(P, cells + 1)
        device = points.device
        with torch.autocast(device_type=device.type, enabled=False):
            pts = points.reshape(B, N * D * fH * fW, 3).float()  # also for B = 0
            cell_f = cell_indices(pts, grid, binning)
            kept = (
                (cell_f[..., 0] >= 0)
                & (cell_f[..., 0] < nx)
                & (cell_f[..., 1] >= 0)
                & (cell_f[..., 1] < ny)
                & (cell_f[..., 2] >= 0)
                & (cell_f[..., 2] < nz)
            )
            ijk = torch.where(kept.unsqueeze(-1), cell_f, 0.0).to(idx_dtype)
            batch = torch.arange(B, dtype=idx_dtype, device=device).view(B, 1)
            cell = ((batch * nz + ijk[..., 2]) * nx + ijk[..., 0]) * ny + ijk[..., 1]
            key = torch.where(kept, cell, cells).reshape(-1)
            sorted_key, order = torch.sort(key, stable=True)
            boundaries = torch.arange(cells + 1, dtype=idx_dtype, device=device)
            cell_start = torch.searchsorted(
                sorted_key, boundaries, out_int32=idx_dtype == torch.int32
            )
            point_cell = torch.where(kept.reshape(-1), key, -1)
        return cls._valid_by_construction(
            point_cell=point_cell,
            sorted_points=order.to(idx_dtype),
            cell_start=cell_start,
            B=B,
            N=N,
            D=D,
            fH=fH,
            fW=fW,
            nz=nz,
            nx=nx,
            ny=ny,
        )


BINNINGS = ("floor", "trunc")


def cell_indices(points: torch.Tensor, grid: BevGrid, binning: str = "floor") -> torch.Tensor:
    """... x 3 ego points (metres) -> ... x 3 whole cell coordinates (float; in the grid iff
    0 <= i < n per axis). "floor": floor((p - min) / size), so points below min fall outside;
    "trunc" (model.splat_binning): rounded toward zero as in the original LSS code, so points up to
    one cell below min land in cell 0. NaN stays NaN (outside)."""
    if binning not in BINNINGS:
        raise ValueError(f"binning must be one of {BINNINGS}, got {binning!r}")
    rounding = torch.floor if binning == "floor" else torch.trunc
    # Python scalars per axis: no host-to-device copy, so a LUT build stays capturable
    return torch.stack([rounding(grid.to_cells(points[..., a], a)) for a in range(3)], dim=-1)


class FrustumLUTCache:
    """Reuses the last FrustumLUT while the frustum, calibration, augmentation and grid are
    unchanged.

    The same tensor objects (unmodified in place) hit without touching the device; equal values in
    new tensors (a fixed rig at evaluation/inference) hit after one comparison on the device (one
    small host sync)."""

    def __init__(self):
        self._inputs: Optional[tuple] = None
        self._ids: Optional[tuple] = None
        self._grid: Optional[tuple[BevGrid, str]] = None  # the grid and the binning
        self._lut: Optional[FrustumLUT] = None
        self.hits = 0
        self.misses = 0

    def _matches(self, tensors, grid: tuple[BevGrid, str]) -> bool:
        if self._lut is None or grid != self._grid:
            return False
        # the very tensors of the last call (held, so ids are not reused), unchanged since
        if all(a is b and a._version == v for a, (b, v) in zip(tensors, self._ids)):
            return True
        if any(a.shape != b.shape or a.device != b.device for a, b in zip(tensors, self._inputs)):
            return False
        device = tensors[1].device
        same = torch.stack([(a == b).all().to(device) for a, b in zip(tensors, self._inputs)])
        if not bool(same.all()):
            return False
        self._ids = tuple(
            (t, t._version) for t in tensors
        )  # next call with these tensors hits without a sync
        return True

    def get(
        self,
        frustum: torch.Tensor,
        intrinsics: torch.Tensor,
        sensor2ego_rot: torch.Tensor,
        sensor2ego_trans: torch.Tensor,
        post_rot: torch.Tensor,
        post_trans: torch.Tensor,
        grid: BevGrid,
        binning: str = "floor",
    ) -> FrustumLUT:
        """The LUT of these inputs (shapes as in `frustum_to_ego`), built only when they differ from
        the last call."""
        tensors = (frustum, intrinsics, sensor2ego_rot, sensor2ego_trans, post_rot, post_trans)
        if not may_sync(frustum):
            # a captured step (train.cuda_graph) changes the rig at every replay and the comparison
            # would need a host sync: build every time, leaving the cache as it is
            return FrustumLUT.build(frustum_to_ego(*tensors), grid, binning)
        if self._matches(tensors, (grid, binning)):
            self.hits += 1
            return self._lut
        self.misses += 1
        points = frustum_to_ego(*tensors)
        self._lut = FrustumLUT.build(points, grid, binning)
        self._inputs = tuple(t.detach().clone() for t in tensors)
        self._ids = tuple((t, t._version) for t in tensors)
        self._grid = (grid, binning)
        return self._lut
