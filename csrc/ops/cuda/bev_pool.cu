// bev_pool CUDA kernels.
//
// The output layout follows feat's (bev_pool::output_channels_last, see bev_pool.h): channels-last feat gives a
// channels-last output (B x nx x ny x nz*C in memory), any other feat an NCHW-contiguous one. Either way every
// output element is written once by the forward (empty cells write 0): no memset, no atomics, no permute after.
//
// Forward, NCHW output: one block per tile of kTile consecutive cells (consecutive along ny). Each warp sums its
// cells' rows in registers, lanes over channels (a point's feature row read as one coalesced run), into shared
// memory; the block then writes the tile channel by channel, kTile consecutive output elements per channel. A tile
// without points writes its zeros straight away. (The cell kernel's NCHW mapping measured slower: it splits rows.)
//
// The cell kernels (channels-last forward and stage) run one thread per (cell, group of kGroup consecutive
// channels), with no shared memory and no barrier, so that many cells' loads are in flight on every SM:
//  - channels-last forward: consecutive threads take consecutive groups of a cell, then the next cell, so that a
//    warp reads whole feature rows and writes contiguous runs of output rows. A thread fetches the indices and
//    depths of kPointUnroll of its cell's points at once, then their kGroup-channel feature slices (one 32-byte
//    sector for float32), so that those loads overlap instead of forming a chain per point;
//  - stage: consecutive threads take consecutive cells (the group comes from blockIdx.y), so each of a warp's
//    kGroup channel loads covers 32 consecutive grad_out elements.
//
// Backward, gather-style without atomics (deterministic):
//  1. stage: grad_out rows of the non-empty cells are copied to a cells x C buffer (cell kernel, NCHW mapping:
//     coalesced reads along ny, one kGroup-channel slice of a row written per thread); skipped when grad_out is
//     channels-last (as it is downstream of a channels-last output): its rows are read in place.
//  2. one warp per feature pixel: lanes over (depth phase, channel group); a lane walks the pixel's points of its
//     phase, kPointUnroll at a time: for point p in cell c, grad_depth[p] = dot(feat[pixel], G[c]) (reduced over
//     the lanes of the phase) and grad_feat[pixel] += depth[p] * G[c] (reduced over the phases at the end).
//     feat is read and grad_feat written with their own strides (grad_feat follows feat's layout): no copies.
//
// Every index read from the table is checked before it is used (a FrustumLUT whose fields were replaced past its
// frozen guard reaches the kernels unvalidated): a bad one fails a device-side assertion and is never followed (an
// offset is clamped into [0, P], a point or a cell is skipped), so nothing outside the inputs is read or written
// even where device assertions are compiled out.
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <limits>
#include <string>

#include "ops/bev_pool.h"

namespace lss {
namespace {

using bev_pool::PixelStrides;
using bev_pool::Shape;

constexpr int kTile = 32;           // consecutive cells per block of the NCHW forward
constexpr int kChunk = 128;         // channels per pass over a tile
constexpr int kPerLane = kChunk / 32;
constexpr int kTileThreads = 256;
constexpr int kTileWarps = kTileThreads / 32;
constexpr int kGroup = 8;           // channels per thread of the cell kernels: one 32-byte sector of float32
constexpr int kCellThreads = 128;   // threads per block of the cell kernels
constexpr int kPointUnroll = 4;     // points whose loads one thread has in flight at once
constexpr int kPixelWarps = 4;      // pixels (one warp each) per block of the backward
constexpr size_t kMaxVectorBytes = 16;

// V consecutive channels moved as one load or store.
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

template <typename T, int V>
__device__ __forceinline__ Vec<T, V> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, V>*>(p);
}

// cell_start[c], clamped into [0, P]: the points of every cell then lie inside sorted_points.
template <typename index_t>
__device__ __forceinline__ index_t checked_offset(index_t offset, int64_t points) {
  if (offset >= 0 && offset <= points) return offset;
  CUDA_KERNEL_ASSERT_MSG(false,
                         "bev_pool: cell_start holds an offset outside [0, P]: the FrustumLUT's index tensors were "
                         "replaced or corrupted; build the table again with lss.geometry.FrustumLUT.build and do "
                         "not modify its fields");
  return offset < 0 ? index_t(0) : static_cast<index_t>(points);
}

// Whether sorted_points' entry p is a point of depth (in [0, P)).
template <typename index_t>
__device__ __forceinline__ bool valid_point(index_t p, int64_t points) {
  if (p >= 0 && p < points) return true;
  CUDA_KERNEL_ASSERT_MSG(false,
                         "bev_pool: sorted_points holds an index outside [0, P): the FrustumLUT's index tensors "
                         "were replaced or corrupted; build the table again with lss.geometry.FrustumLUT.build and "
                         "do not modify its fields");
  return false;
}

// point_cell's entry as a cell in [0, cells), or -1 (outside the grid, or a bad entry: skipped).
template <typename index_t>
__device__ __forceinline__ int64_t checked_cell(index_t cell, int64_t cells) {
  if (cell >= -1 && cell < cells) return cell;
  CUDA_KERNEL_ASSERT_MSG(false,
                         "bev_pool: point_cell holds a value outside -1 and [0, B*nz*nx*ny): the FrustumLUT's index "
                         "tensors were replaced or corrupted; build the table again with "
                         "lss.geometry.FrustumLUT.build and do not modify its fields");
  return -1;
}

// Pointers and sizes of the cell kernels' grid: cell and channel group of this thread, or false past the end.
template <bool kChannelsLast>
__device__ __forceinline__ bool cell_and_group(int64_t cells, int groups, int64_t* cell, int* group) {
  if (kChannelsLast) {
    const int64_t t = static_cast<int64_t>(blockIdx.x) * kCellThreads + threadIdx.x;
    *cell = t / groups;
    *group = static_cast<int>(t - *cell * groups);
  } else {
    *cell = static_cast<int64_t>(blockIdx.x) * kCellThreads + threadIdx.x;
    *group = static_cast<int>(blockIdx.y);
  }
  return *cell < cells;
}

template <bool kChannelsLast>
dim3 cell_grid(int64_t cells, int groups) {
  const int64_t blocks = kChannelsLast ? ceil_div(cells * groups, kCellThreads) : ceil_div(cells, kCellThreads);
  LSS_CHECK(blocks <= std::numeric_limits<int32_t>::max() && groups <= 65535,
            "bev_pool: " + std::to_string(cells) + " cells x " + std::to_string(groups) +
                " channel groups exceed the CUDA grid limit; use a smaller batch, grid or channel count");
  return kChannelsLast ? dim3(static_cast<unsigned>(blocks)) : dim3(static_cast<unsigned>(blocks), groups);
}

// out[b, z*C + ch, i, j] for cell (b, z, i, j) = c: NCHW at ((b*nz + z)*C + ch)*nxy + ij, channels-last at
// ((b*nxy + ij)*nz + z)*C + ch.
template <bool kChannelsLast>
__device__ __forceinline__ int64_t cell_offset(int64_t cell, int64_t nxy, int64_t nz, int64_t C) {
  const int64_t plane = cell / nxy, ij = cell - plane * nxy;  // plane = b * nz + z
  if (!kChannelsLast) return plane * C * nxy + ij;
  const int64_t b = plane / nz;
  return (b * nxy + ij) * nz * C + (plane - b * nz) * C;
}

// Per tile: the first point of each cell (kTile + 1 entries) and where channel 0 of each cell lives in the output
// (-1 past the last cell). Returns whether the tile holds any point.
template <typename index_t>
__device__ __forceinline__ bool load_tile(const index_t* __restrict__ cell_start, int64_t first, int64_t cells,
                                          int64_t points, int64_t nxy, int64_t C, index_t* start, int64_t* base) {
  if (threadIdx.x <= kTile) {
    const int64_t cell = first + threadIdx.x < cells ? first + threadIdx.x : cells;
    start[threadIdx.x] = checked_offset(cell_start[cell], points);
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
                            scalar_t* __restrict__ out, int64_t cells, int64_t points, int64_t nxy, int64_t C,
                            index_t dhw, index_t hw) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t tile[kTile][kChunk + 1];  // +1: the channel-major write-out reads without bank conflicts
  __shared__ index_t start[kTile + 1];
  __shared__ int64_t base[kTile];
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kTile;
  if (!load_tile(cell_start, first, cells, points, nxy, C, start, base)) {
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
          if (valid_point(p, points)) {
            my_w = static_cast<acc_t>(depth[p]);
            my_row = static_cast<int64_t>((p / dhw) * hw + p % hw) * C;
          }
          my_row += c0;  // a bad point: weight 0 on the first pixel's row (P >= 1 here)
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

// Channels-last output. feat is channels-last (B x N x fH x fW x C, contiguous); feat, out and C are aligned to V
// elements when V > 1.
template <typename scalar_t, typename index_t, int V>
__global__ void __launch_bounds__(kCellThreads)
    bev_pool_forward_channels_last_kernel(const scalar_t* __restrict__ depth, const scalar_t* __restrict__ feat,
                                          const index_t* __restrict__ sorted_points,
                                          const index_t* __restrict__ cell_start, scalar_t* __restrict__ out,
                                          int64_t cells, int64_t points, int groups, int64_t nxy, int64_t nz,
                                          int64_t C, index_t dhw, index_t hw) {
  using acc_t = at::opmath_type<scalar_t>;
  using vec_t = Vec<scalar_t, V>;
  constexpr int kVectors = kGroup / V;
  int64_t cell;
  int group;
  if (!cell_and_group<true>(cells, groups, &cell, &group)) return;
  const int64_t c0 = static_cast<int64_t>(group) * kGroup;
  acc_t acc[kGroup];
#pragma unroll
  for (int r = 0; r < kGroup; ++r) acc[r] = acc_t(0);
  const index_t begin = checked_offset(cell_start[cell], points);
  const index_t end = checked_offset(cell_start[cell + 1], points);
  for (index_t k0 = begin; k0 < end; k0 += kPointUnroll) {
    acc_t w[kPointUnroll];
    const scalar_t* row[kPointUnroll];
#pragma unroll
    for (int u = 0; u < kPointUnroll; ++u) {
      w[u] = acc_t(0);
      row[u] = feat;  // past the end or a bad point: weight 0 on the first pixel's row (P >= 1 here)
      if (k0 + u < end) {
        const index_t p = sorted_points[k0 + u];
        if (!valid_point(p, points)) continue;
        w[u] = static_cast<acc_t>(depth[p]);
        row[u] = feat + static_cast<int64_t>((p / dhw) * hw + p % hw) * C + c0;
      }
    }
    vec_t x[kPointUnroll][kVectors];
#pragma unroll
    for (int u = 0; u < kPointUnroll; ++u)
#pragma unroll
      for (int i = 0; i < kVectors; ++i)
        if (k0 + u < end && c0 + i * V < C) x[u][i] = load_vec<scalar_t, V>(row[u] + i * V);
#pragma unroll
    for (int u = 0; u < kPointUnroll; ++u)
#pragma unroll
      for (int i = 0; i < kVectors; ++i)
        if (k0 + u < end && c0 + i * V < C)
#pragma unroll
          for (int v = 0; v < V; ++v) acc[i * V + v] += w[u] * static_cast<acc_t>(x[u][i].v[v]);
  }
  scalar_t* dst = out + cell_offset<true>(cell, nxy, nz, C);
#pragma unroll
  for (int i = 0; i < kVectors; ++i) {
    if (c0 + i * V < C) {
      vec_t y;
#pragma unroll
      for (int v = 0; v < V; ++v) y.v[v] = static_cast<scalar_t>(acc[i * V + v]);
      *reinterpret_cast<vec_t*>(dst + c0 + i * V) = y;
    }
  }
}

// Channels per vector: 16 or 8 bytes (2 to kGroup channels) where that divides C and matches the alignment of the
// given pointers, else one channel.
template <typename scalar_t>
int vector_width(int64_t C, std::initializer_list<const void*> pointers) {
  for (size_t bytes = kMaxVectorBytes; bytes >= kMaxVectorBytes / 2; bytes /= 2) {
    const int v = static_cast<int>(bytes / sizeof(scalar_t));
    if (v < 2 || v > kGroup || C % v != 0) continue;
    bool aligned = true;
    for (const void* p : pointers) aligned = aligned && reinterpret_cast<uintptr_t>(p) % bytes == 0;
    if (aligned) return v;
  }
  return 1;
}

// Calls f(std::integral_constant<int, V>) for the V that vector_width picked (the instantiated widths: 16 bytes,
// 8 bytes and one channel).
template <typename scalar_t, typename F>
void with_vector_width(int width, F&& f) {
  constexpr int kWide = kMaxVectorBytes / sizeof(scalar_t) < kGroup ? kMaxVectorBytes / sizeof(scalar_t) : kGroup;
  constexpr int kHalf = kWide / 2 > 1 ? kWide / 2 : 1;
  if (width == kWide) return f(std::integral_constant<int, kWide>());
  if (width == kHalf) return f(std::integral_constant<int, kHalf>());
  f(std::integral_constant<int, 1>());
}

template <typename scalar_t, typename index_t>
void launch_forward_channels_last(const scalar_t* depth, const scalar_t* feat, const index_t* sorted_points,
                                  const index_t* cell_start, scalar_t* out, const Shape& s, cudaStream_t stream) {
  const int groups = static_cast<int>(ceil_div(s.C, kGroup));
  const dim3 grid = cell_grid<true>(s.cells(), groups);
  with_vector_width<scalar_t>(vector_width<scalar_t>(s.C, {feat, out}), [&](auto v) {
    bev_pool_forward_channels_last_kernel<scalar_t, index_t, decltype(v)::value><<<grid, kCellThreads, 0, stream>>>(
        depth, feat, sorted_points, cell_start, out, s.cells(), s.points(), groups, s.nxy(), s.nz, s.C,
        static_cast<index_t>(s.dhw()), static_cast<index_t>(s.hw()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

template <typename scalar_t, typename index_t>
void launch_forward(const scalar_t* depth, const scalar_t* feat, const index_t* sorted_points,
                    const index_t* cell_start, scalar_t* out, const Shape& s, cudaStream_t stream) {
  const int64_t blocks = ceil_div(s.cells(), kTile);
  LSS_CHECK(blocks <= std::numeric_limits<int32_t>::max(),
            "bev_pool: " + std::to_string(s.cells()) +
                " cells exceed the CUDA grid limit; use a smaller batch or grid");
  bev_pool_forward_kernel<scalar_t, index_t><<<static_cast<unsigned>(blocks), kTileThreads, 0, stream>>>(
      depth, feat, sorted_points, cell_start, out, s.cells(), s.points(), s.nxy(), s.C,
      static_cast<index_t>(s.dhw()), static_cast<index_t>(s.hw()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// NCHW grad_out -> the rows of the non-empty cells in a cells x C buffer (row of cell c at c * C).
template <typename scalar_t, typename index_t, int V>
__global__ void __launch_bounds__(kCellThreads)
    bev_pool_stage_kernel(const scalar_t* __restrict__ grad_out, const index_t* __restrict__ cell_start,
                          scalar_t* __restrict__ staged, int64_t cells, int groups, int64_t nxy, int64_t C) {
  using vec_t = Vec<scalar_t, V>;
  int64_t cell;
  int group;
  if (!cell_and_group<false>(cells, groups, &cell, &group)) return;
  if (cell_start[cell] == cell_start[cell + 1]) return;  // no points: the row is never read
  const int64_t c0 = static_cast<int64_t>(group) * kGroup;
  const scalar_t* src = grad_out + cell_offset<false>(cell, nxy, 1, C) + c0 * nxy;
  scalar_t* dst = staged + cell * C + c0;
#pragma unroll
  for (int i = 0; i < kGroup / V; ++i) {
    if (c0 + i * V < C) {
      vec_t y;
#pragma unroll
      for (int v = 0; v < V; ++v) y.v[v] = src[(i * V + v) * nxy];
      *reinterpret_cast<vec_t*>(dst + i * V) = y;
    }
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

template <typename T>
__device__ __forceinline__ T shfl_xor(T v, int offset) {
  return __shfl_xor_sync(0xffffffffu, v, offset);
}

// Lanes of a pixel's warp: lane = phase * lanes + g with lanes = 1 << lane_bits (a power of two covering the
// channel groups, at most 32); a lane takes channel group pass + g and the points of depth bins d = phase (mod
// 32 / lanes). With more than 32 groups the warp makes several passes of 32 groups; dot_partial (one float per
// point) then carries grad_depth's partial sums from pass to pass (the same lane handles a point in every pass).
// grad_rows and C are aligned to V elements when V > 1.
template <typename scalar_t, typename index_t, int V, bool kPacked>
__global__ void __launch_bounds__(kPixelWarps * 32)
    bev_pool_backward_kernel(const scalar_t* __restrict__ grad_rows, bev_pool::GradRows rows,
                             const scalar_t* __restrict__ depth, const scalar_t* __restrict__ feat,
                             PixelStrides feat_strides, const index_t* __restrict__ point_cell,
                             scalar_t* __restrict__ grad_depth, scalar_t* __restrict__ grad_feat,
                             PixelStrides grad_feat_strides, at::opmath_type<scalar_t>* __restrict__ dot_partial,
                             int64_t pixels, int64_t N, int64_t fH, int64_t fW, int64_t D, int64_t C, int64_t nxy,
                             int64_t planes, int64_t cells, int lane_bits) {
  using acc_t = at::opmath_type<scalar_t>;
  using vec_t = Vec<scalar_t, V>;
  constexpr int kVectors = kGroup / V;
  const int64_t pixel = static_cast<int64_t>(blockIdx.x) * kPixelWarps + threadIdx.x / 32;
  if (pixel >= pixels) return;  // the whole warp: no shuffles follow for it
  const int lane = threadIdx.x % 32, lanes = 1 << lane_bits, phases = 32 >> lane_bits;
  const int g = lane & (lanes - 1), phase = lane >> lane_bits;
  const int64_t hw = fH * fW, bn = pixel / hw, hwi = pixel - bn * hw, b = bn / N, n = bn - b * N;
  const int64_t h = hwi / fW, w = hwi - h * fW;
  const scalar_t* f_pixel = feat + feat_strides.at(b, n, h, w);
  scalar_t* gf_pixel = grad_feat + grad_feat_strides.at(b, n, h, w);
  const int64_t first_point = bn * D * hw + hwi;  // point of depth bin d: first_point + d * hw
  const int groups = static_cast<int>(ceil_div(C, kGroup));
  for (int pass = 0; pass < groups; pass += lanes) {
    const int64_t c0 = static_cast<int64_t>(pass + g) * kGroup;
    const bool first_pass = pass == 0, last_pass = pass + lanes >= groups;
    acc_t f[kGroup], acc[kGroup];
#pragma unroll
    for (int r = 0; r < kGroup; ++r) {
      f[r] = c0 + r < C ? static_cast<acc_t>(f_pixel[(c0 + r) * feat_strides.channel]) : acc_t(0);
      acc[r] = acc_t(0);
    }
    for (int64_t d0 = 0; d0 < D; d0 += static_cast<int64_t>(phases) * kPointUnroll) {
      int64_t p[kPointUnroll], cell[kPointUnroll];
      acc_t wt[kPointUnroll];
#pragma unroll
      for (int u = 0; u < kPointUnroll; ++u) {
        const int64_t d = d0 + u * phases + phase;
        p[u] = d < D ? first_point + d * hw : -1;
        cell[u] = p[u] >= 0 ? checked_cell(point_cell[p[u]], cells) : -1;
        wt[u] = p[u] >= 0 ? static_cast<acc_t>(depth[p[u]]) : acc_t(0);
      }
      vec_t x[kPointUnroll][kVectors];
#pragma unroll
      for (int u = 0; u < kPointUnroll; ++u) {
        const scalar_t* row = grad_rows + (cell[u] >= 0 ? grad_row<kPacked>(cell[u], rows, nxy, planes) : 0) + c0;
#pragma unroll
        for (int i = 0; i < kVectors; ++i) {
          if (cell[u] >= 0 && c0 + i * V < C) {
            x[u][i] = load_vec<scalar_t, V>(row + i * V);
          } else {
#pragma unroll
            for (int v = 0; v < V; ++v) x[u][i].v[v] = scalar_t(0);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kPointUnroll; ++u) {
        acc_t dot = acc_t(0);
#pragma unroll
        for (int i = 0; i < kVectors; ++i)
#pragma unroll
          for (int v = 0; v < V; ++v) {
            const acc_t gc = static_cast<acc_t>(x[u][i].v[v]);
            dot += f[i * V + v] * gc;
            acc[i * V + v] += wt[u] * gc;
          }
        for (int offset = lanes / 2; offset > 0; offset >>= 1) dot += shfl_xor(dot, offset);
        if (g == 0 && p[u] >= 0) {
          if (!first_pass) dot += dot_partial[p[u]];
          if (last_pass) {
            grad_depth[p[u]] = static_cast<scalar_t>(dot);
          } else {
            dot_partial[p[u]] = dot;
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kGroup; ++r) {
      for (int offset = lanes; offset < 32; offset <<= 1) acc[r] += shfl_xor(acc[r], offset);
      if (phase == 0 && c0 + r < C) gf_pixel[(c0 + r) * grad_feat_strides.channel] = static_cast<scalar_t>(acc[r]);
    }
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
      auto launch = channels_last ? launch_forward_channels_last<scalar_t, index_t> : launch_forward<scalar_t, index_t>;
      launch(depth.data_ptr<scalar_t>(), feat.data_ptr<scalar_t>(), sorted_points.data_ptr<index_t>(),
             cell_start.data_ptr<index_t>(), out.data_ptr<scalar_t>(), s, stream);
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> bev_pool_backward_cuda(const at::Tensor& grad_out_in, const at::Tensor& depth_in,
                                                          const at::Tensor& feat, const at::Tensor& cell_start_in,
                                                          const at::Tensor& point_cell_in, int64_t nz, int64_t nx,
                                                          int64_t ny) {
  check_cuda_tensor(depth_in, "bev_pool: depth");
  const Shape s = bev_pool::check_args(depth_in, feat, nullptr, cell_start_in, point_cell_in, nz, nx, ny);
  bev_pool::check_grad_out(grad_out_in, depth_in, s);
  c10::cuda::CUDAGuard guard(depth_in.device());
  auto [grad_depth, grad_feat] = bev_pool::empty_grads(depth_in, feat, s);
  if (s.C == 0) {
    grad_depth.zero_();
    return {grad_depth, grad_feat};
  }
  if (s.pixels() == 0) return {grad_depth, grad_feat};
  const int64_t blocks = ceil_div(s.pixels(), kPixelWarps);
  LSS_CHECK(blocks <= std::numeric_limits<int32_t>::max(),
            "bev_pool: " + std::to_string(s.pixels()) +
                " feature pixels exceed the CUDA grid limit; use a smaller batch");
  const auto depth = depth_in.contiguous();
  const auto cell_start = cell_start_in.contiguous();
  const auto point_cell = point_cell_in.contiguous();
  const bool in_place = bev_pool::grad_is_channels_last(grad_out_in);
  const auto grad_out = in_place ? grad_out_in : grad_out_in.contiguous();
  const auto rows = in_place ? bev_pool::channels_last_rows(s) : bev_pool::staged_rows(s);
  at::Tensor staged = in_place ? grad_out : at::empty({s.cells(), s.C}, grad_out.options());
  const int groups = static_cast<int>(ceil_div(s.C, kGroup));
  int lane_bits = 0;
  while (lane_bits < 5 && (1 << lane_bits) < groups) ++lane_bits;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, depth.scalar_type(), "bev_pool_backward_cuda", [&] {
    AT_DISPATCH_INDEX_TYPES(cell_start.scalar_type(), "bev_pool_backward_cuda_index", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      if (!in_place) {
        const dim3 grid = cell_grid<false>(s.cells(), groups);
        with_vector_width<scalar_t>(vector_width<scalar_t>(s.C, {staged.data_ptr()}), [&](auto v) {
          bev_pool_stage_kernel<scalar_t, index_t, decltype(v)::value><<<grid, kCellThreads, 0, stream>>>(
              grad_out.data_ptr<scalar_t>(), cell_start.data_ptr<index_t>(), staged.data_ptr<scalar_t>(),
              s.cells(), groups, s.nxy(), s.C);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      }
      // more than 32 channel groups: grad_depth's partial sums carried between the warp's passes over the groups
      at::Tensor dot_partial;
      if (groups > 32) dot_partial = at::empty({s.points()}, depth.options().dtype(c10::CppTypeToScalarType<acc_t>()));
      // staged rows, or channels-last grad_out with one height level: row of cell c at c * C
      const bool packed = rows.cell == s.C && rows.batch == s.nz * s.nxy() * s.C &&
                          (s.nz == 1 || rows.level == s.nxy() * s.C);
      with_vector_width<scalar_t>(vector_width<scalar_t>(s.C, {staged.data_ptr()}), [&](auto v) {
        constexpr int V = decltype(v)::value;
        auto kernel = packed ? bev_pool_backward_kernel<scalar_t, index_t, V, true>
                             : bev_pool_backward_kernel<scalar_t, index_t, V, false>;
        kernel<<<static_cast<unsigned>(blocks), kPixelWarps * 32, 0, stream>>>(
            staged.data_ptr<scalar_t>(), rows, depth.data_ptr<scalar_t>(), feat.data_ptr<scalar_t>(),
            bev_pool::pixel_strides(feat), point_cell.data_ptr<index_t>(), grad_depth.data_ptr<scalar_t>(),
            grad_feat.data_ptr<scalar_t>(), bev_pool::pixel_strides(grad_feat),
            dot_partial.defined() ? dot_partial.data_ptr<acc_t>() : nullptr, s.pixels(), s.N, s.fH, s.fW, s.D, s.C,
            s.nxy(), s.nz * s.nxy(), s.cells(), lane_bits);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
  return {grad_depth, grad_feat};
}

}  // namespace
}  // namespace lss

TORCH_LIBRARY_IMPL(lss, CUDA, m) {
  m.impl("bev_pool", &lss::bev_pool_cuda);
  m.impl("_bev_pool_backward", &lss::bev_pool_backward_cuda);
}
