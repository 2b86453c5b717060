"""model.temporal.frames on the model side: 1 is the model as it was before two frames existed (same state dict
keys, same outputs for a fixed seed, old checkpoints load); 2 fuses the previous frame's splatted grid through
TemporalFusion, trains on the tiny synthetic set with gradients reaching the fusion conv, and refuses batches
without the previous frame and a fixed-rig export with clear messages."""
import hashlib

import pytest
import torch

from lss.config import config_from_dict, config_to_dict
from lss.data import NuScenesBEV, collate
from lss.geometry import image_augmentation, load_nuscenes_rig, val_augmentation
from lss.models.build import build_model
from lss.models.losses import TotalLoss

VERSION = "v1.0-mini"
CAMERAS = ("CAM_FRONT", "CAM_BACK")
SMALL = {
    "data": {"final_dim": [64, 192], "classes": ["vehicle", "drivable_area"], "cameras": list(CAMERAS)},
    "model": {"backbone": "resnet18"},
    "grid": {"xbound": [-16.0, 16.0, 0.5], "ybound": [-16.0, 16.0, 0.5]},
}
# SMALL's one-frame model of seed 0 on rig_batch(), as the code before model.temporal (commit addb066) gave it:
# the sha256 of its sorted state dict keys, their count, the sum of its floating-point state, and per output
# (sum, sum of magnitudes)
ONE_FRAME_REFERENCE = {
    "keys_sha256": "5d0de147d8247f5f1af80cd34a400020ac79dbef862c8878c9c20def998f99be",
    "num_keys": 244,
    "state_sum": 17320.607136707098,
    "depth_logits": (77.30260108644143, 572.2895048032515),
    "segmentation": (-158.9088403917849, 442.7215369157493),
}


def small_config(frames=1, frame_blocks=0, **model):
    temporal = {"frames": frames, **({"frame_blocks": frame_blocks} if frame_blocks else {})}
    values = {**SMALL, "model": {**SMALL["model"], **model, "temporal": temporal}}
    return config_from_dict(values)


def rig_batch(batch_size=1, seed=1):
    """Random images on the nuScenes rig under the evaluation augmentation of SMALL's input size."""
    K, rot, trans = load_nuscenes_rig(CAMERAS)
    aug = val_augmentation((1600, 900), (64, 192), (0.0, 0.22))
    post_rot, post_trans = image_augmentation(aug, (1600, 900), (64, 192))
    g = torch.Generator().manual_seed(seed)
    n = len(CAMERAS)
    return {
        "images": torch.randn(batch_size, n, 3, 64, 192, generator=g),
        "intrinsics": K.expand(batch_size, n, 3, 3),
        "sensor2ego_rot": rot.expand(batch_size, n, 3, 3),
        "sensor2ego_trans": trans.expand(batch_size, n, 3),
        "post_rot": post_rot.expand(batch_size, n, 3, 3),
        "post_trans": post_trans.expand(batch_size, n, 3),
    }


def previous_of(batch, forward=4.0, seed=2):
    """The batch with a previous frame: other images on the same rig, the ego `forward` metres further on."""
    out = dict(batch)
    for key in ("intrinsics", "sensor2ego_rot", "sensor2ego_trans", "post_rot", "post_trans"):
        out[f"prev_{key}"] = batch[key]
    out["prev_images"] = rig_batch(batch["images"].shape[0], seed)["images"]
    motion = torch.eye(4).repeat(batch["images"].shape[0], 1, 1)
    motion[:, 0, 3] = -forward
    out["ego_motion"] = motion
    return out


def test_one_frame_model_is_the_model_before_two_frames():
    torch.manual_seed(0)
    model = build_model(small_config()).eval()
    assert model.temporal is None
    state = model.state_dict()
    keys = sorted(state)
    assert hashlib.sha256("\n".join(keys).encode()).hexdigest() == ONE_FRAME_REFERENCE["keys_sha256"]
    assert len(keys) == ONE_FRAME_REFERENCE["num_keys"]
    total = float(sum(v.double().sum() for v in state.values() if v.is_floating_point()))
    assert total == pytest.approx(ONE_FRAME_REFERENCE["state_sum"], rel=1e-9)
    with torch.no_grad():
        # previous-frame entries in the batch change nothing for one frame
        for batch in (rig_batch(), previous_of(rig_batch())):
            outputs = model(batch)
            assert set(outputs) == {"segmentation", "depth_logits"}
            for name in ("depth_logits", "segmentation"):
                value = outputs[name].double()
                expected_sum, expected_abs = ONE_FRAME_REFERENCE[name]
                assert float(value.sum()) == pytest.approx(expected_sum, rel=1e-5, abs=1e-3)
                assert float(value.abs().sum()) == pytest.approx(expected_abs, rel=1e-5)


def test_two_frame_model_adds_only_the_fusion_and_starts_as_the_one_frame_model():
    torch.manual_seed(0)
    one = build_model(small_config()).state_dict()
    torch.manual_seed(0)
    two = build_model(small_config(frames=2)).state_dict()
    added = sorted(set(two) - set(one))
    assert set(one) <= set(two) and added and all(k.startswith("temporal.conv.") for k in added)
    assert all(torch.equal(one[k], two[k]) for k in one)
    assert two["temporal.conv.0.weight"].shape == (64, 128, 3, 3)  # 2 x (nz * context channels) -> nz * C


def test_two_frame_forward_fuses_the_previous_frame():
    torch.manual_seed(0)
    model = build_model(small_config(frames=2)).eval()
    batch = previous_of(rig_batch())
    with torch.no_grad():
        outputs = model(batch)
        assert outputs["segmentation"].shape == (1, 2, 64, 64)
        assert outputs["camera_depth"].shape[:2] == (1, 2) and outputs["camera_context"].shape[:3] == (1, 2, 64)
        # other previous images, or the same images seen from elsewhere, change the prediction
        other = model(previous_of(rig_batch(), seed=3))["segmentation"]
        moved = model(previous_of(rig_batch(), forward=8.0))["segmentation"]
        # the previous frame's camera features given instead of its images: the same prediction
        streamed = dict(batch)
        del streamed["prev_images"]
        features = model({**previous_of(batch), "images": batch["prev_images"]})
        streamed["prev_depth"], streamed["prev_context"] = features["camera_depth"], features["camera_context"]
        again = model(streamed)["segmentation"]
    assert not torch.allclose(other, outputs["segmentation"])
    assert not torch.allclose(moved, outputs["segmentation"])
    torch.testing.assert_close(again, outputs["segmentation"])


def test_frame_blocks_run_the_same_residual_blocks_on_both_frames_before_the_fusion():
    from torchvision.models.resnet import BasicBlock

    torch.manual_seed(0)
    plain = build_model(small_config(frames=2)).state_dict()
    torch.manual_seed(0)
    model = build_model(small_config(frames=2, frame_blocks=2))
    added = sorted(set(model.state_dict()) - set(plain))
    assert {k.split(".")[2] for k in added} == {"0", "1"} and all(k.startswith("temporal.frame.") for k in added)
    assert all(torch.equal(plain[k], model.state_dict()[k]) for k in plain if not k.startswith("temporal."))
    fusion = model.temporal.eval()
    # the reference: two torchvision BasicBlocks with the fusion's weights, applied to each frame, then the conv
    blocks = torch.nn.Sequential(BasicBlock(64, 64), BasicBlock(64, 64)).eval()
    blocks.load_state_dict(fusion.frame.state_dict())
    g = torch.Generator().manual_seed(4)
    current, previous = (torch.randn(2, 64, 16, 16, generator=g) for _ in range(2))
    with torch.no_grad():
        want = fusion.conv(torch.cat([blocks(current), blocks(previous)], 1))
        torch.testing.assert_close(fusion(current, previous), want)
    # trained: the blocks learn from both frames' grids (the previous frame's camera pass has no gradient)
    model.train()
    batch = previous_of(rig_batch(batch_size=2))
    batch["targets"] = torch.rand(2, 2, 64, 64, generator=g).round()
    TotalLoss(small_config(frames=2, frame_blocks=2))(model(batch), batch)["loss"].backward()
    grads = [p.grad for p in model.temporal.frame.parameters()]
    assert all(gr is not None and gr.abs().sum() > 0 for gr in grads)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.camera.parameters())  # current frame


def test_two_frame_model_refuses_a_batch_without_the_previous_frame():
    model = build_model(small_config(frames=2)).eval()
    with pytest.raises(ValueError, match=r"needs the previous frame's inputs, but the batch has no prev_images, "
                                         r"prev_intrinsics.*ego_motion.*model.temporal.frames: 2"):
        model(rig_batch())
    batch = previous_of(rig_batch())
    batch["prev_images"] = batch["prev_images"][:, :1]
    with pytest.raises(ValueError, match=r"prev_images'\] is \(1, 1, 3, 64, 192\).*same cameras"):
        model(batch)


@pytest.mark.slow
def test_two_frames_train_on_the_tiny_set(synthetic_root):
    cfg = config_from_dict({
        **SMALL, "data": {**SMALL["data"], "dataroot": str(synthetic_root), "resize_lim": [0.45, 0.55]},
        "model": {**SMALL["model"], "temporal": {"frames": 2}}, "loss": {"type": "bce"},
    })
    dataset = NuScenesBEV(synthetic_root, VERSION, "train", cfg, is_train=True, verbose=False)
    torch.manual_seed(0)
    batch = collate([dataset[1], dataset[2]])
    model = build_model(cfg).train()
    loss_fn = TotalLoss(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(4):
        optimizer.zero_grad()
        loss = loss_fn(model(batch), batch)["loss"]
        loss.backward()
        fusion_grad = model.temporal.conv[0].weight.grad
        assert fusion_grad is not None and float(fusion_grad.abs().sum()) > 0
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        optimizer.step()
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0], losses


def test_one_frame_checkpoint_of_a_config_without_temporal_loads(tmp_path):
    from lss.engine.checkpoint import load_checkpoint, load_checkpoint_model, save_checkpoint

    cfg = small_config()
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    path = tmp_path / "old.pt"
    save_checkpoint(path, model, step=3, config=cfg)
    state = torch.load(path, weights_only=False)
    del state["config"]["model"]["temporal"]  # as a checkpoint written before model.temporal existed
    torch.save(state, path)
    loaded, _ = load_checkpoint_model(small_config(), path, torch.device("cpu"), state=load_checkpoint(path))
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


def test_a_two_frame_checkpoint_is_refused_by_a_one_frame_config(tmp_path):
    from lss.engine.checkpoint import load_checkpoint_model, save_checkpoint
    from lss.errors import CheckpointError

    cfg = small_config(frames=2)
    path = tmp_path / "two.pt"
    save_checkpoint(path, build_model(cfg), step=1, config=cfg)
    assert config_to_dict(cfg)["model"]["temporal"] == {"frames": 2, "gap": 1, "frame_blocks": 0}
    with pytest.raises(CheckpointError, match=r"model.temporal.frames=2.*model.temporal.frames=1"):
        load_checkpoint_model(small_config(), path, torch.device("cpu"))
    # the same weights read two key frames back are another model: refused too, the gap named
    gap2 = config_from_dict({**config_to_dict(cfg), "model": {**config_to_dict(cfg)["model"],
                                                              "temporal": {"frames": 2, "gap": 2}}})
    with pytest.raises(CheckpointError, match=r"model.temporal.gap=1.*model.temporal.gap=2"):
        load_checkpoint_model(gap2, path, torch.device("cpu"))
    # a checkpoint written before model.temporal.gap existed loads as gap 1
    state = torch.load(path, weights_only=False)
    del state["config"]["model"]["temporal"]["gap"]
    torch.save(state, tmp_path / "old.pt")
    load_checkpoint_model(cfg, tmp_path / "old.pt", torch.device("cpu"))
    with pytest.raises(CheckpointError, match=r"model.temporal.gap"):
        load_checkpoint_model(gap2, tmp_path / "old.pt", torch.device("cpu"))
    # frame blocks are weights of their own: a checkpoint without them is refused by a config with them
    blocks = config_from_dict({**config_to_dict(cfg), "model": {**config_to_dict(cfg)["model"],
                                                                "temporal": {"frames": 2, "frame_blocks": 1}}})
    with pytest.raises(CheckpointError, match=r"model.temporal.frame_blocks=0.*model.temporal.frame_blocks=1"):
        load_checkpoint_model(blocks, path, torch.device("cpu"))


def test_export_refuses_a_fixed_rig_for_a_two_frame_model(tmp_path):
    from lss.errors import ArgumentError
    from lss.export import export_model

    cfg = small_config(frames=2)
    with pytest.raises(ArgumentError, match="exported with rig inputs only .* pass --rig-inputs"):
        export_model(build_model(cfg), tmp_path / "m.onnx", cfg)
