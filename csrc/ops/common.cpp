// Host-compiled definitions of the checks declared in common.h.
#include "ops/common.h"
#include "ops/host_check.h"

namespace lss {

void raise_error(const std::string& message) { TORCH_CHECK(false, message); }

std::string shape_string(at::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out + "]";
}

void check_floating(const at::Tensor& t, const char* name) {
  LSS_HOST_CHECK(at::isFloatingType(t.scalar_type()), name, " must be a floating-point tensor (float32, float16, "
              "bfloat16 or float64), got ", t.scalar_type());
}

void check_dim(const at::Tensor& t, int64_t dim, const char* name, const char* shape_desc) {
  LSS_HOST_CHECK(t.dim() == dim, name, " must be ", dim, "-D (", shape_desc, "), got shape ", t.sizes());
}

void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* name_a, const char* name_b) {
  LSS_HOST_CHECK(a.device() == b.device(), name_a, " and ", name_b, " must be on the same device, got ", a.device(),
              " and ", b.device());
}

void check_cpu_tensor(const at::Tensor& t, const char* name) {
  LSS_HOST_CHECK(t.device().is_cpu(), name, " must be a CPU tensor here, got ", t.device());
}

void check_cuda_tensor(const at::Tensor& t, const char* name) {
  LSS_HOST_CHECK(t.device().is_cuda(), name, " must be a CUDA tensor here, got ", t.device());
}

}  // namespace lss
