"""The second stage's camera cues (lss.models.heads.camera_cues: detection.refine_depth and refine_image): the
projection equals the numpy ego_to_pixels and is unchanged by the BEV augmentation, the depth cues read the depth
distribution at the pixel a box's centre projects to (values against a hand-made distribution), the image features
read the context features at each box point's pixel (values against a ramp, averaged over the cameras), gradients
reach only the cells around those pixels, and clear errors when the cues, the cameras or the second stage are
missing."""
import math

import numpy as np
import pytest
import torch

from lss.config import Config, ConfigError, validate
from lss.data.bev_augmentation import BevAugmentation
from lss.geometry import NUSCENES_CAMERAS, BevGrid, ego_to_pixels, frustum, load_nuscenes_rig, project_to_cameras
from lss.geometry.proposals import Proposals
from lss.models.heads.camera_cues import CUE_CHANNELS, depth_cues, image_features
from lss.models.heads.box_refiner import BoxRefiner
from lss.models.heads.detection import DetectionHead

FINAL_DIM, DOWNSAMPLE, DBOUND = (128, 352), 16, (4.0, 45.0, 1.0)
FRONT = NUSCENES_CAMERAS.index("CAM_FRONT")


def rig(batch: int = 1, post_scale: float = 0.22):
    """The real nuScenes rig as a batch: K, rot, trans from the rig file, an image resize by post_scale and a crop."""
    K, rot, trans = (torch.as_tensor(np.asarray(a), dtype=torch.float32) for a in load_nuscenes_rig())
    N = len(K)
    post_rot = torch.diag(torch.tensor([post_scale, post_scale, 1.0])).expand(N, 3, 3).clone()
    post_trans = torch.tensor([0.0, -46.0, 0.0]).expand(N, 3).clone()
    out = {"intrinsics": K, "sensor2ego_rot": rot, "sensor2ego_trans": trans, "post_rot": post_rot,
           "post_trans": post_trans}
    return {k: v.unsqueeze(0).expand(batch, *v.shape).clone() for k, v in out.items()}


def test_projection_equals_ego_to_pixels_and_survives_the_bev_augmentation():
    calib = rig()
    g = torch.Generator().manual_seed(0)
    points = (torch.rand(1, 40, 3, generator=g) - 0.5) * torch.tensor([80.0, 80.0, 4.0])
    pixels, depth = project_to_cameras(points, *(calib[k] for k in ("intrinsics", "sensor2ego_rot",
                                                                   "sensor2ego_trans", "post_rot", "post_trans")))
    assert pixels.shape == (1, 6, 40, 2) and depth.shape == (1, 6, 40)
    for n in range(6):
        expected, z = ego_to_pixels(points[0].numpy(), *(calib[k][0, n].numpy() for k in (
            "intrinsics", "sensor2ego_rot", "sensor2ego_trans", "post_rot", "post_trans")))
        np.testing.assert_allclose(depth[0, n].numpy(), z, rtol=1e-4, atol=1e-3)
        ahead = z > 1.0
        np.testing.assert_allclose(pixels[0, n].numpy()[ahead], expected[ahead], rtol=1e-4, atol=2e-2)
    # a similarity of the ego frame (rotation, scale, one mirror) moves points and extrinsics alike: same pixels
    aug = BevAugmentation(rotate=17.0, scale=1.04, flip_y=True)
    rot, trans = aug.apply_to_extrinsics(calib["sensor2ego_rot"][0].numpy(), calib["sensor2ego_trans"][0].numpy())
    moved = torch.as_tensor(points[0].numpy().astype(np.float64) @ aug.matrix().T, dtype=torch.float32)[None]
    again, depth_again = project_to_cameras(moved, calib["intrinsics"], torch.as_tensor(rot)[None],
                                            torch.as_tensor(trans)[None], calib["post_rot"], calib["post_trans"])
    torch.testing.assert_close(depth_again, depth, rtol=1e-4, atol=1e-3)
    seen = depth > 1.0
    torch.testing.assert_close(again[seen], pixels[seen], rtol=1e-4, atol=2e-2)


def one_hot_depth(at_m: float, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth distributions B x 6 x D x fH x fW with all mass in the bin of `at_m` metres, and the frustum."""
    f = frustum(FINAL_DIM, DOWNSAMPLE, DBOUND, "centres")
    D, fH, fW = f.shape[:3]
    depth = torch.zeros(batch, 6, D, fH, fW)
    depth[:, :, int((at_m - DBOUND[0]) / DBOUND[2])] = 1.0
    return depth, f


def test_the_cues_read_the_distribution_where_the_box_centre_projects():
    calib = rig()
    depth, f = one_hot_depth(20.0)
    # the front camera looks along ego x: boxes ahead at 12 and 30 m, one behind-left, one invalid slot
    boxes = torch.zeros(1, 4, 9)
    boxes[0, :, 3:6] = torch.tensor([1.9, 4.5, 1.6])
    boxes[0, 0, :3] = torch.tensor([12.0, 0.5, 0.8])
    boxes[0, 1, :3] = torch.tensor([30.0, -1.0, 0.8])
    boxes[0, 2, :3] = torch.tensor([-20.0, 6.0, 0.8])
    boxes[0, 3, :3] = torch.tensor([15.0, 0.0, 0.8])
    valid = torch.tensor([[True, True, True, False]])
    cues = depth_cues(boxes, valid, {"depth": depth, "frustum": f, **calib})
    assert cues.shape == (1, 4, CUE_CHANNELS)
    pixels, z = project_to_cameras(boxes[..., :3], *(calib[k] for k in (
        "intrinsics", "sensor2ego_rot", "sensor2ego_trans", "post_rot", "post_trans")))
    on_image = (z > 4.0) & (pixels[..., 0] >= 0) & (pixels[..., 0] <= 351) & (pixels[..., 1] >= 0) & (
        pixels[..., 1] <= 127)
    assert on_image[0, :, 3].any()  # the invalid slot's box is in view, and still reads nothing
    for p in range(3):
        assert cues[0, p, 0] == 1.0 and on_image[0, :, p].any()  # some camera sees it
    # the front box: CAM_FRONT alone sees it, at about its x
    assert on_image[0, :, 0].tolist() == [n == FRONT for n in range(6)]
    front = z[0, FRONT, 0]
    assert abs(float(front) - 12.0) < 2.0
    assert math.isclose(float(cues[0, 0, 1]), float(20.0 - front), abs_tol=0.05)  # expected depth 20 m minus its own
    assert float(cues[0, 0, 2]) == 0.0  # no mass within 1 m of the box
    ray = boxes[0, 0, :2] - calib["sensor2ego_trans"][0, FRONT, :2]
    ray = ray / ray.norm()
    torch.testing.assert_close(cues[0, 0, 3:5], ray, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cues[0, 0, 5:7], cues[0, 0, 1] * ray, atol=1e-3, rtol=1e-4)
    # at the box's own depth the distribution has all its mass near it: difference about 0, near mass 1
    at_box, _ = one_hot_depth(float(front))
    near = depth_cues(boxes, valid, {"depth": at_box, "frustum": f, **calib})
    assert abs(float(near[0, 0, 1])) <= 1.0 and float(near[0, 0, 2]) == pytest.approx(1.0, abs=1e-5)
    # the invalid slot reads nothing
    assert torch.equal(cues[0, 3], torch.zeros(CUE_CHANNELS))


def test_gradients_reach_only_the_cells_around_the_projected_centre():
    calib = rig()
    depth, f = one_hot_depth(20.0)
    depth = (depth * 0.5 + 0.5 / depth.shape[2]).requires_grad_(True)
    boxes = torch.zeros(1, 2, 9)
    boxes[0, :, 3:6] = torch.tensor([1.9, 4.5, 1.6])
    boxes[0, 0, :3] = torch.tensor([15.0, 0.0, 0.5])
    boxes[0, 1, :3] = torch.tensor([float("nan"), 0.0, 0.5])  # a non-finite slot marked valid: no NaN anywhere
    cues = depth_cues(boxes, torch.tensor([[True, True]]), {"depth": depth, "frustum": f, **calib})
    assert torch.isfinite(cues).all() and cues[0, 1].abs().sum() == 0
    cues[..., 1:3].sum().backward()
    grad = depth.grad[0].abs().sum(1)  # N x fH x fW
    touched = grad.nonzero()
    assert torch.isfinite(depth.grad).all() and len(touched) and len(touched) <= 4  # one bilinear footprint
    assert set(touched[:, 0].tolist()) == {FRONT}  # in CAM_FRONT only


@pytest.mark.parametrize("setting, reads, what", [
    ("refine_depth", {"camera_depth": True}, "depth cues B x P x 7"),
    ("refine_image", {"image_channels": 4}, "image features B x P x 25"),  # 5 points x (4 channels + seen)
    ("refine_motion", {"motion": True}, "depth cues B x P x 7"),  # the previous frame's cameras
])
def test_missing_camera_reads_and_bad_settings_have_clear_errors(setting, reads, what):
    grid = BevGrid((-10.0, 10.0, 0.5), (-10.0, 10.0, 0.5), (-10.0, 10.0, 20.0))
    refiner = BoxRefiner(8, 10, hidden=16, **reads)
    assert refiner.mlp[0].in_features == 8 * 5 + 10 + 9 + int(what.split()[-1])
    proposals = Proposals.zeros(1, 3, torch.device("cpu"))
    with pytest.raises(ValueError, match=f"needs the proposals' {what}"):
        refiner(torch.zeros(1, 8, 40, 40), proposals, grid)
    config = Config()
    config.detection.refine = True
    setattr(config.detection, setting, True)
    config.detection.head_channels, config.detection.refine_hidden = 8, 16
    head = DetectionHead(8, config.detection, grid, image_channels=4).eval()
    if setting == "refine_image":  # without the features' width the stage would ignore them
        with pytest.raises(ValueError, match="pass their channel count as image_channels"):
            DetectionHead(8, config.detection, grid)
    for cameras in (None, {"frustum": torch.zeros(1)}):
        with pytest.raises(ValueError, match=f"{setting} reads the cameras"):
            head(torch.zeros(1, 8, 40, 40), cameras=cameras)
    config.detection.refine = False
    with pytest.raises(ConfigError, match=f"{setting}: true feeds the second stage, which is off"):
        validate(config)


def test_maps_of_another_size_than_the_frustum_are_refused():
    depth, f = one_hot_depth(20.0)
    with pytest.raises(ValueError, match="the camera encoder's maps must be the splat's"):
        depth_cues(torch.zeros(1, 2, 9), torch.ones(1, 2, dtype=torch.bool),
                   {"depth": depth[..., :-1], "frustum": f, **rig()})
    with pytest.raises(ValueError, match="the camera encoder's maps must be the splat's"):
        image_features(torch.zeros(1, 2, 5, 3), torch.ones(1, 2, dtype=torch.bool),
                       {"context": torch.zeros(1, 6, 4, 3, 3), "frustum": f, **rig()})



def ramp_context(batch: int = 1, channels: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Context features B x 6 x C x fH x fW that are linear in the feature cell: channel 0 the column, 1 the row, 2
    the camera's index (bilinear reads of them are exact), and the frustum."""
    f = frustum(FINAL_DIM, DOWNSAMPLE, DBOUND, "centres")
    fH, fW = f.shape[1:3]
    context = torch.zeros(batch, 6, channels, fH, fW)
    context[:, :, 0] = torch.arange(fW, dtype=torch.float32)
    context[:, :, 1] = torch.arange(fH, dtype=torch.float32)[:, None]
    context[:, :, 2] = torch.arange(6, dtype=torch.float32)[:, None, None]
    return context, f


def test_image_features_read_the_context_where_each_box_point_projects():
    from lss.geometry.boxes import BOX_POINTS, box_points

    calib = rig()
    context, f = ramp_context()
    boxes = torch.zeros(1, 3, 9)
    boxes[0, :, 3:6] = torch.tensor([1.9, 4.5, 1.6])
    boxes[0, 0, :3] = torch.tensor([14.0, 0.5, 0.8])  # ahead: CAM_FRONT alone
    boxes[0, 0, 6] = 0.3
    boxes[0, 1, :3] = torch.tensor([0.0, 0.0, 60.0])  # far above the rig: no camera sees it
    boxes[0, 2, :3] = torch.tensor([15.0, 0.0, 0.8])  # in view but an invalid slot
    valid = torch.tensor([[True, True, False]])
    points = box_points(boxes)
    assert points.shape == (1, 3, len(BOX_POINTS), 3)
    # the centre, then the front face's middle: half a length along the heading, at the centre height
    torch.testing.assert_close(points[0, 0, 0], boxes[0, 0, :3])
    heading = torch.tensor([math.cos(0.3), math.sin(0.3), 0.0])
    torch.testing.assert_close(points[0, 0, 1], boxes[0, 0, :3] + 2.25 * heading)
    read = image_features(points, valid, {"context": context, "frustum": f, **calib})
    C = context.shape[2]
    assert read.shape == (1, 3, len(BOX_POINTS) * (C + 1))
    read = read.view(1, 3, len(BOX_POINTS), C + 1)
    pixels, z = project_to_cameras(points[0, 0][None], *(calib[k] for k in (
        "intrinsics", "sensor2ego_rot", "sensor2ego_trans", "post_rot", "post_trans")))
    u, v = f[0, 0, :, 0], f[0, :, 0, 1]
    for k in range(len(BOX_POINTS)):
        col = (pixels[0, FRONT, k, 0] - u[0]) / (u[1] - u[0])
        row = (pixels[0, FRONT, k, 1] - v[0]) / (v[1] - v[0])
        expected = torch.stack([col, row, torch.tensor(float(FRONT)), torch.tensor(1.0)])
        torch.testing.assert_close(read[0, 0, k], expected, atol=1e-3, rtol=1e-4)
    # the five points fall on different pixels: the front and rear faces are told apart
    assert (read[0, 0, 1, :2] - read[0, 0, 2, :2]).abs().max() > 1.0
    assert torch.equal(read[0, 1], torch.zeros(len(BOX_POINTS), C + 1))  # unseen: zeros and seen 0
    assert torch.equal(read[0, 2], torch.zeros(len(BOX_POINTS), C + 1))  # invalid slot


def test_image_features_average_over_the_cameras_and_pass_gradients_only_there():
    from lss.geometry.boxes import box_points

    calib = rig()
    context, f = ramp_context()
    context.requires_grad_(True)
    boxes = torch.zeros(1, 1, 9)
    boxes[0, 0, 3:6] = torch.tensor([1.9, 4.5, 1.6])
    boxes[0, 0, :3] = torch.tensor([12.0, 5.5, 0.8])  # ahead-left: CAM_FRONT and CAM_FRONT_LEFT overlap there
    points = box_points(boxes)[:, :, :1]  # the centre alone
    read = image_features(points, torch.tensor([[True]]), {"context": context, "frustum": f, **calib})
    pixels, z = project_to_cameras(points[:, 0], *(calib[k] for k in (
        "intrinsics", "sensor2ego_rot", "sensor2ego_trans", "post_rot", "post_trans")))
    fH, fW = f.shape[1:3]
    u, v = f[0, 0, :, 0], f[0, :, 0, 1]
    col, row = (pixels[..., 0] - u[0]) / (u[1] - u[0]), (pixels[..., 1] - v[0]) / (v[1] - v[0])
    seen = ((z > DBOUND[0]) & (col >= 0) & (col <= fW - 1) & (row >= 0) & (row <= fH - 1))[0, :, 0]
    assert int(seen.sum()) == 2, seen  # two cameras: the read is their mean
    cams = seen.nonzero()[:, 0].float()
    torch.testing.assert_close(read[0, 0, 2], cams.mean())
    torch.testing.assert_close(read[0, 0, 0], col[0, seen, 0].mean(), atol=1e-3, rtol=1e-4)
    assert float(read.detach()[0, 0, 3]) == 1.0
    read[0, 0, :3].sum().backward()
    touched = context.grad[0].abs().sum(1).nonzero()  # N x fH x fW cells with a gradient
    assert set(touched[:, 0].tolist()) == set(seen.nonzero()[:, 0].tolist())
    assert len(touched) <= 8  # one bilinear footprint per camera
