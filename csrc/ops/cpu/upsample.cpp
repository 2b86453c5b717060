// CPU kernels of bilinear upsampling: per-axis tap tables, then planes (NCHW) or pixels (NHWC) in parallel.
// The backward gathers per input pixel (NHWC) or accumulates a plane per task (NCHW): no two tasks write alike.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <vector>

#include "ops/common.h"
#include "ops/upsample.h"

namespace lss {
namespace upsample {
namespace {

template <typename T>
struct AxisTable {
  std::vector<int> i0, i1, begin, end;
  std::vector<T> w0, w1;

  explicit AxisTable(const AxisMap<T>& m) : i0(m.out), i1(m.out), begin(m.in), end(m.in), w0(m.out), w1(m.out) {
    for (int o = 0; o < m.out; ++o) m.taps(o, i0[o], i1[o], w0[o], w1[o]);
    for (int i = 0; i < m.in; ++i) m.sampled_by(i, begin[i], end[i]);
  }

  T weight(int64_t o, int i) const { return (i0[o] == i ? w0[o] : T(0)) + (i1[o] == i ? w1[o] : T(0)); }
};

int64_t grain(int64_t work_per_item) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, work_per_item)); }

template <typename scalar_t>
void forward_kernel(const at::Tensor& input, at::Tensor& output, std::optional<double> scales_h,
                    std::optional<double> scales_w, CoordMode mode, bool channels_last) {
  using T = at::opmath_type<scalar_t>;
  const int64_t N = input.size(0), C = input.size(1), IH = input.size(2), IW = input.size(3);
  const int64_t OH = output.size(2), OW = output.size(3);
  const AxisTable<T> th(AxisMap<T>(IH, OH, scales_h, mode));
  const AxisTable<T> tw(AxisMap<T>(IW, OW, scales_w, mode));
  const scalar_t* src = input.const_data_ptr<scalar_t>();
  scalar_t* dst = output.mutable_data_ptr<scalar_t>();
  if (!channels_last) {
    at::parallel_for(0, N * C, grain(OH * OW), [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const scalar_t* plane = src + p * IH * IW;
        scalar_t* out = dst + p * OH * OW;
        for (int64_t oh = 0; oh < OH; ++oh) {
          const scalar_t* r0 = plane + th.i0[oh] * IW;
          const scalar_t* r1 = plane + th.i1[oh] * IW;
          const T h0 = th.w0[oh], h1 = th.w1[oh];
          for (int64_t ow = 0; ow < OW; ++ow) {
            const int64_t a = tw.i0[ow], b = tw.i1[ow];
            const T v0 = tw.w0[ow] * static_cast<T>(r0[a]) + tw.w1[ow] * static_cast<T>(r0[b]);
            const T v1 = tw.w0[ow] * static_cast<T>(r1[a]) + tw.w1[ow] * static_cast<T>(r1[b]);
            out[oh * OW + ow] = static_cast<scalar_t>(h0 * v0 + h1 * v1);
          }
        }
      }
    });
    return;
  }
  at::parallel_for(0, N * OH * OW, grain(C), [&](int64_t begin, int64_t end) {
    for (int64_t pix = begin; pix < end; ++pix) {
      const int64_t ow = pix % OW, oh = (pix / OW) % OH, n = pix / (OW * OH);
      const scalar_t* image = src + n * IH * IW * C;
      const scalar_t* p00 = image + (th.i0[oh] * IW + tw.i0[ow]) * C;
      const scalar_t* p01 = image + (th.i0[oh] * IW + tw.i1[ow]) * C;
      const scalar_t* p10 = image + (th.i1[oh] * IW + tw.i0[ow]) * C;
      const scalar_t* p11 = image + (th.i1[oh] * IW + tw.i1[ow]) * C;
      const T h0 = th.w0[oh], h1 = th.w1[oh], w0 = tw.w0[ow], w1 = tw.w1[ow];
      scalar_t* out = dst + pix * C;
      for (int64_t c = 0; c < C; ++c) {
        const T v0 = w0 * static_cast<T>(p00[c]) + w1 * static_cast<T>(p01[c]);
        const T v1 = w0 * static_cast<T>(p10[c]) + w1 * static_cast<T>(p11[c]);
        out[c] = static_cast<scalar_t>(h0 * v0 + h1 * v1);
      }
    }
  });
}

template <typename scalar_t>
void backward_kernel(const at::Tensor& grad_output, at::Tensor& grad_input, std::optional<double> scales_h,
                     std::optional<double> scales_w, CoordMode mode, bool channels_last) {
  using T = at::opmath_type<scalar_t>;
  const int64_t N = grad_input.size(0), C = grad_input.size(1), IH = grad_input.size(2), IW = grad_input.size(3);
  const int64_t OH = grad_output.size(2), OW = grad_output.size(3);
  const AxisTable<T> th(AxisMap<T>(IH, OH, scales_h, mode));
  const AxisTable<T> tw(AxisMap<T>(IW, OW, scales_w, mode));
  const scalar_t* gy = grad_output.const_data_ptr<scalar_t>();
  scalar_t* gx = grad_input.mutable_data_ptr<scalar_t>();
  if (!channels_last) {
    at::parallel_for(0, N * C, grain(OH * OW), [&](int64_t begin, int64_t end) {
      std::vector<T> acc(IH * IW);
      for (int64_t p = begin; p < end; ++p) {
        std::fill(acc.begin(), acc.end(), T(0));
        const scalar_t* g = gy + p * OH * OW;
        for (int64_t oh = 0; oh < OH; ++oh) {
          T* r0 = acc.data() + th.i0[oh] * IW;
          T* r1 = acc.data() + th.i1[oh] * IW;
          const T h0 = th.w0[oh], h1 = th.w1[oh];
          for (int64_t ow = 0; ow < OW; ++ow) {
            const T v = static_cast<T>(g[oh * OW + ow]);
            const int64_t a = tw.i0[ow], b = tw.i1[ow];
            r0[a] += h0 * tw.w0[ow] * v;
            r0[b] += h0 * tw.w1[ow] * v;
            r1[a] += h1 * tw.w0[ow] * v;
            r1[b] += h1 * tw.w1[ow] * v;
          }
        }
        scalar_t* out = gx + p * IH * IW;
        for (int64_t k = 0; k < IH * IW; ++k) out[k] = static_cast<scalar_t>(acc[k]);
      }
    });
    return;
  }
  at::parallel_for(0, N * IH * IW, grain(C * 4), [&](int64_t begin, int64_t end) {
    std::vector<T> acc(C);
    for (int64_t pix = begin; pix < end; ++pix) {
      const int iw = static_cast<int>(pix % IW), ih = static_cast<int>((pix / IW) % IH);
      const int64_t n = pix / (IW * IH);
      std::fill(acc.begin(), acc.end(), T(0));
      for (int64_t oh = th.begin[ih]; oh < th.end[ih]; ++oh) {
        const T wh = th.weight(oh, ih);
        for (int64_t ow = tw.begin[iw]; ow < tw.end[iw]; ++ow) {
          const T w = wh * tw.weight(ow, iw);
          const scalar_t* g = gy + ((n * OH + oh) * OW + ow) * C;
          for (int64_t c = 0; c < C; ++c) acc[c] += w * static_cast<T>(g[c]);
        }
      }
      scalar_t* out = gx + pix * C;
      for (int64_t c = 0; c < C; ++c) out[c] = static_cast<scalar_t>(acc[c]);
    }
  });
}

at::Tensor upsample_bilinear_cpu(const at::Tensor& input, at::IntArrayRef output_size, std::optional<double> scales_h,
                                 std::optional<double> scales_w, c10::string_view mode) {
  lss::check_cpu_tensor(input, "upsample_bilinear: input");
  check_forward(input, output_size);
  const CoordMode coord_mode = parse_mode(std::string(mode));
  KernelLayout io = kernel_layout(input, {input.size(0), input.size(1), output_size[0], output_size[1]});
  const bool channels_last = io.channels_last;
  const at::Tensor& src = io.src;
  at::Tensor& output = io.result;
  if (output.numel() == 0) return output;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "upsample_bilinear_cpu", [&] {
    forward_kernel<scalar_t>(src, output, scales_h, scales_w, coord_mode, channels_last);
  });
  return output;
}

at::Tensor upsample_bilinear_backward_cpu(const at::Tensor& grad_output, at::IntArrayRef input_size,
                                          std::optional<double> scales_h, std::optional<double> scales_w,
                                          c10::string_view mode) {
  lss::check_cpu_tensor(grad_output, "_upsample_bilinear_backward: grad_output");
  check_backward(grad_output, input_size);
  const CoordMode coord_mode = parse_mode(std::string(mode));
  KernelLayout io = kernel_layout(grad_output, input_size);
  const bool channels_last = io.channels_last;
  const at::Tensor& gy = io.src;
  at::Tensor& grad_input = io.result;
  if (grad_input.numel() == 0) return grad_input;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gy.scalar_type(), "upsample_bilinear_backward_cpu", [&] {
    backward_kernel<scalar_t>(gy, grad_input, scales_h, scales_w, coord_mode, channels_last);
  });
  return grad_input;
}

}  // namespace
}  // namespace upsample
}  // namespace lss

TORCH_LIBRARY_IMPL(lss, CPU, m) {
  m.impl("upsample_bilinear", TORCH_FN(lss::upsample::upsample_bilinear_cpu));
  m.impl("_upsample_bilinear_backward", TORCH_FN(lss::upsample::upsample_bilinear_backward_cpu));
}
