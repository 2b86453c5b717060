"""detection.refine_motion_grid: the second stage reads both frames' splatted grids around each proposal, this
frame's at the box's centre and face middles and the previous frame's where those points were one frame interval
before if the box moved at its velocity, and where they were if it moved the other way. The reads land on the right
cells (an unknown velocity reads as standing still), the model passes its own two splatted grids and the refiner's
inputs widen by the embedded reads, the settings are checked and fixed in checkpoints, and with the reads the
reversal logit learns which way a moving object faces from grids that do not show its front."""
import math

import pytest
import torch

from lss.config import Config, ConfigError, config_to_dict, validate
from lss.engine.checkpoint import config_mismatches
from lss.geometry import BevGrid
from lss.geometry.boxes import BOX_POINTS
from lss.geometry.ego_motion import KEY_FRAME_INTERVAL
from lss.models.build import build_model
from lss.models.heads import detection as detection_module
from lss.models.heads.box_refiner import MOTION_EMBED, MOTION_READS, motion_reads, read_grid
from lss.models.heads.detection import DetectionHead
from test_motion_cues import motion_config
from test_reversal import reversal_calls, reversal_config
from test_temporal_model import previous_of, rig_batch

GRID = BevGrid.from_config(reversal_config().grid)  # 16 m at 0.5 m: 32 x 32 cells


def _cell_values(channels=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, channels, GRID.nx, GRID.ny, generator=g)


def _centre(i: int, j: int) -> tuple[float, float]:
    """Ego x, y of cell (i, j)'s centre."""
    return -8.0 + (i + 0.5) * 0.5, -8.0 + (j + 0.5) * 0.5


def test_a_grid_is_read_at_cell_centres_and_bilinearly_between_them():
    bev = _cell_values()
    points = torch.tensor([[_centre(3, 5), _centre(10, 2)], [_centre(0, 31), _centre(31, 0)]])  # B x 2 x 2
    got = read_grid(bev, points, GRID)
    assert got.shape == (2, 2, 3)
    for b, cells in enumerate([((3, 5), (10, 2)), ((0, 31), (31, 0))]):
        for k, (i, j) in enumerate(cells):
            torch.testing.assert_close(got[b, k], bev[b, :, i, j])
    # half-way between the centres of cells (4, 7) and (5, 7): their mean; off the map: zero
    between = torch.tensor([[[(_centre(4, 7)[0] + _centre(5, 7)[0]) / 2, _centre(4, 7)[1]], [40.0, 0.0]]])
    got = read_grid(bev[:1], between, GRID)
    torch.testing.assert_close(got[0, 0], (bev[0, :, 4, 7] + bev[0, :, 5, 7]) / 2)
    torch.testing.assert_close(got[0, 1], torch.zeros(3))


def test_the_previous_grid_is_read_where_the_box_was_and_where_it_would_have_been():
    current, previous = _cell_values(seed=1), _cell_values(seed=2)
    x, y = _centre(16, 16)
    # heading 0 (along x), 4 m/s along x and 2 m/s along y: one interval of 0.5 s shifts the points by (2, 1) m
    boxes = torch.tensor([[[x, y, 0.5, 2.0, 2.0, 1.5, 0.0, 4.0, 2.0]], [[x, y, 0.5, 2.0, 2.0, 1.5, 0.0, 0.0, 0.0]]])
    reads = motion_reads(current, previous, boxes, GRID, interval=0.5)
    assert reads.shape == (2, 1, MOTION_READS, len(BOX_POINTS), 3)
    for k, (along, across) in enumerate(BOX_POINTS):  # box 2 m x 2 m, heading 0: the points 1 m from the centre
        i, j = 16 + int(2 * along), 16 + int(2 * across)
        torch.testing.assert_close(reads[0, 0, 0, k], current[0, :, i, j])
        torch.testing.assert_close(reads[0, 0, 1, k], previous[0, :, i - 4, j - 2])  # where it was
        torch.testing.assert_close(reads[0, 0, 2, k], previous[0, :, i + 4, j + 2])  # moving the other way
        # standing still: both previous reads at the points themselves
        torch.testing.assert_close(reads[1, 0, 1, k], previous[1, :, i, j])
        torch.testing.assert_close(reads[1, 0, 2, k], previous[1, :, i, j])
    # an unknown velocity reads as standing still
    unknown = boxes.clone()
    unknown[1, 0, 7:9] = float("nan")
    torch.testing.assert_close(motion_reads(current, previous, unknown, GRID, 0.5), reads)
    with pytest.raises(ValueError, match="both frames are splatted into the same grid"):
        motion_reads(current, previous[..., :-1], boxes, GRID, 0.5)


def test_the_settings_are_checked_and_fixed_in_checkpoints():
    cfg = motion_config(refine_motion=False, refine_motion_grid=True)
    cfg.model.temporal.frames = 1
    with pytest.raises(ConfigError, match="refine_motion_grid: true reads the previous frame's splatted grid; "
                                          "set model.temporal.frames: 2"):
        validate(cfg)
    with pytest.raises(ConfigError, match="refine_motion_grid: true feeds the second stage, which is off"):
        motion_config(refine=False, refine_motion=False, refine_motion_grid=True)
    found = config_mismatches({"config": config_to_dict(motion_config(refine_motion_grid=True))}, motion_config())
    assert ("detection.refine_motion_grid", True, False) in found
    config = Config()
    config.detection.refine, config.detection.refine_motion_grid = True, True
    with pytest.raises(ValueError, match="pass their channel count as grid_channels"):
        DetectionHead(8, config.detection, GRID)
    head = DetectionHead(8, config.detection, GRID, grid_channels=3)
    with pytest.raises(ValueError, match=r"pass frames=\(this frame's, the previous frame's\)"):
        head(torch.randn(1, 8, GRID.nx, GRID.ny))


def test_the_model_reads_its_own_two_splatted_grids(monkeypatch):
    torch.manual_seed(0)
    cfg = motion_config(refine_motion=False, refine_motion_grid=True)
    model = build_model(cfg).eval()
    refiner = model.detection.refiner
    widths = refiner.mlp[0].in_features - 16 * len(BOX_POINTS)  # the pooled BEV reads: 16 channels x 5 points
    assert widths == 10 + 9 + MOTION_READS * len(BOX_POINTS) * MOTION_EMBED
    assert model.detection.motion_interval == KEY_FRAME_INTERVAL * cfg.model.temporal.gap
    batch = previous_of(rig_batch(), forward=4.0)
    seen = []
    real_reads = detection_module.motion_reads
    monkeypatch.setattr(detection_module, "motion_reads",
                        lambda *args: seen.append(args) or real_reads(*args))
    with torch.no_grad():
        outputs = model(batch)
        lut = model.splat.lut(batch)
        want_current = model.splat(outputs["camera_depth"], outputs["camera_context"], lut)
        prev_depth, prev_context = model.previous_features(batch)
    (current, previous, boxes, grid, interval), = seen
    torch.testing.assert_close(current, want_current)
    assert current.shape == previous.shape and not torch.allclose(current, previous)
    assert refiner.motion_embed.in_features == current.shape[1]
    assert boxes is outputs["det_proposals"].boxes and interval == 0.5 and (grid.nx, grid.ny) == current.shape[-2:]
    # streamed: the previous frame's features instead of its images give the same reads and boxes
    streamed = {k: v for k, v in batch.items() if k != "prev_images"}
    streamed["prev_depth"], streamed["prev_context"] = prev_depth, prev_context
    with torch.no_grad():
        again = model(streamed)
    torch.testing.assert_close(seen[1][1], previous)
    torch.testing.assert_close(again["det_refine_residuals"], outputs["det_refine_residuals"])
    # training: the embedding of the reads gets gradients, and through the reads this frame's splat does
    model.train()
    outputs = model(batch)
    (outputs["det_refine_scores"].sum() + outputs["det_refine_residuals"].sum()).backward()
    assert float(refiner.motion_embed.weight.grad.abs().sum()) > 0


def _moving_scene(g: torch.Generator, channels: int = 4):
    """Three objects of random headings moving 4-8 m/s along them, on grids that show each object's footprint (the
    same from the front and the back) where it is now and where it was 0.5 s before, beside noise; the BEV features
    of the first stage are noise only."""
    yaw = (torch.rand(3, generator=g) * 2 - 1) * math.pi
    speed = 4.0 + 4.0 * torch.rand(3, generator=g)
    boxes = torch.tensor([[3.0, -2.0, 0.4, 1.0, 1.0, 1.6, 0.0, 0, 0], [-4.0, 3.5, 0.8, 1.0, 1.0, 1.8, 0.0, 0, 0],
                          [-1.0, -4.5, 0.6, 1.0, 1.0, 1.7, 0.0, 0, 0]])
    boxes[:, 6], boxes[:, 7], boxes[:, 8] = yaw, speed * torch.cos(yaw), speed * torch.sin(yaw)
    cx, cy = torch.meshgrid(torch.arange(32) * 0.5 - 7.75, torch.arange(32) * 0.5 - 7.75, indexing="ij")

    def footprints(at):
        return sum(torch.exp(-((cx - x) ** 2 + (cy - y) ** 2)) for x, y in at.tolist())

    now, before = footprints(boxes[:, :2]), footprints(boxes[:, :2] - 0.5 * boxes[:, 7:9])
    current = torch.cat([now[None], torch.randn(channels - 1, 32, 32, generator=g) * 0.1])[None]
    previous = torch.cat([before[None], torch.randn(channels - 1, 32, 32, generator=g) * 0.1])[None]
    features = torch.randn(1, 8, 32, 32, generator=g) * 0.1
    return features, (current, previous), [boxes], [torch.tensor([0, 1, 0])]


@pytest.mark.parametrize("reads", [True, False])
def test_with_the_motion_reads_the_reversal_logit_learns_which_way_a_moving_object_faces(reads):
    """The grids show where each object is and was, not its front: with the reads the reversal logit calls the
    turned-around copies of the truth (heading and velocity turned) and not the others; without them it cannot."""
    torch.manual_seed(0)
    config = reversal_config()
    config.model.temporal.frames, config.detection.refine_motion_grid = 2, reads
    validate(config)
    head = DetectionHead(8, config.detection, BevGrid.from_config(config.grid), grid_channels=4)

    def scene(g):
        features, frames, boxes, labels = _moving_scene(g)
        return features, {"frames": frames} if reads else {}, boxes, labels

    calls, truths = reversal_calls(head, config, scene, steps=300)
    assert 0.3 < truths.float().mean() < 0.7
    accuracy = (calls == truths).float().mean()
    assert accuracy > 0.9 if reads else accuracy < 0.75
