// Per-element focal loss math shared by the CPU and CUDA kernels (csrc/ops/cpu|cuda/focal_loss.*).
// T is the accumulation type: float for float32/float16/bfloat16 inputs, double for float64.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <string>

#include "ops/common.h"

namespace lss {
namespace focal {

enum Reduction : int { kNone = 0, kMean = 1, kSum = 2 };

inline Reduction parse_reduction(const std::string& name, const char* op) {
  if (name == "none") return kNone;
  if (name == "mean") return kMean;
  if (name == "sum") return kSum;
  TORCH_CHECK(false, op, ": reduction must be \"none\", \"mean\" or \"sum\", got \"", name, "\"");
  return kNone;
}

C10_HOST_DEVICE inline float exp_(float x) { return expf(x); }
C10_HOST_DEVICE inline double exp_(double x) { return exp(x); }
C10_HOST_DEVICE inline float expm1_(float x) { return expm1f(x); }
C10_HOST_DEVICE inline double expm1_(double x) { return expm1(x); }
C10_HOST_DEVICE inline float log_(float x) { return logf(x); }
C10_HOST_DEVICE inline double log_(double x) { return log(x); }
C10_HOST_DEVICE inline float log1p_(float x) { return log1pf(x); }
C10_HOST_DEVICE inline double log1p_(double x) { return log1p(x); }
C10_HOST_DEVICE inline float pow_(float x, float y) { return powf(x, y); }
C10_HOST_DEVICE inline double pow_(double x, double y) { return pow(x, y); }

// q^gamma with the common exponents spelled out (pow is the slowest instruction in the loop); 0^0 = 1.
template <typename T>
C10_HOST_DEVICE inline T modulating_factor(T q, T gamma) {
  if (gamma == T(2)) return q * q;
  if (gamma == T(1)) return q;
  if (gamma == T(0)) return T(1);
  return pow_(q, gamma);
}

// Sigmoid focal loss of one logit x against target t in [0, 1] and its derivative d loss / d x.
//   ce = softplus(x) - x t,  q = 1 - p_t = p (1 - t) + (1 - p) t,  loss = alpha_t ce q^gamma
//   d loss / d x = alpha_t q^gamma [(p - t) + gamma (1 - 2t) ce p (1 - p) / q]
// p and 1 - p both come from exp(-|x|) so neither cancels; p (1 - p) / q lies in [0, 1] (q is a convex
// combination of p and 1 - p) and tends to 0 where q underflows to 0 (saturated logit, binary target), so no
// inf * 0 appears for gamma < 1.
template <typename T>
C10_HOST_DEVICE inline void sigmoid_focal(T x, T t, T alpha, T gamma, T& loss, T& dloss) {
  const T e = exp_(x >= T(0) ? -x : x);
  const T inv = T(1) / (T(1) + e);
  const T p = x >= T(0) ? inv : e * inv;
  const T pc = x >= T(0) ? e * inv : inv;
  const T ce = (x > T(0) ? x : T(0)) - x * t + log1p_(e);
  const T q = p * (T(1) - t) + pc * t;
  const T qg = modulating_factor(q, gamma);
  const T at = alpha >= T(0) ? alpha * t + (T(1) - alpha) * (T(1) - t) : T(1);
  const T ratio = q > T(0) ? (p * pc) / q : T(0);
  loss = at * ce * qg;
  dloss = at * qg * ((p - t) + gamma * (T(1) - T(2) * t) * ce * ratio);
}

// Softmax focal loss of one sample from lpt = log p_t (<= 0): loss = -alpha (1 - p_t)^gamma log p_t, and the
// coefficient k with d loss / d x_j = k (p_j - [j == target]):
//   k = alpha u^gamma (1 + gamma p_t r),  u = 1 - p_t = -expm1(lpt),  r = -log p_t / u = lpt / expm1(lpt)
// r -> 1 as p_t -> 1, which removes the 0 * inf of u^(gamma - 1) log p_t for gamma < 1.
template <typename T>
C10_HOST_DEVICE inline void softmax_focal(T lpt, T alpha, T gamma, T& loss, T& coef) {
  lpt = lpt < T(0) ? lpt : T(0);
  const T em1 = expm1_(lpt);
  const T u = -em1;
  const T ug = modulating_factor(u, gamma);
  const T r = lpt < T(0) ? lpt / em1 : T(1);
  const T pt = exp_(lpt);
  loss = -alpha * ug * lpt;
  coef = alpha * ug * (T(1) + gamma * pt * r);
}

// Sizes of a sigmoid focal loss call: element i sits in class column (i / inner) % classes and, for class-index
// targets (logits N x C), in sample row i / classes.
struct SigmoidLayout {
  bool index_targets;
  int64_t numel;
  int64_t classes;
  int64_t inner;
  int64_t rows;
};

// Validates a direct call of lss::sigmoid_focal_loss (lss.ops.sigmoid_focal_loss prepares its arguments to pass).
inline SigmoidLayout check_sigmoid_args(const at::Tensor& logits, const at::Tensor& targets,
                                        const c10::optional<at::Tensor>& weight,
                                        const c10::optional<at::Tensor>& mask) {
  LSS_CHECK_FLOATING(logits, "sigmoid_focal_loss: logits");
  LSS_CHECK_SAME_DEVICE(logits, targets, "sigmoid_focal_loss: logits", "targets");
  SigmoidLayout s;
  s.index_targets = !at::isFloatingType(targets.scalar_type());
  s.numel = logits.numel();
  if (s.index_targets) {
    TORCH_CHECK(targets.scalar_type() == at::kLong, "sigmoid_focal_loss: class-index targets must be int64, got ",
                targets.scalar_type(), "; convert them with .long()");
    TORCH_CHECK(logits.dim() == 2 && targets.dim() == 1 && targets.size(0) == logits.size(0),
                "sigmoid_focal_loss: class-index targets need logits N x C and targets N, got logits ", logits.sizes(),
                " and targets ", targets.sizes());
  } else {
    TORCH_CHECK(targets.sizes() == logits.sizes(), "sigmoid_focal_loss: dense targets must have the logits' shape ",
                logits.sizes(), ", got ", targets.sizes());
    TORCH_CHECK(targets.scalar_type() == logits.scalar_type() || targets.scalar_type() == at::kFloat,
                "sigmoid_focal_loss: dense targets must be float32 or the logits' dtype (", logits.scalar_type(),
                "), got ", targets.scalar_type());
  }
  s.classes = logits.dim() >= 2 ? logits.size(1) : 1;
  s.rows = logits.dim() >= 1 ? logits.size(0) : 1;
  s.inner = 1;
  for (int64_t d = 2; d < logits.dim(); ++d) s.inner *= logits.size(d);
  if (weight.has_value()) {
    LSS_CHECK_SAME_DEVICE(logits, *weight, "sigmoid_focal_loss: logits", "weight");
    LSS_CHECK_FLOATING(*weight, "sigmoid_focal_loss: weight");
    TORCH_CHECK(logits.dim() >= 2 && weight->dim() == 1 && weight->size(0) == s.classes,
                "sigmoid_focal_loss: weight must be 1-D with one entry per class (logits dim 1), got weight ",
                weight->sizes(), " for logits ", logits.sizes());
  }
  if (mask.has_value()) {
    LSS_CHECK_SAME_DEVICE(logits, *mask, "sigmoid_focal_loss: logits", "mask");
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->sizes() == logits.sizes(),
                "sigmoid_focal_loss: mask must be a bool tensor of the logits' shape ", logits.sizes(), ", got ",
                mask->scalar_type(), " ", mask->sizes());
  }
  return s;
}

// Validates a direct call of lss::softmax_focal_loss.
inline void check_softmax_args(const at::Tensor& logits, const at::Tensor& targets,
                               const c10::optional<at::Tensor>& weight) {
  LSS_CHECK_FLOATING(logits, "softmax_focal_loss: logits");
  LSS_CHECK_SAME_DEVICE(logits, targets, "softmax_focal_loss: logits", "targets");
  TORCH_CHECK(targets.scalar_type() == at::kLong, "softmax_focal_loss: targets must be int64 class indices, got ",
              targets.scalar_type());
  TORCH_CHECK(logits.dim() == 2 && targets.dim() == 1 && targets.size(0) == logits.size(0),
              "softmax_focal_loss: need logits N x C and targets N, got logits ", logits.sizes(), " and targets ",
              targets.sizes());
  if (weight.has_value()) {
    LSS_CHECK_SAME_DEVICE(logits, *weight, "softmax_focal_loss: logits", "weight");
    LSS_CHECK_FLOATING(*weight, "softmax_focal_loss: weight");
    TORCH_CHECK(weight->dim() == 1 && weight->size(0) == logits.size(1),
                "softmax_focal_loss: weight must be 1-D with one entry per class, got ", weight->sizes(),
                " for logits ", logits.sizes());
  }
}

inline void check_backward_args(const at::Tensor& grad_output, const at::Tensor& grad,
                                const at::Tensor& grad_scale) {
  TORCH_CHECK(grad_scale.dim() == 0, "focal loss backward: grad_scale must be 0-dim, got ", grad_scale.sizes());
  LSS_CHECK_SAME_DEVICE(grad, grad_output, "focal loss backward: grad", "grad_output");
  LSS_CHECK_SAME_DEVICE(grad, grad_scale, "focal loss backward: grad", "grad_scale");
}

// grad_output * grad_scale * grad for any grad_output that broadcasts to grad, computed in grad_scale's dtype.
inline at::Tensor scale_grad_broadcast(const at::Tensor& grad_output, const at::Tensor& grad,
                                       const at::Tensor& grad_scale) {
  const auto acc = grad_scale.scalar_type();
  return (grad.to(acc) * (grad_output.to(acc) * grad_scale)).to(grad.scalar_type());
}

// The accumulation dtype of the weights and of grad_scale.
inline at::ScalarType acc_dtype(const at::Tensor& logits) {
  return logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace focal
}  // namespace lss
