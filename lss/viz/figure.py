"""The picture's layout: a title line, the camera mosaic, below it the BEV panels side by side under
their titles, and a legend. Drawn with numpy and OpenCV (text included): a picture costs
milliseconds, not a matplotlib figure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import cv2
import numpy as np

from lss.viz.bev import BACKGROUND, BORDER_COLOR, TEXT_COLOR, blank

FONT = cv2.FONT_HERSHEY_SIMPLEX
TITLE_HEIGHT = 30
PANEL_TITLE_HEIGHT = 28
LEGEND_ROW_HEIGHT = 24
GAP = 16  # between the panels, and between the mosaic and the panels' titles
SWATCH = 14
MARGIN = 8


@dataclass(frozen=True)
class Rect:
    """A region of the picture, in pixels."""

    top: int
    left: int
    height: int
    width: int

    def of(self, image: np.ndarray) -> np.ndarray:
        return image[self.top : self.top + self.height, self.left : self.left + self.width]


@dataclass(frozen=True)
class LegendEntry:
    """A legend item: a filled swatch (a class layer, the ego car) or an outlined one (boxes)."""

    label: str
    color: tuple[int, int, int]
    style: Literal["fill", "outline"] = "fill"


@dataclass
class Figure:
    """The picture (H x W x 3 uint8 RGB) and where its parts lie: "title", "cameras", one entry per
    panel name (e.g. "prediction", "truth") and its "<name>_title", and "legend"."""

    image: np.ndarray
    regions: dict[str, Rect]


def put_text(image: np.ndarray, text: str, left: int, baseline: int, scale: float = 0.5) -> None:
    """Write `text` in place (dark, anti-aliased), smaller where it would pass the image's right
    edge."""
    width = cv2.getTextSize(text, FONT, scale, 1)[0][0]
    room = image.shape[1] - left - 2
    if width > room > 0:
        scale *= room / width
    cv2.putText(image, text, (left, baseline), FONT, scale, TEXT_COLOR, 1, cv2.LINE_AA)


def _legend_rows(entries: Sequence[LegendEntry], width: int) -> list[list[tuple[int, LegendEntry]]]:
    """The entries with their left edges, wrapped into rows that fit `width`."""
    rows: list[list[tuple[int, LegendEntry]]] = [[]]
    left = MARGIN
    for entry in entries:
        size = SWATCH + 6 + cv2.getTextSize(entry.label, FONT, 0.5, 1)[0][0]
        if rows[-1] and left + size > width - MARGIN:
            rows.append([])
            left = MARGIN
        rows[-1].append((left, entry))
        left += size + 22
    return rows


def _draw_legend(area: np.ndarray, rows: list[list[tuple[int, LegendEntry]]]) -> None:
    for r, row in enumerate(rows):
        top = r * LEGEND_ROW_HEIGHT + (LEGEND_ROW_HEIGHT - SWATCH) // 2
        for left, entry in row:
            corner = (left + SWATCH - 1, top + SWATCH - 1)
            if entry.style == "fill":
                cv2.rectangle(area, (left, top), corner, entry.color, -1)
                cv2.rectangle(area, (left, top), corner, BORDER_COLOR, 1)
            else:
                cv2.rectangle(
                    area, (left + 1, top + 1), (corner[0] - 1, corner[1] - 1), entry.color, 2
                )
            put_text(area, entry.label, left + SWATCH + 6, top + SWATCH - 2)


def compose_figure(
    title: str,
    mosaic: np.ndarray,
    panels: Sequence[tuple[str, str, np.ndarray]],
    legend: Sequence[LegendEntry],
) -> Figure:
    """The picture: `title`, the camera `mosaic` (centred), the `panels` ((name, title, H x W x 3
    uint8) in left to right order, all of one height) under their titles, then the `legend`."""
    heights = {p.shape[0] for _, _, p in panels}
    if len(heights) != 1:
        raise ValueError(f"compose_figure: the panels must be of one height, got {sorted(heights)}")
    panels_width = sum(p.shape[1] for _, _, p in panels) + GAP * (len(panels) - 1)
    width = max(mosaic.shape[1], panels_width)
    legend_rows = _legend_rows(legend, width)
    regions = {
        "title": Rect(0, 0, TITLE_HEIGHT, width),
        "cameras": Rect(TITLE_HEIGHT, (width - mosaic.shape[1]) // 2, *mosaic.shape[:2]),
    }
    titles_top = TITLE_HEIGHT + mosaic.shape[0] + GAP
    panels_top = titles_top + PANEL_TITLE_HEIGHT
    left = (width - panels_width) // 2
    for name, _, panel in panels:
        regions[f"{name}_title"] = Rect(titles_top, left, PANEL_TITLE_HEIGHT, panel.shape[1])
        regions[name] = Rect(panels_top, left, *panel.shape[:2])
        left += panel.shape[1] + GAP
    legend_top = panels_top + heights.pop() + MARGIN
    regions["legend"] = Rect(legend_top, 0, LEGEND_ROW_HEIGHT * len(legend_rows), width)
    image = blank(legend_top + regions["legend"].height + MARGIN, width, BACKGROUND)
    put_text(image, title, MARGIN, TITLE_HEIGHT - 10, 0.55)
    regions["cameras"].of(image)[:] = mosaic
    for name, panel_title, panel in panels:
        regions[name].of(image)[:] = panel
        put_text(regions[f"{name}_title"].of(image), panel_title, 2, PANEL_TITLE_HEIGHT - 9, 0.55)
    _draw_legend(regions["legend"].of(image), legend_rows)
    return Figure(image, regions)
