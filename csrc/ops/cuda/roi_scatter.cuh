// Launch helpers of roi_align / roi_pool: the forward ops' bad-roi record, 32-bit index selection and the (roi,
// channel chunk, bin tile) tiling of the channels-last kernels. Gradient scatter into a channels-last (N x H x W x C) float accumulator.
// Fast path: atomics, coalesced over channels. Deterministic path (torch.use_deterministic_algorithms): every
// (roi, bin) lists the pixels it touches as channel-independent entries (pixel key, bin, sample id, weight); a
// stable sort by pixel makes each pixel's entries one segment, summed by a single thread per (pixel, channel) in
// a fixed order, so results are bit-identical run to run.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <initializer_list>
#include <type_traits>

#include "ops/common.h"
#include "ops/roi_common.h"

namespace lss {
namespace roi_scatter {
// Internal linkage: each including .cu gets its own copy.
namespace {

// Entries of the deterministic path; key == sentinel marks a sample that touches no pixel.
struct Entries {
  at::Tensor key;     // int64: image * H * W + pixel
  at::Tensor bin;     // int64: roi * PH * PW + bin
  at::Tensor sample;  // int32: the sample id (roi_align) or pixel (roi_pool) the argmax must equal in max mode
  at::Tensor weight;  // acc_t
};

// The forward ops' bad-roi record (see roi::find_bad_rois): two int64 set to -1 by a memset, no kernel. With
// record_bad_rois false the empty roi::no_bad_roi_record: no device memory, no driver call.
at::Tensor bad_roi_record(const at::Tensor& like, bool record_bad_rois) {
  if (!record_bad_rois) return roi::no_bad_roi_record(like);
  auto record = at::empty({2}, like.options().dtype(at::kLong));
  C10_CUDA_CHECK(cudaMemsetAsync(record.data_ptr<int64_t>(), 0xff, 2 * sizeof(int64_t),
                                 c10::cuda::getCurrentCUDAStream()));
  return record;
}

// The kernels' pointer to the record: null when the call keeps none.
int64_t* record_ptr(const at::Tensor& record) {
  return record.numel() > 0 ? record.data_ptr<int64_t>() : nullptr;
}

// Notes roi k in its slot of the record (roi::bad_roi_slot) when it cannot be pooled; nothing when record is null.
// atomicMin on the unsigned view (-1 is the largest) keeps the first bad roi, as the CPU record does.
template <typename T>
__device__ __forceinline__ void record_bad_roi(int64_t* record, const T* roi, int64_t k, int64_t batch_size) {
  if (record == nullptr) return;
  const int slot = roi::bad_roi_slot(roi, batch_size);
  if (slot >= 0) atomicMin(reinterpret_cast<unsigned long long*>(record + slot), static_cast<unsigned long long>(k));
}

template <typename T>
__global__ void find_bad_rois_kernel(int64_t K, const T* __restrict__ rois, int64_t batch_size,
                                     int64_t* __restrict__ record) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < K;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    record_bad_roi(record, rois + k * 5, k, batch_size);
  }
}

// Per-bin entry counts -> exclusive offsets and the total (one host sync, deterministic path only).
std::pair<at::Tensor, int64_t> exclusive_offsets(const at::Tensor& counts) {
  const auto inclusive = at::cumsum(counts, 0);
  const int64_t total = counts.numel() > 0 ? inclusive[-1].item<int64_t>() : 0;
  return {inclusive - counts, total};
}

Entries alloc_entries(int64_t total, const at::Tensor& like, at::ScalarType acc) {
  const auto o = like.options();
  return {at::empty({total}, o.dtype(at::kLong)), at::empty({total}, o.dtype(at::kLong)),
          at::empty({total}, o.dtype(at::kInt)), at::empty({total}, o.dtype(acc))};
}

// Grid size of a grid-stride kernel over `items` threads.
int grid_for(int64_t items) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(ceil_div(items, kThreads), int64_t(1) << 20)));
}

// The record of rois (acc type, contiguous, on the current device) without pooling anything: for forward calls whose
// output is empty (C = 0) while there are rois. No kernel when record_bad_rois is false.
at::Tensor find_bad_rois(const at::Tensor& rois, int64_t batch_size, bool record_bad_rois) {
  auto record = bad_roi_record(rois, record_bad_rois);
  const int64_t K = rois.size(0);
  if (K == 0 || !record_bad_rois) return record;
  AT_DISPATCH_FLOATING_TYPES(rois.scalar_type(), "find_bad_rois", [&] {
    find_bad_rois_kernel<scalar_t><<<grid_for(K), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        K, rois.data_ptr<scalar_t>(), batch_size, record.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return record;
}

// 32-bit indices suffice when every index is below 2^30: grid-stride steps (at most 2^28) then cannot overflow.
bool fits_int32(std::initializer_list<int64_t> sizes) {
  for (const int64_t n : sizes) {
    if (n >= (int64_t(1) << 30)) return false;
  }
  return true;
}

// A zero-filled accumulator through one cudaMemsetAsync (all-zero bits are 0.0 in float and double): at::zeros
// goes through the dispatcher's fill_ kernel, more host time per backward call.
at::Tensor zeros_by_memset(at::IntArrayRef sizes, const at::TensorOptions& options) {
  auto out = at::empty(sizes, options);
  if (out.numel() > 0) {
    C10_CUDA_CHECK(cudaMemsetAsync(out.data_ptr(), 0, out.nbytes(), c10::cuda::getCurrentCUDAStream()));
  }
  return out;
}

// The incoming gradient (K x C x PH x PW) read in place through its strides, as torchvision's backward kernels read
// it: the expanded gradient of out.sum() (all strides 0) or a permuted one costs no contiguous copy per call.
// dense: contiguous, the flat index is the offset.
template <typename index_t>
struct GradView {
  index_t k, c, h, w;
  bool dense;

  __device__ __forceinline__ index_t offset(index_t flat, index_t kk, index_t cc, index_t bin, int pooled_w) const {
    if (dense) return flat;
    const index_t ph = bin / pooled_w;
    return kk * k + cc * c + ph * h + (bin - ph * pooled_w) * w;
  }
};

template <typename index_t>
GradView<index_t> grad_view(const at::Tensor& grad) {
  return {static_cast<index_t>(grad.stride(0)), static_cast<index_t>(grad.stride(1)),
          static_cast<index_t>(grad.stride(2)), static_cast<index_t>(grad.stride(3)), grad.is_contiguous()};
}

// One past the largest element offset of a strided tensor (its extent in memory), for the 32-bit index choice.
int64_t extent(const at::Tensor& t) {
  if (t.numel() == 0) return 0;
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return last + 1;
}

// Calls f(int32_t{}) or f(int64_t{}) so the kernel is instantiated with the index type.
template <typename F>
void dispatch_index(bool use_int32, F&& f) {
  if (use_int32) {
    f(int32_t{});
  } else {
    f(int64_t{});
  }
}

// Calls f(std::true_type{}) or f(std::false_type{}) so max mode is a compile-time branch of the kernel.
template <typename F>
void dispatch_bool(bool value, F&& f) {
  if (value) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// Tiles of the channels-last kernels: a block takes (roi, chunk of 2^lanes_log2 channels, up to kTileBins bins).
// A warp's lanes are consecutive channels of one bin (or of 32 >> lanes_log2 bins when C < 32), so feature reads
// and gradient atomics of a warp hit consecutive addresses; the tile goes through shared memory so that the K x C x
// PH x PW side is read or written by consecutive threads at consecutive addresses.
constexpr int kWarps = kThreads / 32;
constexpr int kTileBins = 64;
constexpr int kTileSmem = 32 * (kTileBins + 1);  // the largest lanes * row_stride over lanes_log2 = 0..5

struct Tiling {
  int lanes_log2;
  int64_t c_tiles, bin_tiles, num_tiles;
};

Tiling make_tiling(int64_t K, int64_t C, int64_t bins) {
  Tiling t;
  t.lanes_log2 = 0;
  while (t.lanes_log2 < 5 && (int64_t(1) << t.lanes_log2) < C) ++t.lanes_log2;
  t.c_tiles = ceil_div(C, int64_t(1) << t.lanes_log2);
  t.bin_tiles = ceil_div(bins, kTileBins);
  t.num_tiles = K * t.c_tiles * t.bin_tiles;
  return t;
}

int grid_for_tiles(const Tiling& t) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(t.num_tiles, int64_t(1) << 20)));
}

// One block's tile and this thread's place in it. Shared memory holds the tile as rows of `row` values per channel;
// row = kTileBins + bins per warp keeps the 32 lanes of a warp on 32 different banks.
struct Tile {
  int64_t k, c0, b0;
  int nc, nb;       // channels and bins in this tile
  int lane_c;       // this thread's channel in the tile
  int first_b, step_b;  // this thread's bins in the tile: first_b, first_b + step_b, ...
  int row;

  __device__ Tile(const Tiling& t, int64_t tile, int64_t C, int64_t bins) {
    const int lanes = 1 << t.lanes_log2;
    const int bins_per_warp = 32 >> t.lanes_log2;
    const int64_t bt = tile % t.bin_tiles;
    const int64_t rest = tile / t.bin_tiles;
    k = rest / t.c_tiles;
    c0 = (rest % t.c_tiles) * lanes;
    b0 = bt * kTileBins;
    nc = static_cast<int>(C - c0 < lanes ? C - c0 : lanes);
    nb = static_cast<int>(bins - b0 < kTileBins ? bins - b0 : kTileBins);
    const int lane = threadIdx.x & 31;
    lane_c = lane & (lanes - 1);
    first_b = (threadIdx.x >> 5) * bins_per_warp + (lane >> t.lanes_log2);
    step_b = kWarps * bins_per_warp;
    row = kTileBins + bins_per_warp;
  }
};

template <typename scalar_t, typename acc_t>
__global__ void segment_sum_kernel(int64_t num_items, int64_t C, int64_t bins, int64_t sentinel,
                                   const int64_t* __restrict__ seg_key, const int64_t* __restrict__ seg_end,
                                   const int64_t* __restrict__ seg_count, const int64_t* __restrict__ perm,
                                   const int64_t* __restrict__ entry_bin, const int32_t* __restrict__ entry_sample,
                                   const acc_t* __restrict__ entry_weight, const scalar_t* __restrict__ grad,
                                   const int32_t* __restrict__ argmax, acc_t* __restrict__ grad_nhwc) {
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < num_items;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t seg = idx / C, c = idx % C;
    const int64_t key = seg_key[seg];
    if (key == sentinel) continue;
    const int64_t end = seg_end[seg];
    acc_t acc = acc_t(0);
    for (int64_t j = end - seg_count[seg]; j < end; ++j) {
      const int64_t e = perm[j];
      const int64_t kb = entry_bin[e];
      const int64_t g = ((kb / bins) * C + c) * bins + kb % bins;
      if (argmax != nullptr && argmax[g] != entry_sample[e]) continue;
      acc += static_cast<acc_t>(grad[g]) * entry_weight[e];
    }
    grad_nhwc[key * C + c] = acc;
  }
}

// Sums the entries into grad_nhwc (zero-initialised, N*H*W x C). grad: K x C x PH x PW contiguous; argmax
// (same shape, int32) or undefined for avg mode.
template <typename scalar_t, typename acc_t>
void deterministic_scatter(const Entries& entries, int64_t sentinel, const at::Tensor& grad, const at::Tensor& argmax,
                           at::Tensor& grad_nhwc) {
  if (entries.key.numel() == 0) return;
  const int64_t C = grad.size(1), bins = grad.size(2) * grad.size(3);
  const auto sorted = entries.key.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false);
  const auto& sorted_key = std::get<0>(sorted);
  const auto perm = std::get<1>(sorted).contiguous();
  const auto uniq = at::unique_consecutive(sorted_key, /*return_inverse=*/false, /*return_counts=*/true);
  const auto seg_key = std::get<0>(uniq).contiguous();
  const auto seg_count = std::get<2>(uniq).contiguous();
  const auto seg_end = at::cumsum(seg_count, 0).contiguous();
  const int64_t items = seg_key.numel() * C;
  if (items == 0) return;
  segment_sum_kernel<scalar_t, acc_t><<<grid_for(items), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      items, C, bins, sentinel, seg_key.data_ptr<int64_t>(), seg_end.data_ptr<int64_t>(),
      seg_count.data_ptr<int64_t>(), perm.data_ptr<int64_t>(), entries.bin.data_ptr<int64_t>(),
      entries.sample.data_ptr<int32_t>(), entries.weight.data_ptr<acc_t>(), grad.data_ptr<scalar_t>(),
      argmax.defined() ? argmax.data_ptr<int32_t>() : nullptr, grad_nhwc.data_ptr<acc_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Tiled transpose of one image's HW x C accumulator into C x HW, cast to the gradient's dtype on the way: a block
// takes a 32-pixel x 32-channel tile, reads it as rows of consecutive channels and writes it as rows of consecutive
// pixels through shared memory (33 columns: the column reads hit 32 different banks).
constexpr int kTransposeTile = 32;
constexpr int kTransposeRows = 8;

template <typename acc_t, typename scalar_t>
__global__ void __launch_bounds__(kTransposeTile * kTransposeRows) nhwc_to_nchw_kernel(
    const acc_t* __restrict__ in, scalar_t* __restrict__ out, int64_t N, int64_t HW, int64_t C) {
  __shared__ acc_t tile[kTransposeTile][kTransposeTile + 1];
  const int64_t p0 = static_cast<int64_t>(blockIdx.x) * kTransposeTile;
  for (int64_t n = blockIdx.z; n < N; n += gridDim.z) {
    for (int64_t c0 = static_cast<int64_t>(blockIdx.y) * kTransposeTile; c0 < C;
         c0 += static_cast<int64_t>(gridDim.y) * kTransposeTile) {
      const acc_t* src = in + n * HW * C;
      for (int i = threadIdx.y; i < kTransposeTile; i += kTransposeRows) {
        const int64_t p = p0 + i, c = c0 + threadIdx.x;
        if (p < HW && c < C) tile[i][threadIdx.x] = src[p * C + c];
      }
      __syncthreads();
      scalar_t* dst = out + n * C * HW;
      for (int i = threadIdx.y; i < kTransposeTile; i += kTransposeRows) {
        const int64_t c = c0 + i, p = p0 + threadIdx.x;
        if (p < HW && c < C) dst[c * HW + p] = static_cast<scalar_t>(tile[threadIdx.x][i]);
      }
      __syncthreads();
    }
  }
}

// N x H x W x C accumulator -> N x C x H x W gradient in the features' dtype, in one pass (transpose and cast).
at::Tensor nhwc_to_nchw(const at::Tensor& grad_nhwc, at::ScalarType dtype) {
  const int64_t N = grad_nhwc.size(0), H = grad_nhwc.size(1), W = grad_nhwc.size(2), C = grad_nhwc.size(3);
  auto out = at::empty({N, C, H, W}, grad_nhwc.options().dtype(dtype));
  if (out.numel() == 0) return out;
  const int64_t HW = H * W;
  const dim3 grid(static_cast<unsigned>(ceil_div(HW, int64_t(kTransposeTile))),
                  static_cast<unsigned>(std::min<int64_t>(ceil_div(C, int64_t(kTransposeTile)), 65535)),
                  static_cast<unsigned>(std::min<int64_t>(N, 65535)));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "roi_nhwc_to_nchw", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    nhwc_to_nchw_kernel<acc_t, scalar_t><<<grid, dim3(kTransposeTile, kTransposeRows), 0,
                                           c10::cuda::getCurrentCUDAStream()>>>(
        grad_nhwc.data_ptr<acc_t>(), out.data_ptr<scalar_t>(), N, HW, C);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace
}  // namespace roi_scatter
}  // namespace lss
