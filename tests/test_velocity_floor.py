"""scripts/velocity_floor.py: the velocity error of the validation boxes themselves with a one-frame guess of their
velocity, through the official DetectionEval."""
import math
from pathlib import Path

import numpy as np
import pytest

from conftest import load_script

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "synthetic.yaml"


def _module():
    return load_script("velocity_floor")


def _boxes(rows):
    """M x 9 boxes at the origin from (yaw, vx, vy) rows."""
    boxes = np.zeros((len(rows), 9), np.float32)
    boxes[:, 3:6] = (1.9, 4.5, 1.6)
    for i, (yaw, vx, vy) in enumerate(rows):
        boxes[i, 6:9] = (yaw, vx, vy)
    return boxes


def test_median_speed_of_the_moving_boxes_per_class():
    floor = _module()
    samples = [("a", _boxes([(0.0, 4.0, 0.0), (0.0, 0.1, 0.0), (0.0, np.nan, np.nan)]), np.array([0, 0, 0])),
               ("b", _boxes([(0.0, 0.0, 8.0), (0.0, 3.0, 4.0)]), np.array([0, 1]))]
    speeds = floor.median_speeds(samples, moving=0.5)
    # car: 4 and 8 (0.1 m/s is standing, an unknown velocity is left out); truck: 5
    assert speeds == {0: 6.0, 1: 5.0}


def test_heading_row_moves_the_moving_boxes_along_their_heading_at_the_class_speed():
    floor = _module()
    boxes = _boxes([(math.pi / 2, 3.0, 1.0), (0.3, 0.2, 0.0), (1.0, np.nan, np.nan), (-math.pi, -7.0, 0.0)])
    labels = np.array([0, 0, 0, 1])
    speeds = {0: 6.0, 1: 5.0}
    guess = floor.predicted_velocity(boxes, labels, "heading", speeds, moving=0.5)
    np.testing.assert_allclose(guess, [[0.0, 6.0], [0.0, 0.0], [0.0, 0.0], [-5.0, 0.0]], atol=1e-6)
    np.testing.assert_allclose(floor.predicted_velocity(boxes, labels, "truth", speeds, 0.5),
                               [[3.0, 1.0], [0.2, 0.0], [0.0, 0.0], [-7.0, 0.0]], atol=1e-6)
    assert not floor.predicted_velocity(boxes, labels, "zero", speeds, 0.5).any()
    with pytest.raises(ValueError, match="unknown row 'lidar'"):
        floor.predicted_velocity(boxes, labels, "lidar", speeds, 0.5)


def test_the_true_velocities_score_no_error_and_standing_still_does(synthetic_root, tmp_path):
    floor = _module()
    out = tmp_path / "floor.json"
    result = floor.main([
        "--config", str(CONFIG), "--out", str(out),
        "--set", f"data.dataroot={synthetic_root}", "--set", "data.version=v1.0-mini",
        "--set", "data.train_split=mini_train", "--set", "data.val_split=mini_val",
        "--set", "data.make_synthetic_if_missing=false",
    ])
    truth, zero = result["rows"]["truth"], result["rows"]["zero"]
    scored = [name for name, err in truth.items() if err is not None]
    assert scored and all(truth[name] < 1e-6 for name in scored)
    # the tiny set's validation scene has moving traffic: standing still costs velocity error there
    assert max(zero[name] for name in scored) > 1.0
    assert set(result["median_speed"]) <= {"car", "truck", "bus", "trailer", "construction_vehicle", "pedestrian",
                                           "motorcycle", "bicycle"}
    assert out.is_file()
