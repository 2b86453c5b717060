"""3D object detection on the BEV features: CenterPoint-style centre heatmaps and box regression, decoding by top-K
heatmap peaks and batched NMS, and a second stage that pools the BEV features around each proposal with RoIAlign and
refines its score and box with a small MLP.

Boxes are M x 9 [x, y, z, w, l, h, yaw, vx, vy] in the ego frame (metres, radians, m/s): w across the heading, l
along it (the nuScenes size order), yaw about ego z from ego x. BEV maps are H x W with row = ego x, column = ego y.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lss.config import Config, ConfigError, DetectionConfig
from lss.data import DETECTION_CLASSES
from lss.ops import batched_nms, roi_align, sigmoid_focal_loss

REGRESSION_CHANNELS = ("offset_x", "offset_y", "z", "log_w", "log_l", "log_h", "sin_yaw", "cos_yaw", "vx", "vy")
BOX_DIM = 9
MAX_BOXES_PER_SAMPLE = 500  # the nuScenes detection evaluation's limit
# Which regression channel's code weight applies to each box residual of the second stage (yaw takes sin's).
_RESIDUAL_WEIGHT_CHANNELS = (0, 1, 2, 3, 4, 5, 6, 8, 9)
# Sizes are clamped here when decoded so that an untrained head cannot produce inf boxes.
_MAX_LOG_SIZE = 4.0


@dataclass(frozen=True)
class BevFrame:
    """Where an H x W BEV map lies in the ego frame: row i spans x in [x_min + i dx, x_min + (i + 1) dx), column j
    spans y in [y_min + j dy, y_min + (j + 1) dy)."""

    x_min: float
    y_min: float
    dx: float
    dy: float
    H: int
    W: int

    @classmethod
    def from_bounds(cls, xbound: Sequence[float], ybound: Sequence[float], shape: Sequence[int]) -> "BevFrame":
        """The map of `shape` (H, W) covering the grid bounds (min, max, cell size); the map may be coarser than
        the grid (its cells are then larger)."""
        H, W = int(shape[0]), int(shape[1])
        return cls(float(xbound[0]), float(ybound[0]), (xbound[1] - xbound[0]) / H, (ybound[1] - ybound[0]) / W, H, W)

    def to_cells(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Continuous cell coordinates (u along rows, v along columns); cell (i, j) covers [i, i + 1) x [j, j + 1)."""
        return (x - self.x_min) / self.dx, (y - self.y_min) / self.dy

    def locate(self, boxes: torch.Tensor, labels: torch.Tensor,
               num_classes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Centre cells (row, col) of boxes M x 9 and whether each box can be encoded: centre on the map, a label in
        [0, num_classes), finite geometry and positive sizes."""
        u, v = self.to_cells(boxes[:, 0], boxes[:, 1])
        row, col = torch.floor(u).long(), torch.floor(v).long()
        ok = (row >= 0) & (row < self.H) & (col >= 0) & (col < self.W) & (labels >= 0) & (labels < num_classes) \
            & torch.isfinite(boxes[:, :7]).all(1) & (boxes[:, 3:6] > 0).all(1)
        return row, col, ok


@dataclass
class Proposals:
    """Padded per-sample boxes: boxes B x P x 9, scores B x P, labels B x P (int64), valid B x P (bool)."""

    boxes: torch.Tensor
    scores: torch.Tensor
    labels: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def zeros(cls, batch: int, slots: int, device: torch.device) -> "Proposals":
        """batch x slots proposals, all invalid."""
        return cls(torch.zeros(batch, slots, BOX_DIM, device=device), torch.zeros(batch, slots, device=device),
                   torch.zeros(batch, slots, dtype=torch.long, device=device),
                   torch.zeros(batch, slots, dtype=torch.bool, device=device))


# ---------------------------------------------------------------------------------------------------------------
# Target encoding
# ---------------------------------------------------------------------------------------------------------------


def gaussian_radius(length: torch.Tensor, width: torch.Tensor, min_overlap: float) -> torch.Tensor:
    """Largest centre shift (in the units of `length`/`width`) for which a box of that size still overlaps its
    shifted copy with IoU >= min_overlap, taking the worst of the three corner cases of CornerNet/CenterNet."""
    b1 = length + width
    c1 = width * length * (1 - min_overlap) / (1 + min_overlap)
    r1 = (b1 + torch.sqrt((b1 ** 2 - 4 * c1).clamp(min=0))) / 2
    b2 = 2 * (length + width)
    c2 = (1 - min_overlap) * width * length
    r2 = (b2 + torch.sqrt((b2 ** 2 - 16 * c2).clamp(min=0))) / 2
    a3 = 4 * min_overlap
    b3 = -2 * min_overlap * (length + width)
    c3 = (min_overlap - 1) * width * length
    r3 = (b3 + torch.sqrt((b3 ** 2 - 4 * a3 * c3).clamp(min=0))) / 2
    return torch.minimum(torch.minimum(r1, r2), r3)


def _check_boxes(boxes: torch.Tensor, labels: torch.Tensor, where: str) -> None:
    if boxes.dim() != 2 or boxes.shape[1] != BOX_DIM:
        raise ValueError(f"{where}: expected boxes M x {BOX_DIM} [x, y, z, w, l, h, yaw, vx, vy], got "
                         f"{tuple(boxes.shape)}")
    if labels.dim() != 1 or labels.shape[0] != boxes.shape[0]:
        raise ValueError(f"{where}: expected labels of shape ({boxes.shape[0]},) matching the boxes, got "
                         f"{tuple(labels.shape)}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{where}: expected integer labels (indices into DETECTION_CLASSES), got {labels.dtype}")


def encode_targets(boxes: Sequence[torch.Tensor], labels: Sequence[torch.Tensor], frame: BevFrame,
                   num_classes: int = len(DETECTION_CLASSES), min_overlap: float = 0.1, min_radius: int = 2,
                   device: Optional[torch.device] = None) -> dict:
    """Training targets of the first stage for a batch of ground-truth boxes (one M_b x 9 tensor per sample).

    Returns a dict: "heatmap" B x num_classes x H x W (a gaussian per box, exactly 1 at its centre cell, max where
    gaussians overlap); for the N boxes whose centre lies on the map: "batch", "row", "col", "labels" (N int64),
    "regression" N x 10 (REGRESSION_CHANNELS) and "regression_mask" N x 10 (0 where the velocity is unknown, NaN).
    """
    if len(boxes) != len(labels):
        raise ValueError(f"encode_targets: got {len(boxes)} box tensors but {len(labels)} label tensors; expected "
                         "one of each per sample")
    device = device if device is not None else (boxes[0].device if len(boxes) else torch.device("cpu"))
    B, H, W = len(boxes), frame.H, frame.W
    heatmap = torch.zeros(B, num_classes, H, W, device=device)
    for b, (bx, lb) in enumerate(zip(boxes, labels)):
        _check_boxes(bx, lb, f"encode_targets (sample {b})")
    all_boxes = torch.cat([bx.to(device, torch.float32) for bx in boxes]) if B else torch.zeros(0, BOX_DIM)
    all_labels = torch.cat([lb.to(device, torch.long) for lb in labels]) if B else torch.zeros(0, dtype=torch.long)
    batch = torch.cat([torch.full((len(bx),), b, dtype=torch.long, device=device) for b, bx in enumerate(boxes)]) \
        if B else torch.zeros(0, dtype=torch.long)

    row, col, keep = frame.locate(all_boxes, all_labels, num_classes)
    all_boxes, all_labels, batch, row, col = (t[keep] for t in (all_boxes, all_labels, batch, row, col))
    u, v = frame.to_cells(all_boxes[:, 0], all_boxes[:, 1])

    if len(all_boxes):
        # Radius from the footprint in cells: l along the heading, w across it (CenterPoint's rule).
        radius = gaussian_radius(all_boxes[:, 4] / frame.dx, all_boxes[:, 3] / frame.dy, min_overlap)
        radius = torch.clamp(torch.floor(radius), min=min_radius).long()
        reach = int(radius.max())
        offsets = torch.arange(-reach, reach + 1, device=device)
        d_row, d_col = offsets.view(1, -1, 1), offsets.view(1, 1, -1)
        sigma = ((2 * radius + 1).float() / 6).view(-1, 1, 1)
        values = torch.exp(-(d_row ** 2 + d_col ** 2).float() / (2 * sigma ** 2))
        rows, cols = row.view(-1, 1, 1) + d_row, col.view(-1, 1, 1) + d_col
        r = radius.view(-1, 1, 1)
        inside = (d_row.abs() <= r) & (d_col.abs() <= r) & (rows >= 0) & (rows < H) & (cols >= 0) & (cols < W)
        plane = (batch * num_classes + all_labels).view(-1, 1, 1)
        flat = (plane * H + rows.clamp(0, H - 1)) * W + cols.clamp(0, W - 1)
        heatmap.view(-1).scatter_reduce_(0, flat[inside], values[inside], reduce="amax", include_self=True)

    size = all_boxes[:, 3:6]
    yaw = all_boxes[:, 6]
    velocity = all_boxes[:, 7:9]
    velocity_known = torch.isfinite(velocity)
    regression = torch.cat([
        (u - row).unsqueeze(1), (v - col).unsqueeze(1), all_boxes[:, 2:3], torch.log(size),
        torch.sin(yaw).unsqueeze(1), torch.cos(yaw).unsqueeze(1), torch.where(velocity_known, velocity, 0.0),
    ], dim=1)
    mask = torch.ones_like(regression)
    mask[:, 8:10] = velocity_known.float()
    return {"heatmap": heatmap, "batch": batch, "row": row, "col": col, "labels": all_labels,
            "regression": regression, "regression_mask": mask}


# ---------------------------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------------------------


def regression_to_boxes(regression: torch.Tensor, row: torch.Tensor, col: torch.Tensor,
                        frame: BevFrame) -> torch.Tensor:
    """Boxes ... x 9 (ego frame) from regression values ... x 10 (REGRESSION_CHANNELS) read at cells (row, col)."""
    regression = regression.float()
    x = (row.float() + regression[..., 0]) * frame.dx + frame.x_min
    y = (col.float() + regression[..., 1]) * frame.dy + frame.y_min
    size = torch.exp(regression[..., 3:6].clamp(max=_MAX_LOG_SIZE))
    yaw = torch.atan2(regression[..., 6], regression[..., 7])
    return torch.cat([x.unsqueeze(-1), y.unsqueeze(-1), regression[..., 2:3], size, yaw.unsqueeze(-1),
                      regression[..., 8:10]], dim=-1)


def decode_peaks(heatmap_logits: torch.Tensor, regression: torch.Tensor, frame: BevFrame,
                 top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top_k local maxima (3 x 3) over all classes of each sample's heatmap.

    heatmap_logits B x K x H x W, regression B x 10 x H x W. Returns boxes B x k x 9 (ego frame), scores B x k
    (sigmoid probabilities, descending), labels B x k (int64), with k = min(top_k, K H W).
    """
    if heatmap_logits.dim() != 4 or regression.dim() != 4 or regression.shape[1] != len(REGRESSION_CHANNELS) \
            or heatmap_logits.shape[0] != regression.shape[0] or heatmap_logits.shape[2:] != regression.shape[2:]:
        raise ValueError(f"decode_peaks: expected heatmap B x K x H x W and regression B x "
                         f"{len(REGRESSION_CHANNELS)} x H x W, got {tuple(heatmap_logits.shape)} and "
                         f"{tuple(regression.shape)}")
    B, K, H, W = heatmap_logits.shape
    heat = torch.sigmoid(heatmap_logits.float())
    peaks = heat * (heat == F.max_pool2d(heat, 3, stride=1, padding=1))
    k = min(top_k, K * H * W)
    scores, index = peaks.reshape(B, -1).topk(k, dim=1)
    labels = index // (H * W)
    cell = index % (H * W)
    row, col = cell // W, cell % W
    values = regression.float().reshape(B, len(REGRESSION_CHANNELS), H * W)
    values = values.gather(2, cell.unsqueeze(1).expand(-1, len(REGRESSION_CHANNELS), -1)).transpose(1, 2)
    return regression_to_boxes(values, row, col, frame), scores, labels


def bev_envelopes(boxes: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Axis-aligned BEV envelopes ... x 4 (x1, y1, x2, y2), ego metres, of rotated boxes ... x 9, scaled about the
    centre by `scale`."""
    cos, sin = torch.cos(boxes[..., 6]).abs(), torch.sin(boxes[..., 6]).abs()
    w, l = boxes[..., 3], boxes[..., 4]
    half_x = 0.5 * scale * (l * cos + w * sin)
    half_y = 0.5 * scale * (l * sin + w * cos)
    x, y = boxes[..., 0], boxes[..., 1]
    return torch.stack([x - half_x, y - half_y, x + half_x, y + half_y], dim=-1)


def _pad_per_sample(batch_index: torch.Tensor, order_key: torch.Tensor, batch: int,
                    limit: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slots for items grouped by sample and ranked by descending `order_key`: returns (item, sample, slot) for
    the first `limit` items of each sample."""
    order = torch.argsort(order_key, descending=True)
    order = order[torch.argsort(batch_index[order], stable=True)]
    sample = batch_index[order]
    counts = torch.bincount(sample, minlength=batch)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(len(order), device=order.device) - starts[sample]
    keep = slot < limit
    return order[keep], sample[keep], slot[keep]


def propose(heatmap_logits: torch.Tensor, regression: torch.Tensor, frame: BevFrame, cfg: DetectionConfig,
            max_per_sample: int) -> Proposals:
    """First-stage detections: top-K peaks, score threshold, per-class batched NMS on the BEV envelopes (ego
    metres, negative coordinates included), then the best `max_per_sample` of each sample."""
    B = heatmap_logits.shape[0]
    boxes, scores, labels = decode_peaks(heatmap_logits, regression, frame, cfg.top_k)
    num_classes = heatmap_logits.shape[1]
    batch_index = torch.arange(B, device=boxes.device).view(B, 1).expand_as(labels)
    keep = scores > cfg.score_threshold
    boxes, scores, labels, batch_index = boxes[keep], scores[keep], labels[keep], batch_index[keep]
    if cfg.nms_iou > 0 and len(scores):
        kept = batched_nms(bev_envelopes(boxes), scores, batch_index * num_classes + labels, cfg.nms_iou)
        boxes, scores, labels, batch_index = boxes[kept], scores[kept], labels[kept], batch_index[kept]
    item, sample, slot = _pad_per_sample(batch_index, scores, B, max_per_sample)
    P = int(slot.max()) + 1 if len(slot) else 0
    out = Proposals.zeros(B, P, boxes.device)
    out.boxes[sample, slot] = boxes[item]
    out.scores[sample, slot] = scores[item]
    out.labels[sample, slot] = labels[item]
    out.valid[sample, slot] = True
    return out


def _cat_proposals(a: Proposals, b: Proposals) -> Proposals:
    return Proposals(torch.cat([a.boxes, b.boxes], 1), torch.cat([a.scores, b.scores], 1),
                     torch.cat([a.labels, b.labels], 1), torch.cat([a.valid, b.valid], 1))


def ground_truth_proposals(gt_boxes: Sequence[torch.Tensor], gt_labels: Sequence[torch.Tensor],
                           heatmap_logits: torch.Tensor, frame: BevFrame, generator: Optional[torch.Generator] = None,
                           centre_jitter: float = 0.5, size_jitter: float = 0.1,
                           yaw_jitter: float = 0.2) -> Proposals:
    """Jittered copies of the ground-truth boxes on the map (positives for the second stage early in training),
    scored by the heatmap at their cell. Jitter: centre std in metres, relative size std, yaw std in radians."""
    B, K = heatmap_logits.shape[:2]
    device = heatmap_logits.device
    M = max((len(b) for b in gt_boxes), default=0)
    out = Proposals.zeros(B, M, device)
    for b, (boxes, labels) in enumerate(zip(gt_boxes, gt_labels)):
        if not len(boxes):
            continue
        boxes = boxes.to(device, torch.float32)
        noise = torch.randn(len(boxes), 4, generator=generator).to(device)
        jittered = boxes.clone()
        jittered[:, :2] += centre_jitter * noise[:, :2]
        jittered[:, 3:6] *= torch.exp(size_jitter * noise[:, 2:3])
        jittered[:, 6] += yaw_jitter * noise[:, 3]
        jittered[:, 7:9] = torch.nan_to_num(jittered[:, 7:9])
        labels = labels.to(device, torch.long)
        row, col, ok = frame.locate(jittered, labels, K)
        n = int(ok.sum())
        out.boxes[b, :n] = jittered[ok]
        out.labels[b, :n] = labels[ok]
        out.scores[b, :n] = torch.sigmoid(heatmap_logits[b, labels[ok], row[ok], col[ok]].detach().float())
        out.valid[b, :n] = True
    return out


# ---------------------------------------------------------------------------------------------------------------
# Second stage
# ---------------------------------------------------------------------------------------------------------------


def box_residuals(proposals: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """What the second stage learns, ... x 9: centre and velocity differences, log size ratios, wrapped yaw
    difference (so that apply_residuals(proposals, box_residuals(proposals, targets)) == targets)."""
    d_yaw = torch.remainder(targets[..., 6] - proposals[..., 6] + math.pi, 2 * math.pi) - math.pi
    return torch.cat([targets[..., 0:3] - proposals[..., 0:3], torch.log(targets[..., 3:6] / proposals[..., 3:6]),
                      d_yaw.unsqueeze(-1), targets[..., 7:9] - proposals[..., 7:9]], dim=-1)


def apply_residuals(proposals: torch.Tensor, residuals: torch.Tensor) -> torch.Tensor:
    """Refined boxes ... x 9 from proposals ... x 9 and second-stage residuals ... x 9 (see box_residuals)."""
    residuals = residuals.float()
    return torch.cat([proposals[..., 0:3] + residuals[..., 0:3],
                      proposals[..., 3:6] * torch.exp(residuals[..., 3:6].clamp(max=_MAX_LOG_SIZE)),
                      (proposals[..., 6] + residuals[..., 6]).unsqueeze(-1),
                      proposals[..., 7:9] + residuals[..., 7:9]], dim=-1)


def proposal_rois(proposals: Proposals, frame: BevFrame, enlarge: float,
                  min_cells: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """RoIAlign boxes R x 5 [batch, x1, y1, x2, y2] for the valid proposals, in the map's cell units with RoIAlign's
    x along the columns (ego y) and y along the rows (ego x); each the proposal's axis-aligned envelope scaled by
    `enlarge` and at least `min_cells` wide. Also returns the (sample, slot) index of each row."""
    sample, slot = torch.nonzero(proposals.valid, as_tuple=True)
    env = bev_envelopes(proposals.boxes[sample, slot], enlarge)
    centre_x, centre_y = (env[:, 0] + env[:, 2]) / 2, (env[:, 1] + env[:, 3]) / 2
    half_rows = torch.clamp((env[:, 2] - env[:, 0]) / (2 * frame.dx), min=min_cells / 2)
    half_cols = torch.clamp((env[:, 3] - env[:, 1]) / (2 * frame.dy), min=min_cells / 2)
    u, v = frame.to_cells(centre_x, centre_y)
    rois = torch.stack([sample.float(), v - half_cols, u - half_rows, v + half_cols, u + half_rows], dim=1)
    return rois, torch.stack([sample, slot])


class BoxRefiner(nn.Module):
    """Second stage: RoIAlign pools the BEV features over each proposal's envelope; an MLP on the pooled features,
    the class and the proposal's own geometry predicts a score logit and box residuals (see box_residuals)."""

    def __init__(self, in_channels: int, num_classes: int, roi_size: int = 7, hidden: int = 256,
                 enlarge: float = 1.5):
        super().__init__()
        self.num_classes = num_classes
        self.roi_size = roi_size
        self.enlarge = enlarge
        geometry = num_classes + 9  # one-hot class, sin/cos yaw, log size, z, velocity, first-stage score
        self.mlp = nn.Sequential(
            nn.Linear(in_channels * roi_size * roi_size + geometry, hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, hidden), nn.ReLU(inplace=True),
        )
        self.score = nn.Linear(hidden, 1)
        self.residual = nn.Linear(hidden, BOX_DIM)
        # Start as the identity on boxes, so that early training does not move the proposals around.
        nn.init.zeros_(self.residual.weight)
        nn.init.zeros_(self.residual.bias)

    def forward(self, bev_features: torch.Tensor, proposals: Proposals,
                frame: BevFrame) -> tuple[torch.Tensor, torch.Tensor]:
        """bev_features B x C x H x W. Returns score logits B x P and residuals B x P x 9 (zero where invalid)."""
        B, P = proposals.valid.shape
        rois, (sample, slot) = proposal_rois(proposals, frame, self.enlarge)
        score_logits = bev_features.new_zeros(B, P, dtype=torch.float32)
        residuals = bev_features.new_zeros(B, P, BOX_DIM, dtype=torch.float32)
        if not len(rois):
            # Zero-valued use of every parameter: DDP expects gradients for all of them on every step.
            unused = sum(p.sum() for p in self.parameters()).float() * 0
            return score_logits + unused, residuals + unused
        # float32: in bf16 a roi corner near cell 200 would be off by a whole cell. validate=False skips a host
        # sync: the rois are our own decoding (batch indices from nonzero(), boxes finite unless the network's
        # outputs are not, and then the loss stops training anyway).
        pooled = roi_align(bev_features.float(), rois, (self.roi_size, self.roi_size), spatial_scale=1.0,
                           sampling_ratio=2, aligned=True, validate=False)
        boxes = proposals.boxes[sample, slot]
        geometry = torch.cat([
            F.one_hot(proposals.labels[sample, slot], self.num_classes).float(),
            torch.sin(boxes[:, 6:7]), torch.cos(boxes[:, 6:7]), torch.log(boxes[:, 3:6].clamp(min=1e-3)),
            boxes[:, 2:3], boxes[:, 7:9], proposals.scores[sample, slot].unsqueeze(1),
        ], dim=1)
        hidden = self.mlp(torch.cat([pooled.flatten(1), geometry.to(pooled.dtype)], dim=1))
        score_logits = score_logits.index_put((sample, slot), self.score(hidden).squeeze(1).float())
        residuals = residuals.index_put((sample, slot), self.residual(hidden).float())
        return score_logits, residuals


# ---------------------------------------------------------------------------------------------------------------
# The head
# ---------------------------------------------------------------------------------------------------------------


def check_config(cfg: DetectionConfig) -> None:
    """Raise ConfigError naming the detection.* value that cannot work."""
    if len(cfg.code_weights) != len(REGRESSION_CHANNELS):
        raise ConfigError(f"detection.code_weights: expected {len(REGRESSION_CHANNELS)} weights "
                          f"({', '.join(REGRESSION_CHANNELS)}), got {len(cfg.code_weights)}")
    if not 1 <= cfg.max_detections <= MAX_BOXES_PER_SAMPLE:
        raise ConfigError(f"detection.max_detections={cfg.max_detections}: expected 1 to {MAX_BOXES_PER_SAMPLE} (the "
                          "nuScenes evaluation accepts at most 500 boxes per sample)")
    for key in ("head_channels", "top_k", "roi_size", "refine_hidden", "refine_proposals"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"detection.{key}={getattr(cfg, key)}: expected a positive integer")
    if cfg.min_radius < 0:
        raise ConfigError(f"detection.min_radius={cfg.min_radius}: expected 0 or more heatmap cells")
    if not 0 < cfg.gaussian_overlap < 1 or cfg.match_distance <= 0 or cfg.roi_enlarge <= 0:
        raise ConfigError("detection: gaussian_overlap must lie in (0, 1), match_distance and roi_enlarge must be "
                          f"positive; got {cfg.gaussian_overlap}, {cfg.match_distance}, {cfg.roi_enlarge}")


def _conv_bn_relu(c_in: int, c_out: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]


class DetectionHead(nn.Module):
    """CenterPoint-style head on B x C x H x W BEV features (H x W covering config.grid's x/y bounds).

    forward(bev_features, batch=None) returns "det_heatmap" B x K x H x W logits and "det_regression" B x 10 x H x W
    (REGRESSION_CHANNELS); with config.detection.refine also "det_proposals" (Proposals, detached boxes from the
    first stage, plus jittered ground truth while training when the batch carries "det_boxes"),
    "det_refine_scores" B x P logits and "det_refine_residuals" B x P x 9.
    """

    def __init__(self, in_channels: int, config: Config, num_classes: int = len(DETECTION_CLASSES)):
        super().__init__()
        check_config(config.detection)
        self.cfg = config.detection
        self.xbound, self.ybound = tuple(config.grid.xbound), tuple(config.grid.ybound)
        self.num_classes = num_classes
        hc = self.cfg.head_channels
        self.shared = nn.Sequential(*_conv_bn_relu(in_channels, hc))
        self.heatmap = nn.Sequential(*_conv_bn_relu(hc, hc), nn.Conv2d(hc, num_classes, 1))
        self.regression = nn.Sequential(*_conv_bn_relu(hc, hc), nn.Conv2d(hc, len(REGRESSION_CHANNELS), 1))
        # Heatmap prior 0.1 (focal-loss practice): the loss starts small on the mostly empty map.
        nn.init.constant_(self.heatmap[-1].bias, -math.log((1 - 0.1) / 0.1))
        self.refiner = BoxRefiner(hc, num_classes, self.cfg.roi_size, self.cfg.refine_hidden, self.cfg.roi_enlarge) \
            if self.cfg.refine else None

    def frame(self, shape: Sequence[int]) -> BevFrame:
        return BevFrame.from_bounds(self.xbound, self.ybound, shape)

    def forward(self, bev_features: torch.Tensor, batch: Optional[dict] = None) -> dict:
        if bev_features.dim() != 4:
            raise ValueError(f"DetectionHead: expected BEV features B x C x H x W, got {tuple(bev_features.shape)}")
        features = self.shared(bev_features)
        out = {"det_heatmap": self.heatmap(features), "det_regression": self.regression(features)}
        if self.refiner is None:
            return out
        frame = self.frame(bev_features.shape[-2:])
        limit = self.cfg.refine_proposals if self.training else self.cfg.max_detections
        with torch.no_grad():
            proposals = propose(out["det_heatmap"], out["det_regression"], frame, self.cfg, limit)
            if self.training and self.cfg.refine_gt_proposals and batch is not None and "det_boxes" in batch:
                gt = ground_truth_proposals(batch["det_boxes"], batch["det_labels"], out["det_heatmap"], frame)
                proposals = _cat_proposals(proposals, gt)
        out["det_proposals"] = proposals
        out["det_refine_scores"], out["det_refine_residuals"] = self.refiner(features, proposals, frame)
        return out


# ---------------------------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------------------------


def _pad_ground_truth(gt_boxes: Sequence[torch.Tensor], gt_labels: Sequence[torch.Tensor],
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """B x M x 9 boxes and B x M labels (-1 for padding)."""
    B, M = len(gt_boxes), max((len(b) for b in gt_boxes), default=0)
    boxes = torch.zeros(B, M, BOX_DIM, device=device)
    labels = torch.full((B, M), -1, dtype=torch.long, device=device)
    for b, (bx, lb) in enumerate(zip(gt_boxes, gt_labels)):
        boxes[b, :len(bx)] = bx.to(device, torch.float32)
        labels[b, :len(lb)] = lb.to(device, torch.long)
    return boxes, labels


def match_proposals(proposals: Proposals, gt_boxes: Sequence[torch.Tensor], gt_labels: Sequence[torch.Tensor],
                    match_distance: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Nearest same-class ground truth (BEV centre distance) of every proposal.

    Returns the matched boxes B x P x 9, the distances B x P (inf without a same-class box) and the positives
    B x P (valid and closer than match_distance).
    """
    boxes, labels = _pad_ground_truth(gt_boxes, gt_labels, proposals.boxes.device)
    B, P = proposals.valid.shape
    if boxes.shape[1] == 0 or P == 0:
        return (proposals.boxes.new_zeros(B, P, BOX_DIM), proposals.boxes.new_full((B, P), math.inf),
                torch.zeros(B, P, dtype=torch.bool, device=proposals.boxes.device))
    distance = torch.cdist(proposals.boxes[..., :2], boxes[..., :2])
    same_class = proposals.labels.unsqueeze(2) == labels.unsqueeze(1)
    distance = torch.where(same_class, distance, math.inf)
    nearest, index = distance.min(dim=2)
    matched = boxes.gather(1, index.unsqueeze(2).expand(-1, -1, BOX_DIM))
    return matched, nearest, proposals.valid & (nearest < match_distance)


def detection_loss(outputs: dict, batch: dict, config: Config) -> dict[str, torch.Tensor]:
    """Weighted detection losses (sum them for the total): "det_heatmap" (penalty-reduced focal loss of the
    heatmap logits on the gaussian targets, per object), "det_regression" (weighted L1 at the object centres, per
    object) and, with the second stage, "det_refine_score" (BCE towards 1 - distance / match_distance) and
    "det_refine_box" (weighted L1 of the residuals of the positive proposals)."""
    cfg = config.detection
    if "det_boxes" not in batch or "det_labels" not in batch:
        raise KeyError("detection_loss: the batch has no 'det_boxes'/'det_labels'; set data.detection_targets: "
                       "true so that the dataset provides the detection targets")
    check_config(cfg)
    heatmap_logits, regression = outputs["det_heatmap"], outputs["det_regression"]
    frame = BevFrame.from_bounds(config.grid.xbound, config.grid.ybound, heatmap_logits.shape[-2:])
    targets = encode_targets(batch["det_boxes"], batch["det_labels"], frame, heatmap_logits.shape[1],
                             cfg.gaussian_overlap, cfg.min_radius, device=heatmap_logits.device)
    num_objects = max(len(targets["labels"]), 1)

    # CornerNet's penalty-reduced focal loss: positives at the centre cells, negatives down-weighted near them.
    centres = (targets["heatmap"] == 1).float()
    penalty = torch.where(centres.bool(), 1.0, (1 - targets["heatmap"]) ** 4)
    focal = sigmoid_focal_loss(heatmap_logits.float(), centres, alpha=cfg.focal_alpha, gamma=cfg.focal_gamma,
                               reduction="none")
    heatmap_loss = (focal * penalty).sum() / num_objects

    predicted = regression.float()[targets["batch"], :, targets["row"], targets["col"]]
    code_weights = torch.tensor(cfg.code_weights, device=predicted.device)
    l1 = (predicted - targets["regression"]).abs() * targets["regression_mask"] * code_weights
    losses = {"det_heatmap": cfg.heatmap_weight * heatmap_loss,
              "det_regression": cfg.regression_weight * l1.sum() / num_objects}

    if "det_refine_scores" in outputs:
        proposals = outputs["det_proposals"]
        matched, distance, positive = match_proposals(proposals, batch["det_boxes"], batch["det_labels"],
                                                      cfg.match_distance)
        valid = proposals.valid
        score_target = torch.clamp(1 - distance / cfg.match_distance, min=0.0)
        logits = outputs["det_refine_scores"]
        score_loss = F.binary_cross_entropy_with_logits(logits[valid], score_target[valid], reduction="sum") \
            / max(int(valid.sum()), 1)
        residual_target = box_residuals(proposals.boxes[positive], matched[positive])
        residual_weight = code_weights[list(_RESIDUAL_WEIGHT_CHANNELS)] \
            * torch.isfinite(residual_target).float()
        box_l1 = (outputs["det_refine_residuals"][positive] - torch.nan_to_num(residual_target)).abs() * residual_weight
        losses["det_refine_score"] = cfg.refine_weight * score_loss
        losses["det_refine_box"] = cfg.refine_weight * box_l1.sum() / max(int(positive.sum()), 1)
    return losses


# ---------------------------------------------------------------------------------------------------------------
# Final detections
# ---------------------------------------------------------------------------------------------------------------


def decode_detections(outputs: dict, config: Config) -> list[dict]:
    """Final boxes of each sample from the head's outputs (in eval mode): a list of dicts with "boxes" M x 9 (ego
    frame), "scores" M (descending) and "labels" M (int64 into DETECTION_CLASSES).

    With the second stage the proposals' boxes get the residuals and the score is sqrt(first stage x second stage);
    without it the first-stage proposals are the detections.
    """
    cfg = config.detection
    if "det_refine_scores" in outputs:
        proposals = outputs["det_proposals"]
        boxes = apply_residuals(proposals.boxes, outputs["det_refine_residuals"].detach())
        scores = torch.sqrt(proposals.scores * torch.sigmoid(outputs["det_refine_scores"].detach()))
        valid = proposals.valid
        labels = proposals.labels
    else:
        frame = BevFrame.from_bounds(config.grid.xbound, config.grid.ybound, outputs["det_heatmap"].shape[-2:])
        proposals = propose(outputs["det_heatmap"].detach(), outputs["det_regression"].detach(), frame, cfg,
                            cfg.max_detections)
        boxes, scores, valid, labels = proposals.boxes, proposals.scores, proposals.valid, proposals.labels
    detections = []
    for b in range(valid.shape[0]):
        keep = valid[b]
        order = torch.argsort(scores[b][keep], descending=True)[:cfg.max_detections]
        detections.append({"boxes": boxes[b][keep][order], "scores": scores[b][keep][order],
                           "labels": labels[b][keep][order]})
    return detections
