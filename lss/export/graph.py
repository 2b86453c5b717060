"""The inference network in a form that exports to ONNX: camera encoder -> splat -> BEV
encoder -> segmentation head.

Each piece that the TorchScript exporter cannot write as we mean it is an autograd.Function with a
`symbolic`: its forward runs our PyTorch op (the values the graph is traced with), its symbolic
writes the ONNX node.
- `ResizeFn`: lss.ops.upsample_bilinear -> ONNX Resize (mode "linear") with the op's coordinate
  mode, 1:1 (the op's modes are the Resize `coordinate_transformation_mode` names; the forward
  computes ONNX's arithmetic of the mode, which for pytorch_half_pixel differs from the op's on an
  output axis of length 1).
- `ScatterAddFn`: summing rows into a zero tensor -> ONNX ScatterND with reduction "add"
  (opset >= 16).
- `BevPoolFn`: bev_pool with a one-sample lookup table -> one node `lss.BevPool` (see
  docs/export.md).
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

from lss.geometry import RIG_KEYS, FrustumLUT, frustum_to_ego
from lss.geometry.lut import cell_indices
from lss.ops import UpsampleBilinear, bev_pool, upsample_bilinear_reference

CUSTOM_DOMAIN = "lss"


class ResizeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, size, scale_factor, mode):
        return upsample_bilinear_reference(x, size, scale_factor, mode, onnx_rule=True)

    @staticmethod
    def symbolic(g, x, size, scale_factor, mode):
        empty = g.op("Constant", value_t=torch.tensor([], dtype=torch.float32))
        attrs = dict(mode_s="linear", coordinate_transformation_mode_s=mode)
        if scale_factor is not None:
            sh, sw = (
                scale_factor
                if isinstance(scale_factor, (tuple, list))
                else (scale_factor, scale_factor)
            )
            scales = g.op(
                "Constant",
                value_t=torch.tensor([1.0, 1.0, float(sh), float(sw)], dtype=torch.float32),
            )
            return g.op("Resize", x, empty, scales, **attrs)
        h, w = size if isinstance(size, (tuple, list)) else (size, size)
        batch_channels = g.op(
            "Slice",
            g.op("Shape", x),
            g.op("Constant", value_t=torch.tensor([0])),
            g.op("Constant", value_t=torch.tensor([2])),
        )
        sizes = g.op(
            "Concat",
            batch_channels,
            g.op("Constant", value_t=torch.tensor([int(h), int(w)])),
            axis_i=0,
        )
        return g.op("Resize", x, empty, empty, sizes, **attrs)


class ExportResize(nn.Module):
    """An UpsampleBilinear that exports as ONNX Resize in coordinate mode `mode`."""

    def __init__(self, upsample: UpsampleBilinear, mode: str):
        super().__init__()
        self.size, self.scale_factor, self.mode = upsample.size, upsample.scale_factor, mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ResizeFn.apply(x, self.size, self.scale_factor, self.mode)


class ScatterAddFn(torch.autograd.Function):
    """zeros.index_add(0, index, updates): zeros R x F..., index K (int64), updates K x F..."""

    @staticmethod
    def forward(ctx, zeros, index, updates):
        return zeros.index_add(0, index, updates)

    @staticmethod
    def symbolic(g, zeros, index, updates):
        indices = g.op("Unsqueeze", index, g.op("Constant", value_t=torch.tensor([1])))
        return g.op("ScatterND", zeros, indices, updates, reduction_s="add")


class BevPoolFn(torch.autograd.Function):
    """bev_pool of every sample of the batch with one one-sample table (sorted_points, cell_start,
    point_cell)."""

    @staticmethod
    def forward(ctx, depth, feat, sorted_points, cell_start, point_cell, nz, nx, ny):
        _, N, D, fH, fW = depth.shape
        lut = FrustumLUT._valid_by_construction(
            point_cell=point_cell,
            sorted_points=sorted_points,
            cell_start=cell_start,
            B=1,
            N=N,
            D=D,
            fH=fH,
            fW=fW,
            nz=nz,
            nx=nx,
            ny=ny,
        )
        return torch.cat(
            [bev_pool(depth[b : b + 1], feat[b : b + 1], lut) for b in range(depth.shape[0])]
        )

    @staticmethod
    def symbolic(g, depth, feat, sorted_points, cell_start, point_cell, nz, nx, ny):
        out = g.op(
            f"{CUSTOM_DOMAIN}::BevPool",
            depth,
            feat,
            sorted_points,
            cell_start,
            point_cell,
            nz_i=nz,
            nx_i=nx,
            ny_i=ny,
        )
        sizes = depth.type().sizes() if depth.type().dim() else None
        channels = feat.type().sizes()[2] if feat.type().dim() else None
        if sizes is not None and channels is not None:
            out.setType(
                depth.type().with_sizes([None, nz * channels, nx, ny])
            )  # the batch is dynamic
        return out


def replace_upsampling(module: nn.Module, mode: str) -> None:
    """Swap every UpsampleBilinear under `module` for an ExportResize in coordinate mode `mode`, in
    place."""
    for name, child in module.named_children():
        if isinstance(child, UpsampleBilinear):
            setattr(module, name, ExportResize(child, mode))
        else:
            replace_upsampling(child, mode)


# the outputs a model with the detection head adds to "segmentation" (DeployModel.heads)
DETECTION_OUTPUTS = ("det_heatmap", "det_regression")


def head_outputs(model: nn.Module) -> tuple:
    """The names of DeployModel.heads' outputs for `model`: "segmentation", then
    DETECTION_OUTPUTS where the model has the detection head."""
    has_detection = getattr(model, "detection", None) is not None
    return ("segmentation", *(DETECTION_OUTPUTS if has_detection else ()))


class DeployModel(nn.Module):
    """The network of a LiftSplatShoot, for export.
    forward(images B x N x 3 x H x W[, rig]) -> segmentation logits B x K x nx x ny; with the
    detection head (segmentation, det_heatmap, det_regression), see `heads`.

    splat = "onnx": the frustum-to-BEV table is a constant (rig: N x ... tensors of RIG_KEYS) and
    the pooling a gather + ScatterND(add); "custom": the same constant table feeds one lss.BevPool
    node; "rig_inputs": the rig is five more graph inputs (B x N x ...) and the table is computed in
    the graph (frustum -> ego -> cells).
    resize_mode: the coordinate mode of every Resize (default: the model's model.upsample_mode).
    """

    def __init__(
        self,
        model: nn.Module,
        splat: str = "onnx",
        rig: Optional[dict] = None,
        resize_mode: Optional[str] = None,
        upsample_mode: str = "pytorch_half_pixel",
    ):
        super().__init__()
        if splat not in ("onnx", "custom", "rig_inputs"):
            raise ValueError(
                f"DeployModel: splat must be 'onnx', 'custom' or 'rig_inputs', got {splat!r}"
            )
        model = copy.deepcopy(model).cpu().eval()  # the caller's model stays where it is
        replace_upsampling(model, resize_mode or upsample_mode)
        self.camera, self.bev, self.segmentation = model.camera, model.bev, model.segmentation
        # the detection head's first stage (its maps; decoding and the second stage stay outside)
        self.detection = getattr(model, "detection", None)
        self.detection_decoder = getattr(model, "detection_decoder", None)
        self.splat_mode = splat
        self.grid = model.grid
        self.binning = model.splat.binning  # model.splat_binning
        self.register_buffer("frustum", model.splat.frustum, persistent=False)
        D, fH, fW, _ = self.frustum.shape
        self.nz, self.nx, self.ny = self.grid.nz, self.grid.nx, self.grid.ny
        if splat == "rig_inputs":
            return
        points = frustum_to_ego(self.frustum, *(rig[k].float()[None] for k in RIG_KEYS))
        lut = FrustumLUT.build(points, self.grid, self.binning)
        if splat == "custom":
            self.register_buffer("sorted_points", lut.sorted_points, persistent=False)
            self.register_buffer("cell_start", lut.cell_start, persistent=False)
            self.register_buffer("point_cell", lut.point_cell, persistent=False)
            return
        # the kept points in cell order: their depth entries, their feature pixels (n, h, w) and
        # their cells
        kept = lut.sorted_points[: lut.num_kept()].long()
        n, rest = kept // (D * fH * fW), kept % (fH * fW)
        self.register_buffer("kept_points", kept, persistent=False)
        self.register_buffer("kept_pixels", n * (fH * fW) + rest, persistent=False)
        self.register_buffer("kept_cells", lut.point_cell[kept].long(), persistent=False)

    def forward(self, images: torch.Tensor, *rig: torch.Tensor):
        B, N = images.shape[0], images.shape[1]
        depth, context = self.camera(images.flatten(0, 1))
        return self.heads(self.splat(depth, context, B, N, rig))

    def heads(self, grid: torch.Tensor):
        """The splatted grid -> segmentation logits B x K x nx x ny; with the detection head also
        its heatmap logits B x classes x nx x ny and regression maps B x 10 x nx x ny (as
        lss.models.LSS computes them: the head on the decoder's output or on its own last stage)."""
        if self.detection is None:
            return self.segmentation(self.bev(grid))
        features, detection = self.bev.for_heads(grid, self.detection_decoder)
        shared = self.detection.shared(detection)
        return (
            self.segmentation(features),
            self.detection.heatmap(shared),
            self.detection.regression(shared),
        )

    def splat(
        self, depth: torch.Tensor, context: torch.Tensor, B: int, N: int, rig: tuple
    ) -> torch.Tensor:
        """Camera features (depth B*N x D x fH x fW, context B*N x C x fH x fW) -> the splatted grid
        B x nz*C x nx x ny, through the fixed table or, with rig inputs, `rig` (RIG_KEYS order)."""
        D, fH, fW = depth.shape[1:]
        C = context.shape[1]
        if self.splat_mode == "custom":
            return BevPoolFn.apply(
                depth.unflatten(0, (B, N)),
                context.unflatten(0, (B, N)),
                self.sorted_points,
                self.cell_start,
                self.point_cell,
                self.nz,
                self.nx,
                self.ny,
            )
        # B x N*fH*fW x C: the context vector of every feature pixel
        pixels = context.reshape(B, N, C, fH * fW).permute(0, 1, 3, 2).reshape(B, N * fH * fW, C)
        depth = depth.reshape(B, N * D * fH * fW)
        if self.splat_mode == "rig_inputs":
            return self._pool_rig_inputs(depth, pixels, rig)
        return self._pool_fixed(depth, pixels)

    def _to_bev(self, cells: torch.Tensor, B: int) -> torch.Tensor:
        """B x nz*nx*ny x C cell sums -> B x nz*C x nx x ny (the bev_pool layout)."""
        C = cells.shape[-1]
        return (
            cells.reshape(B, self.nz, self.nx, self.ny, C)
            .permute(0, 1, 4, 2, 3)
            .reshape(B, self.nz * C, self.nx, self.ny)
        )

    def _pool_fixed(self, depth: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
        B, C = depth.shape[0], pixels.shape[-1]
        products = (
            depth[:, self.kept_points].unsqueeze(-1) * pixels[:, self.kept_pixels]
        )  # B x K x C
        zeros = products.new_zeros(self.nz * self.nx * self.ny, B, C)
        cells = ScatterAddFn.apply(
            zeros, self.kept_cells, products.transpose(0, 1)
        )  # cells x B x C
        return self._to_bev(cells.transpose(0, 1), B)

    def _pool_rig_inputs(
        self, depth: torch.Tensor, pixels: torch.Tensor, rig: tuple
    ) -> torch.Tensor:
        B, C = depth.shape[0], pixels.shape[-1]
        points = frustum_to_ego(self.frustum, *rig)  # B x N x D x fH x fW x 3
        N, D, fH, fW = points.shape[1:5]
        cell = cell_indices(points, self.grid, self.binning)
        bounds = torch.tensor([self.nx, self.ny, self.nz], dtype=cell.dtype, device=cell.device)
        kept = ((cell >= 0) & (cell < bounds)).all(dim=-1).reshape(B, -1)
        cell = cell.reshape(B, -1, 3).long()
        num_cells = self.nz * self.nx * self.ny
        # points outside the grid go to one spare row per sample, dropped afterwards
        index = torch.where(
            kept, (cell[..., 2] * self.nx + cell[..., 0]) * self.ny + cell[..., 1], num_cells
        )
        index = index + torch.arange(B, device=index.device).unsqueeze(1) * (num_cells + 1)
        # the feature pixel (n, h, w) of every point (n, d, h, w)
        point = torch.arange(N * D * fH * fW, device=depth.device)
        pixel_of_point = point // (D * fH * fW) * (fH * fW) + point % (fH * fW)
        products = depth.unsqueeze(-1) * pixels[:, pixel_of_point]  # B x P x C
        zeros = products.new_zeros(B * (num_cells + 1), C)
        cells = ScatterAddFn.apply(zeros, index.reshape(-1), products.reshape(-1, C))
        return self._to_bev(cells.reshape(B, num_cells + 1, C)[:, :num_cells], B)
