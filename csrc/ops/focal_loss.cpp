// Schemas of the focal loss ops. Kernels: cpu/focal_loss.cpp and cuda/focal_loss.cu.
//
// Each forward op returns (loss, grad, grad_scale): grad is d(unreduced loss)/d logits in the logits' dtype when
// save_grad is true (empty otherwise), computed in the same pass as the loss; grad_scale (0-dim, float32 or
// float64 for float64 logits) is the reduction's factor (1 / denominator for "mean", else 1). The backward op
// returns grad_output * grad_scale * grad, so forward + backward reads logits and targets once.
#include "ops/common.h"

TORCH_LIBRARY_FRAGMENT(lss, m) {
  m.def(
      "sigmoid_focal_loss(Tensor logits, Tensor targets, Tensor? weight, Tensor? mask, float alpha, float gamma, "
      "str reduction, bool save_grad) -> (Tensor, Tensor, Tensor)");
  m.def(
      "softmax_focal_loss(Tensor logits, Tensor targets, Tensor? weight, float alpha, float gamma, "
      "str reduction, bool save_grad) -> (Tensor, Tensor, Tensor)");
  m.def("_focal_loss_backward(Tensor grad_output, Tensor grad, Tensor grad_scale) -> Tensor");
}
