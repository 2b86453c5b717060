"""train.cuda_graph: the captured training step gives the eager step's trajectory; its warm-up leaves no trace;
configs it cannot serve are rejected with the setting to change; checkpoints stay portable between both kinds of
run; the first call times its warm-up steps and the capture. CPU tests run the step eagerly on its static buffers
(capture=False); the cuda-marked ones capture it."""
import contextlib
import json
import math
import time

import pytest
import torch

from lss.config import ConfigError, load_config
from lss.engine import checkpoint as ck
from lss.engine.distributed import DistInfo
from lss.engine.step import GraphedTrainStep, StepChoice, choose_step
from lss.engine.step.graph import make_capturable
from lss.models.losses import TotalLoss
from lss.engine.optim import build_optimizer, lr_factor
from lss.geometry import inverse_3x3, load_nuscenes_rig
from lss.models import LiftSplatShoot
from test_model import RigDataset, rig_batch, tiny_cfg


def _setup(cfg, device, seed=0):
    torch.manual_seed(seed)
    model = LiftSplatShoot(cfg).to(device)
    loss_fn = TotalLoss(cfg).to(device)
    optimizer = build_optimizer(cfg, model)
    return model, loss_fn, optimizer


def _batches(cfg, device, count, batch_fn=rig_batch):
    return [{k: v.to(device) for k, v in batch_fn(cfg, seed=s).items()} for s in range(count)]


def _eager_step(model, loss_fn, optimizer, batch, autocast, clip):
    optimizer.zero_grad(set_to_none=True)
    with autocast():
        out = model(batch)
    losses = loss_fn(out, batch)
    losses["loss"].backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
    optimizer.step()
    return float(losses["loss"].detach())


def _run_both(cfg, device, steps, capture, amp_dtype, batch_fn=rig_batch):
    def autocast():
        return torch.autocast("cuda", dtype=amp_dtype) if amp_dtype is not None else contextlib.nullcontext()

    batches = _batches(cfg, device, steps, batch_fn)
    model, loss_fn, optimizer = _setup(cfg, device)
    model.train()
    torch.manual_seed(1)
    eager = [_eager_step(model, loss_fn, optimizer, b, autocast, cfg.optim.grad_clip) for b in batches]
    eager_params = [p.detach().clone() for p in model.parameters()]

    model, loss_fn, optimizer = _setup(cfg, device)
    model.train()
    step = GraphedTrainStep(model, loss_fn, optimizer, amp_dtype, cfg.optim.grad_clip, capture=capture)
    torch.manual_seed(1)
    graphed = [float(step(b)["loss"]) for b in batches]
    return eager, graphed, eager_params, [p.detach() for p in model.parameters()], step


def test_static_buffer_step_matches_eager_steps_bit_for_bit_on_cpu():
    cfg = tiny_cfg()
    eager, graphed, pa, pb, step = _run_both(cfg, "cpu", 3, False, None)
    assert eager == graphed  # the warm-up steps were undone: same parameters, Adam state and RNG stream
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    assert step.graph is None and set(step.static) == set(_batches(cfg, "cpu", 1)[0])


def test_the_first_call_times_each_warm_up_step():
    cfg = tiny_cfg()
    model, loss_fn, optimizer = _setup(cfg, "cpu")
    step = GraphedTrainStep(model, loss_fn, optimizer, None, cfg.optim.grad_clip, warmup=3, capture=False)
    a, b = _batches(cfg, "cpu", 2)
    start = time.perf_counter()
    step(a)
    first_call = time.perf_counter() - start
    assert list(step.setup_seconds) == ["warmup_step_1", "warmup_step_2", "warmup_step_3"]  # no capture on the CPU
    assert all(s > 0 for s in step.setup_seconds.values())
    assert sum(step.setup_seconds.values()) <= first_call  # the warm-up steps are parts of the first call
    setup = dict(step.setup_seconds)
    step(b)
    assert step.setup_seconds == setup  # later calls add nothing


def test_batches_that_do_not_fit_the_static_buffers_are_rejected():
    cfg = tiny_cfg()
    model, loss_fn, optimizer = _setup(cfg, "cpu")
    step = GraphedTrainStep(model, loss_fn, optimizer, None, 5.0, warmup=1, capture=False)
    batch = rig_batch(cfg)
    step(batch)
    smaller = {k: v[:1] for k, v in batch.items()}
    with pytest.raises(ValueError, match=r"batch\['images'\] is \(1, 6, 3, 32, 96\).*same shapes"):
        step(smaller)
    with pytest.raises(ValueError, match="same entries"):
        step({k: v for k, v in batch.items() if k != "targets"})
    with pytest.raises(ValueError, match="warmup must be >= 1"):
        GraphedTrainStep(model, loss_fn, optimizer, None, 5.0, warmup=0)


ONE, TWO = DistInfo(), DistInfo(rank=0, world_size=2)
CUDA = torch.device("cuda", 0)


def test_configs_the_captured_step_cannot_serve_are_rejected():
    """The device and process rules (the config's own: the next test)."""
    cfg = tiny_cfg("train.cuda_graph=true")
    with pytest.raises(ConfigError, match="cuda_graph: true cannot be used.*needs a CUDA device.*cuda_graph: false"):
        choose_step(cfg, torch.device("cpu"), ONE)
    # torchrun: the captured step across processes (tests/test_ddp_step.py)
    assert choose_step(tiny_cfg("train.cuda_graph=true"), CUDA, TWO) == StepChoice("captured-ddp")
    assert choose_step(cfg, CUDA, ONE) == StepChoice("captured")
    assert choose_step(tiny_cfg("train.cuda_graph=false"), torch.device("cpu"), TWO) == StepChoice("eager")


@pytest.mark.parametrize("overrides, message", [
    (["train.grad_accum=2"], "cuda_graph: true cannot be used.*train.grad_accum: 1"),
    (["train.amp=fp16"], "cuda_graph: true cannot be used.*bf16 or none"),
    (["train.compile=true", "train.compile_mode=reduce-overhead"],
     "cuda_graph: true cannot be used.*one or the other.*cuda_graph: false"),
])
def test_train_cuda_graph_true_refuses_a_config_it_cannot_serve_before_any_data_is_read(
        tmp_path, overrides, message):
    from lss.engine.train import train

    def no_data(*args):
        raise AssertionError("the datasets were built before the refusal")

    cfg = tiny_cfg("train.cuda_graph=true", *overrides)  # the config loads: the device is not known yet
    with pytest.raises(ConfigError, match=message):
        choose_step(cfg, CUDA, ONE)
    cfg.train.device = "cpu"
    with pytest.raises(ConfigError, match=message):
        train(cfg, str(tmp_path / "run"), dataset_fn=no_data)


@pytest.mark.parametrize("overrides, device, distributed, reason", [
    ([], "cuda", False, None),
    ([], "cpu", False, "needs a CUDA device"),
    (["train.grad_accum=2"], "cuda", False, "train.grad_accum: 1"),
    (["train.amp=fp16"], "cuda", False, "bf16 or none"),
    (["train.compile=true", "train.compile_mode=reduce-overhead"], "cuda", False, "one or the other"),
    (["model.heads=[segmentation, detection]"], "cuda", False, None),  # the dataset's targets follow
    (["model.heads=[segmentation, detection]", "detection.refine=true"], "cuda", False, None),
])
def test_auto_captures_where_every_rule_holds_and_says_why_not(overrides, device, distributed, reason):
    cfg = tiny_cfg("train.cuda_graph=auto", *overrides)  # loads: auto breaks no rule of the config
    choice = choose_step(cfg, torch.device(device), TWO if distributed else ONE)
    assert choice.kind == ("captured" if reason is None else "eager")
    why = choice.eager_because
    assert (why == ()) if reason is None else (len(why) == 1 and reason in why[0])


def test_auto_trains_with_eager_steps_on_the_cpu_and_says_so(synthetic_root, tmp_path, capsys):
    from lss.engine.train import train

    cfg = tiny_cfg("train.cuda_graph=auto", "train.max_steps=2", "train.batch_size=1", "train.eval_every=0",
                   "train.ckpt_every=0", "train.viz_every=0", "train.device=cpu", "data.workers=0",
                   f"data.dataroot={synthetic_root}")
    final = train(cfg, str(tmp_path / "run"))
    assert final["step"] == 2
    out = capsys.readouterr().out
    assert "eager steps (train.cuda_graph: auto: it needs a CUDA device (training runs on cpu))" in out


def test_checkpoints_store_a_plain_learning_rate(tmp_path):
    cfg = tiny_cfg("optim.schedule=cosine", "train.max_steps=10")
    model, _, optimizer = _setup(cfg, "cpu")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg, s))
    make_capturable(optimizer, torch.device("cpu"))  # what a captured step does to the optimizer
    assert torch.is_tensor(optimizer.param_groups[0]["lr"]) and optimizer.param_groups[0]["capturable"]
    scheduler.step()
    lr = float(optimizer.param_groups[0]["lr"])
    assert math.isclose(lr, cfg.optim.lr * lr_factor(cfg, 1), rel_tol=1e-6)
    ck.save_checkpoint(tmp_path / "c.pt", model, 1, cfg, optimizer, scheduler)
    state = ck.load_checkpoint(tmp_path / "c.pt")
    group = state["optimizer"]["param_groups"][0]
    assert isinstance(group["lr"], float) and math.isclose(group["lr"], lr, rel_tol=1e-6)
    assert group["capturable"] is False
    assert all(isinstance(v, float) for v in state["scheduler"]["_last_lr"])
    assert torch.is_tensor(optimizer.param_groups[0]["lr"])  # the live optimizer is left as it was
    fresh = build_optimizer(cfg, model)
    fresh.load_state_dict(state["optimizer"])
    assert math.isclose(fresh.param_groups[0]["lr"], lr, rel_tol=1e-6)


def test_inverse_3x3_matches_linalg_inv():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(5, 4, 3, 3, generator=g, dtype=torch.float64) + 3 * torch.eye(3, dtype=torch.float64)
    torch.testing.assert_close(inverse_3x3(m), torch.linalg.inv(m))
    K, _, _ = load_nuscenes_rig()
    torch.testing.assert_close(inverse_3x3(K), torch.linalg.inv(K.double()).float(), rtol=1e-5, atol=1e-7)
    assert not torch.isfinite(inverse_3x3(torch.zeros(3, 3))).any()


@pytest.mark.cuda
def test_captured_step_follows_the_eager_trajectory_on_cuda():
    cfg = tiny_cfg()
    eager, graphed, pa, pb, step = _run_both(cfg, "cuda", 4, True, torch.bfloat16)
    assert step.graph is not None
    assert list(step.setup_seconds) == ["warmup_step_1", "warmup_step_2", "capture"]
    assert all(s > 0 for s in step.setup_seconds.values())
    assert_follows_eager(eager, graphed, pa, pb)


def assert_follows_eager(eager, graphed, eager_params, graphed_params):
    """The captured steps' losses and parameters are the eager steps' up to bf16 and cuDNN's choices."""
    assert all(math.isfinite(v) for v in graphed)
    # the same kernels on the same inputs; cuDNN may pick other algorithms inside the capture
    for a, b in zip(eager, graphed):
        assert math.isclose(a, b, rel_tol=2e-2), (eager, graphed)
    diffs = [float((a - b).abs().max() / (a.abs().max() + 1e-6)) for a, b in zip(eager_params, graphed_params)]
    assert max(diffs) < 5e-2, max(diffs)


@pytest.mark.cuda
def test_captured_step_reads_new_batches_and_learning_rates():
    cfg = tiny_cfg("optim.lr=0.01")
    model, loss_fn, optimizer = _setup(cfg, "cuda")
    model.train()
    step = GraphedTrainStep(model, loss_fn, optimizer, torch.bfloat16, 5.0)
    a, b = _batches(cfg, "cuda", 2)
    first = float(step(a)["loss"])
    other = float(step(b)["loss"])
    assert first != other  # the replay read the second batch
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.param_groups[0]["lr"].fill_(0.0)  # what the scheduler does in place
    step(a)
    # Adam with lr 0 leaves every parameter where it was (the step still updates the moments)
    assert all(torch.equal(x, p) for x, p in zip(before, model.parameters()))


@pytest.mark.cuda
def test_train_cli_path_with_cuda_graph_resumes_the_same_curve(tmp_path):
    from lss.data import collate
    from lss.engine.train import train

    base = ["train.cuda_graph=true", "train.device=cuda", "train.batch_size=2", "data.workers=0", "train.log_every=1",
            "train.eval_every=0", "train.viz_every=0", "train.ckpt_every=2", "optim.lr=0.005"]

    def run(out, steps, resume=False):
        cfg = tiny_cfg(*base, f"train.max_steps={steps}")
        train(cfg, str(out), resume, dataset_fn=lambda c, split, is_train: RigDataset(c, 6 if is_train else 0),
              collate_fn=collate)
        return [json.loads(ln)["loss"] for ln in (out / "metrics.jsonl").read_text().splitlines()
                if json.loads(ln)["kind"] == "train"]

    straight = run(tmp_path / "a", 4)
    run(tmp_path / "b", 2)
    resumed = run(tmp_path / "b", 4, resume=True)
    assert len(straight) == len(resumed) == 4 and all(math.isfinite(v) for v in straight)
    for x, y in zip(straight, resumed):
        assert math.isclose(x, y, rel_tol=2e-2), (straight, resumed)
