// CPU RoIAlign. Forward parallel over (roi, channel); backward parallel over (image, channel) planes, each plane
// summed by one thread in roi order, so gradients are deterministic whatever the thread count.
#include <ATen/Parallel.h>

#include <limits>

#include "ops/roi_common.h"

namespace lss {
namespace {

template <typename scalar_t>
void roi_align_forward_cpu_impl(const at::Tensor& input, const at::Tensor& rois, at::Tensor& output,
                                at::Tensor& argmax, double spatial_scale, int pooled_h, int pooled_w,
                                int sampling_ratio, bool aligned, bool max_mode) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t K = rois.size(0), N = input.size(0), C = input.size(1), H = input.size(2), W = input.size(3);
  const scalar_t* in = input.data_ptr<scalar_t>();
  const acc_t* roi_data = rois.data_ptr<acc_t>();
  scalar_t* out = output.data_ptr<scalar_t>();
  int32_t* arg = max_mode ? argmax.data_ptr<int32_t>() : nullptr;
  const int64_t bins = static_cast<int64_t>(pooled_h) * pooled_w;
  at::parallel_for(0, K * C, 1, [&](int64_t begin, int64_t end) {
    for (int64_t kc = begin; kc < end; ++kc) {
      const int64_t k = kc / C, c = kc % C;
      const auto r = roi::align_roi<acc_t>(roi_data + k * 5, N, static_cast<acc_t>(spatial_scale), pooled_h,
                                           pooled_w, sampling_ratio, aligned);
      scalar_t* o = out + kc * bins;
      int32_t* a = max_mode ? arg + kc * bins : nullptr;
      if (r.batch < 0) {
        for (int64_t i = 0; i < bins; ++i) {
          o[i] = scalar_t(0);
          if (a) a[i] = -1;
        }
        continue;
      }
      const scalar_t* plane = in + (r.batch * C + c) * H * W;
      for (int ph = 0; ph < pooled_h; ++ph) {
        for (int pw = 0; pw < pooled_w; ++pw) {
          acc_t sum = acc_t(0), best = acc_t(0);
          int32_t best_i = -1;
          for (int iy = 0; iy < r.grid_h; ++iy) {
            const acc_t y = r.sample_y(ph, iy);
            for (int ix = 0; ix < r.grid_w; ++ix) {
              const auto b = roi::bilinear<acc_t>(H, W, y, r.sample_x(pw, ix));
              acc_t v = acc_t(0);
              if (b.valid) {
                v = b.w1 * static_cast<acc_t>(plane[b.o1]) + b.w2 * static_cast<acc_t>(plane[b.o2]) +
                    b.w3 * static_cast<acc_t>(plane[b.o3]) + b.w4 * static_cast<acc_t>(plane[b.o4]);
              }
              sum += v;
              // The first maximum wins; a NaN sample becomes (and stays) the maximum, like torch.max.
              if (best_i < 0 || v > best || (v != v && best == best)) {
                best = v;
                best_i = iy * r.grid_w + ix;
              }
            }
          }
          const int64_t i = static_cast<int64_t>(ph) * pooled_w + pw;
          if (max_mode) {
            o[i] = static_cast<scalar_t>(best_i < 0 ? acc_t(0) : best);
            a[i] = best_i;
          } else {
            o[i] = static_cast<scalar_t>(sum / r.count);
          }
        }
      }
    }
  });
}

template <typename scalar_t>
void roi_align_backward_cpu_impl(const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& argmax,
                                 at::Tensor& grad_input, double spatial_scale, int pooled_h, int pooled_w,
                                 int sampling_ratio, bool aligned, bool max_mode) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t K = rois.size(0), N = grad_input.size(0), C = grad_input.size(1), H = grad_input.size(2),
                W = grad_input.size(3);
  const scalar_t* g = grad.data_ptr<scalar_t>();
  const acc_t* roi_data = rois.data_ptr<acc_t>();
  const int32_t* arg = max_mode ? argmax.data_ptr<int32_t>() : nullptr;
  acc_t* gin = grad_input.data_ptr<acc_t>();
  const int64_t bins = static_cast<int64_t>(pooled_h) * pooled_w;
  at::parallel_for(0, N * C, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nc = begin; nc < end; ++nc) {
      const int64_t n = nc / C, c = nc % C;
      acc_t* plane = gin + nc * H * W;
      for (int64_t k = 0; k < K; ++k) {
        const auto r = roi::align_roi<acc_t>(roi_data + k * 5, N, static_cast<acc_t>(spatial_scale), pooled_h,
                                             pooled_w, sampling_ratio, aligned);
        if (r.batch != n) continue;
        const scalar_t* gk = g + (k * C + c) * bins;
        const int32_t* ak = max_mode ? arg + (k * C + c) * bins : nullptr;
        for (int ph = 0; ph < pooled_h; ++ph) {
          for (int pw = 0; pw < pooled_w; ++pw) {
            const int64_t i = static_cast<int64_t>(ph) * pooled_w + pw;
            const acc_t gv = static_cast<acc_t>(gk[i]);
            for (int iy = 0; iy < r.grid_h; ++iy) {
              const acc_t y = r.sample_y(ph, iy);
              for (int ix = 0; ix < r.grid_w; ++ix) {
                if (max_mode && ak[i] != iy * r.grid_w + ix) continue;
                const auto b = roi::bilinear<acc_t>(H, W, y, r.sample_x(pw, ix));
                if (!b.valid) continue;
                const acc_t s = max_mode ? gv : gv / r.count;
                plane[b.o1] += s * b.w1;
                plane[b.o2] += s * b.w2;
                plane[b.o3] += s * b.w3;
                plane[b.o4] += s * b.w4;
              }
            }
          }
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> roi_align_forward_cpu(const at::Tensor& input_, const at::Tensor& rois_,
                                                                     double spatial_scale, int64_t pooled_h,
                                                                     int64_t pooled_w, int64_t sampling_ratio,
                                                                     bool aligned, bool max_mode,
                                                                     bool record_bad_rois) {
  roi::check_roi_args("roi_align", input_, rois_, pooled_h, pooled_w);
  check_cpu_tensor(input_, "roi_align: input");
  const auto input = input_.contiguous();
  const auto rois = roi::rois_in_acc_type(rois_, input);
  const int64_t K = rois.size(0), C = input.size(1);
  auto output = at::empty({K, C, pooled_h, pooled_w}, input.options());
  const auto int_opts = input.options().dtype(at::kInt);
  auto argmax = max_mode ? at::empty({K, C, pooled_h, pooled_w}, int_opts) : at::empty({0}, int_opts);
  auto bad_rois = roi::find_bad_rois(rois, input.size(0), record_bad_rois);
  if (output.numel() == 0) return {output, argmax, bad_rois};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "roi_align_forward_cpu", [&] {
    roi_align_forward_cpu_impl<scalar_t>(input, rois, output, argmax, spatial_scale, pooled_h, pooled_w,
                                         sampling_ratio, aligned, max_mode);
  });
  return {output, argmax, bad_rois};
}

at::Tensor roi_align_backward_cpu(const at::Tensor& grad_, const at::Tensor& rois_, const at::Tensor& argmax_,
                                  double spatial_scale, int64_t pooled_h, int64_t pooled_w, int64_t batch_size,
                                  int64_t channels, int64_t height, int64_t width, int64_t sampling_ratio,
                                  bool aligned, bool max_mode) {
  check_cpu_tensor(grad_, "_roi_align_backward: grad");
  roi::check_roi_grad("_roi_align_backward", grad_, rois_, argmax_, max_mode, channels, pooled_h, pooled_w);
  const auto grad = grad_.contiguous();
  const auto acc = grad.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto rois = rois_.to(acc).contiguous();
  const auto argmax = max_mode ? argmax_.to(at::kInt).contiguous() : argmax_;
  auto grad_acc = at::zeros({batch_size, channels, height, width}, grad.options().dtype(acc));
  if (grad.numel() > 0 && grad_acc.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "roi_align_backward_cpu", [&] {
      roi_align_backward_cpu_impl<scalar_t>(grad, rois, argmax, grad_acc, spatial_scale, pooled_h, pooled_w,
                                            sampling_ratio, aligned, max_mode);
    });
  }
  return grad_acc.to(grad.scalar_type());
}

}  // namespace
}  // namespace lss

TORCH_LIBRARY_IMPL(lss, CPU, m) {
  m.impl("roi_align", &lss::roi_align_forward_cpu);
  m.impl("_roi_align_backward", &lss::roi_align_backward_cpu);
}
