// Shared checks and helpers for the lss ops. Each op declares its schema in csrc/ops/<op>.cpp
// (TORCH_LIBRARY_FRAGMENT(lss, m)) and implements kernels in cpu/<op>.cpp and cuda/<op>.cu.
//
// Host-side argument checks are declared in the ops' headers and defined once, in csrc/ops/*.cpp, so that only the
// host compiler builds them. nvcc sees torch's headers with __CUDACC__ set: a message that streams IntArrayRef,
// ScalarType or Device from a .cu file instantiates c10::str templates that the linker may merge with the host
// compiler's copies of the same name. Code in .cu files therefore calls these functions, and raises its own
// errors only through LSS_CHECK with a plain std::string message.
#pragma once

#include <torch/library.h>
#include <ATen/ATen.h>
#include <c10/macros/Macros.h>

#include <cstdint>
#include <string>

namespace lss {

// Throws c10::Error with this message (defined in common.cpp).
[[noreturn]] void raise_error(const std::string& message);

// "[2, 3, 4]": a shape for an LSS_CHECK message (the form TORCH_CHECK prints).
std::string shape_string(at::IntArrayRef sizes);

// name: what the tensor is, prefixed with the op ("bev_pool: depth").
void check_floating(const at::Tensor& t, const char* name);
void check_dim(const at::Tensor& t, int64_t dim, const char* name, const char* shape_desc);
void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* name_a, const char* name_b);
void check_cpu_tensor(const at::Tensor& t, const char* name);
void check_cuda_tensor(const at::Tensor& t, const char* name);

namespace {

// Number of threads per block used by most elementwise kernels.
constexpr int kThreads = 256;

C10_HOST_DEVICE constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace
}  // namespace lss

// TORCH_CHECK for .cu code: message is a std::string expression, built only when cond fails.
#define LSS_CHECK(cond, message)                    \
  do {                                              \
    if (C10_UNLIKELY(!(cond))) {                    \
      ::lss::raise_error(message);                  \
    }                                               \
  } while (false)
