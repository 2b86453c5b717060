"""One renderer for every picture of a prediction: `lss viz` (PNGs and scene GIFs of a checkpoint)
and the training loop's tensorboard image (`render_batch`, the trainer's picture callable) both call
`render_sample`."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import cv2
import numpy as np
import torch

from lss.config import Config
from lss.viz.detection import (
    GROUND_TRUTH_COLOR,
    PREDICTION_COLOR,
    SCORE_THRESHOLD,
    confident_boxes,
    draw_camera_detections,
    true_boxes,
)
from lss.geometry import BevGrid
from lss.viz.bev import (
    EGO_COLOR,
    BevView,
    bev_panel,
    class_colors,
    drawing_order,
    layer_opacity,
)
from lss.viz.cameras import CAMERA_TILE_WIDTH, camera_mosaic, denormalize, tile_height
from lss.viz.figure import GAP, Figure, LegendEntry, compose_figure


def prediction_title(cfg: Config) -> str:
    if cfg.viz.mode == "threshold":
        return f"prediction: p > {cfg.eval.threshold:g} (eval.threshold)"
    return "prediction: opacity = probability"


def legend_entries(cfg: Config, with_boxes: bool, with_truth: bool = True) -> list[LegendEntry]:
    """The classes in their colours, the ego car and, with the detection head, the predicted and
    (`with_truth`) the true boxes."""
    classes = cfg.data.classes
    entries = [LegendEntry(c, color) for c, color in zip(classes, class_colors(classes))]
    entries.append(LegendEntry("ego car", EGO_COLOR))
    if with_boxes:
        entries += [
            LegendEntry(
                f"predicted boxes (score >= {SCORE_THRESHOLD:g})", PREDICTION_COLOR, "outline"
            ),
        ]
        if with_truth:
            entries.append(LegendEntry("true boxes", GROUND_TRUTH_COLOR, "outline"))
    return entries


def _camera_images(item: dict, cfg: Config, detections: Optional[dict]) -> np.ndarray:
    """The item's N x H x W x 3 camera images; with `detections`, at the mosaic's tile size with the
    true and predicted boxes drawn at that size (sharp lines rather than lines scaled up)."""
    images = denormalize(item["images"], cfg.data.image_mean, cfg.data.image_std)
    if detections is None:
        return images
    h, w = images.shape[1:3]
    tile = (CAMERA_TILE_WIDTH, tile_height((h, w)))
    images = np.stack([cv2.resize(im, tile, interpolation=cv2.INTER_LINEAR) for im in images])
    # the resize follows the data augmentation: its scale multiplies the augmented pixels
    scale = torch.diag(torch.tensor([tile[0] / w, tile[1] / h, 1.0]))
    rig = dict(
        item,
        post_rot=scale @ item["post_rot"].detach().float().cpu(),
        post_trans=item["post_trans"].detach().float().cpu() @ scale.T,
    )
    return draw_camera_detections(images, rig, detections)


def render_sample(
    item: dict,
    probs: np.ndarray,
    cfg: Config,
    title: str = "",
    detections: Optional[dict] = None,
) -> Figure:
    """The picture of one dataset item (tensors on any device) and the model's K x nx x ny
    probabilities: the cameras on top, the prediction (left) and ground-truth (right) BEV panels
    below them, each at least as tall as the cameras, and the legend. An item without "targets"
    (camera images of `lss predict` without a dataset) gets the prediction panel alone.
    `detections` ({"boxes", "scores"} of decode_detections, with the detection head): predicted
    boxes in the prediction panel, true boxes in the truth panel, both in the cameras."""
    classes = cfg.data.classes
    if probs.shape[0] != len(classes):
        raise ValueError(
            f"render_sample: {probs.shape[0]} probability maps for {len(classes)} classes "
            f"(data.classes={list(classes)}); checkpoint and config must name the same classes"
        )
    mosaic = camera_mosaic(_camera_images(item, cfg, detections), cfg.data.cameras)
    view = BevView.fit(
        BevGrid.from_config(cfg.grid), (mosaic.shape[1] - GAP) // 2, min_height=mosaic.shape[0]
    )
    colors, order = class_colors(classes), drawing_order(classes)
    predicted_boxes, truth_boxes = [], []
    if detections is not None:
        predicted_boxes = [(confident_boxes(detections), PREDICTION_COLOR)]
        truth_boxes = [(true_boxes(item), GROUND_TRUTH_COLOR)]
    opacity = layer_opacity(probs, cfg.viz.mode, cfg.eval.threshold)
    panels = [
        (
            "prediction",
            prediction_title(cfg),
            bev_panel(opacity, colors, order, view, predicted_boxes),
        ),
    ]
    with_truth = "targets" in item
    if with_truth:
        truth = (item["targets"].detach().float().cpu().numpy() > 0.5).astype(np.float32)
        panels.append(("truth", "ground truth", bev_panel(truth, colors, order, view, truth_boxes)))
    legend = legend_entries(cfg, detections is not None, with_truth)
    return compose_figure(title, mosaic, panels, legend)


def _predictions(outputs: dict, cfg: Config) -> tuple[np.ndarray, Optional[list[dict]]]:
    """B x K x nx x ny probabilities and, with the detection head, each sample's decoded boxes."""
    from lss.models.heads.detection_decode import decode_detections

    probs = outputs["segmentation"].detach().float().sigmoid().cpu().numpy()
    detections = decode_detections(outputs, cfg) if "detection" in cfg.model.heads else None
    return probs, detections


def render_batch(batch: dict, outputs: dict, cfg: Config) -> np.ndarray:
    """The training loop's picture (the trainer's render function): render_sample of the batch's
    first sample and the model's `outputs` for the batch (in eval mode). Returns H x W x 3 uint8."""
    probs, detections = _predictions(outputs, cfg)
    item = {k: v[0] for k, v in batch.items()}
    token = item.get("sample_token", "")
    return render_sample(
        item,
        probs[0],
        cfg,
        title=f"first validation sample {token[:12]}".rstrip(),
        detections=None if detections is None else detections[0],
    ).image


def write_scene_gifs(frames: dict[str, list[np.ndarray]], out: Path) -> list[Path]:
    """One GIF per scene (name -> its pictures in time order) in `out`, two frames a second."""
    from PIL import Image

    written = []
    for name, images in frames.items():
        # each frame its own 256 colours: the fast octree instead of PIL's slower default for RGB
        pil = [
            Image.fromarray(im).quantize(
                256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE
            )
            for im in images
        ]
        file = out / f"{name}.gif"
        pil[0].save(file, save_all=True, append_images=pil[1:], duration=500, loop=0)
        written.append(file)
    return written


def write_scene_videos(frames: dict[str, list[np.ndarray]], out: Path) -> list[Path]:
    """One MP4 (MPEG-4 part 2, OpenCV's writer) per scene (name -> its pictures in time order, of
    one size) in `out`, two frames a second."""
    written = []
    for name, images in frames.items():
        file = out / f"{name}.mp4"
        height, width = images[0].shape[:2]
        writer = cv2.VideoWriter(str(file), cv2.VideoWriter_fourcc(*"mp4v"), 2.0, (width, height))
        if not writer.isOpened():
            raise OSError(f"cannot write {file}: OpenCV's MP4 writer is not available (use --gif)")
        for image in images:
            writer.write(cv2.cvtColor(image, cv2.COLOR_RGB2BGR))
        writer.release()
        written.append(file)
    return written


def _scene_name(dataset) -> Callable[[str], str]:
    """sample token -> the name of its scene, from the dataset's nuScenes tables."""
    from lss.data.tables import load_tables

    nusc = load_tables(dataset.root, dataset.version)
    return lambda token: nusc.get("scene", nusc.get("sample", token)["scene_token"])["name"]


def render_checkpoint(
    cfg: Config, ckpt: str, out_dir: Optional[str] = None, num: Optional[int] = None
) -> list[Path]:
    """Render the first `num` (default viz.num) validation samples with checkpoint `ckpt` into
    `out_dir` (default viz.out_dir, else viz/ in the run directory that holds the checkpoint): one
    PNG per sample, plus one GIF per scene with viz.gif. Returns the written paths."""
    from PIL import Image
    from tqdm import tqdm

    from lss.data.loader import build_dataset
    from lss.engine.distributed import select_device
    from lss.engine.checkpoint import load_checkpoint_model, run_directory

    device = select_device(cfg)
    model, state = load_checkpoint_model(cfg, Path(ckpt), device)
    dataset = build_dataset(cfg, cfg.data.val_split, False)
    count = min(num if num is not None else cfg.viz.num, len(dataset))
    out = Path(out_dir or cfg.viz.out_dir or run_directory(ckpt) / "viz")
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    frames: dict[str, list[np.ndarray]] = {}
    scene_of = _scene_name(dataset) if cfg.viz.gif else None
    for idx in tqdm(range(count), desc="viz", unit="sample", dynamic_ncols=True):
        item = dataset[idx]
        batch = {
            k: v.unsqueeze(0).to(device) if torch.is_tensor(v) else [v] for k, v in item.items()
        }
        with torch.no_grad():
            probs, detections = _predictions(model(batch), cfg)
        token = item.get("sample_token", "")
        image = render_sample(
            item,
            probs[0],
            cfg,
            title=f"sample {idx:04d} {token[:12]}   checkpoint step {state['step']}",
            detections=None if detections is None else detections[0],
        ).image
        file = out / f"{idx:04d}_{token[:12] or 'sample'}.png"
        Image.fromarray(image).save(file, compress_level=1)
        written.append(file)
        if scene_of is not None:
            frames.setdefault(scene_of(token), []).append(image)
    written += write_scene_gifs(frames, out)
    print(f"wrote {len(written)} picture(s) to {out}")
    return written
