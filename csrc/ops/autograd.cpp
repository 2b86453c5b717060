// Autograd of roi_align, roi_pool and bev_pool, registered in C++ as torchvision registers its ops': an eager call
// runs no Python between the wrapper and the kernels, forward or backward. Each forward calls the op below the
// autograd key and saves what its backward op reads; the backward calls that op. No double backward (the backward
// ops have no autograd formula), as in torchvision.
#include <torch/autograd.h>

#include <tuple>

#include "ops/common.h"

namespace lss {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;
using Triple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

template <typename Signature>
c10::TypedOperatorHandle<Signature> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

void save_input_shape(AutogradContext* ctx, const at::Tensor& input) {
  for (int64_t d = 0; d < 4; ++d) ctx->saved_data["size" + std::to_string(d)] = input.sym_size(d);
}

c10::SymInt input_size(AutogradContext* ctx, int64_t d) {
  return ctx->saved_data["size" + std::to_string(d)].toSymInt();
}

class RoIAlignFunction : public Function<RoIAlignFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& rois,
                               double spatial_scale, int64_t pooled_height, int64_t pooled_width,
                               int64_t sampling_ratio, bool aligned, bool max_mode, bool record_bad_rois) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = op_handle<Triple(const at::Tensor&, const at::Tensor&, double, int64_t, int64_t, int64_t, bool,
                                      bool, bool)>("lss::roi_align");
    auto [output, argmax, bad_rois] = op.call(input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio,
                                              aligned, max_mode, record_bad_rois);
    save_input_shape(ctx, input);
    ctx->saved_data["spatial_scale"] = spatial_scale;
    ctx->saved_data["pooled_height"] = pooled_height;
    ctx->saved_data["pooled_width"] = pooled_width;
    ctx->saved_data["sampling_ratio"] = sampling_ratio;
    ctx->saved_data["aligned"] = aligned;
    ctx->saved_data["max_mode"] = max_mode;
    ctx->mark_non_differentiable({argmax, bad_rois});
    // No zero gradients for argmax and the bad-roi record (a fill of argmax's size per backward otherwise).
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({rois, argmax});
    return {output, argmax, bad_rois};
  }

  static variable_list backward(AutogradContext* ctx, const variable_list& grad_outputs) {
    static auto op = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t,
                                          int64_t, c10::SymInt, c10::SymInt, c10::SymInt, c10::SymInt, int64_t, bool,
                                          bool)>("lss::_roi_align_backward");
    if (!grad_outputs[0].defined()) return variable_list(9);
    const auto saved = ctx->get_saved_variables();
    auto& data = ctx->saved_data;
    at::Tensor grad_input = op.call(grad_outputs[0], saved[0], saved[1], data["spatial_scale"].toDouble(),
                                    data["pooled_height"].toInt(), data["pooled_width"].toInt(), input_size(ctx, 0),
                                    input_size(ctx, 1), input_size(ctx, 2), input_size(ctx, 3),
                                    data["sampling_ratio"].toInt(), data["aligned"].toBool(),
                                    data["max_mode"].toBool());
    return {grad_input, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

class RoIPoolFunction : public Function<RoIPoolFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& rois,
                               double spatial_scale, int64_t pooled_height, int64_t pooled_width,
                               bool record_bad_rois) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op =
        op_handle<Triple(const at::Tensor&, const at::Tensor&, double, int64_t, int64_t, bool)>("lss::roi_pool");
    auto [output, argmax, bad_rois] =
        op.call(input, rois, spatial_scale, pooled_height, pooled_width, record_bad_rois);
    save_input_shape(ctx, input);
    ctx->saved_data["spatial_scale"] = spatial_scale;
    ctx->saved_data["pooled_height"] = pooled_height;
    ctx->saved_data["pooled_width"] = pooled_width;
    ctx->mark_non_differentiable({argmax, bad_rois});
    // No zero gradients for argmax and the bad-roi record (a fill of argmax's size per backward otherwise).
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({rois, argmax});
    return {output, argmax, bad_rois};
  }

  static variable_list backward(AutogradContext* ctx, const variable_list& grad_outputs) {
    static auto op = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t,
                                          int64_t, c10::SymInt, c10::SymInt, c10::SymInt, c10::SymInt)>(
        "lss::_roi_pool_backward");
    if (!grad_outputs[0].defined()) return variable_list(6);
    const auto saved = ctx->get_saved_variables();
    auto& data = ctx->saved_data;
    at::Tensor grad_input = op.call(grad_outputs[0], saved[0], saved[1], data["spatial_scale"].toDouble(),
                                    data["pooled_height"].toInt(), data["pooled_width"].toInt(), input_size(ctx, 0),
                                    input_size(ctx, 1), input_size(ctx, 2), input_size(ctx, 3));
    return {grad_input, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

class BevPoolFunction : public Function<BevPoolFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& depth, const at::Tensor& feat,
                            const at::Tensor& sorted_points, const at::Tensor& cell_start,
                            const at::Tensor& point_cell, int64_t nz, int64_t nx, int64_t ny) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          const at::Tensor&, int64_t, int64_t, int64_t)>("lss::bev_pool");
    ctx->saved_data["nz"] = nz;
    ctx->saved_data["nx"] = nx;
    ctx->saved_data["ny"] = ny;
    ctx->save_for_backward({depth, feat, cell_start, point_cell});
    return op.call(depth, feat, sorted_points, cell_start, point_cell, nz, nx, ny);
  }

  static variable_list backward(AutogradContext* ctx, const variable_list& grad_outputs) {
    static auto op =
        op_handle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                     const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t)>(
            "lss::_bev_pool_backward");
    const auto saved = ctx->get_saved_variables();
    auto& data = ctx->saved_data;
    auto [grad_depth, grad_feat] = op.call(grad_outputs[0], saved[0], saved[1], saved[2], saved[3],
                                           data["nz"].toInt(), data["nx"].toInt(), data["ny"].toInt());
    return {ctx->needs_input_grad(0) ? grad_depth : at::Tensor(), ctx->needs_input_grad(1) ? grad_feat : at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The backend kernels check the arguments: a bad one raises out of forward, before autograd records a node.
Triple roi_align_autograd(const at::Tensor& input, const at::Tensor& rois, double spatial_scale,
                          int64_t pooled_height, int64_t pooled_width, int64_t sampling_ratio, bool aligned,
                          bool max_mode, bool record_bad_rois) {
  auto out = RoIAlignFunction::apply(input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio,
                                     aligned, max_mode, record_bad_rois);
  return {out[0], out[1], out[2]};
}

Triple roi_pool_autograd(const at::Tensor& input, const at::Tensor& rois, double spatial_scale,
                         int64_t pooled_height, int64_t pooled_width, bool record_bad_rois) {
  auto out = RoIPoolFunction::apply(input, rois, spatial_scale, pooled_height, pooled_width, record_bad_rois);
  return {out[0], out[1], out[2]};
}

at::Tensor bev_pool_autograd(const at::Tensor& depth, const at::Tensor& feat, const at::Tensor& sorted_points,
                             const at::Tensor& cell_start, const at::Tensor& point_cell, int64_t nz, int64_t nx,
                             int64_t ny) {
  return BevPoolFunction::apply(depth, feat, sorted_points, cell_start, point_cell, nz, nx, ny);
}

}  // namespace
}  // namespace lss

TORCH_LIBRARY_IMPL(lss, Autograd, m) {
  m.impl("roi_align", TORCH_FN(lss::roi_align_autograd));
  m.impl("roi_pool", TORCH_FN(lss::roi_pool_autograd));
  m.impl("bev_pool", TORCH_FN(lss::bev_pool_autograd));
}
