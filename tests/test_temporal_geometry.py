"""The previous frame's geometry (model.temporal.frames: 2): its cameras composed with the ego motion lift a
static world point to where the current frame's cameras lift it, into the same BEV cell; its LUT is cached
apart from the current frame's, by calibration and pose."""
import numpy as np
import pytest
import torch
from pyquaternion import Quaternion

from lss.config import config_from_dict
from lss.data import NuScenesBEV, collate
from lss.geometry import BevGrid, ego_to_pixels, frustum_to_ego
from lss.geometry.ego_motion import previous_cam_to_ego
from lss.geometry.lut import cell_indices
from lss.models.splat import Splat

VERSION = "v1.0-mini"


def temporal_config(**data):
    values = {"final_dim": [128, 352], "resize_lim": [0.95, 1.15], **data}
    return config_from_dict({"data": values, "model": {"temporal": {"frames": 2}}})


@pytest.fixture(scope="module")
def nusc(synthetic_root):
    from nuscenes.nuscenes import NuScenes

    return NuScenes(VERSION, str(synthetic_root), verbose=False)


def global_to_ego(nusc, sample_token, points):
    sample = nusc.get("sample", sample_token)
    pose = nusc.get("ego_pose", nusc.get("sample_data", sample["data"]["LIDAR_TOP"])["ego_pose_token"])
    return (points - np.asarray(pose["translation"])) @ Quaternion(pose["rotation"]).rotation_matrix


def lift(item, prefix, camera, uvd, rot=None, trans=None):
    """Augmented-image (u, v, depth) rows of one camera -> ego points, through frustum_to_ego."""
    def rig(key):
        return item[prefix + key][camera][None, None].float()

    frustum = torch.as_tensor(uvd, dtype=torch.float32).view(1, 1, -1, 3)
    points = frustum_to_ego(
        frustum,
        rig("intrinsics"),
        rig("sensor2ego_rot") if rot is None else rot[None, None],
        rig("sensor2ego_trans") if trans is None else trans[None, None],
        rig("post_rot"),
        rig("post_trans"),
    )
    return points.view(-1, 3).double()


@pytest.mark.parametrize("bev_augmentation", [False, True])
def test_a_static_world_point_lands_in_the_same_cell_from_both_frames(synthetic_root, nusc, bev_augmentation):
    extra = dict(bev_rot_lim=[-30.0, 30.0], bev_scale_lim=[0.9, 1.1], bev_flip=True) if bev_augmentation else {}
    cfg = temporal_config(**extra)
    ds = NuScenesBEV(synthetic_root, VERSION, "train", cfg, is_train=True, verbose=False)
    grid = BevGrid.from_config(cfg.grid)
    checked = 0
    for index in (1, 2):
        torch.manual_seed(10 + index)
        item = ds[index]
        token, prev_token = ds.sample_tokens[index], ds.sample_tokens[ds.prev_index[index]]
        # static world points around the current ego: ahead, behind, to the sides, at several heights
        offsets = np.array(
            [[12.13, 0.37, 0.5], [-9.21, 1.12, 1.2], [3.34, 11.09, 0.0], [6.17, -14.36, 2.0], [25.29, 6.18, 0.8]]
        )
        sample = nusc.get("sample", token)
        pose = nusc.get("ego_pose", nusc.get("sample_data", sample["data"]["LIDAR_TOP"])["ego_pose_token"])
        world = np.asarray(pose["translation"]) + offsets @ Quaternion(pose["rotation"]).rotation_matrix.T
        in_current = global_to_ego(nusc, token, world)
        in_previous = global_to_ego(nusc, prev_token, world)
        # where the current (augmented) ego frame has them: lift them back from the current cameras
        rot, trans = previous_cam_to_ego(
            item["ego_motion"][None], item["prev_sensor2ego_rot"][None], item["prev_sensor2ego_trans"][None]
        )
        for camera in range(len(ds.cameras)):
            pixels, depth = ego_to_pixels(
                in_previous,
                item["prev_intrinsics"][camera].numpy(),
                item["prev_sensor2ego_rot"][camera].numpy(),
                item["prev_sensor2ego_trans"][camera].numpy(),
                item["prev_post_rot"][camera].numpy(),
                item["prev_post_trans"][camera].numpy(),
            )
            h, w = cfg.data.final_dim
            seen = (depth > 1.0) & (pixels[:, 0] >= 0) & (pixels[:, 0] < w) & (pixels[:, 1] >= 0) & (pixels[:, 1] < h)
            if not seen.any():
                continue
            uvd = np.concatenate([pixels[seen], depth[seen, None]], axis=1)
            from_previous = lift(item, "prev_", camera, uvd, rot[0, camera], trans[0, camera])
            # the same points seen by the current frame's camera, lifted through the current rig
            pixels_now, depth_now = ego_to_pixels(
                in_current[seen],
                item["intrinsics"][camera].numpy(),
                ds.sensor2ego_rot[index, camera],  # the index's rig: before the BEV augmentation
                ds.sensor2ego_trans[index, camera],
                item["post_rot"][camera].numpy(),
                item["post_trans"][camera].numpy(),
            )
            uvd_now = np.concatenate([pixels_now, depth_now[:, None]], axis=1)
            from_current = lift(item, "", camera, uvd_now)
            torch.testing.assert_close(from_previous, from_current, atol=2e-3, rtol=0)
            cells_prev = cell_indices(from_previous.float(), grid)
            cells_now = cell_indices(from_current.float(), grid)
            inside = ((cells_now >= 0) & (cells_now < torch.tensor([grid.nx, grid.ny, grid.nz]))).all(-1)
            # away from cell borders the two land in one cell
            fraction = torch.stack([grid.to_cells(from_current[:, a].float(), a) for a in range(2)], -1).frac()
            clear = inside & ((fraction > 0.01) & (fraction < 0.99)).all(-1)
            assert torch.equal(cells_prev[clear], cells_now[clear])
            checked += int(clear.sum())
    assert checked >= 5


def test_previous_lut_follows_the_ego_motion_and_is_cached(synthetic_root):
    cfg = temporal_config()
    ds = NuScenesBEV(synthetic_root, VERSION, "train", cfg, is_train=False, verbose=False)
    splat = Splat(BevGrid.from_config(cfg.grid), cfg.data.final_dim, cfg.model.downsample, cfg.grid.dbound)
    first = collate([ds[0]])  # its previous frame is itself: the same table as the current frame's
    current, previous = splat.lut(first), splat.previous_lut(first)
    assert torch.equal(current.point_cell, previous.point_cell)
    assert splat.previous_lut(first) is previous  # the same tensors: a hit
    assert (splat.previous_lut_cache.hits, splat.previous_lut_cache.misses) == (1, 1)
    second = collate([ds[1]])  # the ego drove on: the previous frame's points land elsewhere
    moved = splat.previous_lut(second)
    assert splat.previous_lut_cache.misses == 2
    assert not torch.equal(moved.point_cell, splat.lut(second).point_cell)
    again = {k: v.clone() if torch.is_tensor(v) else v for k, v in second.items()}
    assert splat.previous_lut(again) is moved  # equal calibration and pose in new tensors: a hit
    again["ego_motion"] = again["ego_motion"].clone()
    again["ego_motion"][0, 0, 3] += 1.0
    assert splat.previous_lut(again) is not moved  # another pose: rebuilt
    assert splat.previous_lut_cache.misses == 3


def test_previous_cam_to_ego_refuses_bad_shapes():
    rot, trans = torch.eye(3).expand(2, 6, 3, 3), torch.zeros(2, 6, 3)
    with pytest.raises(ValueError, match="ego_motion must be B x 4 x 4"):
        previous_cam_to_ego(torch.eye(4), rot, trans)
    with pytest.raises(ValueError, match="one pose per sample"):
        previous_cam_to_ego(torch.eye(4).expand(3, 4, 4), rot, trans)
