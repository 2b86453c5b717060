"""Pictures of predictions: the six cameras laid out like nuScenes next to the BEV panel (prediction heat map,
ground-truth outline, map layers, ego car; forward up). `lss viz` writes one PNG per sample."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import cv2
import numpy as np
import torch

from lss.config import Config
from lss.engine.build import build_dataset, select_device
from lss.engine.eval import load_checkpoint_model

FRONT_ROW = ("CAM_FRONT_LEFT", "CAM_FRONT", "CAM_FRONT_RIGHT")
BACK_ROW = ("CAM_BACK_LEFT", "CAM_BACK", "CAM_BACK_RIGHT")
MAP_CLASSES = {
    "drivable_area": (200, 200, 200),
    "ped_crossing": (170, 190, 210),
    "walkway": (215, 205, 190),
    "lane_divider": (90, 90, 90),
    "road_divider": (60, 60, 60),
}
OBJECT_COLORS = [
    (30, 90, 230),
    (220, 40, 40),
    (30, 160, 60),
    (200, 120, 0),
    (150, 60, 200),
]  # RGB per object class
EGO_SIZE_M = (4.5, 1.9)  # length (x), width (y) of the ego car outline
CAMERA_TILE_WIDTH = 352


def bev_to_image(bev: np.ndarray) -> np.ndarray:
    """nx x ny (... ) grid with row = ego x (forward), column = ego y (left) -> image rows/cols with forward up and
    left on the left."""
    return bev[::-1, ::-1]


def denormalize(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """N x 3 x H x W normalized images -> N x H x W x 3 uint8 RGB."""
    m = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)
    rgb = (images.float().cpu() * s + m).clamp(0, 1).mul(255).round().byte()
    return rgb.permute(0, 2, 3, 1).numpy()


def camera_mosaic(
    images: np.ndarray, cameras: Sequence[str], tile_width: int = CAMERA_TILE_WIDTH
) -> np.ndarray:
    """N x H x W x 3 uint8 images named by `cameras` -> one image: front row FL/F/FR, back row BL/B/BR (a camera
    that is missing stays black)."""
    h, w = images.shape[1:3]
    tile_h = max(1, round(h * tile_width / w))
    rows = []
    for row in (FRONT_ROW, BACK_ROW):
        tiles = []
        for name in row:
            tile = np.zeros((tile_h, tile_width, 3), np.uint8)
            if name in cameras:
                tile = cv2.resize(
                    images[list(cameras).index(name)],
                    (tile_width, tile_h),
                    interpolation=cv2.INTER_LINEAR,
                )
                if tile_h >= 40:  # a label on tiles large enough to hold it
                    cv2.putText(
                        tile,
                        name.replace("CAM_", ""),
                        (6, 18),
                        cv2.FONT_HERSHEY_SIMPLEX,
                        0.5,
                        (255, 255, 0),
                        1,
                        cv2.LINE_AA,
                    )
            tiles.append(tile)
        rows.append(np.concatenate(tiles, axis=1))
    return np.concatenate(rows, axis=0)


def bev_panel(
    probs: np.ndarray,
    targets: np.ndarray,
    classes: Sequence[str],
    lower: Sequence[float],
    cell_size: Sequence[float],
    size: int = 400,
) -> np.ndarray:
    """BEV picture, size x size x 3 uint8, forward up: ground-truth map layers as background, a heat map of the
    predicted probability of each object class, the object ground truth as an outline, the ego car in the middle.

    probs, targets: K x nx x ny (classes in `classes` order); lower/cell_size: the grid's (x, y, ...) origin and
    cell size in metres (to place the ego car).
    """
    k, nx, ny = probs.shape
    canvas = np.full((nx, ny, 3), 255.0, np.float32)
    objects = [i for i, c in enumerate(classes) if c not in MAP_CLASSES]
    for i, c in enumerate(classes):
        if c in MAP_CLASSES:
            canvas[targets[i] > 0.5] = MAP_CLASSES[c]
    for n, i in enumerate(objects):
        color = np.array(OBJECT_COLORS[n % len(OBJECT_COLORS)], np.float32)
        alpha = np.clip(probs[i], 0, 1)[..., None]
        canvas = canvas * (1 - alpha) + color * alpha
    canvas = bev_to_image(canvas)
    scale = size / max(nx, ny)
    image = cv2.resize(
        np.ascontiguousarray(canvas).astype(np.uint8),
        (round(ny * scale), round(nx * scale)),
        interpolation=cv2.INTER_NEAREST,
    )
    for i in objects:
        mask = np.ascontiguousarray(bev_to_image(targets[i] > 0.5)).astype(np.uint8)
        mask = cv2.resize(mask, (image.shape[1], image.shape[0]), interpolation=cv2.INTER_NEAREST)
        contours, _ = cv2.findContours(mask, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)
        cv2.drawContours(image, contours, -1, (0, 0, 0), 1, cv2.LINE_AA)
    _draw_ego(image, nx, ny, lower, cell_size, scale)
    return image


def _draw_ego(
    image: np.ndarray,
    nx: int,
    ny: int,
    lower: Sequence[float],
    cell_size: Sequence[float],
    scale: float,
) -> None:
    # ego origin in grid cells, then in image pixels (rows flipped: forward up; columns flipped: left on the left)
    ci = (0.0 - lower[0]) / cell_size[0]
    cj = (0.0 - lower[1]) / cell_size[1]
    row, col = (nx - ci) * scale, (ny - cj) * scale
    half_l = EGO_SIZE_M[0] / 2 / cell_size[0] * scale
    half_w = EGO_SIZE_M[1] / 2 / cell_size[1] * scale
    top_left = (round(col - half_w), round(row - half_l))
    bottom_right = (round(col + half_w), round(row + half_l))
    cv2.rectangle(image, top_left, bottom_right, (20, 170, 20), -1)
    cv2.arrowedLine(
        image,
        (round(col), round(row)),
        (round(col), round(row - 2 * half_l)),
        (0, 90, 0),
        1,
        cv2.LINE_AA,
        tipLength=0.4,
    )


def bev_grid_image(
    probs: torch.Tensor,
    targets: torch.Tensor,
    classes: Sequence[str],
    max_samples: int = 4,
    cell: int = 2,
) -> np.ndarray:
    """Tensorboard picture: per sample (rows) and class (columns), prediction | ground truth, forward up.
    probs, targets: B x K x nx x ny. Returns H x W x 3 uint8."""
    rows = []
    for b in range(min(probs.shape[0], max_samples)):
        tiles = []
        for k in range(len(classes)):
            pred = bev_to_image(probs[b, k].float().numpy())
            truth = bev_to_image(targets[b, k].float().numpy())
            pair = np.concatenate([pred, np.ones((pred.shape[0], 2), np.float32), truth], axis=1)
            tiles += [pair, np.ones((pred.shape[0], 4), np.float32)]
        rows.append(np.concatenate(tiles, axis=1))
    gray = (255 * np.concatenate(rows, axis=0)).clip(0, 255).astype(np.uint8)
    gray = np.kron(gray, np.ones((cell, cell), np.uint8))
    return np.ascontiguousarray(np.repeat(gray[..., None], 3, axis=2))


def render_sample(
    item: dict, probs: np.ndarray, cfg: Config, title: str = "", detections: Optional[dict] = None
) -> np.ndarray:
    """One picture (H x W x 3 uint8) of a dataset item and the model's K x nx x ny probabilities; with the
    detection head, its boxes (`detections`, lss.models.heads.detection.decode_detections) and the item's ground truth."""
    from lss.detection_viz import draw_bev_detections, draw_camera_detections
    from lss.geometry import BevGrid

    grid = BevGrid.from_config(cfg.grid)
    images = denormalize(item["images"], cfg.data.image_mean, cfg.data.image_std)
    if detections is not None:
        images = draw_camera_detections(images, item, detections)
    mosaic = camera_mosaic(images, cfg.data.cameras)
    panel = bev_panel(
        probs,
        item["targets"].float().numpy(),
        cfg.data.classes,
        grid.lower,
        grid.cell_size,
        size=mosaic.shape[0],
    )
    if detections is not None:
        panel = draw_bev_detections(panel, item, grid, detections)
    gap = np.full((mosaic.shape[0], 8, 3), 255, np.uint8)
    image = np.concatenate([mosaic, gap, panel], axis=1)
    header = np.full((24, image.shape[1], 3), 255, np.uint8)
    legend = (
        title
        + "   "
        + "  ".join(f"{c}" for c in cfg.data.classes if c not in MAP_CLASSES)
        + " (heat: prediction, outline: ground truth)"
    )
    cv2.putText(header, legend, (6, 17), cv2.FONT_HERSHEY_SIMPLEX, 0.5, (0, 0, 0), 1, cv2.LINE_AA)
    return np.concatenate([header, image], axis=0)


def _scene_of(dataset, token: str) -> str:
    nusc = getattr(dataset, "nusc", None)
    if nusc is None or not token:
        return "all"
    return nusc.get("sample", token)["scene_token"]


def render_checkpoint(
    cfg: Config, ckpt: str, out_dir: str, num: Optional[int] = None
) -> list[Path]:
    """Render the first `num` (default viz.num) validation samples with checkpoint `ckpt` into `out_dir`:
    one PNG per sample, plus one GIF per scene with viz.gif. Returns the written paths."""
    from PIL import Image
    from tqdm import tqdm

    from lss.models.heads.detection import decode_detections

    device = select_device(cfg)
    model, state = load_checkpoint_model(cfg, Path(ckpt), device)
    dataset = build_dataset(cfg, cfg.data.val_split, False)
    count = min(num if num is not None else cfg.viz.num, len(dataset))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    frames: dict[str, list[np.ndarray]] = {}
    for idx in tqdm(range(count), desc="viz", unit="sample", dynamic_ncols=True):
        item = dataset[idx]
        batch = {
            k: v.unsqueeze(0).to(device) if torch.is_tensor(v) else [v] for k, v in item.items()
        }
        with torch.no_grad():
            outputs = model(batch)
        probs = outputs["segmentation"][0].float().sigmoid().cpu().numpy()
        detections = decode_detections(outputs, cfg)[0] if "detection" in cfg.model.heads else None
        token = item.get("sample_token", "")
        image = render_sample(
            item,
            probs,
            cfg,
            title=f"{idx:04d} {token[:12]} step {state['step']}",
            detections=detections,
        )
        file = out / f"{idx:04d}_{token[:12] or 'sample'}.png"
        Image.fromarray(image).save(file)
        written.append(file)
        if cfg.viz.gif:
            frames.setdefault(_scene_of(dataset, token), []).append(image)
    for n, (scene, images) in enumerate(frames.items()):
        file = out / f"scene_{n:02d}_{scene[:12]}.gif"
        pil = [Image.fromarray(im) for im in images]
        pil[0].save(file, save_all=True, append_images=pil[1:], duration=500, loop=0)
        written.append(file)
    print(f"wrote {len(written)} picture(s) to {out}")
    return written
