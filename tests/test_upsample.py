import math

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck, gradgradcheck

from conftest import devices
from lss.ops import UpsampleBilinear, _ext, upsample_bilinear, upsample_bilinear_reference
from lss.ops.upsample import MODES

needs_ext = pytest.mark.skipif(not _ext.has_ext(), reason="lss._C is not built")

# (input shape, resize arguments): up, down, mixed, fractional scales, 1 x N and N x 1 maps, output length 1.
CASES = [
    ((2, 3, 5, 7), dict(scale_factor=2)),
    ((2, 3, 5, 7), dict(size=(9, 4))),
    ((1, 2, 9, 11), dict(scale_factor=0.5)),
    ((1, 2, 4, 6), dict(scale_factor=(1.5, 3))),
    ((1, 2, 17, 13), dict(size=(3, 29))),
    ((2, 1, 1, 6), dict(size=(3, 12))),
    ((2, 1, 6, 1), dict(size=(12, 3))),
    ((1, 3, 5, 7), dict(size=(1, 4))),
    ((1, 3, 5, 7), dict(size=(1, 1))),
    ((1, 2, 3, 5), dict(scale_factor=0.5)),  # output 1 x 2 from a scale factor
    ((2, 2, 4, 1), dict(scale_factor=(0.3, 1.7))),  # output 1 x 1; the width keeps its length
    ((3, 2, 6, 6), dict(size=(6, 6))),
]
CASE_IDS = [f"{'x'.join(map(str, s))}-{next(iter(k.values()))}" for s, k in CASES]
# Against the float64 reference: the kernels place samples in float32 for every dtype but float64.
TOL = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


def out_size(shape, kwargs):
    if "size" in kwargs:
        return kwargs["size"]
    s = kwargs["scale_factor"]
    s = s if isinstance(s, tuple) else (s, s)
    return math.floor(shape[2] * s[0]), math.floor(shape[3] * s[1])


def has_unit_output(shape, kwargs):
    return 1 in out_size(shape, kwargs)


@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape,kwargs", CASES, ids=CASE_IDS)
def test_forward_and_backward_match_reference(device, dtype, mode, shape, kwargs):
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    y = upsample_bilinear(x, mode=mode, **kwargs)
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    xr = x.detach().double().requires_grad_()
    yr = upsample_bilinear_reference(xr, mode=mode, **kwargs)
    (gr,) = torch.autograd.grad(yr, xr, g.double())
    assert y.shape == (shape[0], shape[1], *out_size(shape, kwargs)) and y.dtype == dtype
    torch.testing.assert_close(y, yr.to(dtype), **TOL[dtype])
    torch.testing.assert_close(gx, gr.to(dtype), **TOL[dtype])


@pytest.mark.parametrize("mode,align_corners", [("pytorch_half_pixel", False), ("half_pixel", False),
                                                ("align_corners", True)])
@pytest.mark.parametrize("shape,kwargs", CASES, ids=CASE_IDS)
def test_matches_interpolate(mode, align_corners, shape, kwargs):
    x = torch.randn(shape, requires_grad=True)
    y = upsample_bilinear(x, mode=mode, **kwargs)
    want = F.interpolate(x, mode="bilinear", align_corners=align_corners, **kwargs)
    # 1e-6 relative to the data's scale: both place samples in float32, with their own rounding.
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6 * x.abs().max().item())
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, x, g)[0], torch.autograd.grad(want, x, g)[0]
    torch.testing.assert_close(gx, gw, rtol=1e-6, atol=1e-6 * gw.abs().max().item())


@pytest.mark.parametrize("fn", [upsample_bilinear, upsample_bilinear_reference])
def test_pytorch_half_pixel_unit_output_samples_the_centre(fn):
    x = torch.randn(2, 3, 5, 7)
    y = fn(x, size=(1, 7), mode="pytorch_half_pixel")
    # the centre row: source coordinate 0.5 * 5 - 0.5 = 2, exactly row 2
    torch.testing.assert_close(y, x[:, :, 2:3, :], rtol=0, atol=0)
    torch.testing.assert_close(y, F.interpolate(x, size=(1, 7), mode="bilinear", align_corners=False))
    z = fn(x, size=(1, 1), mode="pytorch_half_pixel")  # coordinates 2 and 3: row 2, column 3
    torch.testing.assert_close(z, x[:, :, 2:3, 3:4], rtol=0, atol=0)


def test_onnx_rule_samples_first_index_on_an_axis_of_length_1():
    x = torch.randn(2, 3, 5, 7)
    y = upsample_bilinear_reference(x, size=(1, 7), mode="pytorch_half_pixel", onnx_rule=True)
    torch.testing.assert_close(y, x[:, :, :1, :], rtol=0, atol=0)
    # ONNX resamples an axis that keeps its length under a scale factor != 1; PyTorch copies it
    w = upsample_bilinear_reference(x, scale_factor=1.1, mode="pytorch_half_pixel", onnx_rule=True)
    torch.testing.assert_close(
        w, upsample_bilinear_reference(x, scale_factor=1.1, mode="half_pixel"), rtol=0, atol=0
    )
    assert not torch.allclose(w, x)
    torch.testing.assert_close(upsample_bilinear(x, scale_factor=1.1), x, rtol=0, atol=0)


def random_resizes(count: int, seed: int):
    """(input shape, scale_factor) pairs with every output length >= 2, many leaving an axis's length unchanged
    although the scale factor is not 1 (e.g. 6 * 1.0814 -> 6, 3 * 1.25 -> 3)."""
    gen = torch.Generator().manual_seed(seed)
    cases = []
    while len(cases) < count:
        h, w = (int(v) for v in torch.randint(2, 14, (2,), generator=gen))
        scales = []
        for n in (h, w):
            if torch.rand((), generator=gen) < 0.5:  # a factor in (1, (n + 1) / n): the length stays n
                scales.append(1.0 + float(torch.rand((), generator=gen)) * 0.999 / n)
            else:
                scales.append(0.3 + 2.7 * float(torch.rand((), generator=gen)))
        if all(math.floor(n * s) >= 2 for n, s in zip((h, w), scales)):
            cases.append(((2, 3, h, w), tuple(scales)))
    return cases


@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mode,align_corners", [("pytorch_half_pixel", False), ("align_corners", True)])
@pytest.mark.parametrize("seed", range(4))
def test_scale_factor_matches_interpolate_on_random_shapes(device, mode, align_corners, seed):
    for shape, scales in random_resizes(40, seed):
        x = torch.randn(shape, dtype=torch.float64, device=device, requires_grad=True)
        y = upsample_bilinear(x, scale_factor=scales, mode=mode)
        xw = x.detach().cpu().requires_grad_()
        want = F.interpolate(xw, scale_factor=scales, mode="bilinear", align_corners=align_corners)
        torch.testing.assert_close(y.cpu(), want, rtol=1e-12, atol=1e-12, msg=lambda m: f"{shape} {scales}: {m}")
        torch.testing.assert_close(upsample_bilinear_reference(x.detach().cpu(), scale_factor=scales, mode=mode),
                                   want, rtol=1e-12, atol=1e-12)
        g = torch.randn_like(want)
        gx = torch.autograd.grad(y, x, g.to(device))[0].cpu()
        torch.testing.assert_close(gx, torch.autograd.grad(want, xw, g)[0], rtol=1e-12, atol=1e-12)
        # recompute_scale_factor=True: the step becomes in / out, which is what `size` gives.
        recomputed = F.interpolate(x.detach().cpu(), scale_factor=scales, mode="bilinear",
                                   align_corners=align_corners, recompute_scale_factor=True)
        torch.testing.assert_close(upsample_bilinear(x.detach(), size=recomputed.shape[2:], mode=mode).cpu(),
                                   recomputed, rtol=1e-12, atol=1e-12)


@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape,scales", [((1, 2, 6, 9), (1.0814, 2.0)), ((2, 3, 3, 5), (1.25, 0.6)),
                                          ((1, 1, 7, 7), (1.1, 1.1))])
def test_pytorch_half_pixel_copies_an_axis_of_unchanged_length(device, dtype, shape, scales):
    x = torch.randn(shape, dtype=dtype, device=device)
    y = upsample_bilinear(x, scale_factor=scales, mode="pytorch_half_pixel")
    # H keeps its length: every output row is an input row, and the W axis is resized as by size=.
    assert y.shape[2] == shape[2]
    torch.testing.assert_close(y, upsample_bilinear(x, scale_factor=(1.0, scales[1]), mode="pytorch_half_pixel"),
                               rtol=0, atol=0)
    torch.testing.assert_close(y.cpu(), F.interpolate(x.cpu(), scale_factor=scales, mode="bilinear"),
                               **TOL[dtype])
    # half_pixel keeps ONNX Resize's rule and resamples that axis with the step 1 / scale_factor.
    assert not torch.allclose(upsample_bilinear(x, scale_factor=scales, mode="half_pixel"), y)


def onnx_resize(x: torch.Tensor, mode: str, kwargs: dict) -> torch.Tensor:
    """Runs ONNX Resize (linear, opset 13) in onnxruntime on a float32 N x C x H x W tensor."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    inits = []
    if "size" in kwargs:
        names = ["X", "", "", "sizes"]
        inits.append(helper.make_tensor("sizes", TensorProto.INT64, [4], [*x.shape[:2], *out_size(x.shape, kwargs)]))
    else:
        s = kwargs["scale_factor"]
        s = s if isinstance(s, tuple) else (s, s)
        names = ["X", "", "scales"]
        inits.append(helper.make_tensor("scales", TensorProto.FLOAT, [4], [1.0, 1.0, *map(float, s)]))
    node = helper.make_node("Resize", names, ["Y"], mode="linear", coordinate_transformation_mode=mode)
    graph = helper.make_graph([node], "resize", [helper.make_tensor_value_info("X", TensorProto.FLOAT, list(x.shape))],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return torch.from_numpy(sess.run(None, {"X": x.numpy()})[0])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape,kwargs", CASES, ids=CASE_IDS)
def test_matches_onnxruntime_resize(mode, shape, kwargs):
    x = torch.randn(shape)
    want = onnx_resize(x, mode, kwargs)
    got = upsample_bilinear_reference(x, mode=mode, onnx_rule=True, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    kept = [n == o for n, o in zip(shape[2:], out_size(shape, kwargs))]
    onnx_differs = mode == "pytorch_half_pixel" and (
        has_unit_output(shape, kwargs) or ("scale_factor" in kwargs and any(kept))
    )
    if not onnx_differs:  # elsewhere the op's own rule is ONNX's
        torch.testing.assert_close(upsample_bilinear(x, mode=mode, **kwargs), want, rtol=1e-5, atol=1e-5)


@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape,kwargs", [((1, 2, 3, 4), dict(scale_factor=2)), ((2, 1, 7, 5), dict(size=(3, 8))),
                                          ((1, 1, 1, 3), dict(size=(2, 1)))])
def test_gradcheck(device, mode, shape, kwargs):
    x = torch.randn(shape, device=device, dtype=torch.float64, requires_grad=True)
    fn = lambda t: upsample_bilinear(t, mode=mode, **kwargs)  # noqa: E731
    assert gradcheck(fn, (x,))
    assert gradgradcheck(fn, (x,))


@needs_ext
@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    samples = [
        (torch.randn(2, 3, 4, 5, device=device, requires_grad=True), [8, 10], 2.0, 2.0, "align_corners"),
        (torch.randn(1, 2, 9, 6, device=device, requires_grad=True), [4, 13], None, None, "pytorch_half_pixel"),
        (torch.randn(2, 4, 3, 5, device=device).to(memory_format=torch.channels_last).requires_grad_(),
         [7, 5], None, None, "half_pixel"),
        (torch.randn(1, 3, 5, 5, device=device, dtype=torch.float64, requires_grad=True), [5, 2], 1.0, 0.5,
         "asymmetric"),
    ]
    for args in samples:
        torch.library.opcheck(torch.ops.lss.upsample_bilinear, args)
    grad = torch.randn(2, 3, 8, 10, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.lss._upsample_bilinear_backward, (grad, [2, 3, 4, 5], 2.0, 2.0, "align_corners"))


@needs_ext
@pytest.mark.parametrize("device", devices())
def test_non_contiguous_input(device):
    base = torch.randn(2, 6, 11, 9, device=device)
    x = base.transpose(2, 3)[:, ::2, 1:, :].requires_grad_()
    assert not x.is_contiguous() and not x.is_contiguous(memory_format=torch.channels_last)
    y = upsample_bilinear(x, scale_factor=(2, 1.5), mode="asymmetric")
    assert y.is_contiguous()
    xc = x.detach().contiguous().requires_grad_()
    yc = upsample_bilinear_reference(xc, scale_factor=(2, 1.5), mode="asymmetric")
    torch.testing.assert_close(y, yc, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(y).transpose(2, 3).contiguous().transpose(2, 3)  # strided grad_output too
    torch.testing.assert_close(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(yc, xc, g)[0],
                               rtol=1e-5, atol=1e-6)


@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["align_corners", "pytorch_half_pixel"])
def test_channels_last_keeps_format(device, dtype, mode):
    x = torch.randn(2, 37, 5, 6, device=device, dtype=dtype).to(memory_format=torch.channels_last).requires_grad_()
    y = upsample_bilinear(x, scale_factor=2, mode=mode)
    assert y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    assert gx.is_contiguous(memory_format=torch.channels_last)
    xr = x.detach().double().contiguous().requires_grad_()
    yr = upsample_bilinear_reference(xr, scale_factor=2, mode=mode)
    (gr,) = torch.autograd.grad(yr, xr, g.double())
    torch.testing.assert_close(y, yr.to(dtype), **TOL[dtype])
    torch.testing.assert_close(gx, gr.to(dtype), **TOL[dtype])


@needs_ext
@pytest.mark.parametrize("device", devices())
def test_empty_batch_gives_empty_results(device):
    x = torch.randn(0, 3, 4, 5, device=device, requires_grad=True)
    y = upsample_bilinear(x, scale_factor=2, mode="align_corners")
    assert y.shape == (0, 3, 8, 10)
    y.sum().backward()
    assert x.grad.shape == x.shape


def test_module_forward_and_repr():
    up = UpsampleBilinear(scale_factor=2, mode="align_corners")
    assert repr(up) == "UpsampleBilinear(scale_factor=2, mode='align_corners')"
    assert repr(UpsampleBilinear(size=(8, 22))) == "UpsampleBilinear(size=(8, 22), mode='pytorch_half_pixel')"
    x = torch.randn(2, 4, 4, 11)
    torch.testing.assert_close(up(x), F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=True),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fn", [upsample_bilinear, upsample_bilinear_reference])
@pytest.mark.parametrize("x,kwargs,error,message", [
    (torch.randn(1, 2, 4, 4), dict(size=8, scale_factor=2), ValueError, "exactly one of size and scale_factor"),
    (torch.randn(1, 2, 4, 4), dict(), ValueError, "exactly one of size and scale_factor"),
    (torch.randn(2, 4, 4), dict(scale_factor=2), ValueError, "must be 4-D"),
    (torch.randn(1, 1, 2, 2, 2), dict(scale_factor=2), ValueError, "must be 4-D"),
    (torch.ones(1, 2, 4, 4, dtype=torch.int64), dict(scale_factor=2), TypeError, "float32, float16"),
    (torch.randn(1, 2, 4, 4), dict(size=(0, 3)), ValueError, "size must be positive integers"),
    (torch.randn(1, 2, 4, 4), dict(size=(-2, 3)), ValueError, "size must be positive integers"),
    (torch.randn(1, 2, 4, 4), dict(size=(2.5, 3)), ValueError, "size must be positive integers"),
    (torch.randn(1, 2, 4, 4), dict(size=(2, 3, 4)), ValueError, "pair"),
    (torch.randn(1, 2, 4, 4), dict(scale_factor=0), ValueError, "scale_factor must be positive"),
    (torch.randn(1, 2, 4, 4), dict(scale_factor=-1.0), ValueError, "scale_factor must be positive"),
    (torch.randn(1, 2, 4, 4), dict(scale_factor=0.2), ValueError, "at least 1"),
    (torch.randn(1, 2, 0, 4), dict(scale_factor=2), ValueError, "height and width must be positive"),
    (torch.randn(1, 2, 4, 4), dict(scale_factor=2, mode="bilinear"), ValueError, "unknown mode 'bilinear'"),
])
def test_bad_arguments(fn, x, kwargs, error, message):
    with pytest.raises(error, match=message):
        fn(x, **kwargs)


def test_module_bad_arguments():
    with pytest.raises(ValueError, match="exactly one of size and scale_factor"):
        UpsampleBilinear()
    with pytest.raises(ValueError, match="unknown mode"):
        UpsampleBilinear(scale_factor=2, mode="nearest")


@needs_ext
def test_kernel_rejects_bad_sizes():
    with pytest.raises(RuntimeError, match="output_size must be two positive sizes"):
        torch.ops.lss.upsample_bilinear(torch.randn(1, 1, 2, 2), [0, 2], None, None, "half_pixel")
    with pytest.raises(RuntimeError, match="does not fit grad_output"):
        torch.ops.lss._upsample_bilinear_backward(torch.randn(1, 2, 4, 4), [1, 3, 2, 2], None, None, "half_pixel")
    with pytest.raises(RuntimeError, match="unknown mode"):
        torch.ops.lss.upsample_bilinear(torch.randn(1, 1, 2, 2), [4, 4], None, None, "cubic")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape,kwargs", [((3, 7, 13, 17), dict(scale_factor=2)),
                                          ((2, 45, 19, 8), dict(size=(5, 31))),
                                          ((24, 40, 4, 11), dict(scale_factor=2)),
                                          ((1, 3, 64, 48), dict(scale_factor=(0.25, 3.5))),
                                          ((2, 33, 6, 3), dict(scale_factor=(1.0814, 1.25)))])
def test_cpu_cuda_parity(dtype, channels_last, mode, shape, kwargs):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(shape, dtype=dtype).to(memory_format=fmt).requires_grad_()
    xc = x.detach().cuda().requires_grad_()
    y = upsample_bilinear(x, mode=mode, **kwargs)
    yc = upsample_bilinear(xc, mode=mode, **kwargs)
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    (gxc,) = torch.autograd.grad(yc, xc, g.cuda())
    assert yc.is_contiguous(memory_format=fmt) and gxc.is_contiguous(memory_format=fmt)
    torch.testing.assert_close(yc.cpu(), y, **TOL[dtype])
    torch.testing.assert_close(gxc.cpu(), gx, **TOL[dtype])
