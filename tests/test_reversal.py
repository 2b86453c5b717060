"""The second stage's reversal logit (detection.refine_reversal): which proposals face the wrong way, the turned-around
boxes its residuals are trained on and applied to, the turned jittered truth it learns from, and that it learns to
tell a wrong-way box from the BEV features."""
import math

import pytest
import torch
from test_detection import random_boxes

from lss.config import Config, ConfigError, config_to_dict, validate
from lss.engine.checkpoint import config_mismatches
from lss.geometry import BevGrid
from lss.geometry.boxes import box_residuals, reversed_heading, turn_around
from lss.geometry.proposals import Proposals, jitter_boxes
from lss.models.heads.detection import DetectionHead
from lss.models.heads.detection_decode import decode_detections
from lss.models.heads.detection_loss import detection_loss, refine_loss


def _boxes(yaws, velocities):
    n = len(yaws)
    out = torch.zeros(n, 9)
    out[:, 0] = torch.arange(n) * 10.0
    out[:, 3:6] = torch.tensor([2.0, 4.5, 1.6])
    out[:, 6] = torch.tensor(yaws)
    out[:, 7:9] = torch.tensor(velocities)
    return out


def test_turning_around_adds_half_a_turn_and_negates_the_velocity():
    boxes = _boxes([0.0, 3.0, -3.0, 1.0], [[5.0, 1.0], [-2.0, 0.5], [0.0, 0.0], [1.0, -1.0]])
    mask = torch.tensor([True, True, False, True])
    turned = turn_around(boxes, mask)
    torch.testing.assert_close(turned[:, 6], torch.tensor([-math.pi, 3.0 - math.pi, -3.0, 1.0 - math.pi]))
    torch.testing.assert_close(turned[:, 7:9], torch.tensor([[-5.0, -1.0], [2.0, -0.5], [0.0, 0.0], [-1.0, 1.0]]))
    torch.testing.assert_close(turned[:, :6], boxes[:, :6])
    assert turned[:, 6].abs().max() <= math.pi
    # twice is the same heading and velocity
    again = turn_around(turned, mask)
    torch.testing.assert_close(torch.cos(again[:, 6]), torch.cos(boxes[:, 6]))
    torch.testing.assert_close(torch.sin(again[:, 6]), torch.sin(boxes[:, 6]))
    torch.testing.assert_close(again[:, 7:9], boxes[:, 7:9])


def test_a_proposal_is_reversed_beyond_a_quarter_turn_across_the_wrap():
    proposals = _boxes([0.0, 3.0, 0.0, 0.0, -3.1], [[0, 0]] * 5)
    targets = _boxes([3.0, -3.0, math.pi / 2 - 0.01, -(math.pi / 2 + 0.01), 0.1], [[0, 0]] * 5)
    assert reversed_heading(proposals, targets).tolist() == [True, False, False, True, True]


def test_the_jittered_truth_turns_the_given_share_and_keeps_the_stream_without_it():
    grid = BevGrid((-50.0, 50.0, 0.5), (-50.0, 50.0, 0.5), (-10.0, 10.0, 20.0))
    g = torch.Generator().manual_seed(0)
    boxes = random_boxes(64, g, spacing=5.0).unsqueeze(0).repeat(32, 1, 1)
    labels = torch.zeros(32, 64, dtype=torch.long)
    plain = jitter_boxes(boxes, labels, grid, 10, torch.Generator().manual_seed(1))
    again = jitter_boxes(boxes, labels, grid, 10, torch.Generator().manual_seed(1), turn_share=0.0)
    torch.testing.assert_close(again.boxes, plain.boxes)
    turned = jitter_boxes(boxes, labels, grid, 10, torch.Generator().manual_seed(1), turn_share=0.25)
    valid = turned.valid & plain.valid
    flipped = reversed_heading(turned.boxes, boxes) & valid
    assert 0.2 < flipped.sum() / valid.sum() < 0.3
    # the same jitter, turned around where drawn: the velocity negated with the heading
    torch.testing.assert_close(turned.boxes[flipped][:, 7:9], -plain.boxes[flipped][:, 7:9])
    torch.testing.assert_close(turned.boxes[~flipped & valid], plain.boxes[~flipped & valid])


def _outputs(proposal_boxes, reversal, residuals=None):
    P = proposal_boxes.shape[0]
    proposals = Proposals(proposal_boxes[None], torch.full((1, P), 0.5), torch.zeros(1, P, dtype=torch.long),
                          torch.ones(1, P, dtype=torch.bool))
    residuals = torch.zeros(1, P, 9) if residuals is None else residuals
    return {"det_proposals": proposals, "det_refine_scores": torch.zeros(1, P), "det_refine_residuals": residuals,
            "det_refine_reversal": torch.tensor([reversal], dtype=torch.float32)}


def test_the_reversal_loss_and_the_residuals_of_the_turned_proposal():
    truth = _boxes([0.3, 1.2], [[6.0, 1.0], [0.0, -4.0]])
    # the first proposal faces the wrong way (its velocity with it), the second is right, the third matches nothing
    proposals = torch.cat([truth, _boxes([0.0], [[0.0, 0.0]])])
    proposals[0, 6] = 0.3 + math.pi - 0.1
    proposals[0, 7:9] = torch.tensor([-5.5, -1.0])
    proposals[1, 6] = 1.1
    proposals[2, 0] = 40.0
    batch = {"det_boxes": [truth], "det_labels": [torch.zeros(2, dtype=torch.long)]}
    weights = torch.tensor(Config().detection.code_weights)
    start = turn_around(proposals, torch.tensor([True, False, False]))
    exact = box_residuals(start, torch.cat([truth, proposals[2:]]))[None]
    right = refine_loss(_outputs(proposals, [20.0, -20.0, 20.0], exact), batch, 2.0, weights)
    # the residuals towards the truth from the turned-around proposal: small (0.1 rad, 0.5 m/s), and exact here
    assert exact[0, 0, 6].abs().item() == pytest.approx(0.1, abs=1e-5)
    assert exact[0, 0, 7:9].tolist() == pytest.approx([0.5, 0.0], abs=1e-5)
    assert right["det_refine_box"].item() == pytest.approx(0.0, abs=1e-6)
    # the unmatched third proposal's logit does not count
    assert right["det_refine_reversal"].item() == pytest.approx(0.0, abs=1e-6)
    wrong = refine_loss(_outputs(proposals, [-20.0, 20.0, 20.0], exact), batch, 2.0, weights)
    assert wrong["det_refine_reversal"].item() == pytest.approx(20.0, rel=1e-3)
    # without the reversal logit the residuals are those of the proposal as it is
    plain = _outputs(proposals, [0.0, 0.0, 0.0], exact)
    del plain["det_refine_reversal"]
    assert "det_refine_reversal" not in refine_loss(plain, batch, 2.0, weights)
    assert refine_loss(plain, batch, 2.0, weights)["det_refine_box"] > 1.0


def test_decoding_turns_around_what_the_second_stage_calls_reversed():
    boxes = _boxes([0.5, -2.0], [[3.0, 1.0], [0.0, 2.0]])
    config = Config()
    config.detection.refine, config.detection.refine_reversal = True, True
    det = decode_detections(_outputs(boxes, [2.0, -2.0]), config)[0]
    by_x = det["boxes"][torch.argsort(det["boxes"][:, 0])]
    torch.testing.assert_close(by_x[0], turn_around(boxes[0], torch.tensor(True)))
    torch.testing.assert_close(by_x[1], boxes[1])


def _scene(g: torch.Generator, marked: bool):
    """Three boxes of random headings at fixed places and BEV features that mark each one's front (as a trained
    encoder's features carry its appearance) when `marked`, beside noise."""
    yaw = (torch.rand(3, generator=g) * 2 - 1) * math.pi
    boxes = torch.tensor([[3.3, -2.1, 0.4, 1.9, 4.4, 1.6, 0.0, 1.0, 0.5], [-4.2, 3.6, 0.8, 2.0, 5.0, 1.8, 0.0, 0, 0],
                          [-1.0, -5.0, 0.6, 2.0, 4.8, 1.7, 0.0, 0, 0]])
    boxes[:, 6] = yaw
    cx, cy = torch.meshgrid(torch.arange(32) * 0.5 - 7.75, torch.arange(32) * 0.5 - 7.75, indexing="ij")
    front = torch.zeros(32, 32)
    for x, y, _, _, length, _, heading, _, _ in boxes.tolist():
        fx, fy = x + math.cos(heading) * length / 2, y + math.sin(heading) * length / 2
        front = torch.maximum(front, torch.exp(-((cx - fx) ** 2 + (cy - fy) ** 2)))
    features = torch.cat([front[None] * float(marked), torch.randn(7, 32, 32, generator=g) * 0.1])[None]
    return features, [boxes], [torch.tensor([0, 1, 0])]


def reversal_calls(head: DetectionHead, config: Config, scene, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Trains `head`'s second stage on `steps` scenes (scene(g) -> features, head keyword arguments, ground-truth
    boxes, labels; new headings every step: nothing to memorise) against the reversal loss alone, then returns its
    calls (logit > 0) and the truth (reversed_heading) on the jittered ground-truth proposals of 20 new scenes."""
    optimizer = torch.optim.Adam(head.refiner.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        features, inputs, boxes, labels = scene(g)
        optimizer.zero_grad()
        losses = detection_loss(head(features, gt_boxes=boxes, gt_labels=labels, **inputs),
                                {"det_boxes": boxes, "det_labels": labels}, config)
        losses["det_refine_reversal"].backward()
        optimizer.step()
    calls, truths = [], []
    with torch.no_grad():
        for _ in range(20):
            features, inputs, boxes, labels = scene(g)
            out = head(features, gt_boxes=boxes, gt_labels=labels, **inputs)
            slots = out["det_proposals"].valid.clone()
            slots[:, : config.detection.refine_proposals] = False  # the jittered ground truth slots
            calls.append(out["det_refine_reversal"][slots] > 0)
            truths.append(reversed_heading(out["det_proposals"].boxes[slots], boxes[0]))
    return torch.cat(calls), torch.cat(truths)


def reversal_config() -> Config:
    """A 16 m grid, a small second stage with the reversal logit, half the jittered truth turned around."""
    config = Config()
    config.grid.xbound, config.grid.ybound = (-8.0, 8.0, 0.5), (-8.0, 8.0, 0.5)
    config.detection.head_channels, config.detection.refine, config.detection.refine_hidden = 16, True, 64
    config.detection.refine_reversal, config.detection.refine_reversal_share = True, 0.5
    return config


@pytest.mark.parametrize("marked", [True, False])
def test_the_second_stage_learns_which_proposals_face_the_wrong_way(marked):
    """With the objects' fronts in the BEV features the reversal logit learns to call the turned-around copies of
    the truth and not the others; without them it cannot."""
    torch.manual_seed(0)
    config = validate(reversal_config())
    head = DetectionHead(8, config.detection, BevGrid.from_config(config.grid))

    def scene(g):
        features, boxes, labels = _scene(g, marked)
        return features, {}, boxes, labels

    calls, truths = reversal_calls(head, config, scene, steps=400)
    assert 0.3 < truths.float().mean() < 0.7
    accuracy = (calls == truths).float().mean()
    assert accuracy > 0.9 if marked else accuracy < 0.75


def test_the_reversal_setting_is_checked_and_fixes_the_weights():
    config = Config()
    config.detection.refine_reversal = True
    with pytest.raises(ConfigError, match="detection.refine_reversal: true feeds the second stage"):
        validate(config)
    config.detection.refine = True
    config.detection.refine_reversal_share = 1.0
    with pytest.raises(ConfigError, match="refine_reversal_share=1.0: expected the share"):
        validate(config)
    config.detection.refine_reversal_share = 0.25
    validate(config)
    # a checkpoint with the reversal logit is not evaluated with a config without it
    found = config_mismatches({"config": config_to_dict(config)}, Config())
    assert ("detection.refine_reversal", True, False) in found
