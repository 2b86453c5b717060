"""`lss eval --decode`: post-processing variants decoded from the same forward pass. A variant equals a separate
evaluation of the config with its settings; one with the config's own settings scores the same; only settings that
act after the network are taken, each refusal says which are."""
import json

import pytest

from conftest import val_statistics_checkpoint
from lss.cli import main
from lss.config import config_to_dict, load_config
from lss.engine.detection_eval import decode_variants
from lss.engine.eval import evaluate_checkpoint
from lss.errors import ConfigError

TINY = ["data.final_dim=[32, 96]", "data.resize_lim=[0.24, 0.26]", "grid.xbound=[-16.0, 16.0, 1.0]",
        "grid.ybound=[-16.0, 16.0, 1.0]", "grid.dbound=[4.0, 20.0, 2.0]", "model.context_channels=8",
        "data.classes=[vehicle, drivable_area]", "data.workers=0", "train.device=cpu", "eval.batch_size=2",
        "model.heads=[segmentation, detection]", "data.detection_targets=true", "detection.head_channels=8",
        # random weights: every peak kept, so that each sample has boxes to rank
        "detection.score_threshold=0.0"]
REFINE = ["detection.refine=true", "detection.refine_hidden=16", "detection.refine_proposals=8"]
FIRST_STAGE_SCORES = "first=detection.refine_score_alpha=0.0;detection.refine_residuals=[]"


def _differences(a, b):
    a, b = config_to_dict(a), config_to_dict(b)
    return {(s, k) for s in a if isinstance(a[s], dict) for k in a[s] if a[s][k] != b[s][k]}


def test_a_variant_is_the_config_with_its_settings():
    cfg = load_config(None, TINY + REFINE)
    variants = decode_variants(cfg, [FIRST_STAGE_SCORES, "few = detection.max_detections=5"])
    assert list(variants) == ["first", "few"]
    first = variants["first"].detection
    assert first.refine_score_alpha == 0.0 and tuple(first.refine_residuals) == ()
    assert _differences(cfg, variants["first"]) == {("detection", "refine_score_alpha"),
                                                    ("detection", "refine_residuals")}
    assert _differences(cfg, variants["few"]) == {("detection", "max_detections")}
    assert cfg.detection.refine_score_alpha == 0.5  # the config itself is left as it was
    # without the second stage the proposals are made after the network too
    plain = load_config(None, TINY)
    assert decode_variants(plain, ["loose=detection.nms_iou=0.5"])["loose"].detection.nms_iou == 0.5


@pytest.mark.parametrize("spec, message", [
    ("detection.refine_score_alpha=0.0", "expected NAME=detection.key=value"),
    ("name=", "expected NAME=detection.key=value"),
    ("../up=detection.max_detections=5", "NAME of letters, digits"),
    ("a=model.context_channels=4", "changes the post-processing only"),
    ("a=detection.refine=false", "changes the post-processing only"),
    ("a=detection.nms_iou=0.1", "inside the network"),
    ("a=detection.refine_score_alpha=2.0", "refine_score_alpha"),
])
def test_a_bad_variant_is_refused_with_what_to_do(spec, message):
    cfg = load_config(None, TINY + REFINE)
    with pytest.raises(ConfigError, match=message) as info:
        decode_variants(cfg, [spec])
    if "post-processing only" in message or "inside" in message:
        assert "detection.refine_score_alpha" in str(info.value)  # the settings it takes


def test_a_name_given_twice_is_refused():
    cfg = load_config(None, TINY + REFINE)
    with pytest.raises(ConfigError, match="given twice"):
        decode_variants(cfg, ["a=detection.max_detections=5", "a=detection.max_detections=6"])


def _submission(directory):
    return json.loads((directory / "detection_submission.json").read_text())["results"]


def test_variants_equal_separate_evaluations(synthetic_root, tmp_path, capsys):
    cfg = load_config(None, TINY + REFINE + [f"data.dataroot={synthetic_root}"])
    ckpt = val_statistics_checkpoint(cfg, tmp_path / "run" / "last.pt", step=3)
    out = tmp_path / "sweep"
    result = evaluate_checkpoint(cfg, str(ckpt), str(out),
                                 decode=[FIRST_STAGE_SCORES, "same=detection.refine_score_alpha=0.5"])
    printed = capsys.readouterr().out
    assert "| (the config) |" in printed and "| first |" in printed and "| same |" in printed
    base, variants = result["detection"], result["detection_decode"]
    assert set(variants) == {"first", "same"}
    base_boxes = _submission(out)
    assert sum(len(v) for v in base_boxes.values()) > 0
    # the config's own settings: the same detections and metrics
    assert _submission(out / "decode" / "same") == base_boxes
    assert (variants["same"]["mAP"], variants["same"]["NDS"]) == (base["mAP"], base["NDS"])
    # another setting: what `lss eval` of the config with that setting gives, and not the config's detections
    alone = evaluate_checkpoint(load_config(None, TINY + REFINE + [
        f"data.dataroot={synthetic_root}", "detection.refine_score_alpha=0.0", "detection.refine_residuals=[]"]),
        str(ckpt), str(tmp_path / "alone"))
    first = _submission(out / "decode" / "first")
    assert first == _submission(tmp_path / "alone")
    assert first != base_boxes
    assert variants["first"]["per_class"] == alone["detection"]["per_class"]
    saved = json.loads((out / "eval.json").read_text())
    assert saved["detection_decode"]["first"]["NDS"] == variants["first"]["NDS"]


def test_the_command_line_refuses_a_bad_variant_in_one_line(synthetic_root, tmp_path, capsys):
    items = TINY + REFINE + [f"data.dataroot={synthetic_root}"]
    ckpt = val_statistics_checkpoint(load_config(None, items), tmp_path / "last.pt")
    config = tmp_path / "config.yaml"
    config.write_text("train:\n  device: cpu\n")

    def args(overrides):
        return ["eval", "--config", str(config), *[a for item in overrides for a in ("--set", item)], "--ckpt",
                str(ckpt)]

    assert main(args(items) + ["--decode", "a=detection.top_k=10"]) == 2
    err = capsys.readouterr().err
    assert "lss eval: error: --decode 'a=detection.top_k=10'" in err and "inside the network" in err
    segmentation = [i for i in items if not i.startswith(("model.heads", "data.detection_targets", "detection."))]
    assert main(args(segmentation) + ["--decode", "a=detection.max_detections=5"]) == 2
    assert "no detection head" in capsys.readouterr().err


def test_the_attribute_follows_the_moving_speed():
    from lss.engine.detection_eval import default_attribute

    assert default_attribute("car", 0.5) == "vehicle.moving" and default_attribute("car", 0.1) == "vehicle.parked"
    assert default_attribute("pedestrian", 0.1) == "pedestrian.standing"
    assert default_attribute("pedestrian", 0.1, moving_speed=0.05) == "pedestrian.moving"
    assert default_attribute("bicycle", 0.5, moving_speed=1.0) == "cycle.without_rider"
    assert default_attribute("traffic_cone", 5.0) == ""
    assert load_config(None, ["detection.moving_speed=0.05"]).detection.moving_speed == 0.05
    with pytest.raises(ConfigError, match="detection.moving_speed=-1.0: expected a speed"):
        load_config(None, ["detection.moving_speed=-1.0"])


def test_a_moving_speed_variant_changes_the_attributes_only(synthetic_root, tmp_path):
    cfg = load_config(None, TINY + [f"data.dataroot={synthetic_root}"])
    ckpt = val_statistics_checkpoint(cfg, tmp_path / "run" / "last.pt", step=3)
    out = tmp_path / "eval"
    evaluate_checkpoint(cfg, str(ckpt), str(out), decode=["still=detection.moving_speed=1e9"])
    base, still = _submission(out), _submission(out / "decode" / "still")
    assert base.keys() == still.keys()
    pairs = [(a, b) for token in base for a, b in zip(base[token], still[token], strict=True)]
    assert pairs and all({**a, "attribute_name": ""} == {**b, "attribute_name": ""} for a, b in pairs)
    assert {b["attribute_name"] for _, b in pairs} <= {"vehicle.parked", "pedestrian.standing",
                                                        "cycle.without_rider", ""}
    assert any(a["attribute_name"] != b["attribute_name"] for a, b in pairs)  # some boxes move at 0.2 m/s
