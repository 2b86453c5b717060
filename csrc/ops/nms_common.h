// Argument checks shared by the CPU and CUDA NMS kernels.
#pragma once

#include "ops/common.h"

namespace lss {
namespace nms_detail {

// Defined in nms.cpp (see common.h for why they are not inline here). idxs: null for plain nms.
void check_nms_args(const char* op, const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor* idxs);

// Boxes in the accumulation type: double stays double, everything else is computed in float.
at::ScalarType nms_acc_type(const at::Tensor& boxes);

}  // namespace nms_detail
}  // namespace lss
