// Schema of the bilinear upsample op and its backward, and their host-side argument checks (kernels in
// cpu/upsample.cpp and cuda/upsample.cu).
#include "ops/upsample.h"

// output_size / input_size are final sizes computed on the Python side; scales_h / scales_w are the user's scale
// factors (output / input), given only when the output size came from them, because the coordinate transform then
// uses 1 / scale as PyTorch and ONNX Resize do; mode is an ONNX coordinate_transformation_mode name.
TORCH_LIBRARY_FRAGMENT(lss, m) {
  m.def("upsample_bilinear(Tensor input, SymInt[2] output_size, float? scales_h, float? scales_w, str mode) -> Tensor");
  m.def("_upsample_bilinear_backward(Tensor grad_output, SymInt[4] input_size, float? scales_h, float? scales_w, "
        "str mode) -> Tensor");
}

namespace lss {
namespace upsample {

CoordMode parse_mode(const std::string& mode) {
  if (mode == "pytorch_half_pixel") return CoordMode::kPytorchHalfPixel;
  if (mode == "half_pixel") return CoordMode::kHalfPixel;
  if (mode == "align_corners") return CoordMode::kAlignCorners;
  if (mode == "asymmetric") return CoordMode::kAsymmetric;
  TORCH_CHECK(false, "upsample_bilinear: unknown mode '", mode,
              "'; expected one of pytorch_half_pixel, half_pixel, align_corners, asymmetric");
}

bool is_channels_last(const at::Tensor& t) {
  return !t.is_contiguous() && t.is_contiguous(at::MemoryFormat::ChannelsLast);
}

void check_forward(const at::Tensor& input, at::IntArrayRef output_size) {
  TORCH_CHECK(input.dim() == 4, "upsample_bilinear: input must be 4-D (N x C x H x W), got shape ", input.sizes());
  TORCH_CHECK(at::isFloatingType(input.scalar_type()), "upsample_bilinear: input must be float32, float16, "
              "bfloat16 or float64, got ", input.scalar_type());
  TORCH_CHECK(output_size.size() == 2 && output_size[0] > 0 && output_size[1] > 0,
              "upsample_bilinear: output_size must be two positive sizes (H, W), got ", output_size);
  TORCH_CHECK(input.size(2) > 0 && input.size(3) > 0, "upsample_bilinear: input height and width must be positive, "
              "got shape ", input.sizes());
}

void check_backward(const at::Tensor& grad_output, at::IntArrayRef input_size) {
  TORCH_CHECK(grad_output.dim() == 4, "_upsample_bilinear_backward: grad_output must be 4-D (N x C x H x W), got "
              "shape ", grad_output.sizes());
  TORCH_CHECK(at::isFloatingType(grad_output.scalar_type()), "_upsample_bilinear_backward: grad_output must be "
              "floating point, got ", grad_output.scalar_type());
  TORCH_CHECK(input_size.size() == 4 && input_size[0] == grad_output.size(0) && input_size[1] == grad_output.size(1)
              && input_size[2] > 0 && input_size[3] > 0 && grad_output.size(2) > 0 && grad_output.size(3) > 0,
              "_upsample_bilinear_backward: input_size ", input_size, " does not fit grad_output of shape ",
              grad_output.sizes(), "; expected (N, C, H, W) with the batch and channels of grad_output");
}

}  // namespace upsample
}  // namespace lss
