// Schema of the bilinear upsample op and its backward (kernels in cpu/upsample.cpp and cuda/upsample.cu).
#include "ops/common.h"

// output_size / input_size are final sizes computed on the Python side; scales_h / scales_w are the user's scale
// factors (output / input), given only when the output size came from them, because the coordinate transform then
// uses 1 / scale as PyTorch and ONNX Resize do; mode is an ONNX coordinate_transformation_mode name.
TORCH_LIBRARY_FRAGMENT(lss, m) {
  m.def("upsample_bilinear(Tensor input, SymInt[2] output_size, float? scales_h, float? scales_w, str mode) -> Tensor");
  m.def("_upsample_bilinear_backward(Tensor grad_output, SymInt[4] input_size, float? scales_h, float? scales_w, "
        "str mode) -> Tensor");
}
