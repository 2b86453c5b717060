// CUDA RoIPool. Forward: NCHW features are read in place by one thread per bin and 4 channels, bin fastest;
// channels_last features by warps of consecutive channels, the tile written out through shared memory. Backward: each
// output adds its gradient to its arg-max pixel, directly in the NCHW gradient (float32 buffer for fp16/bf16); under
// torch.use_deterministic_algorithms(True) the sort-based segment sum of roi_scatter.cuh instead. The forward kernels
// validate the rois (roi::roi_ok): a bad roi pools to zeros and, when the call keeps a bad-roi record (the op's third
// output, which the Python wrapper reads), is noted in it.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <cfloat>
#include <climits>

#include "ops/cuda/roi_scatter.cuh"
#include "ops/roi_common.h"

namespace lss {
namespace {

using roi_scatter::kTileSmem;
using roi_scatter::Tile;
using roi_scatter::Tiling;

// Max over the bin's pixel window of one channel: base points at the channel's (0, 0) pixel, consecutive pixels
// `stride` elements apart. torchvision's rule: an empty bin is 0 (arg -1); otherwise the first pixel strictly above
// -FLT_MAX so far.
template <typename scalar_t, typename acc_t, typename index_t>
__device__ __forceinline__ acc_t pool_window(const roi::PoolBin& p, const scalar_t* __restrict__ base, index_t stride,
                                             int W, int32_t& arg) {
  arg = -1;
  if (p.batch < 0 || p.h1 <= p.h0 || p.w1 <= p.w0) return acc_t(0);
  acc_t best = static_cast<acc_t>(-FLT_MAX);
  const int h0 = static_cast<int>(p.h0), h1 = static_cast<int>(p.h1);
  const int w0 = static_cast<int>(p.w0), w1 = static_cast<int>(p.w1);
  for (int h = h0; h < h1; ++h) {
    for (int w = w0; w < w1; ++w) {
      const int pixel = h * W + w;
      const acc_t v = static_cast<acc_t>(base[static_cast<index_t>(pixel) * stride]);
      if (v > best) {
        best = v;
        arg = pixel;
      }
    }
  }
  return best;
}

// NCHW input: one thread per (roi, chunk of kPoolChannels channels, bin), the bin fastest. The thread computes its
// window once and walks it once, loading the chunk's channels at each pixel together (independent loads in flight);
// per channel the result is pool_window's.
constexpr int kPoolChannels = 4;

template <typename scalar_t, typename acc_t, typename index_t>
__global__ void roi_pool_forward_nchw_kernel(index_t total, const scalar_t* __restrict__ input,
                                             const acc_t* __restrict__ rois, int64_t N, index_t C, int H, int W,
                                             int pooled_h, int pooled_w, acc_t spatial_scale,
                                             scalar_t* __restrict__ output, int32_t* __restrict__ argmax,
                                             int64_t* __restrict__ bad_rois) {
  const index_t plane = static_cast<index_t>(H) * W;
  const index_t bins = static_cast<index_t>(pooled_h) * pooled_w;
  const index_t chunks = (C + kPoolChannels - 1) / kPoolChannels;
  for (index_t idx = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<index_t>(gridDim.x) * blockDim.x) {
    const index_t bin = idx % bins, t = idx / bins;
    const index_t chunk = t % chunks, k = t / chunks;
    const int ph = static_cast<int>(bin / pooled_w), pw = static_cast<int>(bin % pooled_w);
    const auto p = roi::pool_bin<acc_t>(rois + k * 5, N, spatial_scale, pooled_h, pooled_w, H, W, ph, pw);
    // One thread per roi reports a bad one.
    if (p.batch < 0 && chunk == 0 && bin == 0) roi_scatter::record_bad_roi(bad_rois, rois + k * 5, k, N);
    const index_t c0 = chunk * kPoolChannels;
    const int nc = static_cast<int>(C - c0 < kPoolChannels ? C - c0 : kPoolChannels);
    const index_t image = p.batch >= 0 ? static_cast<index_t>(p.batch) : index_t(0);
    const scalar_t* base = input + (image * C + c0) * plane;
    const bool empty = p.batch < 0 || p.h1 <= p.h0 || p.w1 <= p.w0;
    acc_t best[kPoolChannels];
    int32_t arg[kPoolChannels];
#pragma unroll
    for (int u = 0; u < kPoolChannels; ++u) {
      best[u] = static_cast<acc_t>(-FLT_MAX);
      arg[u] = -1;
    }
    if (!empty) {
      const int h0 = static_cast<int>(p.h0), h1 = static_cast<int>(p.h1);
      const int w0 = static_cast<int>(p.w0), w1 = static_cast<int>(p.w1);
      for (int h = h0; h < h1; ++h) {
        for (int w = w0; w < w1; ++w) {
          const int pixel = h * W + w;
          acc_t v[kPoolChannels];
#pragma unroll
          for (int u = 0; u < kPoolChannels; ++u) {
            v[u] = u < nc ? static_cast<acc_t>(base[static_cast<index_t>(u) * plane + pixel]) : acc_t(0);
          }
#pragma unroll
          for (int u = 0; u < kPoolChannels; ++u) {
            if (v[u] > best[u]) {  // torchvision's rule: the first pixel strictly above -FLT_MAX so far
              best[u] = v[u];
              arg[u] = pixel;
            }
          }
        }
      }
    }
    const index_t out = (k * C + c0) * bins + bin;
#pragma unroll
    for (int u = 0; u < kPoolChannels; ++u) {
      if (u < nc) {
        output[out + static_cast<index_t>(u) * bins] = static_cast<scalar_t>(empty ? acc_t(0) : best[u]);
        argmax[out + static_cast<index_t>(u) * bins] = arg[u];
      }
    }
  }
}

// Channels-last input: a block per tile (roi, channel chunk, bin tile); lanes read consecutive channels, the tile is
// staged in shared memory and written as runs of consecutive output addresses.
template <typename scalar_t, typename acc_t, typename index_t>
__global__ void __launch_bounds__(kThreads) roi_pool_forward_nhwc_kernel(
    Tiling tiling, const scalar_t* __restrict__ input_nhwc, const acc_t* __restrict__ rois, int64_t N, index_t C,
    int H, int W, int pooled_h, int pooled_w, acc_t spatial_scale, scalar_t* __restrict__ output,
    int32_t* __restrict__ argmax, int64_t* __restrict__ bad_rois) {
  __shared__ acc_t s_val[kTileSmem];
  __shared__ int32_t s_arg[kTileSmem];
  const index_t bins = static_cast<index_t>(pooled_h) * pooled_w;
  const index_t image = static_cast<index_t>(H) * W * C;
  for (int64_t tile = blockIdx.x; tile < tiling.num_tiles; tile += gridDim.x) {
    const Tile t(tiling, tile, C, bins);
    if (t.c0 == 0 && t.b0 == 0 && threadIdx.x == 0) roi_scatter::record_bad_roi(bad_rois, rois + t.k * 5, t.k, N);
    if (t.lane_c < t.nc) {
      const index_t c = static_cast<index_t>(t.c0) + t.lane_c;
      for (int b = t.first_b; b < t.nb; b += t.step_b) {
        const index_t bin = static_cast<index_t>(t.b0) + b;
        const auto p = roi::pool_bin<acc_t>(rois + t.k * 5, N, spatial_scale, pooled_h, pooled_w, H, W,
                                            static_cast<int>(bin / pooled_w), static_cast<int>(bin % pooled_w));
        const index_t img = p.batch >= 0 ? static_cast<index_t>(p.batch) : index_t(0);
        int32_t arg;
        s_val[t.lane_c * t.row + b] =
            pool_window<scalar_t, acc_t, index_t>(p, input_nhwc + img * image + c, C, W, arg);
        s_arg[t.lane_c * t.row + b] = arg;
      }
    }
    __syncthreads();
    const index_t out0 = (static_cast<index_t>(t.k) * C + static_cast<index_t>(t.c0)) * bins + static_cast<index_t>(t.b0);
    for (int i = threadIdx.x; i < t.nc * t.nb; i += blockDim.x) {
      const int cl = i / t.nb, b = i - cl * t.nb;
      const index_t o = out0 + static_cast<index_t>(cl) * bins + b;
      output[o] = static_cast<scalar_t>(s_val[cl * t.row + b]);
      argmax[o] = s_arg[cl * t.row + b];
    }
    __syncthreads();
  }
}

// Backward atomics straight into the N x C x H x W gradient: consecutive threads read consecutive argmax entries
// (and grad entries, grad being read through its strides) and add to pixels of one plane.
template <typename scalar_t, typename acc_t, typename index_t>
__global__ void roi_pool_backward_atomic_kernel(index_t total, const scalar_t* __restrict__ grad,
                                                roi_scatter::GradView<index_t> grad_view,
                                                const acc_t* __restrict__ rois, const int32_t* __restrict__ argmax,
                                                int64_t N, index_t C, index_t HW, index_t bins, int pooled_w,
                                                acc_t* __restrict__ grad_input) {
  for (index_t idx = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<index_t>(gridDim.x) * blockDim.x) {
    const int32_t a = argmax[idx];
    if (a < 0 || a >= HW) continue;
    const index_t kc = idx / bins;
    const index_t k = kc / C, c = kc - k * C;
    const acc_t b = rois[k * 5];
    if (!(b >= acc_t(0) && b < static_cast<acc_t>(N))) continue;
    const scalar_t g = grad[grad_view.offset(idx, k, c, idx - kc * bins, pooled_w)];
    atomicAdd(grad_input + (static_cast<index_t>(b) * C + c) * HW + a, static_cast<acc_t>(g));
  }
}

// Deterministic path: every pixel of every bin window is an entry; the segment sum keeps only the arg-max one.
template <typename acc_t>
__global__ void roi_pool_count_kernel(int64_t total, const acc_t* __restrict__ rois, int64_t N, int64_t H, int64_t W,
                                      int pooled_h, int pooled_w, acc_t spatial_scale, int64_t* __restrict__ counts) {
  const int64_t bins = static_cast<int64_t>(pooled_h) * pooled_w;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int ph = static_cast<int>((idx % bins) / pooled_w), pw = static_cast<int>(idx % pooled_w);
    const auto p = roi::pool_bin<acc_t>(rois + (idx / bins) * 5, N, spatial_scale, pooled_h, pooled_w, H, W, ph, pw);
    const bool empty = p.batch < 0 || p.h1 <= p.h0 || p.w1 <= p.w0;
    counts[idx] = empty ? 0 : (p.h1 - p.h0) * (p.w1 - p.w0);
  }
}

template <typename acc_t>
__global__ void roi_pool_fill_kernel(int64_t total, const acc_t* __restrict__ rois, const int64_t* __restrict__ offsets,
                                     int64_t N, int64_t H, int64_t W, int pooled_h, int pooled_w, acc_t spatial_scale,
                                     int64_t* __restrict__ key, int64_t* __restrict__ entry_bin,
                                     int32_t* __restrict__ sample, acc_t* __restrict__ weight) {
  const int64_t bins = static_cast<int64_t>(pooled_h) * pooled_w;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int ph = static_cast<int>((idx % bins) / pooled_w), pw = static_cast<int>(idx % pooled_w);
    const auto p = roi::pool_bin<acc_t>(rois + (idx / bins) * 5, N, spatial_scale, pooled_h, pooled_w, H, W, ph, pw);
    if (p.batch < 0 || p.h1 <= p.h0 || p.w1 <= p.w0) continue;
    int64_t e = offsets[idx];
    for (int64_t h = p.h0; h < p.h1; ++h) {
      for (int64_t w = p.w0; w < p.w1; ++w, ++e) {
        key[e] = p.batch * H * W + h * W + w;
        entry_bin[e] = idx;
        sample[e] = static_cast<int32_t>(h * W + w);
        weight[e] = acc_t(1);
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> roi_pool_forward_cuda(const at::Tensor& input_,
                                                                     const at::Tensor& rois_, double spatial_scale,
                                                                     int64_t pooled_h, int64_t pooled_w,
                                                                     bool record_bad_rois) {
  roi::check_roi_args("roi_pool", input_, rois_, pooled_h, pooled_w);
  check_cuda_tensor(input_, "roi_pool: input");
  LSS_CHECK(pooled_h <= INT_MAX && pooled_w <= INT_MAX, "roi_pool: output size must fit in 32 bits, got " +
                                                            std::to_string(pooled_h) + " x " + std::to_string(pooled_w));
  c10::cuda::CUDAGuard guard(input_.device());
  const auto rois = roi::rois_in_acc_type(rois_, input_);
  const int64_t K = rois.size(0), N = input_.size(0), C = input_.size(1), H = input_.size(2), W = input_.size(3);
  auto output = at::empty({K, C, pooled_h, pooled_w}, input_.options());
  auto argmax = at::empty({K, C, pooled_h, pooled_w}, input_.options().dtype(at::kInt));
  if (output.numel() == 0) return {output, argmax, roi_scatter::find_bad_rois(rois, N, record_bad_rois)};
  // Channels-last features are read in place by the channel-fastest kernel; everything else as NCHW.
  const bool nhwc = input_.suggest_memory_format() == at::MemoryFormat::ChannelsLast;
  const auto input = nhwc ? input_.contiguous(at::MemoryFormat::ChannelsLast) : input_.contiguous();
  const int64_t total = output.numel();
  const int ph = static_cast<int>(pooled_h), pw = static_cast<int>(pooled_w);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const auto bad_rois = roi_scatter::bad_roi_record(input, record_bad_rois);
  int64_t* record = roi_scatter::record_ptr(bad_rois);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "roi_pool_forward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t scale = static_cast<acc_t>(spatial_scale);
    roi_scatter::dispatch_index(roi_scatter::fits_int32({total, input.numel()}), [&](auto index_tag) {
      using index_t = decltype(index_tag);
      if (nhwc) {
        const auto tiling = roi_scatter::make_tiling(K, C, pooled_h * pooled_w);
        roi_pool_forward_nhwc_kernel<scalar_t, acc_t, index_t><<<roi_scatter::grid_for_tiles(tiling), kThreads, 0,
                                                                  stream>>>(
            tiling, input.data_ptr<scalar_t>(), rois.data_ptr<acc_t>(), N, static_cast<index_t>(C),
            static_cast<int>(H), static_cast<int>(W), ph, pw, scale, output.data_ptr<scalar_t>(),
            argmax.data_ptr<int32_t>(), record);
      } else {
        const int64_t threads = K * ceil_div(C, kPoolChannels) * pooled_h * pooled_w;
        roi_pool_forward_nchw_kernel<scalar_t, acc_t, index_t><<<roi_scatter::grid_for(threads), kThreads, 0,
                                                                  stream>>>(
            static_cast<index_t>(threads), input.data_ptr<scalar_t>(), rois.data_ptr<acc_t>(), N,
            static_cast<index_t>(C), static_cast<int>(H), static_cast<int>(W), ph, pw, scale,
            output.data_ptr<scalar_t>(), argmax.data_ptr<int32_t>(), record);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {output, argmax, bad_rois};
}

at::Tensor roi_pool_backward_cuda(const at::Tensor& grad_, const at::Tensor& rois_, const at::Tensor& argmax_,
                                  double spatial_scale, int64_t pooled_h, int64_t pooled_w, int64_t batch_size,
                                  int64_t channels, int64_t height, int64_t width) {
  check_cuda_tensor(grad_, "_roi_pool_backward: grad");
  roi::check_roi_grad("_roi_pool_backward", grad_, rois_, argmax_, true, channels, pooled_h, pooled_w);
  LSS_CHECK(pooled_w <= INT_MAX, "_roi_pool_backward: output width must fit in 32 bits, got " +
                                     std::to_string(pooled_w));
  c10::cuda::CUDAGuard guard(grad_.device());
  const bool deterministic = at::globalContext().deterministicAlgorithms();
  // The atomic kernel reads grad through its strides; the deterministic path's segment sums want it contiguous.
  const auto grad = deterministic ? grad_.contiguous() : grad_;
  const auto acc = grad.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto rois = rois_.to(acc).contiguous();
  const auto argmax = argmax_.to(at::kInt).contiguous();
  const int64_t K = rois.size(0), bins = pooled_h * pooled_w;
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (!deterministic) {
    // Accumulates in the gradient itself for float32/float64, else in a float32 NCHW buffer cast at the end.
    auto grad_input = roi_scatter::zeros_by_memset({batch_size, channels, height, width}, grad.options().dtype(acc));
    if (grad.numel() > 0 && grad_input.numel() > 0) {
      const int64_t total = grad.numel();
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "roi_pool_backward_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const bool small = roi_scatter::fits_int32({total, roi_scatter::extent(grad), grad_input.numel()});
        roi_scatter::dispatch_index(small, [&](auto index_tag) {
          using index_t = decltype(index_tag);
          roi_pool_backward_atomic_kernel<scalar_t, acc_t, index_t>
              <<<roi_scatter::grid_for(total), kThreads, 0, stream>>>(
                  static_cast<index_t>(total), grad.data_ptr<scalar_t>(), roi_scatter::grad_view<index_t>(grad),
                  rois.data_ptr<acc_t>(), argmax.data_ptr<int32_t>(), batch_size, static_cast<index_t>(channels),
                  static_cast<index_t>(height * width), static_cast<index_t>(bins), static_cast<int>(pooled_w),
                  grad_input.data_ptr<acc_t>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      });
    }
    return grad_input.scalar_type() == grad.scalar_type() ? grad_input : grad_input.to(grad.scalar_type());
  }
  auto grad_nhwc = roi_scatter::zeros_by_memset({batch_size, height, width, channels}, grad.options().dtype(acc));
  if (grad.numel() == 0 || grad_nhwc.numel() == 0) return roi_scatter::nhwc_to_nchw(grad_nhwc, grad.scalar_type());
  const int ph = static_cast<int>(pooled_h), pw = static_cast<int>(pooled_w);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "roi_pool_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t scale = static_cast<acc_t>(spatial_scale);
    const int64_t kbins = K * bins;
    auto counts = at::empty({kbins}, grad.options().dtype(at::kLong));
    roi_pool_count_kernel<acc_t><<<roi_scatter::grid_for(kbins), kThreads, 0, stream>>>(
        kbins, rois.data_ptr<acc_t>(), batch_size, height, width, ph, pw, scale, counts.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const auto [offsets, num_entries] = roi_scatter::exclusive_offsets(counts);
    auto entries = roi_scatter::alloc_entries(num_entries, grad, acc);
    if (num_entries == 0) return;
    roi_pool_fill_kernel<acc_t><<<roi_scatter::grid_for(kbins), kThreads, 0, stream>>>(
        kbins, rois.data_ptr<acc_t>(), offsets.data_ptr<int64_t>(), batch_size, height, width, ph, pw, scale,
        entries.key.data_ptr<int64_t>(), entries.bin.data_ptr<int64_t>(), entries.sample.data_ptr<int32_t>(),
        entries.weight.data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    roi_scatter::deterministic_scatter<scalar_t, acc_t>(entries, batch_size * height * width, grad, argmax,
                                                        grad_nhwc);
  });
  return roi_scatter::nhwc_to_nchw(grad_nhwc, grad.scalar_type());
}

}  // namespace
}  // namespace lss

TORCH_LIBRARY_IMPL(lss, CUDA, m) {
  m.impl("roi_pool", &lss::roi_pool_forward_cuda);
  m.impl("_roi_pool_backward", &lss::roi_pool_backward_cuda);
}
