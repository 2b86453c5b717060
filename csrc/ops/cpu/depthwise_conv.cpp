// CPU kernels of the depthwise convolution: one task per (image, channel) plane for the output and the input
// gradient, one per channel for the weight gradient; sums in double, so that they are the exact reference the CUDA
// kernels are tested against.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <tuple>
#include <vector>

#include "ops/common.h"
#include "ops/depthwise_conv.h"

namespace lss {
namespace depthwise_conv {
namespace {

// Calls tap(k, i) for every filter tap k = kh * KW + kw of output (oh, ow) whose input pixel i = ih * W + iw lies
// inside the (unpadded) image.
template <typename F>
inline void for_each_tap(const Geometry& g, int64_t oh, int64_t ow, F&& tap) {
  for (int64_t kh = 0; kh < g.kh; ++kh) {
    const int64_t ih = oh * g.sh - g.pt + kh;
    if (ih < 0 || ih >= g.h) continue;
    for (int64_t kw = 0; kw < g.kw; ++kw) {
      const int64_t iw = ow * g.sw - g.pl + kw;
      if (iw >= 0 && iw < g.w) tap(kh * g.kw + kw, ih * g.w + iw);
    }
  }
}

template <typename scalar_t, typename w_t>
void forward_kernel(const Geometry& g, const scalar_t* x, const w_t* w, scalar_t* y) {
  at::parallel_for(0, g.n * g.c, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const scalar_t* plane = x + p * g.h * g.w;
      const w_t* filter = w + (p % g.c) * g.kh * g.kw;
      scalar_t* out = y + p * g.oh * g.ow;
      for (int64_t oh = 0; oh < g.oh; ++oh) {
        for (int64_t ow = 0; ow < g.ow; ++ow) {
          double acc = 0;
          for_each_tap(g, oh, ow, [&](int64_t k, int64_t i) {
            acc += static_cast<double>(plane[i]) * static_cast<double>(filter[k]);
          });
          out[oh * g.ow + ow] = static_cast<scalar_t>(acc);
        }
      }
    }
  });
}

template <typename scalar_t, typename w_t>
void backward_kernel(const Geometry& g, const scalar_t* dy, const scalar_t* x, const w_t* w, scalar_t* dx,
                     w_t* dw) {
  // the input gradient: every output's gradient spread over its window, per plane
  at::parallel_for(0, g.n * g.c, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> acc(static_cast<size_t>(g.h * g.w));
    for (int64_t p = begin; p < end; ++p) {
      std::fill(acc.begin(), acc.end(), 0.0);
      const scalar_t* go = dy + p * g.oh * g.ow;
      const w_t* filter = w + (p % g.c) * g.kh * g.kw;
      for (int64_t oh = 0; oh < g.oh; ++oh) {
        for (int64_t ow = 0; ow < g.ow; ++ow) {
          const double v = static_cast<double>(go[oh * g.ow + ow]);
          for_each_tap(g, oh, ow, [&](int64_t k, int64_t i) { acc[i] += v * static_cast<double>(filter[k]); });
        }
      }
      scalar_t* out = dx + p * g.h * g.w;
      for (int64_t i = 0; i < g.h * g.w; ++i) out[i] = static_cast<scalar_t>(acc[i]);
    }
  });
  // the weight gradient: per channel, over every image and output position
  at::parallel_for(0, g.c, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> acc(static_cast<size_t>(g.kh * g.kw));
    for (int64_t c = begin; c < end; ++c) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t n = 0; n < g.n; ++n) {
        const scalar_t* plane = x + (n * g.c + c) * g.h * g.w;
        const scalar_t* go = dy + (n * g.c + c) * g.oh * g.ow;
        for (int64_t oh = 0; oh < g.oh; ++oh) {
          for (int64_t ow = 0; ow < g.ow; ++ow) {
            const double v = static_cast<double>(go[oh * g.ow + ow]);
            for_each_tap(g, oh, ow, [&](int64_t k, int64_t i) { acc[k] += v * static_cast<double>(plane[i]); });
          }
        }
      }
      for (int64_t k = 0; k < g.kh * g.kw; ++k) dw[c * g.kh * g.kw + k] = static_cast<w_t>(acc[k]);
    }
  });
}

at::Tensor forward_cpu(const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride,
                       at::IntArrayRef padding) {
  const Geometry g = check_forward(input, weight, stride, padding);
  check_cpu_tensor(input, "depthwise_conv2d: input");
  auto output = at::empty({g.n, g.c, g.oh, g.ow}, input.options());
  if (output.numel() == 0) return output;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "depthwise_conv2d_cpu", [&] {
    if (weight.scalar_type() == at::kFloat) {
      forward_kernel<scalar_t, float>(g, input.const_data_ptr<scalar_t>(), weight.const_data_ptr<float>(),
                                      output.mutable_data_ptr<scalar_t>());
    } else {
      forward_kernel<scalar_t, scalar_t>(g, input.const_data_ptr<scalar_t>(), weight.const_data_ptr<scalar_t>(),
                                         output.mutable_data_ptr<scalar_t>());
    }
  });
  return output;
}

std::tuple<at::Tensor, at::Tensor> backward_cpu(const at::Tensor& grad_output, const at::Tensor& input,
                                                const at::Tensor& weight, at::IntArrayRef stride,
                                                at::IntArrayRef padding) {
  const Geometry g = check_backward(grad_output, input, weight, stride, padding);
  check_cpu_tensor(input, "_depthwise_conv2d_backward: input");
  auto grad_input = at::zeros_like(input, at::MemoryFormat::Contiguous);
  auto grad_weight = at::zeros_like(weight, at::MemoryFormat::Contiguous);
  if (grad_output.numel() == 0) return {grad_input, grad_weight};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "depthwise_conv2d_backward_cpu",
                                  [&] {
    if (weight.scalar_type() == at::kFloat) {
      backward_kernel<scalar_t, float>(g, grad_output.const_data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(),
                                       weight.const_data_ptr<float>(), grad_input.mutable_data_ptr<scalar_t>(),
                                       grad_weight.mutable_data_ptr<float>());
    } else {
      backward_kernel<scalar_t, scalar_t>(g, grad_output.const_data_ptr<scalar_t>(),
                                          input.const_data_ptr<scalar_t>(), weight.const_data_ptr<scalar_t>(),
                                          grad_input.mutable_data_ptr<scalar_t>(),
                                          grad_weight.mutable_data_ptr<scalar_t>());
    }
  });
  return {grad_input, grad_weight};
}

}  // namespace
}  // namespace depthwise_conv
}  // namespace lss

TORCH_LIBRARY_IMPL(lss, CPU, m) {
  m.impl("depthwise_conv2d", &lss::depthwise_conv::forward_cpu);
  m.impl("_depthwise_conv2d_backward", &lss::depthwise_conv::backward_cpu);
}
