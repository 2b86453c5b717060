"""nuScenes detection evaluation of the detection head: ego-frame detections -> the official
submission JSON (global frame) -> nuscenes.eval.detection's DetectionEval (config
"detection_cvpr_2019") -> mAP, NDS and the true-positive errors per class, as a markdown table and
JSON."""

from __future__ import annotations

import json
import math
import re
import tempfile
from pathlib import Path
from typing import Iterable, Optional, Union

import numpy as np
import torch
import torch.distributed as dist
from pyquaternion import Quaternion

from lss.config import DETECTION_CLASSES, Config, config_from_dict, config_to_dict
from lss.data.nuscenes import load_tables, resolve_split
from lss.engine.detection_motion import format_heading_table, heading_and_velocity
from lss.errors import ConfigError, DatasetError
from lss.models.heads.detection_decode import decode_detections

TP_ERRORS = ("trans_err", "scale_err", "orient_err", "vel_err", "attr_err")
_TABLE_COLUMNS = {
    "trans_err": "ATE (m)",
    "scale_err": "ASE (1-IoU)",
    "orient_err": "AOE (rad)",
    "vel_err": "AVE (m/s)",
    "attr_err": "AAE (1-acc)",
}
# The nuScenes vehicle classes; the "vehicles" summary scores those of them with ground truth in the
# split.
VEHICLE_CLASSES = ("car", "truck", "bus", "trailer", "construction_vehicle")
# detection.* settings that act after the network (decode_detections, the attributes), and those
# that act there only without the second stage (with it, the model makes its proposals inside the
# forward pass)
DECODE_SETTINGS = ("refine_score_alpha", "refine_residuals", "max_detections", "moving_speed")
PROPOSAL_SETTINGS = ("score_threshold", "nms_iou", "top_k")
SUBMISSION_META = {
    "use_camera": True,
    "use_lidar": False,
    "use_radar": False,
    "use_map": False,
    "use_external": False,
}


def default_attribute(name: str, speed: float, moving_speed: float = 0.2) -> str:
    """The attribute the evaluation scores (AAE) for a class, from the predicted speed (m/s): moving
    above `moving_speed` (detection.moving_speed; the devkit's baselines cut at 0.2 m/s)."""
    moving = bool(speed > moving_speed)
    if name in VEHICLE_CLASSES:
        return "vehicle.moving" if moving else "vehicle.parked"
    if name == "pedestrian":
        return "pedestrian.moving" if moving else "pedestrian.standing"
    if name in ("motorcycle", "bicycle"):
        return "cycle.with_rider" if moving else "cycle.without_rider"
    return ""


def lidar_ego_pose(nusc, sample_token: str) -> tuple[np.ndarray, Quaternion]:
    """Translation (3,) and rotation of the ego pose at the sample's LIDAR_TOP sweep (the frame of
    det_boxes)."""
    sample = nusc.get("sample", sample_token)
    pose = nusc.get(
        "ego_pose", nusc.get("sample_data", sample["data"]["LIDAR_TOP"])["ego_pose_token"]
    )
    return np.asarray(pose["translation"], dtype=np.float64), Quaternion(pose["rotation"])


def ego_boxes_to_submission(
    sample_token: str,
    boxes: np.ndarray,
    scores: np.ndarray,
    labels: np.ndarray,
    ego_translation: np.ndarray,
    ego_rotation: Quaternion,
    classes: tuple[str, ...] = DETECTION_CLASSES,
    moving_speed: float = 0.2,
) -> list[dict]:
    """Submission entries (global frame) of one sample's boxes M x 9 [x, y, z, w, l, h, yaw, vx, vy]
    (ego frame), scores M and labels M (indices into `classes`); the attributes by
    default_attribute at `moving_speed`."""
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 9)
    entries = []
    rotation = ego_rotation.rotation_matrix
    for box, score, label in zip(boxes, np.asarray(scores, dtype=np.float64), np.asarray(labels)):
        if not np.isfinite(box).all() or not np.isfinite(score):
            continue
        centre = rotation @ box[:3] + ego_translation
        velocity = (rotation @ np.array([box[7], box[8], 0.0]))[:2]
        orientation = ego_rotation * Quaternion(axis=(0.0, 0.0, 1.0), radians=float(box[6]))
        name = classes[int(label)]
        entries.append(
            {
                "sample_token": sample_token,
                "translation": centre.tolist(),
                "size": box[3:6].tolist(),
                "rotation": orientation.elements.tolist(),
                "velocity": velocity.tolist(),
                "detection_name": name,
                "detection_score": float(score),
                "attribute_name": default_attribute(name, float(np.hypot(*velocity)), moving_speed),
            }
        )
    return entries


def split_sample_tokens(nusc, eval_set: str) -> list[str]:
    """Every sample token of the devkit split `eval_set` (e.g. "mini_val") in this dataset."""
    scenes = set(resolve_split(nusc.version, eval_set)[1])
    return [
        s["token"] for s in nusc.sample if nusc.get("scene", s["scene_token"])["name"] in scenes
    ]


def build_submission(
    detections: dict,
    nusc,
    eval_set: str,
    classes: tuple[str, ...] = DETECTION_CLASSES,
    moving_speed: float = 0.2,
) -> dict:
    """The submission JSON object: `detections` maps sample tokens to {"boxes" M x 9 (ego frame),
    "scores" M, "labels" M} (tensors or arrays); samples of the split without detections get an
    empty list, as the evaluation requires every sample of the split. Attributes: moving above
    `moving_speed` m/s."""
    results = {token: [] for token in split_sample_tokens(nusc, eval_set)}
    for token, det in detections.items():
        if token not in results:
            raise DatasetError(
                f"sample {token} is not in the evaluation split {eval_set!r}; evaluate the split "
                "the detections were made on (config data.val_split)"
            )
        translation, rotation = lidar_ego_pose(nusc, token)
        results[token] = ego_boxes_to_submission(
            token,
            _numpy(det["boxes"]),
            _numpy(det["scores"]),
            _numpy(det["labels"]),
            translation,
            rotation,
            classes,
            moving_speed,
        )
    return {"meta": dict(SUBMISSION_META), "results": results}


def _numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if torch.is_tensor(x) else np.asarray(x)


def _finite_or_none(x: float) -> Optional[float]:
    return float(x) if x is not None and math.isfinite(x) else None


def summarize(metrics, classes_with_gt: Iterable[str]) -> dict:
    """Plain-JSON summary of the devkit's DetectionMetrics: mAP, NDS, mean TP errors and per class
    AP (mean over the distance thresholds), AP per threshold and the TP errors (None where the
    devkit leaves them undefined)."""
    classes_with_gt = sorted(set(classes_with_gt), key=list(metrics.cfg.class_names).index)
    mean_dist_aps = metrics.mean_dist_aps
    per_class = {}
    for name in metrics.cfg.class_names:
        per_class[name] = {
            "AP": float(mean_dist_aps[name]),
            "AP_per_distance": {
                str(d): float(metrics.get_label_ap(name, d)) for d in metrics.cfg.dist_ths
            },
            **{m: _finite_or_none(metrics.get_label_tp(name, m)) for m in TP_ERRORS},
            "has_ground_truth": name in classes_with_gt,
        }
    present = [per_class[n]["AP"] for n in classes_with_gt]
    vehicles = [n for n in classes_with_gt if n in VEHICLE_CLASSES]
    return {
        "mAP": float(metrics.mean_ap),
        "NDS": float(metrics.nd_score),
        "tp_errors": {m: _finite_or_none(v) for m, v in metrics.tp_errors.items()},
        "mAP_classes_with_gt": float(np.mean(present)) if present else 0.0,
        "classes_with_gt": classes_with_gt,
        "per_class": per_class,
        "vehicles": {
            "classes": vehicles,
            **subset_scores(per_class, vehicles, metrics.cfg.mean_ap_weight),
        },
    }


def subset_scores(per_class: dict, classes: Iterable[str], mean_ap_weight: float = 5.0) -> dict:
    """mAP and NDS over a subset of the classes, by the devkit's formulas: mAP the mean of the
    classes' AP, each TP error the mean over the classes where it is defined, NDS = (w mAP + sum of
    max(0, 1 - error)) / (w + 5)."""
    classes = list(classes)
    if not classes:
        return {"mAP": 0.0, "NDS": 0.0, "tp_errors": {m: None for m in TP_ERRORS}}
    mean_ap = float(np.mean([per_class[n]["AP"] for n in classes]))
    errors = {}
    for m in TP_ERRORS:
        defined = [per_class[n][m] for n in classes if per_class[n][m] is not None]
        errors[m] = float(np.mean(defined)) if defined else None
    # A metric undefined for every class counts as the worst error (the devkit would give NaN).
    tp_scores = [max(0.0, 1.0 - e) if e is not None else 0.0 for e in errors.values()]
    return {
        "mAP": mean_ap,
        "NDS": (mean_ap_weight * mean_ap + sum(tp_scores)) / (mean_ap_weight + len(TP_ERRORS)),
        "tp_errors": errors,
    }


def format_table(summary: dict) -> str:
    """Markdown table of a summary(): one row per class (AP and TP errors), then the means, mAP and
    NDS, and evaluate_submission's true-positive table where the summary has it."""

    def cell(v):
        return "-" if v is None else f"{v:.3f}"

    head = ["class", "AP"] + [_TABLE_COLUMNS[m] for m in TP_ERRORS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in summary["per_class"].items():
        flag = "" if row["has_ground_truth"] else " (no GT)"
        lines.append(
            "| "
            + " | ".join([name + flag, cell(row["AP"])] + [cell(row[m]) for m in TP_ERRORS])
            + " |"
        )
    lines.append(
        "| **mean** | "
        + " | ".join([cell(summary["mAP"])] + [cell(summary["tp_errors"][m]) for m in TP_ERRORS])
        + " |"
    )
    lines.append("")
    lines.append(
        f"mAP {summary['mAP']:.4f}, NDS {summary['NDS']:.4f} on {summary['eval_set']} "
        f"({summary['num_samples']} samples); mAP over the {len(summary['classes_with_gt'])} "
        f"classes with ground truth: {summary['mAP_classes_with_gt']:.4f}"
    )
    vehicles = summary.get("vehicles")
    if vehicles and vehicles["classes"]:
        lines.append(
            f"vehicles ({', '.join(vehicles['classes'])}): mAP {vehicles['mAP']:.4f}, NDS "
            f"{vehicles['NDS']:.4f}"
        )
    if "true_positives" in summary:
        lines += ["", format_heading_table(summary["true_positives"]).rstrip("\n")]
    return "\n".join(lines) + "\n"


def evaluate_submission(
    nusc,
    submission: Union[dict, str, Path],
    eval_set: str,
    out_dir: Union[str, Path],
    sample_tokens: Optional[Iterable[str]] = None,
    verbose: bool = False,
) -> dict:
    """Run the official DetectionEval (detection_cvpr_2019) on a submission (object or JSON path).

    Writes OUT_DIR/detection_submission.json (when given an object), detection_metrics.json and
    detection_metrics.md; returns summarize()'s dict plus "eval_set", "num_samples" and
    "true_positives" (lss.engine.detection_motion: heading flips and reversed velocities). With
    `sample_tokens`, the evaluation is restricted to those samples of the split (e.g. when
    eval.max_batches stopped early).
    """
    from nuscenes.eval.common.config import config_factory
    from nuscenes.eval.detection.evaluate import DetectionEval

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(submission, dict):
        path = out_dir / "detection_submission.json"
        path.write_text(json.dumps(submission))
    else:
        path = Path(submission)
        if not path.is_file():
            raise FileNotFoundError(f"detection submission {path} does not exist")
    evaluator = DetectionEval(
        nusc,
        config_factory("detection_cvpr_2019"),
        str(path),
        eval_set,
        output_dir=str(out_dir / "detection_eval"),
        verbose=verbose,
    )
    if sample_tokens is not None:
        keep = set(sample_tokens)
        for boxes in (evaluator.gt_boxes, evaluator.pred_boxes):
            for token in [t for t in boxes.boxes if t not in keep]:
                del boxes.boxes[token]
        evaluator.sample_tokens = evaluator.gt_boxes.sample_tokens
    metrics, _ = evaluator.evaluate()
    summary = summarize(metrics, {box.detection_name for box in evaluator.gt_boxes.all})
    summary["eval_set"] = eval_set
    summary["num_samples"] = len(evaluator.sample_tokens)
    summary["true_positives"] = heading_and_velocity(
        evaluator.gt_boxes, evaluator.pred_boxes, summary["classes_with_gt"]
    )
    (out_dir / "detection_metrics.json").write_text(json.dumps(summary, indent=1))
    (out_dir / "detection_metrics.md").write_text(format_table(summary))
    return summary


def decode_variants(config: Config, specs: Iterable[str]) -> dict[str, Config]:
    """Post-processing variants to evaluate on the same forward pass (`lss eval --decode`): each
    spec is NAME=detection.key=value[;detection.key=value...]; returns {NAME: `config` with those
    settings}. Only settings that act after the network are accepted (DECODE_SETTINGS, and
    PROPOSAL_SETTINGS without the second stage)."""
    allowed = DECODE_SETTINGS + (() if config.detection.refine else PROPOSAL_SETTINGS)
    variants: dict[str, Config] = {}
    for spec in specs:
        name, _, rest = spec.partition("=")
        name = name.strip()
        overrides = [item.strip() for item in rest.split(";") if item.strip()]
        if not re.fullmatch(r"[A-Za-z0-9_-]+", name) or not overrides:
            raise ConfigError(
                f"--decode {spec!r}: expected NAME=detection.key=value[;detection.key=value...], "
                "NAME of letters, digits, _ and - (its files go to decode/NAME), "
                "e.g. score_only=detection.refine_score_alpha=0.0"
            )
        if name in variants:
            raise ConfigError(f"--decode {spec!r}: the name {name!r} is given twice")
        for item in overrides:
            section, _, key = item.partition("=")[0].strip().partition(".")
            if section == "detection" and key in allowed:
                continue
            why = (
                f"detection.{key} makes the second stage's proposals inside the network "
                "(detection.refine: true): evaluate a config with it instead"
                if section == "detection" and key in PROPOSAL_SETTINGS
                else "a decode variant changes the post-processing only"
            )
            raise ConfigError(
                f"--decode {spec!r}: {why}; the settings it takes: "
                f"{', '.join('detection.' + k for k in allowed)}"
            )
        variants[name] = config_from_dict(config_to_dict(config), overrides)
    return variants


def format_decode_table(base: dict, variants: dict[str, dict]) -> str:
    """Markdown table of the evaluation's own detections (`base`, a summarize() dict) and each
    decode variant's."""
    lines = ["| decode | mAP | NDS | vehicle mAP | vehicle NDS |", "|---|---|---|---|---|"]
    for name, s in {"(the config)": base, **variants}.items():
        vehicles = s.get("vehicles") or {}
        lines.append(
            f"| {name} | {s['mAP']:.4f} | {s['NDS']:.4f} | {vehicles.get('mAP', 0.0):.4f} | "
            f"{vehicles.get('NDS', 0.0):.4f} |"
        )
    return "\n".join(lines) + "\n"


class DetectionCollector:
    """Gathers the decoded detections of an evaluation loop by sample token, then runs the nuScenes
    evaluation.

    Use: `collector.add(outputs, batch)` after each forward (model in eval mode; the batch carries
    "sample_token"), then `collector.evaluate(nusc, eval_set, out_dir)`.
    """

    def __init__(self, config: Config):
        self.config = config
        self.detections: dict[str, dict] = {}

    def add(self, outputs: dict, batch: dict) -> None:
        tokens = batch["sample_token"]
        decoded = decode_detections(outputs, self.config)
        if len(tokens) != len(decoded):
            raise ValueError(
                f"DetectionCollector.add: {len(tokens)} sample tokens but {len(decoded)} samples "
                "of detections; pass the batch the outputs were computed on"
            )
        for token, det in zip(tokens, decoded):
            self.detections[token] = {k: v.detach().cpu() for k, v in det.items()}

    def gather(self) -> None:
        """Merge the detections of every distributed rank into each rank's collector (no-op when not
        distributed)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, self.detections)
        for part in parts:
            self.detections.update(part)

    def evaluate(
        self,
        nusc,
        eval_set: str,
        out_dir: Union[str, Path],
        verbose: bool = False,
        print_table: bool = True,
    ) -> dict:
        """Metrics of the collected samples (see evaluate_submission); the table is printed unless
        `print_table` is false."""
        submission = build_submission(
            self.detections, nusc, eval_set, moving_speed=self.config.detection.moving_speed
        )
        restrict = (
            None if set(self.detections) == set(submission["results"]) else list(self.detections)
        )
        summary = evaluate_submission(
            nusc, submission, eval_set, out_dir, sample_tokens=restrict, verbose=verbose
        )
        if print_table:
            print(format_table(summary), end="")
        return summary

    def evaluate_dataset(
        self, dataset, out_dir: Optional[Union[str, Path]] = None, print_table: bool = True
    ) -> dict:
        """Metrics on the split of `dataset` (a lss.data.NuScenesBEV), gathered over distributed
        ranks: rank 0 evaluates and shares the result. Files go to `out_dir` (default: a temporary
        folder, removed after)."""
        if not all(hasattr(dataset, a) for a in ("root", "version", "devkit_split")):
            raise TypeError(
                f"DetectionCollector.evaluate_dataset: expected a lss.data.NuScenesBEV, got "
                f"{type(dataset).__name__}"
            )
        self.gather()
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        summary = None
        if not distributed or dist.get_rank() == 0:
            nusc = load_tables(dataset.root, dataset.version)
            if out_dir is not None:
                summary = self.evaluate(
                    nusc, dataset.devkit_split, out_dir, print_table=print_table
                )
            else:
                with tempfile.TemporaryDirectory(prefix="lss_detection_eval_") as tmp:
                    summary = self.evaluate(
                        nusc, dataset.devkit_split, tmp, print_table=print_table
                    )
        if distributed:
            shared = [summary]
            dist.broadcast_object_list(shared, src=0)
            summary = shared[0]
        return summary
