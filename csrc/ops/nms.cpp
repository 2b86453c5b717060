// Greedy non-maximum suppression: kept box indices (int64) by decreasing score. batched_nms only lets boxes of
// the same class (idxs) suppress each other.
#include "ops/common.h"

TORCH_LIBRARY_FRAGMENT(lss, m) {
  m.def("nms(Tensor boxes, Tensor scores, float iou_threshold) -> Tensor");
  m.def("batched_nms(Tensor boxes, Tensor scores, Tensor idxs, float iou_threshold) -> Tensor");
}
