// Depthwise 2-D convolution of contiguous N x C x H x W inputs (one KH x KW filter per channel, no bias), with
// explicit top/bottom/left/right zero padding so that "same" padding of even sizes (EfficientNet's) needs no padded
// copy of the input. The host checks shared by the CPU and CUDA kernels (defined in depthwise_conv.cpp).
#pragma once

#include "ops/common.h"

namespace lss {
namespace depthwise_conv {

// Largest filter side the kernels take (the CUDA weight gradient keeps KH x KW sums per thread).
constexpr int64_t kMaxKernel = 7;

// The convolution's geometry, checked: output OH x OW.
struct Geometry {
  int64_t n, c, h, w, kh, kw, sh, sw, pt, pb, pl, pr, oh, ow;
};

// input N x C x H x W contiguous floating; weight C x 1 x KH x KW of the input's dtype or float32, contiguous, on
// its device; stride (sH, sW) >= 1; padding (top, bottom, left, right) >= 0; an output of at least 1 x 1.
Geometry check_forward(const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride,
                       at::IntArrayRef padding);
// grad_output N x C x OH x OW of the input's dtype, contiguous, on its device.
Geometry check_backward(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
                        at::IntArrayRef stride, at::IntArrayRef padding);

}  // namespace depthwise_conv
}  // namespace lss
