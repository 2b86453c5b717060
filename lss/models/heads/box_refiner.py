"""The detection head's second stage: the BEV features read with RoIAlign at each proposal (its
centre and face middles, or its enlarged envelope), optionally with the cameras' depth cues and
context features there and both frames' splatted grids around it, and a small MLP that refines
the proposal's score and box."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lss.geometry import BevGrid
from lss.geometry.boxes import BOX_DIM, BOX_POINTS, BOX_VELOCITY, bev_envelopes, box_points
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


def rois_at(points: torch.Tensor, grid: BevGrid) -> torch.Tensor:
    """RoIAlign boxes (B ...) x 5, one cell wide and centred on each of points B x ... x 2 (or x 3;
    ego x, y in metres): with a 1 x 1 output and one sample per bin, aligned RoIAlign reads a map
    of `grid` bilinearly at exactly that point (zero off the map)."""
    B = points.shape[0]
    u, v = grid.xy_to_cells(points[..., 0].reshape(-1), points[..., 1].reshape(-1))
    sample = torch.arange(B, device=points.device).repeat_interleave(u.numel() // max(B, 1))
    return torch.stack([sample.float(), v - 0.5, u - 0.5, v + 0.5, u + 0.5], dim=1)


def read_grid(bev: torch.Tensor, points: torch.Tensor, grid: BevGrid) -> torch.Tensor:
    """A map B x C x H x W of `grid` read bilinearly at points B x ... x 2 (or x 3): B x ... x C,
    float32, zero off the map; gradients reach the map."""
    # float32: in bf16 a point near cell 200 would be off by a whole cell. validate=False skips a
    # host sync: the rois are built here (batch indices by construction, finite unless the
    # network's outputs are not, and then the loss stops training anyway).
    pooled = roi_align(
        bev.float(),
        rois_at(points, grid),
        (1, 1),
        spatial_scale=1.0,
        sampling_ratio=1,
        aligned=True,
        validate=False,
    )
    return pooled.reshape(*points.shape[:-1], bev.shape[1])


# detection.refine_motion_grid: the two frames' splatted grids read at each BOX_POINTS point, this
# frame's there and the previous frame's where the point was `interval` seconds before if the box
# moved at its velocity, and where it was if it moved the other way (motion_reads); each read
# embedded to MOTION_EMBED channels by the refiner
MOTION_READS = 3
MOTION_EMBED = 16


def motion_reads(
    current: torch.Tensor,
    previous: torch.Tensor,
    boxes: torch.Tensor,
    grid: BevGrid,
    interval: float,
) -> torch.Tensor:
    """The splatted grids of this frame and the previous one (B x C x H x W each, the map of
    `grid`, both in this frame's ego frame) read at the BOX_POINTS of boxes B x P x 9: B x P x
    MOTION_READS x K x C, this frame's at the points, the previous frame's at the points minus the
    box's velocity x `interval` (seconds between the frames: where they were if the box moved as
    it says) and at the points plus it (where they were if it moved the other way). Of a moving
    object the first of the two previous reads matches this frame's and the second does not,
    whichever way its heading points; an unknown (non-finite) velocity reads as standing still."""
    if current.shape != previous.shape:
        raise ValueError(
            f"motion_reads: this frame's grid is {tuple(current.shape)} but the previous frame's "
            f"{tuple(previous.shape)}: both frames are splatted into the same grid"
        )
    points = box_points(boxes)[..., :2]  # B x P x K x 2
    velocity = torch.nan_to_num(boxes[..., BOX_VELOCITY].float(), nan=0.0, posinf=0.0, neginf=0.0)
    shift = (velocity * interval).unsqueeze(-2)
    before = read_grid(previous, torch.stack([points - shift, points + shift], dim=2), grid)
    return torch.cat([read_grid(current, points, grid).unsqueeze(2), before], dim=2)


class BoxRefiner(nn.Module):
    """Second stage: BEV features read with RoIAlign for each proposal, at the box centre and its
    four face middles (features="points", CenterPoint's design) or over its enlarged axis-aligned
    envelope (features="envelope", roi_size x roi_size); an MLP on them, the class and the
    proposal's own geometry predicts a quality logit (the score) and box residuals
    (lss.geometry.boxes.box_residuals), with `reversal` also a logit for the proposal facing the
    wrong way (lss.geometry.boxes.reversed_heading). With `camera_depth` it also reads the
    proposals' depth cues, with `motion` the depth cues of the previous frame's cameras (after the
    current frame's, when both), with `image_channels` > 0 the cameras' context features (that
    many channels) at the box's BOX_POINTS (lss.models.heads.camera_cues), with `motion_grid` > 0
    both frames' splatted grids (that many channels) around the box (motion_reads), each read
    embedded by one linear layer."""

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
        motion_grid: int = 0,
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
        self.motion_embed = nn.Linear(motion_grid, MOTION_EMBED) if motion_grid else None
        self.motion_shape = (MOTION_READS, len(BOX_POINTS), motion_grid)
        self.motion_width = MOTION_READS * len(BOX_POINTS) * MOTION_EMBED if motion_grid else 0
        geometry = num_classes + 9 + self.cue_width + self.image_width + self.motion_width
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
        motion: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """bev_features B x C x H x W (the H x W map of `grid`); with camera_depth and/or motion the
        proposals' depth cues B x P x CUE_CHANNELS (each; this frame's first), with image_channels
        their image features B x P x len(BOX_POINTS) (image_channels + 1)
        (lss.models.heads.camera_cues), with motion_grid their motion_reads B x P x MOTION_READS x
        len(BOX_POINTS) x motion_grid. Returns score logits B x P, residuals B x P x 9 and with
        `reversal` reversal logits B x P (else None), zero on invalid slots. Every slot is computed
        (fixed shapes, no host sync); invalid ones are masked."""
        B, P = proposals.valid.shape
        for settings, what, shape, given in (
            ("refine_depth or refine_motion", "depth cues", (self.cue_width,), cues),
            ("refine_image", "image features", (self.image_width,), image),
            ("refine_motion_grid", "motion reads", self.motion_shape, motion),
        ):
            if shape[-1] and (given is None or given.shape != (B, P, *shape)):
                raise ValueError(
                    f"BoxRefiner: detection.{settings} needs the proposals' {what} B x P x "
                    f"{' x '.join(map(str, shape))} (B x P = {B} x {P}), got "
                    f"{None if given is None else tuple(given.shape)}: run the head through "
                    "lss.models.LSS, which passes it what the cameras and both frames see"
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
            pooled = read_grid(bev_features, box_points(proposals.boxes), grid)
        else:  # float32 and no validation, as read_grid
            pooled = roi_align(
                bev_features.float(),
                proposal_rois(proposals, grid, self.enlarge),
                (self.roi_size, self.roi_size),
                spatial_scale=1.0,
                sampling_ratio=2,
                aligned=True,
                validate=False,
            )
        pooled = pooled.reshape(B * P, -1)
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
            + ([image.reshape(B * P, self.image_width).float()] if self.image_width else [])
            + (
                [self.motion_embed(motion.float()).reshape(B * P, self.motion_width)]
                if self.motion_embed is not None
                else []
            ),
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
