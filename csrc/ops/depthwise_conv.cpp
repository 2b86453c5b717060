// Schemas and host-side argument checks of the depthwise convolution (kernels: cpu/depthwise_conv.cpp,
// cuda/depthwise_conv.cu). padding is (top, bottom, left, right); the backward returns the gradients of the input
// and of the weight (in the weight's dtype).
#include "ops/depthwise_conv.h"
#include "ops/host_check.h"

TORCH_LIBRARY_FRAGMENT(lss, m) {
  m.def("depthwise_conv2d(Tensor input, Tensor weight, int[2] stride, int[4] padding) -> Tensor");
  m.def(
      "_depthwise_conv2d_backward(Tensor grad_output, Tensor input, Tensor weight, int[2] stride, int[4] padding) "
      "-> (Tensor, Tensor)");
}

namespace lss {
namespace depthwise_conv {

Geometry check_forward(const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride,
                       at::IntArrayRef padding) {
  const char* op = "depthwise_conv2d";
  LSS_HOST_CHECK(input.dim() == 4, op, ": input must be N x C x H x W, got shape ", input.sizes());
  const auto t = input.scalar_type();
  LSS_HOST_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble, op,
                 ": input must be float32, float16, bfloat16 or float64, got ", t);
  LSS_HOST_CHECK(input.is_contiguous(), op, ": input must be contiguous (NCHW); call .contiguous() or use "
                 "torch.nn.functional.conv2d for other layouts");
  LSS_HOST_CHECK(weight.dim() == 4 && weight.size(0) == input.size(1) && weight.size(1) == 1, op,
                 ": weight must be C x 1 x KH x KW with C = ", input.size(1), " (one filter per channel), got shape ",
                 weight.sizes());
  LSS_HOST_CHECK(weight.scalar_type() == t || weight.scalar_type() == at::kFloat, op, ": weight must be ", t,
                 " (the input's dtype) or float32, got ", weight.scalar_type());
  LSS_HOST_CHECK(weight.device() == input.device(), op, ": weight is on ", weight.device(), " but the input on ",
                 input.device());
  LSS_HOST_CHECK(weight.is_contiguous(), op, ": weight must be contiguous");
  LSS_HOST_CHECK(weight.size(2) >= 1 && weight.size(3) >= 1 && weight.size(2) <= kMaxKernel &&
                     weight.size(3) <= kMaxKernel,
                 op, ": filters from 1 x 1 to ", kMaxKernel, " x ", kMaxKernel,
                 " are supported, got ", weight.sizes(), "; use torch.nn.functional.conv2d for larger ones");
  LSS_HOST_CHECK(stride.size() == 2 && stride[0] >= 1 && stride[1] >= 1, op,
                 ": stride must be two values >= 1, got ", stride);
  LSS_HOST_CHECK(padding.size() == 4 && padding[0] >= 0 && padding[1] >= 0 && padding[2] >= 0 && padding[3] >= 0,
                 op, ": padding must be (top, bottom, left, right) >= 0, got ", padding);
  Geometry g;
  g.n = input.size(0);
  g.c = input.size(1);
  g.h = input.size(2);
  g.w = input.size(3);
  g.kh = weight.size(2);
  g.kw = weight.size(3);
  g.sh = stride[0];
  g.sw = stride[1];
  g.pt = padding[0];
  g.pb = padding[1];
  g.pl = padding[2];
  g.pr = padding[3];
  const int64_t ph = g.h + g.pt + g.pb - g.kh, pw = g.w + g.pl + g.pr - g.kw;
  LSS_HOST_CHECK(ph >= 0 && pw >= 0, op, ": the padded input (", g.h + g.pt + g.pb, " x ", g.w + g.pl + g.pr,
                 ") is smaller than the filter (", g.kh, " x ", g.kw, ")");
  g.oh = ph / g.sh + 1;
  g.ow = pw / g.sw + 1;
  return g;
}

Geometry check_backward(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
                        at::IntArrayRef stride, at::IntArrayRef padding) {
  const Geometry g = check_forward(input, weight, stride, padding);
  const char* op = "_depthwise_conv2d_backward";
  LSS_HOST_CHECK(grad_output.dim() == 4 && grad_output.size(0) == g.n && grad_output.size(1) == g.c &&
                     grad_output.size(2) == g.oh && grad_output.size(3) == g.ow,
                 op, ": grad_output has shape ", grad_output.sizes(), " but the output ",
                 at::IntArrayRef({g.n, g.c, g.oh, g.ow}));
  LSS_HOST_CHECK(grad_output.scalar_type() == input.scalar_type(), op, ": grad_output is ",
                 grad_output.scalar_type(), " but the input ", input.scalar_type());
  LSS_HOST_CHECK(grad_output.device() == input.device(), op, ": grad_output is on ", grad_output.device(),
                 " but the input on ", input.device());
  LSS_HOST_CHECK(grad_output.is_contiguous(), op, ": grad_output must be contiguous (NCHW)");
  return g;
}

}  // namespace depthwise_conv
}  // namespace lss
