"""lss custom ops: each has CPU and CUDA kernels (torch.ops.lss.*), autograd, fake kernels and a reference."""
from lss.ops._ext import cuda_archs, has_cuda_ops, has_ext
from lss.ops.upsample import UpsampleBilinear, upsample_bilinear, upsample_bilinear_reference
from lss.ops.bev_pool import bev_pool, bev_pool_reference
