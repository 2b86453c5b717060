// bev_pool schema: the splat of Lift-Splat-Shoot over a FrustumLUT (see lss/ops/bev_pool.py, docs/splat.md).
#include "ops/common.h"

TORCH_LIBRARY_FRAGMENT(lss, m) {
  m.def(
      "bev_pool(Tensor depth, Tensor feat, Tensor sorted_points, Tensor cell_start, Tensor point_cell, "
      "int nz, int nx, int ny) -> Tensor");
  m.def(
      "_bev_pool_backward(Tensor grad_out, Tensor depth, Tensor feat, Tensor cell_start, Tensor point_cell, "
      "int nz, int nx, int ny) -> (Tensor, Tensor)");
}
