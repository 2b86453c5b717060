// Coordinate transform of bilinear upsampling shared by the CPU and CUDA kernels. Along each axis the output index
// o samples the source coordinate x(o) of the ONNX Resize coordinate_transformation_mode, clamped to [0, in - 1];
// the value is w0 * src[i0] + w1 * src[i1] with i0 = floor(x), i1 = min(i0 + 1, in - 1), w1 = x - i0, w0 = 1 - w1.
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>
#include <optional>
#include <string>

#include "ops/common.h"

namespace lss {
namespace upsample {

enum class CoordMode : int { kPytorchHalfPixel = 0, kHalfPixel = 1, kAlignCorners = 2, kAsymmetric = 3 };

// Host-side argument handling, defined in upsample.cpp (see common.h for why it is not inline here).
CoordMode parse_mode(const std::string& mode);

// Kernels run in NHWC order on a channels_last input (keeping its format), in NCHW order on anything else.
bool is_channels_last(const at::Tensor& t);

void check_forward(const at::Tensor& input, at::IntArrayRef output_size);
void check_backward(const at::Tensor& grad_output, at::IntArrayRef input_size);

namespace {

// Output-per-input step of the transform: (in - 1) / (out - 1) for align_corners, else 1 / scale_factor when
// the output size came from a scale factor (as PyTorch and ONNX Resize do), else in / out.
template <typename T>
T coord_scale(int64_t in, int64_t out, std::optional<double> scale_factor, CoordMode mode) {
  if (mode == CoordMode::kAlignCorners) {
    return out > 1 ? static_cast<T>(in - 1) / static_cast<T>(out - 1) : T(0);
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
  int64_t in;
  int64_t out;
  CoordMode mode;

  AxisMap(int64_t in_, int64_t out_, std::optional<double> scale_factor, CoordMode mode_)
      : scale(coord_scale<T>(in_, out_, scale_factor, mode_)), in(in_), out(out_), mode(mode_) {}

  C10_HOST_DEVICE bool half_pixel() const {
    return mode == CoordMode::kPytorchHalfPixel || mode == CoordMode::kHalfPixel;
  }

  C10_HOST_DEVICE T source(int64_t o) const {
    T x;
    if (mode == CoordMode::kPytorchHalfPixel && out == 1) {
      x = T(0);
    } else if (half_pixel()) {
      x = scale * (static_cast<T>(o) + T(0.5)) - T(0.5);
    } else {
      x = scale * static_cast<T>(o);
    }
    const T hi = static_cast<T>(in - 1);
    return x < T(0) ? T(0) : (x > hi ? hi : x);
  }

  C10_HOST_DEVICE void taps(int64_t o, int64_t& i0, int64_t& i1, T& w0, T& w1) const {
    const T x = source(o);
    i0 = static_cast<int64_t>(x);  // x >= 0, so truncation is floor
    i1 = i0 + (i0 < in - 1 ? 1 : 0);
    w1 = x - static_cast<T>(i0);
    w0 = T(1) - w1;
  }

  // First output index whose left tap i0 is >= k (out when there is none). x(o) is non-decreasing in o, so the
  // closed-form estimate is corrected by stepping against source() itself and stays exact under rounding.
  C10_HOST_DEVICE int64_t first_output_from(int64_t k) const {
    if (k <= 0) return 0;
    if (k > in - 1) return out;
    const T kk = static_cast<T>(k);
    T est = T(0);
    if (scale > T(0) && !(mode == CoordMode::kPytorchHalfPixel && out == 1)) {
      est = half_pixel() ? (kk + T(0.5)) / scale - T(0.5) : kk / scale;
    }
    int64_t o;
    if (!(est > T(0))) {
      o = 0;
    } else if (est >= static_cast<T>(out)) {
      o = out;
    } else {
      o = static_cast<int64_t>(est);
      o += static_cast<T>(o) < est ? 1 : 0;
    }
    while (o > 0 && source(o - 1) >= kk) --o;
    while (o < out && source(o) < kk) ++o;
    return o;
  }

  // Outputs [begin, end) are the only ones whose taps include input index i.
  C10_HOST_DEVICE void sampled_by(int64_t i, int64_t& begin, int64_t& end) const {
    begin = first_output_from(i - 1);
    end = first_output_from(i + 1);
  }

  // Weight with which output o reads input i (0 when it does not).
  C10_HOST_DEVICE T weight(int64_t o, int64_t i) const {
    int64_t i0, i1;
    T w0, w1;
    taps(o, i0, i1, w0, w1);
    return (i0 == i ? w0 : T(0)) + (i1 == i ? w1 : T(0));
  }
};

}  // namespace
}  // namespace upsample
}  // namespace lss
