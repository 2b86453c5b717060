// bev_pool CPU kernels: a tile of consecutive cells per task for the forward (every output element written once,
// in the output layout that feat's picks: see bev_pool.h), a gather per feature pixel for the backward (no atomics:
// deterministic; grad_feat in feat's layout, as the CUDA kernels write it).
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <vector>

#include "ops/bev_pool.h"
#include "ops/host_check.h"

namespace lss {
namespace {

using bev_pool::Shape;

constexpr int64_t kTile = 64;  // consecutive cells (along ny) per task

// Every index read from the table is checked where it is read: a FrustumLUT whose fields were replaced past its
// frozen guard reaches the kernel unvalidated, and a bad index must raise instead of reading outside the inputs.
[[noreturn]] C10_NOINLINE void bad_index(const char* field, int64_t position, int64_t value,
                                         const std::string& expected) {
  raise_error(host::message("bev_pool: ", field, "[", position, "] = ", value, ", expected ", expected,
                            "; the FrustumLUT's index tensors were replaced or corrupted: build the table again with "
                            "lss.geometry.FrustumLUT.build (or check one made from tensors with lut.validate()) and "
                            "do not modify its fields"));
}

[[noreturn]] C10_NOINLINE void bad_interval(int64_t cell, int64_t begin, int64_t end, int64_t points) {
  if (begin < 0 || begin > points)
    bad_index("cell_start", cell, begin, host::message("an offset in [0, P] = [0, ", points, "]"));
  if (end < 0 || end > points)
    bad_index("cell_start", cell + 1, end, host::message("an offset in [0, P] = [0, ", points, "]"));
  bad_index("cell_start", cell + 1, end,
            host::message("a value >= cell_start[", cell, "] = ", begin, " (cell_start is non-decreasing)"));
}

// The points of cell c: sorted_points[cell_start[c]:cell_start[c + 1]], inside [0, P).
template <typename index_t>
inline void check_interval(index_t begin, index_t end, int64_t cell, int64_t points) {
  if (C10_UNLIKELY(begin < 0 || begin > end || end > points)) bad_interval(cell, begin, end, points);
}

template <typename index_t>
inline void check_point(index_t p, int64_t k, int64_t points) {
  if (C10_UNLIKELY(p < 0 || p >= points))
    bad_index("sorted_points", k, p, host::message("a point index in [0, P) = [0, ", points, ")"));
}

template <typename scalar_t, typename index_t>
void forward_kernel(const scalar_t* depth, const scalar_t* feat, const index_t* sorted_points,
                    const index_t* cell_start, scalar_t* out, const Shape& s) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t C = s.C, cells = s.cells(), nxy = s.nxy(), points = s.points();
  const index_t dhw = static_cast<index_t>(s.dhw()), hw = static_cast<index_t>(s.hw());
  at::parallel_for(0, ceil_div(cells, kTile), 1, [&](int64_t tile_begin, int64_t tile_end) {
    std::vector<acc_t> acc(kTile * C);
    std::vector<int64_t> base(kTile);
    for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
      const int64_t first = tile * kTile, count = std::min(kTile, cells - first);
      std::fill(acc.begin(), acc.begin() + count * C, acc_t(0));
      for (int64_t t = 0; t < count; ++t) {
        const int64_t cell = first + t, plane = cell / nxy;
        base[t] = plane * C * nxy + (cell - plane * nxy);
        acc_t* a = acc.data() + t * C;
        const index_t begin = cell_start[cell], end = cell_start[cell + 1];
        check_interval(begin, end, cell, points);
        for (index_t k = begin; k < end; ++k) {
          const index_t p = sorted_points[k];
          check_point(p, k, points);
          const acc_t w = static_cast<acc_t>(depth[p]);
          const scalar_t* row = feat + (static_cast<int64_t>(p / dhw) * hw + p % hw) * C;
          for (int64_t c = 0; c < C; ++c) a[c] += w * static_cast<acc_t>(row[c]);
        }
      }
      for (int64_t c = 0; c < C; ++c)
        for (int64_t t = 0; t < count; ++t) out[base[t] + c * nxy] = static_cast<scalar_t>(acc[t * C + c]);
    }
  });
}

// Channels-last output: a cell's C values are one contiguous run of its output row (B x nx x ny x nz*C in memory).
template <typename scalar_t, typename index_t>
void forward_channels_last_kernel(const scalar_t* depth, const scalar_t* feat, const index_t* sorted_points,
                                  const index_t* cell_start, scalar_t* out, const Shape& s) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t C = s.C, cells = s.cells(), nxy = s.nxy(), nz = s.nz, points = s.points();
  const index_t dhw = static_cast<index_t>(s.dhw()), hw = static_cast<index_t>(s.hw());
  at::parallel_for(0, ceil_div(cells, kTile), 1, [&](int64_t tile_begin, int64_t tile_end) {
    std::vector<acc_t> acc(C);
    for (int64_t cell = tile_begin * kTile; cell < std::min(tile_end * kTile, cells); ++cell) {
      const int64_t plane = cell / nxy, b = plane / nz, z = plane - b * nz;
      scalar_t* dst = out + (b * nxy + cell - plane * nxy) * nz * C + z * C;
      std::fill(acc.begin(), acc.end(), acc_t(0));
      const index_t begin = cell_start[cell], end = cell_start[cell + 1];
      check_interval(begin, end, cell, points);
      for (index_t k = begin; k < end; ++k) {
        const index_t p = sorted_points[k];
        check_point(p, k, points);
        const acc_t w = static_cast<acc_t>(depth[p]);
        const scalar_t* row = feat + (static_cast<int64_t>(p / dhw) * hw + p % hw) * C;
        for (int64_t c = 0; c < C; ++c) acc[c] += w * static_cast<acc_t>(row[c]);
      }
      for (int64_t c = 0; c < C; ++c) dst[c] = static_cast<scalar_t>(acc[c]);
    }
  });
}

// Copies grad_out's rows of the non-empty cells into a cells x C buffer (rows of empty cells are never read).
template <typename scalar_t, typename index_t>
void stage_kernel(const scalar_t* grad_out, const index_t* cell_start, scalar_t* staged, const Shape& s) {
  const int64_t C = s.C, cells = s.cells(), nxy = s.nxy();
  at::parallel_for(0, ceil_div(cells, kTile), 1, [&](int64_t tile_begin, int64_t tile_end) {
    for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
      const int64_t first = tile * kTile, count = std::min(kTile, cells - first);
      if (cell_start[first] == cell_start[first + count]) continue;
      for (int64_t t = 0; t < count; ++t) {
        const int64_t cell = first + t;
        if (cell_start[cell + 1] == cell_start[cell]) continue;
        const int64_t plane = cell / nxy, src = plane * C * nxy + (cell - plane * nxy);
        for (int64_t c = 0; c < C; ++c) staged[cell * C + c] = grad_out[src + c * nxy];
      }
    }
  });
}

template <typename scalar_t, typename index_t>
void backward_kernel(const scalar_t* grad_rows, bev_pool::GradRows rows, const scalar_t* depth, const scalar_t* feat,
                     const index_t* point_cell, scalar_t* grad_depth, scalar_t* grad_feat,
                     bev_pool::PixelStrides grad_feat_strides, const Shape& s) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t C = s.C, D = s.D, hw = s.hw(), nxy = s.nxy(), planes = s.nz * nxy, cells = s.cells();
  at::parallel_for(0, s.pixels(), 16, [&](int64_t pixel_begin, int64_t pixel_end) {
    std::vector<acc_t> f(C), acc(C);
    for (int64_t pixel = pixel_begin; pixel < pixel_end; ++pixel) {
      const int64_t bn = pixel / hw, hwi = pixel - bn * hw;
      for (int64_t c = 0; c < C; ++c) f[c] = static_cast<acc_t>(feat[pixel * C + c]);
      std::fill(acc.begin(), acc.end(), acc_t(0));
      for (int64_t d = 0; d < D; ++d) {
        const int64_t p = (bn * D + d) * hw + hwi;
        const int64_t cell = point_cell[p];
        if (C10_UNLIKELY(cell < -1 || cell >= cells))
          bad_index("point_cell", p, cell, host::message("-1 (outside the grid) or a cell in [0, B*nz*nx*ny) = [0, ",
                                                         cells, ")"));
        if (cell < 0) {
          grad_depth[p] = scalar_t(0);
          continue;
        }
        const int64_t b = cell / planes, z = (cell - b * planes) / nxy, ij = cell - b * planes - z * nxy;
        const scalar_t* g = grad_rows + b * rows.batch + z * rows.level + ij * rows.cell;
        const acc_t w = static_cast<acc_t>(depth[p]);
        acc_t dot = 0;
        for (int64_t c = 0; c < C; ++c) {
          const acc_t gc = static_cast<acc_t>(g[c]);
          dot += f[c] * gc;
          acc[c] += w * gc;
        }
        grad_depth[p] = static_cast<scalar_t>(dot);
      }
      const int64_t b = bn / s.N, h = hwi / s.fW;
      scalar_t* gf = grad_feat + grad_feat_strides.at(b, bn - b * s.N, h, hwi - h * s.fW);
      for (int64_t c = 0; c < C; ++c) gf[c * grad_feat_strides.channel] = static_cast<scalar_t>(acc[c]);
    }
  });
}

at::Tensor bev_pool_cpu(const at::Tensor& depth_in, const at::Tensor& feat_in, const at::Tensor& sorted_points,
                        const at::Tensor& cell_start, const at::Tensor& point_cell, int64_t nz, int64_t nx,
                        int64_t ny) {
  check_cpu_tensor(depth_in, "bev_pool: depth");
  const Shape s = bev_pool::check_args(depth_in, feat_in, &sorted_points, cell_start, point_cell, nz, nx, ny);
  auto out = bev_pool::empty_output(depth_in, feat_in, s);
  if (out.numel() == 0) return out;
  const bool channels_last = bev_pool::output_channels_last(feat_in);
  const auto depth = depth_in.contiguous();
  const auto feat = bev_pool::feat_channels_last(feat_in);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, depth.scalar_type(), "bev_pool_cpu", [&] {
    AT_DISPATCH_INDEX_TYPES(cell_start.scalar_type(), "bev_pool_cpu_index", [&] {
      auto kernel = channels_last ? forward_channels_last_kernel<scalar_t, index_t> : forward_kernel<scalar_t, index_t>;
      kernel(depth.data_ptr<scalar_t>(), feat.data_ptr<scalar_t>(), sorted_points.contiguous().data_ptr<index_t>(),
             cell_start.contiguous().data_ptr<index_t>(), out.data_ptr<scalar_t>(), s);
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> bev_pool_backward_cpu(const at::Tensor& grad_out_in, const at::Tensor& depth_in,
                                                         const at::Tensor& feat_in, const at::Tensor& cell_start_in,
                                                         const at::Tensor& point_cell_in, int64_t nz, int64_t nx,
                                                         int64_t ny) {
  check_cpu_tensor(depth_in, "bev_pool: depth");
  const Shape s = bev_pool::check_args(depth_in, feat_in, nullptr, cell_start_in, point_cell_in, nz, nx, ny);
  bev_pool::check_grad_out(grad_out_in, depth_in, s);
  auto [grad_depth, grad_feat] = bev_pool::empty_grads(depth_in, feat_in, s);
  if (s.C == 0) {
    grad_depth.zero_();
    return {grad_depth, grad_feat};
  }
  if (s.pixels() == 0) return {grad_depth, grad_feat};
  const auto depth = depth_in.contiguous();
  const auto feat = bev_pool::feat_channels_last(feat_in);
  const auto cell_start = cell_start_in.contiguous();
  const auto point_cell = point_cell_in.contiguous();
  const bool in_place = bev_pool::grad_is_channels_last(grad_out_in);
  const auto grad_out = in_place ? grad_out_in : grad_out_in.contiguous();
  const auto rows = in_place ? bev_pool::channels_last_rows(s) : bev_pool::staged_rows(s);
  at::Tensor staged = in_place ? grad_out : at::empty({s.cells(), s.C}, grad_out.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, depth.scalar_type(), "bev_pool_backward_cpu", [&] {
    AT_DISPATCH_INDEX_TYPES(cell_start.scalar_type(), "bev_pool_backward_cpu_index", [&] {
      if (!in_place)
        stage_kernel<scalar_t, index_t>(grad_out.data_ptr<scalar_t>(), cell_start.data_ptr<index_t>(),
                                        staged.data_ptr<scalar_t>(), s);
      backward_kernel<scalar_t, index_t>(staged.data_ptr<scalar_t>(), rows, depth.data_ptr<scalar_t>(),
                                         feat.data_ptr<scalar_t>(), point_cell.data_ptr<index_t>(),
                                         grad_depth.data_ptr<scalar_t>(), grad_feat.data_ptr<scalar_t>(),
                                         bev_pool::pixel_strides(grad_feat), s);
    });
  });
  return {grad_depth, grad_feat};
}

}  // namespace
}  // namespace lss

TORCH_LIBRARY_IMPL(lss, CPU, m) {
  m.impl("bev_pool", &lss::bev_pool_cpu);
  m.impl("_bev_pool_backward", &lss::bev_pool_backward_cpu);
}
