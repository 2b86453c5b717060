"""Errors and recovery of a training run: a run directory is never overwritten by accident (--resume / --overwrite),
--resume refuses a config that changes what the checkpoint means, a failing evaluation keeps the step's checkpoint,
non-finite weights are never saved, and Ctrl-C, a full disk or a step out of device memory end in one line that names
the checkpoint on disk."""
import errno
import re

import pytest
import torch

import lss.engine.train as train_module
from lss.cli import main
from lss.config import save_config
from lss.data import collate
from lss.engine import checkpoint as ck
from lss.engine.checkpointer import CheckpointWriter
from lss.engine.hooks import EvalHook, Hook
from lss.engine.train import train
from lss.errors import ArgumentError, CheckpointError, DatasetError, ResourceError
from test_engine import FakeBEVDataset, FakeModel, fake_cfg, fake_train, losses_of

real_train = train


def no_val(cfg, split, is_train):
    return FakeBEVDataset(10 if is_train else 0)


class InterruptAt(Hook):
    """Ctrl-C after optimizer step `step`."""

    def __init__(self, step):
        self.step = step

    def after_step(self, trainer, logs):
        if trainer.step == self.step:
            raise KeyboardInterrupt


def cli_train(monkeypatch, tmp_path, run, *args, hooks=(), cfg_extra=()):
    """`lss train --config CFG --out RUN ARGS` on the fake model and data; returns the exit code."""
    cfg_path = tmp_path / "cfg.yaml"
    save_config(fake_cfg(tmp_path, "train.eval_every=0", "train.viz_every=0", f"data.dataroot={tmp_path / 'none'}",
                         *cfg_extra), cfg_path)
    monkeypatch.setattr(train_module, "train", lambda cfg, **kw: real_train(
        cfg, model_fn=FakeModel, dataset_fn=no_val, collate_fn=collate, hooks=hooks, **kw))
    return main(["train", "--config", str(cfg_path), "--out", str(run), *args])


def error_lines(capsys):
    """The lines of stderr that the command line printed (not the progress bar's)."""
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("lss train")]


def last_step(run):
    return ck.load_checkpoint(run / "checkpoints" / "last.pt")["step"]


# ------------------------------------------------------------------------------------- the run directory
def test_training_into_an_earlier_run_is_refused_and_leaves_it_alone(tmp_path):
    run = tmp_path / "run"
    fake_train(fake_cfg(tmp_path), run)
    metrics, last = (run / "metrics.jsonl").read_bytes(), (run / "checkpoints" / "last.pt").read_bytes()
    with pytest.raises(ArgumentError, match=r"already holds a run \(metrics.jsonl, final.json, checkpoints/last.pt"
                                            r".*--resume.*--overwrite.*new --out"):
        fake_train(fake_cfg(tmp_path, "train.max_steps=3"), run)
    assert (run / "metrics.jsonl").read_bytes() == metrics
    assert (run / "checkpoints" / "last.pt").read_bytes() == last
    with pytest.raises(ArgumentError, match="pass one"):
        train(fake_cfg(tmp_path), str(run), resume=True, overwrite=True, model_fn=FakeModel)


def test_overwrite_starts_the_run_again_from_an_empty_directory(tmp_path):
    run = tmp_path / "run"
    fake_train(fake_cfg(tmp_path), run)
    old_events = set((run / "tensorboard").iterdir())
    train(fake_cfg(tmp_path, "train.max_steps=2", "train.eval_every=0"), str(run), overwrite=True,
          model_fn=FakeModel, dataset_fn=no_val, collate_fn=collate)
    assert [s for s, _ in losses_of(run)] == [1, 2]
    assert last_step(run) == 2 and not (run / "checkpoints" / "best.pt").exists()  # the old run's best is gone
    events = set((run / "tensorboard").iterdir())
    assert events and not events & old_events


def test_cli_refuses_an_earlier_run_in_one_line(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.pt").write_bytes(b"earlier run")
    assert cli_train(monkeypatch, tmp_path, run) == 2
    err = error_lines(capsys)
    assert err[0].startswith(f"lss train: error: run directory {run} already holds a run (checkpoints/last.pt)")
    assert "--resume" in err[0] and "--overwrite" in err[0]
    assert (run / "checkpoints" / "last.pt").read_bytes() == b"earlier run"
    assert cli_train(monkeypatch, tmp_path, run, "--overwrite") == 0
    assert last_step(run) == 6


# ------------------------------------------------------------------------------ evaluation and checkpoints
class MissingImages(FakeBEVDataset):
    def __getitem__(self, i):
        raise DatasetError(f"image samples/CAM_FRONT/{i}.jpg does not exist")


def test_a_failing_evaluation_keeps_the_checkpoint_of_its_step(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(DatasetError, match="does not exist"):
        train(fake_cfg(tmp_path), str(run), model_fn=FakeModel, collate_fn=collate,
              dataset_fn=lambda c, split, is_train: FakeBEVDataset(10) if is_train else MissingImages(5))
    assert last_step(run) == 3  # eval_every = ckpt_every = 3


def test_resume_keeps_the_best_evaluated_at_the_checkpoint_step(tmp_path):
    def scripted(scores):
        values = iter(scores)

        def evaluate():
            score = next(values)
            return {"iou": {"vehicle": score}, "mean_iou": score}
        return evaluate

    def run(out, steps, scores, resume=False):
        cfg = fake_cfg(tmp_path, f"train.max_steps={steps}", "train.ckpt_every=2", "train.eval_every=0")
        return train(cfg, str(out), resume, model_fn=FakeModel, dataset_fn=no_val, collate_fn=collate,
                     hooks=[EvalHook(2, scripted(scores))])

    straight = run(tmp_path / "straight", 8, [0.1, 0.5, 0.3, 0.4])
    run(tmp_path / "split", 4, [0.1, 0.5])  # last.pt of step 4 is written before step 4's best
    resumed = run(tmp_path / "split", 8, [0.3, 0.4], resume=True)
    assert straight["best_step"] == resumed["best_step"] == 4 and resumed["best_iou"] == 0.5
    assert ck.load_checkpoint(tmp_path / "split" / "checkpoints" / "best.pt")["step"] == 4


# ------------------------------------------------------------------------------------------ NaN weights
class PoisonedAt(FakeModel):
    """The update of training step `step` makes the weights infinite (its own loss is finite)."""

    def __init__(self, step):
        super().__init__()
        self.step, self.calls = step, 0

    def forward(self, batch):
        out = super().forward(batch)
        if self.training:
            self.calls += 1
            if self.calls == self.step:
                self.conv.weight.data.fill_(float("inf"))
        return out


def test_non_finite_weights_are_never_saved_and_the_last_good_checkpoint_stays(tmp_path):
    run = tmp_path / "run"
    cfg = fake_cfg(tmp_path, "train.ckpt_every=2", "train.eval_every=0")
    with pytest.raises(FloatingPointError) as error:
        train(cfg, str(run), model_fn=lambda c: PoisonedAt(4), dataset_fn=no_val, collate_fn=collate)
    message = str(error.value)
    assert "weights are not finite after step 4" in message and "optim.lr" in message
    assert f"{run / 'checkpoints' / 'last.pt'} (step 2) is intact" in message and "--resume" in message
    state = ck.load_checkpoint(run / "checkpoints" / "last.pt")
    assert state["step"] == 2 and all(v.isfinite().all() for v in state["model"].values())


def test_an_infinite_learning_rate_stops_before_the_first_checkpoint(tmp_path):
    cfg = fake_cfg(tmp_path, "train.max_steps=1")
    cfg.optim.lr = float("inf")
    run = tmp_path / "run"
    with pytest.raises(FloatingPointError, match="weights are not finite after step 1.*no earlier last.pt exists"
                                                 ".*optim.lr \\(now inf\\).*--overwrite"):
        fake_train(cfg, run)
    assert not (run / "checkpoints" / "last.pt").exists()


# ------------------------------------------------------------------------------------ Ctrl-C, full disk
def test_ctrl_c_names_the_last_checkpoint_and_how_to_resume(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt, match=f"interrupted at step 5; the last checkpoint is step 3 in "
                                                f"{run / 'checkpoints' / 'last.pt'}.*--out {run} --resume"):
        train(fake_cfg(tmp_path, "train.eval_every=0"), str(run), model_fn=FakeModel, dataset_fn=no_val,
              collate_fn=collate, hooks=[InterruptAt(5)])
    assert last_step(run) == 3


def test_cli_ctrl_c_exits_130_with_one_line(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    assert cli_train(monkeypatch, tmp_path, run, hooks=[InterruptAt(2)]) == 130
    err = error_lines(capsys)
    assert err == ["lss train: training interrupted at step 2; no checkpoint was written (train.ckpt_every=3): "
                   "start again with --overwrite"]
    assert cli_train(monkeypatch, tmp_path, run, "--overwrite", hooks=[InterruptAt(4)]) == 130
    err = capsys.readouterr().err
    assert f"the last checkpoint is step 3 in {run / 'checkpoints' / 'last.pt'}" in err and "--resume" in err
    assert "Traceback" not in err


def fail_second_file_write(monkeypatch, error: BaseException) -> list:
    """torch.save writes some bytes of the second checkpoint file and raises `error` (serializing elsewhere, e.g.
    to learn a file's size, works); returns the list of file writes."""
    real_save, writes = torch.save, []

    def save(obj, f, *args, **kwargs):
        if hasattr(f, "fileno"):
            writes.append(1)
            if len(writes) == 2:
                f.write(b"partial")
                raise error
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    return writes


def test_cli_full_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    fail_second_file_write(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    run = tmp_path / "run"
    assert cli_train(monkeypatch, tmp_path, run) == 2
    err = error_lines(capsys)
    last = run / "checkpoints" / "last.pt"
    assert err[0].startswith(f"lss train: error: [Errno {errno.ENOSPC}] No space left on device while writing {last}; "
                             f"the previous {last} (step 3) is intact")
    assert "--resume" in err[0]
    assert last_step(run) == 3 and [p.name for p in (run / "checkpoints").iterdir()] == ["last.pt"]


# ------------------------------------------------------------------------------- background checkpoint writes
def _writer_threads():
    import threading

    return [t for t in threading.enumerate() if t.name == "lss-checkpoint-writer"]


def test_checkpoint_writes_run_behind_the_caller_on_a_snapshot(tmp_path, monkeypatch):
    import threading
    import time

    release, real_save = threading.Event(), ck.atomic_save

    def held_save(obj, path):
        assert release.wait(10)
        real_save(obj, path)

    monkeypatch.setattr(ck, "atomic_save", held_save)
    model, done = torch.nn.Linear(3, 2), []
    cfg = fake_cfg(tmp_path)
    writer = CheckpointWriter()
    state = ck.checkpoint_state(model, 7, cfg, snapshot=True)
    writer.submit(state, tmp_path / "a.pt", done=lambda: done.append("a"))
    writer.submit(ck.checkpoint_state(model, 8, cfg, snapshot=True), tmp_path / "b.pt",
                  done=lambda: done.append("b"))
    expected = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.fill_(5.0)  # training goes on while the files are written: they keep the submitted values
    time.sleep(0.05)
    assert done == [] and not (tmp_path / "a.pt").exists()  # submit returned before the write
    release.set()
    writer.wait()
    assert done == ["a", "b"]
    for name, step in (("a.pt", 7), ("b.pt", 8)):
        saved = ck.load_checkpoint(tmp_path / name)
        assert saved["step"] == step
        torch.testing.assert_close(saved["model"]["weight"], expected)
    deadline = time.monotonic() + 5  # the idle thread ends and does not hold the interpreter at exit
    while _writer_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _writer_threads() == []


def test_a_failed_background_write_drops_the_later_ones_and_raises_once(tmp_path, monkeypatch):
    import threading

    real_save, submitted = ck.atomic_save, threading.Event()

    def full_disk(obj, path):
        assert submitted.wait(10)  # all three queued before the first is written
        if path.name == "b.pt":
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, path)

    monkeypatch.setattr(ck, "atomic_save", full_disk)
    model, cfg, writer = torch.nn.Linear(3, 2), fake_cfg(tmp_path), CheckpointWriter()
    for name in ("a.pt", "b.pt", "c.pt"):
        writer.submit(ck.checkpoint_state(model, 1, cfg, snapshot=True), tmp_path / name,
                      failed=lambda e: RuntimeError(f"while writing: {e.strerror}"))
    submitted.set()
    with pytest.raises(RuntimeError, match="while writing: No space left on device"):
        writer.wait()
    assert (tmp_path / "a.pt").is_file() and not (tmp_path / "b.pt").exists() and not (tmp_path / "c.pt").exists()
    writer.wait()  # raised once
    writer.submit(ck.checkpoint_state(model, 2, cfg, snapshot=True), tmp_path / "c.pt")
    writer.wait()
    assert ck.load_checkpoint(tmp_path / "c.pt")["step"] == 2


def test_a_failed_write_surfaces_at_the_next_save_with_the_checkpoint_on_disk(tmp_path, monkeypatch):
    writes = fail_second_file_write(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    run = tmp_path / "run"
    cfg = fake_cfg(tmp_path, "train.ckpt_every=2", "train.eval_every=0", "train.max_steps=8")
    with pytest.raises(OSError, match=f"No space left on device while writing {run / 'checkpoints' / 'last.pt'}; "
                                      f"the previous .* \\(step 2\\) is intact") as error:
        train(cfg, str(run), model_fn=FakeModel, dataset_fn=no_val, collate_fn=collate)
    assert error.value.errno == errno.ENOSPC
    assert last_step(run) == 2 and len(writes) == 2  # the failed write of step 4 stopped the run by step 6's save


def test_a_full_disk_in_torchs_zip_writer_names_the_file_and_the_space_it_needs(tmp_path, monkeypatch, capsys):
    import types

    # torch's words for a short write on a full disk
    fail_second_file_write(monkeypatch, RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 "
                                                     "vs 598"))
    monkeypatch.setattr(ck.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=1000))
    run = tmp_path / "run"
    assert cli_train(monkeypatch, tmp_path, run) == 2
    err = error_lines(capsys)
    last = run / "checkpoints" / "last.pt"
    assert err[0].startswith(f"lss train: error: [Errno {errno.ENOSPC}] No space left on device while writing {last}; "
                             f"the previous {last} (step 3) is intact; the checkpoint needs ")
    assert f"and {run / 'checkpoints'} has 1.0 kB free: free some space, then continue with" in err[0]
    assert "--resume" in err[0] and "Traceback" not in capsys.readouterr().err
    needed = re.search(r"the checkpoint needs ([0-9.]+) kB", err[0])
    # the file of step 6 that did not fit holds what the file of step 3 holds
    assert float(needed.group(1)) * 1e3 == pytest.approx(last.stat().st_size, rel=0.05)
    assert last_step(run) == 3 and [p.name for p in (run / "checkpoints").iterdir()] == ["last.pt"]


# ------------------------------------------------------------------------------------- --resume, another config
def test_resume_refuses_a_config_that_changes_what_the_checkpoint_means(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    assert cli_train(monkeypatch, tmp_path, run, cfg_extra=["train.max_steps=3"]) == 0
    config, last = (run / "config.yaml").read_bytes(), (run / "checkpoints" / "last.pt").read_bytes()
    changed = ["--set", "grid.xbound=[-40.0, 40.0, 0.5]", "--set", "data.final_dim=[256, 704]"]
    assert cli_train(monkeypatch, tmp_path, run, "--resume", *changed) == 2
    err = error_lines(capsys)
    assert err[0] == (
        f"lss train: error: checkpoint {run / 'checkpoints' / 'last.pt'} was trained with grid.xbound=[-50.0, 50.0, "
        "0.5], data.final_dim=[128, 352], the config has grid.xbound=[-40.0, 40.0, 0.5], data.final_dim=[256, 704]: "
        f"--resume continues that run with its settings; resume with its own config ({run / 'config.yaml'}), or "
        "train the new settings into another --out")
    assert (run / "config.yaml").read_bytes() == config and (run / "checkpoints" / "last.pt").read_bytes() == last
    assert cli_train(monkeypatch, tmp_path, run, "--resume", "--set", "train.max_steps=5") == 0  # not a fixed key
    assert last_step(run) == 5


# ------------------------------------------------------------------------------------------ device memory
OUT_OF_MEMORY = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which "
                 "1.02 GiB is free.")


class OutOfMemoryAt(FakeModel):
    """The training forward of step `step` runs out of device memory."""

    def __init__(self, step, allocate=None):
        super().__init__()
        self.step, self.calls, self.allocate = step, 0, allocate

    def forward(self, batch):
        out = super().forward(batch)
        if self.training:
            self.calls += 1
            if self.calls == self.step:
                if self.allocate is None:
                    raise torch.OutOfMemoryError(OUT_OF_MEMORY)
                out["segmentation"] = out["segmentation"] + self.allocate().float().sum()
        return out


def test_a_step_out_of_device_memory_names_the_settings_to_lower_and_keeps_the_checkpoint(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(ResourceError) as error:
        train(fake_cfg(tmp_path, "train.eval_every=0"), str(run), model_fn=lambda c: OutOfMemoryAt(5),
              dataset_fn=no_val, collate_fn=collate)
    assert str(error.value) == (
        f"training step 5 ran out of memory on cpu ({OUT_OF_MEMORY}): lower train.batch_size (now 2), "
        "data.final_dim (now [128, 352]) or the BEV grid (grid.xbound/ybound: now 200 x 200 cells); the last "
        f"checkpoint is step 3 in {run / 'checkpoints' / 'last.pt'}: continue with `lss train (the same "
        f"--config/--set) --out {run} --resume` (with a lower train.batch_size: another final_dim or grid needs a "
        "new run)")
    assert last_step(run) == 3
    with pytest.raises(ResourceError, match="training step 2 ran out of memory.*no checkpoint was written"):
        train(fake_cfg(tmp_path, "train.eval_every=0"), str(tmp_path / "early"),
              model_fn=lambda c: OutOfMemoryAt(2), dataset_fn=no_val, collate_fn=collate)


# what torch's CPU allocator raised for a training step larger than the host's memory
HOST_OUT_OF_MEMORY = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                      "tried to allocate 1327159296 bytes. Error code 12 (Cannot allocate memory)")


def test_a_step_out_of_host_memory_ends_in_the_same_message_and_other_errors_keep_theirs(tmp_path):
    def host_allocation_fails():
        raise RuntimeError(HOST_OUT_OF_MEMORY)

    def a_bug():
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(ResourceError) as error:
        train(fake_cfg(tmp_path, "train.eval_every=0"), str(tmp_path / "run"),
              model_fn=lambda c: OutOfMemoryAt(2, host_allocation_fails), dataset_fn=no_val, collate_fn=collate)
    assert str(error.value).startswith(
        f"training step 2 ran out of memory on cpu ({HOST_OUT_OF_MEMORY}): lower train.batch_size (now 2), "
        "data.final_dim (now [128, 352]) or the BEV grid")
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as error:
        train(fake_cfg(tmp_path, "train.eval_every=0"), str(tmp_path / "bug"),
              model_fn=lambda c: OutOfMemoryAt(2, a_bug), dataset_fn=no_val, collate_fn=collate)
    assert not isinstance(error.value, ResourceError)


@pytest.mark.cuda
def test_a_real_cuda_out_of_memory_step_ends_in_one_line_and_keeps_the_checkpoint(tmp_path):
    def more_than_the_gpu_has():
        return torch.empty(2 * torch.cuda.mem_get_info()[1], dtype=torch.uint8, device="cuda")

    run = tmp_path / "run"
    cfg = fake_cfg(tmp_path, "train.eval_every=0", "train.device=cuda", "train.amp=none", "train.cuda_graph=false",
                   "train.deterministic=false")
    with pytest.raises(ResourceError, match=r"training step 5 ran out of memory on cuda:0 \(CUDA out of memory.*lower "
                                            r"train.batch_size \(now 2\).*the last checkpoint is step 3"):
        train(cfg, str(run), model_fn=lambda c: OutOfMemoryAt(5, more_than_the_gpu_has), dataset_fn=no_val,
              collate_fn=collate)
    state = ck.load_checkpoint(run / "checkpoints" / "last.pt")
    assert state["step"] == 3 and all(v.isfinite().all() for v in state["model"].values())
    assert torch.ones(4, device="cuda").sum().item() == 4  # the device still serves
