import math

import pytest
import torch

from conftest import devices
from lss.geometry import (BevGrid, FrustumLUT, FrustumLUTCache, ImageAugmentation, depth_bins, frustum,
                          frustum_to_ego, image_augmentation, load_nuscenes_rig, val_augmentation)

FINAL_DIM = (128, 352)
IMAGE_SIZE = (1600, 900)


def rig(B=1, aug=None):
    """The real nuScenes rig, B copies, with one augmentation (post_rot, post_trans) for every camera."""
    K, rot, trans = load_nuscenes_rig()
    if aug is None:
        aug = image_augmentation(val_augmentation(IMAGE_SIZE, FINAL_DIM), IMAGE_SIZE, FINAL_DIM)
    post_rot, post_trans = aug
    N = K.shape[0]
    return (K.expand(B, N, 3, 3), rot.expand(B, N, 3, 3), trans.expand(B, N, 3),
            post_rot.expand(B, N, 3, 3), post_trans.expand(B, N, 3))


def project(ego, K, rot, trans, post_rot, post_trans):
    """Ego points ... x 3 -> (augmented pixel u, v, depth) with the camera model, in float64."""
    cam = (ego.double() - trans.double()) @ rot.double()  # R^T (x - t)
    pix = cam @ K.double().T
    uv1 = torch.cat([pix[..., :2] / pix[..., 2:3], torch.ones_like(pix[..., :1])], dim=-1)
    aug = uv1 @ post_rot.double().T + post_trans.double()
    return torch.cat([aug[..., :2], cam[..., 2:3]], dim=-1)


def test_bev_grid_sizes_and_centres():
    grid = BevGrid((-50, 50, 0.5), (-30, 30, 0.4), (-10, 10, 20))
    assert (grid.nx, grid.ny, grid.nz) == (200, 150, 1)
    assert grid.shape == (200, 150)
    assert grid.lower == (-50.0, -30.0, -10.0) and grid.cell_size == (0.5, 0.4, 20.0)
    torch.testing.assert_close(grid.cell_centers_x()[:2], torch.tensor([-49.75, -49.25]))
    torch.testing.assert_close(grid.cell_centers_y()[-1:], torch.tensor([29.8]))
    with pytest.raises(ValueError, match="xbound"):
        BevGrid((1, 0, 0.5), (-1, 1, 1), (-1, 1, 2))


def test_frustum_uses_feature_cell_centres():
    fr = frustum((64, 176), 16, (4.0, 45.0, 1.0))
    assert fr.shape == (41, 4, 11, 3) and fr.dtype == torch.float32
    torch.testing.assert_close(fr[0, 0, :, 0], (torch.arange(11) + 0.5) * 16 - 0.5)
    torch.testing.assert_close(fr[0, :, 0, 1], (torch.arange(4) + 0.5) * 16 - 0.5)
    torch.testing.assert_close(fr[:, 0, 0, 2], torch.arange(4.0, 45.0))
    assert depth_bins((1.0, 60.0, 0.5)).numel() == 118


def test_val_augmentation_matches_lss_recipe():
    aug = val_augmentation(IMAGE_SIZE, FINAL_DIM, (0.0, 0.22))
    resize = max(128 / 900, 352 / 1600)
    assert resize == pytest.approx(0.22)
    assert aug.resize_dims == (int(1600 * resize), int(900 * resize))
    assert aug.crop == (0, int((1 - 0.11) * int(900 * resize)) - 128)
    assert not aug.flip and aug.rotate == 0.0


def test_resize_scales_pixel_edges():
    """Resize then crop: pixel edges (u = -0.5, W - 0.5) scale with the image, so the centre of source pixel k lands
    at s (k + 0.5) - 0.5 - crop; flip mirrors the final_dim window."""
    aug = ImageAugmentation((400, 225), (10, 20))
    post_rot, post_trans = image_augmentation(aug, IMAGE_SIZE, FINAL_DIM)
    s = 0.25
    torch.testing.assert_close(post_rot, torch.diag(torch.tensor([s, s, 1.0])))
    torch.testing.assert_close(post_trans, torch.tensor([0.5 * (s - 1) - 10, 0.5 * (s - 1) - 20, 0.0]))
    edges = torch.tensor([[-0.5, -0.5, 1.0], [1599.5, 899.5, 1.0]]) @ post_rot.T + post_trans
    torch.testing.assert_close(edges[:, :2], torch.tensor([[-10.5, -20.5], [389.5, 204.5]]))
    flip_rot, flip_trans = image_augmentation(ImageAugmentation((400, 225), (10, 20), flip=True), IMAGE_SIZE,
                                              FINAL_DIM)
    u = torch.tensor([7.0, 3.0, 1.0])
    assert (flip_rot @ u + flip_trans)[0].item() == pytest.approx(FINAL_DIM[1] - 1 - (post_rot @ u + post_trans)[0])


@pytest.mark.parametrize("aug", ["val", "flip_rot"])
def test_known_point_comes_back_at_its_depth_bin(aug):
    """Ego points at the frustum's (u, v, d) project back to (u, v) at depth d through the real rig."""
    params = (val_augmentation(IMAGE_SIZE, FINAL_DIM) if aug == "val" else
              ImageAugmentation((336, 189), (5, 40), flip=True, rotate=4.0))
    post = image_augmentation(params, IMAGE_SIZE, FINAL_DIM)
    K, rot, trans, post_rot, post_trans = rig(1, post)
    fr = frustum(FINAL_DIM, 16, (4.0, 45.0, 1.0))
    ego = frustum_to_ego(fr, K, rot, trans, post_rot, post_trans)[0]  # N x D x fH x fW x 3
    for n in range(K.shape[1]):
        back = project(ego[n], K[0, n], rot[0, n], trans[0, n], post_rot[0, n], post_trans[0, n])
        torch.testing.assert_close(back.float(), fr, atol=2e-3, rtol=1e-5)


def test_known_ego_point_lands_in_its_cell():
    """A 3-D point 20 m ahead of CAM_FRONT, seen at a feature-cell centre, is recovered at its depth bin."""
    K, rot, trans, post_rot, post_trans = rig(1)
    cam_front = 1  # lss.config.NUSCENES_CAMERAS order
    target = torch.tensor([[21.7, 0.3, 0.9]])
    u, v, d = project(target, K[0, cam_front], rot[0, cam_front], trans[0, cam_front], post_rot[0, cam_front],
                      post_trans[0, cam_front])[0].tolist()
    single = torch.tensor([u, v, d]).view(1, 1, 1, 3)
    ego = frustum_to_ego(single, K, rot, trans, post_rot, post_trans)[0, cam_front, 0, 0, 0]
    torch.testing.assert_close(ego, target[0], atol=1e-3, rtol=0)
    grid = BevGrid((-50, 50, 0.5), (-50, 50, 0.5), (-10, 10, 20))
    lut = FrustumLUT.build(ego.view(1, 1, 1, 1, 1, 3), grid)
    assert lut.point_cell.tolist() == [math.floor((21.7 + 50) / 0.5) * 200 + math.floor((0.3 + 50) / 0.5)]


def test_frustum_to_ego_is_float32_under_autocast():
    K, rot, trans, post_rot, post_trans = rig(2)
    fr = frustum((64, 176), 16, (4.0, 45.0, 10.0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pts = frustum_to_ego(fr, K, rot, trans, post_rot, post_trans)
    assert pts.dtype == torch.float32 and pts.shape == (2, 6, 4, 4, 11, 3)
    with pytest.raises(ValueError, match="post_trans must be B x N x 3"):
        frustum_to_ego(fr, K, rot, trans, post_rot, post_trans[:, :3])


def brute_force_lut(points, grid):
    """point -> cell by the grid rule, one point at a time."""
    B = points.shape[0]
    flat = points.reshape(B, -1, 3).double()
    cells = []
    for b in range(B):
        for x, y, z in flat[b].tolist():
            if math.isnan(x + y + z):
                cells.append(-1)
                continue
            ijk = [math.floor((c - lo) / s) for c, lo, s in zip((x, y, z), grid.lower, grid.cell_size)]
            inside = all(0 <= i < n for i, n in zip(ijk, (grid.nx, grid.ny, grid.nz)))
            cells.append(((b * grid.nz + ijk[2]) * grid.nx + ijk[0]) * grid.ny + ijk[1] if inside else -1)
    return torch.tensor(cells)


@pytest.mark.parametrize("device", devices())
def test_lut_matches_brute_force(device):
    torch.manual_seed(0)
    grid = BevGrid((-4, 4, 1.0), (-3, 3, 0.5), (-2, 2, 2.0))
    points = torch.randn(2, 3, 4, 2, 5, 3) * 3
    points[0, 0, 0, 0, 0] = torch.tensor([-4.5, 0.0, 0.0])  # in (-1, 0) cells of x: dropped (floor, not trunc)
    points[0, 0, 0, 0, 1] = torch.tensor([float("nan"), 0.0, 0.0])
    points[0, 0, 0, 0, 2] = torch.tensor([-4.0, -3.0, -2.0])  # exactly on the lower corner: kept
    want = brute_force_lut(points, grid)
    lut = FrustumLUT.build(points.to(device), grid)
    assert lut.point_cell.dtype == torch.int32 and lut.sorted_points.dtype == torch.int32
    assert lut.point_cell.cpu().tolist() == want.tolist()
    assert want[0] == -1 and want[1] == -1 and want[2] == 0
    counts = torch.bincount(want[want >= 0], minlength=lut.num_cells)
    torch.testing.assert_close(lut.cell_start.cpu().long(), torch.cat([torch.zeros(1, dtype=torch.long),
                                                                       counts.cumsum(0)]))
    kept = lut.num_kept()
    order = lut.sorted_points.cpu().long()[:kept]
    assert want[order].tolist() == sorted(want[want >= 0].tolist())
    # ascending point index within a cell: a deterministic summation order
    key = want[order] * want.numel() + order
    assert bool((key[1:] > key[:-1]).all())


def test_lut_cache_reuses_until_inputs_change():
    K, rot, trans, post_rot, post_trans = (t.clone() for t in rig(2))
    fr = frustum((64, 176), 16, (4.0, 45.0, 4.0))
    grid = BevGrid((-50, 50, 0.5), (-50, 50, 0.5), (-10, 10, 20))
    cache = FrustumLUTCache()
    first = cache.get(fr, K, rot, trans, post_rot, post_trans, grid)
    assert cache.get(fr, K, rot, trans, post_rot, post_trans, grid) is first
    assert cache.get(fr.clone(), K.clone(), rot, trans, post_rot, post_trans, grid) is first
    post_trans[0, 0, 1] += 3.0  # in place: the version counter and the values change
    changed = cache.get(fr, K, rot, trans, post_rot, post_trans, grid)
    assert changed is not first and (cache.hits, cache.misses) == (2, 2)
    fresh = FrustumLUT.build(frustum_to_ego(fr, K, rot, trans, post_rot, post_trans), grid)
    assert torch.equal(changed.point_cell, fresh.point_cell)
    other_grid = BevGrid((-50, 50, 1.0), (-50, 50, 1.0), (-10, 10, 20))
    assert cache.get(fr, K, rot, trans, post_rot, post_trans, other_grid).nx == 100
