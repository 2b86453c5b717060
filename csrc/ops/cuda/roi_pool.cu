// CUDA RoIPool: channels-last reads (warp lanes = consecutive channels of one pixel); backward through the
// channels-last float buffer of roi_scatter.cuh (coalesced atomics, or the deterministic segment sum).
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <cfloat>

#include "ops/cuda/roi_scatter.cuh"
#include "ops/roi_common.h"

namespace lss {
namespace {

template <typename scalar_t, typename acc_t>
__global__ void roi_pool_forward_kernel(int64_t total, const scalar_t* __restrict__ input_nhwc,
                                        const acc_t* __restrict__ rois, int64_t N, int64_t C, int64_t H, int64_t W,
                                        int pooled_h, int pooled_w, acc_t spatial_scale,
                                        scalar_t* __restrict__ output, int32_t* __restrict__ argmax) {
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = idx % C;
    int64_t t = idx / C;
    const int pw = static_cast<int>(t % pooled_w);
    t /= pooled_w;
    const int ph = static_cast<int>(t % pooled_h);
    const int64_t k = t / pooled_h;
    const auto p = roi::pool_bin<acc_t>(rois + k * 5, N, spatial_scale, pooled_h, pooled_w, H, W, ph, pw);
    const bool empty = p.batch < 0 || p.h1 <= p.h0 || p.w1 <= p.w0;
    // torchvision's rule: an empty bin is 0; otherwise the first pixel strictly above -FLT_MAX so far.
    acc_t best = empty ? acc_t(0) : static_cast<acc_t>(-FLT_MAX);
    int32_t best_i = -1;
    if (!empty) {
      const scalar_t* base = input_nhwc + p.batch * H * W * C + c;
      for (int64_t h = p.h0; h < p.h1; ++h) {
        for (int64_t w = p.w0; w < p.w1; ++w) {
          const acc_t v = static_cast<acc_t>(base[(h * W + w) * C]);
          if (v > best) {
            best = v;
            best_i = static_cast<int32_t>(h * W + w);
          }
        }
      }
    }
    const int64_t out_i = ((k * C + c) * pooled_h + ph) * pooled_w + pw;
    output[out_i] = static_cast<scalar_t>(best);
    argmax[out_i] = best_i;
  }
}

template <typename scalar_t, typename acc_t>
__global__ void roi_pool_backward_atomic_kernel(int64_t total, const scalar_t* __restrict__ grad,
                                                const acc_t* __restrict__ rois, const int32_t* __restrict__ argmax,
                                                int64_t N, int64_t C, int64_t HW, int64_t bins,
                                                acc_t* __restrict__ grad_nhwc) {
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = idx % C;
    const int64_t kb = idx / C;
    const int64_t k = kb / bins;
    const acc_t b = rois[k * 5];
    if (!(b >= acc_t(0) && b < static_cast<acc_t>(N))) continue;
    const int64_t g_i = (k * C + c) * bins + kb % bins;
    const int32_t a = argmax[g_i];
    if (a < 0 || a >= HW) continue;
    atomicAdd(grad_nhwc + (static_cast<int64_t>(b) * HW + a) * C + c, static_cast<acc_t>(grad[g_i]));
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

std::tuple<at::Tensor, at::Tensor> roi_pool_forward_cuda(const at::Tensor& input_, const at::Tensor& rois_,
                                                         double spatial_scale, int64_t pooled_h, int64_t pooled_w) {
  roi::check_roi_args("roi_pool", input_, rois_, pooled_h, pooled_w);
  check_cuda_tensor(input_, "roi_pool: input");
  c10::cuda::CUDAGuard guard(input_.device());
  const auto rois = roi::rois_in_acc_type(rois_, input_);
  const int64_t K = rois.size(0), N = input_.size(0), C = input_.size(1), H = input_.size(2), W = input_.size(3);
  auto output = at::empty({K, C, pooled_h, pooled_w}, input_.options());
  auto argmax = at::empty({K, C, pooled_h, pooled_w}, input_.options().dtype(at::kInt));
  if (output.numel() == 0) return {output, argmax};
  const auto input = input_.contiguous(at::MemoryFormat::ChannelsLast);
  const int64_t total = output.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "roi_pool_forward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    roi_pool_forward_kernel<scalar_t, acc_t>
        <<<roi_scatter::grid_for(total), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
            total, input.data_ptr<scalar_t>(), rois.data_ptr<acc_t>(), N, C, H, W, static_cast<int>(pooled_h),
            static_cast<int>(pooled_w), static_cast<acc_t>(spatial_scale), output.data_ptr<scalar_t>(),
            argmax.data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {output, argmax};
}

at::Tensor roi_pool_backward_cuda(const at::Tensor& grad_, const at::Tensor& rois_, const at::Tensor& argmax_,
                                  double spatial_scale, int64_t pooled_h, int64_t pooled_w, int64_t batch_size,
                                  int64_t channels, int64_t height, int64_t width) {
  check_cuda_tensor(grad_, "_roi_pool_backward: grad");
  roi::check_roi_grad("_roi_pool_backward", grad_, rois_, argmax_, true, channels, pooled_h, pooled_w);
  c10::cuda::CUDAGuard guard(grad_.device());
  const auto grad = grad_.contiguous();
  const auto acc = grad.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto rois = rois_.to(acc).contiguous();
  const auto argmax = argmax_.to(at::kInt).contiguous();
  auto grad_nhwc = at::zeros({batch_size, height, width, channels}, grad.options().dtype(acc));
  if (grad.numel() == 0 || grad_nhwc.numel() == 0) return roi_scatter::nhwc_to_nchw(grad_nhwc, grad.scalar_type());
  const int64_t K = rois.size(0), bins = pooled_h * pooled_w;
  const int ph = static_cast<int>(pooled_h), pw = static_cast<int>(pooled_w);
  const bool deterministic = at::globalContext().deterministicAlgorithms();
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "roi_pool_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t scale = static_cast<acc_t>(spatial_scale);
    if (!deterministic) {
      const int64_t total = grad.numel();
      roi_pool_backward_atomic_kernel<scalar_t, acc_t><<<roi_scatter::grid_for(total), kThreads, 0, stream>>>(
          total, grad.data_ptr<scalar_t>(), rois.data_ptr<acc_t>(), argmax.data_ptr<int32_t>(), batch_size,
          channels, height * width, bins, grad_nhwc.data_ptr<acc_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
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
