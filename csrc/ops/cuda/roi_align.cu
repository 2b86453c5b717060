// CUDA RoIAlign. Features are read channels-last (one transposing copy unless already channels_last) so the
// threads of a warp share one (roi, bin) and its bilinear weights and read consecutive channels of one pixel.
// Backward accumulates into a channels-last float buffer: coalesced atomics by default, a sort-based segment sum
// when torch.use_deterministic_algorithms(True) is on.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "ops/cuda/roi_scatter.cuh"
#include "ops/roi_common.h"

namespace lss {
namespace {

template <typename scalar_t, typename acc_t>
__global__ void roi_align_forward_kernel(int64_t total, const scalar_t* __restrict__ input_nhwc,
                                         const acc_t* __restrict__ rois, int64_t N, int64_t C, int64_t H, int64_t W,
                                         int pooled_h, int pooled_w, acc_t spatial_scale, int sampling_ratio,
                                         bool aligned, bool max_mode, scalar_t* __restrict__ output,
                                         int32_t* __restrict__ argmax) {
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = idx % C;
    int64_t t = idx / C;
    const int pw = static_cast<int>(t % pooled_w);
    t /= pooled_w;
    const int ph = static_cast<int>(t % pooled_h);
    const int64_t k = t / pooled_h;
    const auto r = roi::align_roi<acc_t>(rois + k * 5, N, spatial_scale, pooled_h, pooled_w, sampling_ratio, aligned);
    const int64_t out_i = ((k * C + c) * pooled_h + ph) * pooled_w + pw;
    acc_t sum = acc_t(0), best = acc_t(0);
    int32_t best_i = -1;
    if (r.batch >= 0) {
      const scalar_t* base = input_nhwc + r.batch * H * W * C + c;
      for (int iy = 0; iy < r.grid_h; ++iy) {
        const acc_t y = r.sample_y(ph, iy);
        for (int ix = 0; ix < r.grid_w; ++ix) {
          const auto b = roi::bilinear<acc_t>(H, W, y, r.sample_x(pw, ix));
          acc_t v = acc_t(0);
          if (b.valid) {
            v = b.w1 * static_cast<acc_t>(base[b.o1 * C]) + b.w2 * static_cast<acc_t>(base[b.o2 * C]) +
                b.w3 * static_cast<acc_t>(base[b.o3 * C]) + b.w4 * static_cast<acc_t>(base[b.o4 * C]);
          }
          sum += v;
          // The first maximum wins; a NaN sample becomes (and stays) the maximum, like torch.max.
          if (best_i < 0 || v > best || (v != v && best == best)) {
            best = v;
            best_i = iy * r.grid_w + ix;
          }
        }
      }
    }
    if (max_mode) {
      output[out_i] = static_cast<scalar_t>(best_i < 0 ? acc_t(0) : best);
      argmax[out_i] = best_i;
    } else {
      output[out_i] = static_cast<scalar_t>(sum / r.count);
    }
  }
}

template <typename scalar_t, typename acc_t>
__global__ void roi_align_backward_atomic_kernel(int64_t total, const scalar_t* __restrict__ grad,
                                                 const acc_t* __restrict__ rois, const int32_t* __restrict__ argmax,
                                                 int64_t N, int64_t C, int64_t H, int64_t W, int pooled_h,
                                                 int pooled_w, acc_t spatial_scale, int sampling_ratio, bool aligned,
                                                 bool max_mode, acc_t* __restrict__ grad_nhwc) {
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = idx % C;
    int64_t t = idx / C;
    const int pw = static_cast<int>(t % pooled_w);
    t /= pooled_w;
    const int ph = static_cast<int>(t % pooled_h);
    const int64_t k = t / pooled_h;
    const auto r = roi::align_roi<acc_t>(rois + k * 5, N, spatial_scale, pooled_h, pooled_w, sampling_ratio, aligned);
    if (r.batch < 0) continue;
    const int64_t g_i = ((k * C + c) * pooled_h + ph) * pooled_w + pw;
    const acc_t g = static_cast<acc_t>(grad[g_i]);
    acc_t* base = grad_nhwc + r.batch * H * W * C + c;
    const int32_t only = max_mode ? argmax[g_i] : -1;
    if (max_mode && only < 0) continue;
    const acc_t s = max_mode ? g : g / r.count;
    for (int iy = 0; iy < r.grid_h; ++iy) {
      const acc_t y = r.sample_y(ph, iy);
      for (int ix = 0; ix < r.grid_w; ++ix) {
        if (max_mode && only != iy * r.grid_w + ix) continue;
        const auto b = roi::bilinear<acc_t>(H, W, y, r.sample_x(pw, ix));
        if (!b.valid) continue;
        atomicAdd(base + b.o1 * C, s * b.w1);
        atomicAdd(base + b.o2 * C, s * b.w2);
        atomicAdd(base + b.o3 * C, s * b.w3);
        atomicAdd(base + b.o4 * C, s * b.w4);
      }
    }
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

std::tuple<at::Tensor, at::Tensor> roi_align_forward_cuda(const at::Tensor& input_, const at::Tensor& rois_,
                                                          double spatial_scale, int64_t pooled_h, int64_t pooled_w,
                                                          int64_t sampling_ratio, bool aligned, bool max_mode) {
  roi::check_roi_args("roi_align", input_, rois_, pooled_h, pooled_w);
  check_cuda_tensor(input_, "roi_align: input");
  c10::cuda::CUDAGuard guard(input_.device());
  const auto rois = roi::rois_in_acc_type(rois_, input_);
  const int64_t K = rois.size(0), N = input_.size(0), C = input_.size(1), H = input_.size(2), W = input_.size(3);
  auto output = at::empty({K, C, pooled_h, pooled_w}, input_.options());
  const auto int_opts = input_.options().dtype(at::kInt);
  auto argmax = max_mode ? at::empty({K, C, pooled_h, pooled_w}, int_opts) : at::empty({0}, int_opts);
  if (output.numel() == 0) return {output, argmax};
  const auto input = input_.contiguous(at::MemoryFormat::ChannelsLast);
  const int64_t total = output.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "roi_align_forward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    roi_align_forward_kernel<scalar_t, acc_t>
        <<<roi_scatter::grid_for(total), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
            total, input.data_ptr<scalar_t>(), rois.data_ptr<acc_t>(), N, C, H, W, static_cast<int>(pooled_h),
            static_cast<int>(pooled_w), static_cast<acc_t>(spatial_scale), static_cast<int>(sampling_ratio),
            aligned, max_mode, output.data_ptr<scalar_t>(), max_mode ? argmax.data_ptr<int32_t>() : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {output, argmax};
}

at::Tensor roi_align_backward_cuda(const at::Tensor& grad_, const at::Tensor& rois_, const at::Tensor& argmax_,
                                   double spatial_scale, int64_t pooled_h, int64_t pooled_w, int64_t batch_size,
                                   int64_t channels, int64_t height, int64_t width, int64_t sampling_ratio,
                                   bool aligned, bool max_mode) {
  check_cuda_tensor(grad_, "_roi_align_backward: grad");
  roi::check_roi_grad("_roi_align_backward", grad_, rois_, argmax_, max_mode, channels, pooled_h, pooled_w);
  c10::cuda::CUDAGuard guard(grad_.device());
  const auto grad = grad_.contiguous();
  const auto acc = grad.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto rois = rois_.to(acc).contiguous();
  const auto argmax = max_mode ? argmax_.to(at::kInt).contiguous() : at::Tensor();
  auto grad_nhwc = at::zeros({batch_size, height, width, channels}, grad.options().dtype(acc));
  if (grad.numel() == 0 || grad_nhwc.numel() == 0) return roi_scatter::nhwc_to_nchw(grad_nhwc, grad.scalar_type());
  const int64_t K = rois.size(0);
  const int ph = static_cast<int>(pooled_h), pw = static_cast<int>(pooled_w), sr = static_cast<int>(sampling_ratio);
  const bool deterministic = at::globalContext().deterministicAlgorithms();
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "roi_align_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t scale = static_cast<acc_t>(spatial_scale);
    if (!deterministic) {
      const int64_t total = grad.numel();
      roi_align_backward_atomic_kernel<scalar_t, acc_t><<<roi_scatter::grid_for(total), kThreads, 0, stream>>>(
          total, grad.data_ptr<scalar_t>(), rois.data_ptr<acc_t>(), max_mode ? argmax.data_ptr<int32_t>() : nullptr,
          batch_size, channels, height, width, ph, pw, scale, sr, aligned, max_mode, grad_nhwc.data_ptr<acc_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
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
