"""detection.refine_motion: the second stage also reads the previous frame's depth distributions where each box's
centre projects into the previous frame's cameras, moved into the current ego frame by the ego motion
(lss.geometry.ego_motion.previous_rig). A static point projects through that rig to where the previous cameras saw
it; a box that stood still reads a surface at its own depth, one that moved along the ray reads the distance it
moved; the model passes the previous frame's own depth (images or streamed features) after this frame's cues, the
refiner's inputs widen by those channels and learn from them on the tiny set; settings without two frames or without
the second stage are refused."""
import math

import pytest
import torch

from lss.config import ConfigError, config_from_dict, validate
from lss.data import NuScenesBEV, collate
from lss.geometry import RIG_KEYS, project_to_cameras
from lss.geometry.ego_motion import previous_rig
from lss.models.build import build_model
from lss.models.heads import detection as detection_module
from lss.models.heads.camera_cues import CUE_CHANNELS, depth_cues
from lss.models.losses import TotalLoss
from test_camera_cues import FRONT, one_hot_depth, rig
from test_temporal_model import SMALL, VERSION, previous_of, rig_batch


def ego_motion(yaw_deg: float, forward: float, left: float = 0.0) -> torch.Tensor:
    """Previous ego frame -> current ego frame of an ego that drove `forward` / `left` metres and turned `yaw_deg`:
    a static point's coordinates move the other way."""
    yaw = math.radians(yaw_deg)
    rot = torch.tensor([[math.cos(yaw), -math.sin(yaw), 0.0], [math.sin(yaw), math.cos(yaw), 0.0], [0.0, 0.0, 1.0]])
    motion = torch.eye(4)
    motion[:3, :3] = rot.T
    motion[:3, 3] = -(rot.T @ torch.tensor([forward, left, 0.0]))
    return motion[None]


def previous_batch(motion: torch.Tensor) -> dict:
    calib = rig()
    return {**calib, **{f"prev_{k}": calib[k] for k in RIG_KEYS}, "ego_motion": motion}


def project(points: torch.Tensor, calib: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return project_to_cameras(points, *(calib[k] for k in RIG_KEYS))


def test_a_static_point_projects_where_the_previous_cameras_saw_it():
    motion = ego_motion(8.0, forward=3.0, left=0.4)
    g = torch.Generator().manual_seed(0)
    seen_before = (torch.rand(1, 30, 3, generator=g) - 0.5) * torch.tensor([60.0, 60.0, 3.0])  # previous ego frame
    now = seen_before @ motion[0, :3, :3].T + motion[0, :3, 3]  # the same world points in the current ego frame
    moved_rig = previous_rig(previous_batch(motion), torch.device("cpu"))
    assert set(moved_rig) == set(RIG_KEYS) and all(v.dtype == torch.float32 for v in moved_rig.values())
    pixels, z = project(now, moved_rig)
    want_pixels, want_z = project(seen_before, rig())
    torch.testing.assert_close(z, want_z, atol=1e-3, rtol=1e-4)
    ahead = want_z > 1.0
    torch.testing.assert_close(pixels[ahead], want_pixels[ahead], atol=2e-2, rtol=1e-4)
    # not the current rig: the ego moved, so the previous cameras saw the points elsewhere
    assert not torch.allclose(project(now, rig())[1], want_z, atol=0.5)


def car_at(x: float, y: float) -> tuple[torch.Tensor, torch.Tensor]:
    boxes = torch.zeros(1, 1, 9)
    boxes[0, 0, :3] = torch.tensor([x, y, 0.8])
    boxes[0, 0, 3:6] = torch.tensor([1.9, 4.5, 1.6])
    return boxes, torch.ones(1, 1, dtype=torch.bool)


def test_the_previous_frame_cues_measure_how_far_a_box_moved_along_the_ray():
    motion = ego_motion(0.0, forward=3.0)  # the ego drove 3 m ahead between the frames
    previous = {"frustum": one_hot_depth(20.0)[1], **previous_rig(previous_batch(motion), torch.device("cpu"))}
    boxes, valid = car_at(12.0, 0.5)
    was_at = boxes[..., :3] @ motion[0, :3, :3] - motion[0, :3, 3] @ motion[0, :3, :3]  # in the previous ego frame
    assert float(was_at[0, 0, 0]) == pytest.approx(15.0, abs=1e-5)
    _, z_before = project(was_at, rig())
    depth_before = float(z_before[0, FRONT, 0])

    def cues(surface_m: float) -> torch.Tensor:  # the previous frame's cameras saw a surface at this depth
        return depth_cues(boxes, valid, {**previous, "depth": one_hot_depth(surface_m)[0]})[0, 0]

    standing = cues(depth_before)  # a parked car: where the previous frame saw it
    assert standing[0] == 1.0 and abs(float(standing[1])) <= 0.6 and float(standing[2]) == pytest.approx(1.0)
    approached = cues(depth_before + 5.0)  # it was 5 m farther along the ray: it came 5 m closer
    assert float(approached[1]) == pytest.approx(5.0, abs=0.6) and float(approached[2]) == 0.0
    torch.testing.assert_close(approached[5:7], approached[1] * approached[3:5], atol=1e-4, rtol=1e-4)
    # without the ego motion the parked car would seem to have moved by the ego's 3 m
    unmoved = {**previous, **rig(), "depth": one_hot_depth(depth_before)[0]}
    assert float(depth_cues(boxes, valid, unmoved)[0, 0, 1]) == pytest.approx(3.0, abs=0.6)


def motion_config(**detection):
    return config_from_dict({
        **SMALL,
        "model": {**SMALL["model"], "temporal": {"frames": 2}, "heads": ["segmentation", "detection"]},
        "detection": {"refine": True, "refine_motion": True, "head_channels": 16, "refine_hidden": 32,
                      "refine_proposals": 16, **detection},
    })


def test_settings_without_two_frames_or_the_second_stage_are_refused():
    cfg = motion_config()
    cfg.model.temporal.frames = 1
    with pytest.raises(ConfigError, match="refine_motion: true reads the previous frame's depth distributions; "
                                          "set model.temporal.frames: 2"):
        validate(cfg)
    with pytest.raises(ConfigError, match="refine_motion: true feeds the second stage, which is off"):
        motion_config(refine=False)


def test_the_model_reads_the_previous_frames_own_depth_after_this_frames_cues(monkeypatch):
    torch.manual_seed(0)
    model = build_model(motion_config(refine_depth=True)).eval()
    geometry = model.detection.refiner.mlp[0].in_features - 16 * 5  # the pooled BEV reads: 16 channels x 5 points
    assert geometry == 10 + 9 + 2 * CUE_CHANNELS
    batch = previous_of(rig_batch(), forward=4.0)
    read = []
    monkeypatch.setattr(detection_module, "depth_cues",
                        lambda boxes, valid, cameras: read.append(cameras) or depth_cues(boxes, valid, cameras))
    with torch.no_grad():
        outputs = model(batch)
        prev_depth, _ = model.camera(batch["prev_images"].flatten(0, 1))
    assert len(read) == 2 and "previous" in read[0] and read[1] is read[0]["previous"]
    torch.testing.assert_close(read[0]["depth"], outputs["camera_depth"])  # this frame's cameras first
    torch.testing.assert_close(read[1]["depth"], prev_depth.unflatten(0, (1, 2)))
    want = previous_rig(batch, torch.device("cpu"))
    for key in RIG_KEYS:
        torch.testing.assert_close(read[1][key], want[key])
    assert float(read[1]["sensor2ego_trans"][0, 0, 0] - batch["sensor2ego_trans"][0, 0, 0]) == pytest.approx(-4.0)
    # streamed: the previous frame's features instead of its images give the same boxes and scores
    streamed = {k: v for k, v in batch.items() if k != "prev_images"}
    streamed["prev_depth"], streamed["prev_context"] = model.previous_features(batch)
    with torch.no_grad():
        again = model(streamed)
    torch.testing.assert_close(again["det_refine_scores"], outputs["det_refine_scores"])
    torch.testing.assert_close(again["det_refine_residuals"], outputs["det_refine_residuals"])


@pytest.mark.slow
def test_the_refiner_learns_from_the_previous_frames_cues_on_the_tiny_set(synthetic_root):
    cfg = motion_config()
    cfg.data.dataroot, cfg.data.resize_lim, cfg.data.detection_targets = str(synthetic_root), (0.45, 0.55), True
    cfg = validate(cfg)
    dataset = NuScenesBEV(synthetic_root, VERSION, "train", cfg, is_train=True, verbose=False)
    batch = collate([dataset[1], dataset[2]])
    assert not torch.equal(batch["prev_images"], batch["images"])  # samples with a previous frame
    torch.manual_seed(0)
    model = build_model(cfg).train()
    loss_fn = TotalLoss(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):
        optimizer.zero_grad()
        losses = loss_fn(model(batch), batch)
        losses["loss"].backward()
        assert torch.isfinite(losses["loss"]) and float(losses["loss/det_refine_score"]) > 0
        # the last CUE_CHANNELS inputs of the refiner's first layer are the previous frame's cues
        motion_grad = model.detection.refiner.mlp[0].weight.grad[:, -CUE_CHANNELS:]
        assert float(motion_grad.abs().sum()) > 0
        optimizer.step()
