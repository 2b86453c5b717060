"""The eager step with its camera trunk and BEV encoder as CUDA graphs (lss.engine.step.partial):
the factory picks it for eager steps on one CUDA process (not under torchrun) and says so in the
run's first line; it follows the plain eager step's losses, gradients and BatchNorm statistics with
gradient accumulation and for a batch of another shape; a capture that fails leaves plain eager steps and one line
that says why. CPU tests stand in for make_graphed_callables with `emulated_make_graphed` (its
contract without graphs: warm-up passes, static buffers that every call reuses); the cuda-marked
ones capture."""

import contextlib

import pytest
import torch
from torch import nn

from lss.engine.optim import build_optimizer, build_scheduler
from lss.models.build import apply_channels_last
from lss.engine.distributed import DistInfo
from lss.engine.step import EagerStep, StepChoice, StepParts, build_step, choose_step
from lss.engine.step.partial import EncoderGraphs, encoder_graph_problems
from lss.models import LiftSplatShoot
from lss.models.losses import TotalLoss
from test_model import rig_batch, tiny_cfg

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
ONE, TWO = DistInfo(), DistInfo(rank=0, world_size=2)


# ------------------------------------------------------------------------ a stand-in for the GPU
def emulated_make_graphed(
    modules, sample_args, num_warmup_iters=3, allow_unused_input=False, **options
):
    """torch.cuda.make_graphed_callables's contract on any device, without graphs: warm-up passes
    (they move BatchNorm statistics and the RNG), one static buffer per input, output and gradient
    that every call overwrites (autograd adopts the returned parameter gradients as .grad), the
    module's forward replaced on the instance, its plain forward where the training mode differs."""
    if torch.is_autocast_enabled() and torch.is_autocast_cache_enabled():
        raise RuntimeError("make_graphed_callables does not support the autocast caching")
    for module, (sample,) in zip(modules, sample_args):
        for _ in range(num_warmup_iters):
            module(sample)
        module.forward = _emulated_forward(module, sample)
    return modules


def _emulated_forward(module, static_input):
    plain, training, params = module.forward, module.training, tuple(module.parameters())
    single = torch.is_tensor(plain(static_input.detach()))
    static, graph = {}, {}

    class Replay(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, *weights):
            static_input.copy_(x)
            with torch.enable_grad():
                leaf = static_input.detach().requires_grad_(static_input.requires_grad)
                outs = plain(leaf)
            outs = (outs,) if single else tuple(outs)
            graph.update(leaf=leaf, outs=outs)
            static.setdefault("outs", [torch.empty_like(o) for o in outs])
            for buffer, o in zip(static["outs"], outs):
                buffer.copy_(o)
            return tuple(buffer.detach() for buffer in static["outs"])

        @staticmethod
        def backward(ctx, *grads):
            leaf = graph["leaf"]
            wanted = [leaf] * leaf.requires_grad + [p for p in params if p.requires_grad]
            got = torch.autograd.grad(graph["outs"], wanted, grads, allow_unused=True)
            static.setdefault("grads", [torch.empty_like(t) for t in wanted])
            for buffer, g in zip(static["grads"], got):
                buffer.copy_(g if g is not None else torch.zeros_like(buffer))
            returned = iter(buffer.detach() for buffer in static["grads"])
            head = [next(returned) if leaf.requires_grad else None]
            return tuple(head + [next(returned) if p.requires_grad else None for p in params])

    def forward(x):
        if module.training != training:
            return plain(x)
        assert x.shape == static_input.shape, "a graph replays the shapes it captured"
        outs = Replay.apply(x, *params)
        return outs[0] if single else outs

    return forward


def failing_make_graphed(modules, sample_args, **options):
    raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore detail")


# ------------------------------------------------------------------------------------ helpers
def parts_for(cfg, model, device, amp_dtype=None, net=None, sgd_lr=None):
    if sgd_lr is None:
        optimizer = build_optimizer(cfg, model)
        scheduler = build_scheduler(cfg, optimizer)
    else:  # plain SGD at a constant rate: an update proportional to the gradient
        optimizer = torch.optim.SGD(model.parameters(), lr=sgd_lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)

    def autocast():
        if amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=amp_dtype)

    return StepParts(
        model,
        TotalLoss(cfg).to(device),
        optimizer,
        scheduler,
        # a low first scale: the tiny model's fp16 gradients overflow at the default one
        torch.amp.GradScaler(device.type, 2.0**8, enabled=amp_dtype == torch.float16),
        amp_dtype,
        autocast,
        cfg.optim.grad_clip,
        device,
        ONE,
        net,
    )


def run(step, steps):
    """Each step's logs and the gradients the optimizer saw, then the model's state."""
    parts, seen = step.parts, []
    parts.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append(
            [p.grad.detach().clone() for p in parts.model.parameters()]
        )
    )
    logs = [step.run_step(micro, i) for i, micro in enumerate(steps, 1)]
    state = {k: v.detach().clone() for k, v in parts.model.state_dict().items()}
    return [dict(x) for x in logs], seen, state


def micro_batches(cfg, count, accum=2, batch_size=2):
    """`count` steps of `accum` micro-batches each."""
    return [
        [rig_batch(cfg, batch_size, seed=10 * s + m) for m in range(accum)] for s in range(count)
    ]


def fresh_model(cfg, device):
    torch.manual_seed(0)
    model = LiftSplatShoot(cfg).to(device)
    for m in model.modules():  # no drop-connect: a graph's random draws differ from eager ones
        if hasattr(m, "_global_params"):
            m._global_params = m._global_params._replace(drop_connect_rate=0.0)
    return apply_channels_last(model, cfg.train.channels_last).train()


def plain_and_graphed(cfg, device, steps, make_graphed, amp_dtype=None, sgd_lr=None):
    plain = EagerStep(parts_for(cfg, fresh_model(cfg, device), device, amp_dtype, sgd_lr=sgd_lr))
    torch.manual_seed(1)  # the same RNG stream (drop-connect) for both
    plain = run(plain, steps)
    model = fresh_model(cfg, device)
    graphs = EncoderGraphs(model, make_graphed)
    step = EagerStep(parts_for(cfg, model, device, amp_dtype, sgd_lr=sgd_lr), graphs)
    torch.manual_seed(1)
    return plain, run(step, steps), step


def no_instance_forward(model):
    return all("forward" not in m.__dict__ for m in (model.camera.trunk, model.bev))


# ---------------------------------------------------------------------------- the factory's rule
def test_eager_steps_graph_their_encoders_on_one_cuda_process_and_the_first_line_says_so():
    on = "train.eager_encoder_graphs=true"  # the default
    choice = choose_step(tiny_cfg("train.cuda_graph=auto", "train.grad_accum=2", on), CUDA, ONE)
    assert choice.kind == "eager" and choice.encoder_graphs
    assert choice.describe() == (
        "eager steps (train.cuda_graph: auto: it needs train.grad_accum: 1 (got 2)), the camera "
        "trunk and the BEV encoder as CUDA graphs"
    )
    assert choose_step(tiny_cfg("train.cuda_graph=auto", "train.grad_accum=2"), CUDA, ONE) == choice
    off = "train.eager_encoder_graphs=false"
    off = choose_step(tiny_cfg("train.cuda_graph=auto", "train.grad_accum=2", off), CUDA, ONE)
    assert not off.encoder_graphs and "CUDA graphs" not in off.describe()
    ddp = choose_step(tiny_cfg("train.cuda_graph=false", on), CUDA, TWO)
    assert not ddp.encoder_graphs and "CUDA graphs" not in ddp.describe()
    cpu = choose_step(tiny_cfg("train.cuda_graph=auto", on), CPU, ONE)
    assert not cpu.encoder_graphs and "CUDA graphs" not in cpu.describe()
    compiled = tiny_cfg(
        "train.cuda_graph=false", "train.compile=true", "train.compile_start=now", on
    )
    assert not choose_step(compiled, CUDA, ONE).encoder_graphs
    assert not choose_step(tiny_cfg("train.cuda_graph=auto", on), CUDA, ONE).encoder_graphs


def test_encoder_graph_problems_name_the_device_the_compiler_and_torchrun():
    assert encoder_graph_problems(CUDA, "off") == []
    assert encoder_graph_problems(CUDA, "off", distributed=True) == [
        "not under torchrun: capturing them inside DistributedDataParallel fails"
    ]
    assert encoder_graph_problems(CPU, "off") == [
        "CUDA graphs need a CUDA device (training runs on cpu)"
    ]
    assert encoder_graph_problems(CUDA, "now") == ["train.compile compiles the encoders instead"]
    assert encoder_graph_problems(CUDA, "background") == [
        "train.compile compiles the encoders instead"
    ]


def test_the_capture_is_thread_local_on_torch_with_and_without_the_keyword(monkeypatch):
    """Where make_graphed_callables takes capture_error_mode it gets "thread_local"; where it does not
    (torch 2.11), torch.cuda.graph, which it calls, defaults to it during the capture and is put back
    after."""
    import torch.cuda.graphs as cuda_graphs

    from lss.engine.step import partial

    class Graph:  # stands in for torch.cuda.graph: records its keywords
        def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
            self.mode = capture_error_mode

    def old_make_graphed(callables, sample_args, num_warmup_iters=3, allow_unused_input=False):
        return torch.cuda.graph(None).mode, cuda_graphs.graph(None, capture_error_mode="global").mode

    monkeypatch.setattr(torch.cuda, "graph", Graph)
    monkeypatch.setattr(cuda_graphs, "graph", Graph)
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", old_make_graphed)
    with partial._thread_local_capture() as keywords:
        assert keywords == {}
        assert old_make_graphed(None, None) == ("thread_local", "global")  # an explicit mode stays
    assert torch.cuda.graph is Graph and cuda_graphs.graph is Graph

    def new_make_graphed(callables, sample_args, capture_error_mode="global"):
        return capture_error_mode

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", new_make_graphed)
    with partial._thread_local_capture() as keywords:
        assert keywords == {"capture_error_mode": "thread_local"} and torch.cuda.graph is Graph


def test_build_step_gives_the_eager_step_its_encoder_graphs_only_where_chosen():
    cfg = tiny_cfg()
    parts = parts_for(cfg, fresh_model(cfg, CPU), CPU)
    with_graphs = build_step(cfg, StepChoice("eager", encoder_graphs=True), parts)
    assert isinstance(with_graphs.graphs, EncoderGraphs) and with_graphs.graphs.problem is None
    assert build_step(cfg, StepChoice("eager"), parts).graphs is None


# ------------------------------------------------------------- the step, with the stand-in (CPU)
def test_graphed_encoders_follow_the_plain_step_with_gradient_accumulation():
    cfg = tiny_cfg()
    steps = micro_batches(cfg, 3) + [[rig_batch(cfg, 1, seed=99)] * 2]  # last: another batch size
    (logs_a, grads_a, state_a), (logs_b, grads_b, state_b), step = plain_and_graphed(
        cfg, CPU, steps, emulated_make_graphed
    )
    assert step.graphs.captured and step.graphs.problem is None
    assert set(step.setup_seconds) == {"encoder_capture"}
    assert logs_a == logs_b
    for a, b in zip(grads_a, grads_b):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    # the warm-up passes' BatchNorm statistics were undone; the replays' own updates kept
    assert state_a.keys() == state_b.keys()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a), "state differs"
    assert no_instance_forward(step.parts.model)  # outside the step: the modules' plain forward


def test_without_zero_gradients_an_accumulating_step_would_lose_a_micro_batch(monkeypatch):
    """The graph's gradient buffers become .grad: the second micro-batch's replay overwrites the
    first's gradients unless the parameters had gradients to add to (EncoderGraphs.keep_grads)."""
    cfg = tiny_cfg()
    steps = micro_batches(cfg, 3)
    monkeypatch.setattr(EncoderGraphs, "keep_grads", lambda self: None)
    (_, grads_a, _), (_, grads_b, _), step = plain_and_graphed(
        cfg, CPU, steps, emulated_make_graphed
    )
    trunk = {id(p) for p in step.parts.model.camera.trunk.parameters()}
    index = next(i for i, p in enumerate(step.parts.model.parameters()) if id(p) in trunk)
    assert torch.equal(grads_a[0][index], grads_b[0][index])  # the first step recorded, eagerly
    assert not torch.allclose(grads_a[1][index], grads_b[1][index])


def test_a_failed_capture_leaves_plain_eager_steps_and_one_line(capsys):
    cfg = tiny_cfg()
    steps = micro_batches(cfg, 3)
    (logs_a, grads_a, state_a), (logs_b, grads_b, state_b), step = plain_and_graphed(
        cfg, CPU, steps, failing_make_graphed
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "lss: eager steps without CUDA graphs of the camera trunk and the BEV encoder: capture "
        "failed: RuntimeError: CUDA error: operation not permitted when stream is capturing"
    ]
    assert not step.graphs.captured and step.setup_seconds == {}
    assert logs_a == logs_b and all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert no_instance_forward(step.parts.model)


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 1, 1)

    def forward(self, batch):
        return {"out": self.conv(batch["x"])}


class SquaredError(nn.Module):
    def forward(self, outputs, batch):
        return {"loss": (outputs["out"] - batch["y"]).pow(2).mean()}


def test_a_model_without_the_encoders_trains_plain_eager_and_says_why(capsys):
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    parts = StepParts(
        model,
        SquaredError(),
        optimizer,
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
        torch.amp.GradScaler("cpu", enabled=False),
        None,
        contextlib.nullcontext,
        0.0,
        CPU,
        ONE,
    )
    step = EagerStep(parts, EncoderGraphs(model, emulated_make_graphed))
    assert capsys.readouterr().err.strip() == (
        "lss: eager steps without CUDA graphs of the camera trunk and the BEV encoder: Regressor "
        "has no camera trunk and no BEV encoder (.camera.trunk, .bev)"
    )
    batch = {"x": torch.ones(2, 3, 4, 4), "y": torch.zeros(2, 1, 4, 4)}
    first = step.run_step([batch], 1)["loss"]
    assert step.run_step([batch], 2)["loss"] < first  # it trains
    assert step.setup_seconds == {} and capsys.readouterr().err == ""


# ----------------------------------------------------------------------------- on the GPU
@contextlib.contextmanager
def full_float32():
    """No TF32 and deterministic cuDNN kernels: the plain and the graphed steps then compute the
    same numbers (nondeterministic weight-gradient kernels differ in their last bits, which Adam's
    first steps, normalised by the gradients' own size, blow up for near-zero gradients)."""
    b = torch.backends
    saved = b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32, b.cudnn.deterministic, b.cudnn.benchmark
    b.cudnn.allow_tf32 = b.cuda.matmul.allow_tf32 = b.cudnn.benchmark = False
    b.cudnn.deterministic = True
    try:
        yield
    finally:
        b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32, b.cudnn.deterministic, b.cudnn.benchmark = saved


def assert_same_run(plain, graphed, tol, floor=0.0):
    """Losses, grad norms and every step's gradients (relative to each tensor's norm, or to
    `floor` times the step's whole gradient norm where that is larger) agree; a step that fp16
    overflowed (GradScaler skips it) overflows in both."""
    (logs_a, grads_a, state_a), (logs_b, grads_b, state_b) = plain, graphed
    assert len(logs_a) == len(logs_b) and len(grads_a) == len(grads_b)
    for a, b in zip(logs_a, logs_b):
        assert a.keys() == b.keys()
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=tol, abs=1e-6, nan_ok=True), (k, logs_a, logs_b)
    for step_a, step_b in zip(grads_a, grads_b):
        finite = [bool(torch.isfinite(x).all()) for x in step_a]
        assert finite == [bool(torch.isfinite(y).all()) for y in step_b]
        whole = float(torch.stack([x.norm() for x, ok in zip(step_a, finite) if ok]).norm())
        for x, y in zip(step_a, step_b):
            if bool(torch.isfinite(x).all()):
                scale = max(float(x.norm()), floor * whole)
                assert float((x - y).norm()) <= tol * scale + 1e-7
    for k in state_a:
        if state_a[k].is_floating_point():
            diff = float((state_a[k] - state_b[k]).norm())
            assert diff <= tol * float(state_a[k].norm()) + 1e-6, k


@pytest.mark.cuda
@pytest.mark.parametrize(
    "amp, tol, sgd_lr", [(None, 1e-3, None), (torch.float16, 5e-2, 1e-2), (torch.bfloat16, 5e-2, 0.0)]
)
def test_captured_encoders_follow_the_plain_eager_step_on_cuda(amp, tol, sgd_lr):
    """fp32: the recipe's Adam; fp16: plain SGD (both bit for bit on an H100). bf16: the same
    parameters at every step (SGD at rate 0), so each step's loss and gradients are compared
    from the same weights. The bf16 graph replays round differently from eager kernels in the
    last bits: the grad norm agrees to about 4 digits, but the trunk's BatchNorm biases, whose
    gradients nearly cancel (norms near 1e-4 of a whole norm near 6), differ by their own size,
    so in bf16 each tensor is compared at no less than 1e-2 of the step's whole gradient norm.
    On this tiny model an update lets such differences grow to several percent within two steps."""
    cfg = tiny_cfg("train.channels_last=true")
    steps = micro_batches(cfg, 4) + [[rig_batch(cfg, 1, seed=99)] * 2]  # last: another batch size
    with full_float32():
        plain, graphed, step = plain_and_graphed(
            cfg, CUDA, steps, torch.cuda.make_graphed_callables, amp, sgd_lr
        )
    assert step.graphs.captured, step.graphs.problem
    assert step.setup_seconds["encoder_capture"] > 0
    assert_same_run(plain, graphed, tol, floor=1e-2 if amp == torch.bfloat16 else 0.0)
    assert no_instance_forward(step.parts.model)

