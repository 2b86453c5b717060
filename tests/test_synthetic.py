"""The synthetic dataset against the real nuscenes-devkit: tables, images, lidar and maps load and
agree."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import cv2
import matplotlib
import numpy as np
import pytest
import shapely
from conftest import SYNTHETIC_SET

matplotlib.use("Agg")

from nuscenes.map_expansion.map_api import NuScenesMap  # noqa: E402
from nuscenes.nuscenes import NuScenes  # noqa: E402
from nuscenes.utils.data_classes import LidarPointCloud  # noqa: E402
from nuscenes.utils.geometry_utils import BoxVisibility, points_in_box, view_points  # noqa: E402
from nuscenes.utils.splits import create_splits_scenes  # noqa: E402

from lss.data.synthetic import generate, scene_names  # noqa: E402
from lss.data.synthetic.rig import CAMERAS, load_rig  # noqa: E402
from lss.data.synthetic.roads import build_location  # noqa: E402
from lss.data.synthetic.world import build_scene  # noqa: E402

TABLES = (
    "category",
    "attribute",
    "visibility",
    "instance",
    "sensor",
    "calibrated_sensor",
    "ego_pose",
    "log",
    "scene",
    "sample",
    "sample_data",
    "sample_annotation",
    "map",
)


@pytest.fixture(scope="module")
def nusc(synthetic_root):
    return NuScenes("v1.0-mini", str(synthetic_root), verbose=False)


def test_devkit_loads_tables_and_splits(nusc):
    splits = create_splits_scenes()
    names = sorted(s["name"] for s in nusc.scene)
    assert len(names) == 2
    assert sum(n in splits["mini_train"] for n in names) == 1
    assert sum(n in splits["mini_val"] for n in names) == 1
    assert {c["name"] for c in nusc.category} >= {
        "vehicle.car",
        "vehicle.truck",
        "vehicle.bus.rigid",
        "human.pedestrian.adult",
        "movable_object.barrier",
        "movable_object.trafficcone",
    }
    assert sorted(v["token"] for v in nusc.visibility) == ["1", "2", "3", "4"]
    for scene in nusc.scene:
        tokens, token = [], scene["first_sample_token"]
        while token:
            sample = nusc.get("sample", token)
            assert sorted(sample["data"]) == sorted(CAMERAS + ("LIDAR_TOP",))
            tokens.append(token)
            token = sample["next"]
        assert len(tokens) == scene["nbr_samples"] == 3
        assert tokens[-1] == scene["last_sample_token"]
        stamps = [nusc.get("sample", t)["timestamp"] for t in tokens]
        assert np.allclose(np.diff(stamps), 500_000)  # 2 Hz key frames
    for inst in nusc.instance:
        chain, token = [], inst["first_annotation_token"]
        while token:
            ann = nusc.get("sample_annotation", token)
            assert ann["instance_token"] == inst["token"]
            chain.append(token)
            token = ann["next"]
        assert len(chain) == inst["nbr_annotations"] and chain[-1] == inst["last_annotation_token"]


def test_sample_data_files_and_boxes(nusc, synthetic_root):
    counts = []
    for sample in nusc.sample:
        for ch in CAMERAS:
            sd = nusc.get("sample_data", sample["data"][ch])
            img = cv2.imread(str(Path(synthetic_root) / sd["filename"]))
            assert img is not None and img.shape == (225, 400, 3) == (sd["height"], sd["width"], 3)
            assert Path(sd["filename"]).name.split("__")[1] == ch
        _, boxes, k = nusc.get_sample_data(sample["data"]["CAM_FRONT"])
        counts.append(len(boxes))
    assert max(counts) > 0


def test_intrinsics_scale_with_image_size(nusc):
    rig = json.loads(
        (Path(__file__).resolve().parent.parent / "lss/data/nuscenes_rig.json").read_text()
    )
    sd = nusc.get("sample_data", nusc.sample[0]["data"]["CAM_FRONT"])
    cs = nusc.get("calibrated_sensor", sd["calibrated_sensor_token"])
    expected = np.array(rig["CAM_FRONT"]["camera_intrinsic"]) * np.array([[0.25], [0.25], [1.0]])
    assert np.allclose(cs["camera_intrinsic"], expected)
    assert np.allclose(cs["rotation"], rig["CAM_FRONT"]["rotation"])


def test_render_functions_headless(nusc, tmp_path):
    sample = nusc.sample[1]
    nusc.render_sample_data(
        sample["data"]["CAM_FRONT"], out_path=str(tmp_path / "cam.png"), verbose=False
    )
    nusc.render_sample_data(
        sample["data"]["LIDAR_TOP"], out_path=str(tmp_path / "lidar.png"), verbose=False
    )
    assert (tmp_path / "cam.png").stat().st_size > 0 and (tmp_path / "lidar.png").stat().st_size > 0


def test_lidar_points_and_counts(nusc, synthetic_root):
    sample = nusc.sample[0]
    path = Path(synthetic_root) / nusc.get("sample_data", sample["data"]["LIDAR_TOP"])["filename"]
    raw = np.fromfile(path, dtype=np.float32).reshape(-1, 5)
    assert len(raw) > 10000
    assert set(np.unique(raw[:, 4]).astype(int)) <= set(range(32))
    pc = LidarPointCloud.from_file(str(path))
    _, boxes, _ = nusc.get_sample_data(sample["data"]["LIDAR_TOP"])
    checked = 0
    for box in boxes:
        n = nusc.get("sample_annotation", box.token)["num_lidar_pts"]
        if n < 20:
            continue
        # Hits lie on the box surface (with 2 cm range noise): a slightly larger box holds them all.
        inside = int(points_in_box(box, pc.points[:3], wlh_factor=1.15).sum())
        assert 0.8 * n <= inside <= 2 * n + 100, (box.name, n, inside)
        checked += 1
    assert checked > 0


def test_map_expansion_and_semantic_prior(nusc, synthetic_root):
    for scene in nusc.scene:
        log = nusc.get("log", scene["log_token"])
        nmap = NuScenesMap(str(synthetic_root), log["location"])
        sample = nusc.get("sample", scene["first_sample_token"])
        pose = nusc.get(
            "ego_pose", nusc.get("sample_data", sample["data"]["LIDAR_TOP"])["ego_pose_token"]
        )
        x, y = pose["translation"][:2]
        masks = nmap.get_map_mask(
            (x, y, 100, 100),
            0.0,
            ["drivable_area", "lane_divider", "road_divider", "ped_crossing", "walkway"],
            (200, 200),
        )
        assert (
            masks[0].mean() > 0.1
            and masks[1].sum() > 0
            and masks[2].sum() > 0
            and masks[4].sum() > 0
        )
        assert nmap.record_on_point(x, y, "drivable_area") != ""
        assert nmap.record_on_point(x, y, "lane") != ""
        # The semantic prior of the map table covers the ego pose.
        prior = nusc.get("map", log["map_token"])["mask"]
        assert prior.is_on_mask(x, y)[0]
        # Moving vehicles drive on the drivable area.
        for token in sample["anns"]:
            ann = nusc.get("sample_annotation", token)
            attrs = {nusc.get("attribute", a)["name"] for a in ann["attribute_tokens"]}
            if "vehicle.moving" in attrs:
                assert nmap.record_on_point(*ann["translation"][:2], "drivable_area") != ""


def _colour_match(pixels: np.ndarray, colour: np.ndarray) -> np.ndarray:
    """Pixels (M x 3 RGB) that are the base colour under some sun shading (0.45..1.1) and JPEG
    noise."""
    c = colour.astype(np.float64)
    f = np.clip(pixels @ c / max(c @ c, 1.0), 0.45, 1.1)
    return np.linalg.norm(pixels - f[:, None] * c, axis=1) < 25.0


def _instance_colours(nusc, seed=0):
    """Rebuild the world of each scene (it depends only on the seed and the scene name) and map
    annotation tokens to their agent's colour (RGB)."""
    colours = {}
    for scene in nusc.scene:
        location = nusc.get("log", scene["log_token"])["location"]
        world = build_scene(
            0, scene["name"], build_location(location, seed), scene["nbr_samples"], seed
        )
        token, k = scene["first_sample_token"], 0
        while token:
            sample = nusc.get("sample", token)
            for ann_token in sample["anns"]:
                x, y = nusc.get("sample_annotation", ann_token)["translation"][:2]
                for agent in world.agents:
                    if abs(agent.x[k] - x) < 1e-6 and abs(agent.y[k] - y) < 1e-6:
                        colours[ann_token] = np.array(agent.color, np.float64)
                        break
            token, k = sample["next"], k + 1
    return colours


def test_projected_boxes_land_on_their_object(nusc, synthetic_root):
    colours = _instance_colours(nusc)
    assert len(colours) == len(nusc.sample_annotation)
    by_visibility = {"1": [], "4": []}
    for sample in nusc.sample:
        for ch in CAMERAS:
            path, boxes, k = nusc.get_sample_data(
                sample["data"][ch], box_vis_level=BoxVisibility.ALL
            )
            img = cv2.imread(path)[..., ::-1].astype(np.float64)
            for box in boxes:
                ann = nusc.get("sample_annotation", box.token)
                if ann["visibility_token"] not in by_visibility:
                    continue
                if not (
                    box.name.startswith("vehicle.car")
                    or box.name.startswith("vehicle.bus")
                    or box.name.startswith("vehicle.truck")
                ):
                    continue
                corners = view_points(box.corners(), k, normalize=True)[:2].T
                mask = np.zeros(img.shape[:2], np.uint8)
                cv2.fillConvexPoly(
                    mask,
                    np.round(cv2.convexHull(corners.astype(np.float32)))
                    .astype(np.int32)
                    .reshape(-1, 2),
                    1,
                )
                if mask.sum() < 30:
                    continue
                match = _colour_match(img[mask > 0], colours[box.token]).mean()
                by_visibility[ann["visibility_token"]].append(match)
    vis4, vis1 = np.array(by_visibility["4"]), np.array(by_visibility["1"])
    assert len(vis4) >= 3
    # Fully visible vehicles: most of the box's projection shows its body colour (windows and wheels
    # aside).
    assert np.median(vis4) > 0.45, vis4
    if len(vis1):
        assert np.median(vis1) < np.median(vis4) - 0.2, (vis1, vis4)


@pytest.mark.slow
def test_same_seed_same_tables(tmp_path):
    kwargs = dict(version="v1.0-mini", scenes=2, samples_per_scene=1, image_size=(64, 36), seed=3)
    a = generate(tmp_path / "a", workers=1, **kwargs)
    b = generate(tmp_path / "b", workers=2, **kwargs)
    c = generate(tmp_path / "c", workers=1, **{**kwargs, "seed": 4})
    for name in TABLES:
        assert (a / "v1.0-mini" / f"{name}.json").read_bytes() == (
            b / "v1.0-mini" / f"{name}.json"
        ).read_bytes()
    assert (a / "v1.0-mini/sample_annotation.json").read_bytes() != (
        c / "v1.0-mini/sample_annotation.json"
    ).read_bytes()
    lidar = sorted((a / "samples/LIDAR_TOP").iterdir())
    assert lidar[0].read_bytes() == (b / "samples/LIDAR_TOP" / lidar[0].name).read_bytes()


def test_scene_names_follow_official_splits():
    splits = create_splits_scenes()
    for version, train, val in (
        ("v1.0-mini", "mini_train", "mini_val"),
        ("v1.0-trainval", "train", "val"),
    ):
        for n in (1, 2, 5, 10):
            names = scene_names(version, n)
            assert len(set(names)) == n
            assert all(x in splits[train] or x in splits[val] for x in names)
            if n >= 2:
                assert any(x in splits[train] for x in names) and any(
                    x in splits[val] for x in names
                )
    assert len(scene_names("v1.0-trainval", 850)) == 850


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown version 'v2.0'.*v1.0-mini"):
        generate(tmp_path / "x", version="v2.0")
    with pytest.raises(ValueError, match="11 scenes.*only 10"):
        generate(tmp_path / "x", scenes=11)
    with pytest.raises(ValueError, match="image_size"):
        generate(tmp_path / "x", image_size=(0, 10))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty.*--force"):
        generate(busy, scenes=2, samples_per_scene=1, image_size=(64, 36))
    assert (busy / "keep.txt").read_text() == "mine"
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(PermissionError, match="cannot write"):
        generate(blocker / "sub", scenes=2)


def test_cli_refuses_non_empty_dir(tmp_path, capsys):
    from lss.cli import main

    (tmp_path / "x.txt").write_text("")
    rc = main(
        [
            "make-synthetic",
            str(tmp_path),
            "--scenes",
            "2",
            "--samples-per-scene",
            "1",
            "--image-size",
            "64x36",
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert "is not empty" in err and "--force" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.txt"]


def test_load_rig_sizes():
    rig = load_rig((800, 450))
    k = rig["CAM_BACK"].intrinsic
    full = load_rig()["CAM_BACK"].intrinsic
    assert np.allclose(k[:2], full[:2] / 2) and rig["CAM_BACK"].size == (800, 450)
    assert rig["LIDAR_TOP"].intrinsic is None


def test_one_scene_is_refused_with_the_minimum(tmp_path, capsys):
    from lss.cli import main

    rc = main(
        [
            "make-synthetic",
            str(tmp_path / "one"),
            "--scenes",
            "1",
            "--samples-per-scene",
            "1",
            "--image-size",
            "64x36",
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err.splitlines()[0]
    assert "at least 2" in err and "--scenes 2" in err
    assert not (tmp_path / "one").exists() or not any((tmp_path / "one").iterdir())


def test_force_replaces_only_its_own_files(tmp_path):
    kwargs = dict(scenes=2, samples_per_scene=1, image_size=(64, 36), workers=1)
    out = generate(tmp_path / "set", **kwargs)
    notes = out / "notes.txt"  # beside the dataset: never touched
    notes.write_text("mine")
    first = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    generate(out, force=True, **kwargs)
    assert sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file()) == first
    assert notes.read_text() == "mine"
    foreign = out / "samples" / "CAM_FRONT" / "my_photo.jpg"
    foreign.write_bytes(b"precious")
    with pytest.raises(FileExistsError, match=rf"{foreign}.*not written by `lss make-synthetic`"):
        generate(out, force=True, **kwargs)
    assert (
        foreign.read_bytes() == b"precious"
        and sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file() and p != foreign)
        == first
    )


# sha256 by part of the conftest set (SYNTHETIC_SET): what seed 0 gives on every CPU. The losses of
# test_recorded_run were computed on this set.
SYNTHETIC_SET_SHA256 = {
    "tables": "03917c2dd0cec936063d414ce7099ca6dd8c40d4e023b371d73a2b1806b2847e",
    "camera images": "557c458e6f782fb04b9eb9ecb577031e936bb44b17fe39f87889416367ec3f47",
    "lidar": "e292795cd800f8950a79ec4f59d8b7b3f60ce652cce20254b745b09600454204",
    "map masks": "b6f8477e5a9cdfafa37b3cb471e8a27cedfc7fa032cfb778c4ecb49be6e0045c",
}
# versions of the libraries that draw and encode the set, as recorded
RECORDED_WITH = {"numpy": "1.26", "cv2": "4.11", "shapely": "2.0"}
INSTALLED = {"numpy": np.__version__, "cv2": cv2.__version__, "shapely": shapely.__version__}
# switches that make numpy, OpenBLAS and OpenCV (IPP) take other CPU code paths in one process
OTHER_CPU_PATHS = {
    "OPENBLAS_CORETYPE": "Haswell",
    "NPY_DISABLE_CPU_FEATURES": "AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL",
    "OPENCV_IPP": "SSE42",
}
recorded_libraries = pytest.mark.skipif(
    any(not INSTALLED[k].startswith(v + ".") for k, v in RECORDED_WITH.items()),
    reason=f"digests recorded with {RECORDED_WITH}, installed {INSTALLED}",
)


def set_digests(root: Path) -> dict:
    """sha256 by part of a generated set: the bytes of tables and lidar sweeps, the decoded pixels
    of camera images and map masks (PNG compression may vary, pixels must not)."""
    parts = {"tables": [], "camera images": [], "lidar": [], "map masks": []}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if path.suffix in (".jpg", ".png"):
            content = cv2.imread(str(path), cv2.IMREAD_UNCHANGED).tobytes()
            part = "camera images" if path.suffix == ".jpg" else "map masks"
        else:
            content = path.read_bytes()
            part = "lidar" if path.suffix == ".bin" else "tables"
        parts[part].append(rel.encode() + b"\0" + hashlib.sha256(content).digest())
    return {k: hashlib.sha256(b"".join(v)).hexdigest() for k, v in parts.items()}


@recorded_libraries
def test_seed_gives_the_recorded_set(synthetic_root):
    assert set_digests(synthetic_root) == SYNTHETIC_SET_SHA256, (
        "the synthetic set of seed 0 changed: if the generator was changed on purpose, record the "
        "new digests here and the first-step losses of test_recorded_run (computed by the trainer "
        "as it was before the change)"
    )


@pytest.mark.slow
def test_set_does_not_depend_on_the_cpu_code_paths(synthetic_root, tmp_path):
    """The set generated with numpy, OpenBLAS and IPP on other CPU code paths (as another CPU picks
    them) is the same."""
    code = (
        "import sys; from lss.data.synthetic import generate; "
        f"generate(sys.argv[1], **{SYNTHETIC_SET!r})"
    )
    env = {**os.environ, **OTHER_CPU_PATHS}
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "set")], env=env, check=True)
    assert set_digests(tmp_path / "set") == set_digests(synthetic_root)
