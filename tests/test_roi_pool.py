import pytest
import torch
import torchvision

from conftest import assert_backward_reads_strided_grad, devices
from lss.ops import RoIPool, roi_pool, roi_pool_reference
from lss.ops._ext import has_ext


def make_rois(k, batch, height, width, scale=1.0, seed=0, device="cpu", dtype=torch.float32):
    """K x 5 random rois in image coordinates, some partly outside the image, some tiny."""
    g = torch.Generator().manual_seed(seed)
    size = torch.tensor([width / scale, height / scale])
    xy = torch.rand(k, 2, generator=g) * size * 1.2 - 0.1 * size
    wh = torch.rand(k, 2, generator=g) * size * 0.7
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
@pytest.mark.parametrize("scale,output_size", [(1.0, 3), (0.5, (2, 5)), (0.25, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_torchvision(device, scale, output_size, dtype):
    x = features(2, 5, 13, 17, device=device, dtype=dtype)
    rois = make_rois(15, 2, 13, 17, scale, device=device, dtype=dtype)
    out, grad = fwd_bwd(roi_pool, x, rois, output_size, scale)
    ref_out, ref_grad = fwd_bwd(torchvision.ops.roi_pool, x, rois, output_size, scale)
    torch.testing.assert_close(out, ref_out, atol=0, rtol=0)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_reference_matches_torchvision(scale):
    x = features(2, 3, 11, 9, dtype=torch.float64)
    rois = make_rois(10, 2, 11, 9, scale, dtype=torch.float64)
    # half-pixel coordinates exercise rounding half away from zero
    rois[:3, 1:] = torch.tensor([[0.5, 1.5, 2.5, 3.5], [-0.5, 2.5, 4.5, 5.5], [1.5, 0.5, 6.5, 8.5]]) / scale
    out, grad = fwd_bwd(roi_pool_reference, x, rois, 3, scale)
    ref_out, ref_grad = fwd_bwd(torchvision.ops.roi_pool, x, rois, 3, scale)
    torch.testing.assert_close(out, ref_out, atol=0, rtol=0)
    torch.testing.assert_close(grad, ref_grad, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_matches_float32(device, dtype):
    x = features(2, 6, 10, 12, device=device, dtype=dtype)
    rois = make_rois(8, 2, 10, 12, device=device)
    out, grad = fwd_bwd(roi_pool, x, rois, 3)
    ref_out, ref_grad = fwd_bwd(roi_pool, x.float(), rois, 3)
    assert out.dtype == dtype and grad.dtype == dtype
    torch.testing.assert_close(out.float(), ref_out, atol=0, rtol=0)
    torch.testing.assert_close(grad.float(), ref_grad, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("device", devices())
def test_list_rois_and_layouts(device):
    x = features(3, 4, 9, 11, device=device)
    boxes = [make_rois(n, 1, 9, 11, seed=n, device=device)[:, 1:] for n in (4, 0, 3)]
    rois = torch.cat([torch.cat([torch.full((len(b), 1), float(i), device=device), b], 1)
                      for i, b in enumerate(boxes)])
    expected = roi_pool(x, rois, 3)
    torch.testing.assert_close(roi_pool(x, boxes, 3), expected)
    wide = features(3, 8, 11, 9, device=device).transpose(2, 3)[:, ::2]
    torch.testing.assert_close(roi_pool(wide, rois, 3), roi_pool(wide.contiguous(), rois, 3))
    torch.testing.assert_close(roi_pool(x.to(memory_format=torch.channels_last), rois, 3), expected)


@pytest.mark.parametrize("device", devices())
def test_empty_rois(device):
    x = features(2, 3, 5, 5, device=device).requires_grad_(True)
    out = roi_pool(x, torch.zeros(0, 5, device=device), 2)
    assert out.shape == (0, 3, 2, 2)
    out.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


@pytest.mark.parametrize("device", devices())
def test_gradcheck(device):
    x = features(1, 2, 6, 7, device=device, dtype=torch.float64).requires_grad_(True)
    rois = make_rois(3, 1, 6, 7, seed=5, device=device, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda t: roi_pool(t, rois, 2), (x,))


@pytest.mark.parametrize("device", devices())
def test_deterministic_backward(device):
    x = features(2, 8, 16, 16, device=device)
    rois = make_rois(64, 2, 16, 16, seed=2, device=device)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        grads = [fwd_bwd(roi_pool, x, rois, 4)[1] for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(before)
    assert all(torch.equal(grads[0], g) for g in grads[1:])
    torch.testing.assert_close(grads[0], fwd_bwd(roi_pool, x, rois, 4)[1], atol=1e-5, rtol=1e-5)

@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("kind", ["expanded", "permuted", "sliced", "channels_last"])
def test_backward_reads_non_contiguous_grads(device, deterministic, kind):
    # the backward reads the incoming gradient through its strides (no contiguous copy): same result as its copy
    x = features(2, 6, 12, 13, device=device)
    rois = make_rois(9, 2, 12, 13, seed=4, device=device)
    assert_backward_reads_strided_grad(lambda t: roi_pool(t, rois, (3, 4), 0.9), x, kind, deterministic)



@pytest.mark.cuda
def test_cuda_matches_cpu():
    x = features(2, 40, 20, 24)
    rois = make_rois(50, 2, 20, 24, 0.5, seed=7)
    out, grad = fwd_bwd(roi_pool, x, rois, (5, 3), 0.5)
    out_c, grad_c = fwd_bwd(roi_pool, x.cuda(), rois.cuda(), (5, 3), 0.5)
    torch.testing.assert_close(out_c.cpu(), out, atol=0, rtol=0)
    torch.testing.assert_close(grad_c.cpu(), grad, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("channels", [1, 5, 37, 70])
def test_cuda_layouts_match_cpu(channels_last, dtype, channels):
    # channel counts below, between and above multiples of the warp size; 9 x 8 = 72 bins span two bin tiles
    x = features(3, channels, 21, 18, seed=channels, dtype=dtype)
    rois = make_rois(23, 3, 21, 18, 0.5, seed=channels)
    rois[0, 1:] = torch.tensor([-30.0, -30.0, 80.0, 70.0])  # partly outside the map
    out, grad = fwd_bwd(roi_pool, x, rois, (9, 8), 0.5)
    xc = x.cuda()
    if channels_last:
        xc = xc.to(memory_format=torch.channels_last)
    out_c, grad_c = fwd_bwd(roi_pool, xc, rois.cuda(), (9, 8), 0.5)
    assert out_c.is_contiguous() and grad_c.dtype == dtype
    torch.testing.assert_close(out_c.cpu(), out, atol=0, rtol=0)
    tol = 1e-2 if dtype == torch.float16 else 1e-6
    torch.testing.assert_close(grad_c.cpu(), grad, atol=tol, rtol=tol)
    _, arg, _ = torch.ops.lss.roi_pool(x, rois, 0.5, 9, 8)
    _, arg_c, _ = torch.ops.lss.roi_pool(xc, rois.cuda(), 0.5, 9, 8)
    assert torch.equal(arg_c.cpu(), arg)


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("channels_last", [False, True])
def test_cuda_64bit_indexing(channels_last):
    # more than 2^30 elements selects the 64-bit index kernels; compare with a crop of the far corner (32-bit)
    torch.manual_seed(0)
    x = torch.randn(1, 16, 8192, 8200, device="cuda", dtype=torch.float16)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    assert x.numel() > 2 ** 30
    rois = torch.tensor([[0.0, 8100, 8110, 8114, 8131], [0.0, 8150, 8170, 8199, 8191],
                         [0.0, 8130, 8120, 8158, 8148]], device="cuda")
    top = 8064
    crop = x[:, :, top:, top:].contiguous(memory_format=torch.channels_last if channels_last
                                          else torch.contiguous_format)
    shifted = rois.clone()
    shifted[:, 1:] -= top
    out, grad = fwd_bwd(roi_pool, x, rois, 7)
    out_crop, grad_crop = fwd_bwd(roi_pool, crop, shifted, 7)
    torch.testing.assert_close(out, out_crop, atol=0, rtol=0)
    torch.testing.assert_close(grad[:, :, top:, top:], grad_crop, atol=5e-3, rtol=5e-3)
    assert not grad[:, :, :top].any() and not grad[:, :, :, :top].any()


@pytest.mark.skipif(not has_ext(), reason="lss._C not built")
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("record_bad_rois", [True, False])
def test_opcheck(device, record_bad_rois):
    x = features(2, 3, 8, 8, device=device).requires_grad_(True)
    rois = make_rois(5, 2, 8, 8, device=device)
    torch.library.opcheck(torch.ops.lss.roi_pool.default, (x, rois, 1.0, 2, 3, record_bad_rois))


def test_errors():
    x = features(2, 3, 8, 8)
    with pytest.raises(ValueError, match="K x 5"):
        roi_pool(x, torch.zeros(3, 4), 2)
    with pytest.raises(ValueError, match="batch index -1.0, expected an integer in \\[0, 2\\)"):
        roi_pool(x, torch.tensor([[-1.0, 0, 0, 4, 4]]), 2)
    with pytest.raises(ValueError, match="must be finite"):
        roi_pool(x, torch.tensor([[0.0, float("-inf"), 0, 4, 4]]), 2)
    with pytest.raises(TypeError, match="float32, float16, bfloat16 or float64"):
        roi_pool(x.long(), torch.tensor([[0.0, 0, 0, 4, 4]]), 2)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -1.0])
@pytest.mark.parametrize("op", [roi_pool, roi_pool_reference])
def test_rejects_non_finite_or_non_positive_spatial_scale(op, scale):
    x = features(2, 3, 8, 8)
    with pytest.raises(ValueError, match=f"spatial_scale must be a finite number > 0.*got {scale}"):
        op(x, torch.tensor([[0.0, 1, 1, 5, 5]]), 2, spatial_scale=scale)
    with pytest.raises(ValueError, match="spatial_scale"):
        RoIPool(2, spatial_scale=scale)


@pytest.mark.skipif(not has_ext(), reason="lss._C not built")
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("channels_last", [False, True])
def test_unvalidated_bad_rois_pool_to_zeros(device, channels_last):
    # validate=False: no error, bad rois pool to zeros and pass no gradient, the other rois are unaffected
    x = features(2, 3, 8, 8, device=device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    rois = make_rois(6, 2, 8, 8, device=device)
    bad = rois.clone()
    bad[0, 0] = -1.0
    bad[2, 4] = float("inf")
    bad[5, 0] = 1.5
    good, rejected = [1, 3, 4], [0, 2, 5]
    x_bad, x_good = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out = roi_pool(x_bad, bad, 3, validate=False)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device)
    out.backward(g)
    want = roi_pool(x_good, rois[good], 3)
    want.backward(g[good])
    torch.testing.assert_close(out[good], want, atol=0, rtol=0)
    assert torch.equal(out[rejected], torch.zeros_like(out[rejected]))
    torch.testing.assert_close(x_bad.grad, x_good.grad, atol=1e-6, rtol=1e-6)
    _, _, record = torch.ops.lss.roi_pool(x, bad, 1.0, 3, 3)
    assert record.tolist() == [2, 0]
    with pytest.raises(ValueError, match="rois must be finite; roi 2 is"):
        roi_pool(x, bad, 3, validate=True)
    torch.testing.assert_close(RoIPool(3, validate=False)(x, bad), out.detach(), atol=0, rtol=0)
    # The default validates CPU inputs only: a CUDA call never waits for the record.
    if device == "cpu":
        with pytest.raises(ValueError, match="rois must be finite; roi 2 is"):
            RoIPool(3)(x, bad)
    else:
        torch.testing.assert_close(roi_pool(x, bad, 3), out.detach(), atol=0, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("channels_last", [False, True])
def test_cuda_bad_rois_raise_clear_errors(channels_last):
    # the CUDA forward checks the rois on the device; the messages are those of the CPU check
    x = features(2, 3, 8, 8, device="cuda").requires_grad_(True)
    if channels_last:
        x = x.detach().to(memory_format=torch.channels_last).requires_grad_(True)
    good = make_rois(4, 2, 8, 8)
    bad = good.clone()
    bad[3, 0] = -1.0
    with pytest.raises(ValueError, match="roi 3 has batch index -1.0, expected an integer in \\[0, 2\\)"):
        roi_pool(x, bad.cuda(), 2, validate=True)
    bad[0, 1] = float("-inf")
    with pytest.raises(ValueError, match="rois must be finite; roi 0 is \\[.*-inf.*\\]"):
        roi_pool(x, bad.cuda(), 2, validate=True)
    # a valid call right after a failed one
    out, grad = fwd_bwd(roi_pool, x, good.cuda(), 2)
    out_cpu, grad_cpu = fwd_bwd(roi_pool, x.detach().cpu(), good, 2)
    torch.testing.assert_close(out.cpu(), out_cpu, atol=0, rtol=0)
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
    expected = roi_pool(x, rois[:1], 2)  # also loads the kernel before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = roi_pool(x, rois, 2)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out[:1], expected, atol=0, rtol=0)
    assert torch.equal(out[1:], torch.zeros_like(out[1:]))
    assert torch.equal(roi_pool(x, rois, 2), out)  # an eager CUDA call does not read the error flag by default
    with pytest.raises(ValueError, match="must be finite; roi 2 is"):
        roi_pool(x, rois, 2, validate=True)


def test_module_repr():
    m = RoIPool(7, spatial_scale=0.0625)
    assert repr(m) == "RoIPool(output_size=(7, 7), spatial_scale=0.0625, validate=None)"
    x = features(1, 2, 10, 10)
    rois = make_rois(3, 1, 10, 10, scale=0.0625)
    torch.testing.assert_close(m(x, rois), roi_pool(x, rois, 7, 0.0625))
