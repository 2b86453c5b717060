// CUDA kernels of the depthwise convolution on contiguous N x C x H x W inputs (NCHW), explicit top/bottom/left/right
// zero padding. PyTorch's NCHW depthwise kernels compute one output per thread, reading the whole window each time,
// and reduce the weight gradient with one block per filter tap; here
//   forward:          a thread computes R neighbouring outputs of a row from one run of input columns per filter
//                     row (held in registers), so every input value is read once per filter row instead of once per
//                     tap;
//   input gradient:   a thread gathers R neighbouring input columns from the output gradients that saw them;
//   weight gradient:  block (c, part) accumulates all KH x KW taps of channel c over its share of the output runs
//                     (registers), sums them over the block, and one thread per tap adds the parts up in double.
// Filters 3x3 and 5x5 with stride 1 or 2 (EfficientNet's) are compiled with their sizes known; other shapes take a
// generic path (one output per thread, runtime sizes up to kMaxKernel). Sums in float (double for double inputs).
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

#include "ops/common.h"
#include "ops/depthwise_conv.h"

namespace lss {
namespace depthwise_conv {
namespace {

constexpr int kBlock = 256;
constexpr int kRun = 4;  // neighbouring outputs (forward, weight gradient) or inputs (input gradient) per thread

struct Dims {
  int64_t n, c, h, w, oh, ow;
  int kh, kw, sh, sw, pt, pl;
};

Dims dims_of(const Geometry& g) {
  return {g.n, g.c, g.h, g.w, g.oh, g.ow, static_cast<int>(g.kh), static_cast<int>(g.kw), static_cast<int>(g.sh),
          static_cast<int>(g.sw), static_cast<int>(g.pt), static_cast<int>(g.pl)};
}

int sm_count() {
  int device = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

// Compile-time shape: KH_, KW_, S_ (the stride of both directions) known, or 0 for the runtime values (then R = 1).
template <int KH_, int KW_, int S_, int R>
struct Shape {
  static constexpr int kMaxKH = KH_ ? KH_ : static_cast<int>(kMaxKernel);
  static constexpr int kMaxKW = KW_ ? KW_ : static_cast<int>(kMaxKernel);
  // input columns that R neighbouring outputs read in one filter row
  static constexpr int kSegment = S_ ? (R - 1) * S_ + kMaxKW : kMaxKW;
  static_assert(S_ != 0 || R == 1, "the generic path computes one output per thread");
};

// The run of Shape::kSegment input columns from iw0 of one row (zeros outside the row and past len).
template <typename scalar_t, typename acc_t, int L>
__device__ __forceinline__ void load_segment(const scalar_t* __restrict__ row, int64_t iw0, int len, int64_t width,
                                             acc_t (&seg)[L]) {
#pragma unroll
  for (int i = 0; i < L; ++i) {
    const int64_t iw = iw0 + i;
    seg[i] = (i < len && iw >= 0 && iw < width) ? static_cast<acc_t>(row[iw]) : acc_t(0);
  }
}

template <typename scalar_t, typename w_t, typename acc_t, int KH_, int KW_, int S_, int R>
__global__ void __launch_bounds__(kBlock) forward_kernel(const scalar_t* __restrict__ x, const w_t* __restrict__ w,
                                                         scalar_t* __restrict__ y, Dims d, int64_t total) {
  using Sh = Shape<KH_, KW_, S_, R>;
  const int kh_n = KH_ ? KH_ : d.kh, kw_n = KW_ ? KW_ : d.kw;
  const int sh = S_ ? S_ : d.sh, sw = S_ ? S_ : d.sw;
  const int len = (R - 1) * sw + kw_n;
  const int64_t runs = ceil_div(d.ow, R);
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t run = t % runs, rest = t / runs;
    const int64_t oh = rest % d.oh, plane = rest / d.oh;
    const scalar_t* xp = x + plane * d.h * d.w;
    const w_t* wp = w + (plane % d.c) * kh_n * kw_n;
    const int64_t ow0 = run * R, iw0 = ow0 * sw - d.pl;
    acc_t acc[R];
#pragma unroll
    for (int j = 0; j < R; ++j) acc[j] = 0;
#pragma unroll
    for (int kh = 0; kh < Sh::kMaxKH; ++kh) {
      if (kh >= kh_n) break;
      const int64_t ih = oh * sh - d.pt + kh;
      if (ih < 0 || ih >= d.h) continue;
      acc_t seg[Sh::kSegment];
      load_segment<scalar_t, acc_t, Sh::kSegment>(xp + ih * d.w, iw0, len, d.w, seg);
#pragma unroll
      for (int kw = 0; kw < Sh::kMaxKW; ++kw) {
        if (kw >= kw_n) break;
        const acc_t wv = static_cast<acc_t>(wp[kh * kw_n + kw]);
#pragma unroll
        for (int j = 0; j < R; ++j) acc[j] += seg[j * sw + kw] * wv;
      }
    }
    scalar_t* out = y + (plane * d.oh + oh) * d.ow;
#pragma unroll
    for (int j = 0; j < R; ++j) {
      if (ow0 + j < d.ow) out[ow0 + j] = static_cast<scalar_t>(acc[j]);
    }
  }
}

// dx[ih, iw] = sum over the taps (kh, kw) with oh = (ih + pt - kh) / sh and ow = (iw + pl - kw) / sw whole and in
// range of dy[oh, ow] * w[kh, kw].
template <typename scalar_t, typename w_t, typename acc_t, int KH_, int KW_, int S_, int R>
__global__ void __launch_bounds__(kBlock) input_grad_kernel(const scalar_t* __restrict__ dy,
                                                            const w_t* __restrict__ w, scalar_t* __restrict__ dx,
                                                            Dims d, int64_t total) {
  using Sh = Shape<KH_, KW_, S_, R>;
  const int kh_n = KH_ ? KH_ : d.kh, kw_n = KW_ ? KW_ : d.kw;
  const int sh = S_ ? S_ : d.sh, sw = S_ ? S_ : d.sw;
  const int64_t runs = ceil_div(d.w, R);
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t run = t % runs, rest = t / runs;
    const int64_t ih = rest % d.h, plane = rest / d.h;
    const scalar_t* gp = dy + plane * d.oh * d.ow;
    const w_t* wp = w + (plane % d.c) * kh_n * kw_n;
    const int64_t iw0 = run * R;
    acc_t acc[R];
#pragma unroll
    for (int j = 0; j < R; ++j) acc[j] = 0;
#pragma unroll
    for (int kh = 0; kh < Sh::kMaxKH; ++kh) {
      if (kh >= kh_n) break;
      const int64_t th = ih + d.pt - kh;
      if (th < 0 || th % sh != 0 || th / sh >= d.oh) continue;
      const scalar_t* row = gp + (th / sh) * d.ow;
      if constexpr (S_ == 1) {
        // output columns iw0 + pl - (KW - 1) ... iw0 + R - 1 + pl
        constexpr int L = R + Sh::kMaxKW - 1;
        acc_t seg[L];
        load_segment<scalar_t, acc_t, L>(row, iw0 + d.pl - (kw_n - 1), L, d.ow, seg);
#pragma unroll
        for (int kw = 0; kw < Sh::kMaxKW; ++kw) {
          const acc_t wv = static_cast<acc_t>(wp[kh * kw_n + kw]);
#pragma unroll
          for (int j = 0; j < R; ++j) acc[j] += seg[j + kw_n - 1 - kw] * wv;
        }
      } else {
#pragma unroll
        for (int kw = 0; kw < Sh::kMaxKW; ++kw) {
          if (kw >= kw_n) break;
          const acc_t wv = static_cast<acc_t>(wp[kh * kw_n + kw]);
#pragma unroll
          for (int j = 0; j < R; ++j) {
            const int64_t tw = iw0 + j + d.pl - kw;
            if (tw >= 0 && tw % sw == 0 && tw / sw < d.ow) acc[j] += static_cast<acc_t>(row[tw / sw]) * wv;
          }
        }
      }
    }
    scalar_t* out = dx + (plane * d.h + ih) * d.w;
#pragma unroll
    for (int j = 0; j < R; ++j) {
      if (iw0 + j < d.w) out[iw0 + j] = static_cast<scalar_t>(acc[j]);
    }
  }
}

// Block (c, part): the sums over the output runs part, part + parts, ... of channel c (all images) of
// dy[oh, ow] * x[oh * sh - pt + kh, ow * sw - pl + kw] for every tap; partial: C x parts x KH x KW.
template <typename scalar_t, typename acc_t, int KH_, int KW_, int S_, int R>
__global__ void __launch_bounds__(kBlock) weight_grad_kernel(const scalar_t* __restrict__ dy,
                                                             const scalar_t* __restrict__ x, Dims d,
                                                             acc_t* __restrict__ partial) {
  using Sh = Shape<KH_, KW_, S_, R>;
  constexpr int KK = Sh::kMaxKH * Sh::kMaxKW;
  const int kh_n = KH_ ? KH_ : d.kh, kw_n = KW_ ? KW_ : d.kw;
  const int sh = S_ ? S_ : d.sh, sw = S_ ? S_ : d.sw;
  const int len = (R - 1) * sw + kw_n;
  const int64_t c = blockIdx.x, part = blockIdx.y, parts = gridDim.y;
  const int64_t runs = ceil_div(d.ow, R), units = d.n * d.oh * runs;
  acc_t acc[KK];
#pragma unroll
  for (int k = 0; k < KK; ++k) acc[k] = 0;
  for (int64_t u = part * kBlock + threadIdx.x; u < units; u += parts * kBlock) {
    const int64_t run = u % runs, rest = u / runs;
    const int64_t oh = rest % d.oh, n = rest / d.oh;
    const int64_t plane = n * d.c + c;
    const int64_t ow0 = run * R, iw0 = ow0 * sw - d.pl;
    const scalar_t* grow = dy + (plane * d.oh + oh) * d.ow;
    acc_t g[R];
#pragma unroll
    for (int j = 0; j < R; ++j) g[j] = ow0 + j < d.ow ? static_cast<acc_t>(grow[ow0 + j]) : acc_t(0);
    const scalar_t* xp = x + plane * d.h * d.w;
#pragma unroll
    for (int kh = 0; kh < Sh::kMaxKH; ++kh) {
      if (kh >= kh_n) break;
      const int64_t ih = oh * sh - d.pt + kh;
      if (ih < 0 || ih >= d.h) continue;
      acc_t seg[Sh::kSegment];
      load_segment<scalar_t, acc_t, Sh::kSegment>(xp + ih * d.w, iw0, len, d.w, seg);
#pragma unroll
      for (int kw = 0; kw < Sh::kMaxKW; ++kw) {
        if (kw >= kw_n) break;
        acc_t s = 0;
#pragma unroll
        for (int j = 0; j < R; ++j) s += g[j] * seg[j * sw + kw];
        acc[kh * Sh::kMaxKW + kw] += s;
      }
    }
  }
  __shared__ acc_t sums[kBlock / 32][KK];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int k = 0; k < KK; ++k) {
    acc_t v = acc[k];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    if (lane == 0) sums[warp][k] = v;
  }
  __syncthreads();
  for (int k = threadIdx.x; k < kh_n * kw_n; k += kBlock) {
    const int slot = (k / kw_n) * Sh::kMaxKW + k % kw_n;
    acc_t v = 0;
#pragma unroll
    for (int wi = 0; wi < kBlock / 32; ++wi) v += sums[wi][slot];
    partial[(c * parts + part) * kh_n * kw_n + k] = v;
  }
}

// One thread per (channel, tap): the parts added up in double.
template <typename acc_t, typename w_t>
__global__ void weight_grad_finalize_kernel(const acc_t* __restrict__ partial, int64_t taps, int64_t parts,
                                            int64_t total, w_t* __restrict__ dw) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= total) return;
  const int64_t c = i / taps, k = i % taps;
  double s = 0;
  for (int64_t p = 0; p < parts; ++p) s += static_cast<double>(partial[(c * parts + p) * taps + k]);
  dw[i] = static_cast<w_t>(s);
}

// Calls body(K, S) with g's filter side and stride known at compile time: 3x3 or 5x5 with one stride of 1 or 2;
// else K = S = 0, the generic path.
template <typename F>
void with_shape(const Geometry& g, F&& body) {
  const bool square = g.kh == g.kw && g.sh == g.sw;
  using I = std::integral_constant<int, 0>;
  if (square && g.kh == 3 && g.sh == 1) return body(std::integral_constant<int, 3>{}, std::integral_constant<int, 1>{});
  if (square && g.kh == 3 && g.sh == 2) return body(std::integral_constant<int, 3>{}, std::integral_constant<int, 2>{});
  if (square && g.kh == 5 && g.sh == 1) return body(std::integral_constant<int, 5>{}, std::integral_constant<int, 1>{});
  if (square && g.kh == 5 && g.sh == 2) return body(std::integral_constant<int, 5>{}, std::integral_constant<int, 2>{});
  return body(I{}, I{});
}

template <typename T>
struct Tag {
  using type = T;
};

// Calls body with the weight's element type: float32, or the input's own.
template <typename scalar_t, typename F>
void with_weight_type(const at::Tensor& weight, F&& body) {
  if (weight.scalar_type() == at::kFloat) return body(Tag<float>{});
  return body(Tag<scalar_t>{});
}

unsigned grid_for(int64_t total) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(ceil_div(total, kBlock),
                                                                      static_cast<int64_t>(sm_count()) * 32)));
}

at::Tensor forward_cuda(const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride,
                        at::IntArrayRef padding) {
  const Geometry g = check_forward(input, weight, stride, padding);
  check_cuda_tensor(input, "depthwise_conv2d: input");
  const c10::cuda::CUDAGuard guard(input.device());
  auto output = at::empty({g.n, g.c, g.oh, g.ow}, input.options());
  if (output.numel() == 0) return output;
  const Dims d = dims_of(g);
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "depthwise_conv2d_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    with_weight_type<scalar_t>(weight, [&](auto wtag) {
      using w_t = typename decltype(wtag)::type;
      with_shape(g, [&](auto k, auto s) {
        constexpr int K = decltype(k)::value, S = decltype(s)::value;
        constexpr int R = S ? kRun : 1;
        const int64_t total = g.n * g.c * g.oh * ceil_div(g.ow, R);
        forward_kernel<scalar_t, w_t, acc_t, K, K, S, R><<<grid_for(total), kBlock, 0, stream>>>(
            input.const_data_ptr<scalar_t>(), weight.const_data_ptr<w_t>(), output.mutable_data_ptr<scalar_t>(),
            d, total);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
  return output;
}

std::tuple<at::Tensor, at::Tensor> backward_cuda(const at::Tensor& grad_output, const at::Tensor& input,
                                                 const at::Tensor& weight, at::IntArrayRef stride,
                                                 at::IntArrayRef padding) {
  const Geometry g = check_backward(grad_output, input, weight, stride, padding);
  check_cuda_tensor(input, "_depthwise_conv2d_backward: input");
  const c10::cuda::CUDAGuard guard(input.device());
  auto grad_input = at::empty_like(input, at::MemoryFormat::Contiguous);
  auto grad_weight = at::empty_like(weight, at::MemoryFormat::Contiguous);
  if (grad_output.numel() == 0) {
    grad_input.zero_();
    grad_weight.zero_();
    return {grad_input, grad_weight};
  }
  const Dims d = dims_of(g);
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int sms = sm_count();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "depthwise_conv2d_backward_cuda",
                                  [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto acc_dtype = std::is_same_v<acc_t, double> ? at::kDouble : at::kFloat;
    with_weight_type<scalar_t>(weight, [&](auto wtag) {
      using w_t = typename decltype(wtag)::type;
      with_shape(g, [&](auto k, auto s) {
        constexpr int K = decltype(k)::value, S = decltype(s)::value;
        constexpr int R = S ? kRun : 1;
        const int64_t total = g.n * g.c * g.h * ceil_div(g.w, R);
        input_grad_kernel<scalar_t, w_t, acc_t, K, K, S, R><<<grid_for(total), kBlock, 0, stream>>>(
            grad_output.const_data_ptr<scalar_t>(), weight.const_data_ptr<w_t>(),
            grad_input.mutable_data_ptr<scalar_t>(), d, total);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        // about 8 reduction blocks per SM in all, each with at least a few runs per thread
        const int64_t units = g.n * g.oh * ceil_div(g.ow, R);
        const int64_t wanted = ceil_div(static_cast<int64_t>(sms) * 8, g.c);
        const int64_t parts = std::max<int64_t>(1, std::min<int64_t>({wanted, ceil_div(units, kBlock * 4), 65535}));
        const int64_t taps = g.kh * g.kw;
        auto partial = at::empty({g.c * parts * taps}, input.options().dtype(acc_dtype));
        weight_grad_kernel<scalar_t, acc_t, K, K, S, R>
            <<<dim3(static_cast<unsigned>(g.c), static_cast<unsigned>(parts)), kBlock, 0, stream>>>(
                grad_output.const_data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(), d,
                partial.mutable_data_ptr<acc_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        const int64_t outputs = g.c * taps;
        weight_grad_finalize_kernel<acc_t, w_t><<<static_cast<unsigned>(ceil_div(outputs, kBlock)), kBlock, 0,
                                                  stream>>>(partial.const_data_ptr<acc_t>(), taps, parts, outputs,
                                                            grad_weight.mutable_data_ptr<w_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
  return {grad_input, grad_weight};
}

}  // namespace
}  // namespace depthwise_conv
}  // namespace lss

TORCH_LIBRARY_IMPL(lss, CUDA, m) {
  m.impl("depthwise_conv2d", &lss::depthwise_conv::forward_cuda);
  m.impl("_depthwise_conv2d_backward", &lss::depthwise_conv::backward_cuda);
}
