// bev_pool CUDA kernels.
//
// The output layout follows feat's (bev_pool::output_channels_last, see bev_pool.h): channels-last feat gives a
// channels-last output (B x nx x ny x nz*C in memory), any other feat an NCHW-contiguous one. Either way every
// output element is written once by the forward (empty cells write 0): no memset, no atomics, no permute after.
//
// Forward, channels-last output: one warp per cell, kCellWarps consecutive cells per block. Lanes over channels,
// V consecutive channels per lane (vector loads and stores when C and the pointers allow): the warp sums the
// depth-weighted feature rows of its cell's points in registers and writes the cell's C-value slice of its output
// row directly. The lanes first fetch up to 32 of the cell's point indices and depths at once, then broadcast them,
// so that the feature-row loads of a cell's points are independent and overlap.
//
// Forward, NCHW output: one block per tile of kTile consecutive cells (consecutive along ny). Each warp sums its
// cells' rows the same way into shared memory; the block then writes the tile channel by channel, kTile consecutive
// output elements per channel. A tile without points writes its zeros straight away. Output offsets are computed
// once per cell (no 64-bit division per element).
//
// Backward, gather-style without atomics (deterministic):
//  1. stage: grad_out rows of the non-empty cells are copied to a cells x C buffer (coalesced reads along ny,
//     coalesced writes along C); skipped when grad_out is channels-last (as it is downstream of a channels-last
//     output): its rows are read in place.
//  2. one block per feature pixel: its warps share the pixel's D points; each warp fetches its points' cells and
//     depths at once, then for point p in cell c: grad_depth[p] = dot(feat[pixel], G[c]) and
//     grad_feat[pixel] = sum_p depth[p] * G[c].
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <limits>
#include <string>

#include "ops/bev_pool.h"

namespace lss {
namespace {

using bev_pool::Shape;

constexpr int kTile = 32;            // consecutive cells per block
constexpr int kChunk = 128;          // channels per pass over a tile
constexpr int kPerLane = kChunk / 32;
constexpr int kTileThreads = 256;
constexpr int kTileWarps = kTileThreads / 32;
constexpr int kMaxPixelWarps = 8;    // warps sharing one pixel's D points in the backward
constexpr size_t kMaxSharedBytes = 48 * 1024;
constexpr int kCellWarps = 8;        // cells per block of the channels-last forward, one warp each
constexpr int kCellThreads = kCellWarps * 32;
constexpr int kLaneVectors = 2;      // vectors per lane per pass over a cell's points (channels-last forward)
constexpr size_t kMaxVectorBytes = 16;

// V consecutive channels moved as one load or store.
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Per tile: the first point of each cell (kTile + 1 entries) and where channel 0 of each cell lives in the output
// (-1 past the last cell). Returns whether the tile holds any point.
template <typename index_t>
__device__ __forceinline__ bool load_tile(const index_t* __restrict__ cell_start, int64_t first, int64_t cells,
                                          int64_t nxy, int64_t C, index_t* start, int64_t* base) {
  if (threadIdx.x <= kTile) {
    const int64_t cell = first + threadIdx.x < cells ? first + threadIdx.x : cells;
    start[threadIdx.x] = cell_start[cell];
    if (threadIdx.x < kTile) {
      const int64_t plane = cell / nxy;
      base[threadIdx.x] = first + threadIdx.x < cells ? plane * C * nxy + (cell - plane * nxy) : -1;
    }
  }
  __syncthreads();
  return start[0] != start[kTile];
}

template <typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kTileThreads)
    bev_pool_forward_kernel(const scalar_t* __restrict__ depth, const scalar_t* __restrict__ feat,
                            const index_t* __restrict__ sorted_points, const index_t* __restrict__ cell_start,
                            scalar_t* __restrict__ out, int64_t cells, int64_t nxy, int64_t C, index_t dhw,
                            index_t hw) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t tile[kTile][kChunk + 1];  // +1: the channel-major write-out reads without bank conflicts
  __shared__ index_t start[kTile + 1];
  __shared__ int64_t base[kTile];
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kTile;
  if (!load_tile(cell_start, first, cells, nxy, C, start, base)) {
    for (int64_t e = threadIdx.x; e < C * kTile; e += kTileThreads) {
      const int t = static_cast<int>(e % kTile);
      if (base[t] >= 0) out[base[t] + (e / kTile) * nxy] = scalar_t(0);
    }
    return;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t c0 = 0; c0 < C; c0 += kChunk) {
    for (int t = warp; t < kTile; t += kTileWarps) {
      acc_t acc[kPerLane];
#pragma unroll
      for (int r = 0; r < kPerLane; ++r) acc[r] = acc_t(0);
      const index_t end = start[t + 1];
      for (index_t k0 = start[t]; k0 < end; k0 += 32) {
        const int n = static_cast<int>(end - k0 < 32 ? end - k0 : 32);
        acc_t my_w = acc_t(0);
        int64_t my_row = 0;
        if (lane < n) {  // one round trip for up to 32 points: indices, depths and row offsets
          const index_t p = sorted_points[k0 + lane];
          my_w = static_cast<acc_t>(depth[p]);
          my_row = static_cast<int64_t>((p / dhw) * hw + p % hw) * C + c0;
        }
#pragma unroll 4
        for (int j = 0; j < n; ++j) {
          const acc_t w = __shfl_sync(0xffffffffu, my_w, j);
          const scalar_t* row = feat + __shfl_sync(0xffffffffu, my_row, j);
#pragma unroll
          for (int r = 0; r < kPerLane; ++r) {
            const int c = lane + 32 * r;
            if (c0 + c < C) acc[r] += w * static_cast<acc_t>(row[c]);
          }
        }
      }
#pragma unroll
      for (int r = 0; r < kPerLane; ++r) tile[t][lane + 32 * r] = acc[r];
    }
    __syncthreads();
    const int channels = static_cast<int>(C - c0 < kChunk ? C - c0 : kChunk);
    for (int e = threadIdx.x; e < channels * kTile; e += kTileThreads) {
      const int t = e % kTile, ch = e / kTile;
      if (base[t] >= 0) out[base[t] + (c0 + ch) * nxy] = static_cast<scalar_t>(tile[t][ch]);
    }
    __syncthreads();
  }
}

// Channels-last output: the warp of cell (b, z, i, j) writes out[((b*nx + i)*ny + j)*nz*C + z*C + ch], ch < C.
// feat, out and C are aligned to V elements (vector_width).
template <typename scalar_t, typename index_t, int V>
__global__ void __launch_bounds__(kCellThreads)
    bev_pool_forward_channels_last_kernel(const scalar_t* __restrict__ depth, const scalar_t* __restrict__ feat,
                                          const index_t* __restrict__ sorted_points,
                                          const index_t* __restrict__ cell_start, scalar_t* __restrict__ out,
                                          int64_t cells, int64_t nxy, int64_t nz, int64_t C, index_t dhw,
                                          index_t hw) {
  using acc_t = at::opmath_type<scalar_t>;
  using vec_t = Vec<scalar_t, V>;
  constexpr int kPass = 32 * V * kLaneVectors;  // channels per pass over the cell's points
  __shared__ index_t start[kCellWarps + 1];
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kCellWarps;
  if (threadIdx.x <= kCellWarps) {
    start[threadIdx.x] = cell_start[first + threadIdx.x < cells ? first + threadIdx.x : cells];
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t cell = first + warp;
  if (cell >= cells) return;  // the whole warp: no shuffles or barriers follow for it
  const int64_t plane = cell / nxy, b = plane / nz;  // plane = b * nz + z
  scalar_t* dst = out + (b * nxy + (cell - plane * nxy)) * nz * C + (plane - b * nz) * C;
  const index_t begin = start[warp], end = start[warp + 1];
  for (int64_t c0 = 0; c0 < C; c0 += kPass) {
    acc_t acc[kLaneVectors][V];
#pragma unroll
    for (int g = 0; g < kLaneVectors; ++g)
#pragma unroll
      for (int v = 0; v < V; ++v) acc[g][v] = acc_t(0);
    for (index_t k0 = begin; k0 < end; k0 += 32) {
      const int n = static_cast<int>(end - k0 < 32 ? end - k0 : 32);
      acc_t my_w = acc_t(0);
      int64_t my_row = 0;
      if (lane < n) {  // one round trip for up to 32 points: indices, depths and row offsets
        const index_t p = sorted_points[k0 + lane];
        my_w = static_cast<acc_t>(depth[p]);
        my_row = static_cast<int64_t>((p / dhw) * hw + p % hw) * C + c0;
      }
#pragma unroll 4
      for (int j = 0; j < n; ++j) {
        const acc_t w = __shfl_sync(0xffffffffu, my_w, j);
        const scalar_t* row = feat + __shfl_sync(0xffffffffu, my_row, j);
#pragma unroll
        for (int g = 0; g < kLaneVectors; ++g) {
          const int c = (lane + 32 * g) * V;
          if (c0 + c < C) {
            const vec_t x = *reinterpret_cast<const vec_t*>(row + c);
#pragma unroll
            for (int v = 0; v < V; ++v) acc[g][v] += w * static_cast<acc_t>(x.v[v]);
          }
        }
      }
    }
#pragma unroll
    for (int g = 0; g < kLaneVectors; ++g) {
      const int c = (lane + 32 * g) * V;
      if (c0 + c < C) {
        vec_t y;
#pragma unroll
        for (int v = 0; v < V; ++v) y.v[v] = static_cast<scalar_t>(acc[g][v]);
        *reinterpret_cast<vec_t*>(dst + c0 + c) = y;
      }
    }
  }
}

// Channels per vector for the channels-last forward: the widest of 4, 2, 1 that divides C, fits kMaxVectorBytes,
// matches the alignment of feat and out, and still gives every lane of a warp a vector (32 * V <= C).
template <typename scalar_t>
int vector_width(int64_t C, const void* feat, const void* out) {
  for (int v : {4, 2}) {
    const size_t bytes = v * sizeof(scalar_t);
    if (bytes <= kMaxVectorBytes && C % v == 0 && 32 * v <= C && reinterpret_cast<uintptr_t>(feat) % bytes == 0 &&
        reinterpret_cast<uintptr_t>(out) % bytes == 0) {
      return v;
    }
  }
  return 1;
}

template <typename scalar_t, typename index_t, int V>
void launch_forward_channels_last(const scalar_t* depth, const scalar_t* feat, const index_t* sorted_points,
                                  const index_t* cell_start, scalar_t* out, const Shape& s, cudaStream_t stream) {
  const int64_t blocks = ceil_div(s.cells(), kCellWarps);
  LSS_CHECK(blocks <= std::numeric_limits<int32_t>::max(),
            "bev_pool: " + std::to_string(s.cells()) +
                " cells exceed the CUDA grid limit; use a smaller batch or grid");
  bev_pool_forward_channels_last_kernel<scalar_t, index_t, V>
      <<<static_cast<unsigned>(blocks), kCellThreads, 0, stream>>>(
          depth, feat, sorted_points, cell_start, out, s.cells(), s.nxy(), s.nz, s.C,
          static_cast<index_t>(s.dhw()), static_cast<index_t>(s.hw()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kTileThreads)
    bev_pool_stage_kernel(const scalar_t* __restrict__ grad_out, const index_t* __restrict__ cell_start,
                          scalar_t* __restrict__ staged, int64_t cells, int64_t nxy, int64_t C) {
  __shared__ scalar_t tile[kTile][kChunk + 1];
  __shared__ index_t start[kTile + 1];
  __shared__ int64_t base[kTile];
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kTile;
  if (!load_tile(cell_start, first, cells, nxy, C, start, base)) return;  // no points: rows never read
  for (int64_t c0 = 0; c0 < C; c0 += kChunk) {
    const int channels = static_cast<int>(C - c0 < kChunk ? C - c0 : kChunk);
    for (int e = threadIdx.x; e < channels * kTile; e += kTileThreads) {
      const int t = e % kTile, ch = e / kTile;
      if (start[t + 1] > start[t]) tile[t][ch] = grad_out[base[t] + (c0 + ch) * nxy];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < channels * kTile; e += kTileThreads) {
      const int ch = e % channels, t = e / channels;
      if (start[t + 1] > start[t]) staged[(first + t) * C + c0 + ch] = tile[t][ch];
    }
    __syncthreads();
  }
}

// kPacked: the cells' rows lie back to back (row of cell c at c * C), so c need not be decomposed into (b, z, ij).
template <bool kPacked>
__device__ __forceinline__ int64_t grad_row(int64_t cell, const bev_pool::GradRows& rows, int64_t nxy,
                                            int64_t planes) {
  if (kPacked) return cell * rows.cell;
  const int64_t b = cell / planes, z = (cell - b * planes) / nxy, ij = cell - b * planes - z * nxy;
  return b * rows.batch + z * rows.level + ij * rows.cell;
}

template <typename scalar_t, typename index_t, bool kPacked>
__global__ void bev_pool_backward_kernel(const scalar_t* __restrict__ grad_rows, bev_pool::GradRows rows,
                                         const scalar_t* __restrict__ depth, const scalar_t* __restrict__ feat,
                                         const index_t* __restrict__ point_cell, scalar_t* __restrict__ grad_depth,
                                         scalar_t* __restrict__ grad_feat, int64_t C, int64_t D, int64_t hw,
                                         int64_t nxy, int64_t planes) {
  using acc_t = at::opmath_type<scalar_t>;
  extern __shared__ __align__(16) unsigned char shared_raw[];
  acc_t* feat_row = reinterpret_cast<acc_t*>(shared_raw);  // C values of this pixel
  acc_t* acc = feat_row + C;                                // warps x C partial grad_feat
  const int64_t pixel = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) feat_row[c] = static_cast<acc_t>(feat[pixel * C + c]);
  for (int64_t c = lane; c < C; c += 32) acc[warp * C + c] = acc_t(0);
  __syncthreads();
  const int64_t bn = pixel / hw, hwi = pixel - bn * hw;
  const int64_t first_point = bn * D * hw + hwi;  // point of depth bin d: first_point + d * hw
  for (int64_t d0 = warp; d0 < D; d0 += 32 * warps) {
    // one round trip for up to 32 of this warp's points: lane j holds bin d0 + j * warps
    const int64_t my_d = d0 + static_cast<int64_t>(lane) * warps;
    int64_t my_cell = -1;
    acc_t my_w = acc_t(0);
    if (my_d < D) {
      const int64_t p = first_point + my_d * hw;
      my_cell = point_cell[p];
      my_w = static_cast<acc_t>(depth[p]);
    }
    const int64_t n = (D - d0 + warps - 1) / warps < 32 ? (D - d0 + warps - 1) / warps : 32;
#pragma unroll 2
    for (int j = 0; j < n; ++j) {
      const int64_t cell = __shfl_sync(0xffffffffu, my_cell, j);
      const acc_t w = __shfl_sync(0xffffffffu, my_w, j);
      const int64_t p = first_point + (d0 + static_cast<int64_t>(j) * warps) * hw;
      if (cell < 0) {  // the same for every lane: the branch is warp-uniform
        if (lane == 0) grad_depth[p] = scalar_t(0);
        continue;
      }
      const scalar_t* g = grad_rows + grad_row<kPacked>(cell, rows, nxy, planes);
      acc_t dot = acc_t(0);
      for (int64_t c = lane; c < C; c += 32) {
        const acc_t gc = static_cast<acc_t>(g[c]);
        dot += feat_row[c] * gc;
        acc[warp * C + c] += w * gc;
      }
      dot = warp_sum(dot);
      if (lane == 0) grad_depth[p] = static_cast<scalar_t>(dot);
    }
  }
  __syncthreads();
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    acc_t sum = acc_t(0);
    for (int w = 0; w < warps; ++w) sum += acc[w * C + c];
    grad_feat[pixel * C + c] = static_cast<scalar_t>(sum);
  }
}

at::Tensor bev_pool_cuda(const at::Tensor& depth_in, const at::Tensor& feat_in, const at::Tensor& sorted_points_in,
                         const at::Tensor& cell_start_in, const at::Tensor& point_cell, int64_t nz, int64_t nx,
                         int64_t ny) {
  check_cuda_tensor(depth_in, "bev_pool: depth");
  const Shape s = bev_pool::check_args(depth_in, feat_in, &sorted_points_in, cell_start_in, point_cell, nz, nx, ny);
  c10::cuda::CUDAGuard guard(depth_in.device());
  auto out = bev_pool::empty_output(depth_in, feat_in, s);
  if (out.numel() == 0) return out;
  const bool channels_last = bev_pool::output_channels_last(feat_in);
  const auto depth = depth_in.contiguous();
  const auto feat = bev_pool::feat_channels_last(feat_in);
  const auto sorted_points = sorted_points_in.contiguous();
  const auto cell_start = cell_start_in.contiguous();
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, depth.scalar_type(), "bev_pool_cuda", [&] {
    AT_DISPATCH_INDEX_TYPES(cell_start.scalar_type(), "bev_pool_cuda_index", [&] {
      if (channels_last) {
        const scalar_t* feat_ptr = feat.data_ptr<scalar_t>();
        scalar_t* out_ptr = out.data_ptr<scalar_t>();
        const int width = vector_width<scalar_t>(s.C, feat_ptr, out_ptr);
        auto launch = width == 4   ? launch_forward_channels_last<scalar_t, index_t, 4>
                      : width == 2 ? launch_forward_channels_last<scalar_t, index_t, 2>
                                   : launch_forward_channels_last<scalar_t, index_t, 1>;
        launch(depth.data_ptr<scalar_t>(), feat_ptr, sorted_points.data_ptr<index_t>(),
               cell_start.data_ptr<index_t>(), out_ptr, s, stream);
        return;
      }
      const int64_t blocks = ceil_div(s.cells(), kTile);
      LSS_CHECK(blocks <= std::numeric_limits<int32_t>::max(),
                "bev_pool: " + std::to_string(s.cells()) +
                    " cells exceed the CUDA grid limit; use a smaller batch or grid");
      bev_pool_forward_kernel<scalar_t, index_t><<<static_cast<unsigned>(blocks), kTileThreads, 0, stream>>>(
          depth.data_ptr<scalar_t>(), feat.data_ptr<scalar_t>(), sorted_points.data_ptr<index_t>(),
          cell_start.data_ptr<index_t>(), out.data_ptr<scalar_t>(), s.cells(), s.nxy(), s.C,
          static_cast<index_t>(s.dhw()), static_cast<index_t>(s.hw()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> bev_pool_backward_cuda(const at::Tensor& grad_out_in, const at::Tensor& depth_in,
                                                          const at::Tensor& feat_in, const at::Tensor& cell_start_in,
                                                          const at::Tensor& point_cell_in, int64_t nz, int64_t nx,
                                                          int64_t ny) {
  check_cuda_tensor(depth_in, "bev_pool: depth");
  const Shape s = bev_pool::check_args(depth_in, feat_in, nullptr, cell_start_in, point_cell_in, nz, nx, ny);
  bev_pool::check_grad_out(grad_out_in, depth_in, s);
  c10::cuda::CUDAGuard guard(depth_in.device());
  auto [grad_depth, grad_feat] = bev_pool::empty_grads(depth_in, feat_in, s);
  auto grad_feat_view = grad_feat.permute({0, 1, 4, 2, 3});
  if (s.C == 0) {
    grad_depth.zero_();
    return {grad_depth, grad_feat_view};
  }
  if (s.pixels() == 0) return {grad_depth, grad_feat_view};
  LSS_CHECK(s.pixels() <= std::numeric_limits<int32_t>::max(),
            "bev_pool: " + std::to_string(s.pixels()) +
                " feature pixels exceed the CUDA grid limit; use a smaller batch");
  const auto depth = depth_in.contiguous();
  const auto feat = bev_pool::feat_channels_last(feat_in);
  const auto cell_start = cell_start_in.contiguous();
  const auto point_cell = point_cell_in.contiguous();
  const bool in_place = bev_pool::grad_is_channels_last(grad_out_in);
  const auto grad_out = in_place ? grad_out_in : grad_out_in.contiguous();
  const auto rows = in_place ? bev_pool::channels_last_rows(s) : bev_pool::staged_rows(s);
  at::Tensor staged = in_place ? grad_out : at::empty({s.cells(), s.C}, grad_out.options());
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, depth.scalar_type(), "bev_pool_backward_cuda", [&] {
    AT_DISPATCH_INDEX_TYPES(cell_start.scalar_type(), "bev_pool_backward_cuda_index", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      if (!in_place) {
        const int64_t blocks = ceil_div(s.cells(), kTile);
        bev_pool_stage_kernel<scalar_t, index_t><<<static_cast<unsigned>(blocks), kTileThreads, 0, stream>>>(
            grad_out.data_ptr<scalar_t>(), cell_start.data_ptr<index_t>(), staged.data_ptr<scalar_t>(), s.cells(),
            s.nxy(), s.C);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      const size_t row_bytes = static_cast<size_t>(s.C) * sizeof(acc_t);
      LSS_CHECK(2 * row_bytes <= kMaxSharedBytes,
                "bev_pool backward: C = " + std::to_string(s.C) + " channels do not fit in shared memory (at most " +
                    std::to_string(kMaxSharedBytes / (2 * sizeof(acc_t))) +
                    " for this dtype); split the channels into several bev_pool calls");
      int warps = static_cast<int>(std::min<int64_t>(kMaxPixelWarps, std::max<int64_t>(1, s.D)));
      while ((warps + 1) * row_bytes > kMaxSharedBytes) --warps;
      // staged rows, or channels-last grad_out with one height level: row of cell c at c * C
      const bool packed = rows.cell == s.C && rows.batch == s.nz * s.nxy() * s.C &&
                          (s.nz == 1 || rows.level == s.nxy() * s.C);
      auto kernel = packed ? bev_pool_backward_kernel<scalar_t, index_t, true>
                           : bev_pool_backward_kernel<scalar_t, index_t, false>;
      kernel<<<static_cast<unsigned>(s.pixels()), warps * 32, (warps + 1) * row_bytes, stream>>>(
          staged.data_ptr<scalar_t>(), rows, depth.data_ptr<scalar_t>(), feat.data_ptr<scalar_t>(),
          point_cell.data_ptr<index_t>(), grad_depth.data_ptr<scalar_t>(), grad_feat.data_ptr<scalar_t>(), s.C, s.D,
          s.hw(), s.nxy(), s.nz * s.nxy());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {grad_depth, grad_feat_view};
}

}  // namespace
}  // namespace lss

TORCH_LIBRARY_IMPL(lss, CUDA, m) {
  m.impl("bev_pool", &lss::bev_pool_cuda);
  m.impl("_bev_pool_backward", &lss::bev_pool_backward_cuda);
}
