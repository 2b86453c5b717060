"""`lss export`: a checkpoint's network (segmentation, and the detection head's maps) to an ONNX
file (TorchScript exporter, opset 16 or later)."""

from __future__ import annotations

import contextlib
import copy
import errno
import inspect
import json
import os
import warnings
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from lss.config import Config
from lss.errors import ArgumentError
from lss.export.graph import CUSTOM_DOMAIN, RIG_KEYS, DeployModel, head_outputs
from lss.export.temporal import INPUT_NAMES as TEMPORAL_INPUTS
from lss.export.temporal import TemporalDeployModel, output_names
from lss.ops.upsample import MODES

MIN_OPSET = 16  # ScatterND with reduction "add"
DEFAULT_OPSET = 17
SPLATS = ("onnx", "custom")


def trained_upsample_mode(state: dict, cfg: Config) -> str:
    """The decoder's resize mode the checkpoint was trained with (its config), else the given
    config's."""
    saved = state.get("config", {})
    saved = saved.get("model", {}) if isinstance(saved, dict) else {}
    return saved.get("upsample_mode", cfg.model.upsample_mode)


def check_options(opset: int, splat: str, rig_inputs: bool, resize_mode: Optional[str]) -> None:
    """Refuses combinations the exporter cannot write, with what to use instead (ArgumentError)."""
    from torch.onnx import _constants

    max_opset = getattr(_constants, "ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET", 20)
    if not MIN_OPSET <= opset <= max_opset:
        raise ArgumentError(
            f"--opset {opset}: supported opsets are {MIN_OPSET}..{max_opset} (the splat needs "
            f"ScatterND with reduction='add', opset {MIN_OPSET}); default {DEFAULT_OPSET}"
        )
    if splat not in SPLATS:
        raise ArgumentError(f"--bev-pool {splat!r}: expected one of {', '.join(SPLATS)}")
    if splat == "custom" and rig_inputs:
        raise ArgumentError(
            "--bev-pool custom needs --fixed-rig: the lss.BevPool node takes the sorted lookup "
            "table as constants; with --rig-inputs use --bev-pool onnx (the table is then computed "
            "in the graph)"
        )
    if resize_mode is not None and resize_mode not in MODES:
        raise ArgumentError(f"--resize-mode {resize_mode!r}: expected one of {', '.join(MODES)}")


def read_rig(path: Union[str, Path], num_cameras: int) -> dict:
    """A rig file (JSON, as `lss export` writes next to the model): RIG_KEYS -> N x 3 x 3 / N x 3
    lists."""
    path = Path(path)
    if not path.is_file():
        raise ArgumentError(
            f"--rig {path}: no such file; pass a JSON file with keys {', '.join(RIG_KEYS)} (the "
            "format `lss export` writes as MODEL.rig.json)"
        )
    try:
        raw = json.loads(path.read_text())
        rig = {k: torch.tensor(raw[k], dtype=torch.float32) for k in RIG_KEYS}
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ArgumentError(
            f"--rig {path}: not a rig file ({type(e).__name__}: {e}); expected a JSON object with "
            f"keys {', '.join(RIG_KEYS)}"
        ) from None
    check_rig(rig, num_cameras, str(path))
    return rig


def check_rig(rig: dict, num_cameras: int, where: str = "rig") -> None:
    """Every rig tensor has the fixed-rig shape: N x 3 x 3 (intrinsics, rotations) or N x 3
    (translations)."""
    for key in RIG_KEYS:
        want = (
            (num_cameras, 3, 3)
            if key in ("intrinsics", "sensor2ego_rot", "post_rot")
            else (num_cameras, 3)
        )
        have = tuple(rig[key].shape)
        if have != want:
            raise ArgumentError(
                f"{where}: {key} has shape {have}, expected {want} ({num_cameras} cameras of "
                "data.cameras); give one camera rig, without a batch dimension"
            )


@contextlib.contextmanager
def replacing(path: Path):
    """Yields a temporary path beside `path` to write; renamed over `path` when the block ends
    without an error, deleted otherwise: `path` never holds a partial file, and a failed write
    leaves an existing file there as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        kept = "the existing file there is unchanged" if path.exists() else "nothing was written"
        todo = "free some space or choose" if e.errno == errno.ENOSPC else "choose"
        raise OSError(
            f"could not write {path} ({e.strerror or e}); {kept}; {todo} another --out"
        ) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_rig(rig: dict, path: Path) -> None:
    with replacing(path) as tmp:
        tmp.write_text(json.dumps({k: rig[k].tolist() for k in RIG_KEYS}, indent=1) + "\n")


def dataset_rig(cfg: Config, index: int = 0) -> dict:
    """The rig (and evaluation augmentation) of validation sample `index`: the fixed rig by
    default."""
    from lss.data.loader import build_dataset

    dataset = build_dataset(cfg, cfg.data.val_split, False)
    if not 0 <= index < len(dataset):
        raise ArgumentError(
            f"--rig-sample {index}: the {cfg.data.val_split} split has {len(dataset)} samples"
        )
    sample = dataset[index]
    return {k: sample[k] for k in RIG_KEYS}


def export_model(
    model: nn.Module,
    out: Union[str, Path],
    cfg: Config,
    *,
    rig: Optional[dict] = None,
    rig_inputs: bool = False,
    splat: str = "onnx",
    opset: int = DEFAULT_OPSET,
    upsample_mode: Optional[str] = None,
    resize_mode: Optional[str] = None,
) -> Path:
    """Write the network of LiftSplatShoot `model` to `out` (ONNX; written to a temporary file
    first, see `replacing`). Inputs: "images" B x N x 3 x H x W (float32, normalised with
    data.image_mean / image_std), with rig_inputs also the RIG_KEYS B x N x ...; output
    "segmentation" B x K x nx x ny logits, with the detection head also its first stage's maps
    "det_heatmap" (logits) and "det_regression" (lss.models.heads.detection_decode.decode_detections
    turns them into boxes; the second stage is not exported); a two-frame model
    (model.temporal.frames: 2, rig inputs only) also reads the previous frame's camera features and
    rig and the ego motion and outputs this frame's features (lss.export.temporal). The batch size
    is dynamic. upsample_mode: the mode the model was trained with (default
    cfg.model.upsample_mode); resize_mode: the Resize coordinate mode written (default:
    upsample_mode)."""
    check_options(opset, splat, rig_inputs, resize_mode)
    two_frames = getattr(model, "temporal", None) is not None
    if two_frames and not rig_inputs:
        raise ArgumentError(
            "a two-frame model (model.temporal.frames: 2) is exported with rig inputs only (its "
            "previous frame's table moves with the ego motion): pass --rig-inputs"
        )
    num_cameras = len(cfg.data.cameras)
    if not rig_inputs:
        if rig is None:
            raise ArgumentError(
                "a fixed-rig export needs the camera rig: pass --rig FILE or let it read a "
                "validation sample (--rig-sample)"
            )
        check_rig(rig, num_cameras)
    upsample_mode = upsample_mode or cfg.model.upsample_mode
    deploy = (
        TemporalDeployModel(model, resize_mode, upsample_mode)
        if two_frames
        else DeployModel(
            model, "rig_inputs" if rig_inputs else splat, rig, resize_mode, upsample_mode
        )
    ).eval()
    H, W = cfg.data.final_dim
    args = [torch.zeros(1, num_cameras, 3, H, W)]
    names, outputs = ["images"], list(head_outputs(model))
    if rig_inputs:
        args += (
            [rig[k][None].float() for k in RIG_KEYS]
            if rig is not None
            else _example_rig(num_cameras)
        )
        names += list(RIG_KEYS)
    if two_frames:
        D, fH, fW, _ = model.splat.frustum.shape
        C = cfg.model.context_channels
        features = [torch.zeros(1, num_cameras, D, fH, fW), torch.zeros(1, num_cameras, C, fH, fW)]
        args += features + [a.clone() for a in args[1:]] + [torch.eye(4)[None]]
        names, outputs = list(TEMPORAL_INPUTS), list(output_names(model))
    out = Path(out)
    with replacing(out) as tmp, warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter(
            "ignore"
        )  # the TorchScript exporter's deprecation and tracer warnings
        # the TorchScript exporter: the default since torch 2.9 is the torch.export one (needs
        # onnxscript)
        legacy = (
            {"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters else {}
        )
        torch.onnx.export(
            deploy,
            tuple(args),
            str(tmp),
            opset_version=opset,
            input_names=names,
            output_names=outputs,
            dynamic_axes={n: {0: "batch"} for n in names + outputs},
            custom_opsets={CUSTOM_DOMAIN: 1} if splat == "custom" else None,
            **legacy,
        )
    return out


def _example_rig(num_cameras: int) -> list[torch.Tensor]:
    """A rig to trace with (values do not matter: the table is computed in the graph):
    1 x N x ..."""
    eye = torch.eye(3).expand(1, num_cameras, 3, 3).clone()
    zeros = torch.zeros(1, num_cameras, 3)
    K = eye.clone()
    K[..., 0, 0] = K[..., 1, 1] = 100.0
    return [K, eye, zeros, eye.clone(), zeros.clone()]


def export_checkpoint(
    cfg: Config,
    ckpt: Union[str, Path],
    out: Union[str, Path],
    *,
    rig_file: Optional[str] = None,
    rig_sample: int = 0,
    rig_inputs: bool = False,
    splat: str = "onnx",
    opset: int = DEFAULT_OPSET,
    resize_mode: Optional[str] = None,
) -> dict:
    """`lss export`: load checkpoint `ckpt`, write `out` and, for a fixed rig, OUT.rig.json (the rig
    baked in). Returns what the check needs: {"model" (PyTorch, CPU, eval), "path", "rig",
    "rig_path" (None with rig inputs), "upsample_mode", "resize_mode"}."""
    from lss.engine.checkpoint import load_checkpoint
    from lss.engine.checkpoint import load_checkpoint_model

    check_options(opset, splat, rig_inputs, resize_mode)
    path = Path(ckpt)
    state = load_checkpoint(path)
    trained = trained_upsample_mode(state, cfg)
    cfg = copy.deepcopy(cfg)
    cfg.model.upsample_mode = (
        trained  # the network as it was trained; the Resize mode may differ (resize_mode)
    )
    model, _ = load_checkpoint_model(cfg, path, torch.device("cpu"), state=state)
    rig = None
    if not rig_inputs:
        rig = (
            read_rig(rig_file, len(cfg.data.cameras)) if rig_file else dataset_rig(cfg, rig_sample)
        )
    out = export_model(
        model,
        out,
        cfg,
        rig=rig,
        rig_inputs=rig_inputs,
        splat=splat,
        opset=opset,
        upsample_mode=trained,
        resize_mode=resize_mode,
    )
    rig_path = None
    if rig is not None:
        rig_path = out.with_suffix(".rig.json")
        write_rig(rig, rig_path)
    return {
        "model": model,
        "path": out,
        "rig": rig,
        "rig_path": rig_path,
        "upsample_mode": trained,
        "resize_mode": resize_mode or trained,
    }
