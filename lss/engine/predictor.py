"""`lss.Predictor`: a checkpoint -> BEV maps of camera images, the one inference entry point (as
detectron2's DefaultPredictor). It builds the checkpoint's model in eval mode, gives the images
the evaluation's resize and crop (lss.data.camera_inputs) and runs the forward of `lss eval`: fp32
on the CPU; bf16 autocast on a GPU, replayed as one CUDA graph per batch size; or the exported
network in onnxruntime. `write_predictions` is the loop of `lss predict`."""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch

from lss.config import Config
from lss.data import collate
from lss.data.camera_inputs import camera_inputs, frame_name
from lss.engine.checkpoint import (
    check_config_fits,
    checkpoint_config,
    load_checkpoint,
    load_checkpoint_model,
)
from lss.engine.eval import pad_batch
from lss.errors import ArgumentError, CheckpointError
from lss.geometry import RIG_KEYS, BevGrid
from lss.geometry.ego_motion import PREVIOUS_FRAME_KEYS
from lss.geometry.boxes import DETECTION_CLASSES
from lss.models.camera import normalize_pixels, pixel_table

BACKENDS = ("torch", "onnxruntime")
MODEL_INPUTS = ("images",) + RIG_KEYS
# the outputs a prediction reads (the depth logits feed only the training loss)
PREDICTION_OUTPUTS = ("segmentation", "det_heatmap", "det_regression")


@dataclasses.dataclass
class Prediction:
    """One sample's prediction: per-class probabilities K x nx x ny (float32; row i is ego x,
    column j ego y, lss.geometry.grid) of `classes` on the grid of `xbound` / `ybound` (min, max,
    cell size in metres); with the detection head also `boxes` M x 9 [x, y, z, w, l, h, yaw, vx,
    vy] (ego frame), `scores` M (descending) and `labels` M (indices into DETECTION_CLASSES)."""

    probabilities: np.ndarray
    classes: tuple[str, ...]
    xbound: tuple[float, float, float]
    ybound: tuple[float, float, float]
    boxes: Optional[np.ndarray] = None
    scores: Optional[np.ndarray] = None
    labels: Optional[np.ndarray] = None
    name: str = ""

    @property
    def extent(self) -> tuple[float, float, float, float]:
        """(x_min, x_max, y_min, y_max) of the grid in ego metres."""
        return (self.xbound[0], self.xbound[1], self.ybound[0], self.ybound[1])

    @property
    def detections(self) -> Optional[dict]:
        """{"boxes", "scores", "labels"} (as decode_detections gives them), or None."""
        if self.boxes is None:
            return None
        return {"boxes": self.boxes, "scores": self.scores, "labels": self.labels}

    def save(self, path: Union[str, Path]) -> Path:
        """An .npz of the fields (with the detection head also "detection_classes")."""
        path = Path(path)
        fields = {
            "probabilities": self.probabilities,
            "classes": np.asarray(self.classes),
            "xbound": np.asarray(self.xbound, dtype=np.float64),
            "ybound": np.asarray(self.ybound, dtype=np.float64),
            "name": np.asarray(self.name),
        }
        if self.boxes is not None:
            fields.update(
                boxes=self.boxes,
                scores=self.scores,
                labels=self.labels,
                detection_classes=np.asarray(DETECTION_CLASSES),
            )
        with open(path, "wb") as f:
            np.savez_compressed(f, **fields)
        return path

    @classmethod
    def load(cls, path: Union[str, Path]) -> "Prediction":
        with np.load(path, allow_pickle=False) as npz:
            boxes = {k: npz[k] for k in ("boxes", "scores", "labels") if k in npz}
            return cls(
                npz["probabilities"],
                tuple(str(c) for c in npz["classes"]),
                tuple(float(v) for v in npz["xbound"]),
                tuple(float(v) for v in npz["ybound"]),
                name=str(npz["name"]),
                **boxes,
            )


def model_inputs(cfg: Config) -> tuple[str, ...]:
    """The batch entries the model of `cfg` reads: MODEL_INPUTS, and with model.temporal.frames: 2
    the previous frame's (lss.geometry.ego_motion.PREVIOUS_FRAME_KEYS)."""
    return MODEL_INPUTS + (PREVIOUS_FRAME_KEYS if cfg.model.temporal.frames == 2 else ())


def _device(device: Union[None, str, torch.device]) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ArgumentError(f"device {device}: no CUDA GPU is visible; use device='cpu'")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class EagerForward:
    """The model's forward as `lss eval` runs it: the batch's model inputs on the device, no
    gradients, under `amp_dtype` autocast where given."""

    def __init__(
        self,
        model: torch.nn.Module,
        amp_dtype: Optional[torch.dtype],
        *,
        inputs: Sequence[str] = MODEL_INPUTS,
    ):
        self.model, self.amp_dtype = model, amp_dtype
        self.inputs = tuple(inputs)  # the batch entries the model reads (model_inputs)
        self.device = next(model.parameters()).device

    autocast_cache = True

    def run(self, inputs: dict) -> dict:
        autocast = torch.autocast(
            self.device.type,
            dtype=self.amp_dtype,
            enabled=self.amp_dtype is not None,
            cache_enabled=self.autocast_cache,
        )
        with torch.no_grad(), autocast:
            return self.model(inputs)

    def __call__(self, batch: dict) -> dict:
        return self.run({k: batch[k].to(self.device, non_blocking=True) for k in self.inputs})


class CapturedForward(EagerForward):
    """The forward captured as one CUDA graph per batch size and replayed on static input buffers:
    one launch instead of the thousands of small kernels of the eager forward. The graph builds
    the frustum lookup table itself (lss.host_sync: no cache check inside a capture), so one graph
    serves every calibration. The first call of a batch size copies the batch into new buffers,
    runs `warmup` forwards on a side stream and captures; `capture=False` runs the forward on the
    static buffers instead (CPU tests of everything but the capture). Autocast runs without its
    weight cache, whose casts would otherwise live outside the graph."""

    def __init__(
        self,
        model: torch.nn.Module,
        amp_dtype: Optional[torch.dtype],
        warmup: int = 2,
        capture: bool = True,
        *,
        inputs: Sequence[str] = MODEL_INPUTS,
        outputs: Sequence[str] = PREDICTION_OUTPUTS,
    ):
        super().__init__(model, amp_dtype, inputs=inputs)
        self.warmup, self.capture = warmup, capture
        self.outputs = tuple(outputs)  # the forward's outputs that a replay returns (copies)
        # batch size -> (graph or None, static inputs, static outputs)
        self.graphs: dict[int, tuple] = {}

    autocast_cache = False

    def run(self, inputs: dict) -> dict:
        return {k: v for k, v in super().run(inputs).items() if k in self.outputs}

    def __call__(self, batch: dict) -> dict:
        size = batch["images"].shape[0]
        if size not in self.graphs:
            self.graphs[size] = self._capture(batch)
        graph, static, outputs = self.graphs[size]
        for key in self.inputs:
            static[key].copy_(batch[key], non_blocking=True)
        if graph is None:
            return self.run(static)
        graph.replay()
        return {k: v.clone() for k, v in outputs.items()}

    def _capture(self, batch: dict) -> tuple:
        static = {k: batch[k].to(self.device).clone() for k in self.inputs}
        if not self.capture:
            return None, static, None
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.run(static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            outputs = self.run(static)
        return graph, static, outputs


class OnnxForward:
    """The exported network (lss.export, rig inputs) in onnxruntime: `onnx`, an export
    made with --rig-inputs, or the checkpoint exported into a temporary folder. On a CUDA device it
    runs on onnxruntime's CUDA execution provider where that is installed."""

    def __init__(self, cfg: Config, checkpoint: Path, device: torch.device, onnx=None):
        from lss.export import export_checkpoint
        from lss.export.check import onnxruntime_session, session_head_outputs

        self._folder = None
        if onnx is None:
            self._folder = tempfile.TemporaryDirectory(prefix="lss-predict-")
            path = Path(self._folder.name) / "model.onnx"
            onnx = export_checkpoint(cfg, checkpoint, path, rig_inputs=True)["path"]
        self.session = onnxruntime_session(onnx, cuda=device.type == "cuda")
        self.pixel_table = pixel_table(cfg.data.image_mean, cfg.data.image_std)  # the export reads
        # normalised images
        names = [i.name for i in self.session.get_inputs()]
        if any(k not in names for k in RIG_KEYS):
            raise ArgumentError(
                f"{onnx} was exported with a fixed rig (inputs {names}); predictions on any "
                "calibration need an export with rig inputs: lss export --rig-inputs"
            )
        self.inputs = names
        # the boxes are decoded from the detection maps as from the PyTorch model's
        self.outputs = session_head_outputs(self.session)

    def __call__(self, batch: dict) -> dict:
        batch = dict(batch, images=normalize_pixels(batch["images"], self.pixel_table))
        feeds = {k: batch[k].float().contiguous().cpu().numpy() for k in self.inputs}
        arrays = self.session.run(self.outputs, feeds)
        return {name: torch.from_numpy(np.asarray(a)) for name, a in zip(self.outputs, arrays)}


class Predictor:
    """BEV maps of a checkpoint (detectron2's DefaultPredictor for LSS).

    `Predictor(checkpoint)` builds the checkpoint's model (its config with `overrides`
    ("section.key=value") applied; or `config`, refused with a CheckpointError when its grid, input
    size, classes or heads differ from the checkpoint's) on `device` (default: the GPU where one is
    visible). `predict(images, intrinsics, cam_to_ego)` of one sample (N images, N x 3 x 3,
    N x 4 x 4) returns a Prediction, of a batch (B lists of N images or B x N x H x W x 3,
    B x N x 3 x 3, B x N x 4 x 4) a list; lss.data.camera_inputs says what the inputs may be.

    backend "torch": the model's forward as `lss eval` runs it; on a GPU in bf16 autocast
    (precision="fp32": without) and with `cuda_graph` replayed as one CUDA graph per batch size
    (not with the detection head's second stage, whose proposals depend on the data). The frustum
    lookup table is cached while the calibration is unchanged. "onnxruntime": the exported
    network (OnnxForward; with the detection head the boxes are decoded from its exported maps, as
    without the second stage)."""

    def __init__(
        self,
        checkpoint: Union[str, Path],
        device: Union[None, str, torch.device] = None,
        *,
        config: Optional[Config] = None,
        overrides: Sequence[str] = (),
        backend: str = "torch",
        precision: str = "bf16",
        cuda_graph: bool = True,
        onnx: Union[None, str, Path] = None,
    ):
        if backend not in BACKENDS:
            raise ArgumentError(f"backend {backend!r}: expected one of {', '.join(BACKENDS)}")
        if precision not in ("bf16", "fp32"):
            raise ArgumentError(f"precision {precision!r}: expected bf16 or fp32")
        path = Path(checkpoint)
        state = load_checkpoint(path)
        self.cfg = config if config is not None else checkpoint_config(state, overrides)
        self.device = _device(device)
        self.step = int(state["step"])
        self.backend = backend
        self.grid = BevGrid.from_config(self.cfg.grid)
        self.classes = tuple(self.cfg.data.classes)
        heads = self.cfg.model.heads
        self.with_boxes = "detection" in heads and backend == "torch"
        self.model: Optional[torch.nn.Module] = None
        if backend == "onnxruntime":
            if self.cfg.model.temporal.frames == 2:
                raise ArgumentError(
                    "backend onnxruntime runs one-frame exports; the checkpoint's model has "
                    "model.temporal.frames=2 (its export reads the previous frame's features, "
                    "docs/temporal.md): use backend torch"
                )
            check_config_fits(state, self.cfg, path)
            self.forward = OnnxForward(self.cfg, path, self.device, onnx)
            # boxes from the export's detection maps (an export without them: maps alone)
            self.with_boxes = "detection" in heads and "det_heatmap" in self.forward.outputs
            return
        model, _ = load_checkpoint_model(self.cfg, path, self.device, state=state)
        # autocast applies on CUDA only, as in training and evaluation
        bf16 = precision == "bf16" and self.device.type == "cuda"
        amp_dtype = torch.bfloat16 if bf16 else None
        refine = "detection" in heads and self.cfg.detection.refine
        inputs = model_inputs(self.cfg)
        if self.device.type == "cuda" and cuda_graph and not refine:
            self.forward = CapturedForward(model, amp_dtype, inputs=inputs)
        else:
            self.forward = EagerForward(model, amp_dtype, inputs=inputs)
        self.model = model

    def predict(self, images, intrinsics, cam_to_ego):
        """One sample's Prediction, or a batch's list (see the class)."""
        self._check_one_frame()
        batched = np.ndim(intrinsics) == 4
        if not batched:
            return self.predict_batch(self.inputs(images, intrinsics, cam_to_ego))[0]
        if not len(images) == len(intrinsics) == len(cam_to_ego):
            raise ArgumentError(
                f"a batch of {len(images)} image sets, {len(intrinsics)} intrinsics and "
                f"{len(cam_to_ego)} cam_to_ego: give one of each per sample"
            )
        items = [camera_inputs(*sample, self.cfg) for sample in zip(images, intrinsics, cam_to_ego)]
        return self.predict_batch(collate(items))

    __call__ = predict

    def inputs(self, images, intrinsics, cam_to_ego) -> dict:
        """The model's input batch (of one) of a sample: camera_inputs, batched."""
        self._check_one_frame()
        return collate([camera_inputs(images, intrinsics, cam_to_ego, self.cfg)])

    def _check_one_frame(self) -> None:
        if self.cfg.model.temporal.frames == 2:
            raise ArgumentError(
                "the checkpoint's model has model.temporal.frames=2: it also reads the previous "
                "frame and the ego motion, which camera images and a rig do not give; predict "
                "the samples of a nuScenes scene (predict_batch, or StreamingPredictor of "
                "lss.engine.streaming), or use a one-frame model"
            )

    def predict_batch(self, batch: dict) -> list[Prediction]:
        """The Predictions of a model input batch (lss.data.collate of NuScenesBEV items or of
        camera_inputs; "sample_token" names them)."""
        missing = [k for k in getattr(self.forward, "inputs", MODEL_INPUTS) if k not in batch]
        if missing:
            raise ArgumentError(
                f"the batch has no {', '.join(missing)}, which the checkpoint's model reads"
                + (
                    " (model.temporal.frames=2: the previous frame and the ego motion, which "
                    "NuScenesBEV items of a scene give; images with a rig file do not)"
                    if self.cfg.model.temporal.frames == 2
                    else ""
                )
            )
        return self.predictions(self.forward(batch), batch.get("sample_token"))

    def predictions(self, outputs: dict, names: Optional[Sequence[str]] = None) -> list[Prediction]:
        """The Predictions of the model's `outputs` of a batch whose samples are `names`."""
        probabilities = outputs["segmentation"].detach().float().sigmoid().cpu().numpy()
        if probabilities.shape[1] != len(self.classes):
            raise CheckpointError(
                f"the model predicts {probabilities.shape[1]} classes, the config names "
                f"{len(self.classes)} ({', '.join(self.classes)})"
            )
        detections = [None] * len(probabilities)
        if self.with_boxes:
            from lss.models.heads.detection_decode import decode_detections

            detections = [
                {k: v.detach().cpu().numpy() for k, v in d.items()}
                for d in decode_detections(outputs, self.cfg)
            ]
        names = names or [""] * len(probabilities)
        return [
            Prediction(
                probs,
                self.classes,
                self.grid.xbound,
                self.grid.ybound,
                **(det or {}),
                name=str(name),
            )
            for probs, det, name in zip(probabilities, detections, names)
        ]


def write_predictions(
    predictor: Predictor,
    dataset: torch.utils.data.Dataset,
    out: Union[str, Path],
    *,
    render_fn: Optional[Callable[[dict, Prediction], np.ndarray]] = None,
    animate_fns: Sequence[Callable[[dict, Path], list[Path]]] = (),
    scene: str = "scene",
    batch_size: Optional[int] = None,
    progress: bool = True,
    predict_fn: Optional[Callable[[dict], list[Prediction]]] = None,
) -> dict:
    """`lss predict`: every sample of `dataset` (model input items with "sample_token", read by
    the evaluation's loader in batches of eval.batch_size, or `batch_size`) through `predictor`,
    written to `out` as NNNN_<name>.npz (Prediction.save); with `render_fn(item, prediction)`
    also its picture NNNN_<name>.png, and each of `animate_fns({scene: pictures}, out)` (e.g.
    lss.viz.render.write_scene_gifs) gets the pictures in order. `predict_fn(batch)` replaces
    predictor.predict_batch (e.g. lss.engine.streaming.StreamingPredictor.step, in batches of 1:
    the batches then go through unpadded, in order). Returns "written" (the paths), "samples",
    "seconds" (the pass, reading included) and "samples_per_s"."""
    from PIL import Image
    from tqdm import tqdm

    from lss.data.loader import build_eval_loader

    cfg = predictor.cfg
    if batch_size is not None:
        cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, batch_size=batch_size))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    loader = build_eval_loader(cfg, dataset, predictor.device)
    written: list[Path] = []
    frames: list[np.ndarray] = []
    start, count = time.perf_counter(), 0
    bar = tqdm(total=len(dataset), desc="predict", unit="sample", disable=not progress)
    for batch in loader:
        size = len(batch["sample_token"])
        if predict_fn is not None:
            predictions = predict_fn(batch)
        else:
            # a full batch keeps one CUDA graph for the whole pass; the copies' outputs are dropped
            full = pad_batch(batch, loader.batch_size) if size < loader.batch_size else batch
            predictions = predictor.predict_batch(full)[:size]
        for i, prediction in enumerate(predictions):
            stem = out / f"{count:04d}_{frame_name(prediction.name) or 'sample'}"
            written.append(prediction.save(stem.with_suffix(".npz")))
            if render_fn is not None:
                picture = render_fn({k: v[i] for k, v in batch.items()}, prediction)
                Image.fromarray(picture).save(stem.with_suffix(".png"), compress_level=1)
                written.append(stem.with_suffix(".png"))
                if animate_fns:  # kept only for the animations
                    frames.append(picture)
            count += 1
        bar.update(size)
    bar.close()
    seconds = time.perf_counter() - start
    for animate in animate_fns if frames else ():
        written += animate({scene: frames}, out)
    return {
        "written": written,
        "samples": count,
        "seconds": seconds,
        "samples_per_s": count / max(seconds, 1e-9),
    }
