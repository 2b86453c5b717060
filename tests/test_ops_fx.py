"""torch.fx.symbolic_trace of models that call the lss ops: each op stays one call node (a leaf, as torchvision's
ops are) and the traced module computes what the eager one does."""
import pytest
import torch
from torch import nn

import lss.ops
from lss.geometry import BevGrid, FrustumLUT
from lss.ops import RoIAlign, RoIPool, UpsampleBilinear

needs_ext = pytest.mark.skipif(not lss.ops.has_ext(), reason="lss._C not built")


class Calls(nn.Module):
    """forward(a, b) = op(a, b, *extra, **kwargs) * 1, calling the op through the lss.ops namespace."""

    def __init__(self, name, *extra, **kwargs):
        super().__init__()
        self.name, self.extra, self.kwargs = name, extra, kwargs

    def forward(self, a, b):
        return getattr(lss.ops, self.name)(a, b, *self.extra, **self.kwargs) * 1


class Calls1(Calls):
    def forward(self, a):
        return getattr(lss.ops, self.name)(a, *self.extra, **self.kwargs) * 1


class Calls3(Calls):
    def forward(self, a, b, c):
        return getattr(lss.ops, self.name)(a, b, c, *self.extra, **self.kwargs) * 1


def small_lut():
    g = torch.Generator().manual_seed(0)
    points = torch.rand(1, 2, 3, 4, 5, 3, generator=g) * torch.tensor([20.0, 20.0, 4.0]) - torch.tensor([10, 10, 2])
    return FrustumLUT.build(points, BevGrid((-10.0, 10.0, 2.0), (-10.0, 10.0, 2.0), (-2.0, 2.0, 4.0)))


def cases():
    g = torch.Generator().manual_seed(1)
    boxes = torch.rand(30, 2, generator=g) * 50
    boxes = torch.cat([boxes, boxes + 1 + torch.rand(30, 2, generator=g) * 20], 1)
    scores = torch.rand(30, generator=g)
    feats = torch.randn(2, 4, 16, 16, generator=g)
    rois = torch.tensor([[0, 1.0, 2.0, 9.0, 12.0], [1, 0.5, 0.0, 15.0, 6.0]])
    lut = small_lut()
    depth = torch.rand(1, 2, 3, 4, 5, generator=g)
    cam = torch.randn(1, 2, 6, 4, 5, generator=g)
    logits = torch.randn(8, 3, generator=g)
    return {
        "nms": (Calls("nms", 0.5), (boxes, scores)),
        "batched_nms": (Calls3("batched_nms", 0.5), (boxes, scores, torch.arange(30) % 3)),
        "roi_align": (Calls("roi_align", (3, 3), 0.5, 2, True), (feats, rois)),
        "roi_pool": (Calls("roi_pool", (2, 3), 0.5), (feats, rois)),
        "RoIAlign-roi_align": (RoIAlign((3, 3), 0.5, 2, True), (feats, rois)),
        "RoIPool-roi_pool": (RoIPool((2, 3), 0.5), (feats, rois)),
        "upsample_bilinear": (Calls1("upsample_bilinear", scale_factor=1.5), (feats,)),
        "UpsampleBilinear-upsample_bilinear": (UpsampleBilinear(scale_factor=2, mode="align_corners"), (feats,)),
        "bev_pool": (Calls("bev_pool", lut), (depth, cam)),
        "sigmoid_focal_loss": (Calls("sigmoid_focal_loss", 0.25, 2.0, "mean"), (logits, torch.rand(8, 3, generator=g))),
        "softmax_focal_loss": (Calls("softmax_focal_loss"), (logits, torch.arange(8) % 3)),
    }


@needs_ext
@pytest.mark.parametrize("name", list(cases()))
def test_symbolic_trace_keeps_the_op_as_one_call(name):
    module, args = cases()[name]
    traced = torch.fx.symbolic_trace(module)
    op = name.split("-")[-1]  # a module form ("RoIAlign-roi_align") calls the functional op, which stays a leaf
    calls = [n.target for n in traced.graph.nodes if n.op == "call_function"]
    assert getattr(lss.ops, op) in calls, traced.code
    want, got = module(*args), traced(*args)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
