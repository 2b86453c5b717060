// RoIPool (torchvision semantics): max over the integer pixel window of each bin. Returns (output, argmax, bad_rois):
// argmax (int32 pixel index in the H x W plane, -1 for an empty bin) routes the gradient; bad_rois is the record of
// roi::find_bad_rois, which the Python wrapper turns into the error, or an empty int64 tensor when record_bad_rois is
// false (the wrapper will not read it: no fill on the device).
#include "ops/common.h"

TORCH_LIBRARY_FRAGMENT(lss, m) {
  m.def("roi_pool(Tensor input, Tensor rois, float spatial_scale, int pooled_height, int pooled_width, "
        "bool record_bad_rois=True) -> (Tensor, Tensor, Tensor)");
  m.def("_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, int pooled_height, "
        "int pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor");
}
