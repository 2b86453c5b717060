"""The BEV panels: every configured class as a layer in its own colour (map areas first, map lines
over them, objects on top; a layer's opacity is the predicted probability, the thresholded
prediction or the ground truth), the ego car, a 10 m scale bar. Forward (ego +x) is up, ego left
(+y) on the left; `BevView` is the one mapping from ego metres to panel pixels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import cv2
import numpy as np

from lss.data import MAP_LINE_LAYERS, MAP_POLYGON_LAYERS
from lss.viz.detection import draw_bev_boxes
from lss.geometry import BevGrid

# RGB per class: map areas light, lines and objects saturated; none equal to the ego or box colours.
CLASS_COLORS = {
    "drivable_area": (190, 190, 190),
    "road_segment": (205, 205, 220),
    "road_block": (175, 190, 210),
    "lane": (205, 220, 200),
    "ped_crossing": (245, 170, 140),
    "walkway": (150, 205, 140),
    "stop_line": (230, 100, 100),
    "carpark_area": (240, 215, 140),
    "lane_divider": (150, 70, 200),
    "road_divider": (200, 0, 160),
    "vehicle": (30, 90, 230),
    "pedestrian": (255, 130, 0),
    "car": (40, 130, 255),
    "truck": (0, 160, 200),
    "bus": (90, 50, 190),
    "trailer": (130, 90, 50),
    "construction_vehicle": (190, 160, 0),
    "motorcycle": (220, 40, 140),
    "bicycle": (0, 130, 110),
    "traffic_cone": (255, 90, 40),
    "barrier": (90, 90, 90),
}
# For class names without a colour of their own, in this order.
SPARE_COLORS = ((0, 200, 200), (170, 120, 255), (120, 160, 0), (255, 180, 200), (100, 60, 120))
EGO_COLOR = (15, 15, 15)
EGO_OUTLINE = (255, 255, 255)
EGO_SIZE_M = (4.5, 1.9)  # length along ego x, width along ego y
BACKGROUND = (255, 255, 255)
BORDER_COLOR = (150, 150, 150)
TEXT_COLOR = (30, 30, 30)
SCALE_BAR_M = 10.0


def class_kind(name: str) -> Literal["area", "line", "object"]:
    """How a class is drawn: a filled map area, a map line over the areas, or an object on top."""
    if name in MAP_POLYGON_LAYERS:
        return "area"
    if name in MAP_LINE_LAYERS:
        return "line"
    return "object"


def drawing_order(classes: Sequence[str]) -> list[int]:
    """Indices into `classes`: map areas, then map lines, then objects (each group in config
    order)."""
    rank = {"area": 0, "line": 1, "object": 2}
    return sorted(range(len(classes)), key=lambda k: (rank[class_kind(classes[k])], k))


def class_colors(classes: Sequence[str]) -> list[tuple[int, int, int]]:
    """One RGB colour per class, distinct within `classes`."""
    spare = iter(c for c in SPARE_COLORS if c not in CLASS_COLORS.values())
    colors = []
    for name in classes:
        color = CLASS_COLORS.get(name)
        if color is None or color in colors:
            color = next(spare, None)
            if color is None:
                raise ValueError(
                    f"class_colors: no colour left for class {name!r}; lss.viz.bev.SPARE_COLORS "
                    f"holds {len(SPARE_COLORS)} colours for classes without one of their own"
                )
        colors.append(color)
    return colors


def layer_opacity(
    probs: np.ndarray, mode: Literal["probability", "threshold"], threshold: float
) -> np.ndarray:
    """K x nx x ny predicted probabilities -> the layers' opacities in [0, 1]: the probability
    itself, or 1 where it exceeds `threshold` (the evaluation's rule: those cells count as predicted
    in the IoU)."""
    if mode == "probability":
        return np.clip(probs, 0.0, 1.0).astype(np.float32)
    if mode == "threshold":
        return (probs > threshold).astype(np.float32)
    raise ValueError(f"layer_opacity: mode {mode!r}: expected 'probability' or 'threshold'")


def blank(height: int, width: int, color: Sequence[int], dtype=np.uint8) -> np.ndarray:
    """A height x width x 3 image of one colour."""
    image = np.empty((height, width, 3), dtype)
    image[:] = np.tile(
        np.asarray(color, dtype), (width, 1)
    )  # row by row: numpy is slow at (3,) broadcasts
    return image


def compose_layers(
    opacity: np.ndarray, colors: Sequence[Sequence[int]], order: Sequence[int]
) -> np.ndarray:
    """K x nx x ny opacities -> nx x ny x 3 uint8: the layers over a white ground, in `order` (last
    on top)."""
    canvas = blank(*opacity.shape[1:], BACKGROUND, np.float32)
    for k in order:
        alpha = opacity[k][..., None]
        canvas += alpha * (np.asarray(colors[k], np.float32) - canvas)
    return canvas.round().astype(np.uint8)


@dataclass(frozen=True)
class BevView:
    """The grid drawn on a panel of `height` x `width` pixels: forward up, ego left on the left."""

    grid: BevGrid
    height: int
    width: int

    @classmethod
    def fit(cls, grid: BevGrid, width: int, min_height: int = 0) -> "BevView":
        """The grid at the same scale along both axes, `width` pixels wide, or wider where that
        leaves it lower than `min_height`."""
        extent_x, extent_y = grid.nx * grid.cell_size[0], grid.ny * grid.cell_size[1]
        pixels_per_metre = max(width / extent_y, min_height / extent_x)
        return cls(grid, round(extent_x * pixels_per_metre), round(extent_y * pixels_per_metre))

    @property
    def pixels_per_metre(self) -> float:
        return self.width / (self.grid.ny * self.grid.cell_size[1])

    def to_pixels(self, xy: np.ndarray) -> np.ndarray:
        """Ego points ... x 2 (x, y in metres) -> panel pixels ... x 2 (column, row), continuous:
        pixel (c, r) covers [c, c + 1) x [r, r + 1)."""
        xy = np.asarray(xy, np.float64)
        u, v = self.grid.to_cells(xy[..., 0], 0), self.grid.to_cells(xy[..., 1], 1)
        rows = (self.grid.nx - u) * (self.height / self.grid.nx)
        cols = (self.grid.ny - v) * (self.width / self.grid.ny)
        return np.stack([cols, rows], axis=-1)

    def raster(self, cells: np.ndarray) -> np.ndarray:
        """An nx x ny (x C) map of the grid -> height x width (x C), each pixel the cell under
        it."""
        if cells.shape[:2] != (self.grid.nx, self.grid.ny):
            raise ValueError(
                f"BevView.raster: a {cells.shape[0]} x {cells.shape[1]} map for a {self.grid.nx} x "
                f"{self.grid.ny} grid; maps must have the grid's shape (grid.xbound, grid.ybound)"
            )
        flipped = np.ascontiguousarray(cells[::-1, ::-1])
        return cv2.resize(flipped, (self.width, self.height), interpolation=cv2.INTER_NEAREST)


def ego_outline_m() -> np.ndarray:
    """The ego car's outline, 5 x 2 (ego x, y in metres): a box whose front half narrows to a nose
    at +x."""
    length, width = EGO_SIZE_M
    back, shoulder, front = -length / 2, length / 8, length / 2
    return np.array(
        [
            [back, width / 2],
            [shoulder, width / 2],
            [front, 0.0],
            [shoulder, -width / 2],
            [back, -width / 2],
        ]
    )


def draw_ego(panel: np.ndarray, view: BevView) -> None:
    """The ego car, filled, its nose towards +x, in place."""
    outline = np.round(view.to_pixels(ego_outline_m())).astype(np.int32).reshape(-1, 1, 2)
    cv2.fillPoly(panel, [outline], EGO_COLOR, cv2.LINE_8)
    cv2.polylines(panel, [outline], True, EGO_OUTLINE, 1, cv2.LINE_AA)


def draw_scale_bar(panel: np.ndarray, view: BevView, margin: int = 10) -> None:
    """A SCALE_BAR_M bar with its length written above it, at the panel's bottom-left, in place."""
    length = max(1, round(SCALE_BAR_M * view.pixels_per_metre))
    label = f"{SCALE_BAR_M:g} m"
    (text_w, text_h), _ = cv2.getTextSize(label, cv2.FONT_HERSHEY_SIMPLEX, 0.45, 1)
    left, bottom = margin, panel.shape[0] - margin
    top = bottom - text_h - 16
    cv2.rectangle(
        panel, (left - 4, top - 4), (left + max(length, text_w) + 4, bottom + 4), BACKGROUND, -1
    )
    cv2.rectangle(panel, (left, bottom - 4), (left + length - 1, bottom), TEXT_COLOR, -1)
    for x in (left, left + length - 1):
        cv2.line(panel, (x, bottom - 9), (x, bottom), TEXT_COLOR, 1)
    cv2.putText(
        panel,
        label,
        (left, bottom - 12),
        cv2.FONT_HERSHEY_SIMPLEX,
        0.45,
        TEXT_COLOR,
        1,
        cv2.LINE_AA,
    )


def bev_panel(
    opacity: np.ndarray,
    colors: Sequence[Sequence[int]],
    order: Sequence[int],
    view: BevView,
    boxes: Sequence[tuple[np.ndarray, Sequence[int]]] = (),
) -> np.ndarray:
    """One BEV panel, view.height x view.width x 3 uint8: the K x nx x ny layers (compose_layers),
    then `boxes` ((M x 9 boxes, RGB) pairs, lss.viz.detection.draw_bev_boxes), the ego car, the
    scale bar and a border."""
    panel = view.raster(compose_layers(opacity, colors, order))
    for box_set, color in boxes:
        draw_bev_boxes(panel, box_set, view, color, thickness=2)
    draw_ego(panel, view)
    draw_scale_bar(panel, view)
    cv2.rectangle(panel, (0, 0), (view.width - 1, view.height - 1), BORDER_COLOR, 1)
    return panel
