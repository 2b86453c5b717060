// bev_pool: argument checks and layout helpers shared by the CPU and CUDA kernels (defined in bev_pool.cpp).
//
// Points p index depth B x N x D x fH x fW flattened; the feature pixel of p is (b, n, h, w), read from feat in
// channels-last order (B x N x fH x fW x C) so that the C values of a pixel are contiguous. Cells c index
// ((b * nz + z) * nx + i) * ny + j. The output B x (nz*C) x nx x ny follows feat's layout (output_channels_last):
//  - channels-last: element (b, z*C + ch, i, j) lives at ((b*nx + i)*ny + j)*nz*C + z*C + ch (a cell's C values
//    are contiguous);
//  - otherwise NCHW-contiguous: element (b, z*C + ch, i, j) lives at ((b*nz + z)*C + ch)*nx*ny + i*ny + j.
#pragma once

#include <tuple>

#include "ops/common.h"

namespace lss {
namespace bev_pool {

struct Shape {
  int64_t B, N, D, fH, fW, C, nz, nx, ny;
  int64_t hw() const { return fH * fW; }
  int64_t dhw() const { return D * fH * fW; }
  int64_t nxy() const { return nx * ny; }
  int64_t cells() const { return B * nz * nx * ny; }
  int64_t points() const { return B * N * D * fH * fW; }
  int64_t pixels() const { return B * N * fH * fW; }
};

// Host-side checks and layout helpers, defined in bev_pool.cpp (see common.h for why they are not inline here).

// Checks depth, feat, the LUT index tensors and the grid; returns the sizes.
Shape check_args(const at::Tensor& depth, const at::Tensor& feat, const at::Tensor* sorted_points,
                 const at::Tensor& cell_start, const at::Tensor& point_cell, int64_t nz, int64_t nx, int64_t ny);

void check_grad_out(const at::Tensor& grad_out, const at::Tensor& depth, const Shape& s);

// Whether the output is channels-last: feat B x N x C x fH x fW is channels-last (its C values per pixel are
// contiguous) and C > 1. lss/ops/bev_pool.py (_output_channels_last) mirrors this for the fake kernel.
bool output_channels_last(const at::Tensor& feat);

// The empty B x (nz*C) x nx x ny output in the layout output_channels_last picks.
at::Tensor empty_output(const at::Tensor& depth, const at::Tensor& feat, const Shape& s);

// feat B x N x C x fH x fW (any strides) as a contiguous B x N x fH x fW x C tensor: free for channels-last input.
at::Tensor feat_channels_last(const at::Tensor& feat);

// Where the C gradient values of a cell live: row(c) = b*batch + z*level + ij*cell with b, z, ij from c; the C
// values of a row are contiguous.
struct GradRows {
  int64_t batch, level, cell;
};

// grad_out already channels-last (B x nx x ny x nz*C in memory): rows can be read in place.
bool grad_is_channels_last(const at::Tensor& grad_out);

GradRows channels_last_rows(const Shape& s);

// The staged copy: a cells x C buffer, row c at c*C.
GradRows staged_rows(const Shape& s);

// Strides of a B x N x C x fH x fW tensor: element (b, n, c, h, w) at at(b, n, h, w) + c * channel.
struct PixelStrides {
  int64_t batch, camera, channel, row, col;
  C10_HOST_DEVICE int64_t at(int64_t b, int64_t n, int64_t h, int64_t w) const {
    return b * batch + n * camera + h * row + w * col;
  }
};

PixelStrides pixel_strides(const at::Tensor& t);

// grad_depth like depth (contiguous); grad_feat B x N x C x fH x fW in feat's layout (output_channels_last):
// channels-last (B x N x fH x fW x C in memory) or contiguous.
std::tuple<at::Tensor, at::Tensor> empty_grads(const at::Tensor& depth, const at::Tensor& feat, const Shape& s);

}  // namespace bev_pool
}  // namespace lss
