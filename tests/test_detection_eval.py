"""The detection evaluation end to end from the dataset: the training targets fed back as predictions must score AP 1
through decode, NMS and the official DetectionEval; the vehicle summary follows the devkit's formulas."""
import json

import numpy as np
import pytest
import torch

from lss.config import DETECTION_CLASSES, Config
from lss.geometry.boxes import encode_targets
from lss.engine.detection_eval import (VEHICLE_CLASSES, DetectionCollector, build_submission,
                                       evaluate_submission, subset_scores)
from lss.engine.hooks import detection_curve_point
from lss.geometry import BevGrid


def oracle_collector(dataset, config: Config) -> DetectionCollector:
    """Head outputs that predict each val sample's encoded detection targets exactly, decoded (top-K peaks, NMS)
    into a collector."""
    grid = BevGrid.from_config(config.grid)
    collector = DetectionCollector(config)
    for i in range(len(dataset)):
        boxes, labels = (torch.from_numpy(a.copy()) for a in dataset.detection_targets(i))
        targets = encode_targets([boxes], [labels], grid)
        regression = torch.zeros(1, 10, grid.nx, grid.ny)
        regression[targets["batch"], :, targets["row"], targets["col"]] = targets["regression"]
        outputs = {"det_heatmap": torch.logit(targets["heatmap"].clamp(1e-4, 1 - 1e-4)), "det_regression": regression}
        collector.add(outputs, {"sample_token": [str(dataset.sample_tokens[i])]})
    return collector


def val_dataset(root, min_lidar_pts: int):
    from lss.data.nuscenes import NuScenesBEV

    config = Config()
    config.data.detection_targets = True
    config.data.min_lidar_pts = min_lidar_pts
    config.detection.refine = False
    return NuScenesBEV(root, "v1.0-mini", split="val", config=config, is_train=False, verbose=False), config


@pytest.mark.slow
def test_dataset_targets_as_predictions_score_ap_one(synthetic_root, tmp_path):
    dataset, config = val_dataset(synthetic_root, min_lidar_pts=1)
    collector = oracle_collector(dataset, config)
    summary = collector.evaluate_dataset(dataset, tmp_path)
    present = summary["classes_with_gt"]
    assert "car" in present and summary["num_samples"] == len(dataset)
    for name in present:
        row = summary["per_class"][name]
        assert row["AP"] == pytest.approx(1.0), name
        for err in ("trans_err", "scale_err", "orient_err", "vel_err"):
            assert row[err] is None or row[err] == pytest.approx(0.0, abs=1e-3), (name, err)
    vehicles = summary["vehicles"]
    assert vehicles["classes"] == [n for n in VEHICLE_CLASSES if n in present]
    assert vehicles["mAP"] == pytest.approx(1.0)
    # NDS = (5 mAP + the four zero errors' scores + 1 - AAE) / 10: only the attribute can be wrong (stopped and
    # parked cars both stand still).
    assert vehicles["NDS"] == pytest.approx((5 + 4 + 1 - vehicles["tp_errors"]["attr_err"]) / 10)
    assert "vehicles (car" in (tmp_path / "detection_metrics.md").read_text()
    # every ground-truth box within the class's evaluation range is a true positive, none turned around or driving
    # backwards
    from nuscenes.eval.common.config import config_factory

    ranges = config_factory("detection_cvpr_2019").class_range
    true_positives = summary["true_positives"]["per_class"]
    assert set(true_positives) == set(present)
    for name, row in true_positives.items():
        count = 0
        for i in range(len(dataset)):
            boxes, labels = dataset.detection_targets(i)
            near = np.hypot(boxes[:, 0], boxes[:, 1]) <= ranges[name]
            count += int((near & (labels == DETECTION_CLASSES.index(name))).sum())
        assert row["true_positives"] == count, name
        assert row["heading_flipped"] in (0.0, None) and row["velocity_reversed"] in (0.0, None), name
        assert row["velocity_error"]["heading_right"] == pytest.approx(0.0, abs=1e-3), name
    assert true_positives["car"]["moving"] > 0
    assert "| car |" in (tmp_path / "detection_metrics.md").read_text().split("true positives within 2.0 m")[1]

    # Boxes no lidar point reaches are not in the evaluation's ground truth: targets that keep them turn into false
    # positives ranked with the true ones.
    everything, _ = val_dataset(synthetic_root, min_lidar_pts=0)
    assert sum(len(everything.detection_targets(i)[0]) for i in range(len(everything))) > \
        sum(len(dataset.detection_targets(i)[0]) for i in range(len(dataset)))
    unfiltered = oracle_collector(everything, config).evaluate_dataset(everything, tmp_path / "all")
    assert unfiltered["vehicles"]["mAP"] < 0.95


@pytest.mark.slow
def test_subset_scores_follow_the_devkit_formulas(synthetic_root, tmp_path):
    from lss.data.nuscenes import load_tables

    dataset, config = val_dataset(synthetic_root, min_lidar_pts=1)
    collector = oracle_collector(dataset, config)
    # Imperfect detections: shifted 0.75 m and 20 % too long, so that AP and the errors are neither 0 nor 1.
    for det in collector.detections.values():
        det["boxes"][:, 0] += 0.75
        det["boxes"][:, 4] *= 1.2
    nusc = load_tables(dataset.root, dataset.version)
    summary = evaluate_submission(nusc, build_submission(collector.detections, nusc, dataset.devkit_split),
                                  dataset.devkit_split, tmp_path)
    # Over all 10 classes the subset formulas give the devkit's own mAP, NDS and mean TP errors.
    full = subset_scores(summary["per_class"], DETECTION_CLASSES)
    assert 0.2 < summary["mAP"] < 0.7
    assert full["mAP"] == pytest.approx(summary["mAP"], abs=1e-9)
    assert full["NDS"] == pytest.approx(summary["NDS"], abs=1e-9)
    for m, v in summary["tp_errors"].items():
        assert full["tp_errors"][m] == pytest.approx(v, abs=1e-9), m
    cars = subset_scores(summary["per_class"], ["car"])
    row = summary["per_class"]["car"]
    expected = (5 * row["AP"] + sum(max(0.0, 1 - row[m]) for m in
                                    ("trans_err", "scale_err", "orient_err", "vel_err", "attr_err"))) / 10
    assert cars["mAP"] == row["AP"] and cars["NDS"] == pytest.approx(expected)
    assert 0.5 < row["trans_err"] < 1.0 and row["scale_err"] > 0.1
    assert subset_scores(summary["per_class"], []) == {"mAP": 0.0, "NDS": 0.0,
                                                       "tp_errors": dict.fromkeys(full["tp_errors"])}
    point = detection_curve_point(summary)
    assert point["mAP"] == summary["mAP"] and point["vehicle_NDS"] == summary["vehicles"]["NDS"]
    assert point["AP"]["car"] == row["AP"] and json.dumps(point)


def test_synthetic_motorcycles_carry_the_cycle_rider_attribute(synthetic_root):
    from lss.data.nuscenes import load_tables

    nusc = load_tables(synthetic_root, "v1.0-mini")
    motorcycles = [a for a in nusc.sample_annotation if a["category_name"] == "vehicle.motorcycle"]
    assert motorcycles
    for ann in motorcycles:
        names = {nusc.get("attribute", t)["name"] for t in ann["attribute_tokens"]}
        assert names and all(n.startswith("cycle.") for n in names), names
