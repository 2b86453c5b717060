"""The detection head's second stage: the BEV features read with RoIAlign at each proposal (its
centre and face middles, or its enlarged envelope), optionally with the cameras' depth cues and
context features there, and a small MLP that refines the proposal's score and box."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lss.geometry import BevGrid
from lss.geometry.boxes import BOX_DIM, BOX_POINTS, bev_envelopes, box_points
from lss.geometry.proposals import Proposals
from lss.models.heads.camera_cues import CUE_CHANNELS
from lss.ops import roi_align


def proposal_rois(
    proposals: Proposals, grid: BevGrid, enlarge: float, min_cells: float = 2.0
) -> torch.Tensor:
    """RoIAlign boxes (B P) x 5 [batch, x1, y1, x2, y2], one per proposal slot (valid or not), in
    the cell units of the grid's map with RoIAlign's x along the columns (ego y) and y along the
    rows (ego x): each the proposal's axis-aligned envelope scaled by `enlarge` and at least
    `min_cells` wide."""
    B, P = proposals.valid.shape
    env = bev_envelopes(proposals.boxes.reshape(B * P, BOX_DIM), enlarge)
    centre_x, centre_y = (env[:, 0] + env[:, 2]) / 2, (env[:, 1] + env[:, 3]) / 2
    half_rows = torch.clamp((env[:, 2] - env[:, 0]) / (2 * grid.cell_size[0]), min=min_cells / 2)
    half_cols = torch.clamp((env[:, 3] - env[:, 1]) / (2 * grid.cell_size[1]), min=min_cells / 2)
    u, v = grid.xy_to_cells(centre_x, centre_y)
    sample = torch.arange(B, device=env.device).repeat_interleave(P).float()
    return torch.stack([sample, v - half_cols, u - half_rows, v + half_cols, u + half_rows], dim=1)


def point_rois(proposals: Proposals, grid: BevGrid) -> torch.Tensor:
    """RoIAlign boxes (B P 5) x 5, one cell wide and centred on each BOX_POINTS point of every
    proposal slot: with a 1 x 1 output and one sample per bin, aligned RoIAlign reads the BEV
    features bilinearly at exactly that point."""
    B, P = proposals.valid.shape
    points = box_points(proposals.boxes.reshape(B * P, BOX_DIM))
    u, v = grid.xy_to_cells(points[..., 0].reshape(-1), points[..., 1].reshape(-1))
    sample = torch.arange(B, device=points.device).repeat_interleave(P * len(BOX_POINTS)).float()
    return torch.stack([sample, v - 0.5, u - 0.5, v + 0.5, u + 0.5], dim=1)


class BoxRefiner(nn.Module):
    """Second stage: BEV features read with RoIAlign for each proposal, at the box centre and its
    four face middles (features="points", CenterPoint's design) or over its enlarged axis-aligned
    envelope (features="envelope", roi_size x roi_size); an MLP on them, the class and the
    proposal's own geometry predicts a quality logit (the score) and box residuals
    (lss.geometry.boxes.box_residuals), with `reversal` also a logit for the proposal facing the
    wrong way (lss.geometry.boxes.reversed_heading). With `camera_depth` it also reads the
    proposals' depth cues, with `motion` the depth cues of the previous frame's cameras (after the
    current frame's, when both), with `image_channels` > 0 the cameras' context features (that
    many channels) at the box's BOX_POINTS (lss.models.heads.camera_cues)."""

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        roi_size: int = 7,
        hidden: int = 256,
        enlarge: float = 1.5,
        features: str = "points",
        camera_depth: bool = False,
        image_channels: int = 0,
        motion: bool = False,
        reversal: bool = False,
    ):
        super().__init__()
        if features not in ("points", "envelope"):
            raise ValueError(f"BoxRefiner: features {features!r} is not one of points, envelope")
        self.num_classes = num_classes
        self.features = features
        self.roi_size = roi_size if features == "envelope" else 1
        self.enlarge = enlarge
        reads = len(BOX_POINTS) if features == "points" else roi_size * roi_size
        # one-hot class, sin/cos yaw, log size, z, velocity, score (and the depth cues of this
        # frame's and the previous frame's cameras, the image features with whether a camera sees
        # each point)
        self.cue_width = CUE_CHANNELS * (int(camera_depth) + int(motion))
        self.image_width = len(BOX_POINTS) * (image_channels + 1) if image_channels else 0
        geometry = num_classes + 9 + self.cue_width + self.image_width
        self.mlp = nn.Sequential(
            nn.Linear(in_channels * reads + geometry, hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, hidden),
            nn.ReLU(inplace=True),
        )
        self.score = nn.Linear(hidden, 1)
        self.residual = nn.Linear(hidden, BOX_DIM)
        self.reversal = nn.Linear(hidden, 1) if reversal else None
        # Start as the identity on boxes, so that early training does not move the proposals around.
        nn.init.zeros_(self.residual.weight)
        nn.init.zeros_(self.residual.bias)

    def forward(
        self,
        bev_features: torch.Tensor,
        proposals: Proposals,
        grid: BevGrid,
        cues: Optional[torch.Tensor] = None,
        image: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """bev_features B x C x H x W (the H x W map of `grid`); with camera_depth and/or motion the
        proposals' depth cues B x P x CUE_CHANNELS (each; this frame's first), with image_channels
        their image features B x P x len(BOX_POINTS) (image_channels + 1)
        (lss.models.heads.camera_cues). Returns score logits B x P, residuals B x P x 9 and with
        `reversal` reversal logits B x P (else None), zero on invalid slots. Every slot is computed
        (fixed shapes, no host sync); invalid ones are masked."""
        B, P = proposals.valid.shape
        for settings, what, width, given in (
            ("refine_depth or refine_motion", "depth cues", self.cue_width, cues),
            ("refine_image", "image features", self.image_width, image),
        ):
            if width and (given is None or given.shape != (B, P, width)):
                raise ValueError(
                    f"BoxRefiner: detection.{settings} needs the proposals' {what} B x P x {width} "
                    f"(B x P = {B} x {P}), got {None if given is None else tuple(given.shape)}: "
                    "run the head through lss.models.LSS, which passes it what the cameras see"
                )
        if P == 0:
            # Zero-valued use of every parameter: DDP expects gradients for all of them every step.
            unused = sum(p.sum() for p in self.parameters()).float() * 0
            return (
                bev_features.new_zeros(B, 0, dtype=torch.float32) + unused,
                bev_features.new_zeros(B, 0, BOX_DIM, dtype=torch.float32) + unused,
                None
                if self.reversal is None
                else bev_features.new_zeros(B, 0, dtype=torch.float32) + unused,
            )
        if self.features == "points":
            rois, sampling = point_rois(proposals, grid), 1
        else:
            rois, sampling = proposal_rois(proposals, grid, self.enlarge), 2
        # float32: in bf16 a roi corner near cell 200 would be off by a whole cell. validate=False
        # skips a host sync: the rois are our own decoding (batch indices by construction, boxes
        # finite unless the network's outputs are not, and then the loss stops training anyway).
        pooled = roi_align(
            bev_features.float(),
            rois,
            (self.roi_size, self.roi_size),
            spatial_scale=1.0,
            sampling_ratio=sampling,
            aligned=True,
            validate=False,
        ).reshape(B * P, -1)
        boxes = proposals.boxes.reshape(B * P, BOX_DIM)
        geometry = torch.cat(
            [
                F.one_hot(proposals.labels.reshape(-1), self.num_classes).float(),
                torch.sin(boxes[:, 6:7]),
                torch.cos(boxes[:, 6:7]),
                torch.log(boxes[:, 3:6].clamp(min=1e-3)),
                boxes[:, 2:3],
                boxes[:, 7:9],
                proposals.scores.reshape(-1, 1),
            ]
            + ([cues.reshape(B * P, self.cue_width).float()] if self.cue_width else [])
            + ([image.reshape(B * P, self.image_width).float()] if self.image_width else []),
            dim=1,
        )
        hidden = self.mlp(torch.cat([pooled, geometry.to(pooled.dtype)], dim=1))
        valid = proposals.valid
        score_logits = torch.where(valid, self.score(hidden).float().view(B, P), 0.0)
        residuals = torch.where(
            valid.unsqueeze(-1), self.residual(hidden).float().view(B, P, BOX_DIM), 0.0
        )
        reversal = (
            None
            if self.reversal is None
            else torch.where(valid, self.reversal(hidden).float().view(B, P), 0.0)
        )
        return score_logits, residuals, reversal
