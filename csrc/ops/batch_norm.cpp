// Schemas and host-side argument checks of the training-mode batch norm (kernels: cpu/batch_norm.cpp,
// cuda/batch_norm.cu). The forward returns the output and the batch's per-channel mean and invstd (the backward
// reads them); the backward returns the gradients of the input, the weight and the bias. Running statistics are the
// caller's (lss/ops/batch_norm.py updates them from mean and invstd).
#include "ops/batch_norm.h"
#include "ops/host_check.h"

TORCH_LIBRARY_FRAGMENT(lss, m) {
  m.def("batch_norm_train(Tensor input, Tensor weight, Tensor bias, float eps) -> (Tensor, Tensor, Tensor)");
  m.def(
      "_batch_norm_train_backward(Tensor grad_output, Tensor input, Tensor weight, Tensor mean, Tensor invstd) "
      "-> (Tensor, Tensor, Tensor)");
}

namespace lss {
namespace batch_norm {

namespace {

void check_channel_vector(const char* op, const at::Tensor& t, const at::Tensor& input, const char* name) {
  LSS_HOST_CHECK(t.dim() == 1 && t.size(0) == input.size(1), op, ": ", name, " must have one value per channel (",
                 input.size(1), "), got shape ", t.sizes());
  LSS_HOST_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", t.scalar_type());
  LSS_HOST_CHECK(t.device() == input.device(), op, ": ", name, " is on ", t.device(), " but the input on ",
                 input.device());
  LSS_HOST_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

void check_input(const char* op, const at::Tensor& input) {
  LSS_HOST_CHECK(input.dim() >= 2, op, ": input must be N x C x ... (at least 2-D), got shape ", input.sizes());
  LSS_HOST_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kHalf ||
                     input.scalar_type() == at::kBFloat16 || input.scalar_type() == at::kDouble,
                 op, ": input must be float32, float16, bfloat16 or float64, got ", input.scalar_type());
  LSS_HOST_CHECK(input.is_contiguous(), op, ": input must be contiguous (NCHW); call .contiguous() or use "
                 "torch.nn.functional.batch_norm for other layouts");
  LSS_HOST_CHECK(input.size(1) >= 1 && input.numel() / input.size(1) >= 2, op, ": training needs at least two "
                 "values per channel (N x spatial size >= 2; the variance of one value is undefined), got shape ",
                 input.sizes());
}

}  // namespace

void check_forward(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  check_input("batch_norm_train", input);
  LSS_HOST_CHECK(eps > 0, "batch_norm_train: eps must be positive, got ", eps);
  check_channel_vector("batch_norm_train", weight, input, "weight");
  check_channel_vector("batch_norm_train", bias, input, "bias");
}

void check_backward(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
                    const at::Tensor& mean, const at::Tensor& invstd) {
  LSS_HOST_CHECK(grad_output.sizes() == input.sizes(), "_batch_norm_train_backward: grad_output has shape ",
                 grad_output.sizes(), " but the input ", input.sizes());
  LSS_HOST_CHECK(grad_output.scalar_type() == input.scalar_type(), "_batch_norm_train_backward: grad_output is ",
                 grad_output.scalar_type(), " but the input ", input.scalar_type());
  LSS_HOST_CHECK(grad_output.device() == input.device(), "_batch_norm_train_backward: grad_output is on ",
                 grad_output.device(), " but the input on ", input.device());
  const char* op = "_batch_norm_train_backward";
  check_input(op, input);
  LSS_HOST_CHECK(grad_output.is_contiguous(), op, ": grad_output must be contiguous (NCHW)");
  check_channel_vector(op, weight, input, "weight");
  check_channel_vector(op, mean, input, "mean");
  check_channel_vector(op, invstd, input, "invstd");
}

}  // namespace batch_norm
}  // namespace lss
