// CUDA kernels of the training-mode batch norm on contiguous N x C x S inputs (NCHW). PyTorch's own NCHW kernels for
// bfloat16 read each channel with one block row at a time; here every pass is spread over the whole device and reads
// 16 bytes per load:
//   forward:  partial sums of each channel over row segments (blocks C x parts), one thread per channel combining
//             them into mean, invstd and the affine scale and shift, then one elementwise pass y = x * scale + shift;
//   backward: partial sums of dy and dy * (x - mean) the same way, the per-channel coefficients, then one pass
//             dx = a * dy + b * x + c.
// The statistics are shifted sums: every thread of channel c accumulates (x - K) and (x - K)^2 with K = x[0, c, 0],
// so partial sums add up exactly as they are (no merging of means), and the variance does not cancel away when the
// channel's mean is large against its spread. Partial sums are float (double for double inputs); the combination is
// in double.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <type_traits>

#include "ops/batch_norm.h"
#include "ops/common.h"

namespace lss {
namespace batch_norm {
namespace {

using Triple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

constexpr int kBlock = 256;
constexpr int64_t kSegment = 4096;  // elements of one row a reduction block reads before moving to its next segment

int sm_count() {
  int device = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

template <typename scalar_t, int V>
struct alignas(sizeof(scalar_t) * V) Vec {
  scalar_t v[V];
};

template <typename scalar_t, int V, typename acc_t>
__device__ __forceinline__ void load(const scalar_t* p, acc_t (&out)[V]) {
  const Vec<scalar_t, V> vec = *reinterpret_cast<const Vec<scalar_t, V>*>(p);
#pragma unroll
  for (int j = 0; j < V; ++j) out[j] = static_cast<acc_t>(vec.v[j]);
}

template <typename scalar_t, int V, typename acc_t>
__device__ __forceinline__ void store(scalar_t* p, const acc_t (&in)[V]) {
  Vec<scalar_t, V> vec;
#pragma unroll
  for (int j = 0; j < V; ++j) vec.v[j] = static_cast<scalar_t>(in[j]);
  *reinterpret_cast<Vec<scalar_t, V>*>(p) = vec;
}

// Sum of a and b over the block (kBlock threads); the result is valid in thread 0.
template <typename acc_t>
__device__ __forceinline__ void block_sum2(acc_t& a, acc_t& b) {
  __shared__ acc_t sa[kBlock / 32], sb[kBlock / 32];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    a += __shfl_down_sync(0xffffffffu, a, off);
    b += __shfl_down_sync(0xffffffffu, b, off);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    sa[warp] = a;
    sb[warp] = b;
  }
  __syncthreads();
  if (warp == 0) {
    a = lane < kBlock / 32 ? sa[lane] : acc_t(0);
    b = lane < kBlock / 32 ? sb[lane] : acc_t(0);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      a += __shfl_down_sync(0xffffffffu, a, off);
      b += __shfl_down_sync(0xffffffffu, b, off);
    }
  }
}

// Block (c, part) sums over the segments part, part + parts, ... of channel c's N rows: forward (dy == nullptr)
// (x - K) and (x - K)^2 with K = x[0, c, 0]; backward dy and dy * (x - mean[c]). partial: C x parts x 2.
template <typename scalar_t, int V, typename acc_t>
__global__ void __launch_bounds__(kBlock) reduce_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ dy,
                                                        const float* __restrict__ mean, int64_t N, int64_t C,
                                                        int64_t S, int64_t segments_per_row,
                                                        acc_t* __restrict__ partial) {
  const int64_t c = blockIdx.x;
  const int64_t part = blockIdx.y, parts = gridDim.y;
  const acc_t shift = dy == nullptr ? static_cast<acc_t>(x[c * S]) : static_cast<acc_t>(mean[c]);
  acc_t s1 = 0, s2 = 0;
  const int64_t units = N * segments_per_row;
  for (int64_t u = part; u < units; u += parts) {
    const int64_t n = u / segments_per_row;
    const int64_t start = (u - n * segments_per_row) * kSegment;
    const int64_t len = S - start < kSegment ? S - start : kSegment;
    const int64_t row = (n * C + c) * S + start;
    for (int64_t i = static_cast<int64_t>(threadIdx.x) * V; i < len; i += static_cast<int64_t>(kBlock) * V) {
      acc_t xv[V];
      load<scalar_t, V, acc_t>(x + row + i, xv);
      if (dy == nullptr) {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const acc_t d = xv[j] - shift;
          s1 += d;
          s2 += d * d;
        }
      } else {
        acc_t gv[V];
        load<scalar_t, V, acc_t>(dy + row + i, gv);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          s1 += gv[j];
          s2 += gv[j] * (xv[j] - shift);
        }
      }
    }
  }
  block_sum2(s1, s2);
  if (threadIdx.x == 0) {
    partial[(c * parts + part) * 2] = s1;
    partial[(c * parts + part) * 2 + 1] = s2;
  }
}

// One thread per channel: the forward's mean, invstd and the affine scale and shift (coef: C x 2).
template <typename scalar_t, typename acc_t>
__global__ void forward_finalize_kernel(const scalar_t* __restrict__ x, const acc_t* __restrict__ partial,
                                        const float* __restrict__ weight, const float* __restrict__ bias,
                                        int64_t C, int64_t S, int parts, double count, double eps,
                                        float* __restrict__ mean, float* __restrict__ invstd,
                                        acc_t* __restrict__ coef) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  double s1 = 0, s2 = 0;
  for (int p = 0; p < parts; ++p) {
    s1 += static_cast<double>(partial[(c * parts + p) * 2]);
    s2 += static_cast<double>(partial[(c * parts + p) * 2 + 1]);
  }
  const double d = s1 / count;
  const double mu = static_cast<double>(static_cast<acc_t>(x[c * S])) + d;
  double var = s2 / count - d * d;
  var = var > 0 ? var : 0;
  const double inv = 1.0 / sqrt(var + eps);
  mean[c] = static_cast<float>(mu);
  invstd[c] = static_cast<float>(inv);
  const double scale = static_cast<double>(weight[c]) * inv;
  coef[c * 2] = static_cast<acc_t>(scale);
  coef[c * 2 + 1] = static_cast<acc_t>(static_cast<double>(bias[c]) - mu * scale);
}

// One thread per channel: the gradients of the weight and bias, and dx = a * dy + b * x + c (coef: C x 3).
template <typename acc_t>
__global__ void backward_finalize_kernel(const acc_t* __restrict__ partial, const float* __restrict__ weight,
                                         const float* __restrict__ mean, const float* __restrict__ invstd,
                                         int64_t C, int parts, double count, float* __restrict__ grad_weight,
                                         float* __restrict__ grad_bias, acc_t* __restrict__ coef) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  double sum_dy = 0, sum_dy_xmu = 0;
  for (int p = 0; p < parts; ++p) {
    sum_dy += static_cast<double>(partial[(c * parts + p) * 2]);
    sum_dy_xmu += static_cast<double>(partial[(c * parts + p) * 2 + 1]);
  }
  const double inv = invstd[c], mu = mean[c];
  const double dweight = sum_dy_xmu * inv;
  grad_weight[c] = static_cast<float>(dweight);
  grad_bias[c] = static_cast<float>(sum_dy);
  const double k = static_cast<double>(weight[c]) * inv;
  coef[c * 3] = static_cast<acc_t>(k);
  coef[c * 3 + 1] = static_cast<acc_t>(-k * inv * dweight / count);
  coef[c * 3 + 2] = static_cast<acc_t>(-k * sum_dy / count + k * inv * dweight / count * mu);
}

// Elementwise over all N x C x S values, V at a time (S % V == 0: a vector never straddles two channels): forward
// y = x * coef[c, 0] + coef[c, 1] (dy == nullptr, coef C x 2), backward y = coef[c, 0] * dy + coef[c, 1] * x +
// coef[c, 2] (coef C x 3).
template <typename scalar_t, int V, typename acc_t>
__global__ void __launch_bounds__(kBlock) apply_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ dy,
                                                       scalar_t* __restrict__ y, int64_t C, int64_t S,
                                                       int64_t vectors, const acc_t* __restrict__ coef) {
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < vectors;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = v * V;
    const int64_t c = (e / S) % C;
    acc_t xv[V], out[V];
    load<scalar_t, V, acc_t>(x + e, xv);
    if (dy == nullptr) {
      const acc_t scale = coef[c * 2], shift = coef[c * 2 + 1];
#pragma unroll
      for (int j = 0; j < V; ++j) out[j] = xv[j] * scale + shift;
    } else {
      acc_t gv[V];
      load<scalar_t, V, acc_t>(dy + e, gv);
      const acc_t a = coef[c * 3], b = coef[c * 3 + 1], k = coef[c * 3 + 2];
#pragma unroll
      for (int j = 0; j < V; ++j) out[j] = a * gv[j] + b * xv[j] + k;
    }
    store<scalar_t, V, acc_t>(y + e, out);
  }
}

struct Launch {
  int64_t n, c, s, segments_per_row;
  int parts;
  int64_t apply_blocks;
};

Launch plan(const at::Tensor& input) {
  Launch l;
  l.n = input.size(0);
  l.c = input.size(1);
  l.s = input.numel() / (l.n * l.c);
  l.segments_per_row = ceil_div(l.s, kSegment);
  const int sms = sm_count();
  const int64_t units = l.n * l.segments_per_row;
  const int64_t wanted = ceil_div(static_cast<int64_t>(sms) * 8, l.c);  // about 8 reduction blocks per SM in all
  l.parts = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({wanted, units, 65535})));
  l.apply_blocks = static_cast<int64_t>(sms) * 16;
  return l;
}

// V elements per load where every row start stays 16-byte aligned, else 1.
template <typename scalar_t>
bool vectorizable(const at::Tensor& t, int64_t s) {
  constexpr int V = 16 / sizeof(scalar_t);
  return s % V == 0 && reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

template <typename scalar_t, int V>
void forward_launch(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias, double eps,
                    at::Tensor& output, at::Tensor& mean, at::Tensor& invstd) {
  using acc_t = at::opmath_type<scalar_t>;
  const Launch l = plan(input);
  const auto acc_dtype = std::is_same_v<acc_t, double> ? at::kDouble : at::kFloat;
  auto partial = at::empty({l.c * l.parts * 2}, input.options().dtype(acc_dtype));
  auto coef = at::empty({l.c * 2}, input.options().dtype(acc_dtype));
  const auto stream = at::cuda::getCurrentCUDAStream();
  const scalar_t* x = input.const_data_ptr<scalar_t>();
  reduce_kernel<scalar_t, V, acc_t><<<dim3(static_cast<unsigned>(l.c), l.parts), kBlock, 0, stream>>>(
      x, nullptr, nullptr, l.n, l.c, l.s, l.segments_per_row, partial.mutable_data_ptr<acc_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  forward_finalize_kernel<scalar_t, acc_t><<<static_cast<unsigned>(ceil_div(l.c, kBlock)), kBlock, 0, stream>>>(
      x, partial.const_data_ptr<acc_t>(), weight.const_data_ptr<float>(), bias.const_data_ptr<float>(), l.c, l.s,
      l.parts, static_cast<double>(l.n * l.s), eps, mean.mutable_data_ptr<float>(), invstd.mutable_data_ptr<float>(),
      coef.mutable_data_ptr<acc_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t vectors = input.numel() / V;
  const auto blocks = static_cast<unsigned>(std::max<int64_t>(1, std::min(ceil_div(vectors, kBlock), l.apply_blocks)));
  apply_kernel<scalar_t, V, acc_t><<<blocks, kBlock, 0, stream>>>(x, nullptr, output.mutable_data_ptr<scalar_t>(), l.c,
                                                                 l.s, vectors, coef.const_data_ptr<acc_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, int V>
void backward_launch(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
                     const at::Tensor& mean, const at::Tensor& invstd, at::Tensor& grad_input,
                     at::Tensor& grad_weight, at::Tensor& grad_bias) {
  using acc_t = at::opmath_type<scalar_t>;
  const Launch l = plan(input);
  const auto acc_dtype = std::is_same_v<acc_t, double> ? at::kDouble : at::kFloat;
  auto partial = at::empty({l.c * l.parts * 2}, input.options().dtype(acc_dtype));
  auto coef = at::empty({l.c * 3}, input.options().dtype(acc_dtype));
  const auto stream = at::cuda::getCurrentCUDAStream();
  const scalar_t* x = input.const_data_ptr<scalar_t>();
  const scalar_t* dy = grad_output.const_data_ptr<scalar_t>();
  reduce_kernel<scalar_t, V, acc_t><<<dim3(static_cast<unsigned>(l.c), l.parts), kBlock, 0, stream>>>(
      x, dy, mean.const_data_ptr<float>(), l.n, l.c, l.s, l.segments_per_row, partial.mutable_data_ptr<acc_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  backward_finalize_kernel<acc_t><<<static_cast<unsigned>(ceil_div(l.c, kBlock)), kBlock, 0, stream>>>(
      partial.const_data_ptr<acc_t>(), weight.const_data_ptr<float>(), mean.const_data_ptr<float>(),
      invstd.const_data_ptr<float>(), l.c, l.parts, static_cast<double>(l.n * l.s),
      grad_weight.mutable_data_ptr<float>(), grad_bias.mutable_data_ptr<float>(), coef.mutable_data_ptr<acc_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t vectors = input.numel() / V;
  const auto blocks = static_cast<unsigned>(std::max<int64_t>(1, std::min(ceil_div(vectors, kBlock), l.apply_blocks)));
  apply_kernel<scalar_t, V, acc_t><<<blocks, kBlock, 0, stream>>>(x, dy, grad_input.mutable_data_ptr<scalar_t>(),
                                                                 l.c, l.s, vectors, coef.const_data_ptr<acc_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

Triple forward_cuda(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  check_forward(input, weight, bias, eps);
  check_cuda_tensor(input, "batch_norm_train: input");
  const c10::cuda::CUDAGuard guard(input.device());
  auto output = at::empty_like(input, at::MemoryFormat::Contiguous);
  auto mean = at::empty({input.size(1)}, input.options().dtype(at::kFloat));
  auto invstd = at::empty_like(mean);
  const int64_t s = input.numel() / (input.size(0) * input.size(1));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "batch_norm_train_cuda", [&] {
    if (vectorizable<scalar_t>(input, s) && vectorizable<scalar_t>(output, s)) {
      forward_launch<scalar_t, 16 / sizeof(scalar_t)>(input, weight, bias, eps, output, mean, invstd);
    } else {
      forward_launch<scalar_t, 1>(input, weight, bias, eps, output, mean, invstd);
    }
  });
  return {output, mean, invstd};
}

Triple backward_cuda(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
                     const at::Tensor& mean, const at::Tensor& invstd) {
  check_backward(grad_output, input, weight, mean, invstd);
  check_cuda_tensor(input, "_batch_norm_train_backward: input");
  const c10::cuda::CUDAGuard guard(input.device());
  auto grad_input = at::empty_like(input, at::MemoryFormat::Contiguous);
  auto grad_weight = at::empty_like(weight);
  auto grad_bias = at::empty_like(weight);
  const int64_t s = input.numel() / (input.size(0) * input.size(1));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "batch_norm_train_backward_cuda",
                                  [&] {
    if (vectorizable<scalar_t>(input, s) && vectorizable<scalar_t>(grad_output, s) &&
        vectorizable<scalar_t>(grad_input, s)) {
      backward_launch<scalar_t, 16 / sizeof(scalar_t)>(grad_output, input, weight, mean, invstd, grad_input,
                                                       grad_weight, grad_bias);
    } else {
      backward_launch<scalar_t, 1>(grad_output, input, weight, mean, invstd, grad_input, grad_weight, grad_bias);
    }
  });
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace
}  // namespace batch_norm
}  // namespace lss

TORCH_LIBRARY_IMPL(lss, CUDA, m) {
  m.impl("batch_norm_train", &lss::batch_norm::forward_cuda);
  m.impl("_batch_norm_train_backward", &lss::batch_norm::backward_cuda);
}
