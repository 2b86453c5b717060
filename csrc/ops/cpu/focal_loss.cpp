// CPU kernels of the focal loss ops (schemas in ../focal_loss.cpp, per-element math in ../focal_loss.h).
// Reductions sum fixed-size chunks in double and then the chunk sums in order, so results do not depend on the
// number of threads.
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

#include <algorithm>

#include <tuple>
#include <vector>

#include "ops/focal_loss.h"
#include "ops/host_check.h"

namespace lss {
namespace focal {
namespace {

constexpr int64_t kChunk = 16384;

using Outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// Loss tensor of a reduced loss from its chunk sums; grad_scale gets 1 / denominator unless the forward already
// folded it into the gradient.
at::Tensor reduced_loss(const std::vector<double>& sums, double denominator, bool folded, const at::Tensor& logits,
                        at::Tensor& grad_scale) {
  double total = 0.0;
  for (double s : sums) total += s;
  const double scale = denominator > 0 ? 1.0 / denominator : 0.0;
  grad_scale.fill_(folded ? 1.0 : scale);
  return at::scalar_tensor(total * scale, logits.options());
}

template <typename scalar_t, typename target_t>
Outputs sigmoid_forward(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& weight,
                        const at::Tensor& mask, const SigmoidLayout& s, double alpha, double gamma,
                        Reduction reduction, bool save_grad) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t n = s.numel;
  at::Tensor grad = save_grad ? at::empty_like(logits) : at::empty({0}, logits.options());
  at::Tensor loss_none = reduction == kNone ? at::empty_like(logits) : at::Tensor();
  at::Tensor grad_scale = at::ones({}, logits.options().dtype(acc_dtype(logits)));

  const scalar_t* x = logits.data_ptr<scalar_t>();
  const target_t* tg = targets.data_ptr<target_t>();
  const acc_t* w = weight.defined() ? weight.data_ptr<acc_t>() : nullptr;
  const bool* m = mask.defined() ? mask.data_ptr<bool>() : nullptr;
  scalar_t* g = save_grad ? grad.data_ptr<scalar_t>() : nullptr;
  scalar_t* l = loss_none.defined() ? loss_none.data_ptr<scalar_t>() : nullptr;
  const acc_t a = static_cast<acc_t>(alpha), gm = static_cast<acc_t>(gamma);
  const double host_denom = host_denominator(reduction, s, mask.defined());
  const bool folded = folds_reduction_into_grad(logits.scalar_type(), host_denom);
  const acc_t prescale = folded ? static_cast<acc_t>(1.0 / host_denom) : acc_t(1);

  const int64_t nchunks = ceil_div(n, kChunk);
  std::vector<double> sums(nchunks, 0.0);
  std::vector<int64_t> kept(nchunks, 0);
  at::parallel_for(0, nchunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      double sum = 0.0;
      int64_t count = 0;
      const int64_t stop = std::min(n, (chunk + 1) * kChunk);
      for (int64_t i = chunk * kChunk; i < stop; ++i) {
        if (m != nullptr && !m[i]) {
          if (l) l[i] = scalar_t(0);
          if (g) g[i] = scalar_t(0);
          continue;
        }
        const int64_t cls = (i / s.inner) % s.classes;
        acc_t t;
        if constexpr (std::is_same_v<target_t, int64_t>) {
          t = tg[i / s.classes] == cls ? acc_t(1) : acc_t(0);
        } else {
          t = static_cast<acc_t>(tg[i]);
        }
        acc_t li, di;
        sigmoid_focal<acc_t>(static_cast<acc_t>(x[i]), t, a, gm, li, di);
        if (w) {
          acc_t wi = w[cls];
          if constexpr (std::is_same_v<target_t, int64_t>) {
            if (s.weight_by_label) wi = w[tg[i / s.classes]];
          }
          li *= wi;
          di *= wi;
        }
        if (l) l[i] = static_cast<scalar_t>(li);
        if (g) g[i] = static_cast<scalar_t>(di * prescale);
        sum += li;
        ++count;
      }
      sums[chunk] = sum;
      kept[chunk] = count;
    }
  });
  if (reduction == kNone) return {loss_none, grad, grad_scale};
  double denominator = host_denom;
  if (denominator < 0) {
    int64_t total = 0;
    for (int64_t c : kept) total += c;
    denominator = static_cast<double>(total);
  }
  at::Tensor loss = reduced_loss(sums, denominator, folded, logits, grad_scale);
  return {loss, grad, grad_scale};
}

Outputs sigmoid_focal_loss_cpu(const at::Tensor& logits_in, const at::Tensor& targets_in,
                               const c10::optional<at::Tensor>& weight_in, const c10::optional<at::Tensor>& mask_in,
                               double alpha, double gamma, c10::string_view reduction_name, bool save_grad,
                               bool /*reuse_grad*/) {
  const SigmoidLayout s = check_sigmoid_args(logits_in, targets_in, weight_in, mask_in);
  check_cpu_tensor(logits_in, "sigmoid_focal_loss: logits");
  const Reduction reduction = parse_reduction(std::string(reduction_name), "sigmoid_focal_loss");
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor targets = targets_in.contiguous();
  const at::Tensor weight = weight_in.has_value() ? weight_in->to(acc_dtype(logits)).contiguous() : at::Tensor();
  const at::Tensor mask = mask_in.has_value() ? mask_in->contiguous() : at::Tensor();
  if (s.index_targets && targets.numel() > 0) {
    const int64_t lo = targets.min().item<int64_t>(), hi = targets.max().item<int64_t>();
    LSS_HOST_CHECK(lo >= 0 && hi <= s.classes, "sigmoid_focal_loss: class-index targets must lie in [0, C] = [0, ",
                s.classes, "] (C = background), got values in [", lo, ", ", hi, "]");
  }
  Outputs out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "sigmoid_focal_loss_cpu", [&] {
    if (s.index_targets) {
      out = sigmoid_forward<scalar_t, int64_t>(logits, targets, weight, mask, s, alpha, gamma, reduction, save_grad);
    } else if (targets.scalar_type() == logits.scalar_type()) {
      out = sigmoid_forward<scalar_t, scalar_t>(logits, targets, weight, mask, s, alpha, gamma, reduction, save_grad);
    } else {
      out = sigmoid_forward<scalar_t, float>(logits, targets, weight, mask, s, alpha, gamma, reduction, save_grad);
    }
  });
  return out;
}

template <typename scalar_t>
Outputs softmax_forward(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& weight,
                        double alpha, double gamma, Reduction reduction, bool save_grad) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t rows = logits.size(0), classes = logits.size(1);
  at::Tensor grad = save_grad ? at::empty_like(logits) : at::empty({0}, logits.options());
  at::Tensor loss_none = reduction == kNone ? at::empty({rows}, logits.options()) : at::Tensor();
  at::Tensor grad_scale = at::ones({}, logits.options().dtype(acc_dtype(logits)));

  const scalar_t* x = logits.data_ptr<scalar_t>();
  const int64_t* tg = targets.data_ptr<int64_t>();
  const acc_t* w = weight.defined() ? weight.data_ptr<acc_t>() : nullptr;
  scalar_t* g = save_grad ? grad.data_ptr<scalar_t>() : nullptr;
  scalar_t* l = loss_none.defined() ? loss_none.data_ptr<scalar_t>() : nullptr;
  const acc_t a = static_cast<acc_t>(alpha), gm = static_cast<acc_t>(gamma);
  const double denominator = reduction == kMean ? static_cast<double>(rows) : reduction == kSum ? 1.0 : 0.0;
  const bool folded = folds_reduction_into_grad(logits.scalar_type(), denominator);
  const acc_t prescale = folded ? static_cast<acc_t>(1.0 / denominator) : acc_t(1);

  const int64_t rows_per_chunk = std::max<int64_t>(1, kChunk / std::max<int64_t>(classes, 1));
  const int64_t nchunks = ceil_div(rows, rows_per_chunk);
  std::vector<double> sums(nchunks, 0.0);
  at::parallel_for(0, nchunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      double sum = 0.0;
      const int64_t stop = std::min(rows, (chunk + 1) * rows_per_chunk);
      for (int64_t r = chunk * rows_per_chunk; r < stop; ++r) {
        const scalar_t* xr = x + r * classes;
        const int64_t t = tg[r];
        if (t < 0) {
          if (l) l[r] = scalar_t(0);
          if (g) std::fill(g + r * classes, g + (r + 1) * classes, scalar_t(0));
          continue;
        }
        acc_t mx = static_cast<acc_t>(xr[0]);
        for (int64_t j = 1; j < classes; ++j) mx = std::max(mx, static_cast<acc_t>(xr[j]));
        acc_t se = 0;
        for (int64_t j = 0; j < classes; ++j) se += exp_(static_cast<acc_t>(xr[j]) - mx);
        const acc_t lse = log_(se);
        const acc_t wt = w ? w[t] : acc_t(1);
        acc_t li, coef;
        softmax_focal<acc_t>((static_cast<acc_t>(xr[t]) - mx) - lse, a, gm, li, coef);
        li *= wt;
        coef *= wt * prescale;
        if (l) l[r] = static_cast<scalar_t>(li);
        if (g) {
          scalar_t* gr = g + r * classes;
          for (int64_t j = 0; j < classes; ++j) {
            const acc_t pj = exp_(static_cast<acc_t>(xr[j]) - mx - lse);
            gr[j] = static_cast<scalar_t>(coef * (pj - (j == t ? acc_t(1) : acc_t(0))));
          }
        }
        sum += li;
      }
      sums[chunk] = sum;
    }
  });
  if (reduction == kNone) return {loss_none, grad, grad_scale};
  at::Tensor loss = reduced_loss(sums, denominator, folded, logits, grad_scale);
  return {loss, grad, grad_scale};
}

Outputs softmax_focal_loss_cpu(const at::Tensor& logits_in, const at::Tensor& targets_in,
                               const c10::optional<at::Tensor>& weight_in, double alpha, double gamma,
                               c10::string_view reduction_name, bool save_grad, bool /*reuse_grad*/) {
  check_softmax_args(logits_in, targets_in, weight_in);
  check_cpu_tensor(logits_in, "softmax_focal_loss: logits");
  const Reduction reduction = parse_reduction(std::string(reduction_name), "softmax_focal_loss");
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor targets = targets_in.contiguous();
  const at::Tensor weight = weight_in.has_value() ? weight_in->to(acc_dtype(logits)).contiguous() : at::Tensor();
  if (targets.numel() > 0) {
    const int64_t hi = targets.max().item<int64_t>();
    LSS_HOST_CHECK(hi < logits.size(1), "softmax_focal_loss: targets must be < C = ", logits.size(1),
                " (negative values are ignored), got ", hi);
  }
  Outputs out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "softmax_focal_loss_cpu", [&] {
    out = softmax_forward<scalar_t>(logits, targets, weight, alpha, gamma, reduction, save_grad);
  });
  return out;
}

at::Tensor focal_loss_backward_cpu(const at::Tensor& grad_output, const at::Tensor& grad,
                                   const at::Tensor& grad_scale) {
  check_backward_args(grad_output, grad, grad_scale);
  check_cpu_tensor(grad, "focal loss backward: grad");
  return scale_grad_broadcast(grad_output, grad, grad_scale);
}

void focal_loss_backward_inplace_cpu(at::Tensor& grad, const at::Tensor& grad_output, const at::Tensor& grad_scale) {
  check_backward_inplace_args(grad_output, grad, grad_scale);
  check_cpu_tensor(grad, "focal loss backward (in place): grad");
  if ((grad_output.to(grad_scale.scalar_type()) * grad_scale).item<double>() == 1.0) return;
  grad.copy_(scale_grad_broadcast(grad_output, grad, grad_scale));
}

}  // namespace
}  // namespace focal
}  // namespace lss

TORCH_LIBRARY_IMPL(lss, CPU, m) {
  m.impl("sigmoid_focal_loss", &lss::focal::sigmoid_focal_loss_cpu);
  m.impl("softmax_focal_loss", &lss::focal::softmax_focal_loss_cpu);
  m.impl("_focal_loss_backward", &lss::focal::focal_loss_backward_cpu);
  m.impl("_focal_loss_backward_", &lss::focal::focal_loss_backward_inplace_cpu);
}
