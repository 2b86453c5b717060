"""lss.ops.depthwise_conv2d (the compiled kernels) against torch.nn.functional.conv2d (groups = C)
in float64: outputs and gradients of the input and the weight in every dtype, the filter and stride
shapes the CUDA kernels compile (3x3, 5x5, stride 1 and 2) and the generic path, asymmetric padding,
a float32 weight under a half input, gradcheck, opcheck, bad arguments; SameDepthwiseConv2d and
use_lss_depthwise_conv against efficientnet-pytorch's own module (autocast included); the model
switch; CUDA kernels against the CPU ones."""
import copy

import pytest
import torch
import torch.nn.functional as F
from efficientnet_pytorch.utils import Conv2dDynamicSamePadding

from lss.ops import _ext
from lss.ops.depthwise_conv import depthwise_conv2d, depthwise_conv2d_reference

needs_ext = pytest.mark.skipif(not _ext.has_ext(), reason="lss._C not built")
needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and _ext.has_cuda_ops()), reason="needs CUDA and lss CUDA ops"
)
TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}

# (N, C, H, W, KH, KW, stride, padding top/bottom/left/right)
CASES = [
    (2, 3, 9, 11, 3, 3, 1, (1, 1, 1, 1)),
    (2, 4, 10, 12, 3, 3, 2, (0, 1, 0, 1)),  # EfficientNet's "same" at even sizes
    (1, 5, 13, 9, 5, 5, 1, (2, 2, 2, 2)),
    (3, 2, 12, 14, 5, 5, 2, (1, 2, 1, 2)),
    (2, 3, 7, 6, 2, 4, (1, 3), (0, 1, 2, 1)),  # the generic path: any other shape
    (1, 2, 5, 5, 1, 1, 1, (0, 0, 0, 0)),
    (2, 2, 6, 17, 3, 3, 1, (0, 0, 3, 0)),  # wider padding than the filter's half on one side
]


def _inputs(case, dtype, device="cpu", seed=0, weight_dtype=None):
    n, c, h, w, kh, kw = case[:6]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, h, w, generator=g, dtype=torch.float64)
    wt = torch.randn(c, 1, kh, kw, generator=g, dtype=torch.float64)
    return x.to(dtype).to(device), wt.to(weight_dtype or dtype).to(device)


def _torch(x, w, stride, padding):
    pt, pb, pl, pr = padding
    return F.conv2d(F.pad(x, (pl, pr, pt, pb)), w, None, stride, groups=x.shape[1])


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_forward_and_backward_match_conv2d(dtype, case):
    stride, padding = case[6], case[7]
    x, w = _inputs(case, dtype, weight_dtype=torch.float32 if dtype != torch.float64 else None)
    out = depthwise_conv2d(x, w, None, stride, padding)
    ref = _torch(x.double(), w.double(), stride, padding)
    assert out.dtype == dtype and out.shape == ref.shape
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    xs, ws = (t.detach().clone().requires_grad_() for t in (x, w))
    depthwise_conv2d(xs, ws, None, stride, padding).backward(g.to(dtype))
    xd, wd = (t.detach().double().requires_grad_() for t in (x, w))
    _torch(xd, wd, stride, padding).backward(g)
    assert ws.grad.dtype == w.dtype
    torch.testing.assert_close(xs.grad.double(), xd.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(ws.grad.double(), wd.grad, rtol=tol, atol=tol * 20)


@needs_ext
def test_bias_integer_padding_and_the_reference():
    x, w = _inputs((2, 3, 8, 8, 3, 3), torch.float32)
    b = torch.randn(3)
    out = depthwise_conv2d(x, w, b, 1, 1)
    torch.testing.assert_close(out, F.conv2d(x, w, b, 1, 1, groups=3), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, depthwise_conv2d_reference(x, w, b, 1, 1), rtol=1e-5, atol=1e-5)
    # (vertical, horizontal)
    torch.testing.assert_close(
        depthwise_conv2d(x, w, None, (2, 1), (1, 0)),
        F.conv2d(x, w, None, (2, 1), (1, 0), groups=3),
        rtol=1e-5,
        atol=1e-5,
    )


@needs_ext
@pytest.mark.parametrize("case", [CASES[1], CASES[4]], ids=["static", "generic"])
def test_gradcheck_in_float64(case):
    x, w = _inputs(case, torch.float64)
    x.requires_grad_()
    w.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, b: depthwise_conv2d(a, b, None, case[6], case[7]), (x, w), eps=1e-6, atol=1e-6
    )


@needs_ext
def test_opcheck_and_non_contiguous_input():
    x, w = _inputs(CASES[3], torch.float32)
    torch.library.opcheck(torch.ops.lss.depthwise_conv2d, (x, w, [2, 2], [1, 2, 1, 2]))
    t = x.transpose(2, 3)
    torch.testing.assert_close(
        depthwise_conv2d(t, w, None, 1, 2), depthwise_conv2d(t.contiguous(), w, None, 1, 2)
    )


@needs_ext
def test_bad_arguments_say_what_to_do():
    x, w = _inputs((2, 3, 8, 8, 3, 3), torch.float32)
    with pytest.raises(TypeError, match="floating-point tensor"):
        depthwise_conv2d(x.long(), w)
    with pytest.raises(ValueError, match="N x C x H x W"):
        depthwise_conv2d(x[0], w)
    with pytest.raises(ValueError, match=r"C x 1 x KH x KW with C = 3"):
        depthwise_conv2d(x, w[:2])
    with pytest.raises(ValueError, match="or float32"):
        depthwise_conv2d(x.half(), w.double())
    with pytest.raises(ValueError, match="up to|use torch.nn.functional.conv2d"):
        depthwise_conv2d(x, torch.randn(3, 1, 9, 9))
    with pytest.raises(ValueError, match="smaller than the filter"):
        depthwise_conv2d(x[..., :2, :2], w)
    with pytest.raises(ValueError, match="padding must be"):
        depthwise_conv2d(x, w, None, 1, (1, 2, 3))
    with pytest.raises(ValueError, match="stride must be >= 1"):
        depthwise_conv2d(x, w, None, 0)
    with pytest.raises(ValueError, match=r"bias must be of shape \(3,\)"):
        depthwise_conv2d(x, w, torch.randn(2))
    # the compiled op checks on its own too
    with pytest.raises(RuntimeError, match="must be contiguous"):
        torch.ops.lss.depthwise_conv2d(x.transpose(2, 3), w, [1, 1], [1, 1, 1, 1])
    with pytest.raises(RuntimeError, match="grad_output has shape"):
        torch.ops.lss._depthwise_conv2d_backward(x, x, w, [2, 2], [1, 1, 1, 1])


def _efficientnet_pair(channels=4, kernel=3, stride=2):
    torch.manual_seed(0)
    theirs = Conv2dDynamicSamePadding(
        channels, channels, kernel, stride=stride, groups=channels, bias=False
    )
    ours = copy.deepcopy(theirs)
    from lss.models.camera import use_lss_depthwise_conv

    assert use_lss_depthwise_conv(ours) == 1
    return theirs, ours


@needs_ext
@pytest.mark.parametrize("kernel,stride,size", [(3, 2, (10, 12)), (5, 2, (9, 13)), (5, 1, (8, 8))])
def test_same_depthwise_module_matches_efficientnet(kernel, stride, size):
    theirs, ours = _efficientnet_pair(kernel=kernel, stride=stride)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x = torch.randn(2, 4, *size)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = theirs(xa), ours(xb)
    torch.testing.assert_close(yb, ya, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, rtol=1e-4, atol=1e-4)


@needs_ext
def test_same_depthwise_module_under_autocast_and_channels_last():
    theirs, ours = _efficientnet_pair()
    x = torch.randn(2, 4, 10, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya, yb = theirs(x), ours(x)
    assert yb.dtype == ya.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), ya.float(), rtol=3e-2, atol=3e-2)
    # a channels-last input goes to efficientnet-pytorch's own forward
    cl = x.to(memory_format=torch.channels_last)
    torch.testing.assert_close(ours(cl), theirs(cl), rtol=1e-5, atol=1e-5)


def test_only_depthwise_convolutions_are_turned():
    from lss.models.camera import SameDepthwiseConv2d, use_lss_depthwise_conv

    net = torch.nn.Sequential(
        Conv2dDynamicSamePadding(4, 4, 3, groups=4, bias=False),
        Conv2dDynamicSamePadding(4, 8, 1, bias=False),
        Conv2dDynamicSamePadding(4, 4, 9, groups=4, bias=False),  # larger than the kernels take
        torch.nn.Conv2d(4, 4, 3, groups=4),
    )
    assert use_lss_depthwise_conv(net) == 1
    assert type(net[0]) is SameDepthwiseConv2d
    assert [type(m) for m in net[1:]] == [
        Conv2dDynamicSamePadding,
        Conv2dDynamicSamePadding,
        torch.nn.Conv2d,
    ]


@needs_ext
def test_model_switch_keeps_the_state_dict_and_the_outputs():
    from lss.config import load_config
    from lss.models import build_model
    from lss.models.camera import StaticSameDepthwiseConv2d

    overrides = ["data.final_dim=[64,192]", "model.pretrained=null"]
    torch.manual_seed(0)
    theirs = build_model(load_config("configs/synthetic_segmentation.yaml", overrides))
    torch.manual_seed(0)
    lss_kernels = overrides + ["model.depthwise_conv=lss"]
    ours = build_model(load_config("configs/synthetic_segmentation.yaml", lss_kernels))
    assert sum(type(m) is StaticSameDepthwiseConv2d for m in ours.modules()) == 16
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    ours.load_state_dict(theirs.state_dict())
    trunk_a, trunk_b = theirs.camera.trunk, ours.camera.trunk
    x = torch.randn(2, 3, 64, 192)
    outputs = []
    for trunk in (trunk_a.train(), trunk_b.train()):
        torch.manual_seed(1)  # the same drop-connect draws
        outputs.append(trunk(x))
    for a, b in zip(*outputs):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_cuda_matches_cpu(dtype, case):
    stride, padding = case[6], case[7]
    wdt = torch.float32 if dtype != torch.float64 else None
    x, w = _inputs(case, dtype, weight_dtype=wdt)
    xc, wc = x.cuda().requires_grad_(), w.cuda().requires_grad_()
    xh, wh = x.clone().requires_grad_(), w.clone().requires_grad_()
    out_c = depthwise_conv2d(xc, wc, None, stride, padding)
    out_h = depthwise_conv2d(xh, wh, None, stride, padding)
    tol = TOL[dtype]
    torch.testing.assert_close(out_c.cpu().double(), out_h.double(), rtol=tol, atol=tol)
    g = torch.randn(out_h.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out_c.backward(g.cuda())
    out_h.backward(g)
    torch.testing.assert_close(xc.grad.cpu().double(), xh.grad.double(), rtol=tol, atol=tol)
    torch.testing.assert_close(wc.grad.cpu().double(), wh.grad.double(), rtol=tol, atol=tol * 20)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("kernel,stride", [(3, 1), (3, 2), (5, 1), (5, 2)])
def test_cuda_efficientnet_sizes_against_cudnn(kernel, stride):
    """A trunk-sized map (24 images x 96 channels, 64 x 176) in bfloat16 against PyTorch's own
    kernels on the same values in float32."""
    pad = kernel // 2
    p = (pad - (stride - 1), pad, pad - (stride - 1), pad)  # "same" at even sizes
    x = torch.randn(24, 96, 64, 176, device="cuda")
    w = torch.randn(96, 1, kernel, kernel, device="cuda")
    xb = x.bfloat16().requires_grad_()
    wf = w.clone().requires_grad_()
    out = depthwise_conv2d(xb, wf, None, stride, p)
    # the same values: the bfloat16 input in float32
    xf, wr = x.bfloat16().float().requires_grad_(), w.clone().requires_grad_()
    ref = _torch(xf, wr, stride, p)
    torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=5e-2)
    g = torch.randn_like(ref)
    out.backward(g.bfloat16())
    ref.backward(g)
    torch.testing.assert_close(xb.grad.float(), xf.grad, rtol=3e-2, atol=5e-2)
    rel = (wf.grad - wr.grad).norm() / wr.grad.norm()
    assert rel < 1e-2, rel


@needs_cuda
@pytest.mark.cuda
def test_cuda_inside_a_captured_graph():
    x, w = _inputs(CASES[3], torch.float32, device="cuda")
    x.requires_grad_()
    w.requires_grad_()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            depthwise_conv2d(x, w, None, 2, (1, 2, 1, 2)).sum().backward()
    torch.cuda.current_stream().wait_stream(stream)
    x.grad = w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = depthwise_conv2d(x, w, None, 2, (1, 2, 1, 2))
        out.sum().backward()
    graph.replay()
    torch.cuda.synchronize()
    ref = _torch(x.detach().double(), w.detach().double(), 2, (1, 2, 1, 2))
    torch.testing.assert_close(out.detach().double(), ref, rtol=1e-4, atol=1e-4)
    assert torch.isfinite(w.grad).all() and w.grad.abs().sum() > 0


def test_config_auto_uses_the_kernels_on_cuda_only_and_not_under_compile(monkeypatch):
    """model.*: auto (the default) turns the modules (same state dict) but keeps CPU inputs on
    PyTorch's kernels; train.compile leaves PyTorch's modules to the compiler; unknown values are
    refused."""
    from test_model import tiny_cfg

    import lss.models.camera as camera
    from lss.config import ConfigError, config_from_dict
    from lss.models.build import build_model
    from lss.ops.batch_norm import BatchNorm2d

    cfg = tiny_cfg()
    assert cfg.model.batch_norm == cfg.model.depthwise_conv == "auto"
    model = build_model(cfg).train()
    dw = [m for m in model.modules() if isinstance(m, camera._LssDepthwise)]
    bn = [m for m in model.modules() if type(m) is BatchNorm2d]
    assert dw and bn and not any(m.on_cpu for m in dw + bn)

    def refuse(*args, **kwargs):
        raise AssertionError("lss's depthwise kernel ran on the CPU")

    monkeypatch.setattr(camera, "depthwise_conv2d", refuse)
    model.camera(torch.randn(2, 3, *cfg.data.final_dim))  # PyTorch's kernels on the CPU
    compiled = build_model(tiny_cfg("train.compile=true"))
    assert not any(isinstance(m, (camera._LssDepthwise, BatchNorm2d)) for m in compiled.modules())
    with pytest.raises(ConfigError, match="model.depthwise_conv"):
        config_from_dict({"model": {"depthwise_conv": "cudnn"}})


@needs_cuda
@pytest.mark.cuda
def test_the_captured_training_step_follows_the_eager_trajectory_on_cuda():
    """The default kernels (auto: lss's batch norm and depthwise convolutions on CUDA) through the
    engine's captured step follow the eager steps (bf16)."""
    from test_graph_step import _run_both, assert_follows_eager
    from test_model import tiny_cfg

    import lss.models.camera as camera

    eager, graphed, pa, pb, step = _run_both(tiny_cfg(), "cuda", 4, True, torch.bfloat16)
    assert step.graph is not None
    assert any(isinstance(m, camera._LssDepthwise) for m in step.model.modules())
    assert_follows_eager(eager, graphed, pa, pb)


@needs_ext
def test_a_trace_for_export_keeps_efficientnet_pytorchs_forward():
    """torch.jit.trace (the ONNX exporter's path) sees PyTorch's convolution, not lss's op, and
    gives the same output."""
    theirs, ours = _efficientnet_pair()
    x = torch.randn(1, 4, 10, 12)
    traced = torch.jit.trace(ours, x)
    assert "lss::" not in str(traced.graph) and "aten::_convolution" in str(traced.graph)
    torch.testing.assert_close(traced(x), theirs(x), rtol=1e-5, atol=1e-5)
