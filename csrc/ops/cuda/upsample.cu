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

constexpr int kPlanes = 4;    // NCHW: planes per thread, sharing one set of taps
constexpr int kChannels = 4;  // NHWC backward: channels per thread, sharing one set of weights

// Enough blocks to fill the device a few times over; the kernels stride over the rest.
int64_t grid_for(int64_t items, int64_t items_per_block) {
  int device = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t cap = static_cast<int64_t>(sms) * 32;
  return std::max<int64_t>(1, std::min(ceil_div(items, items_per_block), cap));
}

// Threads along the channels of one NHWC pixel (a warp, or fewer for thin maps); rows of the block take pixels.
dim3 nhwc_block(int64_t channels) {
  int lanes = 1;
  while (lanes < 32 && lanes < channels) lanes *= 2;
  return dim3(lanes, kThreads / lanes);
}

template <typename scalar_t, typename index_t>
__global__ void forward_nchw_kernel(const scalar_t* __restrict__ src, scalar_t* __restrict__ dst, int64_t planes,
                                    index_t IW, index_t OH, index_t OW, AxisMap<at::opmath_type<scalar_t>> mh,
                                    AxisMap<at::opmath_type<scalar_t>> mw, index_t work) {
  using T = at::opmath_type<scalar_t>;
  const int64_t in_plane = mh.in * static_cast<int64_t>(IW), out_plane = static_cast<int64_t>(OH) * OW;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < work;
       t += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const index_t k = static_cast<index_t>(t);
    const index_t ow = k % OW, oh = (k / OW) % OH;
    const int64_t p0 = static_cast<int64_t>(k / (OW * OH)) * kPlanes;
    int64_t h0, h1, w0, w1;
    T hl0, hl1, wl0, wl1;
    mh.taps(oh, h0, h1, hl0, hl1);
    mw.taps(ow, w0, w1, wl0, wl1);
    const index_t a = h0 * IW + w0, b = h0 * IW + w1, c = h1 * IW + w0, d = h1 * IW + w1;
    const index_t out_offset = oh * OW + ow;
#pragma unroll
    for (int j = 0; j < kPlanes; ++j) {
      const int64_t p = p0 + j;
      if (p < planes) {
        const scalar_t* plane = src + p * in_plane;
        const T v0 = wl0 * static_cast<T>(plane[a]) + wl1 * static_cast<T>(plane[b]);
        const T v1 = wl0 * static_cast<T>(plane[c]) + wl1 * static_cast<T>(plane[d]);
        dst[p * out_plane + out_offset] = static_cast<scalar_t>(hl0 * v0 + hl1 * v1);
      }
    }
  }
}

template <typename scalar_t>
__global__ void forward_nhwc_kernel(const scalar_t* __restrict__ src, scalar_t* __restrict__ dst, int64_t C,
                                    int64_t pixels, AxisMap<at::opmath_type<scalar_t>> mh,
                                    AxisMap<at::opmath_type<scalar_t>> mw) {
  using T = at::opmath_type<scalar_t>;
  const int64_t IW = mw.in, OH = mh.out, OW = mw.out;
  for (int64_t pix = blockIdx.x * static_cast<int64_t>(blockDim.y) + threadIdx.y; pix < pixels;
       pix += static_cast<int64_t>(blockDim.y) * gridDim.x) {
    const int64_t ow = pix % OW, oh = (pix / OW) % OH, n = pix / (OW * OH);
    int64_t h0, h1, w0, w1;
    T hl0, hl1, wl0, wl1;
    mh.taps(oh, h0, h1, hl0, hl1);
    mw.taps(ow, w0, w1, wl0, wl1);
    const scalar_t* image = src + n * mh.in * IW * C;
    const scalar_t* p00 = image + (h0 * IW + w0) * C;
    const scalar_t* p01 = image + (h0 * IW + w1) * C;
    const scalar_t* p10 = image + (h1 * IW + w0) * C;
    const scalar_t* p11 = image + (h1 * IW + w1) * C;
    scalar_t* out = dst + pix * C;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const T v0 = wl0 * static_cast<T>(p00[c]) + wl1 * static_cast<T>(p01[c]);
      const T v1 = wl0 * static_cast<T>(p10[c]) + wl1 * static_cast<T>(p11[c]);
      out[c] = static_cast<scalar_t>(hl0 * v0 + hl1 * v1);
    }
  }
}

template <typename scalar_t, typename index_t>
__global__ void backward_nchw_kernel(const scalar_t* __restrict__ gy, scalar_t* __restrict__ gx, int64_t planes,
                                     index_t IH, index_t IW, index_t OW, AxisMap<at::opmath_type<scalar_t>> mh,
                                     AxisMap<at::opmath_type<scalar_t>> mw, index_t work) {
  using T = at::opmath_type<scalar_t>;
  const int64_t in_plane = static_cast<int64_t>(IH) * IW, out_plane = mh.out * static_cast<int64_t>(OW);
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < work;
       t += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const index_t k = static_cast<index_t>(t);
    const index_t iw = k % IW, ih = (k / IW) % IH;
    const int64_t p0 = static_cast<int64_t>(k / (IW * IH)) * kPlanes;
    int64_t oh_begin, oh_end, ow_begin, ow_end;
    mh.sampled_by(ih, oh_begin, oh_end);
    mw.sampled_by(iw, ow_begin, ow_end);
    T acc[kPlanes];
#pragma unroll
    for (int j = 0; j < kPlanes; ++j) acc[j] = T(0);
    for (int64_t oh = oh_begin; oh < oh_end; ++oh) {
      const T wh = mh.weight(oh, ih);
      const index_t row = static_cast<index_t>(oh) * OW;
      for (int64_t ow = ow_begin; ow < ow_end; ++ow) {
        const T w = wh * mw.weight(ow, iw);
        const index_t offset = row + static_cast<index_t>(ow);
#pragma unroll
        for (int j = 0; j < kPlanes; ++j) {
          if (p0 + j < planes) acc[j] += w * static_cast<T>(gy[(p0 + j) * out_plane + offset]);
        }
      }
    }
    const index_t in_offset = ih * IW + iw;
#pragma unroll
    for (int j = 0; j < kPlanes; ++j) {
      if (p0 + j < planes) gx[(p0 + j) * in_plane + in_offset] = static_cast<scalar_t>(acc[j]);
    }
  }
}

template <typename scalar_t>
__global__ void backward_nhwc_kernel(const scalar_t* __restrict__ gy, scalar_t* __restrict__ gx, int64_t C,
                                     int64_t pixels, AxisMap<at::opmath_type<scalar_t>> mh,
                                     AxisMap<at::opmath_type<scalar_t>> mw) {
  using T = at::opmath_type<scalar_t>;
  const int64_t IH = mh.in, IW = mw.in, OH = mh.out, OW = mw.out;
  const int64_t lanes = blockDim.x;
  for (int64_t pix = blockIdx.x * static_cast<int64_t>(blockDim.y) + threadIdx.y; pix < pixels;
       pix += static_cast<int64_t>(blockDim.y) * gridDim.x) {
    const int64_t iw = pix % IW, ih = (pix / IW) % IH, n = pix / (IW * IH);
    int64_t oh_begin, oh_end, ow_begin, ow_end;
    mh.sampled_by(ih, oh_begin, oh_end);
    mw.sampled_by(iw, ow_begin, ow_end);
    const scalar_t* image = gy + n * OH * OW * C;
    for (int64_t c0 = threadIdx.x; c0 < C; c0 += lanes * kChannels) {
      T acc[kChannels];
#pragma unroll
      for (int j = 0; j < kChannels; ++j) acc[j] = T(0);
      for (int64_t oh = oh_begin; oh < oh_end; ++oh) {
        const T wh = mh.weight(oh, ih);
        for (int64_t ow = ow_begin; ow < ow_end; ++ow) {
          const T w = wh * mw.weight(ow, iw);
          const scalar_t* g = image + (oh * OW + ow) * C;
#pragma unroll
          for (int j = 0; j < kChannels; ++j) {
            const int64_t c = c0 + j * lanes;
            if (c < C) acc[j] += w * static_cast<T>(g[c]);
          }
        }
      }
      scalar_t* out = gx + pix * C;
#pragma unroll
      for (int j = 0; j < kChannels; ++j) {
        const int64_t c = c0 + j * lanes;
        if (c < C) out[c] = static_cast<scalar_t>(acc[j]);
      }
    }
  }
}

bool fits_int32(int64_t n) { return n <= std::numeric_limits<int32_t>::max(); }

at::Tensor upsample_bilinear_cuda(const at::Tensor& input, at::IntArrayRef output_size,
                                  std::optional<double> scales_h, std::optional<double> scales_w,
                                  c10::string_view mode) {
  check_cuda_tensor(input, "upsample_bilinear: input");
  check_forward(input, output_size);
  const CoordMode coord_mode = parse_mode(std::string(mode));
  c10::cuda::CUDAGuard guard(input.device());
  const bool channels_last = is_channels_last(input);
  const at::Tensor src = channels_last ? input : input.contiguous();
  const int64_t N = input.size(0), C = input.size(1), IH = input.size(2), IW = input.size(3);
  const int64_t OH = output_size[0], OW = output_size[1];
  at::Tensor output = at::empty({N, C, OH, OW}, input.options().memory_format(
                                                    channels_last ? at::MemoryFormat::ChannelsLast
                                                                  : at::MemoryFormat::Contiguous));
  if (output.numel() == 0) return output;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "upsample_bilinear_cuda", [&] {
    using T = at::opmath_type<scalar_t>;
    const AxisMap<T> mh(IH, OH, scales_h, coord_mode), mw(IW, OW, scales_w, coord_mode);
    const scalar_t* x = src.const_data_ptr<scalar_t>();
    scalar_t* y = output.mutable_data_ptr<scalar_t>();
    if (channels_last) {
      const dim3 block = nhwc_block(C);
      const int64_t pixels = N * OH * OW;
      forward_nhwc_kernel<scalar_t><<<grid_for(pixels, block.y), block, 0, stream>>>(x, y, C, pixels, mh, mw);
    } else {
      const int64_t planes = N * C;
      const int64_t work = ceil_div(planes, kPlanes) * OH * OW;
      const int64_t grid = grid_for(work, kThreads);
      if (fits_int32(work) && fits_int32(IH * IW) && fits_int32(OH * OW)) {
        forward_nchw_kernel<scalar_t, int32_t><<<grid, kThreads, 0, stream>>>(x, y, planes, IW, OH, OW, mh, mw, work);
      } else {
        forward_nchw_kernel<scalar_t, int64_t><<<grid, kThreads, 0, stream>>>(x, y, planes, IW, OH, OW, mh, mw, work);
      }
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return output;
}

at::Tensor upsample_bilinear_backward_cuda(const at::Tensor& grad_output, at::IntArrayRef input_size,
                                           std::optional<double> scales_h, std::optional<double> scales_w,
                                           c10::string_view mode) {
  check_cuda_tensor(grad_output, "_upsample_bilinear_backward: grad_output");
  check_backward(grad_output, input_size);
  const CoordMode coord_mode = parse_mode(std::string(mode));
  c10::cuda::CUDAGuard guard(grad_output.device());
  const bool channels_last = is_channels_last(grad_output);
  const at::Tensor g = channels_last ? grad_output : grad_output.contiguous();
  const int64_t N = input_size[0], C = input_size[1], IH = input_size[2], IW = input_size[3];
  const int64_t OH = g.size(2), OW = g.size(3);
  at::Tensor grad_input = at::empty(input_size, g.options().memory_format(
                                                    channels_last ? at::MemoryFormat::ChannelsLast
                                                                  : at::MemoryFormat::Contiguous));
  if (grad_input.numel() == 0) return grad_input;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "upsample_bilinear_backward_cuda", [&] {
    using T = at::opmath_type<scalar_t>;
    const AxisMap<T> mh(IH, OH, scales_h, coord_mode), mw(IW, OW, scales_w, coord_mode);
    const scalar_t* gy = g.const_data_ptr<scalar_t>();
    scalar_t* gx = grad_input.mutable_data_ptr<scalar_t>();
    if (channels_last) {
      const dim3 block = nhwc_block(C);
      const int64_t pixels = N * IH * IW;
      backward_nhwc_kernel<scalar_t><<<grid_for(pixels, block.y), block, 0, stream>>>(gy, gx, C, pixels, mh, mw);
    } else {
      const int64_t planes = N * C;
      const int64_t work = ceil_div(planes, kPlanes) * IH * IW;
      const int64_t grid = grid_for(work, kThreads);
      if (fits_int32(work) && fits_int32(IH * IW) && fits_int32(OH * OW)) {
        backward_nchw_kernel<scalar_t, int32_t><<<grid, kThreads, 0, stream>>>(gy, gx, planes, IH, IW, OW, mh, mw,
                                                                               work);
      } else {
        backward_nchw_kernel<scalar_t, int64_t><<<grid, kThreads, 0, stream>>>(gy, gx, planes, IH, IW, OW, mh, mw,
                                                                               work);
      }
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
