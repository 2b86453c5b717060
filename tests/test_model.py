"""LiftSplatShoot: shapes, gradients, splat implementations agree, device/dtype rules, config validation,
local ImageNet weights."""
import pytest
import torch
from efficientnet_pytorch import EfficientNet

from lss.config import ConfigError, load_config
from lss.models.depth_loss import depth_loss
from lss.geometry import image_augmentation, load_nuscenes_rig, val_augmentation
from lss.models import LiftSplatShoot
from lss.models.camera import CameraEncoder, EfficientNetTrunk

TINY = ["data.final_dim=[32, 96]", "grid.xbound=[-8.0, 8.0, 1.0]", "grid.ybound=[-8.0, 8.0, 1.0]",
        "grid.dbound=[4.0, 12.0, 2.0]", "model.context_channels=8", "data.classes=[vehicle, drivable_area]"]


def tiny_cfg(*extra):
    return load_config(None, TINY + list(extra))


def rig_batch(cfg, batch_size=2, seed=0):
    """Random images with the real nuScenes rig, intrinsics scaled from 1600x900 to final_dim."""
    g = torch.Generator().manual_seed(seed)
    h, w = cfg.data.final_dim
    K, rot, trans = load_nuscenes_rig(cfg.data.cameras)
    n = K.shape[0]
    # resize to the image width, keep the bottom rows
    post_rot, post_trans = image_augmentation(val_augmentation((1600, 900), (h, w), (0.0, 0.0)), (1600, 900), (h, w))
    expand = lambda t: t.unsqueeze(0).expand(batch_size, *t.shape).clone()  # noqa: E731
    return {
        "images": torch.randn(batch_size, n, 3, h, w, generator=g),
        "intrinsics": expand(K), "sensor2ego_rot": expand(rot), "sensor2ego_trans": expand(trans),
        "post_rot": expand(post_rot.expand(n, 3, 3)), "post_trans": expand(post_trans.expand(n, 3)),
        "targets": (torch.rand(batch_size, len(cfg.data.classes), 16, 16, generator=g) > 0.8).float(),
    }


class RigDataset(torch.utils.data.Dataset):
    """`length` items of `batch_fn(cfg, batch_size=1, seed=i)` (rig_batch's form), for train()."""

    def __init__(self, cfg, length, batch_fn=rig_batch):
        self.cfg, self.length, self.batch_fn = cfg, length, batch_fn

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return {k: v[0] for k, v in self.batch_fn(self.cfg, batch_size=1, seed=i).items()}


def test_forward_shapes_and_gradients_reach_both_encoders():
    cfg = tiny_cfg()
    model = LiftSplatShoot(cfg)
    batch = rig_batch(cfg)
    out = model(batch)["segmentation"]
    assert out.shape == (2, 2, 16, 16) and out.dtype == torch.float32 and torch.isfinite(out).all()
    out.square().mean().backward()
    for name in ("camera.head.weight", "camera.trunk.net._conv_stem.weight", "bev.stem.0.weight",
                 "segmentation.conv.weight"):
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_frustum_is_a_non_persistent_buffer_and_follows_the_module():
    model = LiftSplatShoot(tiny_cfg())
    assert "splat.frustum" not in model.state_dict()
    assert dict(model.named_buffers())["splat.frustum"].shape == (4, 2, 6, 3)
    model.to(torch.float64)
    assert model.splat.frustum.dtype == torch.float64  # cast with the module, but the LUT is built in float32


def test_bev_pool_and_reference_splat_agree():
    cfg = tiny_cfg()
    torch.manual_seed(0)
    ours = LiftSplatShoot(cfg).eval()
    ref = LiftSplatShoot(tiny_cfg("model.splat=reference")).eval()
    ref.load_state_dict(ours.state_dict())
    batch = rig_batch(cfg)
    with torch.no_grad():
        a, b = ours(batch)["segmentation"], ref(batch)["segmentation"]
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_channels_last_gives_the_same_output():
    cfg = tiny_cfg()
    model = LiftSplatShoot(cfg).eval()
    batch = rig_batch(cfg)
    with torch.no_grad():
        a = model(batch)["segmentation"]
        b = model.to(memory_format=torch.channels_last)(batch)["segmentation"]
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _conv_layouts(module):
    """{"channels_last", "contiguous"} of module's 4-D (convolution) weights whose layouts differ (more than one
    input channel, a spatial size above 1)."""
    return {"channels_last" if w.is_contiguous(memory_format=torch.channels_last) else "contiguous"
            for w in module.parameters() if w.dim() == 4 and w.shape[1] > 1 and w.shape[2] * w.shape[3] > 1}


@pytest.mark.parametrize("setting, camera, rest", [
    (True, {"channels_last"}, {"channels_last"}), (False, {"contiguous"}, {"contiguous"}),
    ("camera", {"channels_last"}, {"contiguous"}), ("bev", {"contiguous"}, {"channels_last"})])
def test_train_channels_last_converts_the_parts_it_names_and_keeps_the_output(setting, camera, rest):
    from lss.models.build import apply_channels_last

    cfg = tiny_cfg(f"train.channels_last={str(setting).lower()}")
    assert cfg.train.channels_last == setting
    model = LiftSplatShoot(cfg).eval()
    batch = rig_batch(cfg)
    with torch.no_grad():
        before = model(batch)["segmentation"]
        assert apply_channels_last(model, cfg.train.channels_last) is model
        after = model(batch)["segmentation"]
    assert _conv_layouts(model.camera) == camera
    assert set().union(*(_conv_layouts(m) for m in (model.bev, model.segmentation))) == rest
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_train_channels_last_of_a_part_needs_the_lss_model():
    from lss.models.build import apply_channels_last

    with pytest.raises(ConfigError, match="train.channels_last='bev' .* no camera encoder .* use true or false"):
        apply_channels_last(torch.nn.Sequential(torch.nn.Conv2d(3, 3, 3)), "bev")
    with pytest.raises(ConfigError, match="train.channels_last=2: expected true/false or 'camera', 'bev'"):
        tiny_cfg("train.channels_last=2")


def test_depth_is_a_distribution():
    enc = CameraEncoder(depth_bins=5, context_channels=3).eval()
    depth, context = enc(torch.randn(2, 3, 64, 64))
    assert depth.shape == (2, 5, 4, 4) and context.shape == (2, 3, 4, 4)
    torch.testing.assert_close(depth.sum(1), torch.ones(2, 4, 4))


@pytest.mark.parametrize("downsample, fine, coarse", [(8, 128, 256), (16, 256, 512)])
def test_the_resnet18_trunk_lifts_at_its_stride_and_reaches_the_bev_grid(downsample, fine, coarse):
    from lss.models.camera import ResNetTrunk

    trunk = ResNetTrunk(downsample).eval()
    a, b = trunk(torch.randn(2, 3, 64, 96))
    assert a.shape == (2, fine, 64 // downsample, 96 // downsample)
    assert b.shape == (2, coarse, 32 // downsample, 48 // downsample)
    cfg = tiny_cfg("model.backbone=resnet18", f"model.downsample={downsample}", "model.camera_channels=16")
    model = LiftSplatShoot(cfg)
    assert model.camera.fuse.conv[0].in_channels == fine + coarse and model.camera.head.in_channels == 16
    out = model(rig_batch(cfg))
    assert out["depth_logits"].shape == (2, 6, 4, 32 // downsample, 96 // downsample)
    out["segmentation"].square().mean().backward()
    for name in ("camera.trunk.stem.0.weight", "camera.head.weight", "bev.stem.0.weight"):
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_camera_trunk_strides_and_weights_are_checked_when_the_config_loads():
    with pytest.raises(ConfigError, match="model.downsample=8: the efficientnet-b0 camera encoder outputs stride 16$"):
        tiny_cfg("model.downsample=8")
    with pytest.raises(ConfigError, match="model.downsample=4: the resnet18 camera encoder outputs stride 8 or 16"):
        tiny_cfg("model.backbone=resnet18", "model.downsample=4")
    with pytest.raises(ConfigError, match="ImageNet weights are loaded for efficientnet-b0 only; set model.pretrained"):
        tiny_cfg("model.backbone=resnet18", "model.pretrained=imagenet")
    with pytest.raises(ConfigError, match="model.camera_channels"):
        tiny_cfg("model.camera_channels=0")


def test_depth_logits_are_exposed_and_the_depth_loss_trains_the_camera_encoder():
    cfg = tiny_cfg()
    model = LiftSplatShoot(cfg).eval()
    batch = rig_batch(cfg)
    out = model(batch)
    logits = out["depth_logits"]
    assert logits.shape == (2, 6, 4, 2, 6)  # B x N x D x fH x fW: 4 bins of 2 m, 32 x 96 input at stride 16
    depth, _ = model.camera(batch["images"].flatten(0, 1))
    torch.testing.assert_close(logits.flatten(0, 1).softmax(dim=1), depth)
    targets = torch.randint(-1, 4, (2, 6, 2, 6), generator=torch.Generator().manual_seed(0))
    depth_loss(out, targets).backward()
    params = dict(model.named_parameters())
    assert params["camera.head.weight"].grad.abs().sum() > 0
    assert params["camera.trunk.net._conv_stem.weight"].grad.abs().sum() > 0
    assert params["segmentation.conv.weight"].grad is None


def test_training_forward_with_and_without_ground_truth_boxes():
    cfg = tiny_cfg("model.heads=[segmentation, detection]", "detection.head_channels=8", "detection.refine=true",
                   "detection.refine_hidden=16", "detection.refine_proposals=4")
    model = LiftSplatShoot(cfg).train()
    batch = rig_batch(cfg)
    out = model(batch)  # no det_boxes: the second stage sees the first-stage proposals only
    assert out["det_proposals"].valid.shape[1] <= 4 and out["segmentation"].shape == (2, 2, 16, 16)
    batch["det_boxes"] = [torch.tensor([[2.0, -3.0, 0.0, 1.9, 4.4, 1.6, 0.3, 0.0, 0.0]]), torch.zeros(0, 9)]
    batch["det_labels"] = [torch.tensor([0]), torch.zeros(0, dtype=torch.long)]
    proposals = model(batch)["det_proposals"]
    assert proposals.valid[:, -1].tolist() == [True, False] and proposals.labels[0, -1] == 0
    assert (proposals.boxes[0, -1, :2] - batch["det_boxes"][0][0, :2]).norm() < 3.0
    assert model.eval()(batch)["det_proposals"].valid.shape[1] <= cfg.detection.max_detections


def test_checkpoint_with_the_old_segmentation_keys_loads_with_identical_outputs():
    from lss.engine.checkpoint import CheckpointError, load_model_state

    cfg = tiny_cfg()
    torch.manual_seed(0)
    model = LiftSplatShoot(cfg).eval()
    # The layout before the heads moved out of the BEV encoder: the 1 x 1 segmentation conv was bev.segmentation.
    old = {k.replace("segmentation.conv.", "bev.segmentation.", 1) if k.startswith("segmentation.conv.") else k: v
           for k, v in model.state_dict().items()}
    assert {"bev.segmentation.weight", "bev.segmentation.bias"} <= set(old)
    torch.manual_seed(1)
    fresh = LiftSplatShoot(cfg).eval()
    load_model_state(fresh, {"model": old})
    batch = rig_batch(cfg)
    with torch.no_grad():
        torch.testing.assert_close(fresh(batch)["segmentation"], model(batch)["segmentation"], rtol=0, atol=0)
    del old["bev.segmentation.bias"]
    with pytest.raises(CheckpointError, match="missing 1"):
        load_model_state(fresh, {"model": old})


@pytest.mark.parametrize("override, message", [
    ("data.final_dim=[40, 96]", "multiples of 32"),
    ("grid.xbound=[-5.0, 5.0, 1.0]", "multiples of 8"),
    ("model.heads=[segmentation, boxes]", "unknown head"),
    ("model.heads=[detection]", "segmentation head is required"),
    ("model.downsample=8", "stride 16"),
    ("model.splat=cuda_magic", "model.splat='cuda_magic'"),
    ("model.backbone=resnet50", "efficientnet-b0"),
])
def test_bad_model_config_is_rejected(override, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        LiftSplatShoot(tiny_cfg(override))


def test_bad_images_are_rejected():
    cfg = tiny_cfg()
    batch = rig_batch(cfg)
    batch["images"] = batch["images"][:, :, :2]
    with pytest.raises(ValueError, match="B x N x 3 x H x W"):
        LiftSplatShoot(cfg)(batch)


def test_pretrained_weights_load_from_a_local_file(tmp_path):
    source = EfficientNet.from_name("efficientnet-b0")
    path = tmp_path / "effb0.pth"
    torch.save(source.state_dict(), path)  # the layout of efficientnet-pytorch's ImageNet files (with _fc)
    model = LiftSplatShoot(tiny_cfg(f"model.pretrained={path}"))
    torch.testing.assert_close(model.camera.trunk.net._conv_stem.weight, source._conv_stem.weight)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        EfficientNetTrunk(pretrained=str(tmp_path / "missing.pth"))
    torch.save({"conv.weight": torch.zeros(1)}, path)
    with pytest.raises(ValueError, match="not an efficientnet-b0 state dict"):
        EfficientNetTrunk(pretrained=str(path))


def test_lut_is_built_in_float32_under_autocast():
    cfg = tiny_cfg()
    model = LiftSplatShoot(cfg)
    batch = rig_batch(cfg)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lut = model.splat.lut(batch)
        out = model(batch)["segmentation"]
    ref = model.splat.lut_cache.get(model.splat.frustum, *(batch[k] for k in (
        "intrinsics", "sensor2ego_rot", "sensor2ego_trans", "post_rot", "post_trans")), model.splat.grid)
    assert torch.equal(lut.point_cell, ref.point_cell)
    assert torch.isfinite(out.float()).all()


@pytest.mark.cuda
@pytest.mark.parametrize("extra", [(), ("model.bev_full_res_skip=true",)])
def test_cuda_bf16_forward_backward(extra):
    cfg = tiny_cfg(*extra)
    model = LiftSplatShoot(cfg).cuda().to(memory_format=torch.channels_last)
    batch = {k: v.cuda() for k, v in rig_batch(cfg).items()}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        outputs = model(batch)
        out = outputs["segmentation"]
        targets = torch.randint(-1, 4, (2, 6, 2, 6), device="cuda")
        depth = depth_loss(outputs, targets)
    assert depth.dtype == torch.float32 and torch.isfinite(depth)
    (out.float().mean() + depth).backward()
    assert torch.isfinite(out.float()).all() and model.camera.head.weight.grad is not None


def test_upsample_mode_reaches_every_decoder_upsampling_and_matches_f_interpolate():
    import torch.nn.functional as F

    from lss.models.blocks import Up
    from lss.ops import UpsampleBilinear

    model = LiftSplatShoot(tiny_cfg("model.upsample_mode=align_corners"))
    modes = [m.mode for m in model.modules() if isinstance(m, UpsampleBilinear)]
    assert len(modes) == 3 and set(modes) == {"align_corners"}  # camera fuse, BEV up1, BEV up2
    assert {m.mode for m in LiftSplatShoot(tiny_cfg()).modules()
            if isinstance(m, UpsampleBilinear)} == {"pytorch_half_pixel"}
    torch.manual_seed(0)
    up = Up(6, 4, scale_factor=2, upsample_mode="align_corners").eval()
    coarse, skip = torch.randn(2, 4, 5, 7), torch.randn(2, 2, 10, 14)
    expected = up.conv(torch.cat([skip, F.interpolate(coarse, scale_factor=2, mode="bilinear", align_corners=True)],
                                 dim=1))
    torch.testing.assert_close(up(coarse, skip), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="model.upsample_mode"):
        tiny_cfg("model.upsample_mode=nearest")


def test_full_res_skip_feeds_the_splatted_grid_to_the_last_upsampling_at_full_resolution():
    from lss.models.bev import BevEncoder
    from lss.models.blocks import Up

    torch.manual_seed(0)
    plain, skip = BevEncoder(8).eval(), BevEncoder(8, full_res_skip=True).eval()
    assert not isinstance(plain.up2, Up)
    assert isinstance(skip.up2, Up) and skip.up2.conv[0].in_channels == 8 + 256
    bev = torch.rand(2, 8, 32, 32)
    assert skip(bev).shape == plain(bev).shape == (2, BevEncoder.feature_channels, 32, 32)
    # with the upsampled features' weights at zero only the skip is left: two 3x3 convolutions at full
    # resolution, so one input cell moves the output in its 5 x 5 neighbourhood and nowhere else
    with torch.no_grad():
        skip.up2.conv[0].weight[:, 8:] = 0
        poked = bev.clone()
        poked[0, :, 9, 20] += 5.0
        moved = skip(poked) - skip(bev)
    changed = moved[0].abs().amax(dim=0) > 0
    assert changed[7:12, 18:23].all() and changed.sum() == 25
    assert torch.equal(moved[1], torch.zeros_like(moved[1]))


def test_full_res_skip_trains_from_the_config_and_its_checkpoints_keep_it(tmp_path):
    cfg = tiny_cfg("model.bev_full_res_skip=true")
    assert tiny_cfg().model.bev_full_res_skip is False
    model = LiftSplatShoot(cfg)
    out = model(rig_batch(cfg))["segmentation"]
    assert out.shape == (2, 2, 16, 16)
    out.square().mean().backward()
    weight = model.bev.up2.conv[0].weight  # its first 8 input channels are the splatted grid
    assert weight.grad[:, :8].abs().sum() > 0 and weight.grad[:, 8:].abs().sum() > 0
    # a checkpoint of the recipe before the skip: refused with what to do, loaded with the skip switched off
    refused_then_loaded(tmp_path, tiny_cfg(), cfg, r"does not fit this model: missing .*bev\.up2.*Use the config",
                        tiny_cfg("model.bev_full_res_skip=false"))
    with pytest.raises(ConfigError, match="model.bev_full_res_skip"):
        tiny_cfg("model.bev_full_res_skip=sometimes")


def refused_then_loaded(tmp_path, trained_cfg, other_cfg, match, fitting_cfg):
    """A checkpoint of a model built from `trained_cfg`: `other_cfg` refuses it with an error matching `match`,
    `fitting_cfg` loads it into a model with the same outputs."""
    from lss.engine.checkpoint import load_for_inference, save_checkpoint
    from lss.errors import CheckpointError

    trained = LiftSplatShoot(trained_cfg).eval()
    save_checkpoint(tmp_path / "trained.pt", trained, step=1, config=trained_cfg)
    with pytest.raises(CheckpointError, match=match):
        load_for_inference(other_cfg, tmp_path / "trained.pt", torch.device("cpu"))
    loaded, _ = load_for_inference(fitting_cfg, tmp_path / "trained.pt", torch.device("cpu"))
    batch = rig_batch(trained_cfg)
    with torch.no_grad():
        torch.testing.assert_close(loaded(batch)["segmentation"], trained(batch)["segmentation"])


def test_a_checkpoint_of_other_depth_bins_is_refused_with_the_head_shapes_and_loads_with_its_dbound(tmp_path):
    # the default recipe moved from 1 m to 0.5 m depth bins: checkpoints of the 1 m recipe need its grid.dbound
    fine_cfg = tiny_cfg("grid.dbound=[4.0, 12.0, 1.0]")
    d, c = 4, fine_cfg.model.context_channels  # 4 bins of 2 m, 8 of 1 m
    refused_then_loaded(tmp_path, tiny_cfg("grid.dbound=[4.0, 12.0, 2.0]"), fine_cfg,
                        rf"does not fit this model: .*camera\.head\.weight: checkpoint \({d + c}, 512, 1, 1\) vs "
                        rf"model \({2 * d + c}, 512, 1, 1\).*Use the config it was trained with",
                        tiny_cfg("grid.dbound=[4.0, 12.0, 2.0]"))


def test_the_default_config_lifts_82_depth_bins_and_predicts_its_classes_on_the_full_grid():
    from pathlib import Path

    cfg = load_config(str(Path(__file__).resolve().parents[1] / "configs/synthetic.yaml"), ["train.device=cpu"])
    model = LiftSplatShoot(cfg).eval()
    batch = rig_batch(cfg, batch_size=1)
    with torch.no_grad():
        out = model(batch)
    h, w = (d // cfg.model.downsample for d in cfg.data.final_dim)
    assert out["depth_logits"].shape == (1, 6, 82, h, w)  # 4-45 m in 0.5 m bins
    assert out["segmentation"].shape == (1, len(cfg.data.classes), 200, 200)
    assert torch.isfinite(out["segmentation"]).all()
    # the default trains both heads: the detection head's heatmap of the 10 classes on the same grid
    assert tuple(cfg.model.heads) == ("segmentation", "detection") and cfg.data.detection_targets
    assert out["det_heatmap"].shape == (1, 10, 200, 200) and torch.isfinite(out["det_heatmap"]).all()
