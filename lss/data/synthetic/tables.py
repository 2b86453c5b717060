"""The 13 nuScenes tables (every field of every record, as in v1.0) of a synthetic dataset."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pyquaternion import Quaternion

from .rig import CAMERAS, LIDAR, Sensor
from .world import Scene

# The object categories of nuScenes v1.0 with their lidarseg indices.
CATEGORIES = [
    ("animal", 1, "All animals, e.g. cats, rats, dogs, deer, birds."),
    ("human.pedestrian.adult", 2, "Adult subcategory."),
    ("human.pedestrian.child", 3, "Child subcategory."),
    ("human.pedestrian.construction_worker", 4, "Construction worker"),
    ("human.pedestrian.personal_mobility", 5, "A small electric or self-propelled vehicle."),
    ("human.pedestrian.police_officer", 6, "Police officer."),
    ("human.pedestrian.stroller", 7, "Strollers."),
    ("human.pedestrian.wheelchair", 8, "Wheelchairs."),
    (
        "movable_object.barrier",
        9,
        "Temporary road barrier placed in the scene in order to redirect traffic.",
    ),
    ("movable_object.debris", 10, "Movable object that is left on the driveable surface."),
    ("movable_object.pushable_pullable", 11, "Objects that a pedestrian may push or pull."),
    ("movable_object.trafficcone", 12, "All types of traffic cone."),
    (
        "static_object.bicycle_rack",
        13,
        "Area or device intended to park or secure the bicycles in a row.",
    ),
    (
        "vehicle.bicycle",
        14,
        "Human or electric powered 2-wheeled vehicle designed to travel at lower speeds.",
    ),
    (
        "vehicle.bus.bendy",
        15,
        "Bendy bus subcategory. Annotate each section of the bendy bus individually.",
    ),
    ("vehicle.bus.rigid", 16, "Rigid bus subcategory."),
    (
        "vehicle.car",
        17,
        "Vehicle designed primarily for personal use, e.g. sedans, hatch-backs, wagons, vans.",
    ),
    (
        "vehicle.construction",
        18,
        "Vehicles primarily designed for construction. Typically very slow moving.",
    ),
    ("vehicle.emergency.ambulance", 19, "All types of ambulances."),
    ("vehicle.emergency.police", 20, "All types of police vehicles."),
    (
        "vehicle.motorcycle",
        21,
        "Gasoline or electric powered 2-wheeled vehicle designed to move rapidly.",
    ),
    ("vehicle.trailer", 22, "Any vehicle trailer, both for trucks, cars and motorcycles."),
    (
        "vehicle.truck",
        23,
        "Vehicles primarily designed to haul cargo including pick-ups, lorrys, trucks.",
    ),
]
ATTRIBUTES = [
    ("vehicle.moving", "Vehicle is moving."),
    (
        "vehicle.stopped",
        "Vehicle, with a driver/rider in/on it, is currently stationary but has an intent to move.",
    ),
    (
        "vehicle.parked",
        "Vehicle is stationary (usually for longer duration) with no immediate intent to move.",
    ),
    ("cycle.with_rider", "There is someone riding the bicycle or motorcycle."),
    ("cycle.without_rider", "There is NO rider on the bicycle or motorcycle."),
    ("pedestrian.sitting_lying_down", "The human is sitting or lying down."),
    ("pedestrian.standing", "The human is standing."),
    ("pedestrian.moving", "The human is moving."),
]
VISIBILITY = [
    ("1", "v0-40", "visibility of whole object is between 0 and 40%"),
    ("2", "v40-60", "visibility of whole object is between 40 and 60%"),
    ("3", "v60-80", "visibility of whole object is between 60 and 80%"),
    ("4", "v80-100", "visibility of whole object is between 80 and 100%"),
]
# Where the official mini scenes were recorded; other scenes are spread over the four maps.
MINI_LOCATIONS = {
    "scene-0061": "singapore-onenorth",
    "scene-0103": "boston-seaport",
    "scene-0553": "boston-seaport",
    "scene-0655": "boston-seaport",
    "scene-0757": "boston-seaport",
    "scene-0796": "singapore-queenstown",
    "scene-0916": "singapore-queenstown",
    "scene-1077": "singapore-hollandvillage",
    "scene-1094": "singapore-hollandvillage",
    "scene-1100": "singapore-hollandvillage",
}
START_TIME_US = 1532402927000000  # 2018-07-24, when scene-0061 was recorded


def visibility_token(fraction: float) -> str:
    """nuScenes visibility level ("1".."4") of the visible fraction of an object in all camera
    images."""
    return "1" if fraction < 0.4 else "2" if fraction < 0.6 else "3" if fraction < 0.8 else "4"


class TokenFactory:
    """32-hex-digit tokens derived from the seed and a record's identity: same seed, same tokens."""

    def __init__(self, seed: int):
        self.seed = seed

    def __call__(self, *parts) -> str:
        return hashlib.md5("/".join(str(p) for p in (self.seed,) + parts).encode()).hexdigest()


def logfile_name(scene: Scene, location: str) -> str:
    """nuScenes-style log name: vehicle, date, time and time zone."""
    start = START_TIME_US + scene.index * 3_600_000_000
    secs = start // 1_000_000
    hh, mm, ss = (secs // 3600) % 24, (secs // 60) % 60, secs % 60
    if location.startswith("singapore"):
        return f"n015-2018-07-24-{(hh + 8) % 24:02d}-{mm:02d}-{ss:02d}+0800"
    return f"n008-2018-07-24-{(hh - 4) % 24:02d}-{mm:02d}-{ss:02d}-0400"


def sample_timestamp(scene: Scene, k: int) -> int:
    return START_TIME_US + scene.index * 3_600_000_000 + k * 500_000


def sample_filename(scene: Scene, k: int, channel: str) -> str:
    ext = "pcd.bin" if channel == LIDAR else "jpg"
    log, stamp = logfile_name(scene, scene.location), sample_timestamp(scene, k)
    return f"samples/{channel}/{log}__{channel}__{stamp}.{ext}"


def _yaw_quaternion(yaw: float) -> list[float]:
    q = Quaternion(axis=[0.0, 0.0, 1.0], angle=float(yaw))
    return [float(q.w), float(q.x), float(q.y), float(q.z)]


def build_tables(
    scenes: list[Scene], rig: dict[str, Sensor], stats: dict, seed: int, map_tokens: dict[str, str]
) -> dict[str, list[dict]]:
    """All 13 tables. `stats[(scene index, k)]` holds per-agent "visible", "projected" (pixels over
    all cameras) and "lidar" (points) dicts; `map_tokens` maps location -> map token."""
    tok = TokenFactory(seed)
    category = [
        {"token": tok("category", n), "name": n, "description": d, "index": i}
        for n, i, d in CATEGORIES
    ]
    cat_token = {c["name"]: c["token"] for c in category}
    attribute = [{"token": tok("attribute", n), "name": n, "description": d} for n, d in ATTRIBUTES]
    attr_token = {a["name"]: a["token"] for a in attribute}
    visibility = [{"description": d, "token": t, "level": lv} for t, lv, d in VISIBILITY]
    channels = list(CAMERAS) + [LIDAR]
    sensor = [
        {
            "token": tok("sensor", ch),
            "channel": ch,
            "modality": "lidar" if ch == LIDAR else "camera",
        }
        for ch in channels
    ]
    sensor_token = {s["channel"]: s["token"] for s in sensor}

    calibrated_sensor, ego_pose, log, scene_tab, sample, sample_data = [], [], [], [], [], []
    instance, sample_annotation = [], []
    for sc in scenes:
        log_token = tok("log", sc.name)
        log.append(
            {
                "token": log_token,
                "logfile": logfile_name(sc, sc.location),
                "vehicle": "n008" if sc.location == "boston-seaport" else "n015",
                "date_captured": "2018-07-24",
                "location": sc.location,
            }
        )
        # One calibration per channel per scene, like one per log in nuScenes.
        cs_token = {}
        for ch in channels:
            s = rig[ch]
            cs_token[ch] = tok("calibrated_sensor", sc.name, ch)
            calibrated_sensor.append(
                {
                    "token": cs_token[ch],
                    "sensor_token": sensor_token[ch],
                    "translation": [float(v) for v in s.translation],
                    "rotation": [float(v) for v in s.rotation],
                    "camera_intrinsic": [] if s.intrinsic is None else s.intrinsic.tolist(),
                }
            )
        n = sc.num_samples
        sample_tokens = [tok("sample", sc.name, k) for k in range(n)]
        scene_token = tok("scene", sc.name)
        scene_tab.append(
            {
                "token": scene_token,
                "log_token": log_token,
                "nbr_samples": n,
                "first_sample_token": sample_tokens[0],
                "last_sample_token": sample_tokens[-1],
                "name": sc.name,
                "description": f"Synthetic drive in {sc.location}, {len(sc.agents)} objects.",
            }
        )
        sd_tokens = {ch: [tok("sample_data", sc.name, ch, k) for k in range(n)] for ch in channels}
        for k in range(n):
            ts = sample_timestamp(sc, k)
            sample.append(
                {
                    "token": sample_tokens[k],
                    "timestamp": ts,
                    "prev": sample_tokens[k - 1] if k > 0 else "",
                    "next": sample_tokens[k + 1] if k + 1 < n else "",
                    "scene_token": scene_token,
                }
            )
            for ch in channels:
                pose_token = tok("ego_pose", sc.name, ch, k)
                ego_pose.append(
                    {
                        "token": pose_token,
                        "timestamp": ts,
                        "rotation": _yaw_quaternion(sc.ego_yaw[k]),
                        "translation": [float(sc.ego_x[k]), float(sc.ego_y[k]), 0.0],
                    }
                )
                cam = rig[ch].size
                sample_data.append(
                    {
                        "token": sd_tokens[ch][k],
                        "sample_token": sample_tokens[k],
                        "ego_pose_token": pose_token,
                        "calibrated_sensor_token": cs_token[ch],
                        "timestamp": ts,
                        "fileformat": "pcd" if ch == LIDAR else "jpg",
                        "is_key_frame": True,
                        "height": 0 if cam is None else int(cam[1]),
                        "width": 0 if cam is None else int(cam[0]),
                        "filename": sample_filename(sc, k, ch),
                        "prev": sd_tokens[ch][k - 1] if k > 0 else "",
                        "next": sd_tokens[ch][k + 1] if k + 1 < n else "",
                    }
                )
        # Annotations: one instance per agent, one annotation per key frame it is in range.
        frames: dict[int, list[int]] = {}
        for k in range(n):
            for i in sc.visible_agents(k):
                frames.setdefault(i, []).append(k)
        for i in sorted(frames):
            agent = sc.agents[i]
            inst_token = tok("instance", sc.name, i)
            ks = frames[i]
            ann_tokens = [tok("sample_annotation", sc.name, i, k) for k in ks]
            instance.append(
                {
                    "token": inst_token,
                    "category_token": cat_token[agent.category],
                    "nbr_annotations": len(ks),
                    "first_annotation_token": ann_tokens[0],
                    "last_annotation_token": ann_tokens[-1],
                }
            )
            for j, k in enumerate(ks):
                st = stats[(sc.index, k)]
                projected = st["projected"].get(i, 0)
                fraction = st["visible"].get(i, 0) / projected if projected else 0.0
                attr = agent.attribute[k]
                sample_annotation.append(
                    {
                        "token": ann_tokens[j],
                        "sample_token": sample_tokens[k],
                        "instance_token": inst_token,
                        "visibility_token": visibility_token(fraction),
                        "attribute_tokens": [attr_token[attr]] if attr else [],
                        "translation": [float(agent.x[k]), float(agent.y[k]), float(agent.z)],
                        "size": [float(v) for v in agent.size],
                        "rotation": _yaw_quaternion(agent.yaw[k]),
                        "prev": ann_tokens[j - 1] if j > 0 else "",
                        "next": ann_tokens[j + 1] if j + 1 < len(ks) else "",
                        "num_lidar_pts": int(st["lidar"].get(i, 0)),
                        "num_radar_pts": 0,
                    }
                )
    locations = sorted({sc.location for sc in scenes})
    map_tab = [
        {
            "category": "semantic_prior",
            "token": map_tokens[loc],
            "filename": f"maps/{map_tokens[loc]}.png",
            "log_tokens": [lg["token"] for lg in log if lg["location"] == loc],
        }
        for loc in locations
    ]
    return {
        "category": category,
        "attribute": attribute,
        "visibility": visibility,
        "instance": instance,
        "sensor": sensor,
        "calibrated_sensor": calibrated_sensor,
        "ego_pose": ego_pose,
        "log": log,
        "scene": scene_tab,
        "sample": sample,
        "sample_data": sample_data,
        "sample_annotation": sample_annotation,
        "map": map_tab,
    }


def write_tables(table_root: Path, tables: dict[str, list[dict]]) -> None:
    table_root.mkdir(parents=True, exist_ok=True)
    for name, records in tables.items():
        with open(table_root / f"{name}.json", "w") as f:
            json.dump(records, f, indent=0)
