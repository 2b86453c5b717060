"""The captured step under torchrun (lss.engine.step.ddp): the split step (forward + backward, one
all-reduce of the flat gradient buffers, clip + update) in 2 gloo processes follows one process's
eager steps on the global batch; BatchNorm statistics are averaged over the processes; the factory
picks it under torchrun on CUDA and says why not elsewhere; a rank that dies ends the others' run
with a message instead of a hang. CPU tests run the split step without graphs (capture=False); the
cuda-marked ones capture it (the two-process one needs 2 GPUs)."""

import contextlib
import math
import os
import signal
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from lss.config import ConfigError
from lss.engine.distributed import DistInfo
from lss.engine.step import (
    CapturedDDPStep,
    EagerStep,
    GraphedTrainStep,
    StepChoice,
    StepParts,
    build_step,
    choose_step,
)
from lss.engine.step.ddp import DistributedGraphedStep
from lss.engine.step.grad_buckets import GradientBuckets, batchnorm_statistics
from lss.errors import ProcessGroupError
from test_model import rig_batch, tiny_cfg

ONE, TWO = DistInfo(), DistInfo(rank=0, world_size=2)
CUDA = torch.device("cuda", 0)
STEPS, GLOBAL_BATCH = 4, 8


# --------------------------------------------------------------------------------- model and data
class Regressor(nn.Module):
    """Per-sample layers only (GroupNorm, no BatchNorm): the mean of two half batches' gradients is
    the full batch's gradient. `unused` gets no gradient, so the optimizer must leave it alone."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.head = nn.Conv2d(8, 2, 1)
        self.unused = nn.Linear(3, 3)

    def forward(self, batch):
        return {"out": self.head(torch.relu(self.norm(self.conv(batch["x"]))))}


class Normalized(nn.Module):
    """BatchNorm on the input itself: its running statistics follow from the data alone."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(3)
        self.head = nn.Conv2d(3, 2, 1)

    def forward(self, batch):
        return {"out": self.head(self.bn(batch["x"]))}


class TwoTermLoss(nn.Module):
    def forward(self, outputs, batch):
        err = outputs["out"] - batch["y"]
        a, b = err[:, 0].pow(2).mean(), err[:, 1].abs().mean()
        return {"loss": a + b, "loss/a": a.detach(), "loss/b": b.detach()}


def global_batches(device="cpu"):
    g = torch.Generator().manual_seed(7)
    return [
        {
            "x": torch.randn(GLOBAL_BATCH, 3, 6, 6, generator=g).to(device),
            "y": torch.randn(GLOBAL_BATCH, 2, 6, 6, generator=g).to(device),
        }
        for _ in range(STEPS)
    ]


def shard(batch, rank, world_size):
    per = GLOBAL_BATCH // world_size
    return {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}


def make_parts(model, optimizer, dist_info, device, clip):
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
        if optimizer == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = torch.amp.GradScaler(device.type, enabled=False)
    return StepParts(
        model,
        TwoTermLoss(),
        opt,
        scheduler,
        scaler,
        None,
        contextlib.nullcontext,
        clip,
        device,
        dist_info,
    )


def record(step, batches, model):
    """Loss terms and grad_norm of every step, then the parameters."""
    rows = []
    for i, batch in enumerate(batches, 1):
        logs = step.run_step([batch], i)
        rows.append({k: logs[k] for k in ("loss", "loss/a", "loss/b", "grad_norm")})
    step.check()
    return rows, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


@contextlib.contextmanager
def full_float32():
    """No TF32 in convolutions and matrix products: a half batch against the full one then differs
    in float32 rounding only, as on the CPU."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def reference(optimizer, clip, device="cpu"):
    """One process, eager steps (autograd's gradients, clip_grad_norm_) on the global batches, from
    the weights rank 0 builds."""
    torch.manual_seed(100)
    model = Regressor().to(device)
    parts = make_parts(model, optimizer, ONE, torch.device(device), clip)
    with full_float32():
        return record(EagerStep(parts), global_batches(device), model)


# ------------------------------------------------------------------------------ two processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_torchrun_rank(rank, world_size, port):
    """This process's environment as torchrun sets it for `rank` (one thread: 2 CPU cores)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)


def join_group(rank, world_size, port, backend):
    as_torchrun_rank(rank, world_size, port)
    torch.distributed.init_process_group(backend, rank=rank, world_size=world_size)
    return DistInfo(rank, world_size, rank)


def _split_step_worker(rank, world_size, port, device_type, out):
    """Each case of the split step in this process: weights seeded per rank (broadcast must fix
    that), this rank's half of every global batch."""
    cuda = device_type == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist_info = join_group(rank, world_size, port, "nccl" if cuda else "gloo")
    with full_float32():
        results = split_step_cases(rank, world_size, device, dist_info, cuda)
    torch.save(results, f"{out}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


def split_step_cases(rank, world_size, device, dist_info, cuda):
    results = {}
    cases = [("adamw", 0.5)] if cuda else [("sgd", 0.5), ("adamw", 0.5), ("adamw", 0.0)]
    for optimizer, clip in cases:
        torch.manual_seed(100 + rank)
        model = Regressor().to(device)
        parts = make_parts(model, optimizer, dist_info, device, clip)
        step = CapturedDDPStep(parts, capture=cuda)
        batches = [shard(b, rank, world_size) for b in global_batches(device)]
        results[(optimizer, clip)] = record(step, batches, model)
    torch.manual_seed(100 + rank)
    model = Normalized().to(device)
    step = CapturedDDPStep(make_parts(model, "adamw", dist_info, device, 0.0), capture=cuda)
    step.run_step([shard(global_batches(device)[0], rank, world_size)], 1)
    step.check()
    results["bn"] = {k: v.cpu() for k, v in model.bn.state_dict().items()}
    return results


def run_two_processes(tmp_path, device_type):
    mp.spawn(_split_step_worker, args=(2, free_port(), device_type, str(tmp_path)), nprocs=2)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


def check_against_one_process(ranks, device_type, tol):
    for case in [k for k in ranks[0] if k != "bn"]:
        (rows0, params0), (rows1, params1) = ranks[0][case], ranks[1][case]
        assert rows0 == rows1  # every rank logs the global batch's means
        assert all(torch.equal(params0[k], params1[k]) for k in params0)  # the same update
        ref_rows, ref_params = reference(*case, device=device_type)
        for got, want in zip(rows0, ref_rows):
            for key in want:
                assert math.isclose(got[key], want[key], rel_tol=tol, abs_tol=tol), (case, key)
        for k in ref_params:
            torch.testing.assert_close(params0[k], ref_params[k], rtol=tol, atol=tol, msg=k)
        # no gradient, no update (AdamW's weight decay and SGD's would move it)
        torch.manual_seed(100)
        initial = Regressor().state_dict()
        assert torch.equal(params0["unused.weight"], initial["unused.weight"])


def check_statistics(ranks):
    """After one step both processes hold the running statistics of the global batch: 0.9 of the
    initial ones plus 0.1 of the mean of each half's batch statistics."""
    x = global_batches()[0]["x"]
    halves = [shard({"x": x}, r, 2)["x"] for r in range(2)]
    mean = sum(h.mean(dim=(0, 2, 3)) for h in halves) / 2
    var = sum(h.transpose(0, 1).flatten(1).var(dim=1) for h in halves) / 2  # unbiased, as BN keeps
    for stats in ranks:
        torch.testing.assert_close(stats["running_mean"], 0.1 * mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(stats["running_var"], 0.9 + 0.1 * var, rtol=1e-5, atol=1e-6)
    alone = 0.1 * halves[0].mean(dim=(0, 2, 3))
    assert not torch.allclose(ranks[0]["running_mean"], alone, atol=1e-4)


@pytest.mark.slow
def test_two_gloo_processes_follow_one_process_on_the_global_batch(tmp_path):
    """Loss terms, grad_norm and parameters after 4 steps against one process's eager steps on the
    full batch (SGD with momentum, AdamW, with and without clipping). The tolerance: float32 sums
    of the same gradient in another order (two half-batch means averaged, the norm over one flat
    buffer instead of per tensor) differ in the 7th digit, and 4 steps carry that to about 1e-6;
    a lost average (a sum of two gradients) or a rank's gradient alone is off by far more."""
    ranks = run_two_processes(tmp_path, "cpu")
    check_against_one_process(ranks, "cpu", tol=2e-5)
    check_statistics([r["bn"] for r in ranks])


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_replay_the_captured_step_with_nccl(tmp_path):
    """The captured graphs and the NCCL all-reduce between them: as the gloo test, with AdamW (the
    captured optimizer), TF32 off; cuDNN's algorithm choice allows a looser tolerance."""
    ranks = run_two_processes(tmp_path, "cuda")
    check_against_one_process(ranks, "cuda", tol=2e-3)
    check_statistics([r["bn"] for r in ranks])


# -------------------------------------------------------------------------------- one process
def _split_against_graphed(cfg, batches):
    """The split step (statistics copied out and back, gradients in the flat buffer) against
    GraphedTrainStep on `batches`, both without graphs, in one process: their losses and final
    states."""
    from lss.engine.optim import build_optimizer
    from lss.models import LiftSplatShoot
    from lss.models.losses import TotalLoss

    runs = []
    for kind in (GraphedTrainStep, DistributedGraphedStep):
        torch.manual_seed(0)
        model = LiftSplatShoot(cfg).train()
        extra = {"dist_info": ONE} if kind is DistributedGraphedStep else {}
        step = kind(
            model,
            TotalLoss(cfg),
            build_optimizer(cfg, model),
            None,
            cfg.optim.grad_clip,
            warmup=1,
            capture=False,
            **extra,
        )
        torch.manual_seed(1)
        losses = [{k: float(v) for k, v in step(b).items()} for b in batches]
        runs.append((losses, model.state_dict()))
    return runs


@pytest.mark.slow
def test_split_step_follows_the_graphed_step_in_one_process():
    """The tiny LSS model (BatchNorm, several loss terms, clipping at work) in one process: the
    split step against GraphedTrainStep, bit for bit."""
    cfg = tiny_cfg()
    (la, sa), (lb, sb) = _split_against_graphed(cfg, [rig_batch(cfg, seed=s) for s in range(2)])
    assert la == lb  # bit for bit: the same gradients, norm and clipping coefficient
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.slow
def test_split_step_trains_the_detection_second_stage_as_the_graphed_step():
    """Both detection stages (the second one's fixed-shape proposals and jittered ground truth from
    the device's random stream) in the step that torchrun captures: as the graphed step, bit for
    bit, with the second stage's loss terms."""
    from test_detection_targets import REFINE, _detection_batches, _detection_cfg

    cfg = _detection_cfg(*REFINE)
    (la, sa), (lb, sb) = _split_against_graphed(cfg, _detection_batches(cfg, "cpu", 2))
    assert la == lb and {"loss/det_refine_score", "loss/det_refine_box"} <= set(la[0])
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.cuda
def test_split_step_captures_two_graphs_and_follows_the_captured_step_on_cuda():
    """One process, bf16: the two graphs of the split step against GraphedTrainStep's one graph
    (cuDNN may pick other algorithms in each capture: the captured-vs-eager test's tolerance)."""
    cfg = tiny_cfg()
    batches = [{k: v.cuda() for k, v in rig_batch(cfg, seed=s).items()} for s in range(4)]
    from lss.engine.optim import build_optimizer
    from lss.models import LiftSplatShoot
    from lss.models.losses import TotalLoss

    runs = []
    for kind in (GraphedTrainStep, DistributedGraphedStep):
        torch.manual_seed(0)
        model = LiftSplatShoot(cfg).cuda().train()
        extra = {"dist_info": ONE} if kind is DistributedGraphedStep else {}
        step = kind(
            model,
            TotalLoss(cfg).cuda(),
            build_optimizer(cfg, model),
            torch.bfloat16,
            cfg.optim.grad_clip,
            **extra,
        )
        torch.manual_seed(1)
        runs.append(([float(step(b)["loss"]) for b in batches], step))
    (graphed, _), (split, step) = runs
    assert step.graphs is not None
    assert list(step.setup_seconds) == ["warmup_step_1", "warmup_step_2", "capture"]
    assert all(math.isfinite(v) for v in split)
    for a, b in zip(graphed, split):
        assert math.isclose(a, b, rel_tol=2e-2), (graphed, split)


def test_gradient_buckets_hold_the_gradients_in_their_layout():
    layer = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    unused = nn.Linear(2, 2)
    optimizer = torch.optim.SGD([*layer.parameters(), *unused.parameters()], lr=0.1)
    layer(torch.randn(2, 3, 5, 5)).sum().backward()
    before = layer.weight.grad.clone()
    buckets = GradientBuckets(optimizer, ["loss"], [], ONE)
    assert layer.weight.grad.stride() == layer.weight.stride()  # channels-last view
    assert torch.equal(layer.weight.grad, before) and unused.weight.grad is None
    assert buckets.buffers[torch.float32].numel() == 4 * 3 * 9 + 4 + 1  # weight, bias, the loss
    buckets.zero_()
    layer(torch.randn(2, 3, 5, 5)).sum().backward()  # adds into the views
    assert layer.weight.grad.data_ptr() >= buckets.buffers[torch.float32].data_ptr()
    flat = buckets.grads[0]
    assert float(flat.abs().sum()) > 0
    norm = buckets.average_and_clip(0.5)
    assert math.isclose(float(torch.linalg.vector_norm(flat)), 0.5, rel_tol=1e-4)
    assert float(norm) > 0.5
    with pytest.raises(ValueError, match="loss terms changed"):
        buckets.gather({"other": torch.tensor(1.0)})
    assert batchnorm_statistics(Normalized())[0].shape == (3,)


# ------------------------------------------------------------------------------ the factory
@pytest.mark.parametrize("setting", ["auto", "true"])
def test_torchrun_on_cuda_picks_the_captured_ddp_step(setting):
    choice = choose_step(tiny_cfg(f"train.cuda_graph={setting}"), CUDA, TWO)
    assert choice == StepChoice("captured-ddp")
    assert "two CUDA graph replays per process around one all-reduce" in choice.describe()
    assert choose_step(tiny_cfg(f"train.cuda_graph={setting}"), CUDA, ONE).kind == "captured"


@pytest.mark.parametrize(
    "overrides, device, reason",
    [
        ([], "cpu", "needs a CUDA device (training runs on cpu)"),
        (["train.grad_accum=2"], "cuda", "train.grad_accum: 1"),
        (["train.amp=fp16"], "cuda", "bf16 or none"),
        (["train.compile=true", "train.compile_mode=reduce-overhead"], "cuda", "one or the other"),
    ],
)
def test_every_rule_that_forbids_it_under_torchrun_says_why(overrides, device, reason):
    choice = choose_step(tiny_cfg("train.cuda_graph=auto", *overrides), torch.device(device), TWO)
    assert choice.kind == "eager" and len(choice.eager_because) == 1
    assert reason in choice.eager_because[0] and reason in choice.describe()
    with pytest.raises(ConfigError, match="cuda_graph: true cannot be used here"):
        choose_step(tiny_cfg("train.cuda_graph=true", *overrides), torch.device(device), TWO)


def test_the_captured_ddp_step_runs_the_plain_model():
    cfg = tiny_cfg()
    model = Regressor()
    parts = make_parts(model, "adamw", TWO, torch.device("cpu"), 1.0)
    step = build_step(cfg, StepChoice("captured-ddp"), parts)
    assert isinstance(step, CapturedDDPStep) and step.parts.net is model
    assert isinstance(step.graph, DistributedGraphedStep) and step.graph.dist_info == TWO
    wrapped = make_parts(model, "adamw", TWO, torch.device("cpu"), 1.0)
    wrapped.net = nn.Sequential(model)
    with pytest.raises(ValueError, match="plain model, not a Sequential wrapper"):
        CapturedDDPStep(wrapped)


# --------------------------------------------------------------------------- a rank that dies
class DyingModel(nn.Module):
    """A segmentation model whose process kills itself (SIGKILL: no message, no cleanup) in its
    third training forward on rank 1."""

    def __init__(self, cfg=None):
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 3, padding=1)
        self.calls = 0

    def forward(self, batch):
        if self.training:
            self.calls += 1
            if self.calls == 3 and os.environ.get("RANK") == "1":
                os.kill(os.getpid(), signal.SIGKILL)
        return {"segmentation": self.conv(batch["images"][:, 0])}


def _dying_worker(rank, world_size, port, cfg_path, run_dir, out):
    from test_engine import FakeBEVDataset

    from lss.config import load_config
    from lss.data import collate
    from lss.engine.train import train

    as_torchrun_rank(rank, world_size, port)
    started = time.perf_counter()
    try:
        train(
            load_config(cfg_path),
            run_dir,
            model_fn=DyingModel,
            dataset_fn=lambda c, s, t: FakeBEVDataset(16),
            collate_fn=collate,
        )
        outcome = "finished"
    except ProcessGroupError as e:
        outcome = str(e)
    with open(f"{out}/rank{rank}.txt", "w") as f:
        f.write(f"{time.perf_counter() - started:.1f}\n{outcome}")


@pytest.mark.slow
def test_a_rank_that_dies_ends_the_others_run_with_a_message(tmp_path):
    from test_engine import fake_cfg

    from lss.config import save_config

    cfg = fake_cfg(
        tmp_path,
        "train.max_steps=6",
        "train.ckpt_every=1",
        "train.eval_every=0",
        "train.viz_every=0",
    )
    save_config(cfg, tmp_path / "cfg.yaml")
    ctx = mp.get_context("spawn")
    args = (2, free_port(), str(tmp_path / "cfg.yaml"), str(tmp_path / "run"), str(tmp_path))
    procs = [ctx.Process(target=_dying_worker, args=(r, *args)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    alive = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not alive, "a process still ran 180 s after its peer died: a hang"
    assert procs[1].exitcode == -signal.SIGKILL
    seconds, message = (tmp_path / "rank0.txt").read_text().split("\n", 1)
    assert procs[0].exitcode == 0 and float(seconds) < 120
    # rank 1 died in step 3's forward: rank 0's all-reduce of that step's gradients failed
    assert message.startswith("rank 0 of 2 stops at step 3: a collective operation with the ")
    assert "another process of this run has ended or cannot be reached" in message
    assert "the last checkpoint is step 2" in message and "--resume" in message


# --------------------------------------------------------------------------- the scaling suite
def test_the_ddp_suite_launches_torchrun_and_compares_curves_at_common_steps(tmp_path):
    import importlib

    from lss.engine import bench

    bench.load_benchmarks()  # the checkout's benchmarks/ on sys.path
    ddp = importlib.import_module("benchmarks.ddp")
    diff = ddp.curve_difference({2: 1.0, 4: 2.0, 6: 3.0}, {2: 1.1, 4: 2.0, 8: 1.0})
    assert diff["steps"] == [2, 4] and math.isclose(diff["max"], 0.1)
    assert math.isclose(diff["mean"], 0.05)
    with pytest.raises(ValueError, match="no common logged steps"):
        ddp.curve_difference({2: 1.0}, {4: 1.0})
    one, two = (ddp.train_command(n, ["train.max_steps=3"], tmp_path) for n in (1, 2))
    assert one[1:4] == ["-m", "lss", "train"] and one[-3:] == [
        "--set",
        "train.max_steps=3",
        "--overwrite",
    ]
    assert two[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m"]
    assert two[6:8] == ["lss", "train"]
