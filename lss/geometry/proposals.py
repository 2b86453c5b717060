"""Proposals of the detection head's second stage: padded per-sample boxes, and the jittered
ground truth it trains on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from lss.geometry.boxes import BOX_DIM, centre_cells, turn_around
from lss.geometry.grid import BevGrid


@dataclass
class Proposals:
    """Padded per-sample boxes: boxes B x P x 9, scores B x P, labels B x P (int64), valid B x P
    (bool)."""

    boxes: torch.Tensor
    scores: torch.Tensor
    labels: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def zeros(cls, batch: int, slots: int, device: torch.device) -> "Proposals":
        """batch x slots proposals, all invalid."""
        return cls(
            torch.zeros(batch, slots, BOX_DIM, device=device),
            torch.zeros(batch, slots, device=device),
            torch.zeros(batch, slots, dtype=torch.long, device=device),
            torch.zeros(batch, slots, dtype=torch.bool, device=device),
        )

    def cat(self, other: "Proposals") -> "Proposals":
        """These proposals followed by `other`'s in each sample: B x (P + Q)."""
        return Proposals(
            torch.cat([self.boxes, other.boxes], 1),
            torch.cat([self.scores, other.scores], 1),
            torch.cat([self.labels, other.labels], 1),
            torch.cat([self.valid, other.valid], 1),
        )


def pad_boxes(
    boxes: Sequence[torch.Tensor], labels: Sequence[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """One M_b x 9 / M_b tensor per sample as B x max(M_b) x 9 boxes and B x max(M_b) labels (-1
    on padding rows, whose boxes are 0)."""
    B, M = len(boxes), max((len(b) for b in boxes), default=0)
    out = torch.zeros(B, M, BOX_DIM, device=device)
    out_labels = torch.full((B, M), -1, dtype=torch.long, device=device)
    for b, (bx, lb) in enumerate(zip(boxes, labels)):
        out[b, : len(bx)] = bx.to(device, torch.float32)
        out_labels[b, : len(lb)] = lb.to(device, torch.long)
    return out, out_labels


def jitter_boxes(
    boxes: torch.Tensor,
    labels: torch.Tensor,
    grid: BevGrid,
    num_classes: int,
    generator: Optional[torch.Generator] = None,
    centre_jitter: float = 0.5,
    size_jitter: float = 0.1,
    yaw_jitter: float = 0.2,
    turn_share: float = 0.0,
) -> Proposals:
    """Jittered copies of padded ground-truth boxes B x M x 9 (labels B x M, -1 on padding) as
    B x M proposals with score 0, valid where the label is a class and the jittered centre stays on
    the grid's map; unknown (NaN) velocities become 0. Jitter: centre std in metres, relative size
    std, yaw std in radians, one randn(B, M, 4) drawn on `generator`'s device (default: the global
    generator of the boxes' device, so that a captured CUDA step draws it on the GPU). With
    `turn_share` > 0 that share of the copies (one rand(B, M) after the randn) is also turned
    around (lss.geometry.boxes.turn_around): the wrong-way proposals the second stage's reversal
    logit learns from."""
    device = generator.device if generator is not None else boxes.device
    noise = torch.randn(*boxes.shape[:2], 4, generator=generator, device=device).to(boxes.device)
    jittered = torch.cat(
        [
            boxes[..., :2] + centre_jitter * noise[..., :2],
            boxes[..., 2:3],
            boxes[..., 3:6] * torch.exp(size_jitter * noise[..., 2:3]),
            (boxes[..., 6] + yaw_jitter * noise[..., 3]).unsqueeze(-1),
            torch.nan_to_num(boxes[..., 7:9]),
        ],
        dim=-1,
    )
    if turn_share > 0:
        draw = torch.rand(*boxes.shape[:2], generator=generator, device=device).to(boxes.device)
        jittered = turn_around(jittered, draw < turn_share)
    flat = jittered.reshape(-1, BOX_DIM)
    _, _, ok = centre_cells(flat, labels.reshape(-1), grid, num_classes)
    valid = ok.view(labels.shape)
    return Proposals(
        torch.where(valid.unsqueeze(-1), jittered, 0.0),
        torch.zeros(labels.shape, device=boxes.device),
        labels.clamp(min=0),
        valid,
    )


def ground_truth_proposals(
    gt_boxes: Sequence[torch.Tensor],
    gt_labels: Sequence[torch.Tensor],
    grid: BevGrid,
    num_classes: int,
    device: torch.device,
    generator: Optional[torch.Generator] = None,
    **jitter: float,
) -> Proposals:
    """jitter_boxes of the ground-truth boxes given as one M_b x 9 / M_b tensor per sample: B x
    max(M_b) proposals, slot i of sample b the jittered box i of that sample (valid where it stays
    on the map)."""
    boxes, labels = pad_boxes(gt_boxes, gt_labels, device)
    return jitter_boxes(boxes, labels, grid, num_classes, generator, **jitter)
