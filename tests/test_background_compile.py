"""train.compile_start: the run trains uncompiled steps while a child process compiles the same model, then compiles
its own modules from the compiler caches that the child filled and goes on compiled; a failed or unfinished child
leaves the run uncompiled. On the CPU (Inductor's C++ kernels), as CI runs it."""
import multiprocessing
import os
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from lss.config import ConfigError
from lss.data import collate
from lss.engine.distributed import DistInfo
from lss.engine.hooks import Hook
from lss.engine.step import BackgroundCompileHook, uncompiled
from lss.engine.step import background as background_compile
from lss.engine.step.factory import compile_start
from lss.engine.train import train
from test_engine import CLASSES, FakeBEVDataset, FakeModel, fake_cfg, losses_of


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, len(CLASSES), 3, padding=1)

    def forward(self, x):
        return self.conv(x)


class SmallModel(FakeModel):
    """FakeModel with its convolution in a module of this file: torch releases differ in whether they compile a
    torch.nn module's own forward as the top frame (2.11 skips it), and the LSS model's parts are modules of ours."""

    def __init__(self, cfg=None):
        super().__init__(cfg)
        self.conv = Head()


class FailsInChild(SmallModel):
    """A model function that works in the run's process and raises in the compile process."""

    def __init__(self, cfg=None):
        if multiprocessing.parent_process() is not None:
            raise RuntimeError("no model in this process")
        super().__init__(cfg)


class Watch(Hook):
    """Records after every step whether the model's conv runs compiled; after step 1 waits for the compile process
    (so the switch comes at a known step)."""

    def __init__(self, wait: bool = True):
        self.wait, self.compiled, self.process, self.waited, self.entries = wait, [], None, None, None

    def after_step(self, trainer, logs):
        self.compiled.append(trainer.model.conv._compiled_call_impl is not None)
        compiling = [h.child for h in trainer.hooks if isinstance(h, BackgroundCompileHook) and h.child]
        if trainer.step == 1 and compiling:
            self.process = compiling[0].process
            if self.wait:
                self.waited = compiling[0].wait(300)
                self.entries = cache_entries()


def bg_cfg(tmp_path, *extra):
    """Compiled in the background, without deterministic algorithms (as the configs run)."""
    return fake_cfg(tmp_path, "train.deterministic=false", "train.compile=true", "train.compile_start=background",
                    *extra)


def run(cfg, run_dir, model_fn=SmallModel, hooks=()):
    return train(cfg, str(run_dir), model_fn=model_fn, collate_fn=collate, hooks=hooks,
                 dataset_fn=lambda c, split, is_train: FakeBEVDataset(10 if is_train else 5))


def cache_entries() -> set:
    """The compiled graphs in the compiler's caches on disk (AOTAutograd's and Inductor's FX graph entries): a
    compilation that does not find its graph there adds one."""
    root = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    return {p.relative_to(root) for kind in ("aotautograd", "fxgraph") for p in (root / kind).rglob("*") if p.is_file()}


@pytest.fixture
def fresh_compiler(tmp_path, monkeypatch):
    """Empty compiler caches on disk (the child inherits the variable), nothing compiled in this process; the switch
    taken however short the rest of the run (its steps take milliseconds here)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(background_compile, "SWITCH_PAYS_AFTER_S", 0.0)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_the_run_switches_to_the_modules_the_child_compiled_into_the_caches(tmp_path, fresh_compiler, capsys):
    watch = Watch()
    run(bg_cfg(tmp_path), tmp_path / "bg", hooks=[watch])
    out = capsys.readouterr().out
    assert watch.waited is not None and watch.waited[0], watch.waited
    assert "uncompiled until a background process has compiled the model" in out
    assert "lss: compiled steps from step 2 (the compile process compiled in" in out
    assert watch.compiled == [False] + [True] * 5
    # this process compiled the training step from the child's entries, and no evaluation or picture compiled
    # anything (each would add entries: other modes, other shapes)
    assert watch.entries and cache_entries() == watch.entries and not watch.process.is_alive()
    run(fake_cfg(tmp_path, "train.deterministic=false"), tmp_path / "eager")
    compiled, eager = zip(*losses_of(tmp_path / "bg")), zip(*losses_of(tmp_path / "eager"))
    (steps, losses), (eager_steps, eager_losses) = compiled, eager
    assert steps == eager_steps and losses == pytest.approx(eager_losses, rel=1e-5, abs=1e-6)


def test_a_failed_compile_process_leaves_the_run_uncompiled(tmp_path, fresh_compiler, capsys):
    watch = Watch()
    run(bg_cfg(tmp_path), tmp_path / "bg",
        model_fn=FailsInChild, hooks=[watch])
    assert watch.waited == (False, "RuntimeError: no model in this process")
    assert ("lss: the background compilation failed (RuntimeError: no model in this process); training goes on "
            "uncompiled") in capsys.readouterr().out
    assert watch.compiled == [False] * 6 and not cache_entries()
    run(fake_cfg(tmp_path, "train.deterministic=false"), tmp_path / "eager")
    assert losses_of(tmp_path / "bg") == losses_of(tmp_path / "eager")


def test_a_run_too_short_for_the_switch_stays_uncompiled_with_the_caches_filled(tmp_path, fresh_compiler, capsys,
                                                                                monkeypatch):
    monkeypatch.setattr(background_compile, "SWITCH_PAYS_AFTER_S", 3600.0)
    watch = Watch()
    run(bg_cfg(tmp_path), tmp_path / "bg", hooks=[watch])
    out = capsys.readouterr().out
    assert watch.waited is not None and watch.waited[0], watch.waited
    assert re.search(r"lss: the compile process compiled in [0-9.]+ s, but the run has about [0-9]+ s of steps left, less "
                     r"than the 3600 s a switch to compiled steps needs to pay off: the steps stay uncompiled", out)
    assert watch.compiled == [False] * 6 and watch.entries and cache_entries() == watch.entries


def test_a_run_that_ends_first_stops_the_compile_process(tmp_path, fresh_compiler, capsys):
    watch = Watch(wait=False)
    run(bg_cfg(tmp_path, "train.max_steps=2"),
        tmp_path / "bg", hooks=[watch])
    assert watch.compiled == [False, False] and not watch.process.is_alive()
    assert "lss: training ended before the background compilation was done" in capsys.readouterr().err


def test_a_model_function_that_cannot_be_sent_compiles_before_the_first_step(tmp_path, fresh_compiler, capsys):
    watch = Watch()
    run(bg_cfg(tmp_path, "train.max_steps=2"),
        tmp_path / "bg", model_fn=lambda c: SmallModel(c), hooks=[watch])
    assert "cannot go to a compile process" in capsys.readouterr().out
    assert watch.compiled == [True, True] and watch.process is None


def test_compile_start_picks_the_process_that_compiles(tmp_path):
    cpu, cuda, one, two = torch.device("cpu"), torch.device("cuda"), DistInfo(), DistInfo(world_size=2)
    auto = fake_cfg(tmp_path, "train.compile=true")
    assert compile_start(auto, cuda, one) == "background" and compile_start(auto, cpu, one) == "now"
    assert compile_start(auto, cuda, two) == "now"  # DDP: every process compiles before its first step
    assert compile_start(fake_cfg(tmp_path), cuda, one) == "off"
    assert compile_start(fake_cfg(tmp_path, "train.compile=true", "train.compile_start=now"), cuda, one) == "now"
    background = bg_cfg(tmp_path)
    assert compile_start(background, cpu, one) == "background"
    with pytest.raises(ConfigError, match="train.compile_start: background needs a run of one process.*"
                                          "set train.compile_start: now"):
        compile_start(background, cuda, two)
    with pytest.raises(ConfigError, match="train.compile_start"):
        fake_cfg(tmp_path, "train.compile_start=later")


def test_uncompiled_runs_the_eager_code_inside_and_restores_the_compiled_calls(fresh_compiler):
    model = SmallModel()
    model.conv.compile()
    compiled_call = model.conv._compiled_call_impl
    batch = {"images": torch.randn(2, 6, 3, 8, 8)}
    with pytest.raises(KeyError), uncompiled():
        model.eval()(batch)
        raise KeyError("restored on the way out")
    assert model.conv._compiled_call_impl is compiled_call
    assert not cache_entries()  # the eager call compiled nothing
    model(batch)
    assert cache_entries()  # outside, the module compiles again


@pytest.mark.cuda
def test_on_a_gpu_the_step_is_captured_again_with_the_compiled_modules(tmp_path, fresh_compiler, capsys):
    watch = Watch()
    gpu = ("train.device=cuda", "train.cuda_graph=true", "train.amp=none", "train.deterministic=false")
    run(fake_cfg(tmp_path, *gpu, "train.compile=true"), tmp_path / "bg", hooks=[watch])  # auto: background on CUDA
    out = capsys.readouterr().out
    assert "each step one CUDA graph replay, uncompiled until a background process has compiled the model" in out
    assert watch.waited is not None and watch.waited[0], watch.waited
    assert watch.compiled == [False] + [True] * 5
    assert watch.entries and cache_entries() == watch.entries
    run(fake_cfg(tmp_path, *gpu), tmp_path / "eager")
    (steps, losses), (eager_steps, eager_losses) = zip(*losses_of(tmp_path / "bg")), zip(*losses_of(tmp_path / "eager"))
    assert steps == eager_steps and losses == pytest.approx(eager_losses, rel=1e-4, abs=1e-6)
