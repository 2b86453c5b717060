import dataclasses
import math

import numpy as np
import pytest
import torch

from conftest import devices
from lss.geometry import (NO_DEPTH_BIN, RIG_KEYS, BevGrid, FrustumLUT, FrustumLUTCache, ImageAugmentation,
                          camera_to_pixels, depth_bin_index, depth_bins, ego_to_pixels, feature_cells, frustum,
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


def test_rig_keys_are_the_arguments_of_frustum_to_ego_after_the_frustum():
    import inspect

    assert tuple(inspect.signature(frustum_to_ego).parameters)[1:] == RIG_KEYS


@pytest.mark.parametrize("aug", ["val", "flip_rot"])
def test_ego_to_pixels_matches_the_devkit_projection_and_inverts_frustum_to_ego(aug):
    """Against the nuScenes devkit's view_points plus post_rot @ (u, v, d) + post_trans written out, and as the
    inverse of frustum_to_ego (points at a frustum's (u, v, d) come back at (u, v) and depth d)."""
    from nuscenes.utils.geometry_utils import view_points

    params = (val_augmentation(IMAGE_SIZE, FINAL_DIM) if aug == "val" else
              ImageAugmentation((336, 189), (5, 40), flip=True, rotate=4.0))
    K, rot, trans, post_rot, post_trans = (t[0].double().numpy() for t in
                                           rig(1, image_augmentation(params, IMAGE_SIZE, FINAL_DIM)))
    points = np.random.default_rng(3).uniform((-40, -40, -1), (40, 40, 3), (500, 3))
    for n in range(len(K)):
        pixels, depth = ego_to_pixels(points, K[n], rot[n], trans[n], post_rot[n], post_trans[n])
        camera = rot[n].T @ (points - trans[n]).T  # 3 x P
        uv = view_points(camera, K[n], normalize=True)[:2]
        want_u = post_rot[n][0, 0] * uv[0] + post_rot[n][0, 1] * uv[1] + post_rot[n][0, 2] * camera[2]
        want_v = post_rot[n][1, 0] * uv[0] + post_rot[n][1, 1] * uv[1] + post_rot[n][1, 2] * camera[2]
        np.testing.assert_allclose(depth, camera[2], rtol=1e-12, atol=1e-9)
        np.testing.assert_allclose(pixels[:, 0], want_u + post_trans[n][0], rtol=1e-9, atol=1e-6)
        np.testing.assert_allclose(pixels[:, 1], want_v + post_trans[n][1], rtol=1e-9, atol=1e-6)
        source, _ = camera_to_pixels(camera.T, K[n])
        np.testing.assert_allclose(source, uv.T, rtol=1e-9, atol=1e-6)
    fr = frustum(FINAL_DIM, 16, (4.0, 45.0, 1.0))
    rig_t = [torch.from_numpy(t).float()[None] for t in (K, rot, trans, post_rot, post_trans)]
    ego = frustum_to_ego(fr, *rig_t)[0].double().numpy()
    for n in range(len(K)):
        pixels, depth = ego_to_pixels(ego[n], K[n], rot[n], trans[n], post_rot[n], post_trans[n])
        np.testing.assert_allclose(pixels, fr[..., :2].numpy(), atol=2e-3)
        np.testing.assert_allclose(depth, fr[..., 2].numpy(), rtol=1e-5)


def test_depth_bin_index_against_the_bin_edges():
    dbound = (4.0, 45.0, 0.5)
    bins = depth_bins(dbound).double().numpy()
    edges = np.append(bins, bins[-1] + 0.5)
    depth = np.concatenate([np.random.default_rng(4).uniform(0.0, 50.0, 2000), edges, edges - 1e-9,
                            [np.nan, np.inf, -np.inf]])
    got = depth_bin_index(depth, dbound)
    want = np.searchsorted(edges, depth, side="right") - 1
    want = np.where((want >= 0) & (want < len(bins)) & np.isfinite(depth), want, NO_DEPTH_BIN)
    assert got.dtype == np.int64 and got.tolist() == want.tolist()
    assert depth_bin_index([4.0, 4.49, 4.5, 44.99, 45.0, 3.99], dbound).tolist() == [0, 0, 1, 81, -1, -1]
    with pytest.raises(ValueError, match="dbound"):
        depth_bin_index([1.0], (5.0, 4.0, 1.0))


def test_feature_cells_hold_the_frustum_centres_and_split_at_pixel_edges():
    final_dim, downsample = (128, 352), 16
    fr = frustum(final_dim, downsample, (4.0, 6.0, 1.0))[0].double().numpy()  # fH x fW x 3
    row, col, inside = feature_cells(fr[..., :2], final_dim, downsample)
    fh, fw = fr.shape[:2]
    assert inside.all()
    assert (row == np.arange(fh)[:, None]).all() and (col == np.arange(fw)[None, :]).all()
    # pixel k covers [k - 0.5, k + 0.5): cell j starts at pixel edge j * 16 - 0.5
    u = np.array([-0.5, 15.5 - 1e-9, 15.5, 351.5 - 1e-9, 351.5, -0.5 - 1e-9])
    row, col, inside = feature_cells(np.stack([u, np.zeros_like(u)], -1), final_dim, downsample)
    assert col[inside].tolist() == [0, 0, 1, 21] and inside.tolist() == [True] * 4 + [False] * 2


def test_grid_contains_is_the_cell_rule():
    grid = BevGrid((-4, 4, 1.0), (-3, 3, 0.5), (-2, 2, 2.0))
    rng = np.random.default_rng(5)
    pts = rng.uniform(-6, 6, (3000, 3))
    pts[:3] = [[-4.0, -3.0, -2.0], [4.0, 0.0, 0.0], [np.nan, 0.0, 0.0]]  # lower corner in, upper edge out
    want = [all(0 <= math.floor((c - lo) / s) < n for c, lo, s, n in
                zip(p, grid.lower, grid.cell_size, (grid.nx, grid.ny, grid.nz))) if np.isfinite(p).all()
            else False for p in pts]
    assert grid.contains(pts[:, 0], pts[:, 1], pts[:, 2]).tolist() == want
    planar = [all(0 <= math.floor((c - lo) / s) < n for c, lo, s, n in
                  zip(p[:2], grid.lower, grid.cell_size, (grid.nx, grid.ny))) if np.isfinite(p).all()
              else False for p in pts]
    assert grid.contains(torch.from_numpy(pts[:, 0]), torch.from_numpy(pts[:, 1])).tolist() == planar
    lut = FrustumLUT.build(torch.from_numpy(pts).float().view(1, 1, 1, 1, -1, 3), grid)
    torch.testing.assert_close(lut.point_cell >= 0, grid.contains(*torch.from_numpy(pts).float().unbind(-1)))


def test_frustum_lut_is_read_only_and_bev_pool_refuses_a_table_changed_in_place():
    from lss.ops import bev_pool, bev_pool_reference

    torch.manual_seed(1)
    grid = BevGrid((-4, 4, 1.0), (-3, 3, 0.5), (-2, 2, 2.0))
    lut = FrustumLUT.build(torch.randn(1, 2, 3, 2, 4, 3) * 3, grid)
    depth, feat = torch.rand(1, 2, 3, 2, 4), torch.rand(1, 2, 5, 2, 4)
    want = bev_pool_reference(depth, feat, lut)
    for name, value in [("nx", 100), ("point_cell", torch.zeros(48, dtype=torch.int32)), ("B", 2)]:
        with pytest.raises(dataclasses.FrozenInstanceError, match=f"read-only: cannot assign '{name}'"):
            setattr(lut, name, value)
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot delete 'cell_start'"):
        del lut.cell_start
    copy = dataclasses.replace(lut, nx=lut.nx)  # a copy is validated and read-only too
    with pytest.raises(dataclasses.FrozenInstanceError):
        copy.ny = 1
    with pytest.raises(ValueError, match="nx must be an integer >= 1"):
        dataclasses.replace(lut, nx=0)
    kept = int(lut.sorted_points[0])
    lut.sorted_points[0] = 10**9  # a corrupt index: would read far outside feat
    for pool in (bev_pool, bev_pool_reference):
        with pytest.raises(ValueError, match="changed in place"):
            pool(depth, feat, lut)
    with pytest.raises(ValueError, match="sorted_points holds 1000000000"):
        lut.validate()
    with pytest.raises(ValueError, match="changed in place"):
        bev_pool(depth, feat, lut)  # a failed validate() does not clear the table
    lut.sorted_points[0] = kept
    torch.testing.assert_close(bev_pool(depth, feat, lut.validate()), want)
