"""RoIPool (Fast R-CNN): max over the integer pixel window of each output bin, as
torchvision.ops.roi_pool."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lss.ops import _ext, _roi
from lss.ops._roi import Rois

# Leaf functions for torch.fx.symbolic_trace (as torchvision's ops): a traced model keeps one call
# node per op.
torch.fx.wrap("roi_pool")


def roi_pool(
    input: torch.Tensor,
    rois: Rois,
    output_size,
    spatial_scale: float = 1.0,
    *,
    validate: Optional[bool] = None,
) -> torch.Tensor:
    """Max-pools each roi of `input` (N x C x H x W) to K x C x PH x PW.

    rois: K x 5 (batch index, x1, y1, x2, y2) or a list of L_i x 4 boxes per image; coordinates are
    scaled by spatial_scale and rounded (half away from zero), the end pixel included. Empty bins
    give 0. The gradient goes to the arg-max pixel of each bin; no gradient for rois. spatial_scale
    must be finite and > 0, else ValueError.

    validate=True raises ValueError for non-finite coordinates or batch indices that are not
    integers in [0, N); reading the forward kernel's record of them is a host sync on CUDA.
    validate=False skips the read and the record: bad rois pool to zeros. The default (None)
    validates CPU inputs only, so an eager CUDA call never waits (see roi_align).
    """
    _roi.check_input(input, "roi_pool")
    pooled_h, pooled_w = _roi.output_hw(output_size, "roi_pool")
    spatial_scale = _roi.check_spatial_scale(spatial_scale, "roi_pool")
    rois = _roi.roi_tensor(rois, input, "roi_pool")
    if _ext.use_reference("roi_pool"):
        return roi_pool_reference(input, rois, output_size, spatial_scale)
    _ext.check_device("roi_pool", input, rois)
    check = _roi.should_validate(validate, input)
    output, _, bad_rois = torch.ops.lss.roi_pool(
        input, rois, spatial_scale, pooled_h, pooled_w, check
    )
    if check:
        _roi.raise_on_bad_rois(bad_rois, rois, input.shape[0], "roi_pool")
    return output


class RoIPool(nn.Module):
    """Module form of roi_pool; forward(input N x C x H x W, rois) -> K x C x PH x PW."""

    def __init__(self, output_size, spatial_scale: float = 1.0, validate: Optional[bool] = None):
        super().__init__()
        self.output_size = _roi.output_hw(output_size, "RoIPool")
        self.spatial_scale = _roi.check_spatial_scale(spatial_scale, "RoIPool")
        self.validate = validate if validate is None else bool(validate)

    def forward(self, input: torch.Tensor, rois: Rois) -> torch.Tensor:
        return roi_pool(input, rois, self.output_size, self.spatial_scale, validate=self.validate)

    def extra_repr(self) -> str:
        return (
            f"output_size={self.output_size}, spatial_scale={self.spatial_scale}, "
            f"validate={self.validate}"
        )


def roi_pool_reference(
    input: torch.Tensor, rois: Rois, output_size, spatial_scale: float = 1.0
) -> torch.Tensor:
    """Pure-PyTorch roi_pool (test oracle and fallback): a loop over rois, each bin a masked max
    over the roi's window. Differentiable through autograd."""
    _roi.check_input(input, "roi_pool")
    PH, PW = _roi.output_hw(output_size, "roi_pool")
    spatial_scale = _roi.check_spatial_scale(spatial_scale, "roi_pool")
    rois = _roi.roi_tensor(rois, input, "roi_pool")
    _roi.check_roi_values(rois, input.shape[0], "roi_pool")
    acc = rois.dtype
    N, C, H, W = input.shape
    x = input.to(acc)
    scaled = (rois[:, 1:] * spatial_scale).double()
    start_w, start_h, end_w, end_h = (
        (torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)).long().unbind(1)
    )
    roi_w = (end_w - start_w + 1).clamp(min=1)
    roi_h = (end_h - start_h + 1).clamp(min=1)
    bin_h = roi_h.to(acc) / PH
    bin_w = roi_w.to(acc) / PW

    def window(bin_size, start, bins, size):  # K x bins, half-open [lo, hi)
        i = torch.arange(bins, dtype=acc, device=x.device)[None]
        lo = torch.floor(i * bin_size[:, None]).long() + start[:, None]
        hi = torch.ceil((i + 1) * bin_size[:, None]).long() + start[:, None]
        return lo.clamp(0, size), hi.clamp(0, size)

    h0, h1 = window(bin_h, start_h, PH, H)
    w0, w1 = window(bin_w, start_w, PW, W)
    outs = []
    for k in range(rois.shape[0]):
        top, bottom = int(h0[k].min()), int(h1[k].max())
        left, right = int(w0[k].min()), int(w1[k].max())
        if bottom <= top or right <= left:
            outs.append(x.new_zeros(C, PH, PW) + 0 * x.sum())
            continue
        feat = x[int(rois[k, 0]), :, top:bottom, left:right]
        hh = torch.arange(top, bottom, device=x.device)
        ww = torch.arange(left, right, device=x.device)
        in_h = (hh[None] >= h0[k][:, None]) & (hh[None] < h1[k][:, None])  # PH x h
        in_w = (ww[None] >= w0[k][:, None]) & (ww[None] < w1[k][:, None])  # PW x w
        inside = in_h[:, None, :, None] & in_w[None, :, None, :]  # PH x PW x h x w
        vals = feat[:, None, None].masked_fill(~inside, float("-inf")).flatten(3)
        best = vals.max(dim=3).values  # C x PH x PW
        empty = ~inside.flatten(2).any(dim=2)
        outs.append(torch.where(empty, torch.zeros_like(best), best))
    if not outs:
        return (x.new_zeros(0, C, PH, PW) + 0 * x.sum()).to(input.dtype)
    return torch.stack(outs).to(input.dtype)


if _ext.has_ext():

    @torch.library.register_fake("lss::roi_pool")
    def _roi_pool_fake(
        input, rois, spatial_scale, pooled_height, pooled_width, record_bad_rois=True
    ):
        torch._check(rois.dim() == 2 and rois.shape[1] == 5, lambda: "roi_pool: rois must be K x 5")
        shape = (rois.shape[0], input.shape[1], pooled_height, pooled_width)
        return (
            input.new_empty(shape),
            input.new_empty(shape, dtype=torch.int32),
            input.new_empty((2 if record_bad_rois else 0,), dtype=torch.int64),
        )

    @torch.library.register_fake("lss::_roi_pool_backward")
    def _roi_pool_backward_fake(
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
    ):
        return grad.new_empty((batch_size, channels, height, width))

    # Autograd is registered in C++ (csrc/ops/autograd.cpp), as torchvision's: no Python runs in an
    # eager call.
