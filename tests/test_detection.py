import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import devices

from lss.geometry.boxes import DETECTION_CLASSES, apply_residuals, bev_envelopes, box_residuals, encode_targets
from lss.geometry.proposals import Proposals, ground_truth_proposals
from lss.config import Config, ConfigError, validate
from lss.geometry import BevGrid
from lss.models.heads.box_refiner import BoxRefiner
from lss.models.heads.detection import DetectionHead
from lss.models.heads.detection_decode import decode_detections, decode_peaks, propose, training_proposals
from lss.models.heads.detection_loss import detection_loss

GRID = BevGrid.from_config(Config().grid).with_shape((200, 200))


def detection_head(in_channels: int, config: Config) -> DetectionHead:
    return DetectionHead(in_channels, config.detection, BevGrid.from_config(config.grid))


def refining_config() -> Config:
    """The head with its second stage on a 64 x 64 map of 0.5 m cells."""
    config = Config()
    config.detection.refine = True
    config.grid.xbound, config.grid.ybound = (-16.0, 16.0, 0.5), (-16.0, 16.0, 0.5)
    return config


def random_boxes(n: int, generator: torch.Generator, spacing: float = 8.0) -> torch.Tensor:
    """n boxes M x 9 on a jittered lattice `spacing` metres apart (their heatmap peaks never merge), negative
    coordinates included, with random sizes, yaw in (-pi, pi) and velocities."""
    side = math.ceil(math.sqrt(n))
    lattice = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij"), -1).reshape(-1, 2)
    lattice = lattice[torch.randperm(len(lattice), generator=generator)[:n]].float()
    centre = (lattice - (side - 1) / 2) * spacing + torch.rand(n, 2, generator=generator) * 2 - 1
    z = torch.rand(n, 1, generator=generator) * 2 - 1
    size = torch.rand(n, 3, generator=generator) * torch.tensor([2.0, 4.0, 2.0]) + 0.5
    yaw = (torch.rand(n, 1, generator=generator) * 2 - 1) * (math.pi - 1e-3)
    velocity = torch.randn(n, 2, generator=generator) * 3
    return torch.cat([centre, z, size, yaw, velocity], 1)


def perfect_outputs(targets: dict, grid: BevGrid) -> dict:
    """Head outputs that predict the encoded targets exactly: heatmap logits of the gaussians, the regression
    targets written at the centre cells."""
    heat = targets["heatmap"]
    logits = torch.logit(heat.clamp(1e-4, 1 - 1e-4))
    regression = torch.zeros(heat.shape[0], 10, grid.nx, grid.ny, device=heat.device)
    regression[targets["batch"], :, targets["row"], targets["col"]] = targets["regression"]
    return {"det_heatmap": logits, "det_regression": regression}


def test_heatmap_targets_peak_at_centres():
    boxes = torch.tensor([[10.2, -7.7, 0.0, 2.0, 4.5, 1.6, 0.3, 1.0, 0.0],
                          [-30.1, 20.4, 0.5, 0.6, 0.7, 1.8, -1.0, float("nan"), float("nan")]])
    labels = torch.tensor([0, 5])
    t = encode_targets([boxes], [labels], GRID)
    heat = t["heatmap"][0]
    rows = torch.floor((boxes[:, 0] + 50) / 0.5).long()
    cols = torch.floor((boxes[:, 1] + 50) / 0.5).long()
    assert heat[labels, rows, cols].tolist() == [1.0, 1.0]
    assert int((heat == 1).sum()) == 2
    # The pedestrian's gaussian has at least min_radius (2) cells and decays away from the centre.
    assert heat[5, rows[1] + 2, cols[1]] > 0 and heat[5, rows[1] + 1, cols[1]] > heat[5, rows[1] + 2, cols[1]]
    assert heat[5, rows[1] + 4, cols[1]] == 0
    # Unknown velocity: masked out of the regression, not NaN.
    assert torch.isfinite(t["regression"]).all()
    assert t["regression_mask"][1, 8:].tolist() == [0.0, 0.0] and t["regression_mask"][0].min() == 1
    offset = t["regression"][:, :2]
    assert ((offset >= 0) & (offset < 1)).all()


def test_boxes_off_the_map_are_dropped():
    boxes = torch.tensor([[60.0, 0.0, 0.0, 2.0, 4.0, 1.5, 0.0, 0.0, 0.0],
                          [0.0, -50.1, 0.0, 2.0, 4.0, 1.5, 0.0, 0.0, 0.0]])
    t = encode_targets([boxes, torch.zeros(0, 9)], [torch.tensor([0, 1]), torch.zeros(0, dtype=torch.long)], GRID)
    assert t["heatmap"].sum() == 0 and len(t["labels"]) == 0


@pytest.mark.parametrize("device", devices())
def test_encode_decode_round_trip(device):
    g = torch.Generator().manual_seed(0)
    boxes = [random_boxes(40, g), random_boxes(25, g)]
    labels = [torch.randint(0, 10, (40,), generator=g), torch.randint(0, 10, (25,), generator=g)]
    targets = encode_targets(boxes, labels, GRID, device=torch.device(device))
    outputs = perfect_outputs(targets, GRID)
    # The model runs channels_last.
    heatmap, regression = (outputs[k].contiguous(memory_format=torch.channels_last)
                           for k in ("det_heatmap", "det_regression"))
    proposals = propose(heatmap, regression, GRID, Config().detection, max_per_sample=100)
    proposals = Proposals(*(t.cpu() for t in (proposals.boxes, proposals.scores, proposals.labels, proposals.valid)))
    for b in range(2):
        valid = proposals.valid[b]
        assert int(valid.sum()) == len(boxes[b])
        decoded, decoded_labels = proposals.boxes[b][valid], proposals.labels[b][valid]
        # Pair each decoded box with the nearest ground truth: the same class, the same box.
        nearest = torch.cdist(decoded[:, :2], boxes[b][:, :2]).argmin(1)
        assert sorted(nearest.tolist()) == list(range(len(boxes[b])))
        assert torch.equal(decoded_labels, labels[b][nearest])
        torch.testing.assert_close(decoded, boxes[b][nearest], atol=1e-4, rtol=1e-5)


def test_nms_suppresses_same_class_overlaps_only():
    boxes = torch.tensor([[5.0, -5.0, 0, 2.0, 4.0, 1.5, 0, 0, 0],
                          [5.2, -5.0, 0, 2.0, 4.0, 1.5, 0, 0, 0],
                          [5.2, -5.0, 0, 2.0, 4.0, 1.5, 0, 0, 0]])
    cfg = Config().detection
    logits = torch.full((1, 10, 200, 200), -10.0)
    regression = torch.zeros(1, 10, 200, 200)
    # Three peaks one cell apart: 0 and 1 are cars (overlapping, 1 suppressed), 2 is a truck.
    cells = [(110, 90), (110, 92), (110, 94)]
    scores = [0.9, 0.8, 0.7]
    for (r, c), label, s, box in zip(cells, [0, 0, 1], scores, boxes):
        logits[0, label, r, c] = math.log(s / (1 - s))
        regression[0, :, r, c] = torch.tensor([0.5, 0.5, 0, *torch.log(box[3:6]).tolist(), 0, 1, 0, 0])
    p = propose(logits, regression, GRID, cfg, 10)
    kept = sorted(zip(p.labels[0][p.valid[0]].tolist(), p.scores[0][p.valid[0]].tolist()))
    assert [(lab, round(s, 4)) for lab, s in kept] == [(0, 0.9), (1, 0.7)]
    cfg.nms_iou = 0.0
    p = propose(logits, regression, GRID, cfg, 10)
    assert int(p.valid.sum()) == 3
    p = propose(logits, regression, GRID, cfg, 2)
    assert p.scores[0].tolist() == pytest.approx([0.9, 0.8])


def test_empty_heatmap_gives_no_detections():
    config = Config()
    outputs = {"det_heatmap": torch.full((2, 10, 16, 16), -20.0), "det_regression": torch.zeros(2, 10, 16, 16)}
    dets = decode_detections(outputs, config)
    assert [len(d["boxes"]) for d in dets] == [0, 0] and dets[0]["boxes"].shape == (0, 9)


def test_residuals_round_trip():
    g = torch.Generator().manual_seed(1)
    a, b = random_boxes(30, g), random_boxes(30, g)
    torch.testing.assert_close(apply_residuals(a, box_residuals(a, b))[:, [0, 1, 2, 3, 4, 5, 7, 8]],
                               b[:, [0, 1, 2, 3, 4, 5, 7, 8]], atol=1e-4, rtol=1e-5)
    yaw = apply_residuals(a, box_residuals(a, b))[:, 6]
    assert torch.allclose(torch.sin(yaw), torch.sin(b[:, 6]), atol=1e-5)
    assert torch.allclose(torch.cos(yaw), torch.cos(b[:, 6]), atol=1e-5)
    assert box_residuals(a, b)[:, 6].abs().max() <= math.pi


def test_envelope_of_rotated_box():
    box = torch.tensor([[1.0, -2.0, 0, 2.0, 4.0, 1.0, math.pi / 2, 0, 0]])
    torch.testing.assert_close(bev_envelopes(box), torch.tensor([[0.0, -4.0, 2.0, 0.0]]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("device", devices())
def test_second_stage_gradients_reach_bev_features_through_roi_align(device):
    g = torch.Generator().manual_seed(2)
    features = torch.randn(2, 8, 40, 40, generator=g).to(device).requires_grad_(True)
    grid = BevGrid((-10.0, 10.0, 0.5), (-10.0, 10.0, 0.5), (-10.0, 10.0, 20.0))
    boxes = torch.zeros(2, 2, 9)
    boxes[..., 3:6] = torch.tensor([1.0, 2.0, 1.5])
    boxes[0, 0, :2] = torch.tensor([-6.0, 4.0])
    boxes[1, 0, :2] = torch.tensor([3.0, -3.0])
    proposals = Proposals(boxes.to(device), torch.full((2, 2), 0.5, device=device),
                          torch.zeros(2, 2, dtype=torch.long, device=device),
                          torch.tensor([[True, False], [True, False]], device=device))
    refiner = BoxRefiner(8, 10, roi_size=3, hidden=16, enlarge=1.0).to(device)
    torch.nn.init.normal_(refiner.residual.weight)
    scores, residuals, reversal = refiner(features, proposals, grid)
    assert reversal is None  # detection.refine_reversal off
    assert residuals[:, 1].abs().sum() == 0 and scores[:, 1].abs().sum() == 0
    (scores.sum() + residuals.sum()).backward()
    grad = features.grad.abs().sum(1).cpu()  # B x H x W
    # Non-zero inside each proposal's footprint (cells around row (x+10)/0.5, column (y+10)/0.5), zero elsewhere.
    assert grad[0, 6:10, 27:29].min() > 0 and grad[1, 25:27, 13:15].min() > 0
    assert grad[0, 20:, :].sum() == 0 and grad[1, :15, :].sum() == 0
    assert grad[0, :, :20].sum() == 0 and grad[1, :, 20:].sum() == 0


def test_head_losses_train_end_to_end():
    torch.manual_seed(0)
    config = refining_config()
    head = detection_head(16, config)
    features = torch.randn(2, 16, 64, 64, requires_grad=True)
    boxes = [torch.tensor([[3.0, -4.0, 0.2, 1.9, 4.4, 1.6, 0.4, 2.0, 0.5]]),
             torch.tensor([[-8.0, 6.0, 0.0, 0.7, 0.7, 1.8, -1.2, float("nan"), float("nan")],
                           [10.0, 10.0, 0.5, 2.5, 11.0, 3.2, 3.0, 0.0, 0.0]])]
    labels = [torch.tensor([0]), torch.tensor([5, 2])]
    batch = {"det_boxes": boxes, "det_labels": labels}
    grid = BevGrid.from_config(config.grid)
    out = head(features, ground_truth_proposals(boxes, labels, grid, head.num_classes, features.device))
    losses = detection_loss(out, batch, config)
    assert set(losses) == {"det_heatmap", "det_regression", "det_refine_score", "det_refine_box"}
    assert all(torch.isfinite(v) and v > 0 for v in losses.values())
    # The jittered ground truth joined the proposals, so the second stage sees positives from the first step.
    assert out["det_proposals"].valid.sum() >= 3
    losses["det_refine_score"].backward(retain_graph=True)
    assert features.grad.abs().sum() > 0
    features.grad = None
    # The head's refinement gradient reaches only the second stage and the shared trunk, not the first-stage
    # branches (the proposals are detached).
    head.zero_grad()
    losses["det_refine_box"].backward()
    assert head.refiner.residual.weight.grad.abs().sum() > 0
    assert head.heatmap[-1].weight.grad is None or head.heatmap[-1].weight.grad.abs().sum() == 0


def test_head_forward_sees_features_only_and_scores_extra_proposals_by_its_heatmap():
    torch.manual_seed(0)
    config = refining_config()
    head = detection_head(16, config).train()
    features = torch.randn(2, 16, 64, 64)
    out = head(features)  # training mode, no labels anywhere
    grid = BevGrid.from_config(config.grid)
    # while training: the refine_proposals best peaks in fixed shapes, valid above the score threshold, no NMS
    first = training_proposals(out["det_heatmap"].detach(), out["det_regression"].detach(), grid, config.detection)
    assert torch.equal(out["det_proposals"].boxes, first.boxes) and torch.equal(out["det_proposals"].valid, first.valid)
    assert first.valid.shape == (2, config.detection.refine_proposals)
    assert out["det_refine_scores"].shape == first.valid.shape
    assert torch.equal(first.valid, first.scores > config.detection.score_threshold)
    peaks, scores, _ = decode_peaks(out["det_heatmap"], out["det_regression"], grid, config.detection.refine_proposals)
    assert torch.equal(first.boxes, peaks) and torch.equal(first.scores, scores)
    head.eval()
    evaluated = head(features)
    nms = propose(evaluated["det_heatmap"], evaluated["det_regression"], grid, config.detection,
                  config.detection.max_detections)
    evaluated = evaluated["det_proposals"]
    assert torch.equal(evaluated.boxes, nms.boxes) and torch.equal(evaluated.valid, nms.valid)
    head.train()

    boxes = [torch.tensor([[3.0, -4.0, 0.2, 1.9, 4.4, 1.6, 0.4, 2.0, 0.5]]), torch.zeros(0, 9)]
    extra = ground_truth_proposals(boxes, [torch.tensor([2]), torch.zeros(0, dtype=torch.long)], grid,
                                   head.num_classes, features.device, torch.Generator().manual_seed(0))
    out = head(features, extra)
    proposals, P = out["det_proposals"], first.valid.shape[1]
    assert proposals.valid.shape == (2, P + 1) and proposals.valid[:, P].tolist() == [True, False]
    assert torch.equal(proposals.boxes[:, P], extra.boxes[:, 0]) and proposals.labels[0, P] == 2
    row, col = (int((extra.boxes[0, 0, i] + 16.0) // 0.5) for i in (0, 1))
    assert proposals.scores[0, P] == torch.sigmoid(out["det_heatmap"][0, 2, row, col]).item()
    assert proposals.scores[1, P] == 0


def test_head_jitters_the_ground_truth_it_is_given_into_proposals_only_while_training():
    torch.manual_seed(0)
    config = refining_config()
    head = detection_head(16, config).train()
    features = torch.randn(2, 16, 64, 64)
    boxes = [torch.tensor([[3.0, -4.0, 0.2, 1.9, 4.4, 1.6, 0.4, 2.0, 0.5]]), torch.zeros(0, 9)]
    labels = [torch.tensor([2]), torch.zeros(0, dtype=torch.long)]
    torch.manual_seed(7)
    given = head(features, gt_boxes=boxes, gt_labels=labels)["det_proposals"]
    torch.manual_seed(7)
    extra = ground_truth_proposals(boxes, labels, BevGrid.from_config(config.grid), head.num_classes, features.device)
    want = head(features, extra)["det_proposals"]
    assert torch.equal(given.boxes, want.boxes) and torch.equal(given.valid, want.valid)
    assert torch.equal(given.scores, want.scores) and given.valid.shape[1] == head(features)["det_proposals"].valid.shape[1] + 1
    config.detection.refine_gt_proposals = False
    assert torch.equal(head(features, gt_boxes=boxes, gt_labels=labels)["det_proposals"].valid,
                       head(features)["det_proposals"].valid)
    config.detection.refine_gt_proposals = True
    head.eval()
    assert torch.equal(head(features, gt_boxes=boxes, gt_labels=labels)["det_proposals"].valid,
                       head(features)["det_proposals"].valid)


@pytest.mark.slow
def test_head_overfits_one_sample():
    torch.manual_seed(0)
    config = Config()
    config.grid.xbound, config.grid.ybound = (-8.0, 8.0, 0.5), (-8.0, 8.0, 0.5)
    config.detection.head_channels = 16
    config.detection.refine = True
    config.detection.refine_hidden = 32
    config.detection.refine_proposals = 16
    head = detection_head(8, config)
    features = torch.randn(1, 8, 32, 32)
    boxes = [torch.tensor([[3.3, -2.1, 0.4, 1.9, 4.4, 1.6, 0.7, 1.0, 0.5],
                           [-4.2, 4.6, 0.8, 0.7, 0.6, 1.8, -2.0, 0.3, 0.1]])]
    labels = [torch.tensor([0, 5])]
    batch = {"det_boxes": boxes, "det_labels": labels}
    grid = BevGrid.from_config(config.grid)
    optimizer = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(80):
        optimizer.zero_grad()
        extra = ground_truth_proposals(boxes, labels, grid, head.num_classes, features.device)
        loss = sum(detection_loss(head(features, extra), batch, config).values())
        loss.backward()
        optimizer.step()
    head.eval()
    with torch.no_grad():
        det = decode_detections(head(features), config)[0]
    assert det["labels"][:2].sort().values.tolist() == [0, 5]
    top = det["boxes"][:2][det["labels"][:2].argsort()]
    assert (top[:, :2] - boxes[0][:, :2]).norm(dim=1).max() < 0.5
    assert det["scores"][1] > 0.3 and (len(det["scores"]) == 2 or det["scores"][2] < det["scores"][1] / 2)


def test_bad_inputs_have_clear_errors():
    with pytest.raises(ValueError, match="expected boxes M x 9"):
        encode_targets([torch.zeros(3, 7)], [torch.zeros(3, dtype=torch.long)], GRID)
    with pytest.raises(ValueError, match="matching the boxes"):
        encode_targets([torch.zeros(3, 9)], [torch.zeros(2, dtype=torch.long)], GRID)
    with pytest.raises(ValueError, match="integer labels"):
        encode_targets([torch.zeros(1, 9)], [torch.zeros(1)], GRID)
    with pytest.raises(ValueError, match="regression B x 10"):
        decode_peaks(torch.zeros(1, 10, 8, 8), torch.zeros(1, 9, 8, 8), GRID, 5)
    config = Config()
    config.detection.max_detections = 600
    with pytest.raises(ConfigError, match="at most 500 boxes"):
        validate(config)
    config = Config()
    config.detection.code_weights = (1.0,) * 9
    with pytest.raises(ConfigError, match="expected 10 weights"):
        validate(config)
    with pytest.raises(KeyError, match="data.detection_targets"):
        detection_loss({"det_heatmap": torch.zeros(1, 10, 8, 8), "det_regression": torch.zeros(1, 10, 8, 8)}, {},
                       Config())


def devkit_ground_truth(nusc, sample_token: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The sample's detection-class annotations that the evaluation keeps (lidar or radar points inside), as ego
    boxes M x 9 in the LIDAR_TOP ego frame and labels M, converted straight from the devkit's tables."""
    from nuscenes.eval.detection.utils import category_to_detection_name
    from pyquaternion import Quaternion

    sample = nusc.get("sample", sample_token)
    pose = nusc.get("ego_pose", nusc.get("sample_data", sample["data"]["LIDAR_TOP"])["ego_pose_token"])
    ego_rot, ego_t = Quaternion(pose["rotation"]).rotation_matrix, np.asarray(pose["translation"])
    boxes, labels = [], []
    for token in sample["anns"]:
        ann = nusc.get("sample_annotation", token)
        name = category_to_detection_name(ann["category_name"])
        if name is None or ann["num_lidar_pts"] + ann["num_radar_pts"] == 0:
            continue
        centre = ego_rot.T @ (np.asarray(ann["translation"]) - ego_t)
        rot = ego_rot.T @ Quaternion(ann["rotation"]).rotation_matrix
        velocity = ego_rot.T @ np.nan_to_num(nusc.box_velocity(token))
        boxes.append([*centre, *ann["size"], math.atan2(rot[1, 0], rot[0, 0]), *velocity[:2]])
        labels.append(DETECTION_CLASSES.index(name))
    return torch.tensor(boxes, dtype=torch.float32).reshape(-1, 9), torch.tensor(labels, dtype=torch.long)


@pytest.mark.slow
def test_perfect_detections_score_map_one_in_the_official_evaluation(synthetic_root, tmp_path):
    from lss.data.nuscenes import load_tables
    from lss.engine.detection_eval import (DetectionCollector, build_submission, evaluate_submission,
                                           split_sample_tokens)

    nusc = load_tables(synthetic_root, "v1.0-mini")
    tokens = split_sample_tokens(nusc, "mini_val")
    assert tokens
    config = Config()
    grid = BevGrid.from_config(config.grid).with_shape((200, 200))
    ground_truth = [devkit_ground_truth(nusc, t) for t in tokens]
    boxes, labels = [g[0] for g in ground_truth], [g[1] for g in ground_truth]
    outputs = perfect_outputs(encode_targets(boxes, labels, grid), grid)
    collector = DetectionCollector(config)
    collector.add(outputs, {"sample_token": tokens})
    split = SimpleNamespace(root=synthetic_root, version="v1.0-mini", devkit_split="mini_val")
    summary = collector.evaluate_dataset(split, tmp_path)

    present = summary["classes_with_gt"]
    assert present and summary["num_samples"] == len(tokens)
    for name in present:
        assert summary["per_class"][name]["AP"] == pytest.approx(1.0), name
        assert summary["per_class"][name]["trans_err"] == pytest.approx(0.0, abs=1e-3), name
        assert summary["per_class"][name]["scale_err"] == pytest.approx(0.0, abs=1e-3), name
    assert summary["mAP_classes_with_gt"] == pytest.approx(1.0)
    # The official mAP averages all 10 classes; a class without ground truth scores 0.
    assert summary["mAP"] == pytest.approx(len(present) / len(DETECTION_CLASSES))
    for name in set(DETECTION_CLASSES) - set(present):
        assert summary["per_class"][name]["AP"] == 0.0
    assert (tmp_path / "detection_metrics.json").is_file()
    assert "| car |" in (tmp_path / "detection_metrics.md").read_text()
    submission = json.loads((tmp_path / "detection_submission.json").read_text())
    assert set(submission["results"]) == set(tokens) and submission["meta"]["use_camera"] is True

    # Only the samples that were evaluated count (eval.max_batches).
    partial = DetectionCollector(config)
    partial.detections = {tokens[0]: collector.detections[tokens[0]]}
    first = partial.evaluate_dataset(split, tmp_path / "partial")
    assert first["num_samples"] == 1 and first["mAP_classes_with_gt"] == pytest.approx(1.0)

    # The same boxes 0.75 m off: all missed at the 0.5 m matching distance, mostly matched at 1, 2 and 4 m (greedy
    # matching can pair a box with a neighbour in a crowd).
    for det in collector.detections.values():
        det["boxes"][:, 0] += 0.75
    shifted = evaluate_submission(nusc, build_submission(collector.detections, nusc, "mini_val"), "mini_val",
                                  tmp_path / "shifted")
    for name in present:
        assert shifted["per_class"][name]["AP_per_distance"]["0.5"] == 0.0, name
        assert 0.5 < shifted["per_class"][name]["trans_err"] < 1.0, name
    assert 0.6 < shifted["mAP_classes_with_gt"] <= 0.75

    # Detections of a sample outside the evaluated split are a user error that names the config key.
    from lss.errors import DatasetError

    train_token = split_sample_tokens(nusc, "mini_train")[0]
    with pytest.raises(DatasetError, match=f"sample {train_token} is not in the evaluation split 'mini_val'.*val_split"):
        build_submission({train_token: collector.detections[tokens[0]]}, nusc, "mini_val")


def test_camera_projection_inverts_frustum_to_ego():
    from lss.geometry import ego_to_pixels, frustum_to_ego, load_nuscenes_rig

    intrinsics, rot, trans = load_nuscenes_rig()
    n = intrinsics.shape[0]
    scale = 0.22
    post_rot = torch.diag(torch.tensor([scale, scale, 1.0])).expand(n, 3, 3).clone()
    post_rot[:, :2, :2] = post_rot[:, :2, :2] @ torch.tensor([[0.99, -0.14], [0.14, 0.99]])
    post_trans = torch.tensor([-3.0, -40.0, 0.0]).expand(n, 3).clone()
    pixels = torch.tensor([[[[20.0, 30.0, 7.5], [300.0, 90.0, 31.0]]]])  # D x fH x fW x 3 (u, v, d), augmented
    ego = frustum_to_ego(pixels, intrinsics[None], rot[None], trans[None], post_rot[None], post_trans[None])[0]
    for cam in range(n):
        uv, depth = ego_to_pixels(ego[cam].numpy(), intrinsics[cam].numpy(), rot[cam].numpy(),
                                  trans[cam].numpy(), post_rot[cam].numpy(), post_trans[cam].numpy())
        np.testing.assert_allclose(uv.reshape(-1, 2), pixels[..., :2].reshape(-1, 2).numpy(), atol=1e-3)
        np.testing.assert_allclose(depth.reshape(-1), pixels[..., 2].reshape(-1).numpy(), rtol=1e-5)


def test_bev_boxes_drawn_forward_up_left_on_the_left():
    from lss.geometry.boxes import box_corners
    from lss.viz.detection import draw_bev_boxes
    from lss.geometry import BevGrid
    from lss.viz import BevView

    corners = box_corners(np.array([[1.0, 2.0, 3.0, 2.0, 4.0, 1.0, math.pi / 2, 0, 0]]))[0]
    # Heading +90 degrees: the front corners (first and fourth) lie towards +y, the top face 0.5 m up.
    assert np.allclose(corners[[0, 3], 1], 4.0) and np.allclose(corners[[1, 2], 1], 0.0)
    assert np.allclose(corners[:4, 2], 2.5) and np.allclose(corners[4:, 2], 3.5)
    panel = np.zeros((200, 200, 3), np.uint8)
    # 100 x 100 grid of 1 m cells around the ego car, panel at 2 pixels per cell.
    box = np.array([[20.0, 30.0, 0.0, 4.0, 4.0, 1.5, 0.0, 0.0, 0.0]])
    draw_bev_boxes(panel, box, BevView(BevGrid.planar((-50.0, 50.0, 1.0), (-50.0, 50.0, 1.0)), 200, 200),
                   (255, 0, 0))
    rows, cols = np.nonzero(panel[..., 0])
    # x = 20 m forward -> above the centre row (100); y = 30 m left -> left of the centre column.
    assert abs(rows.mean() - (100 - 2 * 20)) < 2 and abs(cols.mean() - (100 - 2 * 30)) < 2
    assert rows.max() - rows.min() == pytest.approx(8, abs=2)


@pytest.mark.slow
def test_train_eval_viz_with_the_detection_head(synthetic_root, tmp_path):
    from lss.engine.demo import demo

    tiny = ["data.final_dim=[32, 96]", "data.resize_lim=[0.24, 0.26]", "grid.xbound=[-16.0, 16.0, 1.0]",
            "grid.ybound=[-16.0, 16.0, 1.0]", "grid.dbound=[4.0, 20.0, 2.0]", "model.context_channels=8",
            "data.classes=[vehicle, drivable_area]", "data.workers=0", "train.batch_size=2", "train.max_steps=2",
            "train.eval_every=2", "train.viz_every=2", "train.ckpt_every=2", "train.log_every=1",
            "train.device=cpu", "eval.batch_size=2", "viz.num=1", "viz.gif=false",
            "model.heads=[segmentation, detection]", "data.detection_targets=true", "detection.head_channels=8",
            "detection.refine=true", "detection.refine_hidden=16", "detection.refine_proposals=8",
            f"data.dataroot={synthetic_root}", "data.version=v1.0-mini"]
    run = tmp_path / "run"
    result = demo(overrides=tiny, out_dir=str(run))
    losses = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = {k for row in losses for k in row.get("values", row)}
    assert any("det_heatmap" in k for k in logged) and any("det_refine_box" in k for k in logged)
    report = json.loads((run / "eval.json").read_text())
    detection = report["detection"]
    assert 0.0 <= detection["mAP"] <= 1.0 and 0.0 <= detection["NDS"] <= 1.0
    assert detection["eval_set"] == "mini_val" and detection["num_samples"] == 3
    assert set(detection["per_class"]) == set(DETECTION_CLASSES)
    assert json.loads((run / "detection_metrics.json").read_text())["mAP"] == detection["mAP"]
    submission = json.loads((run / "detection_submission.json").read_text())
    assert len(submission["results"]) == 3
    assert result["eval"]["detection"]["mAP"] == detection["mAP"]
    # The periodic evaluation logs the detection metrics next to the IoU: the learning curve of a run.
    curve = [row for row in losses if row.get("kind") == "val"]
    assert curve and set(curve[-1]["detection"]) == {"mAP", "NDS", "vehicle_mAP", "vehicle_NDS", "AP"}
    assert set(curve[-1]["detection"]["AP"]) == set(DETECTION_CLASSES)
    assert len(list((run / "viz").glob("*.png"))) == 1


def test_drawing_no_boxes_leaves_the_pictures_unchanged():
    from lss.viz.detection import draw_bev_boxes, draw_camera_boxes
    from lss.geometry import BevGrid
    from lss.viz import BevView

    panel = np.full((64, 64, 3), 7, np.uint8)
    view = BevView(BevGrid.planar((-16.0, 16.0, 1.0), (-16.0, 16.0, 1.0)), 64, 64)
    draw_bev_boxes(panel, np.zeros((0, 9), np.float32), view, (255, 0, 0))
    draw_camera_boxes(panel, np.zeros((0, 9)), np.eye(3), np.eye(3), np.zeros(3), np.eye(3), np.zeros(3), (255, 0, 0))
    assert (panel == 7).all()


@pytest.mark.slow
def test_full_model_lowers_the_detection_loss_on_a_tiny_set(synthetic_root):
    from lss.config import load_config
    from lss.data import collate
    from lss.data.loader import build_dataset
    from lss.models.build import build_model
    from lss.models.losses import TotalLoss

    tiny = ["data.final_dim=[32, 96]", "data.resize_lim=[0.24, 0.26]", "grid.xbound=[-16.0, 16.0, 1.0]",
            "grid.ybound=[-16.0, 16.0, 1.0]", "grid.dbound=[4.0, 20.0, 2.0]", "model.context_channels=8",
            f"data.dataroot={synthetic_root}", "data.version=v1.0-mini", "train.device=cpu", "data.workers=0",
            # The evaluation-mode dataset (no augmentation) reads no lidar, so the depth loss is off here.
            "data.depth_targets=false", "loss.depth_weight=0.0"]
    config = load_config("configs/synthetic_detection.yaml", tiny)
    torch.manual_seed(0)
    dataset = build_dataset(config, "train", is_train=False)
    batch = collate([dataset[0], dataset[1]])
    assert all(len(b) for b in batch["det_boxes"])
    model, criterion = build_model(config).train(), TotalLoss(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    first_stage = []
    for _ in range(30):
        losses = criterion(model(batch), batch)
        first_stage.append(float(losses["loss/det_heatmap"] + losses["loss/det_regression"]))
        optimizer.zero_grad()
        losses["loss"].backward()
        optimizer.step()
    assert max(first_stage[-3:]) < 0.5 * first_stage[0], first_stage
