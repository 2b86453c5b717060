"""Detection head post-processing per batch: heatmap decode (top-K peaks) + batched NMS + RoIAlign refinement, and
our NMS / RoIAlign against torchvision's on the same boxes."""

from __future__ import annotations

import torch

from lss.geometry.boxes import bev_envelopes
from lss.config import Config
from lss.geometry import BevGrid
from lss.models.heads.box_refiner import BoxRefiner, proposal_rois
from lss.models.heads.detection_decode import decode_peaks, propose
from lss.ops import batched_nms, roi_align


def _inputs(
    device: torch.device, batch: int, classes: int, size: int, channels: int, seed: int = 0
):
    g = torch.Generator(device="cpu").manual_seed(seed)
    # Mostly low scores with scattered confident cells, like a trained heatmap.
    heatmap = (torch.randn(batch, classes, size, size, generator=g) * 2 - 4).to(device)
    regression = torch.randn(batch, 10, size, size, generator=g).to(device) * 0.3
    regression[:, 3:6] += torch.tensor([0.7, 1.4, 0.5], device=device).view(1, 3, 1, 1)
    features = torch.randn(batch, channels, size, size, generator=g).to(device)
    return heatmap, regression, features


def _setup(device: torch.device, quick: bool):
    batch, classes, size, channels = (1, 10, 32, 16) if quick else (4, 10, 200, 64)
    config = Config()
    grid = BevGrid.from_config(config.grid).with_shape((size, size))
    heatmap, regression, features = _inputs(device, batch, classes, size, channels)
    refiner = (
        BoxRefiner(
            channels,
            classes,
            config.detection.roi_size,
            config.detection.refine_hidden,
            config.detection.roi_enlarge,
            config.detection.refine_features,
        )
        .to(device)
        .eval()
    )
    return config, grid, heatmap, regression, features, refiner


def run(ctx) -> list[dict]:
    device = ctx.device
    config, grid, heatmap, regression, features, refiner = _setup(device, ctx.quick)
    cfg = config.detection
    B, K, H, W = heatmap.shape
    shape = f"B{B} K{K} {H}x{W} C{features.shape[1]}"
    rows = []

    @torch.no_grad()
    def pipeline():
        proposals = propose(heatmap, regression, grid, cfg, cfg.max_detections)
        return refiner(features, proposals, grid)

    proposals = propose(heatmap, regression, grid, cfg, cfg.max_detections)
    count = int(proposals.valid.sum())
    rows.append(
        {
            "case": f"decode+nms+roi_align+mlp {shape}",
            "impl": "lss",
            "ms": ctx.time(pipeline, 5, 20),
            "floor_ms": None,
            "notes": f"{count} boxes kept per batch, top_k {cfg.top_k}",
        }
    )
    rows.append(
        {
            "case": f"decode (top-K peaks) {shape}",
            "impl": "lss",
            "ms": ctx.time(lambda: decode_peaks(heatmap, regression, grid, cfg.top_k), 5, 20),
            "floor_ms": ctx.floor_ms((heatmap.numel() + regression.numel()) * 4),
            "notes": "",
        }
    )

    boxes, scores, labels = decode_peaks(heatmap, regression, grid, cfg.top_k)
    keep = scores > cfg.score_threshold
    idxs = (torch.arange(B, device=device).view(B, 1) * K + labels)[keep]
    envelopes, scores = bev_envelopes(boxes[keep]), scores[keep]
    n = len(scores)
    rows.append(
        {
            "case": f"batched_nms {n} boxes",
            "impl": "lss",
            "ms": ctx.time(lambda: batched_nms(envelopes, scores, idxs, cfg.nms_iou), 5, 20),
            "floor_ms": None,
            "notes": "ego-frame boxes, negative coordinates",
        }
    )
    rois = proposal_rois(proposals, grid, cfg.roi_enlarge)
    out = (cfg.roi_size, cfg.roi_size)
    rows.append(
        {
            "case": f"roi_align {len(rois)} rois {shape}",
            "impl": "lss",
            "ms": ctx.time(lambda: roi_align(features, rois, out, 1.0, 2, True), 5, 20),
            "floor_ms": None,
            "notes": f"{cfg.roi_size}x{cfg.roi_size}, sampling 2, aligned",
        }
    )
    try:
        import torchvision.ops as tvo
    except ImportError:
        return rows
    # torchvision's per-class offset trick assumes non-negative coordinates: shift the same boxes to be fair.
    shifted = envelopes - envelopes.min()
    rows.append(
        {
            "case": f"batched_nms {n} boxes",
            "impl": "torchvision",
            "ms": ctx.time(lambda: tvo.batched_nms(shifted, scores, idxs, cfg.nms_iou), 5, 20),
            "floor_ms": None,
            "notes": "boxes shifted to non-negative coordinates",
        }
    )
    rows.append(
        {
            "case": f"roi_align {len(rois)} rois {shape}",
            "impl": "torchvision",
            "ms": ctx.time(lambda: tvo.roi_align(features, rois, out, 1.0, 2, True), 5, 20),
            "floor_ms": None,
            "notes": "",
        }
    )
    return rows


def smoke(device) -> None:
    """Decode + NMS + RoIAlign refinement forward and backward once on small inputs."""
    device = torch.device(device)
    config, grid, heatmap, regression, features, refiner = _setup(device, quick=True)
    features.requires_grad_(True)
    proposals = propose(
        heatmap, regression, grid, config.detection, config.detection.max_detections
    )
    scores, residuals = refiner.train()(features, proposals, grid)
    (scores.sum() + residuals.sum()).backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
