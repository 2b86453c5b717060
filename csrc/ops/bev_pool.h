// bev_pool: argument checks and layout helpers shared by the CPU and CUDA kernels.
//
// Points p index depth B x N x D x fH x fW flattened; the feature pixel of p is (b, n, h, w), read from feat in
// channels-last order (B x N x fH x fW x C) so that the C values of a pixel are contiguous. Cells c index
// ((b * nz + z) * nx + i) * ny + j; output element (b, z*C + ch, i, j) lives at ((b*nz + z)*C + ch)*nx*ny + i*ny + j.
#pragma once

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

inline void check_index(const at::Tensor& t, const at::Tensor& like, const char* name, int64_t numel,
                        const at::Tensor& depth) {
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, "bev_pool: ", name,
              " must be int32 or int64 (from lss.geometry.FrustumLUT.build), got ", t.scalar_type());
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), "bev_pool: ", name, " has dtype ", t.scalar_type(),
              " but cell_start has ", like.scalar_type(), "; pass the index tensors of one FrustumLUT");
  TORCH_CHECK(t.dim() == 1 && t.numel() == numel, "bev_pool: ", name, " must be 1-D with ", numel,
              " elements for these depth/feat shapes and grid, got shape ", t.sizes(),
              "; rebuild the FrustumLUT for these inputs");
  TORCH_CHECK(t.device() == depth.device(), "bev_pool: ", name, " is on ", t.device(), " but depth is on ",
              depth.device(), "; move the FrustumLUT to the inputs' device (lut.to(device))");
}

// Checks depth, feat, the LUT index tensors and the grid; returns the sizes.
inline Shape check_args(const at::Tensor& depth, const at::Tensor& feat, const at::Tensor* sorted_points,
                        const at::Tensor& cell_start, const at::Tensor& point_cell, int64_t nz, int64_t nx,
                        int64_t ny) {
  LSS_CHECK_FLOATING(depth, "bev_pool: depth");
  LSS_CHECK_FLOATING(feat, "bev_pool: feat");
  LSS_CHECK_DIM(depth, 5, "bev_pool: depth", "B x N x D x fH x fW");
  LSS_CHECK_DIM(feat, 5, "bev_pool: feat", "B x N x C x fH x fW");
  TORCH_CHECK(depth.scalar_type() == feat.scalar_type(), "bev_pool: depth (", depth.scalar_type(), ") and feat (",
              feat.scalar_type(), ") must have the same dtype; cast one of them");
  LSS_CHECK_SAME_DEVICE(depth, feat, "bev_pool: depth", "feat");
  TORCH_CHECK(depth.size(0) == feat.size(0) && depth.size(1) == feat.size(1) && depth.size(3) == feat.size(3) &&
                  depth.size(4) == feat.size(4),
              "bev_pool: depth (B x N x D x fH x fW) ", depth.sizes(), " and feat (B x N x C x fH x fW) ",
              feat.sizes(), " must agree in B, N, fH and fW");
  TORCH_CHECK(nz >= 1 && nx >= 1 && ny >= 1, "bev_pool: grid sizes nz, nx, ny must be >= 1, got ", nz, ", ", nx,
              ", ", ny);
  Shape s{depth.size(0), depth.size(1), depth.size(2), depth.size(3), depth.size(4), feat.size(2), nz, nx, ny};
  check_index(cell_start, cell_start, "cell_start", s.cells() + 1, depth);
  check_index(point_cell, cell_start, "point_cell", s.points(), depth);
  if (sorted_points != nullptr) check_index(*sorted_points, cell_start, "sorted_points", s.points(), depth);
  return s;
}

inline void check_grad_out(const at::Tensor& grad_out, const at::Tensor& depth, const Shape& s) {
  TORCH_CHECK(grad_out.dim() == 4 && grad_out.size(0) == s.B && grad_out.size(1) == s.nz * s.C &&
                  grad_out.size(2) == s.nx && grad_out.size(3) == s.ny,
              "bev_pool backward: grad_out must be B x (nz*C) x nx x ny = [", s.B, ", ", s.nz * s.C, ", ", s.nx,
              ", ", s.ny, "], got ", grad_out.sizes());
  TORCH_CHECK(grad_out.scalar_type() == depth.scalar_type(), "bev_pool backward: grad_out has dtype ",
              grad_out.scalar_type(), ", expected ", depth.scalar_type(), " (the dtype of depth and feat)");
  LSS_CHECK_SAME_DEVICE(grad_out, depth, "bev_pool backward: grad_out", "depth");
}

// feat B x N x C x fH x fW (any strides) as a contiguous B x N x fH x fW x C tensor: free for channels-last input.
inline at::Tensor feat_channels_last(const at::Tensor& feat) { return feat.permute({0, 1, 3, 4, 2}).contiguous(); }

// Where the C gradient values of a cell live: row(c) = b*batch + z*level + ij*cell with b, z, ij from c; the C
// values of a row are contiguous.
struct GradRows {
  int64_t batch, level, cell;
};

// grad_out already channels-last (B x nx x ny x nz*C in memory): rows can be read in place.
inline bool grad_is_channels_last(const at::Tensor& grad_out) {
  return grad_out.is_contiguous(at::MemoryFormat::ChannelsLast) && !grad_out.is_contiguous();
}

inline GradRows channels_last_rows(const Shape& s) { return {s.nxy() * s.nz * s.C, s.C, s.nz * s.C}; }

// The staged copy: a cells x C buffer, row c at c*C.
inline GradRows staged_rows(const Shape& s) { return {s.nz * s.nxy() * s.C, s.nxy() * s.C, s.C}; }

// grad_depth like depth (contiguous); grad_feat allocated channels-last and returned as B x N x C x fH x fW.
inline std::tuple<at::Tensor, at::Tensor> empty_grads(const at::Tensor& depth, const at::Tensor& feat,
                                                      const Shape& s) {
  auto grad_depth = at::empty(depth.sizes(), depth.options().memory_format(at::MemoryFormat::Contiguous));
  auto grad_feat = at::empty({s.B, s.N, s.fH, s.fW, s.C}, feat.options().memory_format(at::MemoryFormat::Contiguous));
  return {grad_depth, grad_feat};
}

}  // namespace bev_pool
}  // namespace lss
