"""Fixed-shape detection targets (lss.geometry.boxes.dense_targets): the same loss as the box lists, the
dataset yields them while training, and with them the detection model's training step runs on static buffers
(the CUDA-graph step) exactly as eager steps do."""
import math

import pytest
import torch
from test_detection import GRID, random_boxes
from test_graph_step import _run_both

from lss.geometry.boxes import DENSE_TARGET_KEYS, DETECTION_CLASSES, dense_targets, encode_targets
from lss.config import Config, ConfigError, load_config
from lss.data import collate
from lss.models.heads.detection_loss import detection_loss
from lss.geometry import BevGrid


def _box_lists(generator):
    counts = (7, 0, 12)  # one sample without objects
    boxes = [random_boxes(n, generator) for n in counts]
    labels = [torch.randint(0, len(DETECTION_CLASSES), (n,), generator=generator) for n in counts]
    return boxes, labels


def _dense_batch(boxes, labels, grid, max_objects=16):
    return collate([dense_targets(b, lb, grid, max_objects=max_objects) for b, lb in zip(boxes, labels)])


def test_dense_targets_give_the_loss_and_gradients_of_the_box_lists():
    g = torch.Generator().manual_seed(0)
    boxes, labels = _box_lists(g)
    config = Config()
    dense = _dense_batch(boxes, labels, GRID)
    lists = {"det_boxes": boxes, "det_labels": labels}
    grads, values = [], []
    for batch in (lists, {**lists, **dense}, dense):  # the dense targets need no box lists
        logits = torch.randn(3, len(DETECTION_CLASSES), 200, 200, generator=torch.Generator().manual_seed(1))
        regression = torch.randn(3, 10, 200, 200, generator=torch.Generator().manual_seed(2))
        logits.requires_grad_(True)
        regression.requires_grad_(True)
        losses = detection_loss({"det_heatmap": logits, "det_regression": regression}, batch, config)
        sum(losses.values()).backward()
        values.append({k: float(v.detach()) for k, v in losses.items()})
        grads.append((logits.grad, regression.grad))
    # the same terms; only the padding (16 slots per sample here, 12 from the lists) changes the summation order
    for other in values[1:]:
        assert other.keys() == values[0].keys()
        assert all(math.isclose(other[k], values[0][k], rel_tol=1e-6) for k in other)
    assert all(v > 0 and math.isfinite(v) for v in values[0].values())
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    # the regression gradient sits at the 19 centre cells only
    assert int((grads[0][1].abs().sum(1) > 0).sum()) == 19


def test_dense_targets_hold_the_centre_cells_padded_and_refuse_too_many_objects():
    g = torch.Generator().manual_seed(3)
    boxes = random_boxes(9, g)
    labels = torch.randint(0, len(DETECTION_CLASSES), (9,), generator=g)
    dense = dense_targets(boxes, labels, GRID, max_objects=12)
    ref = encode_targets([boxes], [labels], GRID)
    assert dense["det_target_heatmap"].shape == (len(DETECTION_CLASSES), 200, 200)
    assert torch.equal(dense["det_target_heatmap"], ref["heatmap"][0])
    assert torch.equal(dense["det_target_index"][:9], ref["row"] * 200 + ref["col"])
    assert torch.equal(dense["det_target_regression"][:9], ref["regression"])
    assert dense["det_target_index"][9:].eq(0).all() and dense["det_target_mask"][9:].eq(0).all()
    assert dense["det_target_mask"][:9, :8].eq(1).all()
    with pytest.raises(ValueError, match="9 detection boxes.*more than detection.max_objects=8; raise"):
        dense_targets(boxes, labels, GRID, max_objects=8)


def test_dense_targets_that_do_not_fit_the_heatmap_are_refused():
    g = torch.Generator().manual_seed(4)
    boxes, labels = _box_lists(g)
    small = BevGrid.from_config(Config().grid).with_shape((100, 100))
    outputs = {"det_heatmap": torch.zeros(3, 10, 200, 200), "det_regression": torch.zeros(3, 10, 200, 200)}
    with pytest.raises(ValueError, match=r"detection targets \(3, 10, 100, 100\).*same grid"):
        detection_loss(outputs, _dense_batch(boxes, labels, small), Config())
    with pytest.raises(KeyError, match="data.detection_targets: true"):
        detection_loss(outputs, {}, Config())


def test_training_dataset_yields_dense_targets_and_evaluation_dataset_does_not(synthetic_root):
    from lss.data.loader import build_dataset

    config = load_config("configs/synthetic_detection.yaml", [
        "data.final_dim=[32, 96]", "data.resize_lim=[0.24, 0.26]", f"data.dataroot={synthetic_root}",
        "data.version=v1.0-mini", "data.depth_targets=false", "loss.depth_weight=0.0", "detection.max_objects=300"])
    train = build_dataset(config, "train", is_train=True)
    item = train[0]
    assert set(DENSE_TARGET_KEYS) <= set(item)
    assert item["det_target_heatmap"].shape == (len(DETECTION_CLASSES), 200, 200)
    assert item["det_target_index"].shape == (300,) and item["det_target_regression"].shape == (300, 10)
    count = int(item["det_target_mask"][:, 0].sum())
    assert count == len(item["det_boxes"]) > 0  # the dataset keeps only boxes whose centre lies on the grid
    assert int((item["det_target_heatmap"] == 1).sum()) <= count
    evaluation = build_dataset(config, "val", is_train=False)
    assert not set(DENSE_TARGET_KEYS) & set(evaluation[0])


def test_the_captured_step_serves_both_stages():
    from lss.engine.distributed import DistInfo
    from lss.engine.step import choose_step

    base = ["train.cuda_graph=true", "model.heads=[segmentation, detection]"]
    config = load_config(None, base)
    assert config.data.detection_targets is True  # follows from the heads
    assert load_config(None, base + ["data.detection_targets=true"]).data.detection_targets is True
    assert choose_step(config, torch.device("cuda", 0), DistInfo()).kind == "captured"
    refining = load_config(None, base + ["detection.refine=true"])
    assert choose_step(refining, torch.device("cuda", 0), DistInfo()).kind == "captured"
    with pytest.raises(ConfigError, match="fixed-shape targets"):
        load_config(None, base + ["data.detection_targets=false"])
    assert load_config(None, []).data.detection_targets is False


def _detection_cfg(*extra):
    from test_model import TINY

    return load_config(None, TINY + ["model.heads=[segmentation, detection]", "data.detection_targets=true",
                                     "detection.head_channels=8", *extra])


def _detection_batches(cfg, device, count, batch_fn=None):
    from test_model import rig_batch
    from test_temporal_step import two_frame_batch

    grid = BevGrid.from_config(cfg.grid)
    batches = []
    for s in range(count):
        g = torch.Generator().manual_seed(100 + s)
        batch = (two_frame_batch if cfg.model.temporal.frames == 2 else rig_batch)(cfg, seed=s)
        boxes = [random_boxes(3, g, spacing=4.0), random_boxes(2, g, spacing=4.0)]
        labels = [torch.randint(0, len(DETECTION_CLASSES), (len(b),), generator=g) for b in boxes]
        batch.update(_dense_batch(boxes, labels, grid, max_objects=8))
        batches.append({k: v.to(device) for k, v in batch.items()})
    return batches


REFINE = ("detection.refine=true", "detection.refine_hidden=16", "detection.refine_proposals=8")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("extra", [(), REFINE, REFINE + ("detection.refine_depth=true",),
                                   REFINE + ("detection.refine_depth=true", "detection.refine_image=true"),
                                   REFINE + ("detection.refine_depth=true", "detection.refine_quality=thresholds"),
                                   REFINE + ("model.temporal.frames=2", "detection.refine_depth=true",
                                             "detection.refine_motion=true"),
                                   REFINE + ("detection.refine_reversal=true",),
                                   REFINE + ("model.temporal.frames=2", "detection.refine_motion_grid=true",
                                             "detection.refine_reversal=true")],
                         ids=["first_stage", "second_stage", "second_stage_camera_depth", "second_stage_cameras",
                              "second_stage_threshold_quality", "second_stage_two_frames_motion",
                              "second_stage_reversal", "second_stage_two_frames_motion_grid"])
def test_detection_training_step_on_static_buffers_follows_eager_steps(device, extra, monkeypatch):
    import test_graph_step

    cfg = _detection_cfg(*extra)
    monkeypatch.setattr(test_graph_step, "_batches", _detection_batches)
    capture = device == "cuda"
    eager, graphed, pa, pb, step = _run_both(cfg, device, 3, capture, torch.bfloat16 if capture else None)
    assert (step.graph is not None) == capture
    assert {"det_target_heatmap", "det_target_index", "det_target_boxes", "det_target_labels"} <= set(step.static)
    if not capture:
        assert eager == graphed
        assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    else:  # cuDNN may pick other algorithms inside the capture
        for a, b in zip(eager, graphed):
            assert math.isclose(a, b, rel_tol=2e-2), (eager, graphed)
    assert all(math.isfinite(v) and v > 0 for v in graphed)
    logs = step(_detection_batches(cfg, device, 1)[0])
    assert ("loss/det_refine_box" in logs) == bool(extra)
    assert ("loss/det_refine_reversal" in logs) == ("detection.refine_reversal=true" in extra)


def test_heatmap_class_weights_scale_each_class_heatmap_loss():
    g = torch.Generator().manual_seed(5)
    boxes, labels = _box_lists(g)
    batch = _dense_batch(boxes, labels, GRID)
    outputs = {"det_heatmap": torch.randn(3, 10, 200, 200, generator=g),
               "det_regression": torch.randn(3, 10, 200, 200, generator=g)}

    def loss(weights):
        config = Config()
        config.detection.heatmap_class_weights = weights
        return {k: float(v) for k, v in detection_loss(outputs, batch, config).items()}

    plain = loss(None)
    doubled = loss((2.0,) * 10)
    assert math.isclose(doubled["det_heatmap"], 2 * plain["det_heatmap"], rel_tol=1e-6)
    assert doubled["det_regression"] == plain["det_regression"]
    per_class = [loss(tuple(float(c == k) for c in range(10)))["det_heatmap"] for k in range(10)]
    assert math.isclose(sum(per_class), plain["det_heatmap"], rel_tol=1e-5)
    assert all(v > 0 for v in per_class)
    with pytest.raises(ConfigError, match="heatmap_class_weights.*10 finite weights >= 0"):
        load_config(None, ["detection.heatmap_class_weights=[1.0, 2.0]"])
