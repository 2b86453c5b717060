"""Where a class's velocity error comes from: the true positives of the nuScenes matching (greedy by
descending score, the nearest unmatched ground truth of the class in the sample within 2 m, as
DetectionEval's accumulate does) split by whether the predicted heading is turned more than 90
degrees from the truth, and whether the predicted velocity of a moving object points backwards.

The devkit reports each TP error as a mean along the recall curve; these are plain means over the
true positives, to read beside it (`lss eval` and `lss train` write them under the detection
summary's "true_positives")."""

from __future__ import annotations

import math
from typing import Iterable, Optional

import numpy as np

# the classes whose heading the devkit scores modulo 180 degrees (their AOE ignores a reversal)
HALF_TURN_CLASSES = ("barrier",)


def _mean(values: list[float]) -> Optional[float]:
    return float(np.mean(values)) if values else None


def match_true_positives(gt_boxes, pred_boxes, class_name: str, distance: float) -> list[tuple]:
    """(ground truth, prediction) pairs of `class_name` matched as DetectionEval matches them at
    `distance` metres (EvalBoxes in, DetectionBox pairs out)."""
    from nuscenes.eval.common.utils import center_distance

    preds = [box for box in pred_boxes.all if box.detection_name == class_name]
    order = np.argsort([-box.detection_score for box in preds], kind="stable")
    taken: set[tuple[str, int]] = set()
    pairs = []
    for index in order:
        pred = preds[index]
        best, best_distance = None, math.inf
        for gt_index, gt in enumerate(gt_boxes[pred.sample_token]):
            if gt.detection_name != class_name or (pred.sample_token, gt_index) in taken:
                continue
            d = center_distance(gt, pred)
            if d < best_distance:
                best, best_distance = gt_index, d
        if best is not None and best_distance < distance:
            taken.add((pred.sample_token, best))
            pairs.append((gt_boxes[pred.sample_token][best], pred))
    return pairs


def heading_and_velocity(
    gt_boxes, pred_boxes, class_names: Iterable[str], distance: float = 2.0, moving: float = 0.5
) -> dict:
    """Per class with true positives at `distance` m: "true_positives" (count); "heading_flipped",
    the share whose heading error exceeds 90 degrees (None for the classes scored modulo 180);
    "velocity_error" {"heading_right", "heading_flipped"}, the mean velocity error (m/s) of each
    part (true positives with a known true velocity); "moving", the true positives whose truth is
    faster than `moving` m/s; "velocity_reversed", the share of those whose predicted velocity
    points more than 90 degrees from the true one; "reversed_with_heading", the share of those
    reversed whose heading is flipped too."""
    from nuscenes.eval.common.utils import velocity_l2, yaw_diff

    out: dict = {"distance": distance, "moving_speed": moving, "per_class": {}}
    for name in class_names:
        pairs = match_true_positives(gt_boxes, pred_boxes, name, distance)
        if not pairs:
            continue
        half_turn = name in HALF_TURN_CLASSES
        flipped = [not half_turn and yaw_diff(gt, pred) > math.pi / 2 for gt, pred in pairs]
        errors: dict[bool, list[float]] = {False: [], True: []}
        reversed_, reversed_flipped, moving_count = 0, 0, 0
        for (gt, pred), flip in zip(pairs, flipped):
            truth = np.asarray(gt.velocity, np.float64)
            if not np.all(np.isfinite(truth)):
                continue
            errors[flip].append(float(velocity_l2(gt, pred)))
            if np.linalg.norm(truth) > moving:
                moving_count += 1
                if float(np.dot(truth, np.asarray(pred.velocity, np.float64))) < 0:
                    reversed_ += 1
                    reversed_flipped += int(flip)
        out["per_class"][name] = {
            "true_positives": len(pairs),
            "heading_flipped": None if half_turn else float(np.mean(flipped)),
            "velocity_error": {
                "heading_right": _mean(errors[False]),
                "heading_flipped": _mean(errors[True]),
            },
            "moving": moving_count,
            "velocity_reversed": reversed_ / moving_count if moving_count else None,
            "reversed_with_heading": reversed_flipped / reversed_ if reversed_ else None,
        }
    return out


def format_heading_table(result: dict) -> str:
    """Markdown table of heading_and_velocity()."""

    def cell(v, fmt="{:.3f}"):
        return "-" if v is None else fmt.format(v)

    lines = [
        f"true positives within {result['distance']} m (plain means; moving: faster than "
        f"{result['moving_speed']} m/s)",
        "",
        "| class | TPs | heading flipped | AVE, heading right | AVE, heading flipped | moving "
        "| velocity reversed | of those, heading flipped |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in result["per_class"].items():
        lines.append(
            f"| {name} | {row['true_positives']} | {cell(row['heading_flipped'])} | "
            f"{cell(row['velocity_error']['heading_right'])} | "
            f"{cell(row['velocity_error']['heading_flipped'])} | {row['moving']} | "
            f"{cell(row['velocity_reversed'])} | {cell(row['reversed_with_heading'])} |"
        )
    return "\n".join(lines) + "\n"
