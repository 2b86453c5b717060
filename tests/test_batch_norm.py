"""lss.ops.batch_norm_train (the compiled kernels) against torch.nn.functional.batch_norm and the pure-PyTorch
reference: outputs, statistics and gradients in every dtype, odd shapes, a channel whose mean dwarfs its spread,
gradcheck in float64 (float32 statistics: float32-level agreement), bad arguments; BatchNorm2d and use_lss_batch_norm against torch.nn.BatchNorm2d (running
statistics, momentum None, evaluation, state dict); CUDA kernels against the CPU ones."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lss.ops import _ext
from lss.ops.batch_norm import BatchNorm2d, batch_norm_train, batch_norm_train_reference, use_lss_batch_norm

needs_ext = pytest.mark.skipif(not _ext.has_ext(), reason="lss._C not built")
TOL = {torch.float64: 1e-6, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _inputs(shape, dtype, device="cpu", seed=0, offset=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 2.0 + 0.5
    if offset is not None:  # channel 0: a large mean against a spread of about 1
        x[:, 0] = offset + torch.randn(x[:, 0].shape, generator=g, dtype=torch.float64)
    c = shape[1]
    w = torch.rand(c, generator=g) + 0.5
    b = torch.randn(c, generator=g)
    return x.to(dtype).to(device), w.to(device), b.to(device)


def _torch(x, w, b, eps=1e-5):
    """F.batch_norm in float64 on the same values: output, mean, invstd."""
    xd = x.double()
    out = F.batch_norm(xd, None, None, w.double(), b.double(), training=True, eps=eps)
    dims = [0] + list(range(2, x.dim()))
    return out, xd.mean(dims), torch.rsqrt(xd.var(dims, unbiased=False) + eps)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(4, 3, 5, 7), (2, 5, 16, 8), (1, 2, 3), (3, 4)])
def test_forward_and_backward_match_torch(dtype, shape):
    x, w, b = _inputs(shape, dtype)
    out, mean, invstd = batch_norm_train(x, w, b)
    ref, ref_mean, ref_invstd = _torch(x, w, b)
    assert out.dtype == dtype and mean.dtype == invstd.dtype == torch.float32
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(mean.double(), ref_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(invstd.double(), ref_invstd, rtol=1e-5, atol=1e-6)
    # gradients against F.batch_norm's in float64 on the same values
    g = torch.randn(shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    xs, ws, bs = (t.detach().clone().requires_grad_() for t in (x, w, b))
    batch_norm_train(xs, ws, bs)[0].backward(g.to(dtype))
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    F.batch_norm(xd, None, None, wd, bd, training=True).backward(g)
    gtol = 10 * tol
    torch.testing.assert_close(xs.grad.double(), xd.grad, rtol=gtol, atol=gtol)
    torch.testing.assert_close(ws.grad.double(), wd.grad, rtol=gtol, atol=gtol * 10)
    torch.testing.assert_close(bs.grad.double(), bd.grad, rtol=gtol, atol=gtol * 10)


@needs_ext
def test_a_large_mean_does_not_cancel_the_variance():
    x, w, b = _inputs((8, 3, 32, 32), torch.float32, offset=1000.0)
    out, mean, invstd = batch_norm_train(x, w, b)
    ref, ref_mean, ref_invstd = _torch(x, w, b)
    torch.testing.assert_close(invstd.double(), ref_invstd, rtol=1e-4, atol=0)
    torch.testing.assert_close(out.double(), ref, rtol=1e-3, atol=1e-3)


@needs_ext
def test_reference_matches_the_kernels_and_gradcheck_in_float64():
    x, w, b = _inputs((3, 4, 5, 6), torch.float64)
    for got, want in zip(batch_norm_train(x, w.double().float(), b), batch_norm_train_reference(x, w, b)):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-6, atol=1e-6)
    xd = x.detach().requires_grad_()
    wd = w.detach().requires_grad_()
    bd = b.detach().requires_grad_()
    # the op takes float32 weight and bias: gradcheck the input in float64 through it
    assert torch.autograd.gradcheck(lambda t: batch_norm_train(t, wd, bd)[0], (xd,), eps=1e-6, atol=1e-5)


@needs_ext
def test_non_contiguous_input_is_made_contiguous():
    x, w, b = _inputs((2, 3, 6, 5), torch.float32)
    t = x.transpose(2, 3)
    torch.testing.assert_close(batch_norm_train(t, w, b)[0], batch_norm_train(t.contiguous(), w, b)[0])


@needs_ext
def test_bad_arguments_say_what_to_do():
    x, w, b = _inputs((2, 3, 4, 4), torch.float32)
    with pytest.raises(TypeError, match="floating-point tensor"):
        batch_norm_train(x.long(), w, b)
    with pytest.raises(ValueError, match=r"weight must be float32 of shape \(3,\)"):
        batch_norm_train(x, w[:2], b)
    with pytest.raises(ValueError, match=r"bias must be float32 of shape \(3,\)"):
        batch_norm_train(x, w, b.double())
    with pytest.raises(ValueError, match="at least two values per channel"):
        batch_norm_train(x[:1, :, :1, :1], w, b)
    with pytest.raises(ValueError, match="at least 2-D"):
        batch_norm_train(x.flatten()[:3], w, b)
    with pytest.raises(ValueError, match="eps must be positive"):
        batch_norm_train(x, w, b, eps=0.0)
    # the compiled op checks on its own too
    with pytest.raises(RuntimeError, match="weight must have one value per channel"):
        torch.ops.lss.batch_norm_train(x, w[:2], b, 1e-5)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        torch.ops.lss.batch_norm_train(x.transpose(2, 3), w, b, 1e-5)
    with pytest.raises(RuntimeError, match="grad_output has shape"):
        out, mean, invstd = torch.ops.lss.batch_norm_train(x, w, b, 1e-5)
        torch.ops.lss._batch_norm_train_backward(out[:1], x, w, mean, invstd)


def _pair(momentum=0.1, **kwargs):
    torch.manual_seed(0)
    ref = nn.BatchNorm2d(5, momentum=momentum, **kwargs)
    with torch.no_grad():
        if ref.affine:
            ref.weight.uniform_(0.5, 1.5)
            ref.bias.uniform_(-1, 1)
    ours = copy.deepcopy(ref)
    assert use_lss_batch_norm(nn.Sequential(ours)) == 1 and type(ours) is BatchNorm2d
    return ref, ours


@needs_ext
@pytest.mark.parametrize("momentum", [0.1, None])
def test_module_trains_and_tracks_statistics_as_torch(momentum):
    ref, ours = _pair(momentum)
    for step in range(3):
        x, _, _ = _inputs((4, 5, 6, 7), torch.float32, seed=step)
        xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
        yr, yo = ref(xr), ours(xo)
        torch.testing.assert_close(yo, yr, rtol=1e-5, atol=1e-5)
        g = torch.randn_like(x)
        yr.backward(g)
        yo.backward(g)
        torch.testing.assert_close(xo.grad, xr.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-4)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(ours, name), getattr(ref, name), rtol=1e-5, atol=1e-6)
    assert ours.state_dict().keys() == ref.state_dict().keys()
    ref.eval(), ours.eval()
    x, _, _ = _inputs((2, 5, 3, 3), torch.float32, seed=9)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)


@needs_ext
def test_module_falls_back_to_torch_where_the_kernels_do_not_apply():
    ref, ours = _pair(affine=False)
    x, _, _ = _inputs((2, 5, 4, 4), torch.float32)
    torch.testing.assert_close(ours(x), ref(x))
    ref, ours = _pair()
    cl = x.contiguous(memory_format=torch.channels_last)  # channels-last: torch's own kernels
    torch.testing.assert_close(ours(cl), ref(cl), rtol=1e-5, atol=1e-5)


def test_use_lss_batch_norm_converts_only_plain_batch_norms():
    class Custom(nn.BatchNorm2d):
        pass

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), Custom(4), nn.BatchNorm1d(4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert use_lss_batch_norm(model) == 1
    assert type(model[1]) is BatchNorm2d and type(model[2]) is Custom and type(model[3]) is nn.BatchNorm1d
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(24, 32, 128, 352), (4, 7, 9, 11), (24, 1152, 8, 22), (2, 3, 5)])
def test_cuda_kernels_match_the_cpu_kernels(dtype, shape):
    x, w, b = _inputs(shape, dtype, offset=50.0)
    cpu = batch_norm_train(x, w, b)
    gpu = batch_norm_train(x.cuda(), w.cuda(), b.cuda())
    tol = TOL[dtype]
    torch.testing.assert_close(gpu[0].cpu().double(), cpu[0].double(), rtol=tol, atol=tol)
    torch.testing.assert_close(gpu[1].cpu(), cpu[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gpu[2].cpu(), cpu[2], rtol=1e-4, atol=1e-6)
    g = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    grads_cpu = torch.ops.lss._batch_norm_train_backward(g, x, w, cpu[1], cpu[2])
    grads_gpu = torch.ops.lss._batch_norm_train_backward(g.cuda(), x.cuda(), w.cuda(), cpu[1].cuda(),
                                                         cpu[2].cuda())
    torch.testing.assert_close(grads_gpu[0].cpu().double(), grads_cpu[0].double(), rtol=10 * tol, atol=10 * tol)
    for got, want in zip(grads_gpu[1:], grads_cpu[1:]):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-3, atol=1e-3 * shape[0] * x[0, 0].numel() ** 0.5)


@pytest.mark.cuda
def test_cuda_module_in_a_captured_graph_follows_torch():
    ref, ours = _pair()
    ref, ours = ref.cuda(), ours.cuda()
    x = torch.randn(8, 5, 16, 16, device="cuda", dtype=torch.bfloat16)
    static = x.clone()
    for m in (ref, ours):
        m(static)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ours(static)
    static.copy_(x)
    graph.replay()
    torch.testing.assert_close(out.float(), ref(x).float(), rtol=2e-2, atol=2e-2)


@needs_ext
def test_model_batch_norm_lss_trains_as_the_torch_model():
    """model.batch_norm: lss builds the same model (same state dict) whose training forward gives the same loss
    and running statistics, and whose camera encoder gets the same gradients, as with PyTorch's batch norm. (The
    whole tiny model's gradients are not compared: at these sizes the sparse BEV grid makes them differ between
    float32 and float64 by more than their own size, for PyTorch's batch norm as for lss's.)"""
    from test_model import rig_batch, tiny_cfg

    from lss.models.build import build_model
    from lss.models.losses import TotalLoss

    losses, states, grads = [], [], []
    for setting in ("torch", "lss"):
        cfg = tiny_cfg(f"model.batch_norm={setting}")
        torch.manual_seed(0)
        model = build_model(cfg).train()
        kinds = {type(m) for m in model.modules() if isinstance(m, nn.BatchNorm2d)}
        assert kinds == ({BatchNorm2d} if setting == "lss" else {nn.BatchNorm2d})
        batch = rig_batch(cfg)
        with torch.no_grad():
            losses.append(TotalLoss(cfg)(model(batch), batch)["loss"])
        states.append(model.state_dict())
        images = batch["images"].flatten(0, 1)
        depth, context = model.camera(images)
        g = torch.Generator().manual_seed(1)
        loss = (depth * torch.randn(depth.shape, generator=g)).sum() + (context * torch.randn(context.shape,
                                                                                          generator=g)).sum()
        loss.backward()
        grads.append({k: p.grad.clone() for k, p in model.camera.named_parameters() if p.grad is not None})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    assert states[0].keys() == states[1].keys()
    for k in states[0]:
        if k.endswith(("running_mean", "running_var")):
            torch.testing.assert_close(states[1][k], states[0][k], rtol=1e-4, atol=1e-5, msg=k)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    # gradients that are zero in exact arithmetic (a batch norm's bias before a convolution and another batch norm)
    # hold only rounding noise: the tolerance is relative to each tensor's size or to a thousandth of the largest
    floor = 1e-3 * max(float(g.abs().max()) for g in grads[0].values())
    for k in grads[0]:
        scale = max(float(grads[0][k].abs().max()), floor)
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=0, atol=1e-3 * scale, msg=k)


def test_config_refuses_an_unknown_batch_norm():
    from lss.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match="model.batch_norm"):
        config_from_dict({"model": {"batch_norm": "cudnn"}})


def test_bench_suite_times_both_implementations_quick():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import BenchContext, available_suites
    from benchmarks import batch_norm as suite

    assert "batch_norm" in available_suites()
    rows = suite.run(BenchContext(torch.device("cpu"), quick=True))
    assert len(rows) == 2 * 2 * 2  # shapes x dtypes x implementations
    assert {r["impl"] for r in rows} == {"lss", "F.batch_norm"} and all(r["ms"] > 0 for r in rows)
    suite.smoke("cpu")


@needs_ext
def test_compiles_through_the_fake_kernels_and_the_autograd_formula():
    """torch.compile (aot_eager: the graph capture, the fake kernels and the registered backward, without codegen) of
    a convolution + BatchNorm2d gives the eager module's output and gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU())
    use_lss_batch_norm(model)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 3, 8, 8)
    for m in (eager, compiled):
        m(x).square().sum().backward()
    torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(model[1].running_mean, eager[1].running_mean)


@needs_ext
def test_the_training_step_on_static_buffers_follows_the_eager_steps():
    """model.batch_norm: lss through the engine's graphed step (on the CPU: its static buffers, the warm-up steps
    undone, running statistics included) gives the eager steps' losses and parameters exactly."""
    from test_graph_step import _run_both
    from test_model import tiny_cfg

    cfg = tiny_cfg("model.batch_norm=lss")
    eager, graphed, pa, pb, step = _run_both(cfg, "cpu", 3, False, None)
    assert eager == graphed
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    assert any(type(m) is BatchNorm2d for m in step.model.modules())
    buffers = dict(step.model.named_buffers())
    assert int(buffers[next(k for k in buffers if k.endswith("num_batches_tracked"))]) == 3


@pytest.mark.cuda
def test_the_captured_training_step_follows_the_eager_trajectory_on_cuda():
    from test_graph_step import _run_both, assert_follows_eager
    from test_model import tiny_cfg

    eager, graphed, pa, pb, step = _run_both(tiny_cfg("model.batch_norm=lss"), "cuda", 4, True, torch.bfloat16)
    assert step.graph is not None
    assert_follows_eager(eager, graphed, pa, pb)
