// Shared checks and helpers for the lss ops. Each op declares its schema in csrc/ops/<op>.cpp
// (TORCH_LIBRARY_FRAGMENT(lss, m)) and implements kernels in cpu/<op>.cpp and cuda/<op>.cu.
#pragma once

#include <torch/library.h>
#include <ATen/ATen.h>

#define LSS_CHECK_FLOATING(t, name)                                                                     \
  TORCH_CHECK(at::isFloatingType((t).scalar_type()), name " must be a floating-point tensor "           \
              "(float32, float16, bfloat16 or float64), got ", (t).scalar_type())

#define LSS_CHECK_DIM(t, d, name, shape_desc)                                                           \
  TORCH_CHECK((t).dim() == (d), name " must be " #d "-D (" shape_desc "), got shape ", (t).sizes())

#define LSS_CHECK_SAME_DEVICE(a, b, name_a, name_b)                                                     \
  TORCH_CHECK((a).device() == (b).device(), name_a " and " name_b " must be on the same device, got ",  \
              (a).device(), " and ", (b).device())

#define LSS_CHECK_CPU(t, name) \
  TORCH_CHECK((t).device().is_cpu(), name " must be a CPU tensor here, got ", (t).device())

#define LSS_CHECK_CUDA(t, name) \
  TORCH_CHECK((t).device().is_cuda(), name " must be a CUDA tensor here, got ", (t).device())

namespace lss {

// Number of threads per block used by most elementwise kernels.
constexpr int kThreads = 256;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace lss
