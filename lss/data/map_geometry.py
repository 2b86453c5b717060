"""Map-expansion geometry of one location (polygons and polylines in global metres, with bounds for
culling), extracted from nuscenes-devkit's NuScenesMap once per process and rasterized into the ego
frame of a sample."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from lss.data import targets as T
from lss.data.bev_augmentation import BevAugmentation
from lss.data.classes import MAP_POLYGON_LAYERS, OBJECT_CLASSES
from lss.data.tables import MapNotFoundError, loaded_or_named
from lss.geometry import BevGrid


@dataclass
class MapGeometry:
    """Map layers of one location in global metres: polygons (rings: exterior then holes) and
    polylines, each with its axis-aligned bounds (P x 4: xmin, ymin, xmax, ymax) for culling."""

    polygons: dict[str, list[list[np.ndarray]]]
    polygon_bounds: dict[str, np.ndarray]
    lines: dict[str, list[np.ndarray]]
    line_bounds: dict[str, np.ndarray]

    def rasterize(
        self,
        layer: str,
        ego_xy: Sequence[float],
        ego_yaw: float,
        grid: BevGrid,
        line_width: int,
        bev: Optional[BevAugmentation] = None,
    ) -> np.ndarray:
        """nx x ny uint8 raster of `layer` in the ego frame at (ego_xy, ego_yaw), moved by `bev`
        when given."""
        canvas = np.zeros(grid.shape, dtype=np.uint8)
        (x_lo, x_hi, dx), (y_lo, y_hi, dy) = grid.xbound, grid.ybound
        reach = np.hypot(max(abs(x_lo), abs(x_hi)), max(abs(y_lo), abs(y_hi)))
        reach += line_width * max(dx, dy)
        reach /= bev.scale if bev is not None else 1.0

        def to_ego(points: np.ndarray) -> np.ndarray:
            ego = T.global_to_ego_xy(points, ego_xy, ego_yaw)
            return bev.apply_to_points_xy(ego) if bev is not None else ego

        lo, hi = np.asarray(ego_xy[:2]) - reach, np.asarray(ego_xy[:2]) + reach

        def near(bounds: np.ndarray) -> np.ndarray:
            if len(bounds) == 0:
                return np.zeros(0, dtype=np.int64)
            keep = (
                (bounds[:, 0] <= hi[0])
                & (bounds[:, 2] >= lo[0])
                & (bounds[:, 1] <= hi[1])
                & (bounds[:, 3] >= lo[1])
            )
            return np.flatnonzero(keep)

        if layer in self.polygons:
            polys = [
                [to_ego(r) for r in self.polygons[layer][i]]
                for i in near(self.polygon_bounds[layer])
            ]
            T.rasterize_polygons(canvas, polys, grid)
        else:
            lines = [to_ego(self.lines[layer][i]) for i in near(self.line_bounds[layer])]
            T.rasterize_lines(canvas, lines, grid, line_width)
        return canvas


_MAPS: dict = {}


def map_file(root: Path, location: str) -> Path:
    return Path(root) / "maps" / "expansion" / f"{location}.json"


def load_map_geometry(root: Path, location: str, layers: Sequence[str]) -> MapGeometry:
    """Extract `layers` of one location from the devkit's NuScenesMap (cached per process)."""
    key = (str(Path(root).resolve()), location, tuple(sorted(layers)))
    if key in _MAPS:
        return _MAPS[key]
    path = map_file(root, location)
    if not path.is_file():
        raise MapNotFoundError(
            f"map expansion for location '{location}' not found: expected {path}. Download the "
            f"nuScenes map expansion (v1.3) and unpack it into {Path(root) / 'maps'} so that "
            "maps/expansion/<location>.json exist, or configure only object classes "
            f"({', '.join(OBJECT_CLASSES)}) in data.classes."
        )
    from nuscenes.map_expansion.map_api import NuScenesMap

    nmap = loaded_or_named(
        lambda: NuScenesMap(dataroot=str(root), map_name=location),
        [path],
        dict,
        f"the map expansion of location '{location}'",
    )
    node_xy = {n["token"]: (n["x"], n["y"]) for n in nmap.node}

    def ring(tokens: Sequence[str]) -> np.ndarray:
        return np.asarray([node_xy[t] for t in tokens], dtype=np.float64).reshape(-1, 2)

    def bounds(arrays: Sequence[np.ndarray]) -> np.ndarray:
        if not arrays:
            return np.zeros((0, 4))
        return np.asarray([[*a.min(0), *a.max(0)] for a in arrays])

    polygons, polygon_bounds, lines, line_bounds = {}, {}, {}, {}
    for layer in layers:
        if layer in MAP_POLYGON_LAYERS:
            polys = []
            for record in getattr(nmap, layer):
                tokens = (
                    record["polygon_tokens"]
                    if layer == "drivable_area"
                    else [record["polygon_token"]]
                )
                for token in tokens:
                    poly = nmap.get("polygon", token)
                    rings = [ring(poly["exterior_node_tokens"])] + [
                        ring(h["node_tokens"]) for h in poly["holes"]
                    ]
                    if len(rings[0]):
                        polys.append(rings)
            polygons[layer] = polys
            polygon_bounds[layer] = bounds([p[0] for p in polys])
        else:
            found = [
                ring(nmap.get("line", r["line_token"])["node_tokens"]) for r in getattr(nmap, layer)
            ]
            lines[layer] = [line for line in found if len(line)]
            line_bounds[layer] = bounds(lines[layer])
    _MAPS[key] = MapGeometry(polygons, polygon_bounds, lines, line_bounds)
    return _MAPS[key]
