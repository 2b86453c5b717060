// CUDA kernels of bilinear upsampling. Forward: one thread per output pixel position, looping over a few planes
// (NCHW) or over channels (NHWC), so writes are coalesced and the taps are computed once per thread.
// Backward gathers without atomics: each input-gradient element sums the output gradients of the contiguous
// output ranges (one per axis) that sample it, found from the same coordinate transform as the forward.
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <limits>

#include "ops/common.h"
#include "ops/upsample.h"

namespace lss {
namespace upsample {
namespace {

constexpr int kPlanes = 4;    // NCHW: planes per thread and step, sharing one set of taps
constexpr int kChannels = 4;  // NHWC backward: channels per thread and step, sharing one set of weights

int64_t resident_blocks() {
  int device = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return static_cast<int64_t>(sms) * 32;
}

// NCHW launch: block x over the pixel positions of one plane, y over groups of kPlanes planes. The grid is capped
// near the device's resident blocks, so each thread computes its taps once and reuses them over many planes.
void plane_launch(int64_t positions, int64_t planes, dim3& grid, dim3& block) {
  const int64_t bx = std::min<int64_t>(kThreads, ceil_div(positions, 32) * 32);
  const int64_t by = kThreads / bx;
  const int64_t gx = std::min<int64_t>(ceil_div(positions, bx), std::numeric_limits<int32_t>::max());
  const int64_t gy = std::min<int64_t>({ceil_div(ceil_div(planes, kPlanes), by),
                                        std::max<int64_t>(1, resident_blocks() / gx), 65535});
  grid = dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
  block = dim3(static_cast<unsigned>(bx), static_cast<unsigned>(by));
}

// NHWC launch: block x along the channels of a pixel (a warp, or fewer for thin maps), y over pixels.
void pixel_launch(int64_t pixels, int64_t channels, dim3& grid, dim3& block) {
  int lanes = 1;
  while (lanes < 32 && lanes < channels) lanes *= 2;
  block = dim3(lanes, kThreads / lanes);
  grid = dim3(static_cast<unsigned>(std::max<int64_t>(1, std::min(ceil_div(pixels, block.y), resident_blocks()))));
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads, 6) forward_nchw_kernel(const scalar_t* __restrict__ src, scalar_t* __restrict__ dst, int64_t planes,
                                    AxisMap<at::opmath_type<scalar_t>> mh, AxisMap<at::opmath_type<scalar_t>> mw) {
  using T = at::opmath_type<scalar_t>;
  const int64_t in_plane = static_cast<int64_t>(mh.in) * mw.in, out_plane = static_cast<int64_t>(mh.out) * mw.out;
  const int64_t plane_step = static_cast<int64_t>(gridDim.y) * blockDim.y * kPlanes;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < out_plane;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int oh = static_cast<int>(k / mw.out), ow = static_cast<int>(k - static_cast<int64_t>(oh) * mw.out);
    int h0, h1, w0, w1;
    T hl0, hl1, wl0, wl1;
    mh.taps(oh, h0, h1, hl0, hl1);
    mw.taps(ow, w0, w1, wl0, wl1);
    const int64_t r0 = static_cast<int64_t>(h0) * mw.in, r1 = static_cast<int64_t>(h1) * mw.in;
    const int64_t a = r0 + w0, b = r0 + w1, c = r1 + w0, d = r1 + w1;
    for (int64_t p0 = (blockIdx.y * static_cast<int64_t>(blockDim.y) + threadIdx.y) * kPlanes; p0 < planes;
         p0 += plane_step) {
#pragma unroll
      for (int j = 0; j < kPlanes; ++j) {
        const int64_t p = p0 + j;
        if (p < planes) {
          const scalar_t* plane = src + p * in_plane;
          const T v0 = wl0 * static_cast<T>(plane[a]) + wl1 * static_cast<T>(plane[b]);
          const T v1 = wl0 * static_cast<T>(plane[c]) + wl1 * static_cast<T>(plane[d]);
          dst[p * out_plane + k] = static_cast<scalar_t>(hl0 * v0 + hl1 * v1);
        }
      }
    }
  }
}

template <typename scalar_t, typename index_t>
__global__ void forward_nhwc_kernel(const scalar_t* __restrict__ src, scalar_t* __restrict__ dst, int C,
                                    index_t pixels, AxisMap<at::opmath_type<scalar_t>> mh,
                                    AxisMap<at::opmath_type<scalar_t>> mw) {
  using T = at::opmath_type<scalar_t>;
  const index_t OH = mh.out, OW = mw.out;
  for (index_t pix = blockIdx.x * static_cast<index_t>(blockDim.y) + threadIdx.y; pix < pixels;
       pix += static_cast<index_t>(blockDim.y) * gridDim.x) {
    const int ow = static_cast<int>(pix % OW), oh = static_cast<int>((pix / OW) % OH);
    const int64_t n = pix / (OW * OH);
    int h0, h1, w0, w1;
    T hl0, hl1, wl0, wl1;
    mh.taps(oh, h0, h1, hl0, hl1);
    mw.taps(ow, w0, w1, wl0, wl1);
    const scalar_t* image = src + n * mh.in * mw.in * C;
    const scalar_t* p00 = image + (static_cast<int64_t>(h0) * mw.in + w0) * C;
    const scalar_t* p01 = image + (static_cast<int64_t>(h0) * mw.in + w1) * C;
    const scalar_t* p10 = image + (static_cast<int64_t>(h1) * mw.in + w0) * C;
    const scalar_t* p11 = image + (static_cast<int64_t>(h1) * mw.in + w1) * C;
    scalar_t* out = dst + static_cast<int64_t>(pix) * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      const T v0 = wl0 * static_cast<T>(p00[c]) + wl1 * static_cast<T>(p01[c]);
      const T v1 = wl0 * static_cast<T>(p10[c]) + wl1 * static_cast<T>(p11[c]);
      out[c] = static_cast<scalar_t>(hl0 * v0 + hl1 * v1);
    }
  }
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads, 6) backward_nchw_kernel(const scalar_t* __restrict__ gy, scalar_t* __restrict__ gx, int64_t planes,
                                     AxisMap<at::opmath_type<scalar_t>> mh, AxisMap<at::opmath_type<scalar_t>> mw) {
  using T = at::opmath_type<scalar_t>;
  const int64_t in_plane = static_cast<int64_t>(mh.in) * mw.in, out_plane = static_cast<int64_t>(mh.out) * mw.out;
  const int64_t plane_step = static_cast<int64_t>(gridDim.y) * blockDim.y * kPlanes;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < in_plane;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int ih = static_cast<int>(k / mw.in), iw = static_cast<int>(k - static_cast<int64_t>(ih) * mw.in);
    int oh_begin, oh_end, ow_begin, ow_end;
    mh.sampled_by(ih, oh_begin, oh_end);
    mw.sampled_by(iw, ow_begin, ow_end);
    for (int64_t p0 = (blockIdx.y * static_cast<int64_t>(blockDim.y) + threadIdx.y) * kPlanes; p0 < planes;
         p0 += plane_step) {
      T acc[kPlanes];
#pragma unroll
      for (int j = 0; j < kPlanes; ++j) acc[j] = T(0);
      for (int oh = oh_begin; oh < oh_end; ++oh) {
        const T wh = mh.weight(oh, ih);
        const int64_t row = static_cast<int64_t>(oh) * mw.out;
        for (int ow = ow_begin; ow < ow_end; ++ow) {
          const T w = wh * mw.weight(ow, iw);
#pragma unroll
          for (int j = 0; j < kPlanes; ++j) {
            if (p0 + j < planes) acc[j] += w * static_cast<T>(gy[(p0 + j) * out_plane + row + ow]);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kPlanes; ++j) {
        if (p0 + j < planes) gx[(p0 + j) * in_plane + k] = static_cast<scalar_t>(acc[j]);
      }
    }
  }
}

template <typename scalar_t, typename index_t>
__global__ void backward_nhwc_kernel(const scalar_t* __restrict__ gy, scalar_t* __restrict__ gx, int C,
                                     index_t pixels, AxisMap<at::opmath_type<scalar_t>> mh,
                                     AxisMap<at::opmath_type<scalar_t>> mw) {
  using T = at::opmath_type<scalar_t>;
  const index_t IH = mh.in, IW = mw.in;
  const int lanes = blockDim.x;
  for (index_t pix = blockIdx.x * static_cast<index_t>(blockDim.y) + threadIdx.y; pix < pixels;
       pix += static_cast<index_t>(blockDim.y) * gridDim.x) {
    const int iw = static_cast<int>(pix % IW), ih = static_cast<int>((pix / IW) % IH);
    const int64_t n = pix / (IW * IH);
    int oh_begin, oh_end, ow_begin, ow_end;
    mh.sampled_by(ih, oh_begin, oh_end);
    mw.sampled_by(iw, ow_begin, ow_end);
    const scalar_t* image = gy + n * mh.out * mw.out * C;
    for (int c0 = threadIdx.x; c0 < C; c0 += lanes * kChannels) {
      T acc[kChannels];
#pragma unroll
      for (int j = 0; j < kChannels; ++j) acc[j] = T(0);
      for (int oh = oh_begin; oh < oh_end; ++oh) {
        const T wh = mh.weight(oh, ih);
        for (int ow = ow_begin; ow < ow_end; ++ow) {
          const T w = wh * mw.weight(ow, iw);
          const scalar_t* g = image + (static_cast<int64_t>(oh) * mw.out + ow) * C;
#pragma unroll
          for (int j = 0; j < kChannels; ++j) {
            const int c = c0 + j * lanes;
            if (c < C) acc[j] += w * static_cast<T>(g[c]);
          }
        }
      }
      scalar_t* out = gx + static_cast<int64_t>(pix) * C;
#pragma unroll
      for (int j = 0; j < kChannels; ++j) {
        const int c = c0 + j * lanes;
        if (c < C) out[c] = static_cast<scalar_t>(acc[j]);
      }
    }
  }
}

bool fits_int32(int64_t n) { return n <= std::numeric_limits<int32_t>::max(); }

at::Tensor upsample_bilinear_cuda(const at::Tensor& input, at::IntArrayRef output_size,
                                  std::optional<double> scales_h, std::optional<double> scales_w,
                                  c10::string_view mode) {
  lss::check_cuda_tensor(input, "upsample_bilinear: input");
  check_forward(input, output_size);
  const CoordMode coord_mode = parse_mode(std::string(mode));
  c10::cuda::CUDAGuard guard(input.device());
  const int64_t N = input.size(0), C = input.size(1), IH = input.size(2), IW = input.size(3);
  const int64_t OH = output_size[0], OW = output_size[1];
  KernelLayout io = kernel_layout(input, {N, C, OH, OW});
  const bool channels_last = io.channels_last;
  const at::Tensor& src = io.src;
  at::Tensor& output = io.result;
  if (output.numel() == 0) return output;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "upsample_bilinear_cuda", [&] {
    using T = at::opmath_type<scalar_t>;
    const AxisMap<T> mh(static_cast<int>(IH), static_cast<int>(OH), scales_h, coord_mode);
    const AxisMap<T> mw(static_cast<int>(IW), static_cast<int>(OW), scales_w, coord_mode);
    const scalar_t* x = src.const_data_ptr<scalar_t>();
    scalar_t* y = output.mutable_data_ptr<scalar_t>();
    dim3 grid, block;
    if (channels_last) {
      TORCH_CHECK(fits_int32(C), "upsample_bilinear: channels_last input needs fewer than 2^31 channels, got ", C);
      const int64_t pixels = N * OH * OW;
      pixel_launch(pixels, C, grid, block);
      if (fits_int32(pixels)) {
        forward_nhwc_kernel<scalar_t, int32_t><<<grid, block, 0, stream>>>(x, y, C, pixels, mh, mw);
      } else {
        forward_nhwc_kernel<scalar_t, int64_t><<<grid, block, 0, stream>>>(x, y, C, pixels, mh, mw);
      }
    } else {
      plane_launch(OH * OW, N * C, grid, block);
      forward_nchw_kernel<scalar_t><<<grid, block, 0, stream>>>(x, y, N * C, mh, mw);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return output;
}

at::Tensor upsample_bilinear_backward_cuda(const at::Tensor& grad_output, at::IntArrayRef input_size,
                                           std::optional<double> scales_h, std::optional<double> scales_w,
                                           c10::string_view mode) {
  lss::check_cuda_tensor(grad_output, "_upsample_bilinear_backward: grad_output");
  check_backward(grad_output, input_size);
  const CoordMode coord_mode = parse_mode(std::string(mode));
  c10::cuda::CUDAGuard guard(grad_output.device());
  const int64_t N = input_size[0], C = input_size[1], IH = input_size[2], IW = input_size[3];
  const int64_t OH = grad_output.size(2), OW = grad_output.size(3);
  KernelLayout io = kernel_layout(grad_output, input_size);
  const bool channels_last = io.channels_last;
  const at::Tensor& g = io.src;
  at::Tensor& grad_input = io.result;
  if (grad_input.numel() == 0) return grad_input;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "upsample_bilinear_backward_cuda", [&] {
    using T = at::opmath_type<scalar_t>;
    const AxisMap<T> mh(static_cast<int>(IH), static_cast<int>(OH), scales_h, coord_mode);
    const AxisMap<T> mw(static_cast<int>(IW), static_cast<int>(OW), scales_w, coord_mode);
    const scalar_t* gy = g.const_data_ptr<scalar_t>();
    scalar_t* gx = grad_input.mutable_data_ptr<scalar_t>();
    dim3 grid, block;
    if (channels_last) {
      TORCH_CHECK(fits_int32(C), "_upsample_bilinear_backward: channels_last grad_output needs fewer than 2^31 "
                  "channels, got ", C);
      const int64_t pixels = N * IH * IW;
      pixel_launch(pixels, C, grid, block);
      if (fits_int32(pixels)) {
        backward_nhwc_kernel<scalar_t, int32_t><<<grid, block, 0, stream>>>(gy, gx, C, pixels, mh, mw);
      } else {
        backward_nhwc_kernel<scalar_t, int64_t><<<grid, block, 0, stream>>>(gy, gx, C, pixels, mh, mw);
      }
    } else {
      plane_launch(IH * IW, N * C, grid, block);
      backward_nchw_kernel<scalar_t><<<grid, block, 0, stream>>>(gy, gx, N * C, mh, mw);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return grad_input;
}

}  // namespace
}  // namespace upsample
}  // namespace lss

TORCH_LIBRARY_IMPL(lss, CUDA, m) {
  m.impl("upsample_bilinear", TORCH_FN(lss::upsample::upsample_bilinear_cuda));
  m.impl("_upsample_bilinear_backward", TORCH_FN(lss::upsample::upsample_bilinear_backward_cuda));
}
