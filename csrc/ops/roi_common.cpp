// Host-compiled argument checks and CPU bad-roi record of roi_align and roi_pool (declared in roi_common.h).
#include "ops/roi_common.h"

#include "ops/host_check.h"

namespace lss {
namespace roi {

void check_roi_args(const char* op, const at::Tensor& input, const at::Tensor& rois, int64_t pooled_h,
                    int64_t pooled_w) {
  LSS_HOST_CHECK(input.dim() == 4, op, ": input must be 4-D (N x C x H x W), got shape ", input.sizes());
  LSS_HOST_CHECK(at::isFloatingType(input.scalar_type()), op,
                 ": input must be float32, float16, bfloat16 or float64, got ", input.scalar_type());
  LSS_HOST_CHECK(rois.dim() == 2 && rois.size(1) == 5, op, ": rois must be K x 5 (batch index, x1, y1, x2, y2), got "
                 "shape ", rois.sizes());
  LSS_HOST_CHECK(at::isFloatingType(rois.scalar_type()), op, ": rois must be a floating-point tensor, got ",
                 rois.scalar_type());
  LSS_HOST_CHECK(input.device() == rois.device(), op, ": input and rois must be on the same device, got ",
                 input.device(), " and ", rois.device());
  LSS_HOST_CHECK(pooled_h > 0 && pooled_w > 0, op, ": output size must be positive, got ", pooled_h, " x ", pooled_w);
  LSS_HOST_CHECK(rois.size(0) == 0 || (input.size(2) > 0 && input.size(3) > 0), op,
                 ": input height and width must be positive when there are rois, got shape ", input.sizes());
  LSS_HOST_CHECK(input.size(2) * input.size(3) < (int64_t(1) << 31), op,
                 ": a feature map plane must have fewer than 2^31 pixels, got ", input.size(2), " x ", input.size(3));
}

void check_roi_grad(const char* op, const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& argmax,
                    bool uses_argmax, int64_t channels, int64_t pooled_h, int64_t pooled_w) {
  LSS_HOST_CHECK(rois.dim() == 2 && rois.size(1) == 5, op, ": rois must be K x 5, got shape ", rois.sizes());
  const int64_t K = rois.size(0);
  LSS_HOST_CHECK(grad.dim() == 4 && grad.size(0) == K && grad.size(1) == channels && grad.size(2) == pooled_h &&
                     grad.size(3) == pooled_w,
                 op, ": grad must be K x C x pooled_height x pooled_width = ", K, " x ", channels, " x ", pooled_h,
                 " x ", pooled_w, ", got ", grad.sizes());
  LSS_HOST_CHECK(!uses_argmax || argmax.sizes() == grad.sizes(), op, ": argmax must have grad's shape ",
                 grad.sizes(), ", got ", argmax.sizes());
  LSS_HOST_CHECK(grad.device() == rois.device() && (!uses_argmax || argmax.device() == grad.device()), op,
                 ": grad, rois and argmax must be on one device");
}

at::Tensor rois_in_acc_type(const at::Tensor& rois, const at::Tensor& input) {
  const auto acc = input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return rois.to(acc).contiguous();
}

at::Tensor find_bad_rois(const at::Tensor& rois, int64_t batch_size, bool record_bad_rois) {
  if (!record_bad_rois) return no_bad_roi_record(rois);
  auto record = at::full({2}, -1, rois.options().dtype(at::kLong));
  int64_t* found = record.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(rois.scalar_type(), "find_bad_rois", [&] {
    const scalar_t* r = rois.data_ptr<scalar_t>();
    // Stops at the first non-finite roi: it is reported before any bad batch index.
    for (int64_t k = 0; k < rois.size(0) && found[0] < 0; ++k) {
      const int slot = bad_roi_slot(r + k * 5, batch_size);
      if (slot >= 0 && found[slot] < 0) found[slot] = k;
    }
  });
  return record;
}

at::Tensor no_bad_roi_record(const at::Tensor& like) { return at::empty({0}, like.options().dtype(at::kLong)); }

}  // namespace roi
}  // namespace lss
