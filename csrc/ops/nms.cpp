// Greedy non-maximum suppression: kept box indices (int64) by decreasing score. batched_nms only lets boxes of
// the same class (idxs) suppress each other. Schemas and the host-side argument checks of both.
#include "ops/nms_common.h"
#include "ops/host_check.h"

TORCH_LIBRARY_FRAGMENT(lss, m) {
  m.def("nms(Tensor boxes, Tensor scores, float iou_threshold) -> Tensor");
  m.def("batched_nms(Tensor boxes, Tensor scores, Tensor idxs, float iou_threshold) -> Tensor");
}

namespace lss {
namespace nms_detail {

void check_nms_args(const char* op, const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor* idxs) {
  LSS_HOST_CHECK(boxes.dim() == 2 && boxes.size(1) == 4, op, ": boxes must be N x 4 (x1, y1, x2, y2), got shape ",
              boxes.sizes());
  LSS_HOST_CHECK(scores.dim() == 1, op, ": scores must be 1-D (N), got shape ", scores.sizes());
  LSS_HOST_CHECK(boxes.size(0) == scores.size(0), op, ": boxes and scores must have the same length, got ",
              boxes.size(0), " boxes and ", scores.size(0), " scores");
  LSS_HOST_CHECK(at::isFloatingType(boxes.scalar_type()), op, ": boxes must be floating point, got ",
              boxes.scalar_type());
  LSS_HOST_CHECK(at::isFloatingType(scores.scalar_type()), op, ": scores must be floating point, got ",
              scores.scalar_type());
  LSS_HOST_CHECK(boxes.device() == scores.device(), op, ": boxes and scores must be on the same device, got ",
              boxes.device(), " and ", scores.device());
  if (idxs != nullptr) {
    LSS_HOST_CHECK(idxs->dim() == 1 && idxs->size(0) == boxes.size(0), op, ": idxs must be 1-D with one class per box "
                "(", boxes.size(0), "), got shape ", idxs->sizes());
    LSS_HOST_CHECK(!at::isFloatingType(idxs->scalar_type()) && idxs->scalar_type() != at::kBool, op,
                ": idxs must be an integer tensor, got ", idxs->scalar_type());
    LSS_HOST_CHECK(idxs->device() == boxes.device(), op, ": idxs must be on the boxes' device ", boxes.device(),
                ", got ", idxs->device());
  }
}

at::ScalarType nms_acc_type(const at::Tensor& boxes) {
  return boxes.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace nms_detail
}  // namespace lss
