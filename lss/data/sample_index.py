"""The index of one split: everything its samples need except their pixels (file paths,
calibration, ego pose, object boxes in the ego frame, map geometry per location).

It is extracted from the tables and maps (through nuscenes-devkit) once, into numpy arrays that
forked loader workers share without copying Python objects, and kept in the on-disk index cache
(lss.data.index_cache), so that a later run neither imports the devkit nor reads the tables.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from pyquaternion import Quaternion

from lss.geometry.boxes import DETECTION_CLASSES, box_footprints
from lss.config import DataConfig
from lss.data.classes import category_matches, class_kinds
from lss.data.depth import lidar_to_camera_matrix
from lss.data.index_cache import index_key, load_index, save_index, wait_for_background_builds
from lss.data.map_geometry import load_map_geometry
from lss.data.tables import check_annotation, load_tables, resolve_split
from lss.errors import DatasetError

# The fields of a split's index (build_index's keys): what the on-disk index cache holds.
INDEX_FIELDS = (
    "devkit_split",
    "scene_count",
    "locations",
    "sample_tokens",
    "location_index",
    "image_sizes",
    "intrinsics",
    "sensor2ego_rot",
    "sensor2ego_trans",
    "ego_pose",
    "prev_index",
    "ego_motion",
    "lidar_to_camera",
    "image_paths",
    "lidar_paths",
    "object_offsets",
    "object_footprints",
    "object_class_bits",
    "det_boxes",
    "det_labels",
    "maps",
)


def split_index(root: Path, version: str, split: str, data: DataConfig) -> tuple[dict, bool]:
    """The index of `split` (a dict with the keys INDEX_FIELDS) and whether it came from the on-disk
    cache; one that is not cached is built from the tables and cached."""
    selection = (
        tuple(data.cameras),
        tuple(data.classes),
        data.min_visibility,
        data.min_lidar_pts,
        data.detection_targets,
        data.depth_targets,
    )
    key = index_key(root, version, split, selection)
    cached = load_index(key, INDEX_FIELDS)
    if cached is None and wait_for_background_builds():  # `lss train` builds it ahead (index_cache)
        cached = load_index(key, INDEX_FIELDS)
    if cached is not None:
        return cached, True
    index = build_index(root, version, split, data)
    save_index(key, index)
    return index, False


def build_index(root: Path, version: str, split: str, data: DataConfig) -> dict:
    """Everything `split` takes from the tables and maps: a dict with the keys INDEX_FIELDS."""
    nusc = load_tables(root, version)
    devkit_split, split_scenes = resolve_split(version, split)
    scenes = sorted(
        (s for s in nusc.scene if s["name"] in set(split_scenes)), key=lambda s: s["name"]
    )
    if not scenes:
        have = sorted(s["name"] for s in nusc.scene)
        raise DatasetError(
            f"split {split!r} ({devkit_split}) has none of its {len(split_scenes)} scenes "
            f"in {root / version}: the tables hold {have[:12]}"
            f"{' ...' if len(have) > 12 else ''}"
        )
    samples = _sample_records(nusc, scenes, root, version, data)
    if not len(samples["sample_tokens"]):
        raise DatasetError(
            f"split {split!r} ({devkit_split}): its {len(scenes)} scene(s) "
            f"({', '.join(s['name'] for s in scenes[:12])}) have no samples in "
            f"{root / version / 'sample.json'}; restore the tables from the dataset "
            "archive (or regenerate a synthetic set)"
        )
    kinds = class_kinds(data.classes)
    map_layers = sorted({c for c, k in zip(data.classes, kinds) if k == "map"})
    maps = (
        {loc: load_map_geometry(root, loc, map_layers) for loc in samples["locations"]}
        if map_layers
        else {}
    )
    return {"devkit_split": devkit_split, "scene_count": len(scenes), **samples, "maps": maps}


def previous_samples(samples: list[dict]) -> np.ndarray:
    """The index of every sample's previous sample (nuScenes `sample["prev"]`) in `samples`, int64;
    a scene's first sample (empty "prev") is its own previous sample, as in BEVDet4D."""
    position = {s["token"]: i for i, s in enumerate(samples)}
    prev_index = np.arange(len(samples), dtype=np.int64)
    for i, sample in enumerate(samples):
        if not sample["prev"]:
            continue
        if sample["prev"] not in position:
            raise DatasetError(
                f"sample {sample['token']}: its previous sample {sample['prev']} is not among the "
                "samples of its scene; the sample table is incomplete, restore it from the dataset "
                "archive (or regenerate a synthetic set)"
            )
        prev_index[i] = position[sample["prev"]]
    return prev_index


def previous_at_gap(
    prev_index: np.ndarray, ego_motion: np.ndarray, gap: int
) -> tuple[np.ndarray, np.ndarray]:
    """The sample `gap` key frames back of every sample (previous_samples followed `gap` times: a
    scene's first samples stop at the scene's first sample) and the ego motion from its ego frame
    into the sample's (the product of the one-step motions on the way: ego_motion[i] takes the
    previous sample's ego frame into sample i's). gap 1 returns the arrays as given."""
    if gap < 1:
        raise ValueError(f"gap={gap}: expected a whole number of key frames >= 1")
    if gap == 1:
        return prev_index, ego_motion
    index = np.arange(len(prev_index), dtype=np.int64)
    motion = np.broadcast_to(np.eye(4), (len(prev_index), 4, 4)).copy()
    for _ in range(gap):
        motion = motion @ ego_motion[index]
        index = prev_index[index]
    return index, motion


def _sample_records(nusc, scenes: list[dict], root: Path, version: str, data: DataConfig) -> dict:
    """The per-sample fields of INDEX_FIELDS (all but devkit_split, scene_count and maps) of
    `scenes`, their samples in scene then time order."""
    from nuscenes.eval.detection.utils import category_to_detection_name
    from nuscenes.utils.geometry_utils import transform_matrix

    cameras, classes = tuple(data.cameras), tuple(data.classes)
    samples = []
    for scene in scenes:
        recs = [
            nusc.get("sample", t) for t in nusc.field2token("sample", "scene_token", scene["token"])
        ]
        location = nusc.get("log", scene["log_token"])["location"]
        samples += [(location, r) for r in sorted(recs, key=lambda r: r["timestamp"])]
    locations = sorted({loc for loc, _ in samples})
    n, c = len(samples), len(cameras)
    sample_tokens = np.asarray([r["token"] for _, r in samples])
    location_index = np.asarray([locations.index(loc) for loc, _ in samples], dtype=np.int16)
    paths = [[""] * c for _ in range(n)]
    # source (W, H) per image from sample_data; 0 where the table has none (then read from the
    # file header)
    image_sizes = np.zeros((n, c, 2), dtype=np.int64)
    intrinsics = np.zeros((n, c, 3, 3), dtype=np.float32)
    sensor2ego_rot = np.zeros((n, c, 3, 3), dtype=np.float32)
    sensor2ego_trans = np.zeros((n, c, 3), dtype=np.float32)
    ego_pose = np.zeros((n, 3), dtype=np.float64)  # global x, y, yaw of LIDAR_TOP's ego pose
    ego_to_global = np.zeros((n, 4, 4), dtype=np.float64)  # LIDAR_TOP's ego pose, full 3D
    lidar_paths = [""] * n
    # lidar frame -> camera frame per sample and camera (through both ego poses); filled for
    # data.depth_targets
    lidar_to_camera = np.zeros((n if data.depth_targets else 0, c, 4, 4), dtype=np.float64)
    kinds = class_kinds(classes)
    object_classes = [k for k, kind in enumerate(kinds) if kind == "object"]
    # once, not per annotation
    annotation_table = root / version / "sample_annotation.json"
    class_bits, det_boxes, det_labels, offsets = [], [], [], [0]
    for i, (_, sample) in enumerate(samples):
        for k, cam in enumerate(cameras):
            if cam not in sample["data"]:
                raise DatasetError(
                    f"sample {sample['token']} has no {cam} image; its channels: "
                    f"{sorted(sample['data'])}"
                )
            sd = nusc.get("sample_data", sample["data"][cam])
            calib = nusc.get("calibrated_sensor", sd["calibrated_sensor_token"])
            paths[i][k] = str(root / sd["filename"])
            image_sizes[i, k] = (int(sd.get("width") or 0), int(sd.get("height") or 0))
            intrinsics[i, k] = np.asarray(calib["camera_intrinsic"])
            sensor2ego_rot[i, k] = Quaternion(calib["rotation"]).rotation_matrix
            sensor2ego_trans[i, k] = calib["translation"]
        if "LIDAR_TOP" not in sample["data"]:
            raise DatasetError(
                f"sample {sample['token']} has no LIDAR_TOP sample_data (the ego pose of the "
                f"targets and the depth targets come from it); its channels: "
                f"{sorted(sample['data'])}"
            )
        lidar_sd = nusc.get("sample_data", sample["data"]["LIDAR_TOP"])
        if data.depth_targets:
            lidar_paths[i] = str(root / lidar_sd["filename"])
            for k, cam in enumerate(cameras):
                lidar_to_camera[i, k] = lidar_to_camera_matrix(
                    nusc, lidar_sd["token"], sample["data"][cam]
                )
        pose = nusc.get("ego_pose", lidar_sd["ego_pose_token"])
        ego_rot = Quaternion(pose["rotation"]).rotation_matrix
        ego_t = np.asarray(pose["translation"])
        ego_pose[i] = (ego_t[0], ego_t[1], np.arctan2(ego_rot[1, 0], ego_rot[0, 0]))
        ego_to_global[i] = transform_matrix(ego_t, Quaternion(pose["rotation"]))
        for ann_token in sample["anns"]:
            ann = nusc.get("sample_annotation", ann_token)
            check_annotation(ann, annotation_table)
            if (
                int(ann["visibility_token"] or 0) < data.min_visibility
                or ann["num_lidar_pts"] < data.min_lidar_pts
            ):
                continue
            category = ann["category_name"]
            bits = sum(
                1 << b
                for b, k in enumerate(object_classes)
                if category_matches(classes[k], category)
            )
            label = (
                DETECTION_CLASSES.index(name)
                if (name := category_to_detection_name(category))
                else -1
            )
            if not bits and not (data.detection_targets and label >= 0):
                continue
            center = ego_rot.T @ (np.asarray(ann["translation"]) - ego_t)
            box_rot = ego_rot.T @ Quaternion(ann["rotation"]).rotation_matrix
            yaw = np.arctan2(box_rot[1, 0], box_rot[0, 0])
            w, l, h = ann["size"]
            velocity = np.zeros(2)
            if data.detection_targets and label >= 0:
                # NaN where the devkit cannot tell (an instance seen once): the targets leave its
                # velocity out of the loss (lss.geometry.boxes.encode_targets) instead of teaching 0
                velocity = (ego_rot.T @ nusc.box_velocity(ann_token))[:2]
            class_bits.append(bits)
            det_boxes.append([*center, w, l, h, yaw, *velocity])
            det_labels.append(label)
        offsets.append(len(det_boxes))
    prev_index = previous_samples([r for _, r in samples])
    boxes = np.asarray(det_boxes, dtype=np.float64).reshape(-1, 9)  # x y z w l h yaw vx vy, ego
    footprints = box_footprints(boxes[:, :2], boxes[:, 3:5], boxes[:, 6])
    return {
        "locations": locations,
        "sample_tokens": sample_tokens,
        "location_index": location_index,
        "image_sizes": image_sizes,
        "intrinsics": intrinsics,
        "sensor2ego_rot": sensor2ego_rot,
        "sensor2ego_trans": sensor2ego_trans,
        "ego_pose": ego_pose,
        "prev_index": prev_index,
        # previous sample's LIDAR_TOP ego frame -> this sample's (4 x 4; identity for a first one)
        "ego_motion": np.linalg.inv(ego_to_global) @ ego_to_global[prev_index],
        "lidar_to_camera": lidar_to_camera,
        "image_paths": np.asarray(paths, dtype=str).reshape(n, c),
        "lidar_paths": np.asarray(lidar_paths, dtype=str),
        "object_offsets": np.asarray(offsets, dtype=np.int64),
        "object_footprints": footprints.astype(np.float32),
        "object_class_bits": np.asarray(class_bits, dtype=np.int64),
        "det_boxes": boxes.astype(np.float32),
        "det_labels": np.asarray(det_labels, dtype=np.int64),
    }
