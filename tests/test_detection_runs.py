"""scripts/detection_runs.py: recipes from the command line and the per-recipe statistics over seeds."""
import math
from pathlib import Path

import pytest

from conftest import load_script

REPO = Path(__file__).resolve().parents[1]


def _module():
    return load_script("detection_runs")


def _run(finished, mAP, car, vehicle_iou):
    point = {"step": 6000, "mAP": mAP, "NDS": mAP / 2, "vehicle_mAP": None, "vehicle_NDS": mAP,
             "AP": {"car": car, "bus": 0.0}, "iou": {"vehicle": vehicle_iou}}
    return {"finished": finished, "curve": [{"step": 3000, "mAP": 0.0}, point]}


def test_statistics_over_the_finished_seeds():
    runs = _module()
    results = {"w_s0": _run(True, 0.2, 0.5, 0.3), "w_s1": _run(True, 0.3, 0.7, 0.4),
               "w_s2": _run(False, 0.9, 0.9, 0.9)}  # an unfinished run does not count
    stats = runs.over_seeds(results, "w", [0, 1, 2])
    assert stats["finished_seeds"] == 2
    mean, std = stats["final"]["mAP"]
    assert math.isclose(mean, 0.25) and math.isclose(std, math.sqrt(0.005))  # sample standard deviation
    assert stats["final"]["vehicle_mAP"] is None  # no values, no statistic
    assert math.isclose(stats["AP"]["car"][0], 0.6) and stats["AP"]["bus"] == [0.0, 0.0]
    assert math.isclose(stats["iou"]["vehicle"][0], 0.35)
    one = runs.over_seeds({"w_s0": results["w_s0"]}, "w", [0])
    assert one["final"]["mAP"] == [0.2, 0.0]


def test_recipes_and_seeds_from_the_command_line(tmp_path):
    runs = _module()
    args = runs.parse_args(["--out-dir", str(tmp_path), "--recipe", "x=detection.refine=false", "--runs", "nope"])
    with pytest.raises(SystemExit, match=r"unknown run\(s\) \['nope'\]; expected names from .*'x'"):
        runs.run_all(args)
    args = runs.parse_args(["--out-dir", str(tmp_path), "--recipe", "no-equals-sign"])
    with pytest.raises(SystemExit, match="expected NAME=section.key=value"):
        runs.run_all(args)
    # the measured length by default; --quick tests the path in a few steps, evaluated at the end
    assert (args.steps, args.eval_every) == (2000, 500)
    quick = runs.parse_args(["--out-dir", str(tmp_path), "--quick"])
    assert (quick.steps, quick.eval_every) == (4, 4)
    assert runs.parse_args(["--out-dir", str(tmp_path), "--quick", "--steps", "6"]).eval_every == 6


def test_vehicle_tp_errors_are_averaged_over_the_finished_seeds():
    runs = _module()
    results = {f"w_s{s}": {**_run(True, 0.2, 0.5, 0.3),
                           "detection": {"vehicles": {"tp_errors": {"vel_err": v, "orient_err": None}}}}
               for s, v in enumerate((1.0, 2.0))}
    stats = runs.over_seeds(results, "w", [0, 1])
    mean, std = stats["vehicle_tp_errors"]["vel_err"]
    assert math.isclose(mean, 1.5) and math.isclose(std, math.sqrt(0.5))
    assert stats["vehicle_tp_errors"]["orient_err"] is None


def test_the_joint_recipe_adds_the_detection_head_to_another_config(tmp_path):
    from lss.config import load_config

    runs = _module()
    args = runs.parse_args(["--out-dir", str(tmp_path), "--config", "configs/synthetic_segmentation.yaml", "--runs", "joint"])
    assert args.config == "configs/synthetic_segmentation.yaml"
    repo = REPO
    base = load_config(repo / "configs" / "synthetic_segmentation.yaml")
    joint = load_config(repo / "configs" / "synthetic_segmentation.yaml", list(runs.RUNS["joint"]))
    assert list(base.model.heads) == ["segmentation"] and not base.data.detection_targets
    assert list(joint.model.heads) == ["segmentation", "detection"] and joint.data.detection_targets
    detection = load_config(repo / "configs" / "synthetic_detection.yaml")
    assert list(joint.detection.heatmap_class_weights) == list(detection.detection.heatmap_class_weights)
    # the segmentation side is the default's: same classes, targets and image size
    assert joint.data.classes == base.data.classes and joint.data.min_lidar_pts == base.data.min_lidar_pts
    assert joint.data.final_dim == base.data.final_dim


def test_the_default_config_is_the_measured_joint_recipe():
    """configs/synthetic.yaml is configs/synthetic_segmentation.yaml with the `joint_own_narrow` recipe, the recipe
    docs/detection.md measured against the segmentation head alone; only its run directory differs."""
    from lss.config import config_to_dict, load_config

    runs = _module()
    measured = load_config(REPO / "configs" / "synthetic_segmentation.yaml",
                           list(runs.RUNS["joint_own_narrow"]) + ["train.out_dir=runs/synthetic"])
    assert config_to_dict(load_config(REPO / "configs" / "synthetic.yaml")) == config_to_dict(measured)


def test_the_temporal_recipes_are_configs_temporal_and_its_gap():
    from lss.config import config_to_dict, load_config

    runs = _module()
    temporal = load_config(REPO / "configs" / "synthetic_temporal.yaml")
    detection = REPO / "configs" / "synthetic_detection.yaml"
    one_back = load_config(detection, list(runs.RUNS["temporal"]))
    two_back = load_config(detection, list(runs.RUNS["temporal_gap2"]))
    # `temporal` on configs/synthetic_detection.yaml is configs/synthetic_temporal.yaml but for its run directory
    a, b = config_to_dict(one_back), config_to_dict(temporal)
    a["train"].pop("out_dir"), b["train"].pop("out_dir")
    assert a == b
    assert (two_back.model.temporal.frames, two_back.model.temporal.gap) == (2, 2)


def test_the_joint_variants_are_the_joint_recipe_plus_one_change():
    from lss.config import config_to_dict, load_config

    runs = _module()
    base = REPO / "configs" / "synthetic_segmentation.yaml"
    joint = config_to_dict(load_config(base, list(runs.RUNS["joint"])))
    expected = {"joint_own": {("detection", "decoder")}, "joint_gs05": {("detection", "trunk_grad_scale")},
                "joint_half": {("detection", "heatmap_weight"), ("detection", "regression_weight")},
                "joint_lane": {("loss", "class_weights")},
                "joint_own_gs0": {("detection", "decoder"), ("detection", "trunk_grad_scale")},
                "joint_own_lane": {("detection", "decoder"), ("loss", "class_weights")},
                "joint_own_narrow": {("detection", "decoder"), ("detection", "decoder_channels")}}
    for name, keys in expected.items():
        variant = config_to_dict(load_config(base, list(runs.RUNS[name])))
        differs = {(s, k) for s in joint if isinstance(joint[s], dict) for k in joint[s] if joint[s][k] != variant[s][k]}
        assert differs == keys, name


def test_the_256x704_detection_recipes_take_the_default_recipes_cameras():
    from lss.config import config_to_dict, load_config

    runs = _module()
    detection = REPO / "configs" / "synthetic_detection.yaml"
    default = load_config(REPO / "configs" / "synthetic_segmentation.yaml")
    camera_keys = {("data", "final_dim"), ("data", "resize_lim"), ("grid", "dbound"), ("model", "frustum_pixels")}
    for name, low in (("hr_refine_off", "refine_off"), ("hr_refine_on", "refine_on"), ("temporal_hr", "temporal")):
        hr = load_config(detection, list(runs.RUNS[name]))
        a, b = config_to_dict(hr), config_to_dict(load_config(detection, list(runs.RUNS[low])))
        differs = {(s, k) for s in a if isinstance(a[s], dict) for k in a[s] if a[s][k] != b[s][k]}
        assert differs == camera_keys, name
        assert (hr.data.final_dim, hr.data.resize_lim) == (default.data.final_dim, default.data.resize_lim)
        assert (hr.grid.dbound, hr.model.frustum_pixels) == (default.grid.dbound, default.model.frustum_pixels)
    assert load_config(detection, list(runs.RUNS["temporal_hr"])).model.temporal.frames == 2
    # the config is the measured recipe with the small rotation: that run changes nothing
    assert config_to_dict(load_config(detection, list(runs.RUNS["hr_depth_rot_small"]))) == config_to_dict(
        load_config(detection))
    # the recipes measured before it run as they were measured: the first stage alone, no BEV rotation
    for name in ("hr_refine_off", "refine_off", "temporal", "temporal_hr", "segmentation_alone"):
        c = load_config(detection, list(runs.RUNS[name]))
        assert not c.detection.refine and not c.detection.refine_depth, name
        assert tuple(c.data.bev_rot_lim) == (0.0, 0.0) and tuple(c.data.bev_scale_lim) == (1.0, 1.0), name
    # the second stage with the camera depth cues: one setting more than hr_refine_on
    a, b = (config_to_dict(load_config(detection, list(runs.RUNS[n]))) for n in ("hr_refine_on", "hr_refine_depth"))
    assert {(s, k) for s in a if isinstance(a[s], dict) for k in a[s] if a[s][k] != b[s][k]} == {
        ("detection", "refine_depth")}
    # and the image features: one setting more than hr_refine_depth
    c = config_to_dict(load_config(detection, list(runs.RUNS["hr_refine_image"])))
    assert {(s, k) for s in b if isinstance(b[s], dict) for k in b[s] if b[s][k] != c[s][k]} == {
        ("detection", "refine_image")}
    # the BEV augmentation screens: with flips (mirrored traffic) and with rotations alone
    flips, turns = (load_config(detection, list(runs.RUNS[n])).data for n in ("hr_bevaug", "hr_bevrot"))
    assert flips.bev_flip and not turns.bev_flip and tuple(turns.bev_rot_lim) == (-180.0, 180.0)


def test_the_augmented_second_stage_recipes_are_the_depth_cue_stage_plus_one_change():
    from lss.config import config_to_dict, load_config

    runs = _module()
    detection = REPO / "configs" / "synthetic_detection.yaml"
    base = config_to_dict(load_config(detection, list(runs.RUNS["hr_refine_depth"])))

    def changes(name):
        c = config_to_dict(load_config(detection, list(runs.RUNS[name])))
        return {(s, k): c[s][k] for s in c if isinstance(c[s], dict) for k in c[s] if c[s][k] != base[s][k]}

    assert changes("hr_depth_cbgs") == {("data", "class_balanced"): True}
    rot = changes("hr_depth_rot_small")
    assert set(rot) == {("data", "bev_rot_lim"), ("data", "bev_scale_lim")}
    assert tuple(rot[("data", "bev_rot_lim")]) == (-22.5, 22.5)
    assert tuple(rot[("data", "bev_scale_lim")]) == (0.95, 1.05)
    assert set(changes("hr_depth_rot_small_q")) == set(rot) | {("detection", "refine_quality")}
    # two frames on the config, and with the second stage reading the previous frame's depth as well
    two = changes("temporal_hr_depth_rot_small")
    assert set(two) == set(rot) | {("model", "temporal")} and two[("model", "temporal")]["frames"] == 2
    assert changes("temporal_hr_motion") == {**two, ("detection", "refine_motion"): True}
    assert changes("temporal_hr_motion_cbgs") == {**two, ("detection", "refine_motion"): True,
                                                 ("data", "class_balanced"): True}
    assert changes("temporal_hr_motion_norot") == {("model", "temporal"): two[("model", "temporal")],
                                                  ("detection", "refine_motion"): True}
    reversal = {("detection", "refine_reversal"): True}
    assert changes("hr_depth_rot_small_reversal") == {**rot, **reversal}
    assert changes("temporal_hr_motion_reversal") == {**two, ("detection", "refine_motion"): True, **reversal}
    # the rotation screen on the first stage is the same augmentation without the second stage
    first = config_to_dict(load_config(detection, list(runs.RUNS["hr_bevrot_small"])))
    assert first["data"]["bev_rot_lim"] == rot[("data", "bev_rot_lim")] and not first["detection"]["refine"]


def test_decode_variants_are_collected_per_run_and_over_seeds(tmp_path):
    import json

    runs = _module()
    run_dir = tmp_path / "w_s0"
    (run_dir / "decode").mkdir(parents=True)
    summary = {"mAP": 0.2, "NDS": 0.3, "vehicles": {"mAP": 0.4, "NDS": 0.5}}
    (run_dir / "decode" / "eval.json").write_text(json.dumps(
        {"detection": summary, "detection_decode": {"q": {**summary, "mAP": 0.25}}}))
    decode = runs.collect_decode(run_dir, 0)
    assert decode == {"(the config)": {"mAP": 0.2, "NDS": 0.3, "vehicle_mAP": 0.4, "vehicle_NDS": 0.5},
                      "q": {"mAP": 0.25, "NDS": 0.3, "vehicle_mAP": 0.4, "vehicle_NDS": 0.5}}
    assert runs.collect_decode(tmp_path / "missing", 1) == {}  # a failed evaluation: nothing, and a message
    results = {"w_s0": {**_run(True, 0.2, 0.5, 0.3), "decode": decode},
               "w_s1": {**_run(True, 0.2, 0.5, 0.3), "decode": {**decode, "q": {**decode["q"], "mAP": 0.35}}}}
    stats = runs.over_seeds(results, "w", [0, 1])
    mean, std = stats["decode"]["q"]["mAP"]
    assert math.isclose(mean, 0.3) and math.isclose(std, math.sqrt(0.005))
    assert "decode q: mAP 0.3000 +- 0.0707" in runs.to_text(
        {"device": "cpu", "date": "d", "steps": 1, "seeds": [0, 1], "dataset": {}, "runs": {},
         "recipes": {"w": {**stats, "AP": {}, "iou": {}}}})


@pytest.mark.slow
def test_a_quick_run_evaluates_its_decode_variants(tmp_path):
    runs = _module()
    args = runs.parse_args(["--quick", "--out-dir", str(tmp_path), "--steps", "2", "--eval-every", "2",
                            "--runs", "refine_on", "--decode", "score_only=detection.refine_score_alpha=0.0"])
    summary = runs.run_all(args)
    run = summary["runs"]["refine_on_s0"]
    assert run["finished"], run
    assert set(run["decode"]) == {"(the config)", "score_only"}
    # the config's own decoding in the separate evaluation scores what the run's final evaluation scored
    assert math.isclose(run["decode"]["(the config)"]["mAP"], run["detection"]["mAP"])
    assert set(summary["recipes"]["refine_on"]["decode"]) == {"(the config)", "score_only"}


def test_the_summary_prints_the_vehicles_heading_flips():
    runs = _module()
    det = {"per_class": {"car": {"AP": 0.7, "has_ground_truth": True}, "truck": {"AP": 0.4, "has_ground_truth": True}},
           "vehicles": {"classes": ["car", "truck"], "tp_errors": {"vel_err": 1.5, "attr_err": None}},
           "true_positives": {"per_class": {
               "car": {"heading_flipped": 0.02, "velocity_reversed": 0.05,
                       "velocity_error": {"heading_right": 0.714, "heading_flipped": 0.338}},
               "truck": {"heading_flipped": 0.125, "velocity_reversed": None,
                         "velocity_error": {"heading_right": 1.116, "heading_flipped": None}}}}}
    run = {"finished": True, "timed_out": False, "returncode": 0, "last_step": 6000, "wall_seconds": 1.0,
           "curve": [], "detection": det}
    text = runs.to_text({"device": "cpu", "date": "d", "steps": 1, "seeds": [0], "dataset": {},
                         "runs": {"w_s0": run}, "recipes": {}})
    assert "AP car 0.700, truck 0.400" in text and "vel_err 1.500" in text
    assert "heading flipped / velocity reversed (share of true positives) car 0.020 / 0.050, truck 0.125 / -" in text
    assert "velocity error facing right / the wrong way (m/s) car 0.71 / 0.34, truck 1.12 / -" in text
    # summaries written before the true positives were reported print as they did
    del det["true_positives"]
    assert "heading flipped" not in runs.to_text({"device": "cpu", "date": "d", "steps": 1, "seeds": [0],
                                                  "dataset": {}, "runs": {"w_s0": run}, "recipes": {}})
