import dataclasses

import pytest
import torch

from conftest import devices
from lss.geometry import (BevGrid, FrustumLUT, ImageAugmentation, frustum, frustum_to_ego, image_augmentation,
                          load_nuscenes_rig, val_augmentation)
from lss.ops import bev_pool, bev_pool_reference, has_ext

needs_ext = pytest.mark.skipif(not has_ext(), reason="lss._C not built")
LSS_GRID = ((-50.0, 50.0, 0.5), (-50.0, 50.0, 0.5), (-10.0, 10.0, 20.0))
TWO_LEVEL_GRID = ((-50.0, 50.0, 0.5), (-50.0, 50.0, 0.5), (-10.0, 10.0, 10.0))  # nz = 2: z-major output channels


def random_lut(B=2, N=6, final_dim=(64, 176), downsample=16, dbound=(4.0, 45.0, 4.0), grid=LSS_GRID, device="cpu",
               seed=0):
    """A LUT from the real nuScenes rig (first N cameras) under a random LSS-style augmentation per camera."""
    g = torch.Generator().manual_seed(seed)
    K, rot, trans = load_nuscenes_rig()
    K, rot, trans = (t[:N].expand(B, *t[:N].shape).clone() for t in (K, rot, trans))
    post_rot = torch.empty(B, N, 3, 3)
    post_trans = torch.empty(B, N, 3)
    base = val_augmentation((1600, 900), final_dim)
    (w0, h0), (x0, y0) = base.resize_dims, base.crop
    for b in range(B):
        for n in range(N):
            r = torch.rand(4, generator=g).tolist()
            scale = 0.9 + 0.2 * r[0]
            aug = ImageAugmentation((int(w0 * scale), int(h0 * scale)), (x0 + int(8 * r[1]), y0 + int(8 * r[2])),
                                    flip=r[3] > 0.5, rotate=10 * r[1] - 5)
            post_rot[b, n], post_trans[b, n] = image_augmentation(aug, (1600, 900), final_dim)
    points = frustum_to_ego(frustum(final_dim, downsample, dbound), K, rot, trans, post_rot, post_trans)
    return FrustumLUT.build(points.to(device), BevGrid(*grid))


def inputs(lut, C, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    depth = torch.rand(lut.B, lut.N, lut.D, lut.fH, lut.fW, generator=g).softmax(2)
    feat = torch.randn(lut.B, lut.N, C, lut.fH, lut.fW, generator=g)
    return depth.to(device, dtype), feat.to(device, dtype)


def channels_last_feat(feat):
    """feat B x N x C x fH x fW as the model produces it: a channels-last camera feature map viewed as 5-D."""
    B, N, C, fH, fW = feat.shape
    return feat.reshape(B * N, C, fH, fW).contiguous(memory_format=torch.channels_last).view(B, N, C, fH, fW)


def float64_reference(depth, feat, lut):
    return bev_pool_reference(depth.double(), feat.double(), lut)


TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def assert_grads_match_reference(depth, feat, lut, grad_out, tol):
    """bev_pool's gradients for depth and feat (leaves; feat in any layout) against float64 reference autograd."""
    grad_depth, grad_feat = torch.autograd.grad(bev_pool(depth, feat, lut), (depth, feat), grad_out)
    d64, f64 = depth.detach().double().requires_grad_(), feat.detach().double().requires_grad_()
    want = torch.autograd.grad(bev_pool_reference(d64, f64, lut), (d64, f64), grad_out.double())
    torch.testing.assert_close(grad_depth.double(), want[0], atol=tol, rtol=tol)
    torch.testing.assert_close(grad_feat.double(), want[1], atol=tol, rtol=tol)
    return grad_depth, grad_feat


@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_matches_reference(device, dtype):
    lut = random_lut(device=device)
    assert 0 < lut.num_kept() < lut.num_points
    depth, feat = inputs(lut, 16, dtype, device)
    out = bev_pool(depth, feat, lut)
    assert out.shape == (2, 16, 200, 200) and out.dtype == dtype and out.is_contiguous()
    want = float64_reference(depth, feat, lut)
    torch.testing.assert_close(out.double(), want, atol=TOL[dtype], rtol=TOL[dtype])
    assert bool((out != 0).any())


@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_layout", ["contiguous", "channels_last"])
def test_gradients_match_reference(device, dtype, grad_layout):
    lut = random_lut(device=device, seed=1)
    depth, feat = inputs(lut, 12, dtype, device, seed=1)
    depth.requires_grad_()
    feat.requires_grad_()
    out = bev_pool(depth, feat, lut)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    if grad_layout == "channels_last":
        grad_out = grad_out.contiguous(memory_format=torch.channels_last)
    grad_depth, grad_feat = torch.autograd.grad(out, (depth, feat), grad_out)
    d64, f64 = depth.detach().double().requires_grad_(), feat.detach().double().requires_grad_()
    want = torch.autograd.grad(bev_pool_reference(d64, f64, lut), (d64, f64), grad_out.double())
    tol = 10 * TOL[dtype]
    torch.testing.assert_close(grad_depth.double(), want[0], atol=tol, rtol=tol)
    torch.testing.assert_close(grad_feat.double(), want[1], atol=tol, rtol=tol)
    assert grad_feat.shape == feat.shape and grad_depth.shape == depth.shape


@needs_ext
@pytest.mark.parametrize("device", devices())
def test_gradcheck_float64(device):
    # a small grid with two height levels: many points per cell, both z slices and dropped points
    lut = random_lut(B=1, N=2, final_dim=(32, 64), dbound=(4.0, 40.0, 9.0), grid=((-20, 20, 8.0), (-20, 20, 8.0),
                                                                                  (-2, 4, 3.0)), device=device)
    assert lut.nz == 2 and 0 < lut.num_kept() < lut.num_points
    depth, feat = inputs(lut, 3, torch.float64, device)
    depth.requires_grad_()
    feat.requires_grad_()
    assert torch.autograd.gradcheck(lambda d, f: bev_pool(d, f, lut), (depth, feat))


@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_opcheck(device, layout):
    lut = random_lut(B=1, N=2, dbound=(4.0, 45.0, 10.0), device=device)
    depth, feat = inputs(lut, 4, torch.float32, device)
    if layout == "channels_last":
        feat = channels_last_feat(feat)
    grad_out = torch.randn(1, 4, lut.nx, lut.ny, device=device)
    backward_args = (grad_out, depth, feat, lut.cell_start, lut.point_cell, lut.nz, lut.nx, lut.ny)
    torch.library.opcheck(torch.ops.lss._bev_pool_backward.default, backward_args)
    depth.requires_grad_()
    feat.requires_grad_()
    args = (depth, feat, lut.sorted_points, lut.cell_start, lut.point_cell, lut.nz, lut.nx, lut.ny)
    torch.library.opcheck(torch.ops.lss.bev_pool.default, args)


@needs_ext
@pytest.mark.parametrize("device", devices())
def test_channels_last_and_strided_inputs(device):
    lut = random_lut(device=device, seed=3)
    depth, feat = inputs(lut, 8, torch.float32, device, seed=3)
    want = bev_pool(depth, feat, lut)
    B, N, C, fH, fW = feat.shape
    # a channels-last camera feature map viewed as B x N x C x fH x fW, as the model produces it
    feat_cl = feat.reshape(B * N, C, fH, fW).contiguous(memory_format=torch.channels_last).view(B, N, C, fH, fW)
    depth_strided = depth.transpose(3, 4).contiguous().transpose(3, 4)
    torch.testing.assert_close(bev_pool(depth_strided, feat_cl, lut), want, rtol=1e-6, atol=1e-6)
    feat_strided = feat.transpose(3, 4).contiguous().transpose(3, 4)  # neither layout: NCHW output
    out = bev_pool(depth, feat_strided, lut)
    assert out.is_contiguous()
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("C", [1, 3, 64, 130])
def test_output_layout_follows_feat(device, dtype, C):
    lut = random_lut(B=2, N=3, grid=TWO_LEVEL_GRID, device=device, seed=8)
    assert lut.nz == 2
    depth, feat = inputs(lut, C, dtype, device, seed=8)
    out = bev_pool(depth, channels_last_feat(feat), lut)
    assert out.shape == (2, 2 * C, 200, 200) and out.dtype == dtype
    assert out.is_contiguous(memory_format=torch.channels_last) == (C > 1)
    assert out.is_contiguous() == (C == 1)
    want = float64_reference(depth, feat, lut)
    assert bool(want[:, :C].any()) and bool(want[:, C:].any())  # points in both height levels
    torch.testing.assert_close(out.double(), want, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(out, bev_pool(depth, feat, lut), atol=TOL[dtype], rtol=TOL[dtype])
    assert bev_pool(depth, feat, lut).is_contiguous()


@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("grad_layout", ["contiguous", "channels_last"])
def test_channels_last_output_gradients(device, dtype, grad_layout):
    lut = random_lut(B=2, N=3, grid=TWO_LEVEL_GRID, device=device, seed=9)
    depth, feat = inputs(lut, 24, dtype, device, seed=9)
    B, N, C, fH, fW = feat.shape
    depth.requires_grad_()
    feat_leaf = feat.reshape(B * N, C, fH, fW).contiguous(memory_format=torch.channels_last).requires_grad_()
    out = bev_pool(depth, feat_leaf.view(B, N, C, fH, fW), lut)
    assert out.is_contiguous(memory_format=torch.channels_last)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    if grad_layout == "channels_last":
        grad_out = grad_out.contiguous(memory_format=torch.channels_last)
    grad_depth, grad_feat = torch.autograd.grad(out, (depth, feat_leaf), grad_out)
    d64, f64 = depth.detach().double().requires_grad_(), feat.detach().double().requires_grad_()
    want = torch.autograd.grad(bev_pool_reference(d64, f64, lut), (d64, f64), grad_out.double())
    tol = 10 * TOL[dtype]
    torch.testing.assert_close(grad_depth.double(), want[0], atol=tol, rtol=tol)
    torch.testing.assert_close(grad_feat.double().view(B, N, C, fH, fW), want[1], atol=tol, rtol=tol)


@needs_ext
@pytest.mark.parametrize("device", devices())
def test_single_batch_single_camera(device):
    lut = random_lut(B=1, N=1, device=device, seed=4)
    depth, feat = inputs(lut, 5, torch.float64, device, seed=4)
    torch.testing.assert_close(bev_pool(depth, feat, lut), float64_reference(depth, feat, lut))


@pytest.mark.slow
@needs_ext
@pytest.mark.parametrize("device", devices())
def test_bevdet_depth_bins_and_large_grid(device):
    lut = random_lut(B=1, N=2, final_dim=(64, 176), dbound=(1.0, 60.0, 0.5),
                     grid=((-51.2, 51.2, 0.2), (-51.2, 51.2, 0.2), (-10, 10, 20)), device=device)
    assert lut.D == 118 and (lut.nx, lut.ny) == (512, 512)
    depth, feat = inputs(lut, 6, torch.float32, device)
    depth.requires_grad_()
    feat.requires_grad_()
    out = bev_pool(depth, feat, lut)
    torch.testing.assert_close(out.double(), float64_reference(depth, feat, lut), atol=1e-5, rtol=1e-5)
    out.square().sum().backward()
    d64, f64 = depth.detach().double().requires_grad_(), feat.detach().double().requires_grad_()
    bev_pool_reference(d64, f64, lut).square().sum().backward()
    torch.testing.assert_close(depth.grad.double(), d64.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(feat.grad.double(), f64.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", devices())
def test_no_kept_points_gives_zeros(device):
    grid = BevGrid(*LSS_GRID)
    points = torch.full((2, 3, 4, 2, 5, 3), 1000.0, device=device)
    lut = FrustumLUT.build(points, grid)
    depth, feat = inputs(lut, 4, torch.float32, device)
    depth.requires_grad_()
    feat.requires_grad_()
    out = bev_pool(depth, feat, lut)
    assert out.shape == (2, 4, 200, 200) and not bool(out.any())
    out.sum().backward()
    assert not bool(depth.grad.any()) and not bool(feat.grad.any())


@needs_ext
@pytest.mark.parametrize("device", devices())
def test_mixed_dtypes_are_promoted(device):
    lut = random_lut(B=1, N=2, device=device)
    depth, feat = inputs(lut, 4, torch.float32, device)
    out = bev_pool(depth.bfloat16(), feat, lut)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, bev_pool(depth.bfloat16().float(), feat, lut))


@needs_ext
def test_reference_agrees_with_explicit_sum():
    """The oracle itself against a direct sum over the frustum, point by point."""
    lut = random_lut(B=1, N=2, dbound=(4.0, 45.0, 10.0))
    depth, feat = inputs(lut, 3, torch.float64)
    want = torch.zeros(1, lut.nz * 3, lut.nx, lut.ny, dtype=torch.float64)
    cells = lut.point_cell.tolist()
    for p, cell in enumerate(cells):
        if cell < 0:
            continue
        n, d, h, w = torch.unravel_index(torch.tensor(p), (lut.N, lut.D, lut.fH, lut.fW))
        i, j = divmod(cell, lut.ny)
        want[0, :, i, j] += depth[0, n, d, h, w] * feat[0, n, :, h, w]
    torch.testing.assert_close(bev_pool_reference(depth, feat, lut), want)


def test_bad_arguments_have_clear_errors():
    lut = random_lut(B=1, N=2, dbound=(4.0, 45.0, 10.0))
    depth, feat = inputs(lut, 4)
    with pytest.raises(ValueError, match="LUT was built for"):
        bev_pool(depth[:, :1], feat, lut)
    with pytest.raises(ValueError, match="feat has shape"):
        bev_pool(depth, feat[..., :-1], lut)
    with pytest.raises(TypeError, match="floating point"):
        bev_pool(depth, feat.long(), lut)
    with pytest.raises(TypeError, match="FrustumLUT"):
        bev_pool(depth, feat, None)


@needs_ext
def test_kernel_rejects_mismatched_lut():
    lut = random_lut(B=1, N=2, dbound=(4.0, 45.0, 10.0))
    depth, feat = inputs(lut, 4)
    with pytest.raises(RuntimeError, match="cell_start must be 1-D with"):
        torch.ops.lss.bev_pool(depth, feat, lut.sorted_points, lut.cell_start[:-1], lut.point_cell, 1, 200, 200)
    with pytest.raises(RuntimeError, match="has dtype"):
        torch.ops.lss.bev_pool(depth, feat, lut.sorted_points.long(), lut.cell_start, lut.point_cell, 1, 200, 200)


@pytest.mark.cuda
def test_wrong_device_is_reported():
    lut = random_lut(B=1, N=2, dbound=(4.0, 45.0, 10.0))
    depth, feat = inputs(lut, 4)
    with pytest.raises(ValueError, match="same device"):
        bev_pool(depth.cuda(), feat.cuda(), lut)


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_cuda_matches_cpu_and_is_deterministic(layout):
    lut = random_lut(B=2, N=6, dbound=(4.0, 45.0, 1.0), seed=5)
    depth, feat = inputs(lut, 64, torch.float32, seed=5)
    if layout == "channels_last":
        feat = channels_last_feat(feat)
    depth.requires_grad_()
    feat.requires_grad_()
    out = bev_pool(depth, feat, lut)
    grads = torch.autograd.grad(out, (depth, feat), out.detach() * 0.5)
    lut_gpu = lut.to("cuda")
    runs = []
    for _ in range(2):
        d, f = depth.detach().cuda().requires_grad_(), feat.detach().cuda().requires_grad_()
        o = bev_pool(d, f, lut_gpu)
        runs.append((o,) + torch.autograd.grad(o, (d, f), o.detach() * 0.5))
    for a, b in zip(runs[0], runs[1]):
        assert torch.equal(a, b)
    torch.testing.assert_close(runs[0][0].cpu(), out, atol=1e-5, rtol=1e-5)
    for got, want in zip(runs[0][1:], grads):
        torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,C", [(torch.float32, 3), (torch.float32, 64), (torch.float32, 128),
                                     (torch.float32, 130), (torch.float32, 300), (torch.bfloat16, 64),
                                     (torch.bfloat16, 256), (torch.float16, 96), (torch.float64, 64)])
def test_cuda_channels_last_forward_vector_widths(dtype, C):
    # C picks the vector width (16 bytes, 8 bytes or one channel) and the 8-channel groups of a cell's threads
    lut = random_lut(B=2, N=3, grid=TWO_LEVEL_GRID, device="cuda", seed=10)
    depth, feat = inputs(lut, C, dtype, "cuda", seed=10)
    out = bev_pool(depth, channels_last_feat(feat), lut)
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out.double(), float64_reference(depth, feat, lut), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.cuda
def test_cuda_channels_last_misaligned_feat_and_int64_lut():
    lut = random_lut(B=2, N=3, grid=TWO_LEVEL_GRID, device="cuda", seed=11)
    depth, feat = inputs(lut, 64, torch.float32, "cuda", seed=11)
    B, N, C, fH, fW = feat.shape
    # channels-last strides at an odd element offset: vector loads are not allowed, one channel per lane
    flat = torch.empty(feat.numel() + 1, device="cuda")
    shifted = flat[1:].as_strided((B, N, C, fH, fW), (N * fH * fW * C, fH * fW * C, 1, fW * C, C))
    shifted.copy_(feat)
    want = float64_reference(depth, feat, lut)
    out = bev_pool(depth, shifted, lut)
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    lut64 = lut_with(lut, **{k: getattr(lut, k).long() for k in ("point_cell", "sorted_points", "cell_start")})
    torch.testing.assert_close(bev_pool(depth, channels_last_feat(feat), lut64), out, atol=1e-6, rtol=1e-6)


@pytest.mark.cuda
def test_cuda_lut_matches_cpu_lut():
    cpu = random_lut(seed=6)
    gpu = random_lut(seed=6, device="cuda")
    for name in ("point_cell", "sorted_points", "cell_start"):
        assert torch.equal(getattr(cpu, name), getattr(gpu, name).cpu()), name


@pytest.mark.cuda
def test_cuda_large_channels_and_int64_indices():
    lut = random_lut(B=1, N=2, seed=7, device="cuda")
    depth, feat = inputs(lut, 200, torch.float32, "cuda", seed=7)  # more channels than one 128-channel pass
    depth.requires_grad_()
    feat.requires_grad_()
    out = bev_pool(depth, feat, lut)
    torch.testing.assert_close(out.double(), float64_reference(depth, feat, lut), atol=1e-5, rtol=1e-5)
    lut64 = lut_with(lut, **{k: getattr(lut, k).long() for k in ("point_cell", "sorted_points", "cell_start")})
    torch.testing.assert_close(bev_pool(depth, feat, lut64), out, rtol=0, atol=0)
    grads = torch.autograd.grad(out, (depth, feat), torch.ones_like(out))
    grads64 = torch.autograd.grad(bev_pool(depth, feat, lut64), (depth, feat), torch.ones_like(out))
    for a, b in zip(grads, grads64):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided"])
def test_grad_feat_follows_feat_layout(device, layout):
    lut = random_lut(B=2, N=3, grid=TWO_LEVEL_GRID, device=device, seed=12)
    depth, feat = inputs(lut, 16, torch.float32, device, seed=12)
    if layout == "channels_last":
        feat = channels_last_feat(feat)
    elif layout == "strided":  # neither layout: read with its strides, gradient contiguous
        feat = feat.transpose(3, 4).contiguous().transpose(3, 4)
    depth.requires_grad_()
    feat.requires_grad_()
    grad_out = torch.randn(2, 2 * 16, 200, 200, generator=torch.Generator().manual_seed(4)).to(device)
    _, grad_feat = assert_grads_match_reference(depth, feat, lut, grad_out, 1e-4)
    if layout == "channels_last":
        assert grad_feat.stride() == feat.stride()
    else:
        assert grad_feat.is_contiguous()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,C", [(torch.float32, 1), (torch.float32, 3), (torch.float32, 12), (torch.float32, 64),
                                     (torch.float32, 80), (torch.float32, 130), (torch.float32, 264),
                                     (torch.bfloat16, 64), (torch.bfloat16, 264), (torch.float16, 96),
                                     (torch.float64, 64)])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_cuda_gradients_channel_groups_and_vector_widths(dtype, C, layout):
    # C picks the vector width, the lanes per pixel of the backward (1 to 32 channel groups of 8) and, past 256
    # channels, several passes of the warp over the groups; the layout picks staged or in-place gradient rows
    lut = random_lut(B=2, N=3, grid=TWO_LEVEL_GRID, device="cuda", seed=13)
    depth, feat = inputs(lut, C, dtype, "cuda", seed=13)
    if layout == "channels_last":
        feat = channels_last_feat(feat)
    depth.requires_grad_()
    feat.requires_grad_()
    out = bev_pool(depth, feat, lut)
    torch.testing.assert_close(out.double(), float64_reference(depth.detach(), feat.detach(), lut), atol=TOL[dtype],
                               rtol=TOL[dtype])
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to("cuda", dtype)
    if layout == "channels_last":
        grad_out = grad_out.contiguous(memory_format=torch.channels_last)
    assert_grads_match_reference(depth, feat, lut, grad_out, 10 * TOL[dtype])


@pytest.mark.cuda
def test_cuda_misaligned_channels_last_grad_out():
    lut = random_lut(B=2, N=3, device="cuda", seed=14)
    depth, feat = inputs(lut, 64, torch.float32, "cuda", seed=14)
    depth.requires_grad_()
    feat.requires_grad_()
    want = torch.randn(2, 64, lut.nx, lut.ny, device="cuda").contiguous(memory_format=torch.channels_last)
    # channels-last strides at an odd element offset: the rows are read in place one channel per load
    flat = torch.empty(want.numel() + 1, device="cuda")
    grad_out = flat[1:].as_strided(want.shape, want.stride())
    grad_out.copy_(want)
    assert grad_out.is_contiguous(memory_format=torch.channels_last)
    assert_grads_match_reference(depth, feat, lut, grad_out, 1e-4)


def lut_with(lut, **changes):
    """The fields of `lut` with some replaced, as FrustumLUT(...) from user tensors (which validates them)."""
    values = {f.name: getattr(lut, f.name) for f in dataclasses.fields(lut)}
    values.update(changes)
    return FrustumLUT(**values)


def edited(t, index, value):
    t = t.clone()
    t[index] = value
    return t


def bad_tables(lut):
    """(field changes, expected message) for tables that would make bev_pool read out of bounds or mix cells."""
    P, cells = lut.num_points, lut.num_cells
    cs, sp, pc = lut.cell_start, lut.sorted_points, lut.point_cell.long()
    kept_cell = int(pc[pc >= 0][0])
    other_cell = int(pc[(pc >= 0) & (pc != kept_cell)][0])
    swapped = pc.clone()
    a, b = int(torch.nonzero(pc == kept_cell)[0]), int(torch.nonzero(pc == other_cell)[0])
    swapped[a], swapped[b] = pc[b], pc[a]
    return [
        (dict(sorted_points=edited(sp, 3, 10**9)), f"sorted_points holds 1000000000, expected point indices in "
                                                   f"\\[0, P\\) = \\[0, {P}\\)"),
        (dict(sorted_points=edited(sp, 3, -5)), "sorted_points holds -5"),
        (dict(cell_start=edited(cs, -1, 10**8)), f"cell_start\\[-1\\] .* is 100000000, expected a value in "
                                                 f"\\[0, P\\] = \\[0, {P}\\]"),
        (dict(cell_start=edited(cs, 0, -2)), "cell_start\\[0\\] is -2, expected 0"),
        (dict(cell_start=edited(cs, cells // 2, -2)), "cell_start must be non-decreasing"),
        (dict(cell_start=cs.flip(0)), "cell_start\\[0\\] is"),
        (dict(cell_start=torch.cat([cs[:1], cs[1:].flip(0)])), "cell_start must be non-decreasing"),
        (dict(point_cell=edited(lut.point_cell, 5, 10**9)), f"point_cell holds 1000000000, expected -1 .* "
                                                            f"\\[0, {cells}\\)"),
        (dict(point_cell=edited(lut.point_cell, 5, -7)), "point_cell holds -7"),
        (dict(point_cell=swapped.to(lut.point_cell.dtype)), "the tables disagree"),
        (dict(point_cell=lut.point_cell.long()), "dtype torch.int64"),
        (dict(sorted_points=sp[:-1]), f"sorted_points must be 1-D with {P} elements"),
        (dict(nx=0), "nx must be an integer >= 1"),
    ]


@needs_ext
def test_inconsistent_lut_is_rejected_when_constructed():
    lut = random_lut(B=1, N=2, grid=TWO_LEVEL_GRID, seed=15)
    depth, feat = inputs(lut, 3, seed=15)
    assert torch.equal(bev_pool(depth, feat, lut_with(lut)), bev_pool(depth, feat, lut))
    for changes, message in bad_tables(lut):
        with pytest.raises(ValueError, match=message):
            lut_with(lut, **changes)


def test_built_lut_skips_validation_and_in_place_edits_are_caught_by_validate(monkeypatch):
    def fail(self):
        raise AssertionError("FrustumLUT.build and .to must not validate (a host sync)")

    with monkeypatch.context() as m:
        m.setattr(FrustumLUT, "validate", fail)
        lut = random_lut(B=1, N=2, seed=16).to("cpu")
    assert lut.validate() is lut
    lut.sorted_points[0] = 10**9
    with pytest.raises(ValueError, match="sorted_points holds 1000000000"):
        lut.validate()


@pytest.mark.cuda
def test_cuda_inconsistent_lut_is_rejected_when_constructed():
    lut = random_lut(B=1, N=2, grid=TWO_LEVEL_GRID, seed=15, device="cuda")
    for changes, message in bad_tables(lut):
        with pytest.raises(ValueError, match=message):
            lut_with(lut, **changes)
