// Coordinate transform of bilinear upsampling shared by the CPU and CUDA kernels. Along each axis the output index
// o samples the source coordinate x(o) of the mode (ONNX Resize coordinate_transformation_mode names; the
// pytorch_half_pixel mode follows F.interpolate itself), clamped to [0, in - 1]; the value is
// w0 * src[i0] + w1 * src[i1] with i0 = floor(x), i1 = min(i0 + 1, in - 1), w1 = x - i0, w0 = 1 - w1.
#pragma once

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>

namespace lss {
namespace upsample {

enum class CoordMode : int { kPytorchHalfPixel = 0, kHalfPixel = 1, kAlignCorners = 2, kAsymmetric = 3 };

inline CoordMode parse_mode(const std::string& mode) {
  if (mode == "pytorch_half_pixel") return CoordMode::kPytorchHalfPixel;
  if (mode == "half_pixel") return CoordMode::kHalfPixel;
  if (mode == "align_corners") return CoordMode::kAlignCorners;
  if (mode == "asymmetric") return CoordMode::kAsymmetric;
  TORCH_CHECK(false, "upsample_bilinear: unknown mode '", mode,
              "'; expected one of pytorch_half_pixel, half_pixel, align_corners, asymmetric");
}

// Output-per-input step of the transform: (in - 1) / (out - 1) for align_corners; 1 for pytorch_half_pixel on an
// axis whose output length equals its input length (F.interpolate copies such an axis whatever the scale factor);
// else 1 / scale_factor when the output size came from a scale factor (as PyTorch and ONNX Resize do), else in / out.
template <typename T>
T coord_scale(int in, int out, std::optional<double> scale_factor, CoordMode mode) {
  if (mode == CoordMode::kAlignCorners) {
    return out > 1 ? static_cast<T>(in - 1) / static_cast<T>(out - 1) : T(0);
  }
  if (mode == CoordMode::kPytorchHalfPixel && in == out) {
    return T(1);
  }
  if (scale_factor.has_value() && *scale_factor > 0) {
    return static_cast<T>(1.0 / *scale_factor);
  }
  return static_cast<T>(in) / static_cast<T>(out);
}

// One axis of the resize: output index -> taps into the input, and input index -> the outputs that sample it.
template <typename T>
struct AxisMap {
  T scale;
  int in;  // lengths along the axis (checked to fit in int32 by check_forward / check_backward)
  int out;
  CoordMode mode;

  AxisMap(int in_, int out_, std::optional<double> scale_factor, CoordMode mode_)
      : scale(coord_scale<T>(in_, out_, scale_factor, mode_)), in(in_), out(out_), mode(mode_) {}

  C10_HOST_DEVICE bool half_pixel() const {
    return mode == CoordMode::kPytorchHalfPixel || mode == CoordMode::kHalfPixel;
  }

  C10_HOST_DEVICE T source(int o) const {
    T x;
    // An output axis of length 1 samples the centre, as F.interpolate does (ONNX's rule, index 0, is the export's).
    if (half_pixel()) {
      x = scale * (static_cast<T>(o) + T(0.5)) - T(0.5);
    } else {
      x = scale * static_cast<T>(o);
    }
    const T hi = static_cast<T>(in - 1);
    return x < T(0) ? T(0) : (x > hi ? hi : x);
  }

  C10_HOST_DEVICE void taps(int o, int& i0, int& i1, T& w0, T& w1) const {
    const T x = source(o);
    i0 = static_cast<int>(x);  // x >= 0, so truncation is floor
    i1 = i0 + (i0 < in - 1 ? 1 : 0);
    w1 = x - static_cast<T>(i0);
    w0 = T(1) - w1;
  }

  // First output index whose left tap i0 is >= k (out when there is none). x(o) is non-decreasing in o, so the
  // closed-form estimate is corrected by stepping against source() itself and stays exact under rounding.
  C10_HOST_DEVICE int first_output_from(int k) const {
    if (k <= 0) return 0;
    if (k > in - 1) return out;
    const T kk = static_cast<T>(k);
    T est = T(0);
    if (scale > T(0)) {
      est = half_pixel() ? (kk + T(0.5)) / scale - T(0.5) : kk / scale;
    }
    int o;
    if (!(est > T(0))) {
      o = 0;
    } else if (est >= static_cast<T>(out)) {
      o = out;
    } else {
      o = static_cast<int>(est);
      o += static_cast<T>(o) < est ? 1 : 0;
    }
    while (o > 0 && source(o - 1) >= kk) --o;
    while (o < out && source(o) < kk) ++o;
    return o;
  }

  // Outputs [begin, end) are the only ones whose taps include input index i.
  C10_HOST_DEVICE void sampled_by(int i, int& begin, int& end) const {
    begin = first_output_from(i - 1);
    end = first_output_from(i + 1);
  }

  // Weight with which output o reads input i (0 when it does not).
  C10_HOST_DEVICE T weight(int o, int i) const {
    int i0, i1;
    T w0, w1;
    taps(o, i0, i1, w0, w1);
    return (i0 == i ? w0 : T(0)) + (i1 == i ? w1 : T(0));
  }
};

// Host-side checks, with internal linkage: the CPU (g++) and CUDA (nvcc) translation units each keep their own.
namespace {

// Sizes as "[a, b, c]" for error messages.
inline std::string dims(at::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

// Kernels run in NHWC order on a channels_last input (keeping its format), in NCHW order on anything else.
inline bool is_channels_last(const at::Tensor& t) {
  return !t.is_contiguous() && t.is_contiguous(at::MemoryFormat::ChannelsLast);
}

// The kernels' view of `t` (channels_last kept, anything else made contiguous) and an empty result of `sizes` in
// the same layout.
struct KernelLayout {
  bool channels_last;
  at::Tensor src;
  at::Tensor result;
};

inline KernelLayout kernel_layout(const at::Tensor& t, at::IntArrayRef sizes) {
  const bool channels_last = is_channels_last(t);
  const auto format = channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  return {channels_last, channels_last ? t : t.contiguous(), at::empty(sizes, t.options().memory_format(format))};
}

inline void check_forward(const at::Tensor& input, at::IntArrayRef output_size) {
  TORCH_CHECK(input.dim() == 4, "upsample_bilinear: input must be 4-D (N x C x H x W), got shape ", dims(input.sizes()));
  TORCH_CHECK(at::isFloatingType(input.scalar_type()), "upsample_bilinear: input must be float32, float16, "
              "bfloat16 or float64, got ", input.scalar_type());
  TORCH_CHECK(output_size.size() == 2 && output_size[0] > 0 && output_size[1] > 0,
              "upsample_bilinear: output_size must be two positive sizes (H, W), got ", dims(output_size));
  TORCH_CHECK(input.size(2) > 0 && input.size(3) > 0, "upsample_bilinear: input height and width must be positive, "
              "got shape ", dims(input.sizes()));
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  TORCH_CHECK(input.size(2) < kMax && input.size(3) < kMax && output_size[0] < kMax && output_size[1] < kMax,
              "upsample_bilinear: heights and widths must be below 2^31, got input ", dims(input.sizes()), " and output ",
              dims(output_size));
}

inline void check_backward(const at::Tensor& grad_output, at::IntArrayRef input_size) {
  TORCH_CHECK(grad_output.dim() == 4, "_upsample_bilinear_backward: grad_output must be 4-D (N x C x H x W), got "
              "shape ", dims(grad_output.sizes()));
  TORCH_CHECK(at::isFloatingType(grad_output.scalar_type()), "_upsample_bilinear_backward: grad_output must be "
              "floating point, got ", grad_output.scalar_type());
  TORCH_CHECK(input_size.size() == 4 && input_size[0] == grad_output.size(0) && input_size[1] == grad_output.size(1)
              && input_size[2] > 0 && input_size[3] > 0 && grad_output.size(2) > 0 && grad_output.size(3) > 0,
              "_upsample_bilinear_backward: input_size ", dims(input_size), " does not fit grad_output of shape ",
              dims(grad_output.sizes()), "; expected (N, C, H, W) with the batch and channels of grad_output");
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  TORCH_CHECK(input_size[2] < kMax && input_size[3] < kMax && grad_output.size(2) < kMax && grad_output.size(3) < kMax,
              "_upsample_bilinear_backward: heights and widths must be below 2^31, got ", dims(input_size), " and ",
              dims(grad_output.sizes()));
}

}  // namespace

}  // namespace upsample
}  // namespace lss
