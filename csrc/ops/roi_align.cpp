// RoIAlign: bilinear samples averaged ("avg", torchvision) or maxed ("max", the arg-max sample gets the gradient)
// over each output bin. Returns (output, argmax, bad_rois): argmax (int32 sample index in the bin, -1 for none) is
// empty in avg mode; bad_rois is the record of roi::find_bad_rois, which the Python wrapper turns into the error, or
// an empty int64 tensor when record_bad_rois is false (the wrapper will not read it: no fill on the device).
#include "ops/common.h"

TORCH_LIBRARY_FRAGMENT(lss, m) {
  m.def("roi_align(Tensor input, Tensor rois, float spatial_scale, int pooled_height, int pooled_width, "
        "int sampling_ratio, bool aligned, bool max_mode, bool record_bad_rois=True) -> (Tensor, Tensor, Tensor)");
  m.def("_roi_align_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, int pooled_height, "
        "int pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width, int sampling_ratio, bool aligned, "
        "bool max_mode) -> Tensor");
}
