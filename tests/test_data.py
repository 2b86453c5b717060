"""NuScenesBEV end to end on a tiny hand-built nuScenes set (known boxes, poses and map), plus the synthetic set."""
import json
import math
import shutil

import numpy as np
import pytest
import torch
from nuscenes.utils.data_classes import Box
from PIL import Image
from pyquaternion import Quaternion

from lss.config import NUSCENES_CAMERAS, Config, validate
from lss.data import DETECTION_CLASSES, NuScenesBEV, collate, locate_dataroot
from lss.data.loader import build_dataset, build_eval_loader, build_loader, ensure_dataset
from lss.data.samplers import EpochSampler
from lss.errors import DatasetError

VERSION = "v1.0-mini"
EGO = [(600.0, 1600.0, 0.7), (604.0, 1603.0, 0.75)]  # global x, y, yaw per sample (scene-0061)
# Annotations of sample 0 (global frame): category, centre, size (w, l, h), yaw, visibility, lidar points.
ANNS = [
    ("vehicle.car", (612.0, 1608.0, 1.0), (1.9, 4.5, 1.6), 0.3, "4", 50),
    ("human.pedestrian.adult", (596.0, 1609.0, 0.9), (0.6, 0.7, 1.8), 0.0, "1", 3),
    ("movable_object.barrier", (590.0, 1590.0, 0.5), (0.5, 2.0, 1.0), 1.0, "3", 0),
    ("vehicle.truck", (630.0, 1580.0, 1.5), (2.5, 8.0, 3.0), -0.4, "2", 20),
]


def _token(*parts):
    return "t" + "_".join(str(p) for p in parts)


def build_tiny_set(root, with_maps=True):
    """Two scenes (scene-0061 in mini_train, scene-0103 in mini_val), two samples each, 6 cameras 160 x 90."""
    tables = {k: [] for k in ("category", "attribute", "visibility", "instance", "sensor", "calibrated_sensor",
                              "ego_pose", "log", "scene", "sample", "sample_data", "sample_annotation", "map")}
    cats = sorted({a[0] for a in ANNS})
    tables["category"] = [{"token": _token("cat", c), "name": c, "description": ""} for c in cats]
    tables["visibility"] = [{"token": str(v), "level": f"v{v}", "description": ""} for v in range(1, 5)]
    channels = list(NUSCENES_CAMERAS) + ["LIDAR_TOP"]
    for ch in channels:
        tables["sensor"].append({"token": _token("sensor", ch), "channel": ch,
                                 "modality": "lidar" if ch == "LIDAR_TOP" else "camera"})
        k = channels.index(ch)
        yaw = math.radians([55, 0, -55, 110, 180, -110, 0][k])
        rot = Quaternion(axis=[0, 0, 1], angle=yaw) * Quaternion(axis=[0, 0, 1], angle=-math.pi / 2) * \
            Quaternion(axis=[1, 0, 0], angle=-math.pi / 2)
        tables["calibrated_sensor"].append({
            "token": _token("calib", ch), "sensor_token": _token("sensor", ch),
            "translation": [1.5 * math.cos(yaw), 0.5 * math.sin(yaw), 1.6],
            "rotation": list(rot.elements) if ch != "LIDAR_TOP" else [1.0, 0, 0, 0],
            "camera_intrinsic": [[126.6, 0, 80.0], [0, 126.6, 45.0], [0, 0, 1]] if ch != "LIDAR_TOP" else []})
    tables["log"] = [{"token": "log0", "logfile": "", "vehicle": "", "date_captured": "", "location": "boston-seaport"}]
    tables["map"] = [{"token": "map0", "log_tokens": ["log0"], "category": "semantic_prior",
                      "filename": "maps/prior.png"}]
    (root / "maps").mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(root / "maps" / "prior.png")
    rng = np.random.default_rng(0)
    for s_idx, name in enumerate(["scene-0061", "scene-0103"]):
        poses = EGO if s_idx == 0 else [(900.0, 700.0, -2.0), (901.0, 702.0, -2.0)]
        sample_tokens = [_token("sample", s_idx, i) for i in range(len(poses))]
        tables["scene"].append({"token": _token("scene", s_idx), "name": name, "description": "", "log_token": "log0",
                                "nbr_samples": len(poses), "first_sample_token": sample_tokens[0],
                                "last_sample_token": sample_tokens[-1]})
        for i, (x, y, yaw) in enumerate(poses):
            st = sample_tokens[i]
            ts = 1_000_000 * (10 * s_idx + i)
            tables["sample"].append({"token": st, "timestamp": ts, "scene_token": _token("scene", s_idx),
                                     "prev": sample_tokens[i - 1] if i else "",
                                     "next": sample_tokens[i + 1] if i + 1 < len(poses) else ""})
            for ch in channels:
                sd = _token("sd", s_idx, i, ch)
                tables["ego_pose"].append({"token": sd, "timestamp": ts, "translation": [x, y, 0.0],
                                           "rotation": list(Quaternion(axis=[0, 0, 1], angle=yaw).elements)})
                filename = f"samples/{ch}/{name}_{i}_{ch}." + ("pcd.bin" if ch == "LIDAR_TOP" else "jpg")
                tables["sample_data"].append({
                    "token": sd, "sample_token": st, "ego_pose_token": sd, "calibrated_sensor_token": _token("calib", ch),
                    "timestamp": ts, "fileformat": "jpg", "is_key_frame": True, "height": 90, "width": 160,
                    "filename": filename, "prev": "", "next": ""})
                (root / filename).parent.mkdir(parents=True, exist_ok=True)
                if ch != "LIDAR_TOP":
                    Image.fromarray(rng.integers(0, 255, (90, 160, 3), dtype=np.uint8)).save(root / filename)
            if s_idx == 0:
                for a_idx, (cat, centre, size, ayaw, vis, pts) in enumerate(ANNS):
                    inst = _token("inst", a_idx)
                    if i == 0:
                        tables["instance"].append({"token": inst, "category_token": _token("cat", cat),
                                                   "nbr_annotations": 2})
                    moved = np.asarray(centre) + np.array([1.0, -0.5, 0.0]) * i  # 1 s apart: (1, -0.5) m/s
                    tables["sample_annotation"].append({
                        "token": _token("ann", i, a_idx), "sample_token": st, "instance_token": inst,
                        "visibility_token": vis, "attribute_tokens": [], "translation": list(moved), "size": list(size),
                        "rotation": list(Quaternion(axis=[0, 0, 1], angle=ayaw).elements),
                        "prev": _token("ann", i - 1, a_idx) if i else "", "next": "" if i else _token("ann", 1, a_idx),
                        "num_lidar_pts": pts, "num_radar_pts": 0})
    table_dir = root / VERSION
    table_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in tables.items():
        (table_dir / f"{name}.json").write_text(json.dumps(rows))
    if with_maps:
        write_map(root)
    return root


def write_map(root):
    """boston-seaport expansion: a drivable square around the first ego pose with a hole, one lane divider."""
    nodes, polygon_rings = [], []

    def ring(points, tag):
        toks = []
        for k, (x, y) in enumerate(points):
            toks.append(f"n_{tag}_{k}")
            nodes.append({"token": toks[-1], "x": x, "y": y})
        return toks

    ext = ring([(560, 1560), (640, 1560), (640, 1640), (560, 1640)], "ext")
    hole = ring([(570, 1620), (580, 1620), (580, 1630), (570, 1630)], "hole")
    polygon_rings.append({"token": "poly0", "exterior_node_tokens": ext, "holes": [{"node_tokens": hole}]})
    line = ring([(560, 1597), (640, 1617)], "div")
    layers = {name: [] for name in ("road_segment", "road_block", "lane", "ped_crossing", "walkway", "stop_line",
                                    "carpark_area", "road_divider", "traffic_light", "lane_connector")}
    expansion = {"version": "1.3", "canvas_edge": [3000.0, 3000.0], "node": nodes, "polygon": polygon_rings,
                 "line": [{"token": "line0", "node_tokens": line}],
                 "drivable_area": [{"token": "da0", "polygon_tokens": ["poly0"]}],
                 "lane_divider": [{"token": "ld0", "line_token": "line0", "lane_divider_segments": []}],
                 "arcline_path_3": {}, "connectivity": {}, **layers}
    (root / "maps" / "expansion").mkdir(parents=True, exist_ok=True)
    (root / "maps" / "expansion" / "boston-seaport.json").write_text(json.dumps(expansion))


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    return build_tiny_set(tmp_path_factory.mktemp("tiny_nuscenes"))


def make_config(**data):
    cfg = Config()
    cfg.data.final_dim = (64, 128)
    cfg.data.resize_lim = (0.9, 1.1)
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def ego_box(ann_index, sample_index=0):
    """The annotation as a devkit Box in the sample's ego frame (the independent reference)."""
    cat, centre, size, yaw, _, _ = ANNS[ann_index]
    x, y, eyaw = EGO[sample_index]
    box = Box(np.asarray(centre) + np.array([1.0, -0.5, 0.0]) * sample_index, size,
              Quaternion(axis=[0, 0, 1], angle=yaw))
    box.translate(-np.array([x, y, 0.0]))
    box.rotate(Quaternion(axis=[0, 0, 1], angle=eyaw).inverse)
    return box


def cell(x, y, cfg):
    xb, yb = cfg.grid.xbound, cfg.grid.ybound
    return int(math.floor((x - xb[0]) / xb[2])), int(math.floor((y - yb[0]) / yb[2]))


def test_uint8_images_normalised_by_the_model_equal_the_loaders_float32_images(tiny_root):
    """data.image_dtype: the default uint8 item carries the augmented pixels; the camera encoder's
    normalisation of them equals the float32 item the loader normalises, value for value, for a
    training item (random augmentation, same seed) and a validation item."""
    from lss.models.camera import CameraEncoder

    cfg8, cfg32 = make_config(), make_config(image_dtype="float32")
    encoder = CameraEncoder(4, 8, backbone="resnet18", image_mean=cfg8.data.image_mean,
                            image_std=cfg8.data.image_std)
    for is_train in (True, False):
        torch.manual_seed(3)
        np.random.seed(3)
        item8 = NuScenesBEV(tiny_root, VERSION, "train", cfg8, is_train=is_train)[1]
        torch.manual_seed(3)
        np.random.seed(3)
        item32 = NuScenesBEV(tiny_root, VERSION, "train", cfg32, is_train=is_train)[1]
        assert item8["images"].dtype == torch.uint8 and item32["images"].dtype == torch.float32
        assert torch.equal(item8["post_rot"], item32["post_rot"])
        normalised = encoder.normalize(item8["images"])
        assert normalised.dtype == torch.float32 and torch.equal(normalised, item32["images"])
    # float images pass through; a uint8 tensor without 3 channels is refused with its shape
    assert encoder.normalize(item32["images"]) is item32["images"]
    with pytest.raises(ValueError, match=r"uint8 images must be \.\.\. x 3 x H x W RGB, got \(6, 2, 4, 4\)"):
        encoder.normalize(torch.zeros(6, 2, 4, 4, dtype=torch.uint8))


def test_item_layout_and_targets(tiny_root):
    cfg = make_config(visibility_mask=True)
    ds = NuScenesBEV(tiny_root, VERSION, "train", cfg, is_train=False)
    assert len(ds) == 2 and ds.layout.startswith("DATAROOT/v1.0-mini")
    item = ds[0]
    n, (h, w) = 6, cfg.data.final_dim
    assert item["images"].shape == (n, 3, h, w) and item["images"].dtype == torch.uint8
    for key, shape in [("intrinsics", (n, 3, 3)), ("sensor2ego_rot", (n, 3, 3)), ("sensor2ego_trans", (n, 3)),
                       ("post_rot", (n, 3, 3)), ("post_trans", (n, 3)), ("targets", (4, 200, 200))]:
        assert item[key].shape == shape and item[key].dtype == torch.float32, key
    assert item["visibility_mask"].shape == (200, 200) and item["visibility_mask"].dtype == torch.bool
    assert item["sample_token"] == _token("sample", 0, 0)
    t = item["targets"]
    vehicle, pedestrian, drivable, divider = cfg.data.classes.index("vehicle"), cfg.data.classes.index("pedestrian"), \
        cfg.data.classes.index("drivable_area"), cfg.data.classes.index("lane_divider")
    car, truck, ped = ego_box(0), ego_box(3), ego_box(1)
    assert t[vehicle][cell(*car.center[:2], cfg)] == 1 and t[vehicle][cell(*truck.center[:2], cfg)] == 1
    assert t[pedestrian][cell(*ped.center[:2], cfg)] == 1
    assert t[vehicle][cell(*ped.center[:2], cfg)] == 0 and t[pedestrian][cell(*car.center[:2], cfg)] == 0
    # Footprint area: the car covers about w * l / cell area cells (plus the outline cells).
    assert 1.9 * 4.5 / 0.25 <= t[vehicle].sum() - (t[vehicle] * 0).sum() and set(t.unique().tolist()) <= {0.0, 1.0}
    # Map: the ego cell is drivable; the hole and beyond the square are not.
    assert t[drivable][cell(0.0, 0.0, cfg)] == 1
    x, y, yaw = EGO[0]

    def to_ego(gx, gy):
        c, s = math.cos(yaw), math.sin(yaw)
        return c * (gx - x) + s * (gy - y), -s * (gx - x) + c * (gy - y)

    assert t[drivable][cell(*to_ego(575, 1625), cfg)] == 0
    assert t[drivable][cell(*to_ego(600, 1645), cfg)] == 0
    for f in np.linspace(0.05, 0.95, 9):
        gx, gy = 560 + 80 * f, 1597 + 20 * f
        ex, ey = to_ego(gx, gy)
        if abs(ex) < 49 and abs(ey) < 49:
            assert t[divider][cell(ex, ey, cfg)] == 1
    assert t[divider].sum() < 0.1 * t[drivable].sum()


def test_original_lss_layout_and_split_order(tiny_root, tmp_path):
    nested = tmp_path / "nested"
    shutil.copytree(tiny_root, nested / "mini")
    val = NuScenesBEV(nested, VERSION, "val", make_config(), verbose=False)
    assert val.layout.startswith("DATAROOT/mini/v1.0-mini") and not val.is_train
    assert list(val.sample_tokens) == [_token("sample", 1, 0), _token("sample", 1, 1)]
    assert val.devkit_split == "mini_val"
    assert locate_dataroot(nested, VERSION)[0] == nested / "mini"


def test_wrong_dataroot_or_version_lists_what_was_looked_for(tiny_root, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"v1.0-trainval not found.*tables found in: .*v1.0-mini"):
        NuScenesBEV(tiny_root, "v1.0-trainval", "train", make_config())
    with pytest.raises(FileNotFoundError, match="does not exist"):
        NuScenesBEV(tmp_path / "nowhere", VERSION, "train", make_config())
    with pytest.raises(ValueError, match="unknown split 'bogus'"):
        NuScenesBEV(tiny_root, VERSION, "bogus", make_config())
    with pytest.raises(ValueError, match="data.classes: unknown class 'cars'"):
        NuScenesBEV(tiny_root, VERSION, "train", make_config(classes=("cars",)))


def test_missing_image_names_file_sample_and_channel(tmp_path):
    root = build_tiny_set(tmp_path / "set")
    ds = NuScenesBEV(root, VERSION, "train", make_config(), verbose=False)
    victim = root / "samples" / "CAM_BACK" / "scene-0061_1_CAM_BACK.jpg"
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=rf"{victim}.*sample {_token('sample', 0, 1)}, channel CAM_BACK"):
        ds[1]
    victim.write_bytes(b"not a jpeg")
    with pytest.raises(DatasetError, match=r"could not be decoded \(sample .*channel CAM_BACK"):
        ds[1]


def test_missing_maps_name_location_and_object_classes_still_work(tmp_path):
    root = build_tiny_set(tmp_path / "nomaps", with_maps=False)
    with pytest.raises(FileNotFoundError, match=r"boston-seaport.*maps/expansion"):
        NuScenesBEV(root, VERSION, "train", make_config())
    ds = NuScenesBEV(root, VERSION, "train", make_config(classes=("vehicle", "pedestrian")), verbose=False)
    assert ds[0]["targets"].shape == (2, 200, 200) and ds[0]["targets"][0].sum() > 0


def test_filters_drop_boxes_by_visibility_and_lidar_points(tiny_root):
    ds = NuScenesBEV(tiny_root, VERSION, "train", make_config(classes=("vehicle", "pedestrian"), min_visibility=2,
                                                              min_lidar_pts=10), is_train=False, verbose=False)
    t = ds[0]["targets"]
    assert t[1].sum() == 0  # the pedestrian has visibility 1 and 3 points
    assert t[0][cell(*ego_box(0).center[:2], ds.config)] == 1 and t[0][cell(*ego_box(3).center[:2], ds.config)] == 1


def test_detection_targets_match_devkit_boxes(tiny_root):
    from nuscenes.nuscenes import NuScenes

    ds = NuScenesBEV(tiny_root, VERSION, "train", make_config(detection_targets=True), is_train=False, verbose=False)
    item = ds[0]
    boxes, labels = item["det_boxes"], item["det_labels"]
    assert boxes.shape == (4, 9) and labels.dtype == torch.int64
    nusc = NuScenes(VERSION, str(tiny_root), verbose=False)
    expected = {"car": 0, "pedestrian": 1, "barrier": 2, "truck": 3}
    assert sorted(DETECTION_CLASSES[k] for k in labels.tolist()) == sorted(expected)
    ego_q = Quaternion(axis=[0, 0, 1], angle=EGO[0][2])
    for row, label in zip(boxes.numpy(), labels.tolist()):
        a = expected[DETECTION_CLASSES[label]]
        box = ego_box(a)
        assert np.allclose(row[:3], box.center, atol=1e-4)
        assert np.allclose(row[3:6], box.wlh)
        assert math.isclose(math.remainder(row[6] - box.orientation.yaw_pitch_roll[0], 2 * math.pi), 0, abs_tol=1e-5)
        v = ego_q.inverse.rotate(nusc.box_velocity(_token("ann", 0, a)))
        assert np.allclose(row[7:], v[:2], atol=1e-5)


def test_an_unknown_velocity_stays_out_of_the_loss(tiny_root, tmp_path, monkeypatch):
    # the devkit gives NaN for an instance it sees once: the boxes keep NaN (not 0 m/s) and the targets
    # mask that velocity out of the regression loss
    from nuscenes.nuscenes import NuScenes

    from lss.geometry.boxes import encode_targets

    root = tmp_path / "root"  # a copy: its own index cache entry
    shutil.copytree(tiny_root, root)
    unknown = _token("ann", 0, 1)  # the pedestrian of sample 0
    velocity = NuScenes.box_velocity
    monkeypatch.setattr(NuScenes, "box_velocity", lambda self, token, *a, **k: (
        np.full(3, np.nan) if token == unknown else velocity(self, token, *a, **k)))
    ds = NuScenesBEV(root, VERSION, "train", make_config(detection_targets=True), is_train=False, verbose=False)
    boxes, labels = ds[0]["det_boxes"], ds[0]["det_labels"]
    is_ped = labels == DETECTION_CLASSES.index("pedestrian")
    assert is_ped.sum() == 1 and torch.isnan(boxes[is_ped, 7:]).all()
    assert torch.isfinite(boxes[~is_ped]).all() and torch.isfinite(boxes[:, :7]).all()
    targets = encode_targets([boxes], [labels], ds.grid, len(DETECTION_CLASSES))
    ped_rows = targets["labels"] == DETECTION_CLASSES.index("pedestrian")
    assert ped_rows.any() and (~ped_rows).any()
    assert (targets["regression_mask"][ped_rows, 8:10] == 0).all()
    assert (targets["regression_mask"][~ped_rows] == 1).all()
    assert torch.isfinite(targets["regression"]).all()


def test_camera_dropout_and_augmentation(tiny_root):
    torch.manual_seed(0)
    ds = NuScenesBEV(tiny_root, VERSION, "train", make_config(num_train_cameras=5), verbose=False)
    assert ds.is_train
    a, b = ds[0], ds[0]
    assert a["images"].shape[0] == 5 and a["intrinsics"].shape == (5, 3, 3)
    assert not torch.equal(a["post_rot"], b["post_rot"]) or not torch.equal(a["post_trans"], b["post_trans"])
    full = NuScenesBEV(tiny_root, VERSION, "train", make_config(num_train_cameras=5), is_train=False, verbose=False)
    assert full[0]["images"].shape[0] == 6
    assert torch.equal(full[0]["images"], full[0]["images"])
    with pytest.raises(ValueError, match="num_train_cameras"):
        validate(make_config(num_train_cameras=7))  # checked when the config loads
    sub = NuScenesBEV(tiny_root, VERSION, "train", make_config(cameras=("CAM_FRONT", "CAM_BACK")), verbose=False)
    assert sub[1]["images"].shape[0] == 2


def test_collate_and_dataloader(tiny_root):
    cfg = make_config(detection_targets=True, workers=0, dataroot=str(tiny_root))
    cfg.train.batch_size = 2
    dataset = build_dataset(cfg, "train", is_train=True)
    sampler = EpochSampler(len(dataset), shuffle=True, seed=cfg.train.seed)
    loader = build_loader(cfg, dataset, sampler, cfg.train.batch_size, True, torch.device("cpu"), cfg.train.seed)
    batch = next(iter(loader))
    assert batch["images"].shape == (2, 6, 3, 64, 128) and batch["targets"].shape == (2, 4, 200, 200)
    assert isinstance(batch["sample_token"], list) and len(batch["sample_token"]) == 2
    assert isinstance(batch["det_boxes"], list) and batch["det_boxes"][0].shape[1] == 9
    with pytest.raises(ValueError, match="fields"):
        collate([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}])
    mixed = collate([{"x": torch.zeros(2, 3)}, {"x": torch.zeros(4, 3)}])
    assert isinstance(mixed["x"], list)


# --- the synthetic set (tests/conftest.py: 2 scenes x 3 key frames, 400 x 225 images, maps) ---------------------

def synthetic_config(**data):
    return make_config(final_dim=(128, 352), resize_lim=(0.95, 1.15), **data)


def devkit_ego_boxes(nusc, sample_token):
    """All annotation boxes of a sample in its LIDAR_TOP ego frame, through the devkit's own transforms."""
    sample = nusc.get("sample", sample_token)
    pose = nusc.get("ego_pose", nusc.get("sample_data", sample["data"]["LIDAR_TOP"])["ego_pose_token"])
    boxes = []
    for token in sample["anns"]:
        box = nusc.get_box(token)
        box.translate(-np.asarray(pose["translation"]))
        box.rotate(Quaternion(pose["rotation"]).inverse)
        boxes.append(box)
    return boxes, pose


@pytest.mark.slow
@pytest.mark.parametrize("split", ["train", "val"])
def test_synthetic_object_centres_are_marked(synthetic_root, split):
    from nuscenes.nuscenes import NuScenes

    ds = NuScenesBEV(synthetic_root, VERSION, split, synthetic_config(), is_train=False, verbose=False)
    nusc = NuScenes(VERSION, str(synthetic_root), verbose=False)
    checked = 0
    for index in range(len(ds)):
        targets = ds.bev_targets(index)
        boxes, _ = devkit_ego_boxes(nusc, ds.sample_tokens[index])
        for box in boxes:
            k = 0 if box.name.startswith("vehicle.") else 1 if box.name.startswith("human.pedestrian.") else None
            x, y = box.center[:2]
            if k is None or not (-50 <= x < 50 and -50 <= y < 50):
                continue
            assert targets[k][cell(x, y, ds.config)] == 1, (box.name, x, y)
            checked += 1
    assert checked > 10


@pytest.mark.slow
def test_synthetic_map_raster_matches_devkit_geometry(synthetic_root):
    import shapely
    from nuscenes.map_expansion.map_api import NuScenesMap
    from nuscenes.nuscenes import NuScenes
    from shapely import affinity
    from shapely.ops import unary_union

    cfg = synthetic_config()
    ds = NuScenesBEV(synthetic_root, VERSION, "train", cfg, is_train=False, verbose=False)
    nusc = NuScenes(VERSION, str(synthetic_root), verbose=False)
    location = ds.locations[ds.location_index[0]]
    nmap = NuScenesMap(str(synthetic_root), location)
    drivable = unary_union([nmap.extract_polygon(t) for r in nmap.drivable_area for t in r["polygon_tokens"]])
    dividers = unary_union([nmap.extract_line(r["line_token"]) for r in nmap.lane_divider])
    xs, ys = np.meshgrid(*[(np.arange(200) + 0.5) * 0.5 - 50] * 2, indexing="ij")
    for index in range(len(ds)):
        targets = ds.bev_targets(index)
        _, pose = devkit_ego_boxes(nusc, ds.sample_tokens[index])
        yaw = Quaternion(pose["rotation"]).yaw_pitch_roll[0]
        to_ego = dict(xoff=-pose["translation"][0], yoff=-pose["translation"][1])

        def ego(geom):
            return affinity.rotate(affinity.translate(geom, **to_ego), -yaw, origin=(0, 0), use_radians=True)

        area, lines = ego(drivable), ego(dividers)
        pts = shapely.points(xs, ys)
        inside = shapely.contains_xy(area, xs, ys)
        far = shapely.distance(area.boundary, pts) >= 0.5
        raster = targets[cfg.data.classes.index("drivable_area")] > 0
        assert inside.any() and not ((raster != inside) & far).any()
        divider = targets[cfg.data.classes.index("lane_divider")] > 0
        dist_cells = shapely.distance(lines, pts) / 0.5
        assert divider.any() and dist_cells[divider].max() <= cfg.data.divider_width / 2 + 0.75
        assert divider[dist_cells <= cfg.data.divider_width / 2 - 0.3].all()


def _bilinear(image, u, v):
    h, w = image.shape[:2]
    u0, v0 = np.clip(np.floor(u).astype(int), 0, w - 2), np.clip(np.floor(v).astype(int), 0, h - 2)
    fu, fv = (u - u0)[:, None], (v - v0)[:, None]
    return ((1 - fu) * (1 - fv) * image[v0, u0] + fu * (1 - fv) * image[v0, u0 + 1]
            + (1 - fu) * fv * image[v0 + 1, u0] + fu * fv * image[v0 + 1, u0 + 1])


@pytest.mark.slow
def test_synthetic_box_corners_project_onto_the_same_content(synthetic_root):
    """Box corners and centres projected with intrinsics, sensor2ego and post_* sample the augmented image
    where the same points, projected without augmentation, sample the source image."""
    import cv2
    from nuscenes.nuscenes import NuScenes
    from nuscenes.utils.geometry_utils import view_points

    cfg = synthetic_config()
    torch.manual_seed(0)
    ds = NuScenesBEV(synthetic_root, VERSION, "train", cfg, is_train=True, verbose=False)
    nusc = NuScenes(VERSION, str(synthetic_root), verbose=False)
    right, shifted = [], []
    for index in range(len(ds)):
        boxes, _ = devkit_ego_boxes(nusc, ds.sample_tokens[index])
        points = np.concatenate([np.concatenate([b.corners(), b.center[:, None]], 1) for b in boxes], 1)
        for _ in range(2):
            item = ds[index]
            for k in range(len(ds.cameras)):
                aug = item["images"][k].permute(1, 2, 0).numpy().astype(np.float64)
                source = np.asarray(Image.open(ds.image_paths[index, k]).convert("RGB"), dtype=np.float64)
                scale = abs(np.linalg.det(item["post_rot"][k, :2, :2].numpy())) ** 0.5
                source = cv2.GaussianBlur(source, (0, 0), max(0.5 / scale, 0.3))
                rot, trans = item["sensor2ego_rot"][k].double().numpy(), item["sensor2ego_trans"][k].double().numpy()
                cam = rot.T @ (points - trans[:, None])
                ok = cam[2] > 2.0
                src = view_points(cam[:, ok], item["intrinsics"][k].double().numpy(), normalize=True)[:2]
                uvd = np.concatenate([src, cam[2:, ok]])
                dst = item["post_rot"][k].double().numpy() @ uvd + item["post_trans"][k].double().numpy()[:, None]
                h, w = source.shape[:2]
                keep = ((src[0] > 2) & (src[0] < w - 3) & (src[1] > 2) & (src[1] < h - 3) & (dst[0] > 5)
                        & (dst[0] < 352 - 6) & (dst[1] > 2) & (dst[1] < 128 - 3))
                ref = _bilinear(source, src[0, keep], src[1, keep])
                right.append(np.abs(_bilinear(aug, dst[0, keep], dst[1, keep]) - ref).mean(1))
                shifted.append(np.abs(_bilinear(aug, dst[0, keep] + 3, dst[1, keep]) - ref).mean(1))
    right, shifted = np.concatenate(right), np.concatenate(shifted)
    assert len(right) > 200
    assert np.median(right) < 6.0 and np.median(shifted) > 2 * np.median(right), (np.median(right), np.median(shifted))


def test_loader_generates_the_synthetic_set_when_asked(tmp_path, monkeypatch, capsys):
    import lss.data.synthetic as synthetic

    calls = []

    def fake_generate(out_dir, version, **kwargs):
        calls.append((out_dir, version, kwargs))
        return build_tiny_set(tmp_path / "gen")

    monkeypatch.setattr(synthetic, "generate", fake_generate)
    cfg = make_config(dataroot=str(tmp_path / "gen"), workers=0)
    with pytest.raises(FileNotFoundError, match="not found"):
        ensure_dataset(cfg)
    assert not calls
    cfg.data.make_synthetic_if_missing = True
    ensure_dataset(cfg)
    loader = build_eval_loader(cfg, build_dataset(cfg, "train", is_train=False), torch.device("cpu"))
    assert len(calls) == 1 and calls[0][1] == VERSION and calls[0][2]["image_size"] == (1600, 900)
    assert "generating a synthetic set" in capsys.readouterr().out
    assert len(loader.dataset) == 2


def test_ensure_dataset_never_generates_into_a_foreign_directory(tmp_path, monkeypatch):
    import lss.data.synthetic as synthetic

    monkeypatch.setattr(synthetic, "generate", lambda *a, **k: pytest.fail("generate called"))
    root = tmp_path / "mine"
    root.mkdir()
    (root / "notes.txt").write_text("keep")
    cfg = make_config(dataroot=str(root), workers=0)
    cfg.data.make_synthetic_if_missing = True
    with pytest.raises(DatasetError, match="holds other files.*set data.dataroot") as info:
        ensure_dataset(cfg)
    assert "--force" not in str(info.value)
    assert (root / "notes.txt").read_text() == "keep"
