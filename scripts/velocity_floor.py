"""What a single frame can reach on the nuScenes velocity error (AVE): the validation split's own boxes submitted
as predictions, perfect in everything but the velocity, scored by the official DetectionEval. Rows:

- `zero`: every box standing still;
- `heading`: a box the ground truth calls moving (faster than `--moving` m/s) moves along its heading at its class's
  median speed of the moving boxes of the training split, the others stand still: what one frame can know (class,
  heading, moving or not) without the speed;
- `truth`: the true velocity (the check: every velocity error 0).

    python scripts/velocity_floor.py --config configs/synthetic_detection.yaml --out velocity_floor.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from lss.config import DETECTION_CLASSES, load_config  # noqa: E402
from lss.geometry.boxes import BOX_VELOCITY, BOX_YAW  # noqa: E402

ROWS = ("zero", "heading", "truth")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/synthetic_detection.yaml", help="its data section picks the set")
    p.add_argument("--set", action="append", default=[], dest="overrides", help="config override (key=value)")
    p.add_argument("--moving", type=float, default=0.5, help="speed (m/s) above which a box counts as moving")
    p.add_argument("--out", default=None, help="JSON file of the figures")
    return p.parse_args(argv)


def split_boxes(dataset) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(sample token, boxes M x 9 in the ego frame, labels M) of every sample of `dataset`, unaugmented."""
    return [(str(dataset.sample_tokens[i]), *dataset.detection_targets(i)) for i in range(len(dataset))]


def median_speeds(samples, moving: float) -> dict[int, float]:
    """Each class's median speed over its moving boxes (known velocity faster than `moving`)."""
    speeds: dict[int, list[float]] = {}
    for _, boxes, labels in samples:
        speed = np.linalg.norm(boxes[:, BOX_VELOCITY], axis=1)
        for label, s in zip(labels, speed):
            if np.isfinite(s) and s > moving:
                speeds.setdefault(int(label), []).append(float(s))
    return {label: float(np.median(v)) for label, v in speeds.items()}


def predicted_velocity(boxes: np.ndarray, labels: np.ndarray, row: str, speeds: dict, moving: float) -> np.ndarray:
    """M x 2 velocities of `row` for the ground-truth boxes (unknown true velocities: 0)."""
    truth = np.nan_to_num(boxes[:, BOX_VELOCITY].astype(np.float64))
    if row == "truth":
        return truth
    if row == "zero":
        return np.zeros_like(truth)
    if row != "heading":
        raise ValueError(f"unknown row {row!r}: one of {', '.join(ROWS)}")
    speed = np.array([speeds.get(int(label), 0.0) for label in labels])
    speed = np.where(np.hypot(truth[:, 0], truth[:, 1]) > moving, speed, 0.0)
    yaw = boxes[:, BOX_YAW].astype(np.float64)
    return np.stack([np.cos(yaw), np.sin(yaw)], 1) * speed[:, None]


def evaluate(nusc, samples, row: str, speeds: dict, moving: float, eval_set: str, out_dir: Path) -> dict:
    from lss.engine.detection_eval import build_submission, evaluate_submission

    # distinct scores in a fixed random order: the devkit interpolates the TP errors along the
    # scores, so equal scores would leave one box's error as the class's
    rng = np.random.default_rng(0)
    detections = {}
    for token, boxes, labels in samples:
        boxes = boxes.astype(np.float64).copy()
        boxes[:, BOX_VELOCITY] = predicted_velocity(boxes, labels, row, speeds, moving)
        scores = rng.uniform(0.05, 1.0, len(boxes))
        detections[token] = {"boxes": boxes, "scores": scores, "labels": labels}
    submission = build_submission(detections, nusc, eval_set)
    return evaluate_submission(nusc, submission, eval_set, out_dir / row)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from lss.data.nuscenes import NuScenesBEV, load_tables

    cfg = load_config(args.config, args.overrides)
    cfg.data.detection_targets = True
    # the boxes the evaluation keeps: it drops those no lidar point reaches, which would otherwise
    # match their neighbours
    cfg.data.min_lidar_pts = max(cfg.data.min_lidar_pts, 1)
    train = NuScenesBEV(cfg.data.dataroot, cfg.data.version, cfg.data.train_split, cfg, is_train=False)
    val = NuScenesBEV(cfg.data.dataroot, cfg.data.version, cfg.data.val_split, cfg, is_train=False)
    speeds = median_speeds(split_boxes(train), args.moving)
    samples = split_boxes(val)
    result = {
        "config": args.config,
        "overrides": args.overrides,
        "moving": args.moving,
        "median_speed": {DETECTION_CLASSES[k]: round(v, 3) for k, v in sorted(speeds.items())},
        "rows": {},
    }
    nusc = load_tables(val.root, val.version)
    with tempfile.TemporaryDirectory() as tmp:
        for row in ROWS:
            summary = evaluate(nusc, samples, row, speeds, args.moving, val.devkit_split, Path(tmp))
            result["rows"][row] = {
                name: summary["per_class"][name]["vel_err"]
                for name in DETECTION_CLASSES
                if summary["per_class"][name].get("has_ground_truth")
            }
            result["rows"][row]["vehicles"] = summary["vehicles"]["tp_errors"]["vel_err"]
            print(row, {k: None if v is None else round(v, 2) for k, v in result["rows"][row].items()})
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
