"""The true positives' heading flips and reversed velocities (lss.engine.detection_motion): the devkit's greedy
matching, the split of the velocity error by the heading, and the shares."""
import math

import pytest
from pyquaternion import Quaternion

from lss.engine.detection_motion import format_heading_table, heading_and_velocity, match_true_positives


def boxes(rows):
    """EvalBoxes of DetectionBox from (sample, class, x, y, yaw, vx, vy, score) rows."""
    from nuscenes.eval.common.data_classes import EvalBoxes
    from nuscenes.eval.detection.data_classes import DetectionBox

    out = EvalBoxes()
    by_sample = {}
    for sample, name, x, y, yaw, vx, vy, score in rows:
        by_sample.setdefault(sample, []).append(DetectionBox(
            sample_token=sample, translation=(x, y, 1.0), size=(2.0, 4.5, 1.6),
            rotation=tuple(Quaternion(axis=[0, 0, 1], angle=yaw).elements), velocity=(vx, vy),
            detection_name=name, detection_score=score, attribute_name=""))
    for sample, rows_ in by_sample.items():
        out.add_boxes(sample, rows_)
    return out


GT = boxes([
    ("a", "car", 0.0, 0.0, 0.0, 5.0, 0.0, -1.0),
    ("a", "car", 10.0, 0.0, 0.0, 5.0, 0.0, -1.0),
    ("a", "truck", 20.0, 0.0, 0.0, 0.0, 0.0, -1.0),
    ("a", "barrier", 30.0, 5.0, 0.0, 0.0, 0.0, -1.0),
    ("b", "car", 0.0, 0.0, math.pi / 2, math.nan, math.nan, -1.0),
])
PRED = boxes([
    # the best score takes the car at the origin, turned around and driving backwards
    ("a", "car", 0.5, 0.0, math.pi, -5.0, 0.0, 0.9),
    ("a", "car", 10.3, 0.0, 0.1, 5.0, 0.0, 0.8),
    # a lower-scored duplicate of the first car: the only car within 2 m is taken, so a false positive
    ("a", "car", 0.2, 0.0, 0.0, 5.0, 0.0, 0.5),
    ("a", "car", 40.0, 0.0, 0.0, 0.0, 0.0, 0.7),
    # a car on the truck is not a truck
    ("a", "car", 20.0, 0.0, 0.0, 0.0, 0.0, 0.6),
    ("a", "truck", 21.0, 0.5, 0.2, 0.5, 0.0, 0.4),
    # the barrier's heading counts modulo 180 degrees
    ("a", "barrier", 30.0, 5.0, math.pi, 0.0, 0.0, 0.3),
    # a car whose truth has no velocity: matched, no velocity error
    ("b", "car", 0.0, 1.0, math.pi / 2 + 2.0, 1.0, 1.0, 0.2),
])


def test_matching_is_the_devkits_greedy_one():
    pairs = match_true_positives(GT, PRED, "car", 2.0)
    # by descending score: 0.9 takes the origin car, 0.8 the car at 10 m, 0.2 the car of sample b
    assert [p.detection_score for _, p in pairs] == [0.9, 0.8, 0.2]
    assert [g.translation[0] for g, _ in pairs] == [0.0, 10.0, 0.0]
    assert match_true_positives(GT, PRED, "car", 0.4)[0][1].detection_score == 0.8
    assert match_true_positives(GT, PRED, "truck", 2.0)[0][1].detection_score == 0.4


def test_heading_flips_and_reversed_velocities_per_class():
    result = heading_and_velocity(GT, PRED, ["car", "truck", "barrier", "bus"])
    assert result["distance"] == 2.0 and set(result["per_class"]) == {"car", "truck", "barrier"}
    car = result["per_class"]["car"]
    assert car["true_positives"] == 3
    # the origin car and sample b's car (2.0 rad off) are turned more than 90 degrees
    assert car["heading_flipped"] == pytest.approx(2 / 3)
    # errors over the true positives with a known velocity: 10 m/s for the reversed car, 0 for the other
    assert car["velocity_error"] == {"heading_right": pytest.approx(0.0), "heading_flipped": pytest.approx(10.0)}
    assert car["moving"] == 2 and car["velocity_reversed"] == pytest.approx(0.5)
    assert car["reversed_with_heading"] == 1.0
    truck = result["per_class"]["truck"]
    assert truck["true_positives"] == 1 and truck["heading_flipped"] == 0.0
    assert truck["velocity_error"]["heading_right"] == pytest.approx(0.5)
    assert truck["velocity_error"]["heading_flipped"] is None
    # a standing truck: nothing moving to reverse
    assert truck["moving"] == 0 and truck["velocity_reversed"] is None and truck["reversed_with_heading"] is None
    assert result["per_class"]["barrier"]["heading_flipped"] is None
    table = format_heading_table(result)
    assert "| car | 3 | 0.667 | 0.000 | 10.000 | 2 | 0.500 | 1.000 |" in table
    assert "| truck | 1 | 0.000 | 0.500 | - | 0 | - | - |" in table
