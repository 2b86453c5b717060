"""The detection head's second stage (lss.models.heads.box_refiner.BoxRefiner and its loss): RoIAlign reads the BEV
features exactly at a box's centre and face middles, the loss on the dataset's padded ground truth equals the loss on
the box lists, the stage learns to move boxes towards the truth (not a no-op), a joint model's heads both learn, and
a refine checkpoint loads, predicts and exports."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import devices, val_statistics_checkpoint
from test_detection import random_boxes

from lss.config import Config, ConfigError, load_config, validate
from lss.data import collate
from lss.geometry import BevGrid
from lss.geometry.boxes import DETECTION_CLASSES, REFINE_TARGET_KEYS, apply_residuals, dense_targets
from lss.geometry.proposals import Proposals, ground_truth_proposals
from lss.geometry.boxes import BOX_POINTS, box_points
from lss.models.heads.box_refiner import BoxRefiner, read_grid
from lss.models.heads.detection import DetectionHead
from lss.models.heads.detection_decode import decode_detections
from lss.models.heads.detection_loss import detection_loss, refine_loss

GRID = BevGrid((-10.0, 10.0, 0.5), (-10.0, 10.0, 0.5), (-10.0, 10.0, 20.0))


def _bilinear(features, x, y, grid):
    """features C x H x W read at ego (x, y) with cell centres as samples (grid_sample, align_corners=False)."""
    H, W = features.shape[-2:]
    u, v = grid.xy_to_cells(x, y)  # continuous cells: row along ego x, column along ego y
    where = torch.stack([2 * v / W - 1, 2 * u / H - 1], -1).view(1, 1, -1, 2)
    return F.grid_sample(features[None], where, align_corners=False)[0, :, 0].T  # points x C


@pytest.mark.parametrize("device", devices())
def test_the_points_design_reads_the_features_at_the_box_centre_and_face_middles(device):
    g = torch.Generator().manual_seed(0)
    features = torch.randn(2, 6, 40, 40, generator=g, dtype=torch.float64).float().to(device)
    boxes = torch.tensor([[[2.3, -1.7, 0.0, 1.9, 4.4, 1.5, 0.6, 0, 0], [-4.1, 3.2, 0.0, 0.8, 0.7, 1.7, -2.5, 0, 0]],
                          [[6.2, 5.5, 0.0, 2.5, 10.0, 3.0, 1.571, 0, 0], [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0, 0]]])
    proposals = Proposals(boxes.to(device), torch.zeros(2, 2, device=device),
                          torch.zeros(2, 2, dtype=torch.long, device=device), torch.ones(2, 2, dtype=torch.bool,
                                                                                         device=device))
    read = read_grid(features, box_points(proposals.boxes), GRID)
    assert read.shape == (2, 2, len(BOX_POINTS), 6)
    for b in range(2):
        for p in range(2):
            x, y, _, w, length, _, yaw = boxes[b, p, :7].tolist()
            # centre, front, rear, left, right in the box's own frame, then rotated into ego
            local = [(0, 0), (length / 2, 0), (-length / 2, 0), (0, w / 2), (0, -w / 2)]
            px = torch.tensor([x + math.cos(yaw) * a - math.sin(yaw) * c for a, c in local])
            py = torch.tensor([y + math.sin(yaw) * a + math.cos(yaw) * c for a, c in local])
            want = _bilinear(features[b].cpu(), px, py, GRID)
            torch.testing.assert_close(read[b, p].cpu(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("features", ["points", "envelope"])
def test_both_designs_mask_invalid_slots_and_pass_gradients_only_through_valid_ones(features):
    g = torch.Generator().manual_seed(2)
    bev = torch.randn(2, 8, 40, 40, generator=g).requires_grad_(True)
    boxes = torch.zeros(2, 3, 9)
    boxes[..., 3:6] = torch.tensor([1.0, 2.0, 1.5])
    boxes[0, 0, :2], boxes[1, 2, :2] = torch.tensor([-6.0, 4.0]), torch.tensor([3.0, -3.0])
    valid = torch.tensor([[True, False, False], [False, False, True]])
    refiner = BoxRefiner(8, 10, roi_size=3, hidden=16, enlarge=1.0, features=features)
    torch.nn.init.normal_(refiner.residual.weight)
    scores, residuals, _ = refiner(bev, Proposals(boxes, torch.full((2, 3), 0.5), torch.zeros(2, 3, dtype=torch.long),
                                               valid), GRID)
    assert scores.shape == (2, 3) and residuals.shape == (2, 3, 9)
    assert scores[~valid].abs().sum() == 0 and residuals[~valid].abs().sum() == 0
    assert scores[valid].abs().min() > 0 and residuals[valid].abs().min() > 0
    (scores.sum() + residuals.sum()).backward()
    grad = bev.grad.abs().sum(1)
    # only around the two valid boxes (rows (x + 10) / 0.5, columns (y + 10) / 0.5); the invalid slots at the
    # origin (cells 20, 20) receive nothing
    assert grad[0, 6:10, 27:29].min() > 0 and grad[1, 25:27, 13:15].min() > 0
    assert grad[:, 17:22, 17:23].sum() == 0
    with pytest.raises(ValueError, match="points, envelope"):
        BoxRefiner(8, 10, features="corners")


def test_loss_on_the_padded_ground_truth_equals_the_loss_on_the_box_lists():
    g = torch.Generator().manual_seed(4)
    grid = BevGrid((-50.0, 50.0, 0.5), (-50.0, 50.0, 0.5), (-10.0, 10.0, 20.0))
    boxes = [random_boxes(6, g), torch.zeros(0, 9), random_boxes(9, g)]
    boxes[0][2, 7:9] = float("nan")  # an unknown velocity weighs nothing
    labels = [torch.randint(0, 3, (len(b),), generator=g) for b in boxes]
    dense = collate([dense_targets(b, lb, grid, max_objects=16) for b, lb in zip(boxes, labels)])
    assert dense["det_target_boxes"].shape == (3, 16, 9) and (dense["det_target_labels"] >= 0).sum() == 15
    proposals = ground_truth_proposals(boxes, labels, grid, len(DETECTION_CLASSES), torch.device("cpu"),
                                       torch.Generator().manual_seed(5))
    proposals = proposals.cat(Proposals(random_boxes(3 * 4, g).view(3, 4, 9), torch.rand(3, 4, generator=g),
                                        torch.randint(0, 3, (3, 4), generator=g), torch.ones(3, 4, dtype=torch.bool)))
    P = proposals.valid.shape[1]
    logits = torch.randn(3, P, generator=g, requires_grad=True)
    residuals = torch.randn(3, P, 9, generator=g, requires_grad=True)
    outputs = {"det_proposals": proposals, "det_refine_scores": logits, "det_refine_residuals": residuals}
    weights = torch.tensor(Config().detection.code_weights)
    from_lists = refine_loss(outputs, {"det_boxes": boxes, "det_labels": labels}, 2.0, weights)
    from_dense = refine_loss(outputs, {k: dense[k] for k in REFINE_TARGET_KEYS}, 2.0, weights)
    for k in from_lists:
        torch.testing.assert_close(from_dense[k], from_lists[k], rtol=1e-6, atol=1e-7)
        assert torch.isfinite(from_lists[k]) and from_lists[k] > 0
    grads = torch.autograd.grad(sum(from_lists.values()), (logits, residuals))
    assert torch.equal(grads[1][~proposals.valid], torch.zeros_like(grads[1][~proposals.valid]))
    # residual gradients only for the positives (the jittered truth is within 2 m of its box)
    assert (grads[1].abs().sum(-1) > 0).sum() >= 14


@pytest.mark.parametrize("design", ["points", "envelope"])
def test_the_second_stage_learns_to_move_boxes_towards_the_truth(design):
    """Trained on fixed features with the first stage frozen, the refined boxes of the jittered truth end closer to
    the truth than the proposals they refine: the stage is not the identity."""
    torch.manual_seed(0)
    config = Config()
    config.grid.xbound, config.grid.ybound = (-8.0, 8.0, 0.5), (-8.0, 8.0, 0.5)
    config.detection.head_channels, config.detection.refine, config.detection.refine_hidden = 16, True, 64
    config.detection.refine_features = design
    grid = BevGrid.from_config(config.grid)
    head = DetectionHead(8, config.detection, grid)
    g = torch.Generator().manual_seed(1)
    boxes = [torch.tensor([[3.3, -2.1, 0.4, 1.9, 4.4, 1.6, 0.7, 1.0, 0.5], [-4.2, 4.6, 0.8, 0.7, 0.6, 1.8, -2.0, 0, 0],
                           [-1.0, -5.0, 0.6, 2.0, 4.8, 1.7, 2.5, 0, 0]])]
    labels = [torch.tensor([0, 5, 0])]
    # BEV features that know where the objects are, as a trained encoder's do: the offset from each cell to the
    # nearest ground-truth centre (metres, channels 0 and 1) beside noise
    cx, cy = torch.meshgrid(torch.arange(32) * 0.5 - 7.75, torch.arange(32) * 0.5 - 7.75, indexing="ij")
    offsets = boxes[0][:, None, None, :2] - torch.stack([cx, cy], -1)
    nearest = offsets.norm(dim=-1).argmin(0)
    to_centre = offsets.gather(0, nearest[None, ..., None].expand(1, 32, 32, 2))[0].permute(2, 0, 1)
    features = torch.cat([to_centre, torch.randn(6, 32, 32, generator=g)])[None]
    optimizer = torch.optim.Adam(head.refiner.parameters(), lr=3e-3)
    batch = {"det_boxes": boxes, "det_labels": labels}
    for _ in range(600):
        optimizer.zero_grad()
        out = head(features, gt_boxes=boxes, gt_labels=labels)
        losses = detection_loss(out, batch, config)
        (losses["det_refine_score"] + losses["det_refine_box"]).backward()
        optimizer.step()
    before, after, quality = [], [], []
    with torch.no_grad():
        for _ in range(5):  # five draws of the jitter
            out = head(features, gt_boxes=boxes, gt_labels=labels)
            proposals = out["det_proposals"]
            truth = proposals.valid.clone()
            truth[:, : config.detection.refine_proposals] = False  # the jittered ground truth slots
            assert truth.sum() == 3
            refined = apply_residuals(proposals.boxes, out["det_refine_residuals"])
            before.append((proposals.boxes[truth][:, :2] - boxes[0][:, :2]).norm(dim=1))
            after.append((refined[truth][:, :2] - boxes[0][:, :2]).norm(dim=1))
            quality.append(torch.sigmoid(out["det_refine_scores"][truth]))
    assert torch.cat(after).mean() < 0.6 * torch.cat(before).mean()
    # the quality score follows the distance to the truth: near boxes score above the mean of the far proposals
    far = out["det_proposals"].valid[:, : config.detection.refine_proposals]
    assert torch.cat(quality).mean() > torch.sigmoid(out["det_refine_scores"][:, : config.detection.refine_proposals][
        far]).mean()


def test_decoding_applies_the_chosen_residuals_and_the_score_blend():
    """decode_detections with the second stage: the boxes take the residuals of detection.refine_residuals only, the
    score is first stage^(1 - a) x quality^a, invalid slots are dropped and the rest sorted by that score."""
    g = torch.Generator().manual_seed(5)
    boxes = random_boxes(4, g).unsqueeze(0)
    proposals = Proposals(boxes, torch.tensor([[0.9, 0.4, 0.6, 0.8]]), torch.tensor([[0, 5, 0, 7]]),
                          torch.tensor([[True, True, True, False]]))
    residuals = torch.randn(1, 4, 9, generator=g) * 0.3
    logits = torch.tensor([[-1.0, 2.0, 0.5, 3.0]])
    outputs = {"det_proposals": proposals, "det_refine_scores": logits, "det_refine_residuals": residuals}
    config = Config()
    config.detection.refine = True
    for alpha, parts in [(0.5, ("centre", "size", "yaw", "velocity")), (1.0, ("yaw",)), (0.0, ())]:
        config.detection.refine_score_alpha, config.detection.refine_residuals = alpha, parts
        det = decode_detections(outputs, config)[0]
        score = proposals.scores[0, :3] ** (1 - alpha) * torch.sigmoid(logits[0, :3]) ** alpha
        order = torch.argsort(score, descending=True)
        torch.testing.assert_close(det["scores"], score[order])
        assert det["labels"].tolist() == proposals.labels[0, :3][order].tolist()
        expected = apply_residuals(boxes[0, :3], residuals[0, :3], parts)[order]
        torch.testing.assert_close(det["boxes"], expected)
        channels = {"centre": {0, 1, 2}, "size": {3, 4, 5}, "yaw": {6}, "velocity": {7, 8}}
        moved = set().union(*(channels[p] for p in parts))
        changed = (det["boxes"] != boxes[0, :3][order]).any(0)
        assert changed.tolist() == [i in moved for i in range(9)]
    for bad in (("yaw", "heading"), ("yaw", "yaw")):
        config.detection.refine_residuals = bad
        with pytest.raises(ConfigError, match="expected distinct names from \\['centre', 'size', 'yaw', 'velocity'\\]"):
            validate(config)


@pytest.mark.parametrize("camera_depth, camera_image", [(False, False), (True, False), (True, True)])
def test_a_joint_model_trains_both_heads_and_its_refine_checkpoint_predicts_and_exports(synthetic_root, tmp_path,
                                                                                        camera_depth, camera_image):
    from test_model import TINY

    from lss.data.loader import build_dataset
    from lss.engine.predictor import Predictor
    from lss.export import export_checkpoint
    from lss.models.build import build_model
    from lss.models.losses import TotalLoss

    cfg = load_config(None, TINY + [f"data.dataroot={synthetic_root}", "model.heads=[segmentation, detection]",
                                    "detection.head_channels=8", "detection.refine=true", "detection.refine_hidden=16",
                                    "detection.refine_proposals=8", f"detection.refine_depth={camera_depth}",
                                    f"detection.refine_image={camera_image}"])
    dataset = build_dataset(cfg, cfg.data.train_split, True, verbose=False)
    batch = collate([dataset[0], dataset[1]])
    model = build_model(cfg).train()
    losses = TotalLoss(cfg)(model(batch), batch)
    losses["loss"].backward()
    assert {"loss/det_refine_score", "loss/det_refine_box", "loss/det_heatmap"} <= set(losses)
    grads = {name: p.grad for name, p in model.named_parameters()}
    seg = [g for n, g in grads.items() if n.startswith("segmentation.")]
    refiner = [g for n, g in grads.items() if n.startswith("detection.refiner.")]
    trunk = [g for n, g in grads.items() if n.startswith("bev.")]
    assert seg and refiner and trunk
    assert all(g is not None and g.abs().sum() > 0 for g in seg + refiner + trunk)
    first = model.detection.refiner.mlp[0].weight.grad
    image = model.detection.refiner.image_width
    assert image == (5 * (cfg.model.context_channels + 1) if camera_image else 0)
    if camera_depth:  # the depth cues come after the geometry, the image features last: read and trained on
        assert first[:, first.shape[1] - image - 7:first.shape[1] - image].abs().sum() > 0
        assert model.camera.head.weight.grad.abs().sum() > 0
    if camera_image:
        assert first[:, -image:].abs().sum() > 0

    ckpt = val_statistics_checkpoint(cfg, tmp_path / "refine.pt", step=3)
    result = Predictor(ckpt, "cpu").predict_batch(collate([build_dataset(cfg, cfg.data.val_split, False,
                                                                         verbose=False)[0]]))[0]
    assert result.boxes.shape[1] == 9 and len(result.boxes) == len(result.scores) > 0
    assert np.all(np.diff(result.scores) <= 0)
    pytest.importorskip("onnx")
    done = export_checkpoint(cfg, ckpt, tmp_path / "refine.onnx")
    assert done["path"].exists()


def test_the_quality_targets_follow_the_distance_to_the_truth():
    from lss.models.heads.detection_loss import quality_target

    distance = torch.tensor([0.0, 0.3, 0.7, 1.5, 3.0, 5.0, float("inf")])
    torch.testing.assert_close(quality_target(distance, 2.0, "distance"),
                               torch.tensor([1.0, 0.85, 0.65, 0.25, 0.0, 0.0, 0.0]))
    # the share of the evaluation's matching distances 0.5, 1, 2, 4 m within which the box is a true positive
    torch.testing.assert_close(quality_target(distance, 2.0, "thresholds"),
                               torch.tensor([1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]))
    with pytest.raises(ValueError, match="distance or thresholds"):
        quality_target(distance, 2.0, "iou")


def test_the_refine_score_loss_trains_towards_the_configured_quality():
    truth = torch.tensor([[[0.0, 0.0, 0.5, 2.0, 4.5, 1.6, 0.0, 0.0, 0.0]]])
    boxes = truth.repeat(1, 4, 1)
    boxes[0, :, 0] += torch.tensor([0.3, 1.5, 3.0, 6.0])  # proposals 0.3, 1.5, 3 and 6 m from the truth
    proposals = Proposals(boxes, torch.full((1, 4), 0.5), torch.zeros(1, 4, dtype=torch.long),
                          torch.ones(1, 4, dtype=torch.bool))
    logits = torch.zeros(1, 4, requires_grad=True)
    outputs = {"det_proposals": proposals, "det_refine_scores": logits,
               "det_refine_residuals": torch.zeros(1, 4, 9)}
    batch = {"det_boxes": [truth[0]], "det_labels": [torch.tensor([0])]}
    weights = torch.tensor(Config().detection.code_weights)
    for kind, target in (("distance", [0.85, 0.25, 0.0, 0.0]), ("thresholds", [1.0, 0.5, 0.25, 0.0])):
        loss = refine_loss(outputs, batch, 2.0, weights, kind)["det_refine_score"]
        (grad,) = torch.autograd.grad(loss, logits)
        # BCE with logits at 0: d/dlogit = (sigmoid(0) - target) / 4 proposals
        torch.testing.assert_close(grad[0], (0.5 - torch.tensor(target)) / 4)
    assert load_config(None, ["detection.refine_quality=thresholds"]).detection.refine_quality == "thresholds"
    with pytest.raises(ConfigError, match="refine_quality"):
        load_config(None, ["detection.refine_quality=iou"])


def test_the_detection_loss_takes_the_configured_quality():
    config = Config()
    config.grid.xbound, config.grid.ybound = (-8.0, 8.0, 0.5), (-8.0, 8.0, 0.5)
    config.detection.head_channels, config.detection.refine, config.detection.refine_hidden = 8, True, 16
    torch.manual_seed(0)
    head = DetectionHead(8, config.detection, BevGrid.from_config(config.grid))
    boxes = [torch.tensor([[3.3, -2.1, 0.4, 1.9, 4.4, 1.6, 0.7, 1.0, 0.5]])]
    labels = [torch.tensor([0])]
    out = head(torch.randn(1, 8, 32, 32), gt_boxes=boxes, gt_labels=labels)
    batch = {"det_boxes": boxes, "det_labels": labels}
    weights = torch.tensor(config.detection.code_weights)
    scores = {}
    for kind in ("distance", "thresholds"):
        config.detection.refine_quality = kind
        scores[kind] = detection_loss(out, batch, config)["det_refine_score"]
        expected = refine_loss(out, batch, config.detection.match_distance, weights, kind)["det_refine_score"]
        torch.testing.assert_close(scores[kind], expected * config.detection.refine_weight)
    assert scores["distance"] != scores["thresholds"]  # the jittered truth lies between 0 and 2 m of its box
