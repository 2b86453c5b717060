"""Inference latency at batch 1 with the detection head, for docs/benchmarks.md: the whole model (six cameras ->
BEV -> segmentation + detection head, eval mode) with and without the detection post-processing, the
post-processing alone (decode + NMS + RoIAlign refinement from the head's outputs, with the refinement on and off),
and the same model without the detection head (segmentation only). Random weights unless --ckpt; one real val
sample of the set (so the heatmap peaks are those of the given weights), the same rig every call (cached LUT).

    python scripts/detection_latency.py --data-dir data/benchmark_accuracy --ckpt-on RUN/checkpoints/last.pt
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lss.config import load_config  # noqa: E402
from lss.data import collate  # noqa: E402
from lss.data.loader import build_dataset  # noqa: E402
from lss.engine.distributed import build_autocast, select_device, to_device  # noqa: E402
from lss.models.build import build_model  # noqa: E402
from lss.engine.checkpoint import load_for_inference  # noqa: E402
from lss.models.heads.detection_decode import decode_detections, propose  # noqa: E402

CONFIG = "configs/synthetic_detection.yaml"


def timed(fn, device: torch.device, warmup: int, reps: int) -> float:
    """Median milliseconds of fn() over `reps` calls (synchronised) after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--version", default="v1.0-trainval")
    p.add_argument("--ckpt-on", default=None,
                   help="checkpoint trained with detection.refine=true and detection.refine_depth=false")
    p.add_argument("--ckpt-off", default=None, help="checkpoint trained with detection.refine=false")
    p.add_argument("--out", default=None)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--set", action="append", default=[], dest="overrides")
    args = p.parse_args(argv)
    overrides = [f"data.dataroot={args.data_dir}", f"data.version={args.version}", "data.workers=0",
                 "data.make_synthetic_if_missing=false", "data.depth_targets=false", "loss.depth_weight=0"]
    overrides += args.overrides
    rows = {}
    with torch.no_grad():
        for refine in (True, False):
            # the RoIAlign stage on the BEV features alone: the camera depth cues of the config read the batch's
            # cameras, which the head-only timings below do not pass
            cfg = load_config(CONFIG, overrides + [f"detection.refine={str(refine).lower()}",
                                                   "detection.refine_depth=false"])
            ckpt = args.ckpt_on if refine else args.ckpt_off
            if ckpt:
                model, _ = load_for_inference(cfg, ckpt)
            else:
                model = build_model(cfg).to(select_device(cfg)).eval()
            device = next(model.parameters()).device
            autocast = build_autocast(cfg, device)
            dataset = build_dataset(cfg, cfg.data.val_split, is_train=False)
            batch = to_device(collate([dataset[0]]), device)

            def forward():
                with autocast():
                    return model(batch)

            def forward_decode():
                return decode_detections(forward(), cfg)

            outputs = forward()
            with autocast():
                features = model.bev(model.splat(*_camera(model, batch), model.splat.lut(batch)))
            head = model.detection

            def post_processing():
                with autocast():
                    out = head(features)
                return decode_detections(out, cfg)

            def head_convs():
                with autocast():
                    shared = head.shared(features)
                    return head.heatmap(shared), head.regression(shared)

            with autocast():
                shared = head.shared(features)
                maps = {"det_heatmap": head.heatmap(shared), "det_regression": head.regression(shared)}
            grid = head.grid.with_shape(features.shape[-2:])

            def post_only():
                out = dict(maps)
                if head.refiner is not None:
                    proposals = propose(out["det_heatmap"], out["det_regression"], grid, cfg.detection,
                                        cfg.detection.max_detections)
                    with autocast():
                        out["det_refine_scores"], out["det_refine_residuals"] = head.refiner(shared, proposals, grid)
                    out["det_proposals"] = proposals
                return decode_detections(out, cfg)

            name = "refine_on" if refine else "refine_off"
            rows[f"{name}: post-processing alone (decode, NMS{', RoIAlign refine' if refine else ''})"] = \
                timed(post_only, device, 5, args.reps)
            rows[f"{name}: model forward + decode (B1)"] = timed(forward_decode, device, 5, args.reps)
            rows[f"{name}: detection head convs"] = timed(head_convs, device, 5, args.reps)
            rows[f"{name}: head + post-processing (decode, NMS{', RoIAlign refine' if refine else ''})"] = \
                timed(post_processing, device, 5, args.reps)
            rows[f"{name}: detections kept"] = float(len(decode_detections(outputs, cfg)[0]["scores"]))
            if refine:
                seg = copy.deepcopy(model)
                seg.detection = None

                def segmentation_only():
                    with autocast():
                        return seg(batch)

                rows["segmentation only: model forward (B1)"] = timed(segmentation_only, device, 5, args.reps)
    device_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    result = {"device": device_name, "torch": torch.__version__, "ckpt": [args.ckpt_on, args.ckpt_off],
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "ms": rows}
    for k, v in rows.items():
        print(f"latency {k}: {v:.3f}" + ("" if "kept" in k else " ms"))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


def _camera(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth and context of the batch's cameras, B x N x ... (as LiftSplatShoot.forward computes them)."""
    images = batch["images"]
    b, n = images.shape[:2]
    depth, context = model.camera(images.flatten(0, 1))[:2]
    return depth.unflatten(0, (b, n)), context.unflatten(0, (b, n))


if __name__ == "__main__":
    main()
