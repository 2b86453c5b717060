"""BEV-space augmentation: the extrinsics and every ego-frame target move by the same transform, images do not."""
import math

import numpy as np
import pytest
import torch

from lss.config import Config
from lss.data import NuScenesBEV
from lss.data import nuscenes as nuscenes_module
from lss.data.bev_augmentation import BevAugmentation, sample_bev_augmentation
from lss.geometry.boxes import box_footprints
from lss.geometry import BevGrid, FrustumLUT, frustum, frustum_to_ego

VERSION = "v1.0-mini"


def make_config(**data) -> Config:
    cfg = Config()
    cfg.data.final_dim = (64, 176)
    cfg.data.resize_lim = (0.45, 0.5)  # of the 400 x 225 synthetic images
    cfg.data.classes = ("vehicle", "pedestrian", "drivable_area", "lane_divider")
    cfg.data.detection_targets = True
    cfg.data.visibility_mask = True
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def item_at(ds: NuScenesBEV, index: int, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    return ds[index]


def project(points: np.ndarray, item: dict, k: int) -> np.ndarray:
    """P x 3 ego points -> P x 3 (u, v, depth) in camera k's augmented image, inverting sensor2ego exactly."""
    rot, trans = item["sensor2ego_rot"][k].double().numpy(), item["sensor2ego_trans"][k].double().numpy()
    cam = np.linalg.solve(rot, (points - trans).T)
    pix = item["intrinsics"][k].double().numpy() @ cam
    uvd = np.stack([pix[0] / cam[2], pix[1] / cam[2], cam[2]])
    return (item["post_rot"][k].double().numpy() @ uvd).T + item["post_trans"][k].double().numpy()


def outline(raster: np.ndarray) -> np.ndarray:
    """Cells that differ from one of their 4 neighbours."""
    padded = np.pad(raster, 1, mode="edge")
    h, w = raster.shape
    return np.any([padded[i:i + h, j:j + w] != raster for i, j in ((0, 1), (2, 1), (1, 0), (1, 2))], axis=0)


def test_matrix_composition():
    rot = BevAugmentation(rotate=90.0).matrix()
    np.testing.assert_allclose(rot @ [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], atol=1e-12)  # x turns towards y
    both = BevAugmentation(flip_x=True, flip_y=True).matrix()
    np.testing.assert_allclose(both, BevAugmentation(rotate=180.0).matrix(), atol=1e-12)
    m = BevAugmentation(rotate=30.0, scale=1.2, flip_x=True).matrix()
    np.testing.assert_allclose(m, np.diag([-1.0, 1.0, 1.0]) @ (1.2 * BevAugmentation(rotate=30.0).matrix()))
    with pytest.raises(ValueError, match="bev_scale_lim"):
        BevAugmentation(scale=0.0)


@pytest.mark.parametrize("aug", [BevAugmentation(flip_y=True), BevAugmentation(rotate=37.0, scale=1.1),
                                 BevAugmentation(rotate=-120.0, scale=0.9, flip_x=True)])
def test_boxes_move_as_their_corners(aug):
    rng = np.random.default_rng(0)
    boxes = np.concatenate([rng.uniform(-40, 40, (6, 3)), rng.uniform(0.5, 5, (6, 3)), rng.uniform(-3, 3, (6, 1)),
                            rng.uniform(-10, 10, (6, 2))], 1)
    moved = aug.apply_to_boxes(boxes).astype(np.float64)
    corners = aug.apply_to_points_xy(box_footprints(boxes[:, :2], boxes[:, 3:5], boxes[:, 6]))
    expected = box_footprints(moved[:, :2], moved[:, 3:5], moved[:, 6])
    for a, b in zip(corners, expected):  # the same rectangle; a flip reverses the corner order
        np.testing.assert_allclose(sorted(map(tuple, a)), sorted(map(tuple, b)), atol=1e-4)
    np.testing.assert_allclose(moved[:, 2], boxes[:, 2] * aug.scale, rtol=1e-6)
    np.testing.assert_allclose(moved[:, 5], boxes[:, 5] * aug.scale, rtol=1e-6)
    np.testing.assert_allclose(moved[:, 7:9], boxes[:, 7:9] @ aug.matrix()[:2, :2].T, rtol=1e-5, atol=1e-5)


def test_off_settings_draw_nothing():
    rng = np.random.default_rng(3)
    state = rng.bit_generator.state
    assert sample_bev_augmentation((0.0, 0.0), (1.0, 1.0), False, rng) is None
    assert rng.bit_generator.state == state
    aug = sample_bev_augmentation((-10.0, 10.0), (0.9, 1.1), True, np.random.default_rng(3))
    assert -10 <= aug.rotate <= 10 and 0.9 <= aug.scale <= 1.1


def test_identity_settings_give_bit_identical_items(synthetic_root, monkeypatch):
    ds = NuScenesBEV(synthetic_root, VERSION, "train", make_config(), is_train=True, verbose=False)
    plain = item_at(ds, 1)
    monkeypatch.setattr(nuscenes_module, "sample_bev_augmentation", lambda *args: BevAugmentation())
    identity = item_at(ds, 1)
    assert plain.keys() == identity.keys()
    for key, value in plain.items():
        if torch.is_tensor(value):
            assert value.dtype == identity[key].dtype and torch.equal(value, identity[key]), key
        else:
            assert value == identity[key]


def test_flip_y_mirrors_targets_and_the_frustum_lut(synthetic_root):
    cfg = make_config()
    ds = NuScenesBEV(synthetic_root, VERSION, "val", cfg, is_train=False, verbose=False)
    aug = BevAugmentation(flip_y=True)
    for index in range(len(ds)):
        plain, flipped = ds.bev_targets(index), ds.bev_targets(index, aug)
        mirrored = plain[:, :, ::-1]
        for k, name in enumerate(cfg.data.classes):
            assert plain[k].sum() > 0, name
            # OpenCV's fill rule is not mirror-symmetric: outline cells may differ, nothing else
            edge = outline(mirrored[k])
            wrong = flipped[k] != mirrored[k]
            assert not (wrong & ~edge).any() and wrong.sum() < 0.5 * edge.sum(), name

    item = ds[0]
    rot, trans = aug.apply_to_extrinsics(item["sensor2ego_rot"].numpy(), item["sensor2ego_trans"].numpy())
    rig = {k: item[k][None] for k in ("intrinsics", "post_rot", "post_trans")}
    grid = BevGrid.from_config(cfg.grid)
    points = frustum(cfg.data.final_dim, cfg.model.downsample, cfg.grid.dbound)
    cells = []
    for r, t in ((item["sensor2ego_rot"], item["sensor2ego_trans"]), (torch.from_numpy(rot), torch.from_numpy(trans))):
        ego = frustum_to_ego(points, rig["intrinsics"], r[None], t[None], rig["post_rot"], rig["post_trans"])
        cells.append(FrustumLUT.build(ego, grid).point_cell.long())
    plain, flipped = cells
    kept = plain >= 0
    assert kept.sum() > 1000
    i, j = plain[kept] // grid.ny, plain[kept] % grid.ny
    agree = (flipped[kept] == i * grid.ny + (grid.ny - 1 - j)).double().mean()
    assert agree > 0.999  # all but points within float rounding of a cell boundary


@pytest.mark.parametrize("rotate, scale", [(25.0, 1.0), (-40.0, 1.15)])
def test_rotation_keeps_image_content_and_moves_footprints(synthetic_root, rotate, scale):
    base = make_config()
    turned = make_config(bev_rot_lim=(rotate, rotate), bev_scale_lim=(scale, scale))
    ds_plain = NuScenesBEV(synthetic_root, VERSION, "train", base, is_train=True, verbose=False)
    ds_turned = NuScenesBEV(synthetic_root, VERSION, "train", turned, is_train=True, verbose=False)
    aug = BevAugmentation(rotate, scale)
    m = aug.matrix()
    marked, checked = 0, 0
    for index in range(len(ds_plain)):
        plain, moved = item_at(ds_plain, index, seed=index), item_at(ds_turned, index, seed=index)
        assert torch.equal(plain["images"], moved["images"])  # pixels are not touched
        boxes, labels = ds_plain.detection_targets(index)
        corners = np.concatenate([box_footprints(boxes[:, :2], boxes[:, 3:5], boxes[:, 6]),
                                  np.broadcast_to(boxes[:, None, 2:3], (len(boxes), 4, 1))], -1).reshape(-1, 3)
        for k in range(len(ds_plain.cameras)):
            before, after = project(corners, plain, k), project(corners @ m.T, moved, k)
            front = before[:, 2] > 1.0
            np.testing.assert_allclose(after[front], before[front], rtol=1e-4, atol=1e-2)
            checked += int(front.sum())
        vehicle = moved["targets"][0].numpy()
        xb, yb = base.grid.xbound, base.grid.ybound
        for x, y in (boxes[:, :2] @ m[:2, :2].T)[np.isin(labels, range(5))]:  # car .. construction_vehicle
            if xb[0] + 1 < x < xb[1] - 1 and yb[0] + 1 < y < yb[1] - 1:
                assert vehicle[math.floor((x - xb[0]) / xb[2]), math.floor((y - yb[0]) / yb[2])] == 1
                marked += 1
        det = moved["det_boxes"].numpy()
        if len(det):
            expected = aug.apply_to_boxes(ds_plain.det_boxes[ds_plain.object_offsets[index]:
                                                             ds_plain.object_offsets[index + 1]])
            for box in det:  # every returned box is one of the moved boxes (an unknown velocity stays NaN)
                assert np.abs(np.nan_to_num(expected, nan=1e6) - np.nan_to_num(box, nan=1e6)).max(1).min() < 1e-5
    assert checked > 20 and marked > 3
