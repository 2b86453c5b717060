"""The switches that reproduce the original LSS code's conventions (docs/accuracy.md), each showing the values it
changes, and model.pretrained: imagenet through efficientnet-pytorch's loader and torch.hub's cache."""
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from efficientnet_pytorch import EfficientNet, utils as effnet_utils
from PIL import Image

from lss.config import Config, ConfigError, load_config
from lss.data import NuScenesBEV
from lss.data.original_conventions import (
    load_augmented_pil,
    original_post_matrices,
    rasterize_footprints_original,
)
from lss.data.targets import rasterize_footprints
from lss.data.transforms import load_augmented_image, sample_augmentation
from lss.engine.checkpoint import load_for_inference
from lss.geometry import BevGrid, FrustumLUT, ImageAugmentation, frustum
from lss.models import LiftSplatShoot
from lss.models.camera import EfficientNetTrunk

ROOT = Path(__file__).resolve().parents[1]
TINY = ["data.final_dim=[32, 96]", "grid.xbound=[-8.0, 8.0, 1.0]", "grid.ybound=[-8.0, 8.0, 1.0]",
        "grid.dbound=[4.0, 12.0, 2.0]", "model.context_channels=8", "data.classes=[vehicle]"]
SWITCHES = {  # key: (lss's behaviour, the original's)
    "data.image_resize": ("fast", "pil"),
    "data.post_matrices": ("exact", "original"),
    "data.target_raster": ("exact", "original"),
    "model.frustum_pixels": ("centres", "linspace"),  # receptive_field: lss's own
    "model.splat_binning": ("floor", "trunc"),
    "model.bev_zero_init_residual": (False, True),
}


def tiny_model(*extra):
    torch.manual_seed(0)
    return LiftSplatShoot(load_config(None, TINY + list(extra)))


def rig(batch_size=1, final_dim=(32, 96)):
    """The nuScenes rig at final_dim (1600 x 900 images resized to the width, bottom rows kept)."""
    from lss.geometry import image_augmentation, load_nuscenes_rig, val_augmentation

    K, rot, trans = load_nuscenes_rig()
    post_rot, post_trans = image_augmentation(val_augmentation((1600, 900), final_dim, (0.0, 0.0)), (1600, 900),
                                              final_dim)
    expand = lambda t: t.unsqueeze(0).expand(batch_size, *t.shape).clone()  # noqa: E731
    return {"intrinsics": expand(K), "sensor2ego_rot": expand(rot), "sensor2ego_trans": expand(trans),
            "post_rot": expand(post_rot.expand(6, 3, 3)), "post_trans": expand(post_trans.expand(6, 3))}


# --- config -----------------------------------------------------------------------------------------------------

def test_switches_default_to_lss_and_the_paper_config_keeps_them():
    defaults, paper = Config(), load_config(ROOT / "configs" / "lss_paper.yaml")
    for key, (ours, _) in SWITCHES.items():
        section, name = key.split(".")
        assert getattr(getattr(defaults, section), name) == ours, key
        assert getattr(getattr(paper, section), name) == ours, key


@pytest.mark.parametrize("key", sorted(SWITCHES))
def test_switches_load_both_values_and_refuse_others(key):
    section, name = key.split(".")
    for value in SWITCHES[key]:
        text = str(value).lower()
        assert getattr(getattr(load_config(None, [f"{key}={text}"]), section), name) == value
    with pytest.raises(ConfigError, match=rf"{key}(='bogus')?: expected (one of|true/false)"):
        load_config(None, [f"{key}=bogus"])


def test_decoded_cache_is_refused_with_the_pil_path():
    with pytest.raises(ConfigError, match="data.decoded_cache.*data.image_resize=pil"):
        load_config(None, ["data.image_resize=pil", "data.decoded_cache=true"])


# --- frustum pixels, binning, BEV initialisation -----------------------------------------------------------------

def test_linspace_frustum_runs_from_the_first_to_the_last_pixel():
    centres = frustum((128, 352), 16, (4.0, 45.0, 1.0))
    spread = frustum((128, 352), 16, (4.0, 45.0, 1.0), "linspace")
    assert spread.shape == centres.shape == (41, 8, 22, 3)
    torch.testing.assert_close(centres[0, 0, :, 0], 16.0 * torch.arange(22.0) + 7.5)
    torch.testing.assert_close(spread[0, 0, :, 0], torch.arange(22.0) * (351.0 / 21.0))
    torch.testing.assert_close(spread[0, :, 0, 1], torch.arange(8.0) * (127.0 / 7.0))
    torch.testing.assert_close(spread[..., 2], centres[..., 2])  # the depth bins are the same
    with pytest.raises(ValueError, match="pixels must be one of"):
        frustum((128, 352), 16, (4.0, 45.0, 1.0), "corners")


def _receptive_field_centre(grad: torch.Tensor, axis: int) -> float:
    """The middle of the input pixels that a feature's gradient reaches along `axis` (2: rows, 3:
    columns)."""
    reach = grad.abs().sum(dim=tuple(d for d in range(4) if d != axis)).nonzero().flatten()
    return (int(reach.min()) + int(reach.max())) / 2


def test_receptive_field_frustum_sits_where_the_trunks_features_are_centred():
    """The trunk's stride-16 feature (i, j) is computed from input pixels centred on the frustum's
    receptive_field (u, v), 7.5 pixels right of and below the cell centres (squeeze-excitation
    switched off: its global pooling reaches every pixel)."""
    torch.manual_seed(0)
    trunk = EfficientNetTrunk().eval()
    for block in trunk.net._blocks:
        block.has_se = False
    x = torch.randn(1, 3, 512, 512, requires_grad=True)
    stride16, _ = trunk(x)
    points = frustum((512, 512), 16, (4.0, 12.0, 2.0), "receptive_field")
    centres = frustum((512, 512), 16, (4.0, 12.0, 2.0))
    for i, j in [(12, 10), (16, 16), (19, 14)]:  # receptive fields inside the image
        (grad,) = torch.autograd.grad(stride16[0, :, i, j].sum(), x, retain_graph=True)
        assert _receptive_field_centre(grad, 3) == points[0, i, j, 0].item() == 16 * j + 15
        assert _receptive_field_centre(grad, 2) == points[0, i, j, 1].item() == 16 * i + 15
        assert points[0, i, j, 0] - centres[0, i, j, 0] == 7.5
    torch.testing.assert_close(points[..., 2], centres[..., 2])


def test_trunc_binning_keeps_points_up_to_one_cell_below_the_grid():
    grid = BevGrid((-2.0, 2.0, 1.0), (-2.0, 2.0, 1.0), (-10.0, 10.0, 20.0))
    xyz = torch.tensor([[-2.5, 0.5, 0.0],    # half a cell below x min: trunc cell 0, floor outside
                        [0.5, -1.5, -25.0],  # 15 m below z min, less than one 20 m cell: trunc keeps it
                        [-3.5, 0.5, 0.0],    # more than a cell below: outside both ways
                        [1.5, 1.5, 9.0],     # inside: the same cell both ways
                        [2.0, 0.0, 0.0]])    # on the upper edge: outside both ways
    points = xyz.view(1, 1, 1, 1, 5, 3)
    floor, trunc = FrustumLUT.build(points, grid), FrustumLUT.build(points, grid, "trunc")
    cell = lambda i, j: i * 4 + j  # noqa: E731  (b = 0, z = 0)
    assert floor.point_cell.tolist() == [-1, -1, -1, cell(3, 3), -1]
    assert trunc.point_cell.tolist() == [cell(0, 2), cell(2, 0), -1, cell(3, 3), -1]
    with pytest.raises(ValueError, match="binning must be one of"):
        FrustumLUT.build(points, grid, "round")


def test_model_switches_reach_the_splat():
    lss_model = tiny_model()
    orig = tiny_model("model.frustum_pixels=linspace", "model.splat_binning=trunc")
    torch.testing.assert_close(orig.splat.frustum, frustum((32, 96), 16, (4.0, 12.0, 2.0), "linspace"))
    assert not torch.equal(orig.splat.frustum, lss_model.splat.frustum)
    floor_lut = tiny_model().splat.lut(rig())
    trunc_lut = tiny_model("model.splat_binning=trunc").splat.lut(rig())
    assert trunc_lut.num_kept() > floor_lut.num_kept() > 0
    inside = floor_lut.point_cell >= 0
    assert torch.equal(trunc_lut.point_cell[inside], floor_lut.point_cell[inside])


def test_export_graphs_bin_as_the_model_does():
    from lss.export.graph import RIG_KEYS, DeployModel

    def splatted(model, *args):
        """The BEV grid of features that `model` hands its BEV encoder."""
        seen = []
        handle = model.bev.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0]))
        with torch.no_grad():
            model(*args)
        handle.remove()
        return seen[0]

    trunc = tiny_model("model.splat_binning=trunc").eval()
    floor = tiny_model().eval()
    floor.load_state_dict(trunc.state_dict())
    batch = rig()
    batch["images"] = torch.randn(1, 6, 3, 32, 96, generator=torch.Generator().manual_seed(1))
    want = splatted(trunc, batch)
    assert (want - splatted(floor, batch)).abs().amax(dim=(0, 1)).gt(1e-3).sum() > 5  # cells trunc adds
    for splat in ("onnx", "rig_inputs"):
        deploy = DeployModel(trunc, splat, rig={k: batch[k][0] for k in RIG_KEYS})
        got = splatted(deploy, batch["images"], *(batch[k] for k in RIG_KEYS))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=splat)


def test_bev_zero_init_residual_starts_every_residual_block_as_the_identity():
    plain, zeroed = tiny_model(), tiny_model("model.bev_zero_init_residual=true")
    for model, value in ((plain, 1.0), (zeroed, 0.0)):
        for layer in (model.bev.layer1, model.bev.layer2, model.bev.layer3):
            for block in layer:
                assert torch.all(block.bn2.weight == value)
    x = torch.rand(2, 64, 8, 8)  # non-negative: a block whose branch is zero returns relu(x) = x
    with torch.no_grad():
        torch.testing.assert_close(zeroed.bev.layer1(x), x)
        assert (plain.bev.layer1(x) - x).abs().max() > 0.1


# --- image path and augmentation matrices ------------------------------------------------------------------------

def encoded_dot_image(size=(400, 225), dot=(130, 60), fmt="PNG"):
    """A dark (W, H) image with a bright 9 x 9 square centred on pixel `dot`, encoded."""
    image = np.full((size[1], size[0], 3), 20, np.uint8)
    image[dot[1] - 4:dot[1] + 5, dot[0] - 4:dot[0] + 5] = 240
    out = io.BytesIO()
    Image.fromarray(image).save(out, format=fmt)
    return out.getvalue()


@pytest.mark.parametrize("aug", [ImageAugmentation((352, 198), (0, 48)),
                                 ImageAugmentation((380, 214), (10, 60), flip=True, rotate=5.0),
                                 ImageAugmentation((330, 185), (-8, 40), rotate=-5.4)])
def test_pil_path_puts_the_content_where_its_matrices_say(aug):
    size, dot, final_dim = (400, 225), (130, 90), (128, 352)
    image, post_rot, post_trans = load_augmented_pil(encoded_dot_image(size, dot), size, aug, final_dim)
    assert image.shape == (128, 352, 3) and image.dtype == np.uint8
    want = post_rot[:2, :2] @ np.asarray(dot, np.float64) + post_trans[:2]
    bright = image.mean(-1) > 128
    rows, cols = np.nonzero(bright)
    assert bright.sum() > 20
    assert abs(cols.mean() - want[0]) < 0.75 and abs(rows.mean() - want[1]) < 0.75, (cols.mean(), rows.mean(), want)


def test_pil_and_fast_paths_differ_in_pixels_not_in_matrices():
    rng = np.random.default_rng(0)
    texture = (rng.random((225, 400, 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(texture).save(out, format="JPEG", quality=95)
    aug = ImageAugmentation((352, 198), (0, 48), flip=True, rotate=3.0)
    pil, pil_rot, pil_trans = load_augmented_pil(out.getvalue(), (400, 225), aug, (128, 352))
    fast, fast_rot, fast_trans = load_augmented_image(out.getvalue(), (400, 225), aug, (128, 352))
    np.testing.assert_allclose(pil_rot, fast_rot, atol=1e-6)
    np.testing.assert_allclose(pil_trans, fast_trans, atol=1e-5)
    difference = np.abs(pil.astype(int) - fast.astype(int))
    assert difference.mean() > 5  # bicubic + nearest rotation against area + bilinear on noise


def test_original_post_matrices_follow_the_original_composition():
    # drawn factor 0.2 of 1600 x 900 -> 320 x 180, crop at (10, 20), flipped: u' = 352 - (0.2 u - 10), v' = 0.2 v - 20
    aug = ImageAugmentation((320, 180), (10, 20), flip=True, rotate=0.0, resize=0.2)
    rot, trans = original_post_matrices(aug, (128, 352))
    np.testing.assert_allclose(rot, np.diag([-0.2, 0.2, 1.0]), atol=1e-7)
    np.testing.assert_allclose(trans, [362.0, -20.0, 0.0], atol=1e-5)
    # exact: pixel edges scale, the flip mirrors about 351 = W - 1: u' = 351 - (0.2 (u + 0.5) - 0.5 - 10)
    from lss.geometry import image_augmentation

    exact_rot, exact_trans = image_augmentation(aug, (1600, 900), (128, 352))
    np.testing.assert_allclose(exact_trans.numpy(), [361.4, -20.4, 0.0], atol=1e-4)
    # a 90 degree turn about (176, 64): u'' = v' + 112, v'' = -u' + 240
    turned = ImageAugmentation((320, 180), (10, 20), rotate=90.0, resize=0.2)
    rot, trans = original_post_matrices(turned, (128, 352))
    np.testing.assert_allclose(rot[:2, :2], [[0.0, 0.2], [-0.2, 0.0]], atol=1e-7)
    np.testing.assert_allclose(trans[:2], [-20.0 + 112.0, 10.0 + 240.0], atol=1e-4)
    with pytest.raises(ValueError, match="drawn resize factor"):
        original_post_matrices(ImageAugmentation((320, 180), (10, 20)), (128, 352))


def test_sample_augmentation_records_the_drawn_factor():
    rng = np.random.default_rng(3)
    aug = sample_augmentation((1600, 900), (128, 352), (0.193, 0.225), (0.0, 0.22), (-5.4, 5.4), True, True, rng)
    assert 0.193 <= aug.resize <= 0.225 and aug.resize_dims == (int(1600 * aug.resize), int(900 * aug.resize))
    val = sample_augmentation((1600, 900), (128, 352), (0.193, 0.225), (0.0, 0.22), (-5.4, 5.4), True, False)
    assert val.resize == pytest.approx(0.22)


# --- ground truth ------------------------------------------------------------------------------------------------

def test_original_target_raster_rounds_corners_to_whole_cells():
    grid = BevGrid.planar((-4.0, 4.0, 1.0), (-4.0, 4.0, 1.0))
    box = np.array([[[0.0, 0.0], [-2.0, 0.0], [-2.0, -2.0], [0.0, -2.0]]])  # cell coordinates 2 to 4

    def block(rows, cols):
        out = np.zeros((8, 8), np.uint8)
        out[rows[0]:rows[1] + 1, cols[0]:cols[1] + 1] = 1
        return out

    def both(shift):
        moved = box + np.asarray(shift)
        return (rasterize_footprints(np.zeros((8, 8), np.uint8), moved, grid),
                rasterize_footprints_original(np.zeros((8, 8), np.uint8), moved, grid))

    # corners on whole cells: the original takes 2 and 4 as pixel centres and fills 2..4 with its boundary
    exact, original = both((0.0, 0.0))
    np.testing.assert_array_equal(original, block((2, 4), (2, 4)))
    np.testing.assert_array_equal(exact, original)
    # corners at 2.6 and 4.6: rounded to 3 and 5 (cells 3..5); lss marks the cells whose centres lie
    # inside (3, 4) and those the outline crosses (2, 4): the original's footprint sits a cell further
    exact, original = both((0.6, 0.6))
    np.testing.assert_array_equal(original, block((3, 5), (3, 5)))
    np.testing.assert_array_equal(exact, block((2, 4), (2, 4)))
    # 2.4 rounds down, 2.6 up
    np.testing.assert_array_equal(both((0.4, 0.6))[1], block((2, 4), (3, 5)))


# --- the dataset -------------------------------------------------------------------------------------------------

def dataset_config(*extra):
    return load_config(None, ["data.final_dim=[128, 352]", "data.classes=[vehicle]", *extra])


def test_dataset_switches_change_images_matrices_and_targets(synthetic_root):
    def item(*extra):
        ds = NuScenesBEV(synthetic_root, "v1.0-mini", "train", dataset_config(*extra), is_train=False, verbose=False)
        return ds[0]

    base = item()
    pil = item("data.image_resize=pil")
    assert torch.equal(pil["post_rot"], base["post_rot"]) and torch.equal(pil["targets"], base["targets"])
    assert (pil["images"].float() - base["images"].float()).abs().mean() > 0.5  # of 255 levels
    # validation of a 400 x 225 image: resize 0.88 to 352 x 198, crop top 48; exact u' = 0.88 (u + 0.5) - 0.5
    orig = item("data.post_matrices=original")
    assert torch.equal(orig["images"], base["images"])
    torch.testing.assert_close(orig["post_rot"], base["post_rot"])
    torch.testing.assert_close(orig["post_trans"] - base["post_trans"],
                               torch.tensor([0.06, 0.06, 0.0]).expand(6, 3), atol=1e-4, rtol=0)
    raster = NuScenesBEV(synthetic_root, "v1.0-mini", "train", dataset_config("data.target_raster=original"),
                         is_train=False, verbose=False)
    ours, theirs = base["targets"][0].numpy(), raster[0]["targets"][0].numpy()
    lo, hi = raster.object_offsets[0], raster.object_offsets[1]
    vehicles = raster.object_footprints[lo:hi][(raster.object_class_bits[lo:hi] & 1) == 1]
    np.testing.assert_array_equal(theirs, rasterize_footprints_original(np.zeros_like(theirs, np.uint8), vehicles,
                                                                        raster.grid))
    assert ours.sum() > 100 and (ours != theirs).sum() > 50
    assert 0.9 < theirs.sum() / ours.sum() < 1.1  # about the same area, other cells


# --- ImageNet weights --------------------------------------------------------------------------------------------

@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty torch.hub cache and efficientnet-b0's download URL pointing at a local file of random weights
    (returned as a state dict) that stands in for the ImageNet file."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    torch.manual_seed(7)
    source = EfficientNet.from_name("efficientnet-b0").state_dict()
    served = tmp_path / "served" / "efficientnet-b0-355c32eb.pth"
    served.parent.mkdir()
    torch.save(source, served)
    monkeypatch.setitem(effnet_utils.url_map, "efficientnet-b0", served.as_uri())
    return source, served


def test_imagenet_weights_load_through_the_library_and_its_cache(hub):
    source, served = hub
    assert Path(torch.hub.get_dir()).is_relative_to(served.parent.parent)
    trunk = EfficientNetTrunk(pretrained="imagenet")
    own = trunk.net.state_dict()
    assert set(own) < set(source)  # the unused head (_conv_head, _bn1, _fc) is dropped after loading
    for key, value in own.items():
        torch.testing.assert_close(value, source[key], msg=key)
    cached = Path(torch.hub.get_dir()) / "checkpoints" / served.name
    assert cached.is_file()
    served.unlink()  # later runs read the cache, no download
    again = EfficientNetTrunk(pretrained="imagenet")
    torch.testing.assert_close(again.net._conv_stem.weight, source["_conv_stem.weight"])


def test_imagenet_offline_without_a_cache_says_how_to_pass_the_file(hub):
    _, served = hub
    served.unlink()
    with pytest.raises(ConfigError, match=r"model.pretrained=imagenet.*could not be downloaded.*"
                                          r"Download that file and pass its path \(model.pretrained=/path/to/"
                                          r"efficientnet-b0-355c32eb.pth\)"):
        EfficientNetTrunk(pretrained="imagenet")


def test_a_damaged_cached_file_is_named(hub):
    _, served = hub
    served.write_bytes(b"not a state dict")
    with pytest.raises(ConfigError, match=r"efficientnet-b0-355c32eb.pth is not the efficientnet-b0 ImageNet state "
                                          r"dict.*delete it"):
        EfficientNetTrunk(pretrained="imagenet")


def test_a_checkpoint_loads_without_the_imagenet_file(hub):
    _, served = hub
    served.unlink()
    cfg = load_config(None, TINY + ["model.pretrained=imagenet"])
    with pytest.raises(ConfigError, match="could not be downloaded"):
        LiftSplatShoot(cfg)
    weights = tiny_model().state_dict()
    model, _ = load_for_inference(cfg, "ckpt.pt", torch.device("cpu"), state={"model": weights})
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, weights[key], msg=key)


def test_the_nuscenes_configs_start_from_imagenet_and_the_synthetic_ones_from_scratch():
    for name in ("nuscenes_mini.yaml", "nuscenes_trainval.yaml"):
        assert load_config(ROOT / "configs" / name).model.pretrained == "imagenet", name
    for name in ("synthetic_segmentation.yaml", "synthetic.yaml", "synthetic_demo.yaml", "lss_paper.yaml"):
        assert load_config(ROOT / "configs" / name).model.pretrained is None, name


@pytest.mark.slow
def test_every_original_switch_at_once_trains_on_the_tiny_set(synthetic_root, tmp_path):
    import json

    from benchmarks.accuracy import QUICK_OVERRIDES
    from lss.engine.train import train

    originals = [f"{key}={str(values[1]).lower()}" for key, values in SWITCHES.items()]
    overrides = list(QUICK_OVERRIDES) + originals + [
        f"data.dataroot={synthetic_root}", "data.version=v1.0-mini", "data.make_synthetic_if_missing=false",
        "data.workers=0", "train.amp=none", "train.cuda_graph=false", "train.channels_last=false",
        "train.max_steps=2", "train.log_every=1", "train.eval_every=2"]
    cfg = load_config(ROOT / "configs" / "lss_paper.yaml", overrides)
    assert (cfg.data.image_resize, cfg.model.splat_binning, cfg.model.bev_zero_init_residual) == ("pil", "trunc", True)
    final = train(cfg, str(tmp_path / "run"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r["kind"] == "train"]
    assert len(losses) == 2 and all(0 < v < 10 for v in losses)
    assert list(final["val"]["iou"]) == ["vehicle"]
