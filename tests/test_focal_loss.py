import functools
import math

import pytest
import torch
import torch.nn.functional as F
import torchvision
from conftest import devices

from lss.ops import (SigmoidFocalLoss, SoftmaxFocalLoss, has_ext, sigmoid_focal_loss, sigmoid_focal_loss_reference,
                     softmax_focal_loss, softmax_focal_loss_reference)

needs_ext = pytest.mark.skipif(not has_ext(), reason="lss._C not built")
REDUCTIONS = ["none", "mean", "sum"]
LOW_PRECISION = [torch.float16, torch.bfloat16]


def value_and_grad(fn, logits, *args, **kwargs):
    x = logits.detach().clone().requires_grad_(True)
    loss = fn(x, *args, **kwargs)
    # linspace in float32: torch's CPU float16 linspace yields NaN for long ranges
    seed = torch.linspace(0.5, 1.5, loss.numel(), device=loss.device).to(loss.dtype).view(loss.shape)
    (grad,) = torch.autograd.grad((loss * seed).sum(), x)
    return loss.detach(), grad


def assert_close_scaled(actual, expected, tol):
    """Relative tolerance tol, plus an absolute floor of tol * 0.01 * max|expected| for values near zero."""
    floor = tol * 1e-2 * expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=tol, atol=floor)


def parity_tol(dtype):
    """Relative tolerance of CPU vs CUDA results. Their float32 math differs by a few ulp, and a gradient rounds to
    the logits' dtype twice (the saved gradient, then times grad_output), so 16-bit results may differ by two units
    in the last place: 2^-6 relative in bfloat16."""
    return {torch.float64: 1e-10, torch.float32: 1e-5}.get(dtype, 2e-2)


def dense_inputs(shape, dtype, device, soft=False, scale=3.0):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)
    targets = torch.rand(shape, generator=g, dtype=torch.float64)
    targets = targets if soft else (targets > 0.7).double()
    return logits, targets.to(dtype).to(device)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0, 2.0])
@pytest.mark.parametrize("alpha", [0.25, -1.0])
def test_dense_matches_torchvision(device, reduction, gamma, alpha):
    logits, targets = dense_inputs((2, 3, 5, 7), torch.float64, device, soft=gamma == 0.5)
    ours = value_and_grad(sigmoid_focal_loss, logits, targets, alpha, gamma, reduction=reduction)
    peer = value_and_grad(torchvision.ops.sigmoid_focal_loss, logits, targets, alpha, gamma, reduction)
    torch.testing.assert_close(ours[0], peer[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours[1], peer[1], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_dense_float32_matches_torchvision(device, reduction):
    logits, targets = dense_inputs((4, 3, 9, 11), torch.float32, device, soft=True)
    ours = value_and_grad(sigmoid_focal_loss, logits, targets, reduction=reduction)
    peer = value_and_grad(torchvision.ops.sigmoid_focal_loss, logits, targets, reduction=reduction)
    torch.testing.assert_close(ours[0], peer[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours[1], peer[1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("gamma", [0.5, 2.0])
def test_dense_weight_and_mask_match_reference(device, reduction, gamma):
    logits, targets = dense_inputs((2, 3, 4, 6), torch.float64, device, soft=True)
    weight = torch.tensor([0.5, 2.0, 1.5], dtype=torch.float64, device=device)
    visible = torch.rand(2, 1, 4, 6, generator=torch.Generator().manual_seed(1)).to(device)  # float, broadcast
    ours = value_and_grad(sigmoid_focal_loss, logits, targets, 0.25, gamma, reduction, class_weight=weight,
                          mask=visible)
    ref = value_and_grad(sigmoid_focal_loss_reference, logits, targets, 0.25, gamma, reduction, class_weight=weight,
                          mask=visible)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-10, atol=1e-12)
    # Independent check of the semantics: weighted torchvision loss averaged over the visible cells.
    keep = (visible > 0.5).expand_as(logits)
    loss = sigmoid_focal_loss(logits, targets, 0.25, gamma, reduction, class_weight=weight, mask=visible > 0.5)
    peer = torchvision.ops.sigmoid_focal_loss(logits, targets, 0.25, gamma, "none") * weight.view(1, 3, 1, 1)
    peer = torch.where(keep, peer, 0.0)
    expected = {"none": peer, "sum": peer.sum(), "mean": peer.sum() / keep.sum()}[reduction]
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("device", devices())
def test_fully_masked_mean_is_zero(device):
    logits, targets = dense_inputs((2, 3, 4), torch.float32, device)
    mask = torch.zeros(2, 3, 4, dtype=torch.bool, device=device)
    loss, grad = value_and_grad(sigmoid_focal_loss, logits, targets, reduction="mean", mask=mask)
    assert loss.item() == 0.0 and torch.count_nonzero(grad).item() == 0


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_low_precision_close_to_float64(device, dtype, reduction):
    logits, targets = dense_inputs((3, 4, 8, 8), dtype, device, soft=True)
    loss, grad = value_and_grad(sigmoid_focal_loss, logits, targets, reduction=reduction)
    ref_loss, ref_grad = value_and_grad(sigmoid_focal_loss_reference, logits.double(), targets.double(),
                                        reduction=reduction)
    assert loss.dtype == dtype and grad.dtype == dtype
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(loss.double(), ref_loss, rtol=tol, atol=tol * ref_loss.abs().max().item())
    torch.testing.assert_close(grad.double(), ref_grad, rtol=tol, atol=tol * ref_grad.abs().max().item())


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0, 2.0])
def test_extreme_logits_stay_finite(device, dtype, gamma):
    logits = torch.tensor([[100.0, -100.0, 100.0, -100.0, 200.0, -200.0, 30.0, -30.0]] * 3, dtype=dtype)
    targets = torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 1.0, 0.0]] * 3, dtype=dtype)
    logits, targets = logits.to(device), targets.to(device)
    loss, grad = value_and_grad(sigmoid_focal_loss, logits, targets, 0.25, gamma, reduction="none")
    ref_loss, ref_grad = value_and_grad(sigmoid_focal_loss_reference, logits.double(), targets.double(), 0.25,
                                        gamma, reduction="none")
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-2, atol=1e-6)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-2, atol=1e-6)
    labels = torch.tensor([0, 1, 7], device=device)
    sm_loss, sm_grad = value_and_grad(softmax_focal_loss, logits, labels, 0.25, gamma, reduction="none")
    sm_ref, sm_ref_grad = value_and_grad(softmax_focal_loss_reference, logits.double(), labels, 0.25, gamma,
                                         reduction="none")
    assert torch.isfinite(sm_loss).all() and torch.isfinite(sm_grad).all()
    torch.testing.assert_close(sm_loss.double(), sm_ref, rtol=1e-2, atol=1e-6)
    torch.testing.assert_close(sm_grad.double(), sm_ref_grad, rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_empty_inputs(device, reduction):
    logits = torch.zeros(0, 4, 3, 3, device=device, requires_grad=True)
    loss = sigmoid_focal_loss(logits, torch.zeros(0, 4, 3, 3, device=device), reduction=reduction)
    assert loss.shape == ((0, 4, 3, 3) if reduction == "none" else ())
    assert loss.sum().item() == 0.0
    (grad,) = torch.autograd.grad(loss.sum(), logits)
    assert grad.shape == logits.shape
    rows = torch.zeros(0, 5, device=device, requires_grad=True)
    labels = torch.zeros(0, dtype=torch.long, device=device)
    for fn in (sigmoid_focal_loss, softmax_focal_loss):
        loss = fn(rows, labels, reduction=reduction)
        assert loss.sum().item() == 0.0
        assert torch.autograd.grad(loss.sum(), rows)[0].shape == rows.shape


@pytest.mark.parametrize("device", devices())
def test_non_contiguous_inputs(device):
    logits, targets = dense_inputs((2, 9, 7, 3), torch.float32, device, soft=True)
    x = logits.permute(0, 3, 1, 2)[:, :, ::2]
    t = targets.permute(0, 3, 1, 2)[:, :, ::2]
    mask = (torch.arange(7, device=device) % 3 != 0).view(1, 1, 1, 7)
    weight = torch.linspace(0.5, 2, 6, device=device)[::2]
    ours = value_and_grad(sigmoid_focal_loss, x, t, 0.25, 2.0, "mean", class_weight=weight, mask=mask)
    ref = value_and_grad(sigmoid_focal_loss_reference, x.contiguous(), t.contiguous(), 0.25, 2.0, "mean",
                         class_weight=weight, mask=mask)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-5, atol=1e-8)
    rows = logits.reshape(-1, 6)[::2, ::2]
    labels = torch.arange(rows.shape[0] * 2, device=device)[::2] % 4 - 1
    ours = value_and_grad(softmax_focal_loss, rows, labels)
    ref = value_and_grad(softmax_focal_loss_reference, rows.contiguous(), labels)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("device", devices())
def test_class_index_hand_computed(device):
    # All logits 0: p = 1/2, ce = ln 2, (1 - p_t)^2 = 1/4 for every cell. Row 0 is class 1, row 1 is background (3).
    logits = torch.zeros(2, 3, dtype=torch.float64, device=device)
    labels = torch.tensor([1, 3], device=device)
    ln2 = math.log(2.0)
    expected = torch.full((2, 3), 0.75 * ln2 * 0.25, dtype=torch.float64)
    expected[0, 1] = 0.25 * ln2 * 0.25
    loss, grad = value_and_grad(sigmoid_focal_loss, logits, labels, reduction="none")
    torch.testing.assert_close(loss.cpu(), expected)
    # d/dx = alpha_t q^2 [(p - t) + 2 (1 - 2t) ce p (1 - p) / q] at p = q = 1/2
    seed = torch.linspace(0.5, 1.5, 6, dtype=torch.float64).view(2, 3)
    dgrad = torch.full((2, 3), 0.75 * 0.25 * (0.5 + ln2), dtype=torch.float64)
    dgrad[0, 1] = 0.25 * 0.25 * (-0.5 - ln2)
    torch.testing.assert_close(grad.cpu(), dgrad * seed)
    assert sigmoid_focal_loss(logits, labels, reduction="sum").item() == pytest.approx(ln2)
    assert sigmoid_focal_loss(logits, labels, reduction="mean").item() == pytest.approx(ln2 / 2)
    weight = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64, device=device)
    # mmcv: the row of sample n scaled by weight[labels[n]]; the background row keeps weight 1.
    weighted = sigmoid_focal_loss(logits, labels, weight=weight, reduction="none")
    torch.testing.assert_close(weighted.cpu(), expected * torch.tensor([[2.0], [1.0]], dtype=torch.float64))
    by_column = sigmoid_focal_loss(logits, labels, class_weight=weight, reduction="none")
    torch.testing.assert_close(by_column.cpu(), expected * weight.cpu())


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_class_index_equals_one_hot_dense(device, reduction):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(37, 6, generator=g, dtype=torch.float64).to(device)
    labels = torch.randint(0, 7, (37,), generator=g).to(device)
    one_hot = F.one_hot(labels, 7)[:, :6].double()
    weight = torch.rand(6, generator=g, dtype=torch.float64).to(device)
    ours = value_and_grad(sigmoid_focal_loss, logits, labels, class_weight=weight, reduction=reduction)
    dense_red = "sum" if reduction == "mean" else reduction
    dense = value_and_grad(sigmoid_focal_loss, logits, one_hot, class_weight=weight, reduction=dense_red)
    scale = 1 / 37 if reduction == "mean" else 1.0
    torch.testing.assert_close(ours[0], dense[0] * scale)
    torch.testing.assert_close(ours[1], dense[1] * scale)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_class_index_weight_scales_rows_as_mmcv(device, reduction):
    # mmcv's sigmoid_focal_loss: loss[n, c] = focal(x[n, c], [labels[n] == c]) * weight[labels[n]], mean = sum / N.
    # Built here from torchvision's dense loss, with background rows (label C) weighted 1.
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(41, 5, generator=g, dtype=torch.float64).to(device)
    labels = torch.randint(0, 6, (41,), generator=g).to(device)
    weight = torch.rand(5, generator=g, dtype=torch.float64).to(device) + 0.5
    one_hot = F.one_hot(labels, 6)[:, :5].double()
    row_weight = torch.cat([weight, weight.new_ones(1)])[labels][:, None]
    peer = torchvision.ops.sigmoid_focal_loss(logits, one_hot, 0.25, 2.0, "none") * row_weight
    expected = {"none": peer, "sum": peer.sum(), "mean": peer.sum() / 41}[reduction]
    ours = value_and_grad(sigmoid_focal_loss, logits, labels, 0.25, 2.0, reduction, weight=weight)
    torch.testing.assert_close(ours[0], expected, rtol=1e-10, atol=1e-12)
    ref = value_and_grad(sigmoid_focal_loss_reference, logits, labels, 0.25, 2.0, reduction, weight=weight)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-10, atol=1e-12)
    peer_grad = value_and_grad(lambda x: {"none": lambda v: v, "sum": torch.sum, "mean": lambda v: v.sum() / 41}[
        reduction](torchvision.ops.sigmoid_focal_loss(x, one_hot, 0.25, 2.0, "none") * row_weight), logits)[1]
    torch.testing.assert_close(ours[1], peer_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("device", devices())
def test_torchvision_positional_order_and_default_reduction(device):
    logits, targets = dense_inputs((3, 4, 5), torch.float64, device, soft=True)
    for args in [(), (0.5,), (0.5, 1.0), (-1.0, 0.5, "sum"), (0.25, 2, "mean")]:
        ours = value_and_grad(sigmoid_focal_loss, logits, targets, *args)
        peer = value_and_grad(torchvision.ops.sigmoid_focal_loss, logits, targets, *args)
        torch.testing.assert_close(ours[0], peer[0], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(ours[1], peer[1], rtol=1e-10, atol=1e-12)
    assert sigmoid_focal_loss(inputs=logits, targets=targets).shape == logits.shape  # "none" by default


@pytest.mark.parametrize("device", devices())
def test_softmax_hand_computed_with_ignore(device):
    logits = torch.zeros(3, 4, dtype=torch.float64, device=device)
    labels = torch.tensor([0, -1, 3], device=device)
    per_sample = 0.25 * 0.75**2 * math.log(4.0)  # p_t = 1/4
    loss, grad = value_and_grad(softmax_focal_loss, logits, labels, reduction="none")
    torch.testing.assert_close(loss.cpu(), torch.tensor([per_sample, 0.0, per_sample], dtype=torch.float64))
    assert torch.count_nonzero(grad[1]).item() == 0
    assert softmax_focal_loss(logits, labels, reduction="sum").item() == pytest.approx(2 * per_sample)
    assert softmax_focal_loss(logits, labels, reduction="mean").item() == pytest.approx(2 * per_sample / 3)
    # d/dx_j = alpha [u^2 + 2 p_t u (-ln p_t)] (p_j - [j = t]), u = 3/4
    coef = 0.25 * (0.75**2 + 2 * 0.25 * 0.75 * math.log(4.0))
    row = coef * (torch.full((4,), 0.25, dtype=torch.float64) - F.one_hot(torch.tensor(0), 4))
    torch.testing.assert_close(grad[0].cpu(), row * 0.5)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_softmax_gamma0_alpha1_is_cross_entropy(device, reduction):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(50, 9, generator=g, dtype=torch.float64) * 4).to(device)
    labels = torch.randint(-1, 9, (50,), generator=g).to(device)
    ours = value_and_grad(softmax_focal_loss, logits, labels, 1.0, 0.0, reduction=reduction)
    peer = value_and_grad(F.cross_entropy, logits, labels, ignore_index=-1, reduction=reduction)
    torch.testing.assert_close(ours[0], peer[0])
    torch.testing.assert_close(ours[1], peer[1])


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0])
def test_softmax_matches_reference(device, reduction, gamma):
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(40, 45, generator=g, dtype=torch.float64) * 5).to(device)
    labels = torch.randint(-2, 45, (40,), generator=g).to(device)
    weight = torch.rand(45, generator=g, dtype=torch.float64).to(device)
    ours = value_and_grad(softmax_focal_loss, logits, labels, 0.25, gamma, weight, reduction)
    ref = value_and_grad(softmax_focal_loss_reference, logits, labels, 0.25, gamma, weight, reduction)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-10, atol=1e-12)
    for dtype in LOW_PRECISION:
        low = value_and_grad(softmax_focal_loss, logits.to(dtype), labels, 0.25, gamma, weight, reduction)
        ref = value_and_grad(softmax_focal_loss_reference, logits.to(dtype).double(), labels, 0.25, gamma, weight,
                             reduction)
        torch.testing.assert_close(low[0].double(), ref[0], rtol=2e-2, atol=2e-2 * ref[0].abs().max().item())
        torch.testing.assert_close(low[1].double(), ref[1], rtol=2e-2, atol=2e-2 * ref[1].abs().max().item())


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_softmax_non_finite_logits_match_reference(device, reduction, dtype):
    nan, inf = float("nan"), float("inf")
    # target 0 in every row; a NaN or +-inf anywhere but a -inf off the target makes the row's loss NaN or +inf
    rows = [[0.0, 1.0, nan], [nan, 1.0, 2.0], [0.0, 1.0, inf], [inf, 1.0, 2.0], [-inf, 1.0, 2.0], [0.0, -inf, 2.0],
            [inf, inf, 0.0], [-inf, -inf, -inf], [0.0, inf, -inf], [0.5, 0.2, 0.1]]
    logits = torch.tensor(rows, dtype=dtype, device=device)
    labels = torch.zeros(len(rows), dtype=torch.long, device=device)
    ours = value_and_grad(softmax_focal_loss, logits, labels, 0.25, 2.0, None, reduction)
    ref = value_and_grad(softmax_focal_loss_reference, logits, labels, 0.25, 2.0, None, reduction)
    if reduction == "none":
        assert not ours[0][:5].isfinite().any()  # a NaN/inf logit never yields a finite loss
        assert ours[0][5:6].isfinite().all() and ours[0][-1:].isfinite().all()
    torch.testing.assert_close(ours[0], ref[0], equal_nan=True)
    torch.testing.assert_close(ours[1], ref[1], equal_nan=True)


@needs_ext
@pytest.mark.parametrize("device", devices())
def test_gradcheck(device):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 3, 4, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
    t = torch.rand(2, 3, 3, 4, generator=g, dtype=torch.float64).to(device)
    w = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64, device=device)
    mask = t > 0.2
    for gamma in (0.5, 2.0):
        assert torch.autograd.gradcheck(lambda x: sigmoid_focal_loss(x, t, 0.25, gamma, "mean", class_weight=w,
                                                                       mask=mask), (x,))
        assert torch.autograd.gradcheck(lambda x: sigmoid_focal_loss(x, t, 0.25, gamma, reduction="none"), (x,))
    rows = torch.randn(6, 3, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
    labels = torch.tensor([0, 3, 2, -1, 1, 2], device=device)
    assert torch.autograd.gradcheck(lambda x: sigmoid_focal_loss(x, labels.clamp_min(0), 0.25, 0.5, "mean", weight=w),
                                     (rows,))
    assert torch.autograd.gradcheck(lambda x: softmax_focal_loss(x, labels.clamp_max(2), 0.25, 0.5, w), (rows,))
    assert torch.autograd.gradcheck(lambda x: softmax_focal_loss(x, labels.clamp_max(2), reduction="none"), (rows,))


@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_opcheck(device, reduction):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 3, 4, 5, generator=g).to(device).requires_grad_(True)
    t = torch.rand(2, 3, 4, 5, generator=g).to(device)
    mask = torch.rand(2, 3, 4, 5, generator=g).to(device) > 0.5
    w = torch.rand(3, generator=g).to(device)
    torch.library.opcheck(torch.ops.lss.sigmoid_focal_loss, (x, t, w, mask, 0.25, 2.0, reduction, True))
    rows = torch.randn(7, 3, generator=g).to(device).requires_grad_(True)
    labels = torch.tensor([0, 3, 2, 1, 1, 3, 0], device=device)
    torch.library.opcheck(torch.ops.lss.sigmoid_focal_loss, (rows, labels, None, None, 0.25, 0.5, reduction, True))
    torch.library.opcheck(torch.ops.lss.softmax_focal_loss, (rows, labels - 1, w, 0.25, 2.0, reduction, True))
    torch.library.opcheck(torch.ops.lss.softmax_focal_loss, (rows.detach(), labels - 1, None, 0.25, 2.0, reduction,
                                                             False))


@pytest.mark.parametrize("device", devices())
def test_bad_arguments(device):
    x = torch.randn(4, 3, device=device)
    with pytest.raises((RuntimeError, ValueError), match=r"\[0, C\] = \[0, 3\]"):
        sigmoid_focal_loss(x, torch.tensor([0, 1, 4, 2], device=device))
    with pytest.raises((RuntimeError, ValueError), match=r"\[0, C\] = \[0, 3\]"):
        sigmoid_focal_loss(x, torch.tensor([0, -1, 2, 2], device=device))
    with pytest.raises((RuntimeError, ValueError), match="< C = 3|\\[0, C\\) = \\[0, 3\\)"):
        softmax_focal_loss(x, torch.tensor([0, 3, -1, 2], device=device))
    # The device stays usable after a rejected call.
    assert torch.isfinite(softmax_focal_loss(x, torch.tensor([0, 2, -1, 2], device=device)))
    with pytest.raises(ValueError, match="logits' shape"):
        sigmoid_focal_loss(x, torch.rand(4, 2, device=device))
    with pytest.raises(ValueError, match="reduction"):
        sigmoid_focal_loss(x, torch.rand(4, 3, device=device), reduction="avg")
    with pytest.raises(ValueError, match="gamma"):
        sigmoid_focal_loss(x, torch.rand(4, 3, device=device), gamma=-1.0)
    with pytest.raises(ValueError, match="does not broadcast"):
        sigmoid_focal_loss(x, torch.rand(4, 3, device=device), mask=torch.ones(3, 4, device=device))
    with pytest.raises(ValueError, match="one entry per class"):
        sigmoid_focal_loss(x, torch.rand(4, 3, device=device), class_weight=torch.ones(4, device=device))
    with pytest.raises(ValueError, match="needs int64 class-index targets; .*class_weight="):
        sigmoid_focal_loss(x, torch.rand(4, 3, device=device), weight=torch.ones(3, device=device))
    with pytest.raises(ValueError, match="not both"):
        sigmoid_focal_loss(x, torch.tensor([0, 1, 3, 2], device=device), weight=torch.ones(3, device=device),
                           class_weight=torch.ones(3, device=device))
    with pytest.raises(TypeError, match="positional"):
        sigmoid_focal_loss(x, torch.rand(4, 3, device=device), 0.25, 2.0, "none", torch.ones(3, device=device))
    with pytest.raises(ValueError, match="targets.detach"):
        sigmoid_focal_loss(x, torch.rand(4, 3, device=device, requires_grad=True))
    with pytest.raises(TypeError, match="class indices"):
        softmax_focal_loss(x, torch.rand(4, device=device))
    with pytest.raises(ValueError, match="N x C"):
        softmax_focal_loss(x, torch.zeros(3, dtype=torch.long, device=device))


@needs_ext
def test_backward_without_saved_grad_raises():
    x = torch.randn(3, 4, requires_grad=True)
    loss, _, _ = torch.ops.lss.sigmoid_focal_loss(x, torch.rand(3, 4), None, None, 0.25, 2.0, "mean", False)
    with pytest.raises(RuntimeError, match="save_grad=False"):
        loss.backward()


@pytest.mark.parametrize("device", devices())
def test_modules_and_no_grad(device):
    logits, targets = dense_inputs((2, 3, 4, 4), torch.float32, device)
    weight = torch.tensor([1.0, 2.0, 3.0])
    module = SigmoidFocalLoss(alpha=0.5, gamma=1.0, class_weight=weight).to(device)
    expected = sigmoid_focal_loss_reference(logits, targets, 0.5, 1.0, "mean", class_weight=weight.to(device))
    torch.testing.assert_close(module(logits, targets), expected)
    with torch.no_grad():
        torch.testing.assert_close(module(logits.requires_grad_(True), targets), expected)
    rows = logits.reshape(-1, 3)
    labels = torch.arange(rows.shape[0], device=device) % 3
    sm = SoftmaxFocalLoss(gamma=0.5, reduction="sum").to(device)
    torch.testing.assert_close(sm(rows, labels), softmax_focal_loss_reference(rows, labels, gamma=0.5, reduction="sum"))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset", [0, 1])
def test_cuda_matches_cpu_large(dtype, offset):
    # Odd sizes and a 1-element offset exercise the vectorized body, its tail and the unaligned fallback.
    shape = (3, 5, 67, 131)
    n = math.prod(shape)
    g = torch.Generator().manual_seed(7)
    flat_x = (torch.randn(n + 1, generator=g) * 4).to(dtype)
    flat_t = torch.rand(n + 1, generator=g)
    flat_m = torch.rand(n + 1, generator=g) > 0.1
    x, t, m = (f[offset:offset + n].view(shape) for f in (flat_x, flat_t, flat_m))
    w = torch.rand(5, generator=g)
    for reduction in REDUCTIONS:
        for mask in (None, m):
            cpu = value_and_grad(sigmoid_focal_loss, x, t, 0.25, 2.0, reduction, class_weight=w, mask=mask)
            cuda = value_and_grad(sigmoid_focal_loss, x.cuda(), t.cuda(), 0.25, 2.0, reduction, class_weight=w.cuda(),
                                  mask=None if mask is None else mask.cuda())
            tol = parity_tol(dtype)
            assert_close_scaled(cuda[0].cpu(), cpu[0], tol)
            assert_close_scaled(cuda[1].cpu(), cpu[1], tol)


@pytest.mark.cuda
def test_cuda_class_index_and_softmax_match_cpu():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(1000, 80, generator=g) * 3
    labels = torch.randint(0, 81, (1000,), generator=g)
    w = torch.rand(80, generator=g)
    mask = torch.rand(1000, 1, generator=g) > 0.2
    for reduction in REDUCTIONS:
        cpu = value_and_grad(sigmoid_focal_loss, logits, labels, weight=w, reduction=reduction, mask=mask)
        cuda = value_and_grad(sigmoid_focal_loss, logits.cuda(), labels.cuda(), weight=w.cuda(), reduction=reduction,
                              mask=mask.cuda())
        assert_close_scaled(cuda[0].cpu(), cpu[0], 1e-5)
        assert_close_scaled(cuda[1].cpu(), cpu[1], 1e-5)
        sm_labels = labels.clamp_max(79) - (labels % 7 == 0).long() * 100  # some ignored rows
        for classes in (80, 3, 1000):
            x = torch.randn(1000, classes, generator=g) * 3
            lab = sm_labels % classes - (sm_labels < 0).long() * classes
            cpu = value_and_grad(softmax_focal_loss, x, lab.clamp(-1, classes - 1), reduction=reduction)
            cuda = value_and_grad(softmax_focal_loss, x.cuda(), lab.clamp(-1, classes - 1).cuda(), reduction=reduction)
            assert_close_scaled(cuda[0].cpu(), cpu[0], 1e-5)
            assert_close_scaled(cuda[1].cpu(), cpu[1], 1e-5)


@pytest.mark.cuda
def test_cuda_reduction_is_deterministic():
    x = torch.randn(4, 10, 100, 100, device="cuda", requires_grad=True)
    t = torch.rand(4, 10, 100, 100, device="cuda")
    mask = torch.rand(4, 1, 100, 100, device="cuda") > 0.3
    first = value_and_grad(sigmoid_focal_loss, x, t, mask=mask)
    for _ in range(3):
        again = value_and_grad(sigmoid_focal_loss, x, t, mask=mask)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    rows = torch.randn(5000, 80, device="cuda")
    labels = torch.randint(-1, 80, (5000,), device="cuda")
    assert torch.equal(softmax_focal_loss(rows, labels), softmax_focal_loss(rows, labels))


def value_and_grad_of_view(fn, flat_logits, offset, shape, *args, **kwargs):
    """value_and_grad for logits that are a view at `offset` elements into a buffer (value_and_grad's clone would
    realign them): the op sees the view's data pointer."""
    flat = flat_logits.detach().clone().requires_grad_(True)
    n = math.prod(shape)
    loss = fn(flat[offset:offset + n].view(shape), *args, **kwargs)
    seed = torch.linspace(0.5, 1.5, loss.numel(), device=loss.device).to(loss.dtype).view(loss.shape)
    (grad,) = torch.autograd.grad((loss * seed).sum(), flat)
    return loss.detach(), grad[offset:offset + n].view(shape)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,target_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
                                                (torch.float64, torch.float64)])
@pytest.mark.parametrize("offsets", [(0, 0), (0, 4), (1, 0), (8, 8)])
@pytest.mark.parametrize("gamma,alpha", [(2.0, 0.25), (0.5, -1.0)])
def test_cuda_dense_unrolled_paths_match_cpu(dtype, target_dtype, offsets, gamma, alpha):
    # More elements than one resident wave covers in one loop step, so the unrolled loop runs several steps and
    # ends part-way through one; numel % 8 = 7 leaves an element-wise tail. Offsets (logits, targets) in elements,
    # taken on the device: (0, 4) leaves 16-bit logits aligned but their float targets off a 32-byte vector,
    # (1, 0) misaligns the logits (and the mask), (8, 8) keeps every pointer aligned from views into a buffer.
    shape = (3, 5, 301, 293)
    n = math.prod(shape)
    g = torch.Generator().manual_seed(10)
    ox, ot = offsets
    flat_x = (torch.randn(n + 8, generator=g, dtype=torch.float64) * 4).to(dtype)
    flat_t = torch.rand(n + 8, generator=g, dtype=torch.float64).to(target_dtype)
    flat_m = torch.rand(n + 8, generator=g) > 0.1
    w = torch.rand(5, generator=g, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    tol = parity_tol(dtype)
    for reduction in REDUCTIONS:
        for with_extras in (False, True):
            results = []
            for device in ("cpu", "cuda"):
                t = flat_t.to(device)[ot:ot + n].view(shape)
                weight = w.to(device) if with_extras else None
                mask = flat_m.to(device)[ox:ox + n].view(shape) if with_extras else None
                results.append(value_and_grad_of_view(sigmoid_focal_loss, flat_x.to(device), ox, shape, t, alpha,
                                                      gamma, reduction, class_weight=weight, mask=mask))
            cpu, cuda = results
            assert_close_scaled(cuda[0].cpu(), cpu[0], tol)
            assert_close_scaled(cuda[1].cpu(), cpu[1], tol)


@needs_ext
@pytest.mark.cuda
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cuda_grad_scale_written_for_every_reduction(reduction):
    # grad_scale is not pre-filled on CUDA: the kernels write 1 / count for a masked "mean" (the gradient carries
    # 1 / N otherwise), else 1. Freed blocks full of 123 before each call make a missing write visible.
    def call(op, *args):
        junk = [torch.full((64,), 123.0, device="cuda") for _ in range(8)]
        del junk
        return op(*args)[2].item()

    x = torch.randn(2, 3, 37, 5, device="cuda")
    t = torch.rand(2, 3, 37, 5, device="cuda")
    mask = torch.rand(2, 3, 37, 5, device="cuda") > 0.5
    op = torch.ops.lss.sigmoid_focal_loss
    for m in (None, mask):
        expected = 1.0 / int(m.sum()) if reduction == "mean" and m is not None else 1.0
        assert call(op, x, t, None, m, 0.25, 2.0, reduction, True) == pytest.approx(expected, rel=1e-6)
    assert call(op, x[:0], t[:0], None, None, 0.25, 2.0, reduction, True) == (0.0 if reduction == "mean" else 1.0)
    rows = torch.randn(6, 4, device="cuda")
    labels = torch.tensor([0, 1, 2, 3, -1, 0], device="cuda")
    op = torch.ops.lss.softmax_focal_loss
    assert call(op, rows, labels, None, 0.25, 2.0, reduction, True) == pytest.approx(1.0, rel=1e-6)
    assert call(op, rows.half(), labels, None, 0.25, 2.0, reduction, True) == pytest.approx(
        1.0 / 6 if reduction == "mean" else 1.0, rel=1e-6)
    assert call(op, rows[:0], labels[:0], None, 0.25, 2.0, reduction, True) == (0.0 if reduction == "mean" else 1.0)


@pytest.mark.cuda
@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0, 2.0])
@pytest.mark.parametrize("alpha", [0.25, -1.0])
def test_cuda_float32_fast_math_close_to_float64(gamma, alpha):
    # The float32 CUDA kernel uses approximate exp / log1p / reciprocals: check it over the whole logit range
    # against float64, for binary, half and soft targets.
    x = torch.linspace(-110, 110, 20001)
    soft = torch.rand(x.numel(), generator=torch.Generator().manual_seed(11))
    for t in (torch.zeros_like(x), torch.ones_like(x), torch.full_like(x, 0.5), soft):
        loss, grad = value_and_grad(sigmoid_focal_loss, x.cuda(), t.cuda(), alpha, gamma, reduction="none")
        ref_loss, ref_grad = value_and_grad(sigmoid_focal_loss_reference, x.double(), t.double(), alpha, gamma,
                                            reduction="none")
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
        for ours, ref in ((loss, ref_loss), (grad, ref_grad)):
            torch.testing.assert_close(ours.cpu().double(), ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())


def reference_grad(fn_ref, logits, *args, **kwargs):
    x = logits.detach().double().requires_grad_(True)
    (grad,) = torch.autograd.grad(fn_ref(x, *args, **kwargs), x)
    return grad


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["mean", "sum", "masked mean", "class index", "softmax"])
def test_backward_paths(device, dtype, case):
    # The backward scales the saved gradient in place when the graph is not kept (and skips that for grad_output
    # 1), out of place otherwise. Every path must give the reference gradient, and a gradient returned by one
    # backward of a retained graph must not change when a later backward uses another grad_output.
    logits, targets = dense_inputs((2, 3, 8, 9), dtype, device, soft=True)
    mask = None
    if case in ("class index", "softmax"):
        logits = logits.reshape(-1, 9)
        targets = torch.arange(logits.shape[0], device=device) % (10 if case == "class index" else 9)
    if case == "masked mean":
        mask = torch.rand(2, 1, 8, 9, generator=torch.Generator().manual_seed(12)).to(device) > 0.4
    reduction = "sum" if case == "sum" else "mean"
    if case == "softmax":
        fn, fn_ref = softmax_focal_loss, softmax_focal_loss_reference
        args = (targets, 0.25, 2.0, None, reduction)
    else:
        fn, fn_ref = (functools.partial(f, mask=mask) for f in (sigmoid_focal_loss, sigmoid_focal_loss_reference))
        args = (targets, 0.25, 2.0, reduction)
    expected = reference_grad(fn_ref, logits, *args)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # up to three roundings to 16 bits (x.grad accumulates)

    def check(grad, factor):
        assert grad.dtype == dtype
        assert_close_scaled(grad.double(), expected * factor, tol)

    x = logits.detach().clone().requires_grad_(True)
    fn(x, *args).backward()  # grad_output 1: nothing left to scale
    check(x.grad, 1.0)
    (2.0 * fn(x, *args)).backward()  # in place by 2, accumulated into x.grad
    check(x.grad, 3.0)
    loss = fn(x, *args)
    first = torch.autograd.grad(loss, x, retain_graph=True)[0]
    kept = first.clone()
    second = torch.autograd.grad(loss, x, grad_outputs=torch.tensor(4.0, dtype=dtype, device=device),
                                 retain_graph=True)[0]
    third = torch.autograd.grad(loss, x)[0]  # last use: in place
    assert torch.equal(first, kept)
    check(second, 4.0)
    assert torch.equal(third, kept)
    both = torch.autograd.grad(fn(x, *args) + 0.5 * fn(x, *args), x)[0]  # two nodes accumulate into one gradient
    check(both, 1.5)


@pytest.mark.parametrize("device", devices())
def test_float16_mean_gradient_survives_loss_scaling(device):
    # A float16 gradient divided by N before a loss scale multiplies it would sit among float16 subnormals (about
    # 1e-7 here); float16 keeps 1 / N in grad_scale instead, applied together with the loss scale.
    logits, targets = dense_inputs((4, 10, 60, 60), torch.float16, device, soft=True)
    x = logits.detach().clone().requires_grad_(True)
    loss_scale = 2.0**14
    (grad,) = torch.autograd.grad(sigmoid_focal_loss(x, targets, reduction="mean") * loss_scale, x)
    expected = reference_grad(sigmoid_focal_loss_reference, logits, targets, reduction="mean") * loss_scale
    assert_close_scaled(grad.double(), expected, 2e-3)


@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_inplace_backward_op(device, dtype):
    op = torch.ops.lss._focal_loss_backward_
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    grad = torch.randn(3, 37, dtype=dtype, device=device)
    original = grad.clone()
    for go, scale in ((1.0, 1.0), (4.0, 0.25)):
        op(grad, torch.tensor(go, dtype=dtype, device=device), torch.tensor(scale, dtype=acc, device=device))
        assert torch.equal(grad, original)
    op(grad, torch.tensor(3.0, dtype=dtype, device=device), torch.tensor(0.5, dtype=acc, device=device))
    torch.testing.assert_close(grad, (original.to(acc) * 1.5).to(dtype))
    with pytest.raises(RuntimeError, match="one element"):
        op(grad, torch.ones(2, dtype=dtype, device=device), torch.tensor(1.0, dtype=acc, device=device))
    with pytest.raises(RuntimeError, match="contiguous"):
        op(grad.t(), torch.tensor(1.0, dtype=dtype, device=device), torch.tensor(1.0, dtype=acc, device=device))


@needs_ext
@pytest.mark.parametrize("device", devices())
def test_compiled_matches_eager(device):
    logits, targets = dense_inputs((2, 3, 8, 9), torch.float32, device, soft=True)
    mask = targets > 0.2

    def fn(x):
        return (sigmoid_focal_loss(x, targets, reduction="mean", mask=mask) * 3.0
                + sigmoid_focal_loss(x, targets, reduction="sum"))

    eager = value_and_grad(fn, logits)
    compiled = value_and_grad(torch.compile(fn, backend="aot_eager", fullgraph=True), logits)
    torch.testing.assert_close(compiled[0], eager[0])
    torch.testing.assert_close(compiled[1], eager[1])


@pytest.mark.cuda
def test_cuda_graph_replay_reads_grad_output_on_device():
    # Forward + backward captured once; grad_output lives in a tensor the replays change, so whether the in-place
    # backward has anything to scale is decided on the device, with no host sync during capture.
    logits, targets = dense_inputs((2, 5, 64, 64), torch.float32, "cuda", soft=True)
    x = logits.detach().clone().requires_grad_(True)
    grad_output = torch.ones((), device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            torch.autograd.grad(sigmoid_focal_loss(x, targets, reduction="mean"), x, grad_outputs=grad_output)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (grad,) = torch.autograd.grad(sigmoid_focal_loss(x, targets, reduction="mean"), x, grad_outputs=grad_output)
    expected = reference_grad(sigmoid_focal_loss_reference, logits, targets, reduction="mean").float()
    for value in (1.0, 3.0, 1.0):
        grad_output.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert_close_scaled(grad, expected * value, 1e-5)


@needs_ext
@pytest.mark.parametrize("missing", [("_C", "_len_torch_dispatch_stack"),
                                     ("_C._autograd", "_get_current_graph_task_keep_graph")])
def test_backward_without_private_torch_functions(monkeypatch, missing):
    # Those private functions only enable the in-place backward; without them the public path gives the same result.
    import operator
    owner = operator.attrgetter(missing[0])(torch)
    if hasattr(owner, missing[1]):
        monkeypatch.delattr(owner, missing[1])
    logits, targets = dense_inputs((2, 3, 8, 9), torch.float32, "cpu", soft=True)
    expected = reference_grad(sigmoid_focal_loss_reference, logits, targets, reduction="mean")
    for factor in (1.0, 2.0):
        x = logits.detach().clone().requires_grad_(True)
        (factor * sigmoid_focal_loss(x, targets, reduction="mean")).backward()
        assert_close_scaled(x.grad.double(), expected * factor, 1e-5)
        x.grad = None
        (factor * softmax_focal_loss(x.view(-1, 9), targets.view(-1, 9).argmax(1))).backward()
        rows = reference_grad(softmax_focal_loss_reference, logits.view(-1, 9), targets.view(-1, 9).argmax(1))
        assert_close_scaled(x.grad.view(-1, 9).double(), rows * factor, 1e-5)
