// bev_pool schema and host-side checks: the splat of Lift-Splat-Shoot over a FrustumLUT (see lss/ops/bev_pool.py,
// docs/splat.md).
#include "ops/bev_pool.h"
#include "ops/host_check.h"

TORCH_LIBRARY_FRAGMENT(lss, m) {
  m.def(
      "bev_pool(Tensor depth, Tensor feat, Tensor sorted_points, Tensor cell_start, Tensor point_cell, "
      "int nz, int nx, int ny) -> Tensor");
  m.def(
      "_bev_pool_backward(Tensor grad_out, Tensor depth, Tensor feat, Tensor cell_start, Tensor point_cell, "
      "int nz, int nx, int ny) -> (Tensor, Tensor)");
}

namespace lss {
namespace bev_pool {

namespace {

void check_index(const at::Tensor& t, const at::Tensor& like, const char* name, int64_t numel,
                 const at::Tensor& depth) {
  LSS_HOST_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, "bev_pool: ", name,
              " must be int32 or int64 (from lss.geometry.FrustumLUT.build), got ", t.scalar_type());
  LSS_HOST_CHECK(t.scalar_type() == like.scalar_type(), "bev_pool: ", name, " has dtype ", t.scalar_type(),
              " but cell_start has ", like.scalar_type(), "; pass the index tensors of one FrustumLUT");
  LSS_HOST_CHECK(t.dim() == 1 && t.numel() == numel, "bev_pool: ", name, " must be 1-D with ", numel,
              " elements for these depth/feat shapes and grid, got shape ", t.sizes(),
              "; rebuild the FrustumLUT for these inputs");
  LSS_HOST_CHECK(t.device() == depth.device(), "bev_pool: ", name, " is on ", t.device(), " but depth is on ",
              depth.device(), "; move the FrustumLUT to the inputs' device (lut.to(device))");
}

}  // namespace

Shape check_args(const at::Tensor& depth, const at::Tensor& feat, const at::Tensor* sorted_points,
                 const at::Tensor& cell_start, const at::Tensor& point_cell, int64_t nz, int64_t nx, int64_t ny) {
  check_floating(depth, "bev_pool: depth");
  check_floating(feat, "bev_pool: feat");
  check_dim(depth, 5, "bev_pool: depth", "B x N x D x fH x fW");
  check_dim(feat, 5, "bev_pool: feat", "B x N x C x fH x fW");
  LSS_HOST_CHECK(depth.scalar_type() == feat.scalar_type(), "bev_pool: depth (", depth.scalar_type(), ") and feat (",
              feat.scalar_type(), ") must have the same dtype; cast one of them");
  check_same_device(depth, feat, "bev_pool: depth", "feat");
  LSS_HOST_CHECK(depth.size(0) == feat.size(0) && depth.size(1) == feat.size(1) && depth.size(3) == feat.size(3) &&
                  depth.size(4) == feat.size(4),
              "bev_pool: depth (B x N x D x fH x fW) ", depth.sizes(), " and feat (B x N x C x fH x fW) ",
              feat.sizes(), " must agree in B, N, fH and fW");
  LSS_HOST_CHECK(nz >= 1 && nx >= 1 && ny >= 1, "bev_pool: grid sizes nz, nx, ny must be >= 1, got ", nz, ", ", nx,
              ", ", ny);
  Shape s{depth.size(0), depth.size(1), depth.size(2), depth.size(3), depth.size(4), feat.size(2), nz, nx, ny};
  check_index(cell_start, cell_start, "cell_start", s.cells() + 1, depth);
  check_index(point_cell, cell_start, "point_cell", s.points(), depth);
  if (sorted_points != nullptr) check_index(*sorted_points, cell_start, "sorted_points", s.points(), depth);
  return s;
}

void check_grad_out(const at::Tensor& grad_out, const at::Tensor& depth, const Shape& s) {
  LSS_HOST_CHECK(grad_out.dim() == 4 && grad_out.size(0) == s.B && grad_out.size(1) == s.nz * s.C &&
                  grad_out.size(2) == s.nx && grad_out.size(3) == s.ny,
              "bev_pool backward: grad_out must be B x (nz*C) x nx x ny = [", s.B, ", ", s.nz * s.C, ", ", s.nx,
              ", ", s.ny, "], got ", grad_out.sizes());
  LSS_HOST_CHECK(grad_out.scalar_type() == depth.scalar_type(), "bev_pool backward: grad_out has dtype ",
              grad_out.scalar_type(), ", expected ", depth.scalar_type(), " (the dtype of depth and feat)");
  check_same_device(grad_out, depth, "bev_pool backward: grad_out", "depth");
}

bool output_channels_last(const at::Tensor& feat) { return feat.size(2) > 1 && feat.stride(2) == 1; }

at::Tensor empty_output(const at::Tensor& depth, const at::Tensor& feat, const Shape& s) {
  const auto format = output_channels_last(feat) ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  return at::empty({s.B, s.nz * s.C, s.nx, s.ny}, depth.options().memory_format(format));
}

at::Tensor feat_channels_last(const at::Tensor& feat) { return feat.permute({0, 1, 3, 4, 2}).contiguous(); }

bool grad_is_channels_last(const at::Tensor& grad_out) {
  return grad_out.is_contiguous(at::MemoryFormat::ChannelsLast) && !grad_out.is_contiguous();
}

GradRows channels_last_rows(const Shape& s) { return {s.nxy() * s.nz * s.C, s.C, s.nz * s.C}; }

GradRows staged_rows(const Shape& s) { return {s.nz * s.nxy() * s.C, s.nxy() * s.C, s.C}; }

PixelStrides pixel_strides(const at::Tensor& t) {
  return {t.stride(0), t.stride(1), t.stride(2), t.stride(3), t.stride(4)};
}

std::tuple<at::Tensor, at::Tensor> empty_grads(const at::Tensor& depth, const at::Tensor& feat, const Shape& s) {
  auto grad_depth = at::empty(depth.sizes(), depth.options().memory_format(at::MemoryFormat::Contiguous));
  const auto options = feat.options().memory_format(at::MemoryFormat::Contiguous);
  auto grad_feat = output_channels_last(feat)
                       ? at::empty({s.B, s.N, s.fH, s.fW, s.C}, options).permute({0, 1, 4, 2, 3})
                       : at::empty({s.B, s.N, s.C, s.fH, s.fW}, options);
  return {grad_depth, grad_feat};
}

}  // namespace bev_pool
}  // namespace lss
