"""What a user can rely on: a second process, a full disk, a killed generate, a stale cache and sizes
beyond the machine end in a refusal that says what to do, never in lost or mixed-up files."""
import errno
import os
import pickle
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import devices

from lss.cli import main
from lss.config import load_config
from lss.data import index_cache
from lss.engine.run_dir import LOCK_FILE, lock_run_dir, open_run_dir
from lss.errors import ArgumentError, ConfigError, RunDirInUseError
from lss.export.exporter import replacing
from lss.config.memory import check_render_memory, host_memory, size_text, training_needs


# ----------------------------------------------------------------------------------- run-directory lock
def hold_lock(run_dir, fork_child=False):
    """A process that locks `run_dir` and sleeps (with fork_child, after forking a child that sleeps
    too); returns (process, pid of its child or None) once the lock is held."""
    script = textwrap.dedent(f"""
        import os, time
        from lss.engine.run_dir import lock_run_dir
        lock = lock_run_dir({str(run_dir)!r})
        child = os.fork() if {fork_child} else -1
        if child == 0:  # its fork handlers have run when fork returns here
            os.write(1, b"forked\\n")
            time.sleep(60)
            os._exit(0)
        os.write(1, f"locked {{child}}\\n".encode())  # one write: the child writes too
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    lines = [proc.stdout.readline().split() for _ in range(2 if fork_child else 1)]
    (locked,) = [line for line in lines if line[0] == "locked"]
    return proc, (int(locked[1]) if fork_child else None)


def stop(proc):
    proc.kill()
    proc.wait()
    proc.stdout.close()


def test_a_second_process_is_refused_with_the_holders_pid_until_the_holder_dies(tmp_path):
    run_dir = tmp_path / "run"
    proc, _ = hold_lock(run_dir)
    try:
        with pytest.raises(RunDirInUseError, match=rf"in use by .*pid {proc.pid} on "):
            lock_run_dir(run_dir)
    finally:
        proc.send_signal(signal.SIGKILL)  # no clean-up runs: the kernel drops the lock
        stop(proc)
    with lock_run_dir(run_dir) as lock:
        assert lock.held and (run_dir / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} ")
    with lock_run_dir(run_dir):  # released by the context manager
        pass


def test_a_forked_child_does_not_keep_a_dead_trainers_lock(tmp_path):
    run_dir = tmp_path / "run"
    proc, child = hold_lock(run_dir, fork_child=True)
    try:
        stop(proc)
        os.kill(child, 0)  # the child (a loader worker, say) is still alive
        with lock_run_dir(run_dir) as lock:
            assert lock.held
    finally:
        os.kill(child, signal.SIGKILL)


def test_other_torchrun_ranks_share_the_directory(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    with lock_run_dir(run_dir):
        monkeypatch.setenv("RANK", "1")
        assert not lock_run_dir(run_dir).held


def test_a_refused_run_releases_the_lock_and_leaves_no_directory(tmp_path):
    run_dir = tmp_path / "new"
    with pytest.raises(FileNotFoundError, match="--resume"):
        open_run_dir(run_dir, resume=True, overwrite=False)
    assert not run_dir.exists()
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ArgumentError, match="already holds a run"):
        open_run_dir(run_dir, resume=False, overwrite=False)
    with lock_run_dir(run_dir):  # not held by the refused call
        pass


def test_lss_train_into_a_live_directory_is_refused_at_once_and_deletes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text('{"step": 10}\n')
    config = tmp_path / "config.yaml"
    config.write_text(f"data: {{dataroot: {tmp_path / 'no_data'}}}\ntrain: {{device: cpu}}\n")
    proc, _ = hold_lock(run_dir)
    try:
        started = time.perf_counter()
        rc = main(["train", "--config", str(config), "--out", str(run_dir), "--overwrite"])
        seconds = time.perf_counter() - started
    finally:
        stop(proc)
    err = capsys.readouterr().err
    assert rc == 2 and f"pid {proc.pid}" in err and "choose another --out" in err
    assert seconds < 30 and metrics.read_text() == '{"step": 10}\n'
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE, "metrics.jsonl"]


# --------------------------------------------------------------------------------------- atomic writes
def test_a_full_disk_keeps_the_previous_file_and_leaves_no_temp_file(tmp_path):
    out = tmp_path / "model.onnx"
    out.write_bytes(b"the previous export")
    with pytest.raises(OSError, match=rf"could not write {out} .*the existing file there is "
                                      "unchanged; free some space"):
        with replacing(out) as tmp:
            tmp.write_bytes(b"half a mod")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert out.read_bytes() == b"the previous export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]
    with replacing(out) as tmp:
        tmp.write_bytes(b"the new export")
    assert out.read_bytes() == b"the new export" and len(list(tmp_path.iterdir())) == 1


def test_an_interrupted_write_keeps_the_previous_file(tmp_path):
    out = tmp_path / "model.onnx"
    out.write_bytes(b"the previous export")
    with pytest.raises(KeyboardInterrupt):
        with replacing(out) as tmp:
            tmp.write_bytes(b"half")
            raise KeyboardInterrupt
    assert out.read_bytes() == b"the previous export" and len(list(tmp_path.iterdir())) == 1


# --------------------------------------------------------------------------------------- make-synthetic
SMALL = dict(scenes=2, samples_per_scene=1, image_size=(64, 36), workers=1)


def fail_on_second_sample(monkeypatch):
    from lss.data.synthetic import pipeline

    real, calls = pipeline.render_sample, []

    def render_sample(task):
        calls.append(task)
        if len(calls) == 2:
            raise MemoryError("out of memory in the renderer")
        return real(task)

    monkeypatch.setattr(pipeline, "render_sample", render_sample)


def test_a_generate_that_fails_part_way_leaves_no_half_set(tmp_path, monkeypatch):
    from lss.data.synthetic import generate

    fail_on_second_sample(monkeypatch)
    out = tmp_path / "set"
    with pytest.raises(MemoryError):
        generate(out, **SMALL)
    assert list(out.iterdir()) == []


def test_a_failed_forced_generate_keeps_the_earlier_set(tmp_path, monkeypatch):
    from lss.data.synthetic import generate

    out = generate(tmp_path / "set", **SMALL)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    fail_on_second_sample(monkeypatch)
    with pytest.raises(MemoryError):
        generate(out, force=True, **{**SMALL, "seed": 1})
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_the_staging_folder_of_a_killed_generate_is_removed(tmp_path):
    from lss.data.synthetic import generate
    from lss.data.synthetic.pipeline import STAGING, STAGING_LOCK

    out = tmp_path / "set"
    stale = out / f"{STAGING}{socket.gethostname()}-1234"
    (stale / "samples").mkdir(parents=True)
    (stale / STAGING_LOCK).write_text("")  # its writer is gone: nobody holds the lock
    generate(out, **SMALL)
    assert not stale.exists() and (out / "v1.0-mini" / "sample.json").is_file()


# ------------------------------------------------------------------------------------------ index cache
@pytest.mark.parametrize("content", [
    pickle.dumps([1, 2, 3]),
    pickle.dumps({"sample_tokens": []}),
    pickle.dumps({"format": index_cache.FORMAT, "key": "another key", "fields": {"a": 1}}),
    pickle.dumps({"format": index_cache.FORMAT, "key": "KEY", "fields": {"a": 1}}),  # field missing
    pickle.dumps({"format": index_cache.FORMAT, "key": "KEY", "fields": {"a": 1, "b": 2}})[:-9],
    b"\x80\x05\x95garbage",
    b"",
])
def test_an_index_cache_file_of_another_shape_is_not_used(tmp_path, monkeypatch, content):
    monkeypatch.setenv("LSS_CACHE_DIR", str(tmp_path))
    index_cache.save_index("KEY", {"a": 1, "b": 2})
    assert index_cache.load_index("KEY", ("a", "b")) == {"a": 1, "b": 2}
    (tmp_path / "index" / "KEY.pkl").write_bytes(content)
    assert index_cache.load_index("KEY", ("a", "b")) is None


# -------------------------------------------------------------------------------------- memory estimate
def test_a_grid_beyond_the_machines_memory_is_refused_when_the_config_loads():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.device=cpu", "grid.xbound=[-50.0, 50.0, 0.001]",
                           "grid.ybound=[-50.0, 50.0, 0.001]"])
    message = str(info.value)
    assert message.startswith("grid.xbound/grid.ybound/grid.zbound: the BEV grid of 100000 x 100000")
    assert "TiB for one sample" in message and "coarser cell size" in message


def test_depth_bins_beyond_the_machines_memory_are_refused_without_making_them():
    with pytest.raises(ConfigError, match=r"^grid.dbound/data.final_dim: .* depth bins .*need at "
                                          r"least .* for one sample .*larger depth step"):
        load_config(None, ["train.device=cpu", "grid.dbound=[4.0, 45.0, 1e-9]"])


def test_the_cli_prints_the_refusal_in_one_line(capsys):
    rc = main(["config", "show", "--set", "train.device=cpu", "--set", "data.final_dim=[320000, 320000]"])
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and err[0].startswith("lss config: error: data.final_dim: camera inputs of 320000 x ")
    assert f"more than this machine's memory ({size_text(host_memory())})" in err[0]


def test_the_training_batch_is_checked_against_the_devices_memory_before_anything_is_built(tmp_path):
    from lss.engine.train import train

    # about 0.66 GB per sample on the CPU: a batch of 4096 cannot fit here, one sample can
    cfg = load_config(None, ["train.device=cpu", "grid.xbound=[-50.0, 50.0, 0.1]",
                             "grid.ybound=[-50.0, 50.0, 0.1]", "train.batch_size=4096"])
    assert sum(n.size for n in training_needs(cfg, 4096, "cpu")) > host_memory()

    def no_dataset(*args):
        raise AssertionError("built a dataset for a batch that cannot fit")

    with pytest.raises(ConfigError, match=r"BEV grid of 1000 x 1000 x 1 cells .* for a batch of 4096 "
                                          r"\(train.batch_size\)"):
        train(cfg, out_dir=str(tmp_path / "run"), dataset_fn=no_dataset)


def test_an_input_beyond_the_hosts_memory_is_refused_in_one_line_before_anything_is_built(tmp_path, monkeypatch,
                                                                                          capsys):
    monkeypatch.setattr("lss.config.memory.host_memory", lambda: 16 * 2**30)
    root = tmp_path / "synthetic"
    rc = main(["train", "--config", "configs/synthetic_segmentation.yaml", "--set", "data.final_dim=[32,96000]", "--set",
               "train.device=cpu", "--set", f"data.dataroot={root}", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and err[0] == (
        "lss train: error: data.final_dim: camera inputs of 32 x 96000 pixels (6 cameras x 1 samples: images and the "
        "camera trunk's maps) need at least 26.0 GiB for one sample (26.2 GiB with the rest "
        "of the network's largest tensors), more than this machine's memory (16.0 GiB); use a smaller "
        "data.final_dim")
    assert not root.exists() and not (tmp_path / "run").exists()  # no synthetic set generated, no run directory


@torch.no_grad()
def test_the_estimate_counts_no_more_than_the_tensors_it_names():
    """Each share against the real tensors of a small float32 step: frustum points and their lookup
    table, the pooled grid and the BEV encoder's maps, the camera images and the maps the camera trunk
    keeps for the backward pass."""
    from lss.geometry import BevGrid, FrustumLUT, frustum, frustum_to_ego
    from lss.models.bev import BevEncoder
    from lss.models.camera import EfficientNetTrunk

    cfg = load_config(None, ["train.device=cpu", "data.final_dim=[64, 128]", "train.amp=none",
                             "grid.xbound=[-16.0, 16.0, 0.5]", "grid.ybound=[-16.0, 16.0, 0.5]",
                             "model.context_channels=8"])
    batch, cameras, classes = 2, len(cfg.data.cameras), len(cfg.data.classes)
    bev, points, camera = training_needs(cfg, batch, "cpu")
    grid = BevGrid.from_config(cfg.grid)
    fr = frustum(cfg.data.final_dim, cfg.model.downsample, cfg.grid.dbound).float()
    eye = torch.eye(3).expand(batch, cameras, 3, 3)
    zero = torch.zeros(batch, cameras, 3)
    ego = frustum_to_ego(fr, eye, eye, zero, eye, zero)
    lut = FrustumLUT.build(ego, grid)
    depth = torch.rand(batch, cameras, *fr.shape[:3])
    assert points.size == ego.nbytes + lut.point_cell.nbytes + lut.sorted_points.nbytes + depth.nbytes

    pooled = torch.rand(batch, grid.nz * cfg.model.context_channels, grid.nx, grid.ny)
    encoder = BevEncoder(pooled.shape[1]).eval()
    maps = [pooled, lut.cell_start, encoder.stem(pooled), encoder(pooled)]
    maps += [torch.zeros(batch, classes, grid.nx, grid.ny)] * 2  # targets and logits
    actual = sum(t.nbytes for t in maps)
    assert actual - 4 <= bev.size <= actual  # cell_start has one offset more than cells

    images = torch.rand(batch * cameras, 3, *cfg.data.final_dim)
    trunk = EfficientNetTrunk().train()
    weights = {w.data_ptr() for w in trunk.parameters()}
    kept = {}  # the activations the trunk's training forward keeps for backward, once each
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
            lambda t: kept.setdefault((t.data_ptr(), t.shape), t.nbytes) and t, lambda t: t):
        trunk(images.requires_grad_())
    maps = sum(size for (pointer, _), size in kept.items() if pointer not in weights and pointer != images.data_ptr())
    stem = trunk.net._conv_stem(images)
    assert images.nbytes + 3 * stem.nbytes < camera.size <= images.nbytes + maps


@pytest.mark.parametrize("downsample", [8, 16])
def test_the_estimate_of_the_resnet18_trunk_counts_no_more_than_it_keeps(downsample):
    from lss.models.camera import ResNetTrunk

    cfg = load_config(None, ["train.device=cpu", "data.final_dim=[64, 128]", "train.amp=none",
                             "model.backbone=resnet18", f"model.downsample={downsample}"])
    batch, cameras = 2, len(cfg.data.cameras)
    camera = training_needs(cfg, batch, "cpu")[2]
    images = torch.rand(batch * cameras, 3, *cfg.data.final_dim)
    trunk = ResNetTrunk(downsample).train()
    weights = {w.data_ptr() for w in trunk.parameters()}
    kept = {}
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
            lambda t: kept.setdefault((t.data_ptr(), t.shape), t.nbytes) and t, lambda t: t):
        trunk(images.requires_grad_())
    maps = sum(size for (pointer, _), size in kept.items() if pointer not in weights and pointer != images.data_ptr())
    stem = trunk.stem[0](images)
    assert images.nbytes + 2 * stem.nbytes < camera.size <= images.nbytes + maps


def test_synthetic_images_beyond_the_machines_memory_are_refused_before_writing(tmp_path):
    from lss.data.synthetic import generate
    from lss.data.synthetic.render import CameraModel
    from lss.data.synthetic.rig import load_rig
    from lss.config.memory import RENDER_BYTES_PER_PIXEL

    kept = CameraModel(load_rig((64, 36))["CAM_FRONT"])
    arrays = [v for v in vars(kept).values() if hasattr(v, "nbytes") and getattr(v, "ndim", 0) >= 2]
    assert sum(a.nbytes for a in arrays) >= RENDER_BYTES_PER_PIXEL * 64 * 36
    with pytest.raises(ArgumentError, match=r"^image_size \(--image-size\): synthetic camera images of "
                                            r"200000 x 100000 pixels .*smaller image size"):
        generate(tmp_path / "set", image_size=(200000, 100000))
    assert not (tmp_path / "set" / "samples").exists()
    with pytest.raises(ConfigError, match="data.synthetic.image_size"):
        check_render_memory((1600, 900), "data.synthetic.image_size", available=10**6)


# --------------------------------------------------------------------------------------- op arguments
def test_op_arguments_of_the_wrong_kind_are_named():
    from lss.ops import batched_nms, nms, roi_align, roi_pool, sigmoid_focal_loss

    boxes, scores = torch.tensor([[0.0, 0.0, 2.0, 2.0], [0.0, 0.0, 2.0, 2.1]]), torch.tensor([0.9, 0.8])
    features, rois = torch.rand(1, 2, 8, 8), torch.tensor([[0.0, 1.0, 1.0, 5.0, 5.0]])
    cases = [
        (lambda: nms(boxes, scores, "abc"), TypeError, "lss.ops.nms: iou_threshold must be a number, got 'abc'"),
        (lambda: batched_nms(boxes, scores, torch.zeros(2, dtype=torch.long), None), TypeError,
         "lss.ops.batched_nms: iou_threshold must be a number, got None"),
        (lambda: roi_align(features, rois, 2.5), ValueError,
         "lss.ops.roi_align: output_size must be a positive int or an (h, w) pair of positive ints, got 2.5"),
        (lambda: roi_pool(features, rois, (2, 2.5)), ValueError, "lss.ops.roi_pool: output_size must be"),
        (lambda: roi_align(features, rois, 2, spatial_scale="1/8"), TypeError,
         "lss.ops.roi_align: spatial_scale must be a number, got '1/8'"),
        (lambda: roi_align(features, rois, 2, sampling_ratio=1.5), ValueError,
         "lss.ops.roi_align: sampling_ratio must be an integer, got 1.5"),
        (lambda: sigmoid_focal_loss(scores, scores, alpha="0.25"), TypeError,
         "lss.ops.sigmoid_focal_loss: alpha must be a number, got '0.25'"),
    ]
    for call, error, message in cases:
        with pytest.raises(error) as info:
            call()
        assert str(info.value).startswith(message), str(info.value)
    # numbers of other kinds still work: a tensor threshold, an integral float ratio
    assert nms(boxes, scores, torch.tensor(0.5)).tolist() == [0]
    assert roi_align(features, rois, 2, sampling_ratio=2.0).shape == (1, 2, 2, 2)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("impl", ["bev_pool", "bev_pool_reference"])
def test_bev_pool_of_an_empty_batch_is_empty(impl, device):
    import lss.ops
    from lss.geometry import BevGrid, FrustumLUT, frustum, frustum_to_ego

    grid = BevGrid((-8.0, 8.0, 1.0), (-8.0, 8.0, 1.0), (-10.0, 10.0, 20.0))
    fr = frustum((32, 64), 16, (4.0, 20.0, 4.0)).float().to(device)
    eye, zero = torch.eye(3, device=device).expand(0, 2, 3, 3), torch.zeros(0, 2, 3, device=device)
    lut = FrustumLUT.build(frustum_to_ego(fr, eye, eye, zero, eye, zero), grid)
    depth = torch.rand(0, 2, *fr.shape[:3], device=device, requires_grad=True)
    feat = torch.rand(0, 2, 5, *fr.shape[1:3], device=device, requires_grad=True)
    out = getattr(lss.ops, impl)(depth, feat, lut)
    assert out.shape == (0, 5, 16, 16)
    out.sum().backward()
    assert depth.grad.shape == depth.shape and feat.grad.shape == feat.shape


@pytest.mark.cuda
def test_a_batch_beyond_the_gpus_memory_is_refused_naming_the_gpu():
    from lss.config.memory import check_device_memory

    cfg = load_config(None, ["train.device=cuda", "grid.xbound=[-50.0, 50.0, 0.1]",
                             "grid.ybound=[-50.0, 50.0, 0.1]", "train.batch_size=4096"])
    with pytest.raises(ConfigError, match=r"for a batch of 4096 \(train.batch_size\) .*more than the memory of "
                                          r"cuda:0 \(.*\) \(\d+\.\d GiB\)"):
        check_device_memory(cfg, torch.device("cuda", 0))
    check_device_memory(load_config(None, ["train.device=cuda"]), torch.device("cuda", 0))
