// CPU RoIPool. Forward parallel over (roi, channel); backward parallel over (image, channel) planes, each summed
// by one thread in roi order (deterministic).
#include <ATen/Parallel.h>

#include <limits>

#include "ops/roi_common.h"

namespace lss {
namespace {

template <typename scalar_t>
void roi_pool_forward_cpu_impl(const at::Tensor& input, const at::Tensor& rois, at::Tensor& output,
                               at::Tensor& argmax, double spatial_scale, int pooled_h, int pooled_w) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t K = rois.size(0), N = input.size(0), C = input.size(1), H = input.size(2), W = input.size(3);
  const scalar_t* in = input.data_ptr<scalar_t>();
  const acc_t* roi_data = rois.data_ptr<acc_t>();
  scalar_t* out = output.data_ptr<scalar_t>();
  int32_t* arg = argmax.data_ptr<int32_t>();
  const int64_t bins = static_cast<int64_t>(pooled_h) * pooled_w;
  at::parallel_for(0, K * C, 1, [&](int64_t begin, int64_t end) {
    for (int64_t kc = begin; kc < end; ++kc) {
      const int64_t k = kc / C, c = kc % C;
      for (int ph = 0; ph < pooled_h; ++ph) {
        for (int pw = 0; pw < pooled_w; ++pw) {
          const auto p = roi::pool_bin<acc_t>(roi_data + k * 5, N, static_cast<acc_t>(spatial_scale), pooled_h,
                                              pooled_w, H, W, ph, pw);
          const bool empty = p.batch < 0 || p.h1 <= p.h0 || p.w1 <= p.w0;
          // torchvision's rule: an empty bin is 0; otherwise the first pixel strictly above -FLT_MAX so far.
          acc_t best = empty ? acc_t(0) : -std::numeric_limits<float>::max();
          int32_t best_i = -1;
          if (!empty) {
            const scalar_t* plane = in + (p.batch * C + c) * H * W;
            for (int64_t h = p.h0; h < p.h1; ++h) {
              for (int64_t w = p.w0; w < p.w1; ++w) {
                const acc_t v = static_cast<acc_t>(plane[h * W + w]);
                if (v > best) {
                  best = v;
                  best_i = static_cast<int32_t>(h * W + w);
                }
              }
            }
          }
          const int64_t i = kc * bins + static_cast<int64_t>(ph) * pooled_w + pw;
          out[i] = static_cast<scalar_t>(best);
          arg[i] = best_i;
        }
      }
    }
  });
}

template <typename scalar_t>
void roi_pool_backward_cpu_impl(const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& argmax,
                                at::Tensor& grad_input) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t K = rois.size(0), N = grad_input.size(0), C = grad_input.size(1),
                HW = grad_input.size(2) * grad_input.size(3);
  const int64_t bins = grad.size(2) * grad.size(3);
  const scalar_t* g = grad.data_ptr<scalar_t>();
  const acc_t* roi_data = rois.data_ptr<acc_t>();
  const int32_t* arg = argmax.data_ptr<int32_t>();
  acc_t* gin = grad_input.data_ptr<acc_t>();
  at::parallel_for(0, N * C, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nc = begin; nc < end; ++nc) {
      const int64_t n = nc / C, c = nc % C;
      acc_t* plane = gin + nc * HW;
      for (int64_t k = 0; k < K; ++k) {
        const acc_t b = roi_data[k * 5];
        if (!(b >= acc_t(0) && b < static_cast<acc_t>(N)) || static_cast<int64_t>(b) != n) continue;
        const int64_t off = (k * C + c) * bins;
        for (int64_t i = 0; i < bins; ++i) {
          const int32_t a = arg[off + i];
          if (a >= 0 && a < HW) plane[a] += static_cast<acc_t>(g[off + i]);
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> roi_pool_forward_cpu(const at::Tensor& input_, const at::Tensor& rois_,
                                                                    double spatial_scale, int64_t pooled_h,
                                                                    int64_t pooled_w, bool record_bad_rois) {
  roi::check_roi_args("roi_pool", input_, rois_, pooled_h, pooled_w);
  check_cpu_tensor(input_, "roi_pool: input");
  const auto input = input_.contiguous();
  const auto rois = roi::rois_in_acc_type(rois_, input);
  const int64_t K = rois.size(0), C = input.size(1);
  auto output = at::empty({K, C, pooled_h, pooled_w}, input.options());
  auto argmax = at::empty({K, C, pooled_h, pooled_w}, input.options().dtype(at::kInt));
  auto bad_rois = roi::find_bad_rois(rois, input.size(0), record_bad_rois);
  if (output.numel() == 0) return {output, argmax, bad_rois};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "roi_pool_forward_cpu", [&] {
    roi_pool_forward_cpu_impl<scalar_t>(input, rois, output, argmax, spatial_scale, pooled_h, pooled_w);
  });
  return {output, argmax, bad_rois};
}

at::Tensor roi_pool_backward_cpu(const at::Tensor& grad_, const at::Tensor& rois_, const at::Tensor& argmax_,
                                 double spatial_scale, int64_t pooled_h, int64_t pooled_w, int64_t batch_size,
                                 int64_t channels, int64_t height, int64_t width) {
  check_cpu_tensor(grad_, "_roi_pool_backward: grad");
  roi::check_roi_grad("_roi_pool_backward", grad_, rois_, argmax_, true, channels, pooled_h, pooled_w);
  const auto grad = grad_.contiguous();
  const auto acc = grad.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto rois = rois_.to(acc).contiguous();
  const auto argmax = argmax_.to(at::kInt).contiguous();
  auto grad_acc = at::zeros({batch_size, channels, height, width}, grad.options().dtype(acc));
  if (grad.numel() > 0 && grad_acc.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "roi_pool_backward_cpu", [&] {
      roi_pool_backward_cpu_impl<scalar_t>(grad, rois, argmax, grad_acc);
    });
  }
  return grad_acc.to(grad.scalar_type());
}

}  // namespace
}  // namespace lss

TORCH_LIBRARY_IMPL(lss, CPU, m) {
  m.impl("roi_pool", &lss::roi_pool_forward_cpu);
  m.impl("_roi_pool_backward", &lss::roi_pool_backward_cpu);
}
