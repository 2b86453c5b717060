"""The accuracy benchmark: recipe parsing, the mean/std aggregation, and a quick CPU run end to end."""
import dataclasses
import json

import numpy as np
import pytest

from benchmarks import accuracy
from benchmarks.accuracy import best_thresholds, mean_std, parse_recipe, summarize


def test_mean_std_matches_numpy():
    values = [0.31, 0.342, 0.297, 0.365]
    mean, std = mean_std(values)
    assert mean == pytest.approx(np.mean(values)) and std == pytest.approx(np.std(values, ddof=1))
    assert mean_std([0.25]) == (0.25, None)
    with pytest.raises(ValueError):
        mean_std([])


def _run(seed, iou05, sweep, curve):
    return {"recipe": "r", "seed": seed, "status": "ok", "iou": {"vehicle": iou05}, "sweep": sweep,
            "best": best_thresholds(sweep), "curve": [{"step": s, "iou": {"vehicle": v}} for s, v in curve]}


def test_summarize_against_numpy():
    sweeps = [{"0.3": {"vehicle": 0.20}, "0.5": {"vehicle": 0.25}, "0.7": {"vehicle": 0.22}},
              {"0.3": {"vehicle": 0.31}, "0.5": {"vehicle": 0.30}, "0.7": {"vehicle": 0.10}},
              {"0.3": {"vehicle": 0.10}, "0.5": {"vehicle": 0.12}, "0.7": {"vehicle": 0.13}}]
    runs = [_run(s, sw["0.5"]["vehicle"], sw, [(10, 0.1 * (s + 1)), (20, 0.2 + s / 10), (30, 0.5)])
            for s, sw in enumerate(sweeps)]
    runs[2]["curve"] = runs[2]["curve"][1:]  # a seed without step 10: the curve keeps the common steps only
    runs.append({"recipe": "r", "seed": 9, "status": "failed"})
    row = summarize(runs)["table"]["r"]["vehicle"]
    np.testing.assert_allclose(row["iou_0.5"], [np.mean([0.25, 0.30, 0.12]), np.std([0.25, 0.30, 0.12], ddof=1)])
    np.testing.assert_allclose(row["iou_best"], [np.mean([0.25, 0.31, 0.13]), np.std([0.25, 0.31, 0.13], ddof=1)])
    assert row["best_threshold"] == pytest.approx(np.mean([0.5, 0.3, 0.7])) and row["seeds"] == [0, 1, 2]
    curve = summarize(runs)["curves"]["r"]["vehicle"]
    assert curve["steps"] == [20, 30]
    np.testing.assert_allclose(curve["mean"], [np.mean([0.2, 0.3, 0.4]), 0.5])
    np.testing.assert_allclose(curve["std"], [np.std([0.2, 0.3, 0.4], ddof=1), 0.0], atol=1e-12)


def test_parse_recipe():
    paper = parse_recipe("paper")
    assert paper.config == "configs/lss_paper.yaml" and paper.overrides == ()
    r = parse_recipe("wide=configs/lss_paper.yaml,data.final_dim=[256, 704],optim.lr=0.002")
    assert (r.name, r.config, r.overrides) == ("wide", "configs/lss_paper.yaml",
                                              ("data.final_dim=[256, 704]", "optim.lr=0.002"))
    assert parse_recipe("flip=paper,data.bev_flip=true").config == "configs/lss_paper.yaml"
    with pytest.raises(ValueError, match="named recipes"):
        parse_recipe("nonesuch")


def test_a_recipes_own_max_steps_wins_over_the_benchmark_steps():
    opts = accuracy.AccuracyOptions(out_dir="unused", steps=2000)
    overrides = accuracy.run_overrides(opts, parse_recipe("default_4k"), seed=1)
    steps = [o for o in overrides if o.startswith("train.max_steps=")]
    assert steps == ["train.max_steps=2000", "train.max_steps=4000"]  # the later one wins in the config loader
    from lss.config import load_config

    cfg = load_config("configs/synthetic_segmentation.yaml", overrides)
    assert cfg.train.max_steps == 4000 and cfg.train.seed == 1


@pytest.mark.slow
def test_quick_benchmark_writes_table_json_and_plot(tmp_path):
    opts = accuracy.quick_options(str(tmp_path / "out"))
    opts.recipes = [parse_recipe("paper"), parse_recipe("default"),
                    parse_recipe("broken=configs/lss_paper.yaml,optim.no_such_key=1")]
    opts.time_to = ("vehicle", 0.5)
    result = accuracy.benchmark(opts, {"device": "cpu"})
    out = tmp_path / "out"
    saved = json.loads((out / "accuracy.json").read_text())
    assert saved["settings"]["seeds"] == [0, 1] and list(saved["settings"]["recipes"]) == ["paper", "default",
                                                                                         "broken"]
    table = saved["summary"]["table"]
    assert list(table) == ["paper", "default"]  # the broken recipe has no successful run
    assert list(table["paper"]) == ["vehicle"]
    assert list(table["default"]) == ["vehicle", "pedestrian", "drivable_area", "lane_divider"]
    for recipe, classes in table.items():
        runs = [r for r in saved["runs"] if r["recipe"] == recipe]
        assert sorted(r["seed"] for r in runs) == [0, 1] and all(r["status"] == "ok" for r in runs)
        for c, row in classes.items():
            values = [r["iou"][c] for r in runs]
            np.testing.assert_allclose(row["iou_0.5"], [np.mean(values), np.std(values, ddof=1)])
            assert row["seeds"] == [r["seed"] for r in runs]
            assert saved["summary"]["curves"][recipe][c]["steps"] == [2]
    failed = [r for r in saved["runs"] if r["status"] == "failed"]
    assert [r["recipe"] for r in failed] == ["broken", "broken"] and "no_such_key" in failed[0]["log_tail"]
    md = (out / "accuracy.md").read_text()
    assert "| paper | 2 | vehicle |" in md and "| default | 2 | lane_divider |" in md
    assert "FAILED: broken seed 0" in md and "no_such_key" in md
    # every validation of a real run carries its training time, and the time-to table has both recipes
    assert all(p["seconds"] > 0 for r in saved["runs"] if r["status"] == "ok" for p in r["curve"])
    assert list(saved["time_to"]["recipes"]) == ["paper", "default"]
    assert saved["time_to"]["recipes"]["paper"]["runs"] == 2 and "to vehicle IoU >= 50.0" in md
    png = (out / "accuracy.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert result["runs"] == saved["runs"]


def test_loop_rates_prefer_elapsed_and_fall_back_to_the_wrapper_clock():
    from benchmarks.train_loop import loop_rates

    seen = {s: 10.0 + 0.5 * s for s in range(1, 11)}
    records = [{"kind": "train", "step": s, "elapsed": 4.0 + 0.25 * (s - 1)} for s in range(1, 11)]
    records.append({"kind": "val", "step": 10})
    rates = loop_rates(records, seen)
    assert rates["steady_steps_per_s"] == pytest.approx(4.0) and rates["first_step_s"] == pytest.approx(10.5)
    assert rates["train_call_s"] == pytest.approx(6.5) and rates["train_to_first_step_s"] == pytest.approx(4.0)
    plain = loop_rates([{k: v for k, v in r.items() if k != "elapsed"} for r in records], seen)
    assert plain["steady_steps_per_s"] == pytest.approx(2.0) and "train_call_s" not in plain
    with pytest.raises(ValueError, match="3 train records"):
        loop_rates(records[:2], seen)


@pytest.mark.slow
def test_train_loop_suite_quick(tmp_path, monkeypatch):
    import torch

    from benchmarks import BenchContext
    from benchmarks import train_loop

    monkeypatch.setenv("LSS_LOOP_OUT", str(tmp_path))
    rows = train_loop.run(BenchContext(torch.device("cpu"), quick=True))
    by_impl = {r["impl"].split(" (")[0]: r for r in rows}
    expected = {"first_step", "loop", "final eval", "loader alone", "step alone", "loop/step", "eval"}
    assert expected <= set(by_impl), rows
    assert by_impl["first_step"]["ms"] > 0 and by_impl["loop"]["steps_per_s"] > 0
    assert by_impl["loader alone"]["steps_per_s"] > 0 and by_impl["eval"]["samples_per_s"] > 0
    phases = [r for r in rows if r["impl"].startswith("startup: ")]
    assert [r["impl"] for r in phases][:2] == ["startup: datasets", "startup: model"] and phases[-1]["ms"] > 0
    # the phases add up to train() -> step 1, which with the time before train() is the first_step row
    imports = [r for r in phases if r["impl"].startswith("startup: imports")]
    assert [r["impl"] for r in imports] == ["startup: imports, first", "startup: imports"]
    assert all(r["ms"] > 0 for r in imports), imports
    assert sum(r["ms"] for r in phases if r not in imports) == pytest.approx(
        by_impl["first_step"]["ms"] - 1e3 * float(by_impl["first_step"]["notes"].split("train() ")[1].split(" s")[0]),
        abs=150)
    assert by_impl["loop/step"]["ratio"] == pytest.approx(by_impl["loop"]["steps_per_s"]
                                                          / by_impl["step alone"]["steps_per_s"])
    assert (tmp_path / "run" / "checkpoints" / "last.pt").is_file()


def test_train_loop_children_write_bytecode_outside_the_packages(monkeypatch, tmp_path):
    from benchmarks.train_loop import child_env_with_stacks

    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    env = child_env_with_stacks()
    assert "PYTHONDONTWRITEBYTECODE" not in env and env["PYTHONPYCACHEPREFIX"].endswith("lss-pycache")
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(tmp_path))  # the user's own prefix is kept
    assert child_env_with_stacks()["PYTHONPYCACHEPREFIX"] == str(tmp_path)
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX")
    assert "PYTHONPYCACHEPREFIX" not in child_env_with_stacks()  # Python's default: next to the sources


def test_the_table_follows_the_recipe_order_not_the_order_runs_finish(tmp_path, monkeypatch):
    sweep = {"0.5": {"vehicle": 0.2}}
    finished = [dict(_run(s, 0.2, sweep, [(2, 0.2)]), recipe=name) for name, s in
                (("b", 1), ("a", 0), ("b", 0), ("a", 1))]
    monkeypatch.setattr(accuracy, "train_runs", lambda opts: finished)
    monkeypatch.setattr(accuracy, "ensure_synthetic_set", lambda *a, **k: 0.0)
    monkeypatch.setattr(accuracy, "plot_curves", lambda *a, **k: None)
    opts = accuracy.AccuracyOptions(out_dir=str(tmp_path), recipes=[parse_recipe("a=x.yaml"), parse_recipe("b=x.yaml")])
    result = accuracy.benchmark(opts)
    assert list(result["summary"]["table"]) == ["a", "b"]
    assert [(r["recipe"], r["seed"]) for r in result["runs"]] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]


def test_least_loaded_gpu_fills_the_emptiest_gpu_first():
    assert accuracy.least_loaded_gpu([], 4) == 0
    assert accuracy.least_loaded_gpu([0, 1, 2], 4) == 3
    assert accuracy.least_loaded_gpu([0, 0, 1, 2, 3], 4) == 1
    assert accuracy.least_loaded_gpu([0, 0], 1) == 0
    with pytest.raises(ValueError, match="at least 1"):
        accuracy.least_loaded_gpu([], 0)


def test_runs_are_spread_over_the_gpus(tmp_path, monkeypatch):
    """Each training process sees one GPU through CUDA_VISIBLE_DEVICES, the least loaded one."""
    import sys

    script = "import os, time; print('gpu', os.environ.get('CUDA_VISIBLE_DEVICES')); time.sleep(1)"
    monkeypatch.setattr(accuracy, "run_command", lambda *a: [sys.executable, "-c", script])
    seen = {}

    def collect(run_dir, recipe, seed, returncode, seconds, late):
        seen[(recipe.name, seed)] = (run_dir / "train.log").read_text().split()
        return {"recipe": recipe.name, "seed": seed, "status": "ok", "seconds": seconds}

    monkeypatch.setattr(accuracy, "collect_run", collect)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    opts = accuracy.AccuracyOptions(
        out_dir=str(tmp_path), recipes=[parse_recipe("a=x.yaml"), parse_recipe("b=x.yaml")],
        seeds=(0, 1), parallel=3, gpus=2,
    )
    accuracy.train_runs(opts)
    # a0 -> 0, a1 -> 1, b0 -> 0 start together; b1 starts when one ends, on the GPU that freed
    assert [seen[k][1] for k in (("a", 0), ("a", 1), ("b", 0))] == ["0", "1", "0"]
    assert seen[("b", 1)][1] in {"0", "1"}
    one = accuracy.AccuracyOptions(out_dir=str(tmp_path / "one"), recipes=[parse_recipe("a=x.yaml")],
                                   seeds=(0,), gpus=1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    accuracy.train_runs(one)
    assert seen[("a", 0)][1] == "7"  # one GPU: the caller's choice stays
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    accuracy.train_runs(dataclasses.replace(opts, out_dir=str(tmp_path / "mapped"), seeds=(0,)))
    assert {seen[("a", 0)][1], seen[("b", 0)][1]} == {"4", "6"}  # the caller's GPUs, not 0 and 1


def test_gpu_devices_follow_the_callers_cuda_visible_devices():
    assert accuracy.gpu_devices(3, {}) == ["0", "1", "2"]
    assert accuracy.gpu_devices(2, {"CUDA_VISIBLE_DEVICES": "2, 3"}) == ["2", "3"]
    assert accuracy.gpu_devices(1, {"CUDA_VISIBLE_DEVICES": "5,6"}) == ["5"]
    with pytest.raises(ValueError, match="names 2: give at most that many"):
        accuracy.gpu_devices(4, {"CUDA_VISIBLE_DEVICES": "2,3"})


def test_gpus_argument_is_checked(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    parser = accuracy.build_parser()
    assert accuracy.options_from_args(parser.parse_args(["--gpus", "4"])).gpus == 4
    with pytest.raises(ValueError, match="--gpus 0"):
        accuracy.options_from_args(parser.parse_args(["--gpus", "0"]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(ValueError, match="names 1"):
        accuracy.options_from_args(parser.parse_args(["--gpus", "2"]))


def test_paper_orig_sets_the_originals_switches_but_ground_truth_and_fp32():
    recipe = parse_recipe("paper_orig")
    assert recipe.config == "configs/lss_paper.yaml"
    for switch in ("pil", "post_orig", "linspace", "trunc", "zero_init"):
        assert set(accuracy.ABLATIONS[switch]) <= set(recipe.overrides)
    assert not set(accuracy.ABLATIONS["gt_orig"]) & set(recipe.overrides)
    assert not set(accuracy.ABLATIONS["fp32_eager"]) & set(recipe.overrides)


def test_the_set_argument_selects_the_set_its_folder_and_the_runs_data(monkeypatch, tmp_path):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    parser = accuracy.build_parser()
    bench = accuracy.options_from_args(parser.parse_args([]))
    confirm = accuracy.options_from_args(parser.parse_args(["--set", "confirm"]))
    screen = accuracy.options_from_args(parser.parse_args(["--set", "screen", "--data-dir", str(tmp_path)]))
    assert (bench.dataset.seed, bench.data_dir) == (11, "data/benchmark_accuracy")
    # the confirmation set: the benchmark set's size and version, other draws, its own folder
    assert confirm.dataset == dataclasses.replace(bench.dataset, seed=23)
    assert confirm.data_dir == "data/confirm_accuracy"
    assert (screen.dataset.version, screen.dataset.scenes, screen.data_dir) == ("v1.0-mini", 10, str(tmp_path))
    overrides = accuracy.run_overrides(confirm, parse_recipe("default"), seed=2)
    from lss.config import load_config

    cfg = load_config("configs/synthetic_segmentation.yaml", overrides)
    assert cfg.data.dataroot == str((accuracy.Path("data/confirm_accuracy")).resolve())
    assert (cfg.data.version, cfg.train.seed, cfg.data.make_synthetic_if_missing) == ("v1.0-trainval", 2, False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--set", "nonesuch"])


def test_a_set_folder_made_for_one_set_is_refused_for_the_other(tmp_path):
    from benchmarks._runs import ensure_synthetic_set

    (tmp_path / "v1.0-trainval").mkdir()
    (tmp_path / "v1.0-trainval" / "sample.json").write_text("[]")
    (tmp_path / "benchmark_set.json").write_text(json.dumps(accuracy.BENCHMARK_SET.describe()))
    assert ensure_synthetic_set(tmp_path, accuracy.BENCHMARK_SET) == 0.0  # reused, not generated
    with pytest.raises(ValueError, match="delete this one"):
        ensure_synthetic_set(tmp_path, accuracy.CONFIRM_SET)


@pytest.mark.parametrize("name", ["default_at_128", "ped_cw4", "default_torch_kernels", "no_soft_iou",
                                  "no_soft_iou_at_128"])
def test_the_two_set_recipes_change_only_what_they_name(name):
    from lss.config import config_to_dict, load_config

    recipe = parse_recipe(name)
    assert recipe.config == "configs/synthetic_segmentation.yaml"
    default = config_to_dict(load_config("configs/synthetic_segmentation.yaml"))
    changed = config_to_dict(load_config(recipe.config, list(recipe.overrides)))
    differs = {(section, key) for section in default for key in default[section]
               if isinstance(default[section], dict) and default[section][key] != changed[section][key]}
    if name.startswith("no_soft_iou"):
        # the recipe measured before 2026-11-28: the per-pixel BCE alone
        assert changed["loss"]["soft_iou_weights"] is None and default["loss"]["soft_iou_weights"]
        differs -= {("loss", "soft_iou_weights")}
        name = name.replace("no_soft_iou", "default") if name.endswith("128") else "unchanged"
    if name == "unchanged":
        assert differs == set()
    elif name == "default_at_128":
        # the paper's images: 128x352, the crop of 1600x900 images resized to 0.193-0.225 (as configs/lss_paper.yaml)
        paper = load_config("configs/lss_paper.yaml")
        assert differs == {("data", "final_dim"), ("data", "resize_lim")}
        assert tuple(changed["data"]["final_dim"]) == tuple(paper.data.final_dim) == (128, 352)
        assert tuple(changed["data"]["resize_lim"]) == tuple(paper.data.resize_lim)
    elif name == "ped_cw4":
        assert differs == {("loss", "class_weights"), ("loss", "soft_iou_weights")}
        assert changed["loss"]["class_weights"][1] == 4.0 and changed["loss"]["soft_iou_weights"] is None
    else:
        assert differs == {("model", "batch_norm"), ("model", "depthwise_conv")}
        assert changed["model"]["batch_norm"] == changed["model"]["depthwise_conv"] == "torch"


def test_training_seconds_leave_the_validations_out_and_interpolate_the_clock():
    records = [
        {"kind": "startup", "step": 1},
        {"kind": "train", "step": 20, "elapsed": 12.0},
        {"kind": "train", "step": 40, "elapsed": 14.0},
        {"kind": "val", "step": 40, "timing": {"seconds": 5.0}},  # lss's records
        {"kind": "train", "step": 60, "elapsed": 21.0},  # 5 s of it the validation at 40
        {"kind": "val", "step": 50, "seconds": 1.0},  # the original's runner's records; between clock records
        {"kind": "val", "step": 70, "seconds": 1.0},  # past the last clock record: its last pace
    ]
    got = accuracy.training_seconds(records)
    assert got[40] == pytest.approx(14.0)
    assert got[50] == pytest.approx(14.0 + 7.0 / 2 - 5.0)  # interpolated 17.5, less the validation at 40
    assert got[70] == pytest.approx(21.0 + 3.5 - 6.0)  # 24.5 at the last pace (7 s per 20 steps), less 5 + 1
    early = accuracy.training_seconds([{"kind": "train", "step": 20, "elapsed": 10.0},
                                       {"kind": "val", "step": 10, "timing": {"seconds": 3.0}}])
    assert early == {10: pytest.approx(5.0)}  # before the first record: its pace from the start
    assert accuracy.training_seconds([{"kind": "train", "step": 20, "loss": 1.0},
                                      {"kind": "val", "step": 20}]) == {}  # no clock, no times


def _timed_run(recipe, seed, points):
    return {"recipe": recipe, "seed": seed, "status": "ok",
            "curve": [{"step": s, "seconds": t, "iou": {"vehicle": v}} for s, t, v in points]}


def test_time_to_accuracy_reports_the_first_validation_over_the_target_and_the_best_by_each_half():
    runs = [
        _timed_run("fast", 0, [(100, 10.0, 0.20), (200, 20.0, 0.31), (300, 30.0, 0.29), (400, 40.0, 0.33)]),
        _timed_run("fast", 1, [(100, 12.0, 0.25), (200, 22.0, 0.28), (300, 32.0, 0.30), (400, 42.0, 0.32)]),
        _timed_run("slow", 0, [(100, 50.0, 0.10), (200, 100.0, 0.22), (300, 150.0, 0.25), (400, 200.0, 0.24)]),
        {"recipe": "slow", "seed": 1, "status": "failed"},
    ]
    table = accuracy.time_to_accuracy(runs, "vehicle", 0.30, steps=400)
    fast, slow = table["fast"], table["slow"]
    assert fast["reached"] == 2 and fast["runs"] == 2
    np.testing.assert_allclose(fast["seconds"], [26.0, np.std([20.0, 32.0], ddof=1)])
    np.testing.assert_allclose(fast["step"][0], 250.0)
    np.testing.assert_allclose(fast["best_by"][200]["iou"], [np.mean([0.31, 0.28]), np.std([0.31, 0.28], ddof=1)])
    np.testing.assert_allclose(fast["best_by"][200]["seconds"][0], np.mean([20.0, 22.0]))
    np.testing.assert_allclose(fast["best_by"][400]["iou"][0], np.mean([0.33, 0.32]))
    assert slow == {"reached": 0, "runs": 1, "best_by": {200: {"iou": [0.22, None], "seconds": [100.0, None]},
                                                          400: {"iou": [0.25, None], "seconds": [150.0, None]}}}
    lines = "\n".join(accuracy.time_to_markdown({"class": "vehicle", "target": 0.30, "recipes": table}))
    assert "| fast | 2 of 2 | 26 ± 8 s | 250 |" in lines and "| slow | 0 of 1 | not reached |" in lines
    assert "best by 200: IoU, seconds | best by 400: IoU, seconds" in lines
    # runs without a clock (written before train records carried one) are left out, not counted as zero
    untimed = _timed_run("old", 0, [(100, None, 0.5)])
    assert accuracy.time_to_accuracy([untimed], "vehicle", 0.30, steps=100) == {}


@pytest.mark.parametrize("text", ["vehicle", "vehicle=30", "vehicle=x", "=0.3", "vehicle=0"])
def test_time_to_argument_is_checked(text):
    parser = accuracy.build_parser()
    assert accuracy.options_from_args(parser.parse_args(["--time-to", "pedestrian=0.15"])).time_to == \
        ("pedestrian", 0.15)
    with pytest.raises(ValueError, match=r"expected CLASS=IOU with the IoU as a fraction, e.g. vehicle=0.30"):
        accuracy.options_from_args(parser.parse_args(["--time-to", text]))
