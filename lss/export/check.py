"""`lss export --check`: the exported model in onnxruntime against the PyTorch model on validation
samples."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch
from torch import nn

from lss.config import Config
from lss.errors import ArgumentError, LssError
from lss.export.graph import CUSTOM_DOMAIN, RIG_KEYS

LOGIT_TOLERANCE = 1e-3  # fp32: max |logit difference| of a faithful export
IOU_TOLERANCE = 0.1  # IoU points


def onnxruntime_session(path: Union[str, Path], threads: Optional[int] = None, cuda: bool = False):
    """An onnxruntime CPU session of the model at `path` (`cuda`: on onnxruntime's CUDA execution
    provider where it is installed); a clear error where onnxruntime is missing or the graph holds
    our custom node (stock onnxruntime has no kernel for it)."""
    try:
        import onnx
        import onnxruntime as ort
    except ImportError as e:
        raise LssError(
            f"running an exported model needs onnx and onnxruntime ({e}); install them with "
            "pip install onnx onnxruntime (or pip install -e '.[export]')"
        ) from None
    if any(
        node.domain == CUSTOM_DOMAIN
        for node in onnx.load(str(path), load_external_data=False).graph.node
    ):
        raise ArgumentError(
            f"{path} holds the custom node {CUSTOM_DOMAIN}.BevPool, which stock onnxruntime cannot "
            "run; check an export made with --bev-pool onnx (same weights and rig)"
        )
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    providers = ["CPUExecutionProvider"]
    if cuda and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    return ort.InferenceSession(str(path), options, providers=providers)


def check_export(
    cfg: Config,
    model: nn.Module,
    path: Union[str, Path],
    rig: Optional[dict] = None,
    samples: int = 8,
) -> dict:
    """Run the PyTorch `model` (CPU, fp32) and the ONNX file `path` in onnxruntime on the first
    `samples` validation samples, one at a time. A fixed-rig export (rig given) is compared with
    PyTorch run on that rig, and the largest difference between the samples' own rig and it is
    reported ("rig_deviation"). Returns max_abs_diff, max_abs_logit, the IoU of both
    (IoUMeter.compute), the largest IoU difference in points and "passed"."""
    from lss.data import collate
    from lss.data.loader import build_dataset
    from lss.engine.metrics import IoUMeter

    if samples < 1:
        raise ArgumentError(f"--check-samples {samples}: expected at least 1")
    session = onnxruntime_session(path)
    inputs = [i.name for i in session.get_inputs()]
    dataset = build_dataset(cfg, cfg.data.val_split, False)
    count = min(samples, len(dataset))
    meters = {name: IoUMeter(cfg.data.classes, cfg.eval.threshold) for name in ("torch", "onnx")}
    max_diff = max_logit = rig_deviation = 0.0
    model = model.cpu().eval()
    for index in range(count):
        batch = collate([dataset[index]])
        if rig is not None:
            rig_deviation = max(
                rig_deviation, max(float((batch[k][0] - rig[k]).abs().max()) for k in RIG_KEYS)
            )
            batch.update({k: rig[k][None].float() for k in RIG_KEYS})
        with torch.no_grad():
            ours = model(batch)["segmentation"]
            if "prev_depth" in inputs:  # a two-frame export reads the previous frame's features
                depth, context = model.camera(batch["prev_images"].flatten(0, 1))
                batch["prev_depth"] = depth.unflatten(0, (1, -1))
                batch["prev_context"] = context.unflatten(0, (1, -1))
        batch["images"] = model.camera.normalize(batch["images"])  # the export reads normalised
        feeds = {name: batch[name].float().contiguous().numpy() for name in inputs}
        theirs = torch.from_numpy(np.asarray(session.run(["segmentation"], feeds)[0]))
        max_diff = max(max_diff, float((theirs - ours).abs().max()))
        max_logit = max(max_logit, float(ours.abs().max()))
        meters["torch"].update(ours, batch["targets"])
        meters["onnx"].update(theirs, batch["targets"])
    result = {
        "samples": count,
        "max_abs_diff": max_diff,
        "max_abs_logit": max_logit,
        "rig_deviation": rig_deviation if rig is not None else None,
    }
    result.update({f"iou_{name}": meter.compute()["iou"] for name, meter in meters.items()})
    result["max_iou_diff_points"] = max(
        100 * abs(result["iou_torch"][c] - result["iou_onnx"][c]) for c in cfg.data.classes
    )
    result["passed"] = (
        max_diff <= LOGIT_TOLERANCE and result["max_iou_diff_points"] <= IOU_TOLERANCE
    )
    return result


def format_check(result: dict, path: Union[str, Path]) -> str:
    lines = [
        f"check of {path}: {result['samples']} validation samples, onnxruntime CPU vs PyTorch CPU "
        "(fp32)",
        f"max |logit difference| {result['max_abs_diff']:.3g} (largest |logit| "
        f"{result['max_abs_logit']:.3g}; target <= {LOGIT_TOLERANCE:g})",
    ]
    width = max(len(c) for c in result["iou_torch"])
    lines.append(f"{'class':<{width}}  IoU torch  IoU onnx")
    for c, iou in result["iou_torch"].items():
        lines.append(f"{c:<{width}}  {100 * iou:9.2f}  {100 * result['iou_onnx'][c]:8.2f}")
    lines.append(
        f"largest IoU difference {result['max_iou_diff_points']:.3f} points "
        f"(target <= {IOU_TOLERANCE:g})"
    )
    if result["rig_deviation"]:
        lines.append(
            f"note: the samples' own rigs differ from the exported fixed rig by up to "
            f"{result['rig_deviation']:.3g} (both sides ran on the fixed rig)"
        )
    lines.append("PASSED" if result["passed"] else "FAILED")
    return "\n".join(lines)
