"""BEV rasterization: layout (row = ego x, column = ego y), footprints, polygons, lines, camera visibility."""
import math

import numpy as np
import pytest
import shapely
from nuscenes.utils.data_classes import Box
from nuscenes.utils.geometry_utils import view_points
from pyquaternion import Quaternion
from shapely.geometry import LineString, Point, Polygon

from lss.geometry.boxes import box_footprints
from lss.data import targets as T
from lss.geometry import BevGrid

XB, YB = (-50.0, 50.0, 0.5), (-50.0, 50.0, 0.5)
GRID = BevGrid.planar(XB, YB)


def cell_of(x, y, xb=XB, yb=YB):
    return int(math.floor((x - xb[0]) / xb[2])), int(math.floor((y - yb[0]) / yb[2]))


def centre_agreement(raster, geometry, grid=GRID, band=None):
    """Count raster cells that disagree with `geometry.contains(cell centre)`, ignoring cells within `band`
    metres of the boundary."""
    xs, ys = T.cell_centers(grid)
    gx, gy = np.meshgrid(xs, ys, indexing="ij")
    band = band if band is not None else max(grid.cell_size[:2])
    inside = shapely.contains_xy(geometry, gx, gy)
    far = shapely.distance(geometry.boundary, shapely.points(gx, gy)) >= band
    return int(((raster.astype(bool) != inside) & far).sum())


def test_grid_shape_and_centres():
    assert GRID.shape == (200, 200)
    small = BevGrid.planar((-10.0, 30.0, 0.25), (-5.0, 5.0, 1.0))
    assert small.shape == (160, 10)
    xs, ys = T.cell_centers(small)
    assert xs[0] == pytest.approx(-9.875) and xs[-1] == pytest.approx(29.875) and ys[3] == pytest.approx(-1.5)
    with pytest.raises(ValueError, match="xbound"):
        BevGrid.planar((1.0, -1.0, 0.5), YB)


def test_footprints_match_devkit_bottom_corners():
    rng = np.random.default_rng(0)
    for _ in range(20):
        c = rng.uniform(-30, 30, 3)
        w, l, h = rng.uniform(0.5, 12, 3)
        yaw = rng.uniform(-math.pi, math.pi)
        box = Box(c, [w, l, h], Quaternion(axis=[0, 0, 1], angle=yaw))
        ours = box_footprints(c[None, :2], [[w, l]], [yaw])[0]
        theirs = box.bottom_corners()[:2].T
        # Same rectangle: every devkit corner is one of ours.
        d = np.linalg.norm(ours[:, None] - theirs[None], axis=-1)
        assert np.allclose(d.min(0), 0, atol=1e-9) and np.allclose(d.min(1), 0, atol=1e-9)


def test_box_raster_layout_rows_are_ego_x_columns_ego_y():
    canvas = np.zeros((200, 200), np.uint8)
    fp = box_footprints([[10.2, 5.3]], [[0.3, 0.3]], [0.0])
    T.rasterize_footprints(canvas, fp, GRID)
    i, j = cell_of(10.2, 5.3)
    assert canvas[i, j] == 1 and canvas.sum() <= 2
    assert (i, j) == (120, 110)


def test_rotated_boxes_fill_their_cells():
    rng = np.random.default_rng(1)
    centres = rng.uniform(-45, 45, (25, 2))
    sizes = np.stack([rng.uniform(0.6, 3, 25), rng.uniform(0.6, 12, 25)], -1)
    yaws = rng.uniform(-math.pi, math.pi, 25)
    fps = box_footprints(centres, sizes, yaws)
    canvas = T.rasterize_footprints(np.zeros((200, 200), np.uint8), fps, GRID)
    for c in centres:
        assert canvas[cell_of(*c)] == 1
    union = Polygon(fps[0])
    for fp in fps[1:]:
        union = union.union(Polygon(fp))
    assert centre_agreement(canvas, union) == 0


def test_polygons_with_holes_and_overlaps():
    outer = np.array([[-20, -20], [20, -20], [20, 20], [-20, 20]], float)
    hole = np.array([[-5, -5], [5, -5], [5, 5], [-5, 5]], float)
    other = np.array([[0, 0], [30, 0], [30, 8], [0, 8]], float)  # overlaps the hole of the first polygon
    canvas = T.rasterize_polygons(np.zeros((200, 200), np.uint8), [[outer, hole], [other]], GRID)
    geom = Polygon(outer, [hole]).union(Polygon(other))
    assert centre_agreement(canvas, geom) == 0
    assert canvas[cell_of(-2, -2)] == 0 and canvas[cell_of(2, 2)] == 1 and canvas[cell_of(25, 4)] == 1


@pytest.mark.parametrize("width", [1, 2, 3, 4.5])
def test_lines_are_bands_of_the_configured_width(width):
    line = np.array([[-40.0, -30.0], [35.0, 20.0], [40.0, 45.0]])
    canvas = T.rasterize_lines(np.zeros((200, 200), np.uint8), [line], GRID, width=width)
    xs, ys = T.cell_centers(GRID)
    gx, gy = np.meshgrid(xs, ys, indexing="ij")
    dist_cells = shapely.distance(LineString(line), shapely.points(gx, gy)) / 0.5
    # Cells whose centre is within width/2 cells of the line are marked; OpenCV also marks cells its outline
    # passes through, so the band is up to one cell wider.
    assert dist_cells[canvas > 0].max() <= width / 2 + 0.75
    assert canvas[dist_cells <= width / 2 - 0.3].all()
    length_cells = LineString(line).length / 0.5
    assert length_cells * (width - 0.5) <= canvas.sum() <= length_cells * (width + 1.5)
    with pytest.raises(ValueError, match="width"):
        T.rasterize_lines(np.zeros((4, 4), np.uint8), [line], GRID, width=0)


def test_empty_inputs_give_empty_rasters():
    canvas = np.zeros((200, 200), np.uint8)
    T.rasterize_footprints(canvas, np.zeros((0, 4, 2)), GRID)
    T.rasterize_polygons(canvas, [], GRID)
    T.rasterize_lines(canvas, [], GRID, 2)
    T.rasterize_polygons(canvas, [[np.array([[1e7, 1e7], [1e7 + 5, 1e7], [1e7, 1e7 + 5]])]], GRID)
    assert canvas.sum() == 0


def test_global_to_ego_matches_the_inverse_pose():
    rng = np.random.default_rng(2)
    ego_xy, yaw = np.array([400.0, 1200.0]), 2.3
    q = Quaternion(axis=[0, 0, 1], angle=yaw)
    pts = rng.uniform(-100, 100, (10, 2)) + ego_xy
    ref = np.stack([q.inverse.rotate(np.array([*(p - ego_xy), 0.0]))[:2] for p in pts])
    assert np.allclose(T.global_to_ego_xy(pts, ego_xy, yaw), ref)


def test_visibility_mask_is_the_front_camera_fan():
    width, height = 1600, 900
    intrinsics = np.array([[1266.0, 0.0, 800.0], [0.0, 1266.0, 450.0], [0.0, 0.0, 1.0]])
    rot = (Quaternion(axis=[0, 0, 1], angle=-math.pi / 2) * Quaternion(axis=[1, 0, 0], angle=-math.pi / 2))
    trans = np.array([1.5, 0.0, 1.5])
    scale = 0.22
    post_rot = np.diag([scale, scale, 1.0]).astype(np.float32)
    post_trans = np.array([0.0, -70.0, 0.0], np.float32)
    final_dim = (128, 352)
    mask = T.camera_visibility_mask(intrinsics[None], rot.rotation_matrix[None], trans[None], post_rot[None],
                                    post_trans[None], final_dim, GRID, (4.0, 45.0))
    xs, ys = T.cell_centers(GRID)
    assert mask[cell_of(20.0, 0.0)] and not mask[cell_of(-20.0, 0.0)] and not mask[cell_of(2.0, 0.0)]
    assert not mask[cell_of(48.0, 0.0)]  # beyond the last depth bin
    # Reference: the devkit's projection of every cell centre on the ground.
    gx, gy = np.meshgrid(xs, ys, indexing="ij")
    pts = np.stack([gx.ravel(), gy.ravel(), np.zeros(gx.size)])
    cam = rot.rotation_matrix.T @ (pts - trans[:, None])
    uv = view_points(cam, intrinsics, normalize=True)[:2] * scale + post_trans[:2, None]
    ref = ((cam[2] >= 4.0) & (cam[2] < 45.0) & (uv[0] >= -0.5) & (uv[0] < 351.5) & (uv[1] >= -0.5) & (uv[1] < 127.5))
    assert np.array_equal(mask.ravel(), ref)
    assert ref.sum() > 100
