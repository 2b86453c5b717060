"""The original LSS code as a row of the accuracy benchmark (benchmarks/original_lss.py): the grid alignment,
lss's evaluation of another model's logits, the harness's recipe plumbing and the skip without a checkout. The
tests that run the original code itself need a checkout of nv-tlabs/lift-splat-shoot named by LSS_ORIGINAL_LSS
(they are skipped without one)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import accuracy
from benchmarks.original_lss import (
    SharedEvaluation,
    align_to_lss_grid,
    check_checkout,
    recipe_settings,
    scored_by,
    without_imagenet_weights,
)

ROOT = Path(__file__).resolve().parents[1]
CHECKOUT = os.environ.get("LSS_ORIGINAL_LSS")
needs_checkout = pytest.mark.skipif(
    not CHECKOUT, reason="set LSS_ORIGINAL_LSS to a checkout of nv-tlabs/lift-splat-shoot"
)
SMALL = (-16.0, 16.0, 1.0)  # the quick runs' grid: 32 x 32 cells of 1 m


def test_alignment_samples_the_logits_at_lss_cell_centres():
    n, a, b, c = 6, 0.7, -1.3, 0.25
    i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    ramp = torch.tensor(a * i + b * j + c, dtype=torch.float32).expand(2, 3, n, n)
    got = align_to_lss_grid(ramp)
    # a linear map interpolates exactly: the value at (i + 0.5, j + 0.5), the last cells held at the edge
    ie, je = np.minimum(i + 0.5, n - 1), np.minimum(j + 0.5, n - 1)
    want = torch.tensor(a * ie + b * je + c, dtype=torch.float32).expand(2, 3, n, n)
    torch.testing.assert_close(got, want)
    assert got.shape == ramp.shape


def test_alignment_moves_a_box_from_the_original_cell_points_to_lss_cell_centres():
    """Logits that are a smooth function of the ego position, sampled where the original's cells stand (cell i at
    xmin + i * dx), are after the alignment positive exactly in the cells whose centre (xmin + (i + 0.5) * dx, lss's
    convention) lies in the box; cell by cell they are off."""
    lo, hi = np.array([1.05, -3.95]), np.array([5.95, -1.05])  # metres: edges 0.45 m from the centres

    def inside(x, y):  # signed distance-like: > 0 inside the box, linear near each edge
        return np.minimum(np.minimum(x - lo[0], hi[0] - x), np.minimum(y - lo[1], hi[1] - y))

    corner = SMALL[0] + np.arange(32) * SMALL[2]
    logits = torch.tensor(inside(*np.meshgrid(corner, corner, indexing="ij")), dtype=torch.float32)[None, None]
    centre = corner + SMALL[2] / 2
    want = inside(*np.meshgrid(centre, centre, indexing="ij")) > 0
    assert want.sum() == 5 * 3  # x centres 1.5..5.5, y centres -3.5..-1.5
    np.testing.assert_array_equal(align_to_lss_grid(logits)[0, 0].numpy() > 0, want)
    assert ((logits[0, 0].numpy() > 0) != want).sum() >= 6


class TableModel(torch.nn.Module):
    """A fake model: the logits of sample k come from a table; its input carries k."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return self.table[index]


def _numpy_iou(logits: torch.Tensor, truth: np.ndarray, threshold: float) -> float:
    pred = torch.sigmoid(logits).numpy() > threshold
    return float((pred & truth).sum() / (pred | truth).sum())


def test_lss_evaluation_of_fake_logits_follows_the_sample_order(synthetic_root):
    shared = SharedEvaluation(synthetic_root, "v1.0-mini", SMALL, SMALL)
    tokens = [str(t) for t in shared.dataset.sample_tokens][::-1]  # another order than lss's
    truth = np.stack([shared.dataset.bev_targets(shared.row[t]) for t in tokens]) > 0.5
    assert len(tokens) == 3 and truth.any() and not (truth[0] == truth[1]).all()
    # the logits of a perfect model in lss's own convention: cell by cell, every sample right
    table = torch.tensor(np.where(truth, 5.0, -5.0), dtype=torch.float32)
    model = TableModel(table)
    with scored_by(model, shared, tokens):
        for start in range(0, len(tokens), 2):
            model(torch.arange(start, min(start + 2, len(tokens))))
    result = shared.compute()
    assert result["samples"] == 3 and result["cellwise"]["iou"]["vehicle"] == 1.0
    aligned = align_to_lss_grid(table)
    assert result["iou"]["vehicle"] == pytest.approx(_numpy_iou(aligned, truth, 0.5))
    assert result["sweep"]["0.3"]["vehicle"] == pytest.approx(_numpy_iou(aligned, truth, 0.3))
    assert result["iou"]["vehicle"] < 1.0


def test_lss_evaluation_refuses_incomplete_passes_and_other_grids(synthetic_root):
    shared = SharedEvaluation(synthetic_root, "v1.0-mini", SMALL, SMALL)
    tokens = [str(t) for t in shared.dataset.sample_tokens]
    model = TableModel(torch.zeros(4, 1, 32, 32))
    with pytest.raises(RuntimeError, match="saw 2 of the 3 validation samples"):
        with scored_by(model, shared, tokens):
            model(torch.arange(2))
    with pytest.raises(RuntimeError, match="more predictions than the 3 validation samples"):
        with scored_by(model, shared, tokens):
            model(torch.arange(2))
            model(torch.arange(2))
    with pytest.raises(ValueError, match="the grids or classes differ"):
        shared.update(torch.zeros(1, 1, 16, 16), tokens[:1])
    with pytest.raises(KeyError, match="not in lss's val split"):
        shared.update(torch.zeros(1, 1, 32, 32), ["no-such-token"])


def test_recipe_settings_are_the_train_defaults_with_overrides():
    def train(version, dataroot="/data", nepochs=10, gpuid=1, lr=1e-3, bsz=4, final_dim=(128, 352)):
        raise AssertionError("not called")

    assert recipe_settings(train) == {"lr": 1e-3, "bsz": 4, "final_dim": (128, 352)}
    got = recipe_settings(train, ["bsz=2", "final_dim=[32, 96]", "lr=2.0e-3"])
    assert got == {"lr": 2e-3, "bsz": 2, "final_dim": [32, 96]}
    with pytest.raises(ValueError, match=r"--set 'gpuid=0'.*\['bsz', 'final_dim', 'lr'\]"):
        recipe_settings(train, ["gpuid=0"])


def test_the_camera_encoder_is_built_without_imagenet_weights(monkeypatch):
    from efficientnet_pytorch import EfficientNet, model

    def no_download(*args, **kwargs):
        raise AssertionError("pretrained weights were requested")

    monkeypatch.setattr(model, "load_pretrained_weights", no_download)
    torch.manual_seed(0)
    with without_imagenet_weights():
        net = EfficientNet.from_pretrained("efficientnet-b0")
    torch.manual_seed(0)
    ref = EfficientNet.from_name("efficientnet-b0")
    assert net.state_dict().keys() == ref.state_dict().keys()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(net.state_dict()[key], value)
    with pytest.raises(AssertionError, match="pretrained weights were requested"):
        EfficientNet.from_pretrained("efficientnet-b0")  # restored on leaving


def _fake_checkout(path: Path) -> Path:
    for name in ("__init__.py", "data.py", "models.py", "tools.py", "train.py"):
        (path / "src").mkdir(parents=True, exist_ok=True)
        (path / "src" / name).write_text("")
    return path


def test_harness_arguments(tmp_path):
    parse = accuracy.build_parser().parse_args
    opts = accuracy.options_from_args(parse(["--recipe", "original", "--recipe", "paper"]))
    assert [r.name for r in opts.recipes] == ["original", "paper"] and opts.recipes[0].is_original
    assert opts.dataset == accuracy.BENCHMARK_SET and opts.data_dir == "data/benchmark_accuracy"
    assert opts.original_lss is None
    args = ["--set", "screen", "--seeds", "0", "--parallel", "8", "--workers", "1", "--steps", "300"]
    checkout = _fake_checkout(tmp_path / "lift-splat-shoot")
    opts = accuracy.options_from_args(parse(args + ["--original-lss", str(checkout)]))
    assert opts.dataset == accuracy.SCREEN_SET and opts.data_dir == "data/screen_accuracy"
    assert (opts.seeds, opts.parallel, opts.workers, opts.steps) == ((0,), 8, 1, 300)
    assert opts.original_lss == str(checkout.resolve())
    with pytest.raises(ValueError, match=r"not a checkout of nv-tlabs/lift-splat-shoot .*src/__init__.py"):
        accuracy.options_from_args(parse(["--original-lss", str(tmp_path)]))
    with pytest.raises(SystemExit):
        parse(["--set", "nonesuch"])
    # the confirmation set: the benchmark set's size and version, another seed, its own directory
    opts = accuracy.options_from_args(parse(["--set", "confirm", "--recipe", "default"]))
    assert opts.dataset == accuracy.CONFIRM_SET and opts.data_dir == "data/confirm_accuracy"
    assert (opts.dataset.version, opts.dataset.scenes, opts.dataset.samples_per_scene, opts.dataset.image_size) == (
        "v1.0-trainval", 40, 40, (1600, 900))
    assert opts.dataset.seed != accuracy.BENCHMARK_SET.seed and [r.name for r in opts.recipes] == ["default"]


def test_a_set_directory_holds_one_set(tmp_path):
    """A directory generated for one named set is refused for another: the two 40-scene sets differ only by seed."""
    from benchmarks._runs import ensure_synthetic_set

    root = tmp_path / "set"
    (root / "v1.0-trainval").mkdir(parents=True)
    (root / "v1.0-trainval" / "sample.json").write_text("[]")
    (root / "benchmark_set.json").write_text(json.dumps(accuracy.BENCHMARK_SET.describe()))
    assert ensure_synthetic_set(root, accuracy.BENCHMARK_SET) == 0.0
    with pytest.raises(ValueError, match="holds a synthetic set made with .*'seed': 11.*pass another data directory"):
        ensure_synthetic_set(root, accuracy.CONFIRM_SET)


def test_original_recipes_become_driver_commands(tmp_path):
    opts = accuracy.AccuracyOptions(out_dir=str(tmp_path), steps=2000, eval_every=500, workers=2)
    opts.original_lss = "/checkout"
    recipe = accuracy.parse_recipe("orig6=original_4k,ncams=6")
    assert (recipe.config, recipe.overrides) == ("original", ("train.max_steps=4000", "ncams=6"))
    cmd = accuracy.run_command(opts, recipe, seed=1, run_dir=tmp_path / "run")
    assert cmd[:3] == [sys.executable, "-m", "benchmarks.original_lss"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--checkout"] == "/checkout" and flags["--steps"] == "4000" and flags["--seed"] == "1"
    assert flags["--version"] == "v1.0-trainval" and flags["--eval-every"] == "500"
    assert flags["--workers"] == "2" and flags["--set"] == "ncams=6" and "--device" not in flags
    opts.quick = True
    quick = accuracy.run_command(opts, accuracy.parse_recipe("original"), 0, tmp_path / "run")
    assert "cpu" in quick and "--steps" in quick and quick[quick.index("--steps") + 1] == "2000"
    assert [quick[k + 1] for k, v in enumerate(quick) if v == "--set"] == list(accuracy.QUICK_ORIGINAL)
    lss_cmd = accuracy.run_command(opts, accuracy.parse_recipe("paper"), 0, tmp_path / "run")
    assert lss_cmd[1:3] == ["-m", "lss"] and "--overwrite" in lss_cmd
    more = accuracy.run_command(opts, accuracy.parse_recipe("o=original,data.workers=5"), 0, tmp_path)
    assert more[more.index("--workers") + 1] == "5" and "data.workers=5" not in more


def test_original_recipe_is_skipped_without_a_checkout(tmp_path, monkeypatch, capsys):
    sweep = {"0.5": {"vehicle": 0.2}}
    started = []

    def train_runs(opts):
        started.extend(r.name for r in opts.recipes)
        return [{"recipe": "a", "seed": 0, "status": "ok", "iou": {"vehicle": 0.2}, "sweep": sweep,
                 "best": accuracy.best_thresholds(sweep), "curve": [{"step": 2, "iou": {"vehicle": 0.2}}]}]

    monkeypatch.setattr(accuracy, "train_runs", train_runs)
    monkeypatch.setattr(accuracy, "ensure_synthetic_set", lambda *a, **k: 0.0)
    monkeypatch.setattr(accuracy, "plot_curves", lambda *a, **k: None)
    opts = accuracy.AccuracyOptions(out_dir=str(tmp_path), seeds=(0,),
                                    recipes=[accuracy.parse_recipe("original"), accuracy.parse_recipe("a=x.yaml")])
    result = accuracy.benchmark(opts)
    assert started == ["a"]
    assert [(r["recipe"], r["status"]) for r in result["runs"]] == [("original", "skipped"), ("a", "ok")]
    assert "recipe original skipped: it runs the original LSS code" in capsys.readouterr().out
    md = (tmp_path / "accuracy.md").read_text()
    assert "SKIPPED: original seed 0: it runs the original LSS code" in md and "--original-lss PATH" in md
    assert list(result["summary"]["table"]) == ["a"]


def test_the_original_rows_carry_both_evaluations(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    val = {"threshold": 0.5, "iou": {"vehicle": 0.25}, "mean_iou": 0.25,
           "sweep": {"0.4": {"vehicle": 0.27}, "0.5": {"vehicle": 0.25}},
           "own": {"iou": {"vehicle": 0.23}, "loss": 0.4}, "cellwise": {"iou": {"vehicle": 0.18}}}
    (run_dir / "final.json").write_text(json.dumps({"val": val}))
    (run_dir / "metrics.jsonl").write_text(
        json.dumps({"kind": "train", "step": 4, "loss": 0.5}) + "\n"
        + json.dumps({"kind": "val", "step": 4, "iou": {"vehicle": 0.25}}) + "\n")
    runs = []
    for seed, scale in ((0, 1.0), (1, 1.2)):
        record = accuracy.collect_run(run_dir, accuracy.parse_recipe("original"), seed, 0, 1.0)
        record["iou"] = {"vehicle": 0.25 * scale}
        record["own_iou"] = {"vehicle": 0.23 * scale}
        runs.append(record)
    assert runs[0]["cellwise_iou"] == {"vehicle": 0.18} and runs[0]["steps"] == 4
    row = accuracy.summarize(runs)["table"]["original"]["vehicle"]
    np.testing.assert_allclose(row["iou_own"], [np.mean([0.23, 0.276]), np.std([0.23, 0.276], ddof=1)])
    np.testing.assert_allclose(row["iou_0.5"], [np.mean([0.25, 0.3]), np.std([0.25, 0.3], ddof=1)])
    np.testing.assert_allclose(row["iou_cellwise"][0], 0.18)


def _their_val_data(checkout: str, root: Path, grid: dict, final_dim=(32, 96), hw=(225, 400)):
    from benchmarks.original_lss import import_checkout, original_layout
    from lss.geometry import NUSCENES_CAMERAS

    src = import_checkout(checkout)
    nusc_root = original_layout(root, "v1.0-mini", root.parent / (root.name + "_original_layout"))
    from nuscenes.nuscenes import NuScenes

    nusc = NuScenes("v1.0-mini", str(nusc_root / "mini"), verbose=False)
    aug = {"resize_lim": (0.24, 0.26), "final_dim": final_dim, "rot_lim": (-5.4, 5.4), "H": hw[0], "W": hw[1],
           "rand_flip": True, "bot_pct_lim": (0.0, 0.22), "cams": list(NUSCENES_CAMERAS), "Ncams": 5}
    return src.data.SegmentationData(nusc, is_train=False, data_aug_conf=aug, grid_conf=grid)


@needs_checkout
def test_the_original_ground_truth_sits_half_a_cell_above_lss(synthetic_root):
    """Its masks, drawn at cell corners, are lss's moved by +0.5 cell along x and y (the median over the vehicles
    of the offset of each lss footprint to the nearest of the original's), with the same area."""
    import cv2

    grid = {"xbound": [-50.0, 50.0, 0.5], "ybound": [-50.0, 50.0, 0.5], "zbound": [-10.0, 10.0, 20.0],
            "dbound": [4.0, 45.0, 1.0]}
    theirs = _their_val_data(CHECKOUT, synthetic_root, grid)
    shared = SharedEvaluation(synthetic_root, "v1.0-mini", grid["xbound"], grid["ybound"])
    offsets, areas = [], []
    for rec in theirs.ixes:
        masks = theirs.get_binimg(rec)[0].numpy() > 0.5, shared.targets([rec["token"]])[0, 0].numpy() > 0
        areas.append([m.sum() for m in masks])
        (n_theirs, label_theirs), (n_ours, label_ours) = (cv2.connectedComponents(m.astype(np.uint8), connectivity=4)
                                                          for m in masks)
        centres = np.array([np.argwhere(label_theirs == k).mean(0) for k in range(1, n_theirs)])
        for k in range(1, n_ours):
            d = centres - np.argwhere(label_ours == k).mean(0)
            nearest = d[np.argmin(np.hypot(*d.T))]
            if np.hypot(*nearest) < 2:
                offsets.append(nearest)
    assert len(offsets) > 50
    np.testing.assert_allclose(np.median(offsets, 0), [0.5, 0.5], atol=0.1)
    areas = np.array(areas)
    np.testing.assert_allclose(areas[:, 0] / areas[:, 1], 1.0, atol=0.1)


@needs_checkout
@pytest.mark.slow
def test_the_quick_benchmark_trains_the_original_code(tmp_path):
    """benchmarks/original_lss.py through the harness on the tiny set: its loader, model and loss on the CPU,
    both evaluations in the table."""
    opts = accuracy.quick_options(str(tmp_path / "out"))
    opts.recipes, opts.seeds, opts.original_lss = [accuracy.parse_recipe("original")], (0,), CHECKOUT
    result = accuracy.benchmark(opts, {"device": "cpu"})
    (run,) = result["runs"]
    assert run["status"] == "ok", run.get("log_tail")
    assert set(run["own_iou"]) == {"vehicle"} and set(run["cellwise_iou"]) == {"vehicle"}
    assert [p["step"] for p in run["curve"]] == [2] and run["steps"] == 2
    final = json.loads((Path(run["run_dir"]) / "final.json").read_text())
    assert final["original"]["lr"] == 1e-3 and final["original"]["weight_decay"] == 1e-7
    assert final["original"]["max_grad_norm"] == 5.0 and final["original"]["pos_weight"] == 2.13
    assert (final["original"]["W"], final["original"]["H"]) == accuracy.QUICK_SET.image_size
    assert final["val"]["samples"] == 3
    assert "| original | 2 | vehicle |" in (tmp_path / "out" / "accuracy.md").read_text()


def test_the_driver_names_a_wrong_checkout(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.original_lss", "--checkout", str(tmp_path), "--dataroot", str(tmp_path),
         "--out", str(tmp_path / "run"), "--steps", "1"],
        cwd=ROOT, capture_output=True, text=True)
    assert done.returncode != 0 and "not a checkout of nv-tlabs/lift-splat-shoot" in done.stderr
    with pytest.raises(ValueError, match="clone https://github.com/nv-tlabs/lift-splat-shoot"):
        check_checkout(tmp_path)
