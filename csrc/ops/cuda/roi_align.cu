// CUDA RoIAlign. Forward: NCHW features are read in place by one thread per output with the bin fastest (consecutive
// threads write consecutive outputs and sample neighbouring pixels of one plane); channels_last features are read by
// warps of consecutive channels and the tile is written out through shared memory. Backward accumulates into a
// channels-last float buffer (the sample geometry does not depend on the channel, so a warp's atomics hit
// consecutive addresses): coalesced atomics by default, a sort-based segment sum when
// torch.use_deterministic_algorithms(True) is on. The forward kernels also validate the rois (roi::roi_ok): a bad roi
// pools to zeros and, when the call keeps a bad-roi record (the op's third output, which the Python wrapper reads), is
// noted in it.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <climits>

#include "ops/cuda/roi_scatter.cuh"
#include "ops/roi_common.h"

namespace lss {
namespace {

using roi_scatter::kTileSmem;
using roi_scatter::Tile;
using roi_scatter::Tiling;

// One axis of roi::bilinear with the same arithmetic (so the same weights), in 32-bit pixel indices: a plane has
// fewer than 2^31 pixels (check_roi_args). valid == false: more than one pixel outside, the sample is zero.
template <typename T>
struct Axis {
  int lo, hi;
  T l, h;  // weights of hi and lo
  bool valid;
};

template <typename T>
__device__ __forceinline__ Axis<T> axis(T v, int size) {
  Axis<T> a;
  a.valid = !(v < T(-1) || v > static_cast<T>(size));
  if (!a.valid) {
    a.lo = a.hi = 0;
    a.l = a.h = T(0);
    return a;
  }
  if (v <= T(0)) v = T(0);
  a.lo = static_cast<int>(v);
  if (a.lo >= size - 1) {
    a.lo = a.hi = size - 1;
    v = static_cast<T>(a.lo);
  } else {
    a.hi = a.lo + 1;
  }
  a.l = v - static_cast<T>(a.lo);
  a.h = T(1) - a.l;
  return a;
}

// Pools one bin of roi r from one channel: base points at the channel's (0, 0) pixel, consecutive pixels `stride`
// elements apart (1 for NCHW, C for channels-last). Returns the bin's value; arg = the arg-max sample (max mode).
template <bool kMax, typename scalar_t, typename acc_t, typename index_t>
__device__ __forceinline__ acc_t align_bin(const roi::AlignRoi<acc_t>& r, const scalar_t* __restrict__ base,
                                           index_t stride, int H, int W, int ph, int pw, int32_t& arg) {
  acc_t sum = acc_t(0), best = acc_t(0);
  arg = -1;
  for (int iy = 0; iy < r.grid_h; ++iy) {
    const auto ay = axis<acc_t>(r.sample_y(ph, iy), H);
    const index_t row_lo = static_cast<index_t>(ay.lo) * W, row_hi = static_cast<index_t>(ay.hi) * W;
    for (int ix = 0; ix < r.grid_w; ++ix) {
      const auto ax = axis<acc_t>(r.sample_x(pw, ix), W);
      acc_t v = acc_t(0);
      if (ay.valid && ax.valid) {
        v = ay.h * ax.h * static_cast<acc_t>(base[(row_lo + ax.lo) * stride]) +
            ay.h * ax.l * static_cast<acc_t>(base[(row_lo + ax.hi) * stride]) +
            ay.l * ax.h * static_cast<acc_t>(base[(row_hi + ax.lo) * stride]) +
            ay.l * ax.l * static_cast<acc_t>(base[(row_hi + ax.hi) * stride]);
      }
      if (kMax) {
        // The first maximum wins; a NaN sample becomes (and stays) the maximum, like torch.max.
        if (arg < 0 || v > best || (v != v && best == best)) {
          best = v;
          arg = iy * r.grid_w + ix;
        }
      } else {
        sum += v;
      }
    }
  }
  if (kMax) return arg < 0 ? acc_t(0) : best;
  return sum / r.count;
}

// NCHW input: one thread per output, index = output index (pw fastest).
template <bool kMax, typename scalar_t, typename acc_t, typename index_t>
__global__ void roi_align_forward_nchw_kernel(index_t total, const scalar_t* __restrict__ input,
                                              const acc_t* __restrict__ rois, int64_t N, index_t C, int H, int W,
                                              int pooled_h, int pooled_w, acc_t spatial_scale, int sampling_ratio,
                                              bool aligned, scalar_t* __restrict__ output,
                                              int32_t* __restrict__ argmax, int64_t* __restrict__ bad_rois) {
  const index_t plane = static_cast<index_t>(H) * W;
  for (index_t idx = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<index_t>(gridDim.x) * blockDim.x) {
    const int pw = static_cast<int>(idx % pooled_w);
    index_t t = idx / pooled_w;
    const int ph = static_cast<int>(t % pooled_h);
    t /= pooled_h;
    const index_t c = t % C, k = t / C;
    const auto r = roi::align_roi<acc_t>(rois + k * 5, N, spatial_scale, pooled_h, pooled_w, sampling_ratio, aligned);
    int32_t arg = -1;
    acc_t v = acc_t(0);
    if (r.batch >= 0) {
      const scalar_t* base = input + (static_cast<index_t>(r.batch) * C + c) * plane;
      v = align_bin<kMax, scalar_t, acc_t, index_t>(r, base, index_t(1), H, W, ph, pw, arg);
    } else if (c == 0 && ph == 0 && pw == 0) {
      roi_scatter::record_bad_roi(bad_rois, rois + k * 5, k, N);  // one thread per roi reports it
    }
    output[idx] = static_cast<scalar_t>(v);
    if (kMax) argmax[idx] = arg;
  }
}

// Channels-last input: a block per tile (roi, channel chunk, bin tile); lanes read consecutive channels, the tile is
// staged in shared memory and written as runs of consecutive output addresses.
template <bool kMax, typename scalar_t, typename acc_t, typename index_t>
__global__ void __launch_bounds__(kThreads) roi_align_forward_nhwc_kernel(
    Tiling tiling, const scalar_t* __restrict__ input_nhwc, const acc_t* __restrict__ rois, int64_t N, index_t C,
    int H, int W, int pooled_h, int pooled_w, acc_t spatial_scale, int sampling_ratio, bool aligned,
    scalar_t* __restrict__ output, int32_t* __restrict__ argmax, int64_t* __restrict__ bad_rois) {
  __shared__ acc_t s_val[kTileSmem];
  __shared__ int32_t s_arg[kMax ? kTileSmem : 1];
  const index_t bins = static_cast<index_t>(pooled_h) * pooled_w;
  const index_t image = static_cast<index_t>(H) * W * C;
  for (int64_t tile = blockIdx.x; tile < tiling.num_tiles; tile += gridDim.x) {
    const Tile t(tiling, tile, C, bins);
    const auto r = roi::align_roi<acc_t>(rois + t.k * 5, N, spatial_scale, pooled_h, pooled_w, sampling_ratio,
                                         aligned);
    if (r.batch < 0 && t.c0 == 0 && t.b0 == 0 && threadIdx.x == 0) {
      roi_scatter::record_bad_roi(bad_rois, rois + t.k * 5, t.k, N);
    }
    if (t.lane_c < t.nc) {
      const index_t c = static_cast<index_t>(t.c0) + t.lane_c;
      const scalar_t* base = r.batch >= 0 ? input_nhwc + static_cast<index_t>(r.batch) * image + c : nullptr;
      for (int b = t.first_b; b < t.nb; b += t.step_b) {
        const index_t bin = static_cast<index_t>(t.b0) + b;
        int32_t arg = -1;
        acc_t v = acc_t(0);
        if (base != nullptr) {
          v = align_bin<kMax, scalar_t, acc_t, index_t>(r, base, C, H, W, static_cast<int>(bin / pooled_w),
                                                         static_cast<int>(bin % pooled_w), arg);
        }
        s_val[t.lane_c * t.row + b] = v;
        if (kMax) s_arg[t.lane_c * t.row + b] = arg;
      }
    }
    __syncthreads();
    const index_t out0 = (static_cast<index_t>(t.k) * C + static_cast<index_t>(t.c0)) * bins + static_cast<index_t>(t.b0);
    for (int i = threadIdx.x; i < t.nc * t.nb; i += blockDim.x) {
      const int cl = i / t.nb, b = i - cl * t.nb;
      const index_t o = out0 + static_cast<index_t>(cl) * bins + b;
      output[o] = static_cast<scalar_t>(s_val[cl * t.row + b]);
      if (kMax) argmax[o] = s_arg[cl * t.row + b];
    }
    __syncthreads();
  }
}

// Shared memory of the separable backward's column sums (bin rows x columns x channels).
constexpr int kColumnSmemBytes = 24 * 1024;

// Avg-mode backward of one roi for one channel chunk, when the tile holds all its bins. A sample's bilinear weight
// is (row weight) x (column weight), so the bin gradients are first spread over the roi's columns (one thread per
// (channel, bin row)), then over rows by one thread per (channel, column) that walks the samples in order with a
// running sum per row (consecutive samples share rows): every pixel the roi touches gets one atomic per channel
// instead of one per sample corner. Columns go through shared memory in chunks; returns false, writing nothing,
// when the bin rows leave room for fewer than 4 columns (the caller then scatters sample by sample).
template <typename acc_t, typename index_t>
__device__ bool separable_avg_backward(const roi::AlignRoi<acc_t>& r, const Tile& t, int lanes,
                                       const acc_t* s_grad, acc_t* s_cols, int pooled_h, int pooled_w, int H, int W,
                                       index_t C, acc_t* __restrict__ base) {
  constexpr int64_t capacity = kColumnSmemBytes / static_cast<int64_t>(sizeof(acc_t));
  const int64_t wide = capacity / (static_cast<int64_t>(lanes) * pooled_h);
  if (wide < 4) return false;
  const int width = static_cast<int>(wide);
  if (r.grid_h <= 0 || r.grid_w <= 0) return true;
  // Sample columns are linear in (pw, ix): the first and last samples bound them (one column of slack for rounding).
  const acc_t x_first = r.sample_x(0, 0), x_last = r.sample_x(pooled_w - 1, r.grid_w - 1);
  const acc_t x_min = x_first < x_last ? x_first : x_last, x_max = x_first < x_last ? x_last : x_first;
  if (x_max < acc_t(-1) || x_min > static_cast<acc_t>(W)) return true;
  const int col_min = max(axis<acc_t>(x_min > acc_t(-1) ? x_min : acc_t(-1), W).lo - 1, 0);
  const int col_max = min(axis<acc_t>(x_max < static_cast<acc_t>(W) ? x_max : static_cast<acc_t>(W), W).hi + 1, W - 1);
  const index_t row_stride = static_cast<index_t>(W) * C;
  for (int x0 = col_min; x0 <= col_max; x0 += width) {
    const int n = min(width, col_max - x0 + 1);
    for (int i = threadIdx.x; i < lanes * pooled_h; i += blockDim.x) {
      const int cl = i & (lanes - 1), ph = i / lanes;
      acc_t* cols = s_cols + static_cast<int64_t>(ph) * width * lanes + cl;
      for (int x = 0; x < n; ++x) cols[x * lanes] = acc_t(0);
      if (cl >= t.nc) continue;
      for (int pw = 0; pw < pooled_w; ++pw) {
        const acc_t g = s_grad[cl * t.row + ph * pooled_w + pw] / r.count;
        if (g == acc_t(0)) continue;
        for (int ix = 0; ix < r.grid_w; ++ix) {
          const auto ax = axis<acc_t>(r.sample_x(pw, ix), W);
          if (!ax.valid) continue;
          const int lo = ax.lo - x0, hi = ax.hi - x0;
          if (lo >= 0 && lo < n) cols[lo * lanes] += g * ax.h;
          if (hi >= 0 && hi < n) cols[hi * lanes] += g * ax.l;
        }
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < lanes * n; i += blockDim.x) {
      const int cl = i & (lanes - 1), x = i / lanes;
      if (cl >= t.nc) continue;
      acc_t* dst = base + static_cast<index_t>(x0 + x) * C + cl;
      int r0 = -1, r1 = -1;  // the rows of the current sample, with their running sums a0, a1
      acc_t a0 = acc_t(0), a1 = acc_t(0);
      for (int ph = 0; ph < pooled_h; ++ph) {
        const acc_t v = s_cols[(static_cast<int64_t>(ph) * width + x) * lanes + cl];
        if (v == acc_t(0)) continue;
        for (int iy = 0; iy < r.grid_h; ++iy) {
          const auto ay = axis<acc_t>(r.sample_y(ph, iy), H);
          if (!ay.valid) continue;
          if (ay.lo != r0) {
            if (a0 != acc_t(0)) atomicAdd(dst + r0 * row_stride, a0);
            if (ay.lo == r1) {
              a0 = a1;
            } else {
              if (a1 != acc_t(0)) atomicAdd(dst + r1 * row_stride, a1);
              a0 = acc_t(0);
            }
            r0 = ay.lo;
            r1 = ay.hi;
            a1 = acc_t(0);
          }
          a0 += ay.h * v;
          a1 += ay.l * v;
        }
      }
      if (a0 != acc_t(0)) atomicAdd(dst + r0 * row_stride, a0);
      if (a1 != acc_t(0)) atomicAdd(dst + r1 * row_stride, a1);
    }
    __syncthreads();
  }
  return true;
}

// Backward atomics: a block per tile (roi, channel chunk, bin tile); the grad (and argmax) tile is read coalesced
// into shared memory, then lanes of consecutive channels add to the channels-last buffer: per pixel of the roi
// (separable_avg_backward) in avg mode when the tile holds the whole roi, else per sample corner.
template <bool kMax, typename scalar_t, typename acc_t, typename index_t>
__global__ void __launch_bounds__(kThreads) roi_align_backward_atomic_kernel(
    Tiling tiling, const scalar_t* __restrict__ grad, roi_scatter::GradView<index_t> grad_view,
    const acc_t* __restrict__ rois, const int32_t* __restrict__ argmax, int64_t N, index_t C, int H, int W,
    int pooled_h, int pooled_w, acc_t spatial_scale, int sampling_ratio, bool aligned, acc_t* __restrict__ grad_nhwc) {
  __shared__ acc_t s_grad[kTileSmem];
  __shared__ int32_t s_arg[kMax ? kTileSmem : 1];
  __shared__ acc_t s_cols[kMax ? 1 : kColumnSmemBytes / sizeof(acc_t)];
  const index_t bins = static_cast<index_t>(pooled_h) * pooled_w;
  const index_t image = static_cast<index_t>(H) * W * C;
  for (int64_t tile = blockIdx.x; tile < tiling.num_tiles; tile += gridDim.x) {
    const Tile t(tiling, tile, C, bins);
    const auto r = roi::align_roi<acc_t>(rois + t.k * 5, N, spatial_scale, pooled_h, pooled_w, sampling_ratio,
                                         aligned);
    // Uniform over the block (r depends on the roi only), so no thread skips a barrier another one waits at.
    if (r.batch < 0) continue;
    const index_t g0 = (static_cast<index_t>(t.k) * C + static_cast<index_t>(t.c0)) * bins + static_cast<index_t>(t.b0);
    for (int i = threadIdx.x; i < t.nc * t.nb; i += blockDim.x) {
      const int cl = i / t.nb, b = i - cl * t.nb;
      const index_t g = g0 + static_cast<index_t>(cl) * bins + b;  // argmax is contiguous, grad maybe not
      s_grad[cl * t.row + b] = static_cast<acc_t>(grad[grad_view.offset(
          g, static_cast<index_t>(t.k), static_cast<index_t>(t.c0 + cl), static_cast<index_t>(t.b0 + b), pooled_w)]);
      if (kMax) s_arg[cl * t.row + b] = argmax[g];
    }
    __syncthreads();
    if constexpr (!kMax) {
      // Uniform over the block, like the return value: every barrier inside is reached by all threads.
      if (tiling.bin_tiles == 1 &&
          separable_avg_backward<acc_t, index_t>(r, t, 1 << tiling.lanes_log2, s_grad, s_cols, pooled_h, pooled_w, H,
                                                 W, C, grad_nhwc + static_cast<index_t>(r.batch) * image +
                                                           static_cast<index_t>(t.c0))) {
        continue;
      }
    }
    if (t.lane_c < t.nc) {
      acc_t* base = grad_nhwc + static_cast<index_t>(r.batch) * image + static_cast<index_t>(t.c0) + t.lane_c;
      const int64_t samples = static_cast<int64_t>(r.grid_h) * r.grid_w;
      for (int b = t.first_b; b < t.nb; b += t.step_b) {
        const index_t bin = static_cast<index_t>(t.b0) + b;
        const int ph = static_cast<int>(bin / pooled_w), pw = static_cast<int>(bin % pooled_w);
        const acc_t g = s_grad[t.lane_c * t.row + b];
        int iy0 = 0, iy1 = r.grid_h, ix0 = 0, ix1 = r.grid_w;
        if (kMax) {
          // Only the arg-max sample gets the gradient.
          const int32_t only = s_arg[t.lane_c * t.row + b];
          if (only < 0 || only >= samples) continue;
          iy0 = only / r.grid_w;
          ix0 = only - iy0 * r.grid_w;
          iy1 = iy0 + 1;
          ix1 = ix0 + 1;
        }
        const acc_t s = kMax ? g : g / r.count;
        for (int iy = iy0; iy < iy1; ++iy) {
          const auto ay = axis<acc_t>(r.sample_y(ph, iy), H);
          if (!ay.valid) continue;
          const index_t row_lo = static_cast<index_t>(ay.lo) * W, row_hi = static_cast<index_t>(ay.hi) * W;
          for (int ix = ix0; ix < ix1; ++ix) {
            const auto ax = axis<acc_t>(r.sample_x(pw, ix), W);
            if (!ax.valid) continue;
            atomicAdd(base + (row_lo + ax.lo) * C, s * (ay.h * ax.h));
            atomicAdd(base + (row_lo + ax.hi) * C, s * (ay.h * ax.l));
            atomicAdd(base + (row_hi + ax.lo) * C, s * (ay.l * ax.h));
            atomicAdd(base + (row_hi + ax.hi) * C, s * (ay.l * ax.l));
          }
        }
      }
    }
    __syncthreads();
  }
}

// Deterministic path, step 1: entries per (roi, bin) = 4 corners per sample.
template <typename acc_t>
__global__ void roi_align_count_kernel(int64_t total, const acc_t* __restrict__ rois, int64_t N, int pooled_h,
                                       int pooled_w, acc_t spatial_scale, int sampling_ratio, bool aligned,
                                       int64_t* __restrict__ counts) {
  const int64_t bins = static_cast<int64_t>(pooled_h) * pooled_w;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const auto r = roi::align_roi<acc_t>(rois + (idx / bins) * 5, N, spatial_scale, pooled_h, pooled_w,
                                         sampling_ratio, aligned);
    counts[idx] = r.batch < 0 ? 0 : int64_t(4) * r.grid_h * r.grid_w;
  }
}

// Step 2: write each sample's 4 corner entries (pixel key, bin, sample id, weight / count in avg mode).
template <typename acc_t>
__global__ void roi_align_fill_kernel(int64_t total, const acc_t* __restrict__ rois, const int64_t* __restrict__ offsets,
                                      int64_t N, int64_t H, int64_t W, int pooled_h, int pooled_w, acc_t spatial_scale,
                                      int sampling_ratio, bool aligned, bool max_mode, int64_t sentinel,
                                      int64_t* __restrict__ key, int64_t* __restrict__ entry_bin,
                                      int32_t* __restrict__ sample, acc_t* __restrict__ weight) {
  const int64_t bins = static_cast<int64_t>(pooled_h) * pooled_w;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const auto r = roi::align_roi<acc_t>(rois + (idx / bins) * 5, N, spatial_scale, pooled_h, pooled_w,
                                         sampling_ratio, aligned);
    if (r.batch < 0) continue;
    const int ph = static_cast<int>((idx % bins) / pooled_w), pw = static_cast<int>(idx % pooled_w);
    const int64_t plane = r.batch * H * W;
    int64_t e = offsets[idx];
    for (int iy = 0; iy < r.grid_h; ++iy) {
      const acc_t y = r.sample_y(ph, iy);
      for (int ix = 0; ix < r.grid_w; ++ix) {
        const auto b = roi::bilinear<acc_t>(H, W, y, r.sample_x(pw, ix));
        const int64_t o[4] = {b.o1, b.o2, b.o3, b.o4};
        const acc_t w[4] = {b.w1, b.w2, b.w3, b.w4};
        for (int q = 0; q < 4; ++q, ++e) {
          key[e] = b.valid ? plane + o[q] : sentinel;
          entry_bin[e] = idx;
          sample[e] = iy * r.grid_w + ix;
          weight[e] = max_mode ? w[q] : w[q] / r.count;
        }
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> roi_align_forward_cuda(const at::Tensor& input_,
                                                                      const at::Tensor& rois_, double spatial_scale,
                                                                      int64_t pooled_h, int64_t pooled_w,
                                                                      int64_t sampling_ratio, bool aligned,
                                                                      bool max_mode, bool record_bad_rois) {
  roi::check_roi_args("roi_align", input_, rois_, pooled_h, pooled_w);
  check_cuda_tensor(input_, "roi_align: input");
  LSS_CHECK(pooled_h <= INT_MAX && pooled_w <= INT_MAX && sampling_ratio <= INT_MAX,
            "roi_align: output size and sampling_ratio must fit in 32 bits, got " + std::to_string(pooled_h) + " x " +
                std::to_string(pooled_w) + " and " + std::to_string(sampling_ratio));
  c10::cuda::CUDAGuard guard(input_.device());
  const auto rois = roi::rois_in_acc_type(rois_, input_);
  const int64_t K = rois.size(0), N = input_.size(0), C = input_.size(1), H = input_.size(2), W = input_.size(3);
  auto output = at::empty({K, C, pooled_h, pooled_w}, input_.options());
  const auto int_opts = input_.options().dtype(at::kInt);
  auto argmax = max_mode ? at::empty({K, C, pooled_h, pooled_w}, int_opts) : at::empty({0}, int_opts);
  if (output.numel() == 0) return {output, argmax, roi_scatter::find_bad_rois(rois, N, record_bad_rois)};
  // Channels-last features are read in place by the channel-fastest kernel; everything else as NCHW.
  const bool nhwc = input_.suggest_memory_format() == at::MemoryFormat::ChannelsLast;
  const auto input = nhwc ? input_.contiguous(at::MemoryFormat::ChannelsLast) : input_.contiguous();
  const int64_t total = output.numel();
  const int ph = static_cast<int>(pooled_h), pw = static_cast<int>(pooled_w), sr = static_cast<int>(sampling_ratio);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const auto bad_rois = roi_scatter::bad_roi_record(input, record_bad_rois);
  int64_t* record = roi_scatter::record_ptr(bad_rois);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "roi_align_forward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t scale = static_cast<acc_t>(spatial_scale);
    const scalar_t* in = input.data_ptr<scalar_t>();
    scalar_t* out = output.data_ptr<scalar_t>();
    int32_t* arg = max_mode ? argmax.data_ptr<int32_t>() : nullptr;
    const acc_t* roi_data = rois.data_ptr<acc_t>();
    roi_scatter::dispatch_index(roi_scatter::fits_int32({total, input.numel()}), [&](auto index_tag) {
      using index_t = decltype(index_tag);
      roi_scatter::dispatch_bool(max_mode, [&](auto max_tag) {
        constexpr bool kMax = decltype(max_tag)::value;
        if (nhwc) {
          const auto tiling = roi_scatter::make_tiling(K, C, pooled_h * pooled_w);
          roi_align_forward_nhwc_kernel<kMax, scalar_t, acc_t, index_t>
              <<<roi_scatter::grid_for_tiles(tiling), kThreads, 0, stream>>>(
                  tiling, in, roi_data, N, static_cast<index_t>(C), static_cast<int>(H), static_cast<int>(W), ph, pw,
                  scale, sr, aligned, out, arg, record);
        } else {
          roi_align_forward_nchw_kernel<kMax, scalar_t, acc_t, index_t>
              <<<roi_scatter::grid_for(total), kThreads, 0, stream>>>(
                  static_cast<index_t>(total), in, roi_data, N, static_cast<index_t>(C), static_cast<int>(H),
                  static_cast<int>(W), ph, pw, scale, sr, aligned, out, arg, record);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
  return {output, argmax, bad_rois};
}

at::Tensor roi_align_backward_cuda(const at::Tensor& grad_, const at::Tensor& rois_, const at::Tensor& argmax_,
                                   double spatial_scale, int64_t pooled_h, int64_t pooled_w, int64_t batch_size,
                                   int64_t channels, int64_t height, int64_t width, int64_t sampling_ratio,
                                   bool aligned, bool max_mode) {
  check_cuda_tensor(grad_, "_roi_align_backward: grad");
  roi::check_roi_grad("_roi_align_backward", grad_, rois_, argmax_, max_mode, channels, pooled_h, pooled_w);
  LSS_CHECK(pooled_h <= INT_MAX && pooled_w <= INT_MAX && sampling_ratio <= INT_MAX && height <= INT_MAX &&
                width <= INT_MAX,
            "_roi_align_backward: output size, sampling_ratio, height and width must fit in 32 bits");
  c10::cuda::CUDAGuard guard(grad_.device());
  const bool deterministic = at::globalContext().deterministicAlgorithms();
  // The atomic kernel reads grad through its strides; the deterministic path's segment sums want it contiguous.
  const auto grad = deterministic ? grad_.contiguous() : grad_;
  const auto acc = grad.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto rois = rois_.to(acc).contiguous();
  const auto argmax = max_mode ? argmax_.to(at::kInt).contiguous() : at::Tensor();
  auto grad_nhwc = roi_scatter::zeros_by_memset({batch_size, height, width, channels}, grad.options().dtype(acc));
  if (grad.numel() == 0 || grad_nhwc.numel() == 0) return roi_scatter::nhwc_to_nchw(grad_nhwc, grad.scalar_type());
  const int64_t K = rois.size(0);
  const int ph = static_cast<int>(pooled_h), pw = static_cast<int>(pooled_w), sr = static_cast<int>(sampling_ratio);
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "roi_align_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t scale = static_cast<acc_t>(spatial_scale);
    if (!deterministic) {
      const auto tiling = roi_scatter::make_tiling(K, channels, pooled_h * pooled_w);
      const bool small = roi_scatter::fits_int32({grad.numel(), roi_scatter::extent(grad), grad_nhwc.numel()});
      roi_scatter::dispatch_index(small, [&](auto index_tag) {
        using index_t = decltype(index_tag);
        roi_scatter::dispatch_bool(max_mode, [&](auto max_tag) {
          constexpr bool kMax = decltype(max_tag)::value;
          roi_align_backward_atomic_kernel<kMax, scalar_t, acc_t, index_t>
              <<<roi_scatter::grid_for_tiles(tiling), kThreads, 0, stream>>>(
                  tiling, grad.data_ptr<scalar_t>(), roi_scatter::grad_view<index_t>(grad), rois.data_ptr<acc_t>(),
                  kMax ? argmax.data_ptr<int32_t>() : nullptr, batch_size, static_cast<index_t>(channels),
                  static_cast<int>(height), static_cast<int>(width), ph, pw, scale, sr, aligned,
                  grad_nhwc.data_ptr<acc_t>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      });
      return;
    }
    const int64_t kbins = K * pooled_h * pooled_w;
    auto counts = at::empty({kbins}, grad.options().dtype(at::kLong));
    roi_align_count_kernel<acc_t><<<roi_scatter::grid_for(kbins), kThreads, 0, stream>>>(
        kbins, rois.data_ptr<acc_t>(), batch_size, ph, pw, scale, sr, aligned, counts.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const auto [offsets, num_entries] = roi_scatter::exclusive_offsets(counts);
    auto entries = roi_scatter::alloc_entries(num_entries, grad, acc);
    if (num_entries == 0) return;
    const int64_t sentinel = batch_size * height * width;
    roi_align_fill_kernel<acc_t><<<roi_scatter::grid_for(kbins), kThreads, 0, stream>>>(
        kbins, rois.data_ptr<acc_t>(), offsets.data_ptr<int64_t>(), batch_size, height, width, ph, pw, scale, sr,
        aligned, max_mode, sentinel, entries.key.data_ptr<int64_t>(), entries.bin.data_ptr<int64_t>(),
        entries.sample.data_ptr<int32_t>(), entries.weight.data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    roi_scatter::deterministic_scatter<scalar_t, acc_t>(entries, sentinel, grad, argmax, grad_nhwc);
  });
  return roi_scatter::nhwc_to_nchw(grad_nhwc, grad.scalar_type());
}

}  // namespace
}  // namespace lss

TORCH_LIBRARY_IMPL(lss, CUDA, m) {
  m.impl("roi_align", &lss::roi_align_forward_cuda);
  m.impl("_roi_align_backward", &lss::roi_align_backward_cuda);
}
