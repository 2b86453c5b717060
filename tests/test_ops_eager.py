"""Eager-call cost of the ops: autograd registered in C++ (no Python autograd node, as torchvision's ops) and, on
CUDA, no host sync in a default forward + backward."""
import pytest
import torch

import lss.ops
from conftest import devices
from test_ops_fx import small_lut

needs_ext = pytest.mark.skipif(not lss.ops.has_ext(), reason="lss._C not built")


def calls(device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, 8, generator=g).to(device).requires_grad_(True)
    rois = torch.tensor([[0, 1.0, 1.0, 5.0, 6.0], [1, 0.0, 2.0, 7.0, 7.0]], device=device)
    lut = small_lut().to(device)
    depth = torch.rand(1, 2, 3, 4, 5, generator=g).to(device).requires_grad_(True)
    feat = torch.randn(1, 2, 6, 4, 5, generator=g).to(device).requires_grad_(True)
    return {
        "roi_align": (lambda: lss.ops.roi_align(x, rois, 2, 1.0, 2, True), (x,)),
        "roi_align max": (lambda: lss.ops.roi_align(x, rois, 2, 1.0, 2, True, "max"), (x,)),
        "roi_pool": (lambda: lss.ops.roi_pool(x, rois, 2, 1.0), (x,)),
        "bev_pool": (lambda: lss.ops.bev_pool(depth, feat, lut), (depth, feat)),
    }


@needs_ext
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("name", ["roi_align", "roi_align max", "roi_pool", "bev_pool"])
def test_autograd_is_registered_in_cpp(device, name):
    fn, inputs = calls(device)[name]
    out = fn()
    assert out.grad_fn.name().startswith("torch::autograd::CppNode"), out.grad_fn.name()
    grads = torch.autograd.grad(out, inputs, torch.ones_like(out))
    assert all(g.shape == t.shape for g, t in zip(grads, inputs))


@needs_ext
def test_bev_pool_gradient_only_for_inputs_that_need_it():
    fn, (depth, feat) = calls("cpu")["bev_pool"]
    feat.requires_grad_(False)
    out = fn()
    (grad_depth,) = torch.autograd.grad(out, depth, torch.ones_like(out))
    assert grad_depth.shape == depth.shape and feat.grad is None


@needs_ext
@pytest.mark.parametrize("name", ["roi_align", "roi_align max", "roi_pool"])
def test_backward_fills_no_zero_gradients_for_argmax_or_the_bad_roi_record(name):
    # The forward's argmax and bad-roi record are not differentiable: autograd must not build zero gradients for
    # them (a fill of the argmax's size, 100 MB at the FPN benchmark case, per backward); only grad_input is zeroed.
    from torch.profiler import ProfilerActivity, profile

    fn, (x,) = calls("cpu")[name]
    out = fn()
    grad_out = torch.ones_like(out)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        (grad,) = torch.autograd.grad(out, x, grad_out)
    zeroed = [e.input_shapes[0] for e in prof.events() if e.name == "aten::zero_"]
    assert zeroed and all(shape == list(x.shape) for shape in zeroed), zeroed
    assert grad.shape == x.shape


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["roi_align", "roi_align max", "roi_pool", "bev_pool"])
def test_cuda_default_forward_backward_has_no_host_sync(name):
    fn, inputs = calls("cuda")[name]
    out = fn()  # loads the kernels
    torch.autograd.grad(out, inputs, torch.ones_like(out))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fn()
        torch.autograd.grad(out, inputs, torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_ext
@pytest.mark.parametrize("name", ["roi_align", "roi_align max", "roi_pool", "bev_pool"])
def test_compiled_forward_backward_matches_eager(name):
    # The C++ autograd runs under AOTAutograd on the ops' fake kernels, as torchvision's ops do.
    torch._dynamo.reset()
    fn, inputs = calls("cpu")[name]

    def loss():
        return (fn() ** 2).sum()

    want = torch.autograd.grad(loss(), inputs)
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(), inputs)  # the backward graph AOTAutograd traced through the C++ autograd
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@needs_ext
def test_host_overhead_script_times_every_op_against_torchvision():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "host_overhead.py"
    out = subprocess.run([sys.executable, str(script), "--calls", "20", "--rounds", "2"], capture_output=True, text=True,
                         check=True).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "call" not in line]
    assert [r[0].strip() for r in rows] == ["roi_pool fwd", "roi_pool fwd+bwd", "roi_align fwd", "roi_align fwd+bwd",
                                            "nms", "batched_nms"]
    assert all(float(v) > 0 for r in rows for v in r[1:])
