// CPU kernels of the training-mode batch norm: one task per channel, statistics accumulated in double (two passes:
// the mean, then the squared deviations), so that they are the exact reference the CUDA kernels are tested against.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <tuple>

#include "ops/batch_norm.h"
#include "ops/common.h"

namespace lss {
namespace batch_norm {
namespace {

using Triple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// The input as N x C x S.
struct Shape {
  int64_t n, c, s;
};

Shape shape_of(const at::Tensor& input) {
  const int64_t n = input.size(0), c = input.size(1);
  return {n, c, n * c == 0 ? 0 : input.numel() / (n * c)};
}

template <typename scalar_t>
void forward_kernel(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias, double eps,
                    at::Tensor& output, at::Tensor& mean, at::Tensor& invstd) {
  using T = at::opmath_type<scalar_t>;
  const Shape sh = shape_of(input);
  const scalar_t* x = input.const_data_ptr<scalar_t>();
  scalar_t* y = output.mutable_data_ptr<scalar_t>();
  const float* w = weight.const_data_ptr<float>();
  const float* b = bias.const_data_ptr<float>();
  float* mean_out = mean.mutable_data_ptr<float>();
  float* invstd_out = invstd.mutable_data_ptr<float>();
  const double count = static_cast<double>(sh.n * sh.s);
  at::parallel_for(0, sh.c, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      double sum = 0;
      for (int64_t n = 0; n < sh.n; ++n) {
        const scalar_t* row = x + (n * sh.c + c) * sh.s;
        for (int64_t i = 0; i < sh.s; ++i) sum += static_cast<double>(row[i]);
      }
      const double mu = sum / count;
      double sq = 0;
      for (int64_t n = 0; n < sh.n; ++n) {
        const scalar_t* row = x + (n * sh.c + c) * sh.s;
        for (int64_t i = 0; i < sh.s; ++i) {
          const double d = static_cast<double>(row[i]) - mu;
          sq += d * d;
        }
      }
      const double inv = 1.0 / std::sqrt(sq / count + eps);
      mean_out[c] = static_cast<float>(mu);
      invstd_out[c] = static_cast<float>(inv);
      const T scale = static_cast<T>(static_cast<double>(w[c]) * inv);
      const T shift = static_cast<T>(static_cast<double>(b[c]) - mu * static_cast<double>(w[c]) * inv);
      for (int64_t n = 0; n < sh.n; ++n) {
        const int64_t off = (n * sh.c + c) * sh.s;
        for (int64_t i = 0; i < sh.s; ++i) {
          y[off + i] = static_cast<scalar_t>(static_cast<T>(x[off + i]) * scale + shift);
        }
      }
    }
  });
}

template <typename scalar_t>
void backward_kernel(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
                     const at::Tensor& mean, const at::Tensor& invstd, at::Tensor& grad_input,
                     at::Tensor& grad_weight, at::Tensor& grad_bias) {
  using T = at::opmath_type<scalar_t>;
  const Shape sh = shape_of(input);
  const scalar_t* dy = grad_output.const_data_ptr<scalar_t>();
  const scalar_t* x = input.const_data_ptr<scalar_t>();
  scalar_t* dx = grad_input.mutable_data_ptr<scalar_t>();
  const float* w = weight.const_data_ptr<float>();
  const float* mu = mean.const_data_ptr<float>();
  const float* inv = invstd.const_data_ptr<float>();
  float* dw = grad_weight.mutable_data_ptr<float>();
  float* db = grad_bias.mutable_data_ptr<float>();
  const double count = static_cast<double>(sh.n * sh.s);
  at::parallel_for(0, sh.c, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      double sum_dy = 0, sum_dy_xmu = 0;
      const double m = mu[c], is = inv[c];
      for (int64_t n = 0; n < sh.n; ++n) {
        const int64_t off = (n * sh.c + c) * sh.s;
        for (int64_t i = 0; i < sh.s; ++i) {
          const double g = static_cast<double>(dy[off + i]);
          sum_dy += g;
          sum_dy_xmu += g * (static_cast<double>(x[off + i]) - m);
        }
      }
      const double dweight = sum_dy_xmu * is;
      dw[c] = static_cast<float>(dweight);
      db[c] = static_cast<float>(sum_dy);
      // dx = k (dy - sum_dy / M - xhat * dweight / M), k = w * invstd, xhat = (x - mean) * invstd
      const double k = static_cast<double>(w[c]) * is;
      const T a = static_cast<T>(k);
      const T bx = static_cast<T>(-k * is * dweight / count);
      const T cst = static_cast<T>(-k * sum_dy / count + k * is * dweight / count * m);
      for (int64_t n = 0; n < sh.n; ++n) {
        const int64_t off = (n * sh.c + c) * sh.s;
        for (int64_t i = 0; i < sh.s; ++i) {
          dx[off + i] = static_cast<scalar_t>(a * static_cast<T>(dy[off + i]) + bx * static_cast<T>(x[off + i]) + cst);
        }
      }
    }
  });
}

Triple forward_cpu(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  check_forward(input, weight, bias, eps);
  check_cpu_tensor(input, "batch_norm_train: input");
  auto output = at::empty_like(input, at::MemoryFormat::Contiguous);
  auto mean = at::empty({input.size(1)}, input.options().dtype(at::kFloat));
  auto invstd = at::empty_like(mean);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "batch_norm_train_cpu", [&] {
    forward_kernel<scalar_t>(input, weight, bias, eps, output, mean, invstd);
  });
  return {output, mean, invstd};
}

Triple backward_cpu(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
                    const at::Tensor& mean, const at::Tensor& invstd) {
  check_backward(grad_output, input, weight, mean, invstd);
  check_cpu_tensor(input, "_batch_norm_train_backward: input");
  auto grad_input = at::empty_like(input, at::MemoryFormat::Contiguous);
  auto grad_weight = at::empty_like(weight);
  auto grad_bias = at::empty_like(weight);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "batch_norm_train_backward_cpu",
                                  [&] {
                                    backward_kernel<scalar_t>(grad_output, input, weight, mean, invstd, grad_input,
                                                              grad_weight, grad_bias);
                                  });
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace
}  // namespace batch_norm
}  // namespace lss

TORCH_LIBRARY_IMPL(lss, CPU, m) {
  m.impl("batch_norm_train", &lss::batch_norm::forward_cpu);
  m.impl("_batch_norm_train_backward", &lss::batch_norm::backward_cpu);
}
