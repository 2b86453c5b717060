"""The road network of a synthetic nuScenes location: a grid of straight two-way roads with lanes,
optional parking shoulders, sidewalks, zebra crossings and buildings lining the blocks.

Everything lives in the global frame of the location (metres, x east, y north, z up, ground at
z = 0), as in nuScenes.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import numpy as np

from .reproducible import norm

LOCATIONS = (
    "singapore-onenorth",
    "singapore-hollandvillage",
    "singapore-queenstown",
    "boston-seaport",
)
# Singapore drives on the left, Boston on the right.
DRIVE_SIDE = {
    "singapore-onenorth": -1,
    "singapore-hollandvillage": -1,
    "singapore-queenstown": -1,
    "boston-seaport": 1,
}
# Extent of the real nuScenes maps (metres); our roads lie well inside them.
CANVAS_EDGE = {
    "singapore-onenorth": (1585.6, 2025.0),
    "singapore-hollandvillage": (2808.3, 2922.9),
    "singapore-queenstown": (3228.6, 3687.1),
    "boston-seaport": (2979.5, 2118.1),
}

SIDEWALK_WIDTH = 3.5
CROSSING_GAP = 0.5  # from the intersection edge to the zebra crossing
CROSSING_DEPTH = 4.0
STOP_LINE_GAP = 1.0  # from the crossing to the stop line


def stable_seed(*parts) -> int:
    """A seed from strings/ints that does not depend on Python's hash randomization."""
    return zlib.crc32("/".join(str(p) for p in parts).encode())


@dataclass
class Road:
    """A straight two-way road: centreline from `start` to `end` (global x, y)."""

    name: str
    start: np.ndarray
    end: np.ndarray
    lanes: int  # per direction
    lane_width: float
    parking: float  # width of the parking shoulder on each side (0: none)
    stations: list = field(default_factory=list)  # (s, half width) of crossing roads, sorted by s

    @property
    def length(self) -> float:
        return norm(self.end - self.start)

    @property
    def direction(self) -> np.ndarray:
        return (self.end - self.start) / self.length

    @property
    def left(self) -> np.ndarray:
        d = self.direction
        return np.array([-d[1], d[0]])

    @property
    def heading(self) -> float:
        d = self.direction
        return math.atan2(d[1], d[0])

    @property
    def lane_half_width(self) -> float:
        return self.lanes * self.lane_width

    @property
    def half_width(self) -> float:
        return self.lane_half_width + self.parking

    def point(self, s, lateral) -> np.ndarray:
        """Global x, y at distance s along the road and `lateral` metres to its left.
        Returns ... x 2."""
        s = np.asarray(s, dtype=np.float64)[..., None]
        lateral = np.asarray(lateral, dtype=np.float64)[..., None]
        return self.start + s * self.direction + lateral * self.left

    def sections(self) -> list[tuple[float, float, bool, bool]]:
        """Stretches between intersections: (s0, s1, starts at an intersection, ends at one)."""
        out, s0, at_start = [], 0.0, False
        for s, hw in self.stations:
            out.append((s0, s - hw, at_start, True))
            s0, at_start = s + hw, True
        out.append((s0, self.length, at_start, False))
        return out

    def lane_offset(self, direction: int, lane: int, drive_side: int) -> float:
        """Lateral offset (to the left) of the centre of lane `lane` (0 = next to the centreline) of
        the carriageway travelling along (+1) or against (-1) the road."""
        return -drive_side * direction * (lane + 0.5) * self.lane_width


@dataclass
class Building:
    """An unannotated static box (global frame): centre x, y, yaw, size (w, l, h), RGB colour."""

    x: float
    y: float
    yaw: float
    size: tuple[float, float, float]
    color: tuple[int, int, int]


@dataclass
class Location:
    """The road network of one nuScenes location."""

    name: str
    roads: list[Road]
    buildings: list[Building]
    drive_side: int
    bounds: tuple[float, float, float, float]  # xmin, ymin, xmax, ymax of the road grid

    @property
    def canvas_edge(self) -> tuple[float, float]:
        return CANVAS_EDGE[self.name]


def build_location(name: str, seed: int) -> Location:
    """A grid of 4 x 4 straight roads with 1-2 lanes per direction, placed like a real map (hundreds
    of metres from the map origin), with buildings lining the blocks."""
    rng = np.random.default_rng(stable_seed("location", name, seed))
    x0, y0 = rng.uniform(200.0, 320.0, size=2)
    xs = x0 + np.concatenate([[0.0], np.cumsum(rng.uniform(120.0, 170.0, size=3))])
    ys = y0 + np.concatenate([[0.0], np.cumsum(rng.uniform(120.0, 170.0, size=3))])
    margin = 90.0
    xmin, xmax, ymin, ymax = xs[0] - margin, xs[-1] + margin, ys[0] - margin, ys[-1] + margin
    lane_width = 3.6 if name == "boston-seaport" else 3.4

    def make(kind, i, c):
        lanes = int(rng.choice([1, 2, 2]))
        parking = float(rng.choice([0.0, 2.5, 2.5]))
        if kind == "x":
            start, end = np.array([xmin, c]), np.array([xmax, c])
        else:
            start, end = np.array([c, ymin]), np.array([c, ymax])
        return Road(f"{kind}{i}", start, end, lanes, lane_width, parking)

    x_roads = [make("x", i, y) for i, y in enumerate(ys)]  # run along x
    y_roads = [make("y", i, x) for i, x in enumerate(xs)]  # run along y
    for r in x_roads:
        r.stations = [(float(c.start[0] - xmin), c.half_width) for c in y_roads]
    for r in y_roads:
        r.stations = [(float(c.start[1] - ymin), c.half_width) for c in x_roads]
    roads = x_roads + y_roads
    buildings = _place_buildings(rng, x_roads, y_roads, (xmin, ymin, xmax, ymax))
    return Location(name, roads, buildings, DRIVE_SIDE[name], (xmin, ymin, xmax, ymax))


def _place_buildings(rng, x_roads, y_roads, bounds) -> list[Building]:
    """Buildings along every block edge, set back from the sidewalk."""
    xmin, ymin, xmax, ymax = bounds
    xs = [xmin - 40.0] + [r.start[0] for r in y_roads] + [xmax + 40.0]
    ys = [ymin - 40.0] + [r.start[1] for r in x_roads] + [ymax + 40.0]
    hw_x = [0.0] + [r.half_width for r in y_roads] + [0.0]
    hw_y = [0.0] + [r.half_width for r in x_roads] + [0.0]
    palette = [
        (150, 145, 140),
        (175, 160, 135),
        (120, 125, 135),
        (190, 185, 175),
        (140, 110, 95),
        (105, 115, 110),
        (200, 195, 185),
        (160, 150, 165),
    ]
    out = []
    for i in range(len(xs) - 1):
        for j in range(len(ys) - 1):
            # Block interior after sidewalks and a setback.
            bx0 = xs[i] + hw_x[i] + SIDEWALK_WIDTH + 2.0
            bx1 = xs[i + 1] - hw_x[i + 1] - SIDEWALK_WIDTH - 2.0
            by0 = ys[j] + hw_y[j] + SIDEWALK_WIDTH + 2.0
            by1 = ys[j + 1] - hw_y[j + 1] - SIDEWALK_WIDTH - 2.0
            if bx1 - bx0 < 20 or by1 - by0 < 20:
                continue
            # Walk the four edges; each building sits against one edge of the block.
            for edge in range(4):
                if edge in (0, 1):  # along x at the bottom (0) / top (1)
                    a0, a1 = bx0, bx1
                else:  # along y at the left (2) / right (3)
                    a0, a1 = by0, by1
                a = a0 + rng.uniform(0.0, 6.0)
                while True:
                    front = rng.uniform(12.0, 35.0)
                    depth = rng.uniform(10.0, 22.0)
                    # Corners are owned by the x edges; keep y-edge buildings clear of them.
                    lo, hi = (a0, a1) if edge in (0, 1) else (a0 + 24.0, a1 - 24.0)
                    a = max(a, lo)
                    if a + front > hi:
                        break
                    height = float(rng.choice([rng.uniform(5.0, 12.0), rng.uniform(12.0, 35.0)]))
                    color = palette[int(rng.integers(len(palette)))]
                    mid = a + front / 2
                    if edge == 0:
                        out.append(
                            Building(mid, by0 + depth / 2, 0.0, (depth, front, height), color)
                        )
                    elif edge == 1:
                        out.append(
                            Building(mid, by1 - depth / 2, 0.0, (depth, front, height), color)
                        )
                    elif edge == 2:
                        out.append(
                            Building(
                                bx0 + depth / 2, mid, math.pi / 2, (depth, front, height), color
                            )
                        )
                    else:
                        out.append(
                            Building(
                                bx1 - depth / 2, mid, math.pi / 2, (depth, front, height), color
                            )
                        )
                    a += front + rng.uniform(0.0, 8.0)
    return out
