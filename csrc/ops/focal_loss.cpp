// Schemas and host-side argument checks of the focal loss ops. Kernels: cpu/focal_loss.cpp and cuda/focal_loss.cu.
//
// Each forward op returns (loss, grad, grad_scale) with d loss / d logits = grad_scale * grad: grad, in the logits'
// dtype when save_grad is true (empty otherwise), is computed in the same pass as the loss and already carries the
// reduction's 1 / denominator where the host knows it (see folds_reduction_into_grad); grad_scale (0-dim, float32
// or float64 for float64 logits) is the factor still to apply: 1 / denominator for a masked dense "mean" (the
// kernel counts the kept cells) and for float16 "mean", else 1. The backward returns grad_output * grad_scale *
// grad: out of place (_focal_loss_backward), or in place on the saved gradient (_focal_loss_backward_, which does
// nothing when the factor is 1), so forward + backward reads logits and targets once and, in the common case,
// writes the gradient once. The in-place form changes the op's grad output, so it is used only for calls made with
// reuse_grad = true (lss.ops.sigmoid_focal_loss / softmax_focal_loss, which never hand grad out); the kernels
// ignore reuse_grad, the autograd registration (lss/ops/focal_loss.py) reads it.
#include "ops/focal_loss.h"
#include "ops/host_check.h"

TORCH_LIBRARY_FRAGMENT(lss, m) {
  m.def(
      "sigmoid_focal_loss(Tensor logits, Tensor targets, Tensor? weight, Tensor? mask, float alpha, float gamma, "
      "str reduction, bool save_grad, bool reuse_grad=False) -> (Tensor, Tensor, Tensor)");
  m.def(
      "softmax_focal_loss(Tensor logits, Tensor targets, Tensor? weight, float alpha, float gamma, "
      "str reduction, bool save_grad, bool reuse_grad=False) -> (Tensor, Tensor, Tensor)");
  m.def("_focal_loss_backward(Tensor grad_output, Tensor grad, Tensor grad_scale) -> Tensor");
  m.def("_focal_loss_backward_(Tensor(a!) grad, Tensor grad_output, Tensor grad_scale) -> ()");
}

namespace lss {
namespace focal {

Reduction parse_reduction(const std::string& name, const char* op) {
  if (name == "none") return kNone;
  if (name == "mean") return kMean;
  if (name == "sum") return kSum;
  LSS_HOST_CHECK(false, op, ": reduction must be \"none\", \"mean\" or \"sum\", got \"", name, "\"");
}

SigmoidLayout check_sigmoid_args(const at::Tensor& logits, const at::Tensor& targets,
                                 const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& mask) {
  check_floating(logits, "sigmoid_focal_loss: logits");
  check_same_device(logits, targets, "sigmoid_focal_loss: logits", "targets");
  SigmoidLayout s;
  s.index_targets = !at::isFloatingType(targets.scalar_type());
  s.numel = logits.numel();
  if (s.index_targets) {
    LSS_HOST_CHECK(targets.scalar_type() == at::kLong, "sigmoid_focal_loss: class-index targets must be int64, got ",
                targets.scalar_type(), "; convert them with .long()");
    LSS_HOST_CHECK(logits.dim() == 2 && targets.dim() == 1 && targets.size(0) == logits.size(0),
                "sigmoid_focal_loss: class-index targets need logits N x C and targets N, got logits ", logits.sizes(),
                " and targets ", targets.sizes());
  } else {
    LSS_HOST_CHECK(targets.sizes() == logits.sizes(), "sigmoid_focal_loss: dense targets must have the logits' shape ",
                logits.sizes(), ", got ", targets.sizes());
    LSS_HOST_CHECK(targets.scalar_type() == logits.scalar_type() || targets.scalar_type() == at::kFloat,
                "sigmoid_focal_loss: dense targets must be float32 or the logits' dtype (", logits.scalar_type(),
                "), got ", targets.scalar_type());
  }
  s.classes = logits.dim() >= 2 ? logits.size(1) : 1;
  s.rows = logits.dim() >= 1 ? logits.size(0) : 1;
  s.inner = 1;
  for (int64_t d = 2; d < logits.dim(); ++d) s.inner *= logits.size(d);
  s.weight_by_label = false;
  if (weight.has_value()) {
    check_same_device(logits, *weight, "sigmoid_focal_loss: logits", "weight");
    check_floating(*weight, "sigmoid_focal_loss: weight");
    s.weight_by_label = s.index_targets && weight->dim() == 1 && weight->size(0) == s.classes + 1;
    LSS_HOST_CHECK(logits.dim() >= 2 && weight->dim() == 1 && (weight->size(0) == s.classes || s.weight_by_label),
                "sigmoid_focal_loss: weight must be 1-D with one entry per class (logits dim 1), or C + 1 entries "
                "indexed by the class-index target, got weight ", weight->sizes(), " for logits ", logits.sizes());
  }
  if (mask.has_value()) {
    check_same_device(logits, *mask, "sigmoid_focal_loss: logits", "mask");
    LSS_HOST_CHECK(mask->scalar_type() == at::kBool && mask->sizes() == logits.sizes(),
                "sigmoid_focal_loss: mask must be a bool tensor of the logits' shape ", logits.sizes(), ", got ",
                mask->scalar_type(), " ", mask->sizes());
  }
  return s;
}

void check_softmax_args(const at::Tensor& logits, const at::Tensor& targets, const c10::optional<at::Tensor>& weight) {
  check_floating(logits, "softmax_focal_loss: logits");
  check_same_device(logits, targets, "softmax_focal_loss: logits", "targets");
  LSS_HOST_CHECK(targets.scalar_type() == at::kLong, "softmax_focal_loss: targets must be int64 class indices, got ",
              targets.scalar_type());
  LSS_HOST_CHECK(logits.dim() == 2 && targets.dim() == 1 && targets.size(0) == logits.size(0),
              "softmax_focal_loss: need logits N x C and targets N, got logits ", logits.sizes(), " and targets ",
              targets.sizes());
  if (weight.has_value()) {
    check_same_device(logits, *weight, "softmax_focal_loss: logits", "weight");
    check_floating(*weight, "softmax_focal_loss: weight");
    LSS_HOST_CHECK(weight->dim() == 1 && weight->size(0) == logits.size(1),
                "softmax_focal_loss: weight must be 1-D with one entry per class, got ", weight->sizes(),
                " for logits ", logits.sizes());
  }
}

void check_backward_args(const at::Tensor& grad_output, const at::Tensor& grad, const at::Tensor& grad_scale) {
  LSS_HOST_CHECK(grad_scale.dim() == 0, "focal loss backward: grad_scale must be 0-dim, got ", grad_scale.sizes());
  check_same_device(grad, grad_output, "focal loss backward: grad", "grad_output");
  check_same_device(grad, grad_scale, "focal loss backward: grad", "grad_scale");
}

void raise_bad_targets(const char* op, const std::string& expected, int64_t lo, int64_t hi) {
  LSS_HOST_CHECK(false, op, ": targets must lie in ", expected, ", got values in [", lo, ", ", hi, "]");
}

at::Tensor scale_grad_broadcast(const at::Tensor& grad_output, const at::Tensor& grad, const at::Tensor& grad_scale) {
  const auto acc = grad_scale.scalar_type();
  return (grad.to(acc) * (grad_output.to(acc) * grad_scale)).to(grad.scalar_type());
}

// Messages are plain strings: this check runs in CUDA calls, where streaming sizes or dtypes into an error has
// crashed the extension (see common.h).
void check_backward_inplace_args(const at::Tensor& grad_output, const at::Tensor& grad, const at::Tensor& grad_scale) {
  check_backward_args(grad_output, grad, grad_scale);
  const std::string op = "focal loss backward (in place): ";
  if (!grad.is_contiguous()) raise_error(op + "grad must be contiguous (the forward's saved gradient)");
  if (grad_output.numel() != 1 || grad_output.scalar_type() != grad.scalar_type()) {
    raise_error(op + "grad_output must be one element of grad's dtype " + c10::toString(grad.scalar_type()) +
                ", got " + std::to_string(grad_output.numel()) + " elements of " +
                c10::toString(grad_output.scalar_type()) + "; use _focal_loss_backward otherwise");
  }
  if (grad_scale.scalar_type() != acc_dtype(grad)) {
    raise_error(op + "grad_scale must be " + c10::toString(acc_dtype(grad)) + ", got " +
                c10::toString(grad_scale.scalar_type()));
  }
}

double host_denominator(Reduction reduction, const SigmoidLayout& s, bool has_mask) {
  if (reduction == kNone) return 0.0;
  if (reduction == kSum) return 1.0;
  if (s.index_targets) return static_cast<double>(s.rows);
  return has_mask ? -1.0 : static_cast<double>(s.numel);
}

bool folds_reduction_into_grad(at::ScalarType dtype, double denominator) {
  return denominator > 0 && dtype != at::kHalf;
}

at::ScalarType acc_dtype(const at::Tensor& logits) {
  return logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace focal
}  // namespace lss
