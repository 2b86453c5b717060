// Per-element focal loss math shared by the CPU and CUDA kernels (csrc/ops/cpu|cuda/focal_loss.*), and the
// host-side argument checks they both call (defined in focal_loss.cpp).
// T is the accumulation type: float for float32/float16/bfloat16 inputs, double for float64.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <string>

#include "ops/common.h"

namespace lss {
namespace focal {

enum Reduction : int { kNone = 0, kMean = 1, kSum = 2 };

namespace {

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
// Rounding can leave lpt a hair above 0; the clamp is written so that a NaN lpt (a NaN or +-inf logit in the row)
// stays NaN, as in the PyTorch reference, instead of becoming a zero loss.
template <typename T>
C10_HOST_DEVICE inline void softmax_focal(T lpt, T alpha, T gamma, T& loss, T& coef) {
  lpt = lpt > T(0) ? T(0) : lpt;
  const T em1 = expm1_(lpt);
  const T u = -em1;
  const T ug = modulating_factor(u, gamma);
  const T r = lpt < T(0) ? lpt / em1 : T(1);
  const T pt = exp_(lpt);
  loss = -alpha * ug * lpt;
  coef = alpha * ug * (T(1) + gamma * pt * r);
}

}  // namespace

// Sizes of a sigmoid focal loss call: element i sits in class column (i / inner) % classes and, for class-index
// targets (logits N x C), in sample row i / classes. weight_by_label: the weight has C + 1 entries and scales the
// whole row n by weight[targets[n]] (mmcv's semantics, entry C for background rows); otherwise its C entries scale
// column c by weight[c].
struct SigmoidLayout {
  bool index_targets;
  bool weight_by_label;
  int64_t numel;
  int64_t classes;
  int64_t inner;
  int64_t rows;
};

// Host-side argument handling, defined in focal_loss.cpp (see common.h for why it is not inline here).
Reduction parse_reduction(const std::string& name, const char* op);

// Validates a direct call of lss::sigmoid_focal_loss (lss.ops.sigmoid_focal_loss prepares its arguments to pass).
SigmoidLayout check_sigmoid_args(const at::Tensor& logits, const at::Tensor& targets,
                                 const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& mask);

// Validates a direct call of lss::softmax_focal_loss.
void check_softmax_args(const at::Tensor& logits, const at::Tensor& targets, const c10::optional<at::Tensor>& weight);

void check_backward_args(const at::Tensor& grad_output, const at::Tensor& grad, const at::Tensor& grad_scale);

// Class-index targets outside `expected` (e.g. "[0, C] = [0, 3] (C = background)"), found in [lo, hi].
[[noreturn]] void raise_bad_targets(const char* op, const std::string& expected, int64_t lo, int64_t hi);

// grad_output * grad_scale * grad for any grad_output that broadcasts to grad, computed in grad_scale's dtype.
at::Tensor scale_grad_broadcast(const at::Tensor& grad_output, const at::Tensor& grad, const at::Tensor& grad_scale);

// Checks of the in-place backward: grad contiguous, grad_output one element of grad's dtype.
void check_backward_inplace_args(const at::Tensor& grad_output, const at::Tensor& grad, const at::Tensor& grad_scale);

// The reduction's denominator where the host knows it: 1 for "sum", the element count (dense, no mask) or the row
// count (class-index targets) for "mean"; -1 where the kernel counts it (dense "mean" with a mask), 0 for "none".
double host_denominator(Reduction reduction, const SigmoidLayout& s, bool has_mask);

// Whether the forward folds 1 / denominator into the saved gradient, so that the backward has nothing left to do
// when grad_output is 1: where the host knows the denominator and the logits' dtype has float32's exponent range
// (a float16 gradient divided by N before a loss scale multiplies it would underflow).
bool folds_reduction_into_grad(at::ScalarType dtype, double denominator);

// The accumulation dtype of the weights and of grad_scale.
at::ScalarType acc_dtype(const at::Tensor& logits);

}  // namespace focal
}  // namespace lss
