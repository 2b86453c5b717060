"""model.temporal.frames: 2 on the data side: the previous sample of the scene (a scene's first sample
uses itself), its images under the current sample's augmentation, and the ego motion between the two
LIDAR_TOP ego frames; plus the synthetic generator's moving ego and objects (checked through the devkit)."""
import numpy as np
import pytest
import torch
from pyquaternion import Quaternion

from lss.config import config_from_dict
from lss.data import NuScenesBEV
from lss.geometry.ego_motion import PREVIOUS_FRAME_KEYS, previous_cam_to_ego

VERSION = "v1.0-mini"


def temporal_config(frames=2, gap=1, **data):
    values = {"final_dim": [128, 352], "resize_lim": [0.95, 1.15], **data}
    return config_from_dict({"data": values, "model": {"temporal": {"frames": frames, "gap": gap}}})


@pytest.fixture(scope="module")
def nusc(synthetic_root):
    from nuscenes.nuscenes import NuScenes

    return NuScenes(VERSION, str(synthetic_root), verbose=False)


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    """test_data's hand-built set: its ego turns between the two samples of a scene (yaw 0.7 -> 0.75)."""
    from test_data import build_tiny_set

    return build_tiny_set(tmp_path_factory.mktemp("tiny_nuscenes_temporal"))


def ego_to_global(nusc, sample_token):
    sample = nusc.get("sample", sample_token)
    pose = nusc.get("ego_pose", nusc.get("sample_data", sample["data"]["LIDAR_TOP"])["ego_pose_token"])
    return Quaternion(pose["rotation"]).rotation_matrix, np.asarray(pose["translation"])


@pytest.mark.parametrize("split", ["train", "val"])
def test_previous_sample_follows_the_scene_and_a_first_sample_uses_itself(synthetic_root, nusc, split):
    ds = NuScenesBEV(synthetic_root, VERSION, split, temporal_config(), is_train=False, verbose=False)
    firsts = 0
    for i, token in enumerate(ds.sample_tokens):
        sample = nusc.get("sample", token)
        prev = int(ds.prev_index[i])
        if sample["prev"]:
            assert ds.sample_tokens[prev] == sample["prev"]
            assert nusc.get("sample", sample["prev"])["scene_token"] == sample["scene_token"]
        else:
            firsts += 1
            assert prev == i
            np.testing.assert_array_equal(ds.ego_motion[i], np.eye(4))
    assert firsts == ds.scene_count


def check_ego_motion(root, nusc, split, gap=1):
    """A static world point, taken into the previous sample's ego frame, goes by ego_motion to where the
    devkit's own pose puts it in the current ego frame."""
    ds = NuScenesBEV(root, VERSION, split, temporal_config(gap=gap, final_dim=[64, 128], resize_lim=[0.9, 1.1]),
                     is_train=False, verbose=False)
    world = np.array([[12.0, -7.0, 1.5], [-30.0, 4.0, 0.0], [3.0, 45.0, -1.0]])
    moved = 0
    for i, token in enumerate(ds.sample_tokens):
        prev_token = ds.sample_tokens[ds.prev_index[i]]
        rot, trans = ego_to_global(nusc, token)
        prev_rot, prev_trans = ego_to_global(nusc, prev_token)
        anchor = rot @ np.array([5.0, 2.0, 0.0]) + trans  # near the ego wherever the scene is
        points = anchor + world
        in_prev = (points - prev_trans) @ prev_rot  # global -> previous ego frame
        in_current = (points - trans) @ rot
        motion = ds.ego_motion[i]
        np.testing.assert_allclose(in_prev @ motion[:3, :3].T + motion[:3, 3], in_current, atol=1e-6)
        moved += prev_token != token
    return moved


def test_ego_motion_takes_the_previous_ego_frame_into_the_current(synthetic_root, nusc):
    assert check_ego_motion(synthetic_root, nusc, "train") > 0


def test_previous_frame_two_key_frames_back(synthetic_root, nusc):
    """model.temporal.gap: 2: the sample before the previous one (a scene's second sample: its first), the ego
    motion from its ego frame, and the item's previous images are that sample's."""
    ds = NuScenesBEV(synthetic_root, VERSION, "train", temporal_config(gap=2), is_train=False, verbose=False)
    one = NuScenesBEV(synthetic_root, VERSION, "train", temporal_config(gap=1), is_train=False, verbose=False)
    two_back = 0
    for i, token in enumerate(ds.sample_tokens):
        sample = nusc.get("sample", token)
        back = [token]
        for _ in range(2):
            back.append(nusc.get("sample", back[-1])["prev"] or back[-1])
        assert ds.sample_tokens[ds.prev_index[i]] == back[-1]
        two_back += back[-1] != back[-2]
        assert nusc.get("sample", back[-1])["scene_token"] == sample["scene_token"]
    assert two_back > 0
    assert check_ego_motion(synthetic_root, nusc, "train", gap=2) > 0
    i = next(i for i in range(len(ds)) if ds.prev_index[i] != one.prev_index[i])
    item, before = ds[i], one[int(one.prev_index[i])]
    assert item["prev_sample_token"] == ds.sample_tokens[one.prev_index[one.prev_index[i]]]
    # the images two key frames back, under this sample's (here: the evaluation) augmentation
    torch.testing.assert_close(item["prev_images"], one[int(ds.prev_index[i])]["images"])
    assert not torch.equal(item["prev_images"], before["images"])


def test_previous_at_gap_chains_the_steps_and_composes_the_motions():
    from lss.data.sample_index import previous_at_gap

    rng = np.random.default_rng(0)
    # two scenes of 4 and 3 samples: each sample's previous is the one before, a first sample itself
    prev = np.array([0, 0, 1, 2, 4, 4, 5])
    poses = []
    for _ in prev:
        yaw = rng.uniform(-np.pi, np.pi)
        pose = np.eye(4)
        pose[:2, :2] = [[np.cos(yaw), -np.sin(yaw)], [np.sin(yaw), np.cos(yaw)]]
        pose[:3, 3] = rng.normal(size=3) * 20
        poses.append(pose)
    poses = np.stack(poses)
    motion = np.linalg.inv(poses) @ poses[prev]
    same_index, same_motion = previous_at_gap(prev, motion, 1)
    assert same_index is prev and same_motion is motion
    index, composed = previous_at_gap(prev, motion, 3)
    np.testing.assert_array_equal(index, [0, 0, 0, 0, 4, 4, 4])
    np.testing.assert_allclose(composed, np.linalg.inv(poses) @ poses[index], atol=1e-9)
    with pytest.raises(ValueError, match="gap=0"):
        previous_at_gap(prev, motion, 0)


def test_ego_motion_with_a_turning_ego(tiny_root):
    from nuscenes.nuscenes import NuScenes

    nusc = NuScenes(VERSION, str(tiny_root), verbose=False)
    assert check_ego_motion(tiny_root, nusc, "train") == 1
    ds = NuScenesBEV(tiny_root, VERSION, "train", temporal_config(final_dim=[64, 128]), is_train=False,
                     verbose=False)
    yaw = np.arctan2(ds.ego_motion[1, 1, 0], ds.ego_motion[1, 0, 0])
    assert yaw == pytest.approx(-0.05, abs=1e-6)  # the ego turned +0.05 rad: the old frame appears turned back


def test_item_holds_the_previous_frame_under_the_same_augmentation(synthetic_root):
    cfg = temporal_config(num_train_cameras=4, bev_rot_lim=[-20.0, 20.0], bev_scale_lim=[0.9, 1.1], bev_flip=True)
    ds = NuScenesBEV(synthetic_root, VERSION, "train", cfg, is_train=True, verbose=False)
    for index in (0, 1, 2):
        torch.manual_seed(index)
        item = ds[index]
        assert set(PREVIOUS_FRAME_KEYS) <= set(item)
        assert item["prev_images"].shape == item["images"].shape == (4, 3, 128, 352)
        torch.testing.assert_close(item["prev_post_rot"], item["post_rot"])
        torch.testing.assert_close(item["prev_post_trans"], item["post_trans"])
        torch.testing.assert_close(item["prev_intrinsics"], item["intrinsics"])  # one calibration per scene
        # the previous frame's cameras, moved by ego_motion (BEV augmentation included) ...
        rot, trans = previous_cam_to_ego(item["ego_motion"][None], item["prev_sensor2ego_rot"][None],
                                         item["prev_sensor2ego_trans"][None])
        if index == 0:  # ... are the current ones where the previous frame is the sample itself
            torch.testing.assert_close(item["prev_images"], item["images"])
            torch.testing.assert_close(rot[0], item["sensor2ego_rot"])
            torch.testing.assert_close(trans[0], item["sensor2ego_trans"], atol=1e-5, rtol=0)
        else:  # ... and sit behind the current ones by the distance the ego drove (4-9 m/s, 0.5 s)
            assert not torch.equal(item["prev_images"], item["images"])
            torch.testing.assert_close(rot[0], item["sensor2ego_rot"], atol=1e-5, rtol=0)
            gap = (trans[0] - item["sensor2ego_trans"]).norm(dim=-1)
            assert bool((gap > 1.5).all() and (gap < 5.5).all()), gap


def test_one_frame_items_are_as_before(synthetic_root):
    ds = NuScenesBEV(synthetic_root, VERSION, "train", temporal_config(frames=1), is_train=True, verbose=False)
    torch.manual_seed(0)
    assert not set(PREVIOUS_FRAME_KEYS) & set(ds[1])


def test_synthetic_scenes_move_consistently(synthetic_root, nusc):
    """The generator's ego drives forward along its heading, every channel of a key frame shares one ego
    pose, and moving vehicles move along their heading at the speed the devkit's box_velocity reports."""
    checked_ego = checked_vehicles = 0
    for scene in nusc.scene:
        token, previous = scene["first_sample_token"], None
        while token:
            sample = nusc.get("sample", token)
            poses = {nusc.get("sample_data", sd)["ego_pose_token"] for sd in sample["data"].values()}
            records = [nusc.get("ego_pose", p) for p in poses]
            assert all(r["translation"] == records[0]["translation"] for r in records)
            assert all(r["rotation"] == records[0]["rotation"] for r in records)
            rot, trans = ego_to_global(nusc, token)
            if previous is not None:
                prev_rot, prev_trans, prev_time = previous
                step = (trans - prev_trans) / ((sample["timestamp"] - prev_time) * 1e-6)
                forward = prev_rot[:, 0]
                assert 1.0 < np.linalg.norm(step) < 15.0
                assert step @ forward > 0.99 * np.linalg.norm(step)
                checked_ego += 1
            previous = (rot, trans, sample["timestamp"])
            for ann_token in sample["anns"]:
                ann = nusc.get("sample_annotation", ann_token)
                velocity = nusc.box_velocity(ann_token)
                if not ann["category_name"].startswith("vehicle.") or not np.isfinite(velocity).all():
                    continue
                speed = np.linalg.norm(velocity[:2])
                heading = Quaternion(ann["rotation"]).rotation_matrix[:2, 0]
                if speed > 0.5:
                    assert abs(velocity[:2] @ heading) > 0.98 * speed, (ann["category_name"], velocity)
                    checked_vehicles += 1
                assert abs(velocity[2]) < 1e-6
            token = sample["next"]
    assert checked_ego == sum(s["nbr_samples"] - 1 for s in nusc.scene)
    assert checked_vehicles > 0


@pytest.mark.parametrize("frames", [0, 3, -1])
def test_config_refuses_other_frame_counts(frames):
    from lss.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"model.temporal.frames={frames}: expected 1 .* or 2 "):
        temporal_config(frames=frames)


@pytest.mark.parametrize(
    "temporal, message",
    [({"frame": 2}, "unknown key 'frame'. Allowed keys: frames, gap, frame_blocks"), ({"frames": "two"}, "expected an integer"),
     ({"frames": 2, "gap": 0}, r"model.temporal.gap=0: expected a whole number of key frames >= 1"),
     ({"frames": 2, "gap": 1.5}, "expected an integer"),
     ({"gap": 2}, r"model.temporal.gap=2 needs model.temporal.frames: 2"),
     ({"frames": 2, "frame_blocks": -1}, r"model.temporal.frame_blocks=-1: expected a whole number of residual blocks"),
     ({"frame_blocks": 2}, r"model.temporal.frame_blocks=2 needs model.temporal.frames: 2")],
)
def test_config_refuses_unknown_keys_and_types(temporal, message):
    from lss.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        config_from_dict({"model": {"temporal": temporal}})


def test_config_default_is_one_frame():
    assert config_from_dict({}).model.temporal.frames == 1
