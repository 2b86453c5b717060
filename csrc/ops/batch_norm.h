// Training-mode batch normalization over N x C x (spatial...) inputs in their contiguous (NCHW) layout, the host
// checks shared by the CPU and CUDA kernels (defined in batch_norm.cpp). Every channel c normalizes the N x S values
// x[n, c, s] (S: the product of the spatial sizes) with their mean and biased variance; float32 weight, bias, mean
// and invstd = 1 / sqrt(var + eps); the output in the input's dtype.
#pragma once

#include "ops/common.h"

namespace lss {
namespace batch_norm {

// input N x C x ... (dim >= 2, contiguous, floating, N * S >= 1), weight and bias float32 of C on its device.
void check_forward(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias, double eps);
// grad_output of input's shape and dtype; mean and invstd float32 of C.
void check_backward(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
                    const at::Tensor& mean, const at::Tensor& invstd);

}  // namespace batch_norm
}  // namespace lss
