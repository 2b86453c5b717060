// Host-compiled argument checks of roi_align and roi_pool (declared in roi_common.h).
#include "ops/roi_common.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace lss {
namespace roi {

void check_roi_args(const char* op, const at::Tensor& input, const at::Tensor& rois, int64_t pooled_h,
                    int64_t pooled_w) {
  TORCH_CHECK(input.dim() == 4, op, ": input must be 4-D (N x C x H x W), got shape ", input.sizes());
  TORCH_CHECK(at::isFloatingType(input.scalar_type()), op, ": input must be float32, float16, bfloat16 or float64, "
              "got ", input.scalar_type());
  TORCH_CHECK(rois.dim() == 2 && rois.size(1) == 5, op, ": rois must be K x 5 (batch index, x1, y1, x2, y2), got "
              "shape ", rois.sizes());
  TORCH_CHECK(at::isFloatingType(rois.scalar_type()), op, ": rois must be a floating-point tensor, got ",
              rois.scalar_type());
  TORCH_CHECK(input.device() == rois.device(), op, ": input and rois must be on the same device, got ",
              input.device(), " and ", rois.device());
  TORCH_CHECK(pooled_h > 0 && pooled_w > 0, op, ": output size must be positive, got ", pooled_h, " x ", pooled_w);
  TORCH_CHECK(rois.size(0) == 0 || (input.size(2) > 0 && input.size(3) > 0), op,
              ": input height and width must be positive when there are rois, got shape ", input.sizes());
  TORCH_CHECK(input.size(2) * input.size(3) < (int64_t(1) << 31), op,
              ": a feature map plane must have fewer than 2^31 pixels, got ", input.size(2), " x ", input.size(3));
}

void check_roi_grad(const char* op, const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& argmax,
                    bool uses_argmax, int64_t channels, int64_t pooled_h, int64_t pooled_w) {
  TORCH_CHECK(rois.dim() == 2 && rois.size(1) == 5, op, ": rois must be K x 5, got shape ", rois.sizes());
  const int64_t K = rois.size(0);
  TORCH_CHECK(grad.dim() == 4 && grad.size(0) == K && grad.size(1) == channels && grad.size(2) == pooled_h &&
                  grad.size(3) == pooled_w,
              op, ": grad must be K x C x pooled_height x pooled_width = ", K, " x ", channels, " x ", pooled_h,
              " x ", pooled_w, ", got ", grad.sizes());
  TORCH_CHECK(!uses_argmax || argmax.sizes() == grad.sizes(), op, ": argmax must have grad's shape ", grad.sizes(),
              ", got ", argmax.sizes());
  TORCH_CHECK(grad.device() == rois.device() && (!uses_argmax || argmax.device() == grad.device()), op,
              ": grad, rois and argmax must be on one device");
}

at::Tensor rois_in_acc_type(const at::Tensor& rois, const at::Tensor& input) {
  const auto acc = input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return rois.to(acc).contiguous();
}

namespace {

// A float as repr() prints it: the fewest significant digits that read back to the same double, positional for
// exponents in [-4, 16) ("2.0", not "2"), else scientific ("1e-05"); nan / inf / -inf.
std::string py_float(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  int digits = 1;
  for (; digits < 17; ++digits) {
    std::snprintf(buf, sizeof(buf), "%.*e", digits - 1, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::snprintf(buf, sizeof(buf), "%.*e", digits - 1, v);
  const int exponent = std::atoi(std::strchr(buf, 'e') + 1);
  if (exponent < -4 || exponent >= 16) return buf;
  std::snprintf(buf, sizeof(buf), "%.*f", std::max(digits - 1 - exponent, 0), v);
  std::string s(buf);
  if (s.find('.') == std::string::npos) s += ".0";
  return s;
}

}  // namespace

void raise_bad_rois(const char* op, const at::Tensor& bad_rois, const at::Tensor& rois, int64_t batch_size) {
  const auto found = bad_rois.to(at::kCPU);
  const int64_t non_finite = found.data_ptr<int64_t>()[0];
  const int64_t bad_index = found.data_ptr<int64_t>()[1];
  if (non_finite < 0 && bad_index < 0) return;
  const int64_t row = non_finite >= 0 ? non_finite : bad_index;
  const auto values = rois.select(0, row).to(at::kCPU, at::kDouble).contiguous();
  const double* v = values.data_ptr<double>();
  if (non_finite >= 0) {
    std::string list = "[";
    for (int i = 0; i < 5; ++i) list += (i ? ", " : "") + py_float(v[i]);
    list += "]";
    TORCH_CHECK_VALUE(false, "lss.ops.", op, ": rois must be finite; roi ", row, " is ", list,
                      ". Filter out boxes with NaN/inf coordinates first");
  }
  TORCH_CHECK_VALUE(false, "lss.ops.", op, ": roi ", row, " has batch index ", py_float(v[0]),
                    ", expected an integer in [0, ", batch_size, ") (the input batch size)");
}

}  // namespace roi
}  // namespace lss
