"""Lidar depth targets (data.depth_targets) on the synthetic set: layout, an independent projection of every lidar
point through the devkit tables (with camera and lidar ego poses made to differ), flip consistency with the image,
and clear errors for missing or corrupt point clouds."""
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from pyquaternion import Quaternion

from lss.config import Config
from lss.data import NuScenesBEV, collate
from lss.data.nuscenes import load_tables
from lss.data.transforms import ImageAugmentation

VERSION = "v1.0-mini"
FINAL_DIM = (96, 256)
DBOUND = (4.0, 36.0, 1.0)


def depth_config(**data):
    """Synthetic images are 400 x 225: resize to about 0.7 for a 96 x 256 input (6 x 16 feature cells)."""
    cfg = Config()
    cfg.data.final_dim = FINAL_DIM
    cfg.data.resize_lim = (0.65, 0.8)
    cfg.data.bot_pct_lim = (0.0, 0.1)
    cfg.data.rot_lim = (-5.0, 5.0)
    cfg.data.classes = ("vehicle",)
    cfg.data.depth_targets = True
    cfg.grid.dbound = DBOUND
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


@pytest.fixture(scope="module")
def shifted_root(synthetic_root, tmp_path_factory):
    """A copy of the synthetic set whose camera ego poses are moved (0.7, -0.4, 0.05) m and turned 2 degrees away
    from the lidar's, so that the lidar -> ego -> global -> ego -> camera chain matters."""
    root = tmp_path_factory.mktemp("shifted") / "nuscenes"
    shutil.copytree(synthetic_root, root)
    tables = root / VERSION
    sample_data = json.loads((tables / "sample_data.json").read_text())
    camera_poses = {sd["ego_pose_token"] for sd in sample_data if sd["fileformat"] == "jpg"}
    poses = json.loads((tables / "ego_pose.json").read_text())
    turn = Quaternion(axis=[0, 0, 1], angle=math.radians(2.0))
    for pose in poses:
        if pose["token"] in camera_poses:
            pose["translation"] = list(np.asarray(pose["translation"]) + [0.7, -0.4, 0.05])
            pose["rotation"] = list((turn * Quaternion(pose["rotation"])).elements)
    (tables / "ego_pose.json").write_text(json.dumps(poses))
    return root


def reference_targets(root, dataset, index, cams, post_rot, post_trans):
    """Per camera feature cell, the depth bin of the nearest lidar point: each point projected on its own with
    explicit rotation matrices, the source size from the sample_data table, and a per-cell minimum in a dict."""
    nusc = load_tables(root, VERSION)
    sample = nusc.get("sample", dataset.sample_tokens[index])
    lidar = nusc.get("sample_data", sample["data"]["LIDAR_TOP"])
    points = np.fromfile(root / lidar["filename"], dtype=np.float32).reshape(-1, 5)[:, :3].astype(np.float64)

    def rt(record):
        return Quaternion(record["rotation"]).rotation_matrix, np.asarray(record["translation"], dtype=np.float64)

    r, t = rt(nusc.get("calibrated_sensor", lidar["calibrated_sensor_token"]))
    ego = points @ r.T + t
    r, t = rt(nusc.get("ego_pose", lidar["ego_pose_token"]))
    world = ego @ r.T + t
    height, width = FINAL_DIM
    fh, fw = height // 16, width // 16
    lo, hi, step = DBOUND
    out = np.full((len(cams), fh, fw), -1, dtype=np.int64)
    for n, k in enumerate(cams):
        cam_sd = nusc.get("sample_data", sample["data"][dataset.cameras[k]])
        r, t = rt(nusc.get("ego_pose", cam_sd["ego_pose_token"]))
        cam_ego = (world - t) @ r
        calib = nusc.get("calibrated_sensor", cam_sd["calibrated_sensor_token"])
        r, t = rt(calib)
        cam = (cam_ego - t) @ r
        cam = cam[cam[:, 2] > 0]
        uv = (cam / cam[:, 2:]) @ np.asarray(calib["camera_intrinsic"]).T
        seen = (uv[:, 0] >= -0.5) & (uv[:, 0] < cam_sd["width"] - 0.5) & (uv[:, 1] >= -0.5) & \
            (uv[:, 1] < cam_sd["height"] - 0.5)
        nearest = {}
        for (u, v, _), z in zip(uv[seen], cam[seen, 2]):
            ua, va, _ = post_rot[n] @ np.array([u, v, z]) + post_trans[n]
            row, col = math.floor((va + 0.5) / 16), math.floor((ua + 0.5) / 16)
            if 0 <= row < fh and 0 <= col < fw:
                nearest[row, col] = min(nearest.get((row, col), math.inf), z)
        for (row, col), z in nearest.items():
            if lo <= z < hi:
                out[n, row, col] = math.floor((z - lo) / step)
    return out


def test_item_depth_targets_layout_and_collate(synthetic_root):
    dataset = NuScenesBEV(synthetic_root, VERSION, "train", depth_config(), is_train=False, verbose=False)
    items = [dataset[i] for i in range(2)]
    targets = items[0]["depth_targets"]
    bins = round((DBOUND[1] - DBOUND[0]) / DBOUND[2])
    assert targets.shape == (6, FINAL_DIM[0] // 16, FINAL_DIM[1] // 16) and targets.dtype == torch.int64
    assert targets.min() >= -1 and targets.max() < bins
    valid = (targets >= 0).float().mean()
    assert 0.2 < valid < 1.0, valid  # the ground fills the lower rows; the sky above the horizon has no return
    batch = collate(items)
    assert batch["depth_targets"].shape == (2, *targets.shape)
    assert "depth_targets" not in NuScenesBEV(synthetic_root, VERSION, "train", depth_config(depth_targets=False),
                                              is_train=False, verbose=False)[0]


def test_targets_match_an_independent_projection_of_every_lidar_point(shifted_root):
    dataset = NuScenesBEV(shifted_root, VERSION, "train", depth_config(num_train_cameras=3), is_train=True,
                          verbose=False)
    flips = set()
    for seed in range(3):
        torch.manual_seed(seed)
        for index in range(len(dataset)):
            item = dataset[index]
            # which cameras the random subset drew: the rows of the rig whose translations the item carries
            cams = [int(np.abs(dataset.sensor2ego_trans[index] - t).sum(1).argmin()) for t in item["sensor2ego_trans"].numpy()]
            expected = reference_targets(shifted_root, dataset, index, cams, item["post_rot"].double().numpy(),
                                         item["post_trans"].double().numpy())
            assert (expected >= 0).sum() > 10
            np.testing.assert_array_equal(item["depth_targets"].numpy(), expected)
            flips |= set((item["post_rot"][:, 0, 0] < 0).tolist())
    assert flips == {False, True}  # augmentations with and without flips were both checked


def test_flipped_augmentation_mirrors_image_and_targets(synthetic_root, monkeypatch):
    cfg = depth_config()
    dataset = NuScenesBEV(synthetic_root, VERSION, "train", cfg, is_train=False, verbose=False)

    def item_with(aug):
        monkeypatch.setattr("lss.data.nuscenes.sample_augmentation", lambda *args, **kwargs: aug)
        return dataset[1]

    plain = item_with(ImageAugmentation((290, 163), (17, 60), flip=False, rotate=4.0))
    flipped = item_with(ImageAugmentation((290, 163), (17, 60), flip=True, rotate=-4.0))
    torch.testing.assert_close(flipped["images"].float(), plain["images"].flip(-1).float(), atol=6, rtol=0)
    assert (plain["depth_targets"] >= 0).sum() > 20
    assert not torch.equal(plain["depth_targets"], plain["depth_targets"].flip(-1))  # the test can tell
    assert torch.equal(flipped["depth_targets"], plain["depth_targets"].flip(-1))


def test_missing_or_corrupt_lidar_names_file_and_sample(synthetic_root, tmp_path):
    root = tmp_path / "nuscenes"
    shutil.copytree(synthetic_root, root)
    dataset = NuScenesBEV(root, VERSION, "train", depth_config(), is_train=False, verbose=False)
    first, second = dataset.lidar_paths[0], dataset.lidar_paths[1]
    with open(second, "wb") as f:
        f.write(b"\0" * 7)
    with pytest.raises(OSError, match=re.escape(second) + ".*could not be read.*sample " + dataset.sample_tokens[1]):
        dataset[1]
    Path(first).unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(f"{first} not found (sample {dataset.sample_tokens[0]}")):
        NuScenesBEV(root, VERSION, "train", depth_config(), is_train=False, verbose=False)


def test_the_decoded_cache_keeps_each_sweeps_projections(synthetic_root, tmp_path, monkeypatch):
    """data.decoded_cache with depth targets: the same targets as without it under the same augmentations, one
    entry per sample and camera, later epochs read no sweep; a sweep rewritten since is read and projected again."""
    import lss.data.nuscenes as nuscenes_module

    monkeypatch.setenv("LSS_CACHE_DIR", str(tmp_path / "cache"))

    def dataset(decoded_cache):
        return NuScenesBEV(synthetic_root, VERSION, "train", depth_config(decoded_cache=decoded_cache),
                           is_train=True, verbose=False)

    def epoch(ds, seed=4):
        torch.manual_seed(seed)
        return ds, [ds[i]["depth_targets"] for i in range(len(ds))]

    _, plain = epoch(dataset(False))
    ds, first = epoch(dataset(True))
    entries = sorted((tmp_path / "cache" / "lidar").rglob("*.npy"))
    assert len(entries) == len(ds) * len(ds.cameras)
    assert all(torch.equal(a, b) for a, b in zip(plain, first))
    load = nuscenes_module.load_lidar_points

    def no_sweep(*args, **kwargs):
        raise AssertionError("a sweep was read although its projections are in the cache")

    again = dataset(True)  # (opening a set reads one sweep, to check it is there)
    monkeypatch.setattr(nuscenes_module, "load_lidar_points", no_sweep)
    _, second = epoch(again)
    assert all(torch.equal(a, b) for a, b in zip(plain, second))
    # the first sample's sweep rewritten (same bytes): its entries no longer match it, so it is read again
    sweep = Path(ds.lidar_paths[0])
    sweep.write_bytes(sweep.read_bytes())
    read = []
    monkeypatch.setattr(nuscenes_module, "load_lidar_points", lambda *a: read.append(a[0]) or load(*a))
    torch.manual_seed(4)
    assert torch.equal(ds[0]["depth_targets"], plain[0])
    assert read == [ds.lidar_paths[0]]
