// CPU NMS: the greedy loop over boxes sorted by decreasing score (stable, so ties keep index order).
#include <vector>

#include "ops/nms_common.h"

namespace lss {
namespace {

template <typename acc_t>
at::Tensor nms_cpu_impl(const at::Tensor& boxes, const at::Tensor& order, const int64_t* classes,
                        double iou_threshold) {
  const int64_t n = boxes.size(0);
  const acc_t* b = boxes.data_ptr<acc_t>();
  const int64_t* ord = order.data_ptr<int64_t>();
  const acc_t thr = static_cast<acc_t>(iou_threshold);
  std::vector<acc_t> area(n);
  for (int64_t i = 0; i < n; ++i) area[i] = (b[4 * i + 2] - b[4 * i]) * (b[4 * i + 3] - b[4 * i + 1]);
  std::vector<uint8_t> suppressed(n, 0);
  std::vector<int64_t> keep;
  for (int64_t oi = 0; oi < n; ++oi) {
    const int64_t i = ord[oi];
    if (suppressed[i]) continue;
    keep.push_back(i);
    const acc_t* bi = b + 4 * i;
    for (int64_t oj = oi + 1; oj < n; ++oj) {
      const int64_t j = ord[oj];
      if (suppressed[j] || (classes != nullptr && classes[i] != classes[j])) continue;
      const acc_t* bj = b + 4 * j;
      const acc_t w = std::max(std::min(bi[2], bj[2]) - std::max(bi[0], bj[0]), acc_t(0));
      const acc_t h = std::max(std::min(bi[3], bj[3]) - std::max(bi[1], bj[1]), acc_t(0));
      const acc_t inter = w * h;
      if (inter / (area[i] + area[j] - inter) > thr) suppressed[j] = 1;
    }
  }
  auto out = at::empty({static_cast<int64_t>(keep.size())}, boxes.options().dtype(at::kLong));
  std::copy(keep.begin(), keep.end(), out.data_ptr<int64_t>());
  return out;
}

at::Tensor nms_cpu_common(const char* op, const at::Tensor& boxes_, const at::Tensor& scores,
                          const at::Tensor* idxs, double iou_threshold) {
  nms_detail::check_nms_args(op, boxes_, scores, idxs);
  check_cpu_tensor(boxes_, "nms: boxes");
  if (boxes_.size(0) == 0) return at::empty({0}, boxes_.options().dtype(at::kLong));
  const auto boxes = boxes_.to(nms_detail::nms_acc_type(boxes_)).contiguous();
  const auto order = std::get<1>(scores.sort(/*stable=*/true, /*dim=*/0, /*descending=*/true)).contiguous();
  at::Tensor classes;
  if (idxs != nullptr) classes = idxs->to(at::kLong).contiguous();
  const int64_t* cls = idxs != nullptr ? classes.data_ptr<int64_t>() : nullptr;
  return boxes.scalar_type() == at::kDouble ? nms_cpu_impl<double>(boxes, order, cls, iou_threshold)
                                            : nms_cpu_impl<float>(boxes, order, cls, iou_threshold);
}

at::Tensor nms_cpu(const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold) {
  return nms_cpu_common("nms", boxes, scores, nullptr, iou_threshold);
}

at::Tensor batched_nms_cpu(const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor& idxs,
                           double iou_threshold) {
  return nms_cpu_common("batched_nms", boxes, scores, &idxs, iou_threshold);
}

}  // namespace
}  // namespace lss

TORCH_LIBRARY_IMPL(lss, CPU, m) {
  m.impl("nms", &lss::nms_cpu);
  m.impl("batched_nms", &lss::batched_nms_cpu);
}
