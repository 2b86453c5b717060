"""A model with both heads: where the detection head reads the BEV features (detection.decoder: shared or own) and
how much of its gradient reaches the BEV encoder (detection.trunk_grad_scale); the default model is unchanged."""
import pytest
import torch

from lss.config import ConfigError, load_config
from lss.models.build import build_model
from test_model import TINY, rig_batch

JOINT = ["model.heads=[segmentation, detection]", "detection.head_channels=8"]


def _model(*extra, seed=0):
    cfg = load_config(None, TINY + JOINT + list(extra))
    torch.manual_seed(seed)
    return build_model(cfg).train(), cfg


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}


def _detection_loss(outputs):
    return outputs["det_heatmap"].float().square().mean() + outputs["det_regression"].float().square().mean()


def _nonzero(g):
    return g is not None and bool(g.abs().sum() > 0)


def test_shared_decoder_is_the_model_as_before():
    shared, _ = _model()
    assert shared.detection_decoder is None
    assert not any(k.startswith("detection_decoder.") for k in shared.state_dict())


def test_own_decoder_keeps_the_detection_losses_out_of_the_segmentation_heads_last_stage():
    model, cfg = _model("detection.decoder=own")
    shared, _ = _model()
    extra = set(model.state_dict()) - set(shared.state_dict())
    assert extra and all(k.startswith("detection_decoder.") for k in extra)
    # the modules both models have start alike (the own decoder is built last)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in shared.state_dict().items())
    batch = rig_batch(cfg)
    grads = _grads(model, _detection_loss(model(batch)))
    assert all(not _nonzero(g) for n, g in grads.items() if n.startswith(("bev.up2.", "segmentation.")))
    assert any(_nonzero(g) for n, g in grads.items() if n.startswith("detection_decoder."))
    assert any(_nonzero(g) for n, g in grads.items() if n.startswith("bev.layer1."))  # the trunk is shared
    grads = _grads(model, model(batch)["segmentation"].float().square().mean())
    assert all(not _nonzero(g) for n, g in grads.items() if n.startswith(("detection_decoder.", "detection.")))
    assert any(_nonzero(g) for n, g in grads.items() if n.startswith("bev.up2."))


@pytest.mark.parametrize("decoder", ["shared", "own"])
def test_trunk_grad_scale_scales_only_what_reaches_the_bev_encoder(decoder):
    grads = {}
    for scale in (1.0, 0.25, 0.0):
        model, cfg = _model(f"detection.decoder={decoder}", f"detection.trunk_grad_scale={scale}")
        out = model(rig_batch(cfg))
        grads[scale] = _grads(model, _detection_loss(out))
        if scale == 1.0:
            with torch.no_grad():  # the forward does not depend on the scale
                reference = out["det_heatmap"].detach()
        else:
            torch.testing.assert_close(out["det_heatmap"].detach(), reference)
    scaled = [n for n in grads[1.0] if n.startswith(("bev.", "camera."))]
    head = [n for n in grads[1.0] if n.startswith(("detection.", "detection_decoder."))]
    assert any(_nonzero(grads[1.0][n]) for n in scaled) and any(_nonzero(grads[1.0][n]) for n in head)
    for n in scaled:
        if grads[1.0][n] is not None:
            torch.testing.assert_close(grads[0.25][n], 0.25 * grads[1.0][n], rtol=1e-4, atol=1e-9)
            assert not _nonzero(grads[0.0][n])
    for n in head:
        torch.testing.assert_close(grads[0.25][n], grads[1.0][n], rtol=1e-5, atol=1e-9)


def test_a_narrower_own_decoder_stage_feeds_the_head_and_leaves_segmentation_as_it_was():
    wide, cfg = _model("detection.decoder=own")
    narrow, _ = _model("detection.decoder=own", "detection.decoder_channels=32")
    batch = rig_batch(cfg)
    shapes = {k: v.shape for k, v in narrow.state_dict().items()}
    differ = {k for k, v in wide.state_dict().items() if shapes[k] != v.shape}
    assert differ and all(k.startswith(("detection_decoder.", "detection.shared.0.")) for k in differ)
    assert shapes["detection.shared.0.weight"][1] == 32
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(narrow.detection_decoder) < 0.3 * count(wide.detection_decoder)
    # the same seed: every module but the detection branch starts alike, so segmentation is the same
    same = [k for k in wide.state_dict() if not k.startswith(("detection_decoder.", "detection."))]
    assert all(torch.equal(wide.state_dict()[k], narrow.state_dict()[k]) for k in same)
    with torch.no_grad():
        a, b = wide.eval()(batch), narrow.eval()(batch)
    torch.testing.assert_close(a["segmentation"], b["segmentation"])
    assert b["det_heatmap"].shape == a["det_heatmap"].shape
    grads = _grads(narrow.train(), _detection_loss(narrow(batch)))
    assert any(_nonzero(g) for n, g in grads.items() if n.startswith("detection_decoder."))


@pytest.mark.parametrize("setting, message", [
    ("detection.trunk_grad_scale=-1", r"trunk_grad_scale=-1.0: expected a finite factor >= 0"),
    ("detection.decoder=separate", "detection.decoder"),
    ("detection.decoder_channels=32", r"decoder_channels=32: the width of the detection head's own decoder stage"),
    ("detection.decoder=own;detection.decoder_channels=0", r"decoder_channels=0: .* a count >= 1"),
])
def test_bad_settings_are_refused(setting, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, TINY + JOINT + setting.split(";"))


def test_a_checkpoint_with_its_own_decoder_is_refused_by_a_shared_config(tmp_path):
    from lss.engine.checkpoint import load_checkpoint_model, save_checkpoint
    from lss.errors import CheckpointError

    model, cfg = _model("detection.decoder=own")
    save_checkpoint(tmp_path / "own.pt", model, step=1, config=cfg)
    _, shared = _model()
    with pytest.raises(CheckpointError, match="detection.decoder=own.*detection.decoder=shared"):
        load_checkpoint_model(shared, tmp_path / "own.pt", torch.device("cpu"))
    _, narrow = _model("detection.decoder=own", "detection.decoder_channels=32")
    with pytest.raises(CheckpointError, match="detection.decoder_channels=None.*detection.decoder_channels=32"):
        load_checkpoint_model(narrow, tmp_path / "own.pt", torch.device("cpu"))


def test_lss_train_with_the_shipped_default_trains_and_evaluates_both_heads(synthetic_root, tmp_path):
    """configs/synthetic.yaml (the default) from the CLI on the tiny set, shrunk to CPU sizes: both heads learn (their
    weights move from the initial ones), and the final evaluation reports the map IoU and the detection metrics."""
    import json

    from lss.cli import main
    from lss.engine.checkpoint import load_checkpoint

    run = tmp_path / "run"
    sets = [f"data.dataroot={synthetic_root}", "data.make_synthetic_if_missing=false", "data.workers=0",
            "data.final_dim=[64,192]", "data.resize_lim=[0.46,0.5]", "model.pretrained=null", "train.device=cpu",
            "train.max_steps=2", "train.eval_every=2", "train.ckpt_every=2", "train.viz_every=0",
            "train.batch_size=2", "eval.batch_size=2"]
    args = ["train", "--config", "configs/synthetic.yaml", "--out", str(run)]
    for s in sets:
        args += ["--set", s]
    torch.manual_seed(0)
    assert main(args) == 0
    final = json.loads((run / "final.json").read_text())
    assert set(final["val"]["iou"]) == {"vehicle", "pedestrian", "drivable_area", "lane_divider"}
    assert "mAP" in final["val"]["detection"] and "NDS" in final["val"]["detection"]
    cfg = load_config("configs/synthetic.yaml", sets)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg)
    trained = load_checkpoint(run / "checkpoints" / "last.pt", torch.device("cpu"))["model"]
    # two AdamW steps at the schedule's first learning rates move every weight a little: the same initial weights
    # (within 0.01), each head's moved
    for prefix in ("detection.", "detection_decoder.", "segmentation.", "bev.up2."):
        change = [float((trained[name] - value.detach()).abs().max()) for name, value in model.named_parameters()
                  if name.startswith(prefix)]
        assert change and max(change) < 1e-2 and min(change) > 0, (prefix, change)


@pytest.mark.parametrize("full_res_skip", [True, False])
def test_both_last_stages_read_one_upsampled_map_as_if_each_made_its_own(full_res_skip):
    """for_heads upsamples (and concatenates the grid) once for both last stages: the features and every gradient,
    with the detection branch's gradient scaled, are those of each stage run on its own copy of the inputs."""
    from lss.models.blocks import scale_gradient

    model, cfg = _model("detection.decoder=own", "detection.decoder_channels=8",
                        f"model.bev_full_res_skip={str(full_res_skip).lower()}")
    bev_encoder, stage = model.bev, model.detection_decoder
    grid = torch.randn(2, bev_encoder.stem[0].in_channels, 16, 16, dtype=torch.float64)
    bev_encoder.double(), stage.double()
    branch = lambda t: scale_gradient(t, 0.5)  # noqa: E731

    def run(shared):
        bev = grid.clone().requires_grad_(True)
        if shared:
            seg, det = bev_encoder.for_heads(bev, stage, branch)
        else:  # each stage upsamples its own input; the branch scales both of the detection stage's inputs
            x = bev_encoder.stride2(bev)
            seg = bev_encoder.up2(x, bev) if full_res_skip else bev_encoder.up2(x)
            det = stage(branch(x), branch(bev)) if full_res_skip else stage(branch(x))
        weights = torch.linspace(-1, 1, det.numel(), dtype=det.dtype).view_as(det)
        loss = seg.square().mean() + (det * weights).sum()
        params = list(bev_encoder.parameters()) + list(stage.parameters())
        return seg, det, torch.autograd.grad(loss, [bev] + params)

    seg_a, det_a, grads_a = run(True)
    seg_b, det_b, grads_b = run(False)
    assert seg_a.shape[1] == bev_encoder.feature_channels and det_a.shape[1] == 8
    torch.testing.assert_close(seg_a, seg_b, rtol=0, atol=0)
    torch.testing.assert_close(det_a, det_b, rtol=0, atol=0)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert grads_a[0].abs().sum() > 0


@pytest.mark.parametrize("channels_last", [True, False])
def test_the_last_stage_reads_the_grid_in_the_upsampled_maps_dtype_and_layout(channels_last):
    """Under bf16 autocast the float32 grid joins the bf16 upsampled map as bf16 in the map's memory format (no float32
    concatenation for each convolution to convert again), and the stage's output is what the convolutions gave on the
    float32 concatenation."""
    from lss.models.bev import BevEncoder

    torch.manual_seed(0)
    stage = BevEncoder.last_stage(8, "pytorch_half_pixel", True, 16).train()
    coarse = torch.randn(2, 256, 8, 8).to(torch.bfloat16)
    grid = torch.randn(2, 8, 16, 16)
    if channels_last:
        stage = stage.to(memory_format=torch.channels_last)
        coarse = coarse.contiguous(memory_format=torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        joined = stage.join(coarse, grid)
        out = stage.conv(joined)
        reference = stage.conv(torch.cat([grid, stage.upsample(coarse).float()], dim=1))
    assert joined.dtype == torch.bfloat16
    assert joined.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    torch.testing.assert_close(out, reference, rtol=0, atol=0)
    torch.testing.assert_close(joined[:, :8].float(), grid.to(torch.bfloat16).float(), rtol=0, atol=0)
