import pytest
import torch
import torchvision

from conftest import assert_backward_reads_strided_grad, devices
from lss.ops import RoIAlign, roi_align, roi_align_reference, roi_pool
from lss.ops._ext import has_ext

TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 8e-2}


def make_rois(k, batch, height, width, scale=1.0, seed=0, device="cpu", dtype=torch.float32):
    """K x 5 random rois in image coordinates (feature map size / scale), some partly outside the image."""
    g = torch.Generator().manual_seed(seed)
    img_h, img_w = height / scale, width / scale
    xy = torch.rand(k, 2, generator=g) * torch.tensor([img_w, img_h]) * 1.1 - 0.05 * torch.tensor([img_w, img_h])
    wh = torch.rand(k, 2, generator=g) * torch.tensor([img_w, img_h]) * 0.6 + 0.3
    idx = torch.randint(0, batch, (k, 1), generator=g).float()
    return torch.cat([idx, xy, xy + wh], dim=1).to(device=device, dtype=dtype)


def features(n, c, h, w, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, c, h, w, generator=g).to(device=device, dtype=dtype)


def fwd_bwd(fn, x, *args, **kwargs):
    x = x.detach().clone().requires_grad_(True)
    out = fn(x, *args, **kwargs)
    g = torch.Generator().manual_seed(1)
    out.backward(torch.randn(out.shape, generator=g).to(out.device, out.dtype))
    return out.detach(), x.grad


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("sampling_ratio,scale", [(-1, 1.0), (0, 0.5), (2, 0.25), (3, 1.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_torchvision(device, aligned, sampling_ratio, scale, dtype):
    x = features(2, 5, 13, 17, device=device, dtype=dtype)
    rois = make_rois(12, 2, 13, 17, scale, device=device, dtype=dtype)
    args = dict(output_size=(3, 4), spatial_scale=scale, sampling_ratio=sampling_ratio, aligned=aligned)
    out, grad = fwd_bwd(roi_align, x, rois, **args)
    ref_out, ref_grad = fwd_bwd(torchvision.ops.roi_align, x, rois, **args)
    torch.testing.assert_close(out, ref_out, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(grad, ref_grad, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("aligned", [False, True])
def test_reference_matches_torchvision(aligned):
    x = features(2, 3, 11, 9, dtype=torch.float64)
    rois = make_rois(10, 2, 11, 9, 0.5, dtype=torch.float64)
    args = dict(output_size=5, spatial_scale=0.5, sampling_ratio=-1, aligned=aligned)
    out, grad = fwd_bwd(roi_align_reference, x, rois, **args)
    ref_out, ref_grad = fwd_bwd(torchvision.ops.roi_align, x, rois, **args)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(grad, ref_grad, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("sampling_ratio", [-1, 2])
def test_max_mode_matches_reference(device, aligned, sampling_ratio):
    x = features(2, 4, 12, 10, device=device, dtype=torch.float64)
    rois = make_rois(9, 2, 12, 10, 1.0, seed=3, device=device, dtype=torch.float64)
    args = dict(output_size=3, sampling_ratio=sampling_ratio, aligned=aligned, mode="max")
    out, grad = fwd_bwd(roi_align, x, rois, **args)
    ref_out, ref_grad = fwd_bwd(roi_align_reference, x, rois, **args)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(grad, ref_grad, atol=1e-10, rtol=1e-10)
    # max over samples is at least their mean
    avg = roi_align(x, rois, 3, sampling_ratio=sampling_ratio, aligned=aligned)
    assert (out >= avg - 1e-12).all()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["avg", "max"])
def test_low_precision_matches_float32(device, dtype, mode):
    x = features(2, 6, 10, 12, device=device, dtype=dtype)
    rois = make_rois(8, 2, 10, 12, device=device)
    out, grad = fwd_bwd(roi_align, x, rois, 2, sampling_ratio=2, aligned=True, mode=mode)
    ref_out, ref_grad = fwd_bwd(roi_align, x.float(), rois, 2, sampling_ratio=2, aligned=True, mode=mode)
    assert out.dtype == dtype and grad.dtype == dtype
    torch.testing.assert_close(out.float(), ref_out, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(grad.float(), ref_grad, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("device", devices())
def test_list_rois_and_layouts(device):
    x = features(3, 4, 9, 11, device=device)
    boxes = [make_rois(n, 1, 9, 11, seed=n, device=device)[:, 1:] for n in (4, 0, 3)]
    rois = torch.cat([torch.cat([torch.full((len(b), 1), float(i), device=device), b], 1)
                      for i, b in enumerate(boxes)])
    expected = roi_align(x, rois, 3, aligned=True)
    torch.testing.assert_close(roi_align(x, boxes, 3, aligned=True), expected)
    # non-contiguous (a channel slice of a wider map, transposed twice) and channels_last inputs
    wide = features(3, 8, 11, 9, device=device).transpose(2, 3)[:, ::2]
    torch.testing.assert_close(roi_align(wide, rois, 3), roi_align(wide.contiguous(), rois, 3))
    cl = x.to(memory_format=torch.channels_last)
    torch.testing.assert_close(roi_align(cl, rois, 3, aligned=True), expected)
    torch.testing.assert_close(roi_align(x, rois.t().contiguous().t(), 3, aligned=True), expected)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mode", ["avg", "max"])
def test_empty_rois(device, mode):
    x = features(2, 3, 5, 5, device=device).requires_grad_(True)
    out = roi_align(x, torch.zeros(0, 5, device=device), 2, mode=mode)
    assert out.shape == (0, 3, 2, 2)
    out.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    assert roi_align(x, [torch.zeros(0, 4, device=device)], 2, mode=mode).shape == (0, 3, 2, 2)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mode", ["avg", "max"])
def test_gradcheck(device, mode):
    x = features(1, 2, 6, 7, device=device, dtype=torch.float64).requires_grad_(True)
    rois = make_rois(3, 1, 6, 7, seed=5, device=device, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda t: roi_align(t, rois, 2, 1.0, 2, True, mode), (x,))
    assert torch.autograd.gradcheck(lambda t: roi_align(t, rois, 2, 1.0, -1, False, mode), (x,))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mode", ["avg", "max"])
def test_deterministic_backward(device, mode):
    x = features(2, 8, 16, 16, device=device)
    rois = make_rois(64, 2, 16, 16, seed=2, device=device)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        grads = [fwd_bwd(roi_align, x, rois, 4, sampling_ratio=-1, aligned=True, mode=mode)[1] for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(before)
    assert all(torch.equal(grads[0], g) for g in grads[1:])
    fast = fwd_bwd(roi_align, x, rois, 4, sampling_ratio=-1, aligned=True, mode=mode)[1]
    torch.testing.assert_close(grads[0], fast, atol=1e-5, rtol=1e-5)

@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("kind", ["expanded", "permuted", "sliced", "channels_last"])
def test_backward_reads_non_contiguous_grads(device, mode, deterministic, kind):
    # the backward reads the incoming gradient through its strides (no contiguous copy): same result as its copy
    x = features(2, 6, 12, 13, device=device)
    rois = make_rois(9, 2, 12, 13, seed=4, device=device)
    assert_backward_reads_strided_grad(lambda t: roi_align(t, rois, (3, 4), 0.9, 2, True, mode), x, kind, deterministic)



@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_matches_cpu(mode, dtype):
    x = features(2, 40, 20, 24, dtype=dtype)
    rois = make_rois(50, 2, 20, 24, 0.5, seed=7)
    args = dict(output_size=(5, 3), spatial_scale=0.5, sampling_ratio=-1, aligned=True, mode=mode)
    out, grad = fwd_bwd(roi_align, x, rois, **args)
    out_c, grad_c = fwd_bwd(roi_align, x.cuda(), rois.cuda(), **args)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out_c.cpu(), out, atol=tol, rtol=tol)
    torch.testing.assert_close(grad_c.cpu(), grad, atol=tol, rtol=tol)


@pytest.mark.cuda
def test_cuda_large_batch_index_and_channels():
    # many rois on the last image of a batch, channel count not a multiple of the warp size
    x = features(5, 37, 30, 30, device="cuda")
    rois = make_rois(300, 5, 30, 30, device="cuda")
    rois[:, 0] = 4
    torch.testing.assert_close(roi_align(x, rois, 7, 1.0, 2, True),
                               torchvision.ops.roi_align(x, rois, 7, 1.0, 2, True), atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("channels", [1, 5, 37, 70])
def test_cuda_layouts_match_cpu(channels_last, mode, dtype, channels):
    # channel counts below, between and above multiples of the warp size; 9 x 8 = 72 bins span two bin tiles
    x = features(3, channels, 21, 18, seed=channels, dtype=dtype)
    rois = make_rois(23, 3, 21, 18, 0.5, seed=channels)
    rois[0, 1:] = torch.tensor([-30.0, -30.0, 80.0, 70.0])  # partly outside the map
    args = dict(output_size=(9, 8), spatial_scale=0.5, sampling_ratio=-1, aligned=False, mode=mode)
    xc = x.cuda()
    if channels_last:
        xc = xc.to(memory_format=torch.channels_last)
    out, arg, _ = torch.ops.lss.roi_align(x, rois, 0.5, 9, 8, -1, False, mode == "max")
    out_c, arg_c, _ = torch.ops.lss.roi_align(xc, rois.cuda(), 0.5, 9, 8, -1, False, mode == "max")
    assert out_c.is_contiguous()
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float64: 1e-10}[dtype]
    torch.testing.assert_close(out_c.cpu(), out, atol=tol, rtol=tol)
    if dtype == torch.float64:  # in lower precision near-ties may pick another sample
        assert torch.equal(arg_c.cpu(), arg)
    # backward with the CPU's argmax on both devices, so max mode routes identically
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    grad = torch.ops.lss._roi_align_backward(g, rois, arg, 0.5, 9, 8, 3, channels, 21, 18, -1, False, mode == "max")
    grad_c = torch.ops.lss._roi_align_backward(g.cuda(), rois.cuda(), arg.cuda(), 0.5, 9, 8, 3, channels, 21, 18, -1,
                                               False, mode == "max")
    assert grad_c.is_contiguous() and grad_c.dtype == dtype
    torch.testing.assert_close(grad_c.cpu(), grad, atol=tol, rtol=tol)
    # and through autograd
    _, grad_auto = fwd_bwd(roi_align, xc, rois.cuda(), **args)
    assert grad_auto.shape == x.shape and grad_auto.dtype == dtype


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("mode", ["avg", "max"])
def test_cuda_64bit_indexing(channels_last, mode):
    # more than 2^30 elements selects the 64-bit index kernels; compare with a crop of the far corner (32-bit)
    torch.manual_seed(0)
    x = torch.randn(1, 16, 8192, 8200, device="cuda", dtype=torch.float16)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    assert x.numel() > 2 ** 30
    # sample points on multiples of 1/4 pixel: exact in float32 at both offsets
    rois = torch.tensor([[0.0, 8100, 8110, 8114, 8131], [0.0, 8150, 8170, 8192, 8191],
                         [0.0, 8130, 8120, 8158, 8148]], device="cuda")
    top = 8064
    crop = x[:, :, top:, top:].contiguous(memory_format=torch.channels_last if channels_last
                                          else torch.contiguous_format)
    shifted = rois.clone()
    shifted[:, 1:] -= top
    out, grad = fwd_bwd(roi_align, x, rois, 7, 1.0, 2, False, mode)
    out_crop, grad_crop = fwd_bwd(roi_align, crop, shifted, 7, 1.0, 2, False, mode)
    torch.testing.assert_close(out, out_crop, atol=1e-3, rtol=1e-3)
    # atomics add in any order: the float32 sums may round to neighbouring float16 values
    torch.testing.assert_close(grad[:, :, top:, top:], grad_crop, atol=5e-3, rtol=5e-3)
    assert not grad[:, :, :top].any() and not grad[:, :, :, :top].any()


@pytest.mark.skipif(not has_ext(), reason="lss._C not built")
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("max_mode", [False, True])
@pytest.mark.parametrize("record_bad_rois", [True, False])
def test_opcheck(device, max_mode, record_bad_rois):
    x = features(2, 3, 8, 8, device=device).requires_grad_(True)
    rois = make_rois(5, 2, 8, 8, device=device)
    torch.library.opcheck(torch.ops.lss.roi_align.default, (x, rois, 1.0, 2, 3, 2, True, max_mode, record_bad_rois))


def test_errors():
    x = features(2, 3, 8, 8)
    good = make_rois(4, 2, 8, 8)
    with pytest.raises(ValueError, match="K x 5"):
        roi_align(x, good[:, 1:], 2)
    with pytest.raises(ValueError, match="batch index 2.0, expected an integer in \\[0, 2\\)"):
        roi_align(x, torch.tensor([[2.0, 0, 0, 4, 4]]), 2)
    with pytest.raises(ValueError, match="batch index"):
        roi_align(x, torch.tensor([[0.5, 0, 0, 4, 4]]), 2)
    with pytest.raises(ValueError, match="batch index 2.0"):  # checked even when there is nothing to pool
        roi_align(x[:, :0], torch.tensor([[2.0, 0, 0, 4, 4]]), 2)
    with pytest.raises(ValueError, match="must be finite"):
        roi_align(x, torch.tensor([[0.0, 0, float("nan"), 4, 4]]), 2)
    with pytest.raises(ValueError, match="must be finite"):
        roi_align(x, torch.tensor([[0.0, 0, 0, float("inf"), 4]]), 2)
    with pytest.raises(ValueError, match="mode must be one of"):
        roi_align(x, good, 2, mode="sum")
    with pytest.raises(ValueError, match="output_size"):
        roi_align(x, good, 0)
    with pytest.raises(ValueError, match="N x C x H x W"):
        roi_align(x[0], good, 2)
    with pytest.raises(ValueError, match="boxes for 3 images"):
        roi_align(x, [good[:1, 1:]] * 3, 2)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), float("-inf"), 0.0, -0.5])
@pytest.mark.parametrize("op", [roi_align, roi_align_reference])
def test_rejects_non_finite_or_non_positive_spatial_scale(op, scale):
    x = features(2, 3, 8, 8)
    with pytest.raises(ValueError, match=f"spatial_scale must be a finite number > 0.*got {scale}"):
        op(x, make_rois(4, 2, 8, 8), 2, spatial_scale=scale)
    with pytest.raises(ValueError, match="spatial_scale"):
        RoIAlign(2, spatial_scale=scale)


@pytest.mark.parametrize("op", [roi_align, roi_align_reference])
def test_rejects_sampling_ratio_above_cap(op):
    x = features(2, 3, 8, 8)
    rois = make_rois(4, 2, 8, 8)
    with pytest.raises(ValueError, match="sampling_ratio must be <= 64.*got 100000"):
        op(x, rois, 2, sampling_ratio=100000)
    with pytest.raises(ValueError, match="sampling_ratio must be <= 64.*got 65"):
        RoIAlign(2, sampling_ratio=65)
    with pytest.raises(ValueError, match="sampling_ratio must be an integer"):
        op(x, rois, 2, sampling_ratio=2.5)
    torch.testing.assert_close(op(x, rois, 2, sampling_ratio=64),
                               torchvision.ops.roi_align(x, rois, 2, sampling_ratio=64), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not has_ext(), reason="lss._C not built")
def test_raw_op_rejects_bad_rois_without_reading_out_of_bounds():
    x = features(1, 2, 6, 6)
    with pytest.raises(RuntimeError, match="rois must be K x 5"):
        torch.ops.lss.roi_align(x, torch.zeros(3, 4), 1.0, 2, 2, 2, False, False)
    # bad rois pool to zeros instead of reading out of bounds; the record names the first of each kind
    bad = torch.tensor([[7.0, 0, 0, 3, 3], [0.0, float("nan"), 0, 3, 3], [-1.0, 0, 0, 3, 3]])
    out, _, bad_rois = torch.ops.lss.roi_align(x, bad, 1.0, 2, 2, -1, False, False)
    assert torch.equal(out, torch.zeros_like(out))
    assert bad_rois.dtype == torch.int64 and bad_rois.tolist() == [1, 0]
    _, _, none = torch.ops.lss.roi_align(x, make_rois(3, 1, 6, 6), 1.0, 2, 2, -1, False, False)
    assert none.tolist() == [-1, -1]


@pytest.mark.skipif(not has_ext(), reason="lss._C not built")
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("op,args", [("roi_align", (1.0, 3, 2, -1, True, False)),
                                     ("roi_align", (1.0, 3, 2, -1, True, True)), ("roi_pool", (1.0, 3, 2))],
                         ids=["roi_align avg", "roi_align max", "roi_pool"])
def test_raw_op_without_bad_roi_record(device, channels_last, op, args):
    # record_bad_rois=False: the same output, argmax and gradient, an empty record, bad rois still pool to zeros
    forward = getattr(torch.ops.lss, op)
    x = features(2, 5, 8, 8, device=device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    rois = make_rois(6, 2, 8, 8, device=device)
    rois[1, 0] = 2.0
    rois[3, 2] = float("nan")
    rois[4, 0] = -1.0
    rejected = [1, 3, 4]
    x_rec, x_none = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out, arg, record = forward(x_rec, rois, *args)
    out_none, arg_none, none = forward(x_none, rois, *args, False)
    assert record.tolist() == [3, 1]
    assert none.shape == (0,) and none.dtype == torch.int64 and none.device == x.device
    assert torch.equal(out_none, out) and torch.equal(arg_none, arg)
    assert torch.equal(out_none[rejected], torch.zeros_like(out_none[rejected]))
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device)
    out.backward(g)
    out_none.backward(g)
    torch.testing.assert_close(x_none.grad, x_rec.grad, atol=1e-6, rtol=1e-6)
    # no pooling kernel for C = 0: the record alone is computed, or nothing
    _, _, none = forward(x[:, :0], rois, *args, record_bad_rois=False)
    assert none.shape == (0,) and none.dtype == torch.int64
    assert forward(x[:, :0], rois, *args)[2].tolist() == [3, 1]


@pytest.mark.skipif(not has_ext(), reason="lss._C not built")
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("validate", [None, False, True])
@pytest.mark.parametrize("op", [roi_align, roi_pool], ids=["roi_align", "roi_pool"])
def test_wrapper_asks_for_the_record_only_when_it_reads_it(device, validate, op):
    from torch.utils._python_dispatch import TorchDispatchMode

    forward = getattr(torch.ops.lss, op.__name__).default
    records = []

    class RecordShapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is forward:
                records.append(tuple(out[2].shape))
            return out

    x = features(2, 3, 8, 8, device=device)
    with RecordShapes():
        op(x, make_rois(4, 2, 8, 8, device=device), 2, validate=validate)
    reads = validate if validate is not None else device == "cpu"
    assert records == [(2,) if reads else (0,)]


@pytest.mark.skipif(not has_ext(), reason="lss._C not built")
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("mode", ["avg", "max"])
def test_unvalidated_bad_rois_pool_to_zeros(device, channels_last, mode):
    # validate=False: no error, bad rois pool to zeros and pass no gradient, the other rois are unaffected
    x = features(2, 3, 8, 8, device=device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    rois = make_rois(6, 2, 8, 8, device=device)
    bad = rois.clone()
    bad[1, 0] = 2.0
    bad[3, 2] = float("nan")
    bad[4, 0] = 0.5
    good, rejected = [0, 2, 5], [1, 3, 4]
    x_bad, x_good = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out = roi_align(x_bad, bad, 3, 1.0, 2, True, mode, validate=False)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device)
    out.backward(g)
    want = roi_align(x_good, rois[good], 3, 1.0, 2, True, mode)
    want.backward(g[good])
    torch.testing.assert_close(out[good], want, atol=0, rtol=0)
    assert torch.equal(out[rejected], torch.zeros_like(out[rejected]))
    torch.testing.assert_close(x_bad.grad, x_good.grad, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="rois must be finite; roi 3 is"):
        roi_align(x, bad, 3, 1.0, 2, True, mode, validate=True)
    with pytest.raises(ValueError, match="rois must be finite; roi 3 is"):
        RoIAlign(3, 1.0, 2, True, mode, validate=True)(x, bad)
    torch.testing.assert_close(RoIAlign(3, 1.0, 2, True, mode, validate=False)(x, bad), out.detach(), atol=0, rtol=0)
    # The default validates CPU inputs (no sync needed) and lets CUDA inputs pool bad rois to zeros (no sync).
    if device == "cpu":
        with pytest.raises(ValueError, match="rois must be finite; roi 3 is"):
            RoIAlign(3, 1.0, 2, True, mode)(x, bad)
    else:
        torch.testing.assert_close(roi_align(x, bad, 3, 1.0, 2, True, mode), out.detach(), atol=0, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("op", [roi_align, roi_pool], ids=["roi_align", "roi_pool"])
def test_cuda_unvalidated_call_has_no_host_sync(op):
    x = features(2, 3, 8, 8, device="cuda").requires_grad_(True)
    rois = make_rois(4, 2, 8, 8, device="cuda")
    op(x, rois, 2, validate=False).sum().backward()  # loads the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        op(x, rois, 2, validate=False).sum().backward()
        op(x, rois, 2).sum().backward()  # the default does not read the record on CUDA
        with pytest.raises(RuntimeError, match="synchronizing"):
            op(x, rois, 2, validate=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("mode", ["avg", "max"])
def test_cuda_bad_rois_raise_clear_errors(channels_last, mode):
    # the CUDA forward checks the rois on the device; the messages are those of the CPU check
    x = features(2, 3, 8, 8, device="cuda").requires_grad_(True)
    if channels_last:
        x = x.detach().to(memory_format=torch.channels_last).requires_grad_(True)
    good = make_rois(4, 2, 8, 8)
    bad = good.clone()
    bad[2, 0] = 2.0
    with pytest.raises(ValueError, match="roi 2 has batch index 2.0, expected an integer in \\[0, 2\\)"):
        roi_align(x, bad.cuda(), 2, mode=mode, validate=True)
    with pytest.raises(ValueError, match="roi 2 has batch index 2.0"):  # no pooling kernel for C = 0
        roi_align(x[:, :0], bad.cuda(), 2, mode=mode, validate=True)
    bad = good.clone()
    bad[1, 0] = 0.5
    with pytest.raises(ValueError, match="roi 1 has batch index 0.5, expected an integer"):
        roi_align(x, bad.cuda(), 2, mode=mode, validate=True)
    bad[3, 2] = float("nan")  # non-finite coordinates are reported before bad batch indices, as on the CPU
    with pytest.raises(ValueError, match="rois must be finite; roi 3 is \\[.*nan.*\\]"):
        roi_align(x, bad.cuda(), 2, mode=mode, validate=True)
    with pytest.raises(ValueError, match="must be finite"):
        roi_align(x, [good[:2, 1:].cuda(), torch.tensor([[0.0, 0, float("inf"), 4]], device="cuda")], 2, mode=mode,
                  validate=True)
    # a valid call right after a failed one
    out, grad = fwd_bwd(roi_align, x, good.cuda(), 2, 1.0, 2, True, mode)
    out_cpu, grad_cpu = fwd_bwd(roi_align, x.detach().cpu(), good, 2, 1.0, 2, True, mode)
    torch.testing.assert_close(out.cpu(), out_cpu, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.cpu(), grad_cpu, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("channels_last", [False, True])
def test_cuda_graph_capture_pools_bad_rois_to_zeros(channels_last):
    # no error flag read while capturing: bad rois pool to zeros (and are never read out of bounds)
    x = features(2, 33, 6, 6, device="cuda")
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    nan = float("nan")
    rois = torch.tensor([[1.0, 0, 0, 3, 3], [7.0, 0, 0, 3, 3], [0.0, nan, 0, 3, 3], [0.5, 0, 0, 3, 3],
                         [-1.0, 1, 1, 4, 4]], device="cuda")
    expected = roi_align(x, rois[:1], 2, 1.0, 2, True)  # also loads the kernel before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = roi_align(x, rois, 2, 1.0, 2, True)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out[:1], expected, atol=0, rtol=0)
    assert torch.equal(out[1:], torch.zeros_like(out[1:]))
    with pytest.raises(ValueError, match="must be finite; roi 2 is"):
        roi_align(x, rois, 2, 1.0, 2, True, validate=True)


def test_module_repr_and_forward():
    m = RoIAlign((7, 7), spatial_scale=0.125, sampling_ratio=2, aligned=True)
    assert repr(m) == ("RoIAlign(output_size=(7, 7), spatial_scale=0.125, sampling_ratio=2, aligned=True, mode='avg', "
                       "validate=None)")
    x = features(1, 2, 10, 10)
    rois = make_rois(3, 1, 10, 10, scale=0.125)
    torch.testing.assert_close(m(x, rois), roi_align(x, rois, 7, 0.125, 2, True))
