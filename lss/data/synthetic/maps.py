"""Map geometry of a synthetic location and its nuScenes files: the map-expansion JSON (v1.3 schema,
loaded by nuscenes.map_expansion.map_api.NuScenesMap) and the semantic-prior PNG named by the map
table.

The same geometry drives the ground texture the cameras see (scenery.py), so what the map says is
what is drawn.
"""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np
from shapely.geometry import LineString, MultiPolygon, Polygon, box
from shapely.ops import unary_union

from .roads import CROSSING_DEPTH, CROSSING_GAP, SIDEWALK_WIDTH, STOP_LINE_GAP, Location

MAP_VERSION = "1.3"
SEMANTIC_PRIOR_RESOLUTION = 0.1  # metres per pixel, what nuscenes.utils.map_mask.MapMask assumes


@dataclass
class Marking:
    """A painted line on the road: polyline (global x, y), width (m), colour name, dash (on, off)
    metres or None."""

    points: np.ndarray
    width: float
    color: str
    dash: tuple[float, float] | None = None


@dataclass
class LocationGeometry:
    """Map layers (shapely, global frame) and the painted markings of one location."""

    drivable: Polygon | MultiPolygon
    walkway: list[Polygon]
    road_segments: list[tuple[Polygon, bool]]  # (polygon, is_intersection)
    lanes: list[dict]  # polygon, start/end edge lines, divider nodes, centreline pose
    road_dividers: list[LineString]
    lane_dividers: list[LineString]
    ped_crossings: list[Polygon]
    stop_lines: list[tuple[Polygon, int]]  # (polygon, index of the ped crossing it guards)
    markings: list[Marking] = field(default_factory=list)


def _rect(road, s0, s1, l0, l1) -> Polygon:
    pts = [road.point(s0, l0), road.point(s1, l0), road.point(s1, l1), road.point(s0, l1)]
    return Polygon([tuple(p) for p in pts])


def _line(road, s0, s1, lat) -> LineString:
    return LineString([tuple(road.point(s0, lat)), tuple(road.point(s1, lat))])


def location_geometry(location: Location) -> LocationGeometry:
    """Build every map layer and marking from the road grid."""
    side = location.drive_side
    rects = [_rect(r, 0.0, r.length, -r.half_width, r.half_width) for r in location.roads]
    drivable = unary_union(rects)
    xmin, ymin, xmax, ymax = location.bounds
    walk = (
        drivable.buffer(SIDEWALK_WIDTH, join_style=2)
        .difference(drivable)
        .intersection(box(xmin, ymin, xmax, ymax))
    )
    walkway = list(walk.geoms) if hasattr(walk, "geoms") else [walk]
    walkway = [p for p in walkway if isinstance(p, Polygon) and p.area > 1.0]

    x_roads = [r for r in location.roads if r.name.startswith("x")]
    y_roads = [r for r in location.roads if r.name.startswith("y")]
    segments = [
        (rects[location.roads.index(a)].intersection(rects[location.roads.index(b)]), True)
        for a in x_roads
        for b in y_roads
    ]
    lanes, road_dividers, lane_dividers, crossings, stop_lines, markings = [], [], [], [], [], []
    zone = CROSSING_GAP + CROSSING_DEPTH
    centre_color = "yellow" if side > 0 else "white"
    for r in location.roads:
        for s0, s1, at_start, at_end in r.sections():
            segments.append((_rect(r, s0, s1, -r.half_width, r.half_width), False))
            m0 = s0 + (zone + STOP_LINE_GAP + 0.5 if at_start else 0.0)
            m1 = s1 - (zone + STOP_LINE_GAP + 0.5 if at_end else 0.0)
            # Centre line (road divider) and lane dividers stop short of the crossings.
            road_dividers.append(_line(r, m0, m1, 0.0))
            for off in (-0.12, 0.12):
                markings.append(Marking(np.array(_line(r, m0, m1, off).coords), 0.12, centre_color))
            for d in (-1, 1):
                for k in range(1, r.lanes):
                    lat = -side * d * k * r.lane_width
                    line = _line(r, m0, m1, lat)
                    if d < 0:
                        line = LineString(list(line.coords)[::-1])
                    lane_dividers.append(line)
                    markings.append(Marking(np.array(line.coords), 0.12, "white", (3.0, 6.0)))
                for ln in range(r.lanes):
                    c = r.lane_offset(d, ln, side)
                    poly = _rect(r, s0, s1, c - r.lane_width / 2, c + r.lane_width / 2)
                    a, b = (s0, s1) if d > 0 else (s1, s0)
                    start, end = r.point(a, c), r.point(b, c)
                    half = r.lane_width / 2
                    lanes.append(
                        {
                            "polygon": poly,
                            "from_edge": LineString(
                                [tuple(r.point(a, c - half)), tuple(r.point(a, c + half))]
                            ),
                            "to_edge": LineString(
                                [tuple(r.point(b, c - half)), tuple(r.point(b, c + half))]
                            ),
                            # Divider nodes on the lane's left and right edges (seen in its
                            # direction of travel).
                            "left": [
                                tuple(r.point(a, c + d * half)),
                                tuple(r.point(b, c + d * half)),
                            ],
                            "right": [
                                tuple(r.point(a, c - d * half)),
                                tuple(r.point(b, c - d * half)),
                            ],
                            "start_pose": (
                                float(start[0]),
                                float(start[1]),
                                r.heading
                                if d > 0
                                else math.atan2(-r.direction[1], -r.direction[0]),
                            ),
                            "end_pose": (
                                float(end[0]),
                                float(end[1]),
                                r.heading
                                if d > 0
                                else math.atan2(-r.direction[1], -r.direction[0]),
                            ),
                            "length": abs(b - a),
                        }
                    )
            if r.parking > 0:
                for lat in (-r.lane_half_width, r.lane_half_width):
                    markings.append(Marking(np.array(_line(r, m0, m1, lat).coords), 0.15, "white"))
            for at, s_edge, sign in ((at_start, s0, 1), (at_end, s1, -1)):
                if not at:
                    continue
                c0, c1 = sorted((s_edge + sign * CROSSING_GAP, s_edge + sign * zone))
                crossings.append(_rect(r, c0, c1, -r.half_width, r.half_width))
                # Zebra stripes run along the road, across its whole width.
                n = int(2 * r.half_width // 1.0)
                for i in range(n):
                    lat = -r.half_width + 0.5 + i * 1.0 + 0.25
                    markings.append(
                        Marking(np.array(_line(r, c0 + 0.2, c1 - 0.2, lat).coords), 0.5, "white")
                    )
                # The stop line spans the carriageway arriving at the crossing (direction -sign
                # along s).
                stop_s = s_edge + sign * (zone + STOP_LINE_GAP)
                s_a, s_b = sorted((stop_s, stop_s + sign * 0.4))
                arriving = -sign  # direction of the traffic that reaches this crossing
                l0, l1 = sorted((0.0, -side * arriving * r.lane_half_width))
                stop_lines.append((_rect(r, s_a, s_b, l0, l1), len(crossings) - 1))
                markings.append(
                    Marking(
                        np.array(
                            [
                                tuple(r.point(stop_s + sign * 0.2, l0)),
                                tuple(r.point(stop_s + sign * 0.2, l1)),
                            ]
                        ),
                        0.4,
                        "white",
                    )
                )
    return LocationGeometry(
        drivable,
        walkway,
        segments,
        lanes,
        road_dividers,
        lane_dividers,
        crossings,
        stop_lines,
        markings,
    )


class _Tokens:
    """Deterministic uuid-style tokens, as in the real map files."""

    def __init__(self, namespace: str):
        self.namespace = namespace
        self.count = 0

    def __call__(self) -> str:
        self.count += 1
        return str(uuid.UUID(hashlib.md5(f"{self.namespace}/{self.count}".encode()).hexdigest()))


def map_expansion(location: Location, geometry: LocationGeometry, seed: int) -> dict:
    """The map-expansion JSON object of a location (every layer NuScenesMap reads)."""
    token = _Tokens(f"map/{location.name}/{seed}")
    nodes, lines, polygons = [], [], []

    def node(x, y) -> str:
        t = token()
        nodes.append({"token": t, "x": round(float(x), 4), "y": round(float(y), 4)})
        return t

    def ring(coords) -> list[str]:
        coords = list(coords)
        if len(coords) > 1 and coords[0] == coords[-1]:
            coords = coords[:-1]  # nuScenes rings are open
        return [node(x, y) for x, y in coords]

    def polygon(p: Polygon) -> str:
        t = token()
        polygons.append(
            {
                "token": t,
                "exterior_node_tokens": ring(p.exterior.coords),
                "holes": [{"node_tokens": ring(h.coords)} for h in p.interiors],
            }
        )
        return t

    def line(ls: LineString) -> str:
        t = token()
        lines.append({"token": t, "node_tokens": [node(x, y) for x, y in ls.coords]})
        return t

    drivable_parts = (
        list(geometry.drivable.geoms)
        if hasattr(geometry.drivable, "geoms")
        else [geometry.drivable]
    )
    drivable_token = token()
    drivable_area = [
        {"token": drivable_token, "polygon_tokens": [polygon(p) for p in drivable_parts]}
    ]
    road_segment = [
        {
            "token": token(),
            "polygon_token": polygon(p),
            "is_intersection": inter,
            "drivable_area_token": drivable_token,
        }
        for p, inter in geometry.road_segments
    ]
    lane, arcline, connectivity = [], {}, {}
    for ln in geometry.lanes:
        t = token()
        lane.append(
            {
                "token": t,
                "polygon_token": polygon(ln["polygon"]),
                "lane_type": "CAR",
                "from_edge_line_token": line(ln["from_edge"]),
                "to_edge_line_token": line(ln["to_edge"]),
                "left_lane_divider_segments": [
                    {"node_token": node(*p), "segment_type": "DOUBLE_DASHED_WHITE"}
                    for p in ln["left"]
                ],
                "right_lane_divider_segments": [
                    {"node_token": node(*p), "segment_type": "DOUBLE_DASHED_WHITE"}
                    for p in ln["right"]
                ],
            }
        )
        # A straight lane as one arcline path whose two arcs have zero length.
        arcline[t] = [
            {
                "start_pose": list(ln["start_pose"]),
                "end_pose": list(ln["end_pose"]),
                "shape": "LSR",
                "radius": 999.0,
                "segment_length": [0.0, float(ln["length"]), 0.0],
            }
        ]
        connectivity[t] = {"incoming": [], "outgoing": []}
    ped_crossing = [
        {"token": token(), "polygon_token": polygon(p), "road_segment_token": ""}
        for p in geometry.ped_crossings
    ]
    stop_line = [
        {
            "token": token(),
            "polygon_token": polygon(p),
            "stop_line_type": "PED_CROSSING",
            "ped_crossing_tokens": [ped_crossing[i]["token"]],
            "traffic_light_tokens": [],
            "road_block_token": "",
        }
        for p, i in geometry.stop_lines
    ]
    walkway = [{"token": token(), "polygon_token": polygon(p)} for p in geometry.walkway]
    road_divider = [
        {"token": token(), "line_token": line(ls), "road_segment_token": ""}
        for ls in geometry.road_dividers
    ]
    lane_divider = []
    for ls in geometry.lane_dividers:
        lt = line(ls)
        lane_divider.append(
            {
                "token": token(),
                "line_token": lt,
                "lane_divider_segments": [
                    {"node_token": nt, "segment_type": "SINGLE_DASHED_WHITE"}
                    for nt in lines[-1]["node_tokens"]
                ],
            }
        )
    return {
        "version": MAP_VERSION,
        "canvas_edge": list(location.canvas_edge),
        "polygon": polygons,
        "line": lines,
        "node": nodes,
        "drivable_area": drivable_area,
        "road_segment": road_segment,
        "road_block": [],
        "lane": lane,
        "ped_crossing": ped_crossing,
        "walkway": walkway,
        "stop_line": stop_line,
        "carpark_area": [],
        "road_divider": road_divider,
        "lane_divider": lane_divider,
        "traffic_light": [],
        "lane_connector": [],
        "arcline_path_3": arcline,
        "connectivity": connectivity,
    }


def write_map_expansion(
    dataroot: Path, location: Location, geometry: LocationGeometry, seed: int
) -> Path:
    path = Path(dataroot) / "maps" / "expansion" / f"{location.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(map_expansion(location, geometry, seed), f, separators=(",", ":"))
    return path


def write_semantic_prior(path: Path, location: Location, geometry: LocationGeometry) -> Path:
    """The semantic prior (drivable surface and sidewalks, 255 on 0) at 10 px/m, row 0 at the top
    (max y), as MapMask reads it. The image covers the map origin up to the road grid plus a
    margin."""
    xmin, ymin, xmax, ymax = location.bounds
    res = SEMANTIC_PRIOR_RESOLUTION
    width, height = int(math.ceil((xmax + 50.0) / res)), int(math.ceil((ymax + 50.0) / res))
    mask = np.zeros((height, width), np.uint8)

    def fill(poly: Polygon, value: int):
        for ring, v in [(poly.exterior, value)] + [(h, 0) for h in poly.interiors]:
            xy = np.asarray(ring.coords)
            px = np.stack([xy[:, 0] / res, height - xy[:, 1] / res], axis=1)
            cv2.fillPoly(mask, [np.round(px).astype(np.int32)], v)

    parts = (
        list(geometry.drivable.geoms)
        if hasattr(geometry.drivable, "geoms")
        else [geometry.drivable]
    )
    for p in parts + geometry.walkway:
        fill(p, 255)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(path), mask, [cv2.IMWRITE_PNG_COMPRESSION, 3])
    return path
