"""The training loop's data stream and host syncs: batches across epochs as the per-epoch passes gave them (resume
mid-epoch included), the captured step's values read only where needed, the start-up record, evaluation of a
padded last batch, loader workers with one BLAS thread, the train_loop benchmark's start-up rows, and what importing
the trainer leaves out."""
import json
import os
import subprocess
import sys
from collections.abc import Mapping

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lss.config import load_config
from lss.data import collate
from lss.data.loader import build_dataset, build_loader
from lss.data.samplers import StreamSampler
from lss.data.samplers import EpochSampler
from lss.engine.distributed import DistInfo
from lss.engine.eval import evaluate, pad_batch
from lss.engine.hooks import LogHook, StepTimer
from lss.engine.step import CapturedStep, StepLogs
from lss.engine.train import Trainer, train
from test_engine import CLASSES, FakeBEVDataset, FakeModel, fake_cfg


class IndexSet(torch.utils.data.Dataset):
    def __init__(self, length):
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return {"index": torch.tensor(i)}


def epoch_passes(length, batch_size, epochs, seed=0):
    """The batches of one DataLoader pass per epoch over EpochSampler with drop_last (the loop before the stream)."""
    sampler, out = EpochSampler(length, shuffle=True, seed=seed), []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out += [b.tolist() for b in DataLoader(IndexSet(length), batch_size, sampler=sampler, drop_last=True,
                                               collate_fn=lambda items: torch.stack([x["index"] for x in items]))]
    return out


def test_the_stream_sampler_gives_the_batches_of_the_epoch_passes_from_any_start():
    expected = epoch_passes(7, 2, 4)  # 3 full batches per epoch, one sample of each epoch left out
    sampler = StreamSampler(EpochSampler(7, shuffle=True, seed=0), 2)
    stream = iter(torch.utils.data.BatchSampler(sampler, 2, drop_last=True))
    assert [next(stream) for _ in range(12)] == expected
    sampler.set_start(1, 2)  # epoch 1, after its first batch: micro-batch 4
    stream = iter(torch.utils.data.BatchSampler(sampler, 2, drop_last=True))
    assert [next(stream) for _ in range(8)] == expected[4:]


def test_trainer_batches_follow_the_step_across_epochs(tmp_path):
    cfg = fake_cfg(tmp_path, "train.batch_size=2")
    trainer = Trainer(cfg, FakeModel(), IndexSet(7), None, tmp_path, torch.device("cpu"), DistInfo())
    expected = epoch_passes(7, 2, 4)
    stream = trainer.batches()
    seen, epochs = [], []
    for _ in range(12):
        seen.append(next(stream)["index"].tolist())
        epochs.append(trainer.epoch)
    assert seen == expected and epochs == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    trainer.step = 5  # a resumed run continues with the batch the straight run used for step 6
    stream = trainer.batches()
    assert [next(stream)["index"].tolist() for _ in range(4)] == expected[5:9] and trainer.epoch == 2


def test_step_logs_hold_host_values_and_read_device_values_once():
    logs = StepLogs({"loss": torch.tensor(1.5), "grad_norm": torch.tensor(2.0, dtype=torch.float64)}, lr=0.1)
    logs.add(step_time=0.25)
    assert dict(logs) == {"loss": 1.5, "grad_norm": 2.0, "lr": 0.1, "step_time": 0.25} and len(logs) == 4


@pytest.mark.cuda
def test_step_logs_of_device_tensors_wait_for_the_copy_only_when_read():
    values = {"loss": torch.tensor(3.0, device="cuda")}
    logs = StepLogs(values, lr=0.5)
    values["loss"].fill_(7.0)  # a later write (the next replay) does not reach the logs of this step
    assert set(logs) == {"lr", "loss"} and logs["loss"] == 3.0 and logs["lr"] == 0.5


class _ReadRecorder(Mapping):
    """Logs that note every read of a value."""

    def __init__(self, reads, **values):
        self.values, self.reads = values, reads

    def __getitem__(self, key):
        self.reads.append(key)
        return self.values[key]

    def __iter__(self):
        return iter(self.values)

    def __len__(self):
        return len(self.values)


class _FakeWriter:
    def __init__(self):
        self.records = []

    def write(self, kind, step, values):
        self.records.append((kind, step, json.loads(json.dumps(values))))

    def close(self):
        pass


def test_the_log_hook_reads_the_losses_only_at_its_period_and_writes_the_startup_once(tmp_path):
    class FakeTrainer:
        cfg = fake_cfg(tmp_path, "train.max_steps=5")

    writer, trainer, reads = _FakeWriter(), FakeTrainer(), []
    timer = StepTimer(started=0.0)
    timer.phases = {"datasets": 0.5, "first_step": 1.25}
    hook = LogHook(2, writer, timer)
    for step in range(1, 6):
        trainer.step = step
        hook.after_step(trainer, _ReadRecorder(reads, loss=float(step)))
    assert reads == ["loss"] * 3  # steps 2, 4 and the last one, 5
    assert writer.records[0] == ("startup", 1, {"phases": {"datasets": 0.5, "first_step": 1.25},
                                                "first_step_detail": {}})
    assert [(k, s, v["loss"]) for k, s, v in writer.records[1:]] == [("train", 2, 2.0), ("train", 4, 4.0),
                                                                       ("train", 5, 5.0)]


def test_train_writes_its_startup_phases_in_order(tmp_path):
    cfg = fake_cfg(tmp_path, "train.eval_every=0", "train.viz_every=0")
    train(cfg, str(tmp_path / "run"), model_fn=FakeModel, collate_fn=collate,
          dataset_fn=lambda c, split, is_train: FakeBEVDataset(10 if is_train else 5))
    records = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    startup = [r for r in records if r["kind"] == "startup"]
    assert len(startup) == 1 and startup[0]["step"] == 1
    from benchmarks.train_loop import STARTUP_PHASES

    phases = startup[0]["phases"]
    assert list(phases) == list(STARTUP_PHASES)
    times = [phases[p] for p in STARTUP_PHASES]
    assert times == sorted(times) and times[0] >= 0
    assert times[-1] <= next(r for r in records if r["kind"] == "train")["elapsed"]
    assert startup[0]["first_step_detail"] == {}  # the eager step has no parts


def test_the_startup_record_splits_the_first_static_buffer_step(tmp_path):
    cfg = fake_cfg(tmp_path, "train.max_steps=2", "train.eval_every=0", "train.ckpt_every=0", "train.amp=none")
    trainer = Trainer(cfg, FakeModel(), FakeBEVDataset(10), None, tmp_path, torch.device("cpu"), DistInfo())
    trainer.train_step = CapturedStep(trainer.train_step.parts, warmup=2, capture=False)
    writer, timer = _FakeWriter(), StepTimer()
    trainer.register_hooks([timer, LogHook(1, writer, timer)])
    trainer.fit()
    startup = [values for kind, _, values in writer.records if kind == "startup"]
    assert len(startup) == 1
    phases, detail = startup[0]["phases"], startup[0]["first_step_detail"]
    assert list(phases) == ["first_batch", "first_step"] and list(detail) == ["warmup_step_1", "warmup_step_2"]
    assert all(s >= 0 for s in detail.values())
    # each value is rounded to 1 ms: allow half a millisecond per rounded number
    assert sum(detail.values()) <= phases["first_step"] - phases["first_batch"] + 0.0005 * (len(detail) + 2)


class _BatchSizes(FakeModel):
    def __init__(self):
        super().__init__()
        self.sizes = []

    def forward(self, batch):
        self.sizes.append(batch["images"].shape[0])
        return super().forward(batch)


def test_evaluation_pads_the_last_batch_and_counts_only_the_real_samples(tmp_path):
    model = _BatchSizes().eval()
    dataset = FakeBEVDataset(5, 100)
    results = {}
    for batch_size in (1, 3):
        cfg = fake_cfg(tmp_path, f"eval.batch_size={batch_size}")
        loader = DataLoader(dataset, batch_size, collate_fn=collate)
        timing = {}
        model.sizes.clear()
        torch.manual_seed(0)  # the items draw on the global RNG: the same draws for both batch sizes
        results[batch_size] = evaluate(model, loader, cfg, torch.device("cpu"), show_progress=False, timing=timing)
        assert timing["samples"] == 5 and timing["seconds"] >= timing["first_batch_s"] > 0
        assert model.sizes == [batch_size] * len(loader)  # the last batch of 2 went through as 3
    assert results[1]["union"] == results[3]["union"] and results[1]["sweep"] == results[3]["sweep"]
    assert set(results[1]["iou"]) == set(CLASSES)


def test_pad_batch_repeats_the_last_sample_of_every_field():
    batch = {"images": torch.arange(6.0).view(2, 3), "sample_token": ["a", "b"], "det_boxes": [torch.zeros(1, 9)] * 2}
    padded = pad_batch(batch, 4)
    assert padded["images"].tolist() == [[0, 1, 2], [3, 4, 5], [3, 4, 5], [3, 4, 5]]
    assert padded["sample_token"] == ["a", "b", "b", "b"] and len(padded["det_boxes"]) == 4


class _NativeThreads(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        import cv2
        from threadpoolctl import threadpool_info

        return {"threads": torch.tensor([p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]),
                "cv2_threads": torch.tensor(cv2.getNumThreads())}


def test_loader_workers_run_one_blas_and_one_opencv_thread():
    import cv2

    cfg = load_config(None, ["data.workers=1"])
    before = cv2.getNumThreads()
    loader = build_loader(cfg, _NativeThreads(), None, 2, False, torch.device("cpu"), 0)
    batch = next(iter(loader))
    assert batch["threads"].numel() > 0 and batch["threads"].eq(1).all()
    assert batch["cv2_threads"].tolist() == [1, 1]
    assert cv2.getNumThreads() == before  # the training process keeps its own


class _Niceness(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        return {"niceness": torch.tensor(os.nice(0))}


@pytest.mark.skipif(not hasattr(os, "nice"), reason="no process niceness on this platform")
def test_loader_workers_take_data_worker_niceness():
    base = os.nice(0)
    cfg = load_config(None, ["data.workers=1", "data.worker_niceness=7"])
    batch = next(iter(build_loader(cfg, _Niceness(), None, 2, False, torch.device("cpu"), 0)))
    assert batch["niceness"].tolist() == [min(base + 7, 19)] * 2
    assert os.nice(0) == base  # the training process keeps its own
    with pytest.raises(Exception, match="worker_niceness=20: expected 0 to 19"):
        load_config(None, ["data.worker_niceness=20"])


def test_evaluation_datasets_read_no_lidar(synthetic_root):
    cfg = load_config(None, [f"data.dataroot={synthetic_root}", "data.depth_targets=true"])
    assert "depth_targets" in build_dataset(cfg, "train", True)[0]
    assert "depth_targets" not in build_dataset(cfg, "val", False)[0]


def test_startup_rows_give_each_phase_its_own_time():
    from benchmarks.train_loop import startup_rows

    records = [{"kind": "train", "step": 10}, {"kind": "startup", "step": 1,
                                               "phases": {"datasets": 1.0, "model": 1.5, "first_step": 4.0}}]
    rows = startup_rows("c", records, train_call_s=2.0)
    assert [r["impl"] for r in rows] == ["startup: datasets", "startup: model", "startup: first_step"]
    records[1]["first_step_detail"] = {"warmup_step_1": 1.5, "warmup_step_2": 0.25, "capture": 0.5}
    parts = startup_rows("c", records, train_call_s=2.0)[3:]  # after the first_step row (2.5 s)
    assert [(r["impl"], r["ms"]) for r in parts] == [
        ("startup: first_step: warmup_step_1", 1500.0), ("startup: first_step: warmup_step_2", 250.0),
        ("startup: first_step: capture", 500.0), ("startup: first_step: rest", 250.0)]
    assert "cuDNN autotuning" in parts[0]["notes"] and "60 % of the first step" in parts[0]["notes"]
    assert [r["ms"] for r in rows] == pytest.approx([1000.0, 500.0, 2500.0])
    assert rows[-1]["notes"] == "done 6.00 s after process start"
    assert startup_rows("c", records[:1], None)[0]["notes"] == "metrics.jsonl has no startup record"


# ------------------------------------------------------------------------------------ dataset-index cache
def _dataset(root, *extra):
    from lss.data import NuScenesBEV

    cfg = load_config(None, [f"data.dataroot={root}", "data.depth_targets=true", *extra])
    return NuScenesBEV(root, "v1.0-mini", "val", cfg, is_train=False, verbose=False)


def test_a_cached_index_gives_the_same_dataset_without_the_tables(synthetic_root, tmp_path, monkeypatch):
    import lss.data.sample_index as sample_index
    from lss.data.index_cache import cache_dir

    monkeypatch.setenv("LSS_CACHE_DIR", str(tmp_path / "cache"))
    built = _dataset(synthetic_root)
    assert len(list((cache_dir() / "index").glob("*.pkl"))) == 1

    def no_tables(*args):
        raise RuntimeError("the tables were read although the index is cached")

    monkeypatch.setattr(sample_index, "load_tables", no_tables)
    cached = _dataset(synthetic_root)
    assert set(vars(built)) == set(vars(cached))
    for name, a in vars(built).items():
        b = getattr(cached, name)
        assert np.all(a == b) if hasattr(a, "shape") else name == "config" or repr(a) == repr(b), name
    a, b = built[1], cached[1]
    assert all(torch.equal(a[k], b[k]) for k in a if torch.is_tensor(a[k])) and "depth_targets" in a
    with pytest.raises(RuntimeError, match="tables were read"):  # other classes: another index
        _dataset(synthetic_root, "data.classes=[vehicle]")


def test_an_edited_table_invalidates_the_cached_index(synthetic_root, tmp_path, monkeypatch):
    import os
    import shutil

    import lss.data.sample_index as sample_index

    monkeypatch.setenv("LSS_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "data"
    shutil.copytree(synthetic_root, root)
    _dataset(root)
    table = root / "v1.0-mini" / "sample.json"
    stat = table.stat()
    os.utime(table, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    monkeypatch.setattr(sample_index, "load_tables", lambda *a: (_ for _ in ()).throw(RuntimeError("tables read")))
    with pytest.raises(RuntimeError, match="tables read"):
        _dataset(root)


def test_a_cached_index_does_not_import_the_devkit(synthetic_root, tmp_path):
    import subprocess
    import sys

    code = (f"import sys; from lss.config import load_config; from lss.data.loader import build_dataset; "
            f"cfg = load_config(None, ['data.dataroot={synthetic_root}', 'data.depth_targets=true']); "
            f"ds = build_dataset(cfg, 'train', True); ds[0]; print('nuscenes' in sys.modules)")
    env = dict(os.environ, LSS_CACHE_DIR=str(tmp_path / "cache"))
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env) for _ in range(2)]
    assert [r.stdout.strip().splitlines()[-1] for r in runs] == ["True", "False"], [r.stderr[-500:] for r in runs]


def test_lss_train_builds_the_index_in_a_child_and_the_datasets_load_it(synthetic_root, tmp_path, monkeypatch,
                                                                          capsys):
    import lss.data.sample_index as sample_index
    from lss.data.index_cache import cache_dir
    from lss.data.loader import index_splits_in_background, build_dataset

    cfg = load_config(None, [f"data.dataroot={synthetic_root}", "data.depth_targets=true",
                             "data.train_split=train", "data.val_split=val"])
    monkeypatch.setenv("LSS_CACHE_DIR", str(tmp_path / "in-process"))
    here = [build_dataset(cfg, "train", True), build_dataset(cfg, "val", False)]
    monkeypatch.setenv("LSS_CACHE_DIR", str(tmp_path / "background"))
    assert index_splits_in_background(cfg)
    # the tables are read in the child only: this process waits for it and loads both splits from the cache
    monkeypatch.setattr(sample_index, "load_tables", lambda *a: (_ for _ in ()).throw(RuntimeError("tables read here")))
    capsys.readouterr()
    there = [build_dataset(cfg, "train", True), build_dataset(cfg, "val", False)]
    assert capsys.readouterr().out.count("(cached index)") == 2
    assert len(list((cache_dir() / "index").glob("*.pkl"))) == 2
    for a, b in zip(here, there):
        assert set(vars(a)) == set(vars(b))
        for name, value in vars(a).items():
            other = getattr(b, name)
            assert np.all(value == other) if hasattr(value, "shape") else name == "config" or repr(value) == repr(other)


def test_a_failed_or_stuck_background_build_leaves_the_work_and_the_error_to_this_process(tmp_path, monkeypatch,
                                                                                          capfd):
    import time

    from lss.data.index_cache import build_in_background, wait_for_background_builds
    from lss.data.loader import index_splits_in_background, build_dataset
    from lss.errors import DatasetError

    assert not wait_for_background_builds()  # none started
    cfg = load_config(None, [f"data.dataroot={tmp_path / 'missing'}", "data.make_synthetic_if_missing=false"])
    assert not index_splits_in_background(cfg)  # no dataset: no child
    with pytest.raises(DatasetError, match="missing"):
        build_dataset(cfg, cfg.data.train_split, True)

    def fails():
        print("from the child")
        raise ValueError("a bad table")

    assert build_in_background(fails)
    assert wait_for_background_builds()
    assert "from the child" not in capfd.readouterr().out  # silenced; the dataset reports its own error
    started = time.perf_counter()
    assert build_in_background(lambda: time.sleep(60))
    assert wait_for_background_builds(timeout_s=0.5)  # stopped: the caller builds the index itself
    assert time.perf_counter() - started < 20


def test_train_stops_its_loader_workers_before_it_returns(tmp_path):
    import multiprocessing

    cfg = fake_cfg(tmp_path, "data.workers=1", "train.max_steps=4", "train.eval_every=2", "train.viz_every=0")
    train(cfg, str(tmp_path / "run"), model_fn=FakeModel, collate_fn=collate,
          dataset_fn=lambda c, split, is_train: FakeBEVDataset(10 if is_train else 5))
    # persistent validation workers left to interpreter exit are joined with a timeout each (minutes for many)
    assert multiprocessing.active_children() == []


class _NanAtStep(FakeModel):
    """A model whose training forward gives NaN at its `bad`-th call."""

    def __init__(self, bad):
        super().__init__()
        self.bad, self.calls = bad, 0

    def forward(self, batch):
        out = super().forward(batch)["segmentation"]
        if self.training:
            self.calls += 1
            out = out * float("nan") if self.calls == self.bad else out
        return {"segmentation": out}


@pytest.mark.parametrize("log_every", [0, 1])
def test_the_static_buffer_step_stops_at_a_nan_loss_at_most_one_update_later(tmp_path, log_every):
    # The loss check of a step waits until the next step is queued (the device never waits for the host's launch),
    # so one more update may be applied; a step that a hook logs is checked before the next one.
    cfg = fake_cfg(tmp_path, "train.max_steps=6", f"train.log_every={log_every}", "train.eval_every=0",
                   "train.ckpt_every=0", "train.viz_every=0", "train.amp=none")
    model = _NanAtStep(bad=1 + 3)  # one warm-up call, then steps 1, 2, 3
    trainer = Trainer(cfg, model, FakeBEVDataset(10), None, tmp_path, torch.device("cpu"), DistInfo())
    trainer.train_step = CapturedStep(trainer.train_step.parts, warmup=1, capture=False)
    with pytest.raises(FloatingPointError, match="loss is nan at step 3 "):
        trainer.fit()
    later = 1 if log_every == 0 else 0
    assert trainer.step == 3 + later and model.calls == 4 + later  # no step after that was run


def test_bench_timer_is_not_fooled_by_a_slow_cold_call():
    # A fast op whose first call is slow (lazy kernel loading) gets the full repetitions; a slow op gets a few.
    import time

    from benchmarks import BenchContext

    ctx, calls = BenchContext(torch.device("cpu")), []

    def cold_then_fast():
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.1)

    assert ctx.time(cold_then_fast, warmup=10, reps=50) < 5.0 and len(calls) == 60
    calls.clear()
    assert ctx.time(lambda: (calls.append(1), time.sleep(0.06)), warmup=10, reps=50) >= 60.0
    assert len(calls) == 5  # the cold call, the timed check, 3 repetitions


def test_importing_the_trainer_and_the_cli_leaves_out_what_training_does_not_need_yet(tmp_path):
    code = f"""
import sys
from pathlib import Path
import lss.cli
assert [m for m in ("torch", "importlib.metadata", "subprocess") if m in sys.modules] == [], "lss.cli"
import lss.engine.train
heavy = ("matplotlib", "nuscenes", "scipy", "sklearn", "shapely", "tensorboard", "torch.utils.tensorboard", "onnx",
         "onnxruntime", "lss.viz", "lss.export", "benchmarks")
assert [m for m in heavy if m in sys.modules] == [], [m for m in heavy if m in sys.modules]
from lss.engine.hooks import MetricsWriter
writer = MetricsWriter(Path({str(tmp_path)!r}), None)
assert "torch.utils.tensorboard" not in sys.modules, "tensorboard before the first record"
writer.write("train", 1, {{"loss": 1.0}})
writer.close()
assert "torch.utils.tensorboard" in sys.modules
print("clean")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "clean", out.stderr[-2000:]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.parametrize("overrides, cpu, cuda", [
    (["train.cuda_graph=true"], "lss", "lss_cuda_graph"),
    (["train.cuda_graph=auto"], "lss", "lss_cuda_graph"),
    (["train.cuda_graph=auto", "train.grad_accum=2"], "lss", "lss"),  # auto: eager where the graph cannot serve
    (["train.cuda_graph=auto", "train.compile=true"], "lss", "lss_cuda_graph_compiled"),
    (["train.cuda_graph=false", "train.compile=true"], "lss", "lss_compiled"),
    (["train.cuda_graph=false", "train.amp=none"], "lss_fp32", "lss_fp32"),
])
def test_step_alone_runs_the_step_the_config_trains_with(overrides, cpu, cuda):
    from benchmarks.train_loop import step_impl

    cfg = load_config("configs/synthetic_segmentation.yaml", overrides)
    assert (step_impl(cfg, torch.device("cpu")), step_impl(cfg, torch.device("cuda"))) == (cpu, cuda)
