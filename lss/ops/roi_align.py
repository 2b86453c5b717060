"""RoIAlign (Mask R-CNN): bilinear samples of each output bin, averaged (torchvision's roi_align) or
maxed (mmcv's "max" pool mode, the gradient going to the arg-max sample)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lss.ops import _ext, _roi
from lss.ops._roi import Rois

# Leaf functions for torch.fx.symbolic_trace (as torchvision's ops): a traced model keeps one call
# node per op.
torch.fx.wrap("roi_align")

_MODES = ("avg", "max")


def roi_align(
    input: torch.Tensor,
    rois: Rois,
    output_size,
    spatial_scale: float = 1.0,
    sampling_ratio: int = -1,
    aligned: bool = False,
    mode: str = "avg",
    *,
    validate: Optional[bool] = None,
) -> torch.Tensor:
    """Pools each roi of `input` (N x C x H x W) to K x C x PH x PW.

    rois: K x 5 (batch index, x1, y1, x2, y2) in input-image coordinates, or a list of L_i x 4 boxes
    per image. spatial_scale maps roi coordinates to the feature map (1/8 for a stride-8 map).
    sampling_ratio > 0 samples that many points per bin side; <= 0 uses ceil(roi size / output
    size). aligned=True shifts by half a pixel (pixel centres at +0.5, the detectron2 convention).
    mode "avg" equals torchvision.ops.roi_align; "max" takes the largest bilinear sample.
    spatial_scale must be finite and > 0 and sampling_ratio at most
    lss.ops._roi.MAX_SAMPLING_RATIO (64), else ValueError. Accumulates in float32 (float64 for
    float64 input); no gradient for rois.

    validate=True raises ValueError for non-finite coordinates or batch indices that are not
    integers in [0, N), which the forward kernel records. Reading that record is a host sync on
    CUDA: the host waits for the forward instead of queueing autograd's backward work while it runs.
    validate=False skips the read, and the kernel keeps no record (no allocation and fill of it per
    call): bad rois then pool to zeros (no gradient) and are never read out of bounds. The default
    (None) validates CPU inputs, where the read costs no sync, and skips it for CUDA inputs, so an
    eager CUDA call never waits for the device (as torchvision's, which does not check rois at all).
    The pure-PyTorch fallback always validates.
    """
    _roi.check_input(input, "roi_align")
    if mode not in _MODES:
        raise ValueError(f"lss.ops.roi_align: mode must be one of {_MODES}, got {mode!r}")
    pooled_h, pooled_w = _roi.output_hw(output_size, "roi_align")
    spatial_scale = _roi.check_spatial_scale(spatial_scale, "roi_align")
    sampling_ratio = _roi.check_sampling_ratio(sampling_ratio, "roi_align")
    rois = _roi.roi_tensor(rois, input, "roi_align")
    if _ext.use_reference("roi_align"):
        return roi_align_reference(
            input, rois, output_size, spatial_scale, sampling_ratio, aligned, mode
        )
    _ext.check_device("roi_align", input, rois)
    check = _roi.should_validate(validate, input)
    output, _, bad_rois = torch.ops.lss.roi_align(
        input,
        rois,
        spatial_scale,
        pooled_h,
        pooled_w,
        sampling_ratio,
        bool(aligned),
        mode == "max",
        check,
    )
    if check:
        _roi.raise_on_bad_rois(bad_rois, rois, input.shape[0], "roi_align")
    return output


class RoIAlign(nn.Module):
    """Module form of roi_align; forward(input N x C x H x W, rois) -> K x C x PH x PW."""

    def __init__(
        self,
        output_size,
        spatial_scale: float = 1.0,
        sampling_ratio: int = -1,
        aligned: bool = False,
        mode: str = "avg",
        validate: Optional[bool] = None,
    ):
        super().__init__()
        if mode not in _MODES:
            raise ValueError(f"RoIAlign: mode must be one of {_MODES}, got {mode!r}")
        self.output_size = _roi.output_hw(output_size, "RoIAlign")
        self.spatial_scale = _roi.check_spatial_scale(spatial_scale, "RoIAlign")
        self.sampling_ratio = _roi.check_sampling_ratio(sampling_ratio, "RoIAlign")
        self.aligned = bool(aligned)
        self.mode = mode
        self.validate = validate if validate is None else bool(validate)

    def forward(self, input: torch.Tensor, rois: Rois) -> torch.Tensor:
        return roi_align(
            input,
            rois,
            self.output_size,
            self.spatial_scale,
            self.sampling_ratio,
            self.aligned,
            self.mode,
            validate=self.validate,
        )

    def extra_repr(self) -> str:
        return (
            f"output_size={self.output_size}, spatial_scale={self.spatial_scale}, "
            f"sampling_ratio={self.sampling_ratio}, aligned={self.aligned}, mode={self.mode!r}, "
            f"validate={self.validate}"
        )


def _bilinear_axis(coord: torch.Tensor, size: int):
    """Per-axis part of torchvision's bilinear rule: (low, high, frac, 1 - frac, inside) for
    coordinates along an axis of `size` pixels; points more than one pixel outside are not
    `inside`."""
    inside = (coord >= -1) & (coord <= size)
    c = coord.clamp(min=0)
    low = c.floor().long()
    edge = low >= size - 1
    low = torch.where(edge, torch.full_like(low, size - 1), low)
    high = torch.where(edge, low, low + 1)
    c = torch.where(edge, low.to(c.dtype), c)
    frac = c - low.to(c.dtype)
    return low, high, frac, 1 - frac, inside


def roi_align_reference(
    input: torch.Tensor,
    rois: Rois,
    output_size,
    spatial_scale: float = 1.0,
    sampling_ratio: int = -1,
    aligned: bool = False,
    mode: str = "avg",
) -> torch.Tensor:
    """Pure-PyTorch roi_align (test oracle and fallback): every sample of every bin gathered at
    once, so it needs K x PH x PW x samples x C memory. Differentiable through autograd."""
    _roi.check_input(input, "roi_align")
    if mode not in _MODES:
        raise ValueError(f"lss.ops.roi_align: mode must be one of {_MODES}, got {mode!r}")
    PH, PW = _roi.output_hw(output_size, "roi_align")
    spatial_scale = _roi.check_spatial_scale(spatial_scale, "roi_align")
    sampling_ratio = _roi.check_sampling_ratio(sampling_ratio, "roi_align")
    rois = _roi.roi_tensor(rois, input, "roi_align")
    _roi.check_roi_values(rois, input.shape[0], "roi_align")
    acc = rois.dtype
    N, C, H, W = input.shape
    K = rois.shape[0]
    x = input.to(acc)
    if K == 0:
        return (x.new_zeros(0, C, PH, PW) + 0 * x.sum()).to(input.dtype)
    offset = 0.5 if aligned else 0.0
    x1 = rois[:, 1] * spatial_scale - offset
    y1 = rois[:, 2] * spatial_scale - offset
    roi_w = rois[:, 3] * spatial_scale - offset - x1
    roi_h = rois[:, 4] * spatial_scale - offset - y1
    if not aligned:
        roi_w, roi_h = roi_w.clamp(min=1), roi_h.clamp(min=1)
    bin_h, bin_w = roi_h / PH, roi_w / PW
    if sampling_ratio > 0:
        grid_h = grid_w = torch.full((K,), sampling_ratio, dtype=torch.long, device=x.device)
    else:
        grid_h = torch.ceil(roi_h / PH).clamp(min=0).long()
        grid_w = torch.ceil(roi_w / PW).clamp(min=0).long()
    count = (grid_h * grid_w).clamp(min=1).to(acc)
    GH, GW = int(grid_h.max()), int(grid_w.max())
    if GH == 0 or GW == 0:
        return (x.new_zeros(K, C, PH, PW) + 0 * x.sum()).to(input.dtype)

    def positions(start, bin_size, grid, bins, samples):  # K x bins x samples
        b = torch.arange(bins, dtype=acc, device=x.device)[None, :, None]
        s = torch.arange(samples, dtype=acc, device=x.device)[None, None, :]
        g = grid.to(acc).clamp(min=1)[:, None, None]
        pos = (
            start[:, None, None]
            + b * bin_size[:, None, None]
            + (s + 0.5) * bin_size[:, None, None] / g
        )
        in_grid = (s < grid[:, None, None].to(acc)).expand_as(pos)
        return torch.where(in_grid, pos, torch.zeros_like(pos)), in_grid

    y, in_grid_y = positions(y1, bin_h, grid_h, PH, GH)
    xs, in_grid_x = positions(x1, bin_w, grid_w, PW, GW)
    y_lo, y_hi, ly, hy, in_y = _bilinear_axis(y, H)
    x_lo, x_hi, lx, hx, in_x = _bilinear_axis(xs, W)

    def Y(t):  # K x PH x GH -> K x PH x GH x 1 x 1
        return t[:, :, :, None, None]

    def X(t):  # K x PW x GW -> K x 1 x 1 x PW x GW
        return t[:, None, None, :, :]

    feats = x.permute(0, 2, 3, 1)  # N x H x W x C
    b = rois[:, 0].long()[:, None, None, None, None]
    val = (
        (Y(hy) * X(hx))[..., None] * feats[b, Y(y_lo), X(x_lo)]
        + (Y(hy) * X(lx))[..., None] * feats[b, Y(y_lo), X(x_hi)]
        + (Y(ly) * X(hx))[..., None] * feats[b, Y(y_hi), X(x_lo)]
        + (Y(ly) * X(lx))[..., None] * feats[b, Y(y_hi), X(x_hi)]
    )  # K x PH x GH x PW x GW x C
    in_grid = (Y(in_grid_y) & X(in_grid_x))[..., None]
    inside = (Y(in_y) & X(in_x))[..., None]
    val = torch.where(in_grid & inside, val, torch.zeros_like(val))
    if mode == "avg":
        out = val.sum(dim=(2, 4)) / count[:, None, None, None]
    else:
        val = torch.where(in_grid, val, torch.full_like(val, float("-inf")))
        val = val.permute(0, 1, 3, 2, 4, 5).flatten(
            3, 4
        )  # K x PH x PW x GH*GW x C, samples row-major
        out = val.max(dim=3).values
        empty = (grid_h * grid_w == 0)[:, None, None, None]
        out = torch.where(empty, torch.zeros_like(out), out)
    return out.permute(0, 3, 1, 2).contiguous().to(input.dtype)


if _ext.has_ext():

    @torch.library.register_fake("lss::roi_align")
    def _roi_align_fake(
        input,
        rois,
        spatial_scale,
        pooled_height,
        pooled_width,
        sampling_ratio,
        aligned,
        max_mode,
        record_bad_rois=True,
    ):
        torch._check(
            rois.dim() == 2 and rois.shape[1] == 5, lambda: "roi_align: rois must be K x 5"
        )
        shape = (rois.shape[0], input.shape[1], pooled_height, pooled_width)
        argmax = input.new_empty(shape if max_mode else (0,), dtype=torch.int32)
        return (
            input.new_empty(shape),
            argmax,
            input.new_empty((2 if record_bad_rois else 0,), dtype=torch.int64),
        )

    @torch.library.register_fake("lss::_roi_align_backward")
    def _roi_align_backward_fake(
        grad,
        rois,
        argmax,
        spatial_scale,
        pooled_height,
        pooled_width,
        batch_size,
        channels,
        height,
        width,
        sampling_ratio,
        aligned,
        max_mode,
    ):
        return grad.new_empty((batch_size, channels, height, width))

    # Autograd is registered in C++ (csrc/ops/autograd.cpp), as torchvision's: no Python runs in an
    # eager call.
