"""lss custom ops: each has CPU and CUDA kernels (torch.ops.lss.*), autograd, fake kernels and a
reference."""

import torch

from lss.ops._ext import cuda_archs, has_cuda_ops, has_ext, kernels_take
from lss.ops.upsample import UpsampleBilinear, upsample_bilinear, upsample_bilinear_reference
from lss.ops.bev_pool import bev_pool, bev_pool_reference
from lss.ops.focal_loss import (
    SigmoidFocalLoss,
    SoftmaxFocalLoss,
    sigmoid_focal_loss,
    sigmoid_focal_loss_reference,
    softmax_focal_loss,
    softmax_focal_loss_reference,
)
from lss.ops.nms import batched_nms, nms, nms_reference
from lss.ops.roi_align import RoIAlign, roi_align, roi_align_reference
from lss.ops.roi_pool import RoIPool, roi_pool, roi_pool_reference
from lss.ops.batch_norm import (
    BatchNorm2d,
    batch_norm_train,
    batch_norm_train_reference,
    use_lss_batch_norm,
)
from lss.ops.depthwise_conv import depthwise_conv2d, depthwise_conv2d_reference

# torch.fx leaf functions where a model calls them as lss.ops.<op> (each op's module wraps its own
# name too).
for _name in (
    "upsample_bilinear",
    "bev_pool",
    "sigmoid_focal_loss",
    "softmax_focal_loss",
    "nms",
    "batched_nms",
    "roi_align",
    "roi_pool",
    "batch_norm_train",
    "depthwise_conv2d",
):
    torch.fx.wrap(_name)
