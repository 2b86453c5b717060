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
from lss.export.graph import CUSTOM_DOMAIN, DETECTION_OUTPUTS, RIG_KEYS

LOGIT_TOLERANCE = 1e-3  # fp32: max |logit difference| of a faithful export
IOU_TOLERANCE = 0.1  # IoU points
# An export with rig inputs computes the frustum-to-BEV table in the graph, in float32 as PyTorch
# does but through onnxruntime's kernels: a frustum point within rounding of a cell boundary can
# land in the neighbouring cell, which moves the logits of the cells around it beyond
# LOGIT_TOLERANCE. Such an export passes when the grid cells (any class or map) off by more than
# LOGIT_TOLERANCE are at most this share of the cells checked.
BOUNDARY_CELL_SHARE = 1e-2


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


def session_head_outputs(session) -> list[str]:
    """The head outputs an onnxruntime session of an lss export has: "segmentation", and the
    detection head's maps where the export holds them (an export without the head, or an older
    one)."""
    exported = {o.name for o in session.get_outputs()}
    return ["segmentation"] + [name for name in DETECTION_OUTPUTS if name in exported]


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
    (IoUMeter.compute), the largest IoU difference in points and "passed"; an export with the
    detection head's maps also max_abs_diff_detection (its heatmap logits and regression maps),
    held to the same tolerance. "off_cell_share": the share of grid cells where any output is off
    by more than LOGIT_TOLERANCE; an export with rig inputs passes with up to BOUNDARY_CELL_SHARE
    of them (frustum points on cell boundaries)."""
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
    detection = session_head_outputs(session)[1:]
    max_diff = max_logit = rig_deviation = detection_diff = 0.0
    off_cells = cells = 0
    model = model.cpu().eval()
    for index in range(count):
        batch = collate([dataset[index]])
        if rig is not None:
            rig_deviation = max(
                rig_deviation, max(float((batch[k][0] - rig[k]).abs().max()) for k in RIG_KEYS)
            )
            batch.update({k: rig[k][None].float() for k in RIG_KEYS})
        with torch.no_grad():
            mine = model(batch)
            ours = mine["segmentation"]
            if "prev_depth" in inputs:  # a two-frame export reads the previous frame's features
                depth, context = model.camera(batch["prev_images"].flatten(0, 1))
                batch["prev_depth"] = depth.unflatten(0, (1, -1))
                batch["prev_context"] = context.unflatten(0, (1, -1))
        batch["images"] = model.camera.normalize(batch["images"])  # the export reads normalised
        feeds = {name: batch[name].float().contiguous().numpy() for name in inputs}
        arrays = session.run(["segmentation", *detection], feeds)
        theirs, *maps = (torch.from_numpy(np.asarray(a)) for a in arrays)
        diff = (theirs - ours).abs()
        max_diff = max(max_diff, float(diff.max()))
        off = diff.amax(dim=1) > LOGIT_TOLERANCE  # B x nx x ny: the cells off in any class
        for name, exported in zip(detection, maps):
            diff = (exported - mine[name]).abs()
            detection_diff = max(detection_diff, float(diff.max()))
            off |= diff.amax(dim=1) > LOGIT_TOLERANCE
        off_cells, cells = off_cells + int(off.sum()), cells + off.numel()
        max_logit = max(max_logit, float(ours.abs().max()))
        meters["torch"].update(ours, batch["targets"])
        meters["onnx"].update(theirs, batch["targets"])
    result = {
        "samples": count,
        "max_abs_diff": max_diff,
        "max_abs_logit": max_logit,
        "rig_deviation": rig_deviation if rig is not None else None,
    }
    if detection:
        result["max_abs_diff_detection"] = detection_diff
    result["off_cell_share"] = off_cells / cells
    rig_inputs = all(k in inputs for k in RIG_KEYS)
    result.update({f"iou_{name}": meter.compute()["iou"] for name, meter in meters.items()})
    result["max_iou_diff_points"] = max(
        100 * abs(result["iou_torch"][c] - result["iou_onnx"][c]) for c in cfg.data.classes
    )
    close = max(max_diff, detection_diff) <= LOGIT_TOLERANCE or (
        rig_inputs and result["off_cell_share"] <= BOUNDARY_CELL_SHARE
    )
    result["passed"] = close and result["max_iou_diff_points"] <= IOU_TOLERANCE
    return result


def format_check(result: dict, path: Union[str, Path]) -> str:
    lines = [
        f"check of {path}: {result['samples']} validation samples, onnxruntime CPU vs PyTorch CPU "
        "(fp32)",
        f"max |logit difference| {result['max_abs_diff']:.3g} (largest |logit| "
        f"{result['max_abs_logit']:.3g}; target <= {LOGIT_TOLERANCE:g})",
    ]
    if "max_abs_diff_detection" in result:
        lines.append(
            f"detection head (heatmap logits, regression maps): max |difference| "
            f"{result['max_abs_diff_detection']:.3g} (target <= {LOGIT_TOLERANCE:g})"
        )
    width = max(len(c) for c in result["iou_torch"])
    lines.append(f"{'class':<{width}}  IoU torch  IoU onnx")
    for c, iou in result["iou_torch"].items():
        lines.append(f"{c:<{width}}  {100 * iou:9.2f}  {100 * result['iou_onnx'][c]:8.2f}")
    lines.append(
        f"largest IoU difference {result['max_iou_diff_points']:.3f} points "
        f"(target <= {IOU_TOLERANCE:g})"
    )
    if result.get("off_cell_share"):
        lines.append(
            f"cells off by more than {LOGIT_TOLERANCE:g}: {100 * result['off_cell_share']:.3f} % "
            f"(an export with rig inputs passes with up to {100 * BOUNDARY_CELL_SHARE:g} %: "
            "frustum points on cell boundaries)"
        )
    if result["rig_deviation"]:
        lines.append(
            f"note: the samples' own rigs differ from the exported fixed rig by up to "
            f"{result['rig_deviation']:.3g} (both sides ran on the fixed rig)"
        )
    lines.append("PASSED" if result["passed"] else "FAILED")
    return "\n".join(lines)
