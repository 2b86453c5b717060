"""Box coding (lss.geometry.boxes) and the grid methods it uses: regression and residual round trips, centre cells, the
jittered ground-truth proposals, box corners."""
import math

import numpy as np
import pytest
import torch

from lss.geometry.boxes import (REGRESSION_CHANNELS, apply_residuals, box_corners, box_residuals, box_footprints, boxes_to_regression, centre_cells,
                       regression_to_boxes)
from lss.geometry.proposals import ground_truth_proposals
from lss.geometry import BevGrid

GRID = BevGrid((-50.0, 50.0, 0.5), (-40.0, 40.0, 0.5), (-10.0, 10.0, 20.0))


def boxes_on_map(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    centre = torch.rand(n, 2, generator=g) * torch.tensor([98.0, 78.0]) - torch.tensor([49.0, 39.0])
    z = torch.rand(n, 1, generator=g) * 2 - 1
    size = torch.rand(n, 3, generator=g) * torch.tensor([2.0, 4.0, 2.0]) + 0.5
    yaw = (torch.rand(n, 1, generator=g) * 2 - 1) * (math.pi - 1e-3)
    velocity = torch.randn(n, 2, generator=g) * 3
    return torch.cat([centre, z, size, yaw, velocity], 1)


def test_with_shape_and_xy_to_cells_place_a_coarser_map_on_the_same_area():
    coarse = GRID.with_shape((50, 40))
    assert (coarse.nx, coarse.ny) == (50, 40) and coarse.cell_size[:2] == (2.0, 2.0)
    assert coarse.xbound[:2] == GRID.xbound[:2] and coarse.zbound == GRID.zbound
    assert GRID.with_shape(GRID.shape) == GRID
    u, v = coarse.xy_to_cells(torch.tensor([-50.0, 0.0, 49.0]), torch.tensor([-40.0, 1.0, 39.5]))
    assert u.tolist() == [0.0, 25.0, 49.5] and v.tolist() == [0.0, 20.5, 39.75]


def test_regression_round_trip_recovers_the_boxes():
    boxes = boxes_on_map(200)
    labels = torch.arange(200) % 10
    row, col, ok = centre_cells(boxes, labels, GRID, 10)
    assert ok.all()
    regression = boxes_to_regression(boxes, row, col, GRID)
    assert regression.shape == (200, len(REGRESSION_CHANNELS))
    assert ((regression[:, :2] >= 0) & (regression[:, :2] < 1)).all()
    torch.testing.assert_close(regression_to_boxes(regression, row, col, GRID), boxes, atol=1e-4, rtol=1e-5)


def test_centre_cells_flags_what_cannot_be_encoded():
    boxes = boxes_on_map(6)
    boxes[1, 0] = 50.0  # on the upper x bound: off the map
    boxes[2, 4] = 0.0  # zero length
    boxes[3, 6] = float("nan")
    labels = torch.tensor([0, 0, 0, 0, 10, -1])
    row, col, ok = centre_cells(boxes, labels, GRID, 10)
    assert ok.tolist() == [True, False, False, False, False, False]
    assert row[0] == math.floor((boxes[0, 0] + 50) / 0.5) and col[0] == math.floor((boxes[0, 1] + 40) / 0.5)


def test_ground_truth_proposals_jitter_only_boxes_that_stay_on_the_map():
    boxes = [boxes_on_map(5, seed=1), torch.zeros(0, 9), boxes_on_map(2, seed=2)]
    boxes[2][1, 0] = 200.0  # far off the map, whatever the jitter
    boxes[0][0, 7:9] = float("nan")
    labels = [torch.arange(5), torch.zeros(0, dtype=torch.long), torch.tensor([3, 4])]
    a = ground_truth_proposals(boxes, labels, GRID, 10, torch.device("cpu"), torch.Generator().manual_seed(3))
    b = ground_truth_proposals(boxes, labels, GRID, 10, torch.device("cpu"), torch.Generator().manual_seed(3))
    assert torch.equal(a.boxes, b.boxes)
    assert a.valid.tolist() == [[True] * 5, [False] * 5, [True] + [False] * 4]
    assert a.scores.abs().sum() == 0 and a.labels[0].tolist() == [0, 1, 2, 3, 4] and a.labels[2, 0] == 3
    assert torch.isfinite(a.boxes).all() and a.boxes[0, 0, 7:9].tolist() == [0.0, 0.0]
    shift = (a.boxes[0, :, :2] - boxes[0][:, :2]).norm(dim=1)
    assert (shift > 0).all() and (shift < 3.0).all()
    torch.testing.assert_close(a.boxes[0, 1:, 7:9], boxes[0][1:, 7:9])
    assert (a.boxes[0, :, 3:6] / boxes[0][:, 3:6]).sub(1).abs().max() < 0.6


def test_box_corners_are_the_devkit_corners_bottom_face_first_front_left_first():
    from nuscenes.utils.data_classes import Box
    from pyquaternion import Quaternion

    rng = np.random.default_rng(0)
    boxes = np.concatenate([rng.uniform(-30, 30, (20, 3)), rng.uniform(0.5, 8, (20, 3)),
                            rng.uniform(-math.pi, math.pi, (20, 1)), rng.normal(size=(20, 2))], 1)
    corners = box_corners(boxes)
    assert corners.shape == (20, 8, 3) and box_corners(np.zeros((0, 9))).shape == (0, 8, 3)
    for box, ours in zip(boxes, corners):
        devkit = Box(box[:3], box[3:6], Quaternion(axis=[0, 0, 1], angle=box[6])).corners().T
        # the devkit lists front-left-top, front-right-top, front-right-bottom, front-left-bottom, then the rear
        np.testing.assert_allclose(ours, devkit[[3, 7, 6, 2, 0, 4, 5, 1]], atol=1e-9)
    np.testing.assert_allclose(box_footprints(boxes[:, :2], boxes[:, 3:5], boxes[:, 6]), corners[:, :4, :2])


def test_apply_residuals_moves_only_the_chosen_parts():
    proposals = boxes_on_map(50, seed=3)
    targets = boxes_on_map(50, seed=4)
    residuals = box_residuals(proposals, targets)

    def same_yaw(a, b):  # equal modulo 2 pi
        return (torch.remainder(a - b + math.pi, 2 * math.pi) - math.pi).abs().max() < 1e-4

    keep = [0, 1, 2, 3, 4, 5, 7, 8]
    every = apply_residuals(proposals, residuals)
    torch.testing.assert_close(every[:, keep], targets[:, keep], atol=1e-4, rtol=1e-5)
    assert same_yaw(every[:, 6], targets[:, 6])
    # the yaw alone: every other value stays the proposal's, the yaw is the target's
    yaw_only = apply_residuals(proposals, residuals, ("yaw",))
    torch.testing.assert_close(yaw_only[:, keep], proposals[:, keep])
    assert same_yaw(yaw_only[:, 6], targets[:, 6])
    centre_size = apply_residuals(proposals, residuals, ("centre", "size"))
    torch.testing.assert_close(centre_size[:, :6], targets[:, :6], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(centre_size[:, 6:], proposals[:, 6:])
    torch.testing.assert_close(apply_residuals(proposals, residuals, ()), proposals)
    with pytest.raises(ValueError, match="unknown parts \\['heading'\\]"):
        apply_residuals(proposals, residuals, ("yaw", "heading"))
