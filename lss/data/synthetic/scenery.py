"""The synthetic world as the sensors see it, shared by the cameras (render.py) and the lidar
(lidar.py): the boxes of a key frame (annotated agents and buildings, each with a kind that says
how it is painted and how it reflects) and the top-down ground texture rasterized from the map
geometry (asphalt, markings, sidewalks, verges), whose texel classes also set lidar intensity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cv2
import numpy as np

from .maps import LocationGeometry
from .reproducible import matmul, matvec, norm, resize_cubic
from .roads import Location
from .world import Scene

# Object kinds: how a box is painted (and what the lidar intensity looks like).
CAR, TRUCK, BUS, MOTORCYCLE, BICYCLE, PEDESTRIAN, CONE, BARRIER, BUILDING = range(9)
KIND_OF_CATEGORY = {
    "vehicle.car": CAR,
    "vehicle.truck": TRUCK,
    "vehicle.bus.rigid": BUS,
    "vehicle.motorcycle": MOTORCYCLE,
    "vehicle.bicycle": BICYCLE,
    "human.pedestrian.adult": PEDESTRIAN,
    "human.pedestrian.child": PEDESTRIAN,
    "movable_object.trafficcone": CONE,
    "movable_object.barrier": BARRIER,
}

# Ground texture classes (also used for lidar intensity).
VERGE, SIDEWALK, CURB, ASPHALT, WHITE, YELLOW = range(6)
GROUND_RGB = np.array(
    [
        (92, 112, 70),
        (168, 165, 158),
        (205, 205, 200),
        (80, 82, 86),
        (228, 228, 222),
        (232, 180, 45),
    ],
    np.float32,
)
TEXTURE_RESOLUTION = 0.06  # metres per texel
# Metres of ground around the route that are textured; fog hides what lies beyond.
TEXTURE_MARGIN = 120.0


@dataclass
class BoxSet:
    """Boxes in the global frame: centre N x 3, size N x 3 (w, l, h), yaw N, colour N x 3 (RGB),
    kind N, agent index N (-1 for buildings)."""

    center: np.ndarray
    size: np.ndarray
    yaw: np.ndarray
    color: np.ndarray
    kind: np.ndarray
    agent: np.ndarray

    def __len__(self) -> int:
        return len(self.yaw)


def scene_boxes(scene: Scene, location: Location, k: int, radius: float = 160.0) -> BoxSet:
    """The annotated agents of key frame k plus the buildings within `radius` of the ego."""
    rows = []
    ex, ey = scene.ego_x[k], scene.ego_y[k]
    for i in scene.visible_agents(k):
        a = scene.agents[i]
        rows.append(
            ((a.x[k], a.y[k], a.z), a.size, a.yaw[k], a.color, KIND_OF_CATEGORY[a.category], i)
        )
    for b in location.buildings:
        if math.hypot(b.x - ex, b.y - ey) - max(b.size) / 2 <= radius:
            rows.append(((b.x, b.y, b.size[2] / 2), b.size, b.yaw, b.color, BUILDING, -1))
    if not rows:
        return BoxSet(
            np.zeros((0, 3)),
            np.zeros((0, 3)),
            np.zeros(0),
            np.zeros((0, 3)),
            np.zeros(0, int),
            np.zeros(0, int),
        )
    center, size, yaw, color, kind, agent = zip(*rows)
    return BoxSet(
        np.array(center, float),
        np.array(size, float),
        np.array(yaw, float),
        np.array(color, float),
        np.array(kind, int),
        np.array(agent, int),
    )


def yaw_matrix(yaw: float) -> np.ndarray:
    c, s = math.cos(yaw), math.sin(yaw)
    return np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])


def box_corners(center, size, yaw) -> np.ndarray:
    """8 x 3 corners (global) of a box with size (w, l, h): the bottom four, then the top four."""
    w, l, h = size
    x = np.array([1, 1, -1, -1, 1, 1, -1, -1]) * l / 2
    y = np.array([1, -1, -1, 1, 1, -1, -1, 1]) * w / 2
    z = np.array([-1, -1, -1, -1, 1, 1, 1, 1]) * h / 2
    return matmul(np.stack([x, y, z], axis=1), yaw_matrix(yaw).T) + np.asarray(center)


def yaw_matrices(yaws) -> np.ndarray:
    """yaw_matrix of every yaw: N x 3 x 3."""
    c = np.array([math.cos(y) for y in np.asarray(yaws, np.float64).tolist()])
    s = np.array([math.sin(y) for y in np.asarray(yaws, np.float64).tolist()])
    zero, one = np.zeros_like(c), np.ones_like(c)
    return np.stack([c, -s, zero, s, c, zero, zero, zero, one], -1).reshape(-1, 3, 3)


def boxes_corners(boxes: "BoxSet") -> np.ndarray:
    """box_corners of every box: N x 8 x 3."""
    w, l, h = boxes.size[:, 0:1], boxes.size[:, 1:2], boxes.size[:, 2:3]
    x = np.array([1, 1, -1, -1, 1, 1, -1, -1]) * l / 2
    y = np.array([1, -1, -1, 1, 1, -1, -1, 1]) * w / 2
    z = np.array([-1, -1, -1, -1, 1, 1, 1, 1]) * h / 2
    local = np.stack([x, y, z], -1)
    return matvec(yaw_matrices(boxes.yaw)[:, None], local) + boxes.center[:, None]


@dataclass
class GroundTexture:
    """Top-down ground appearance over a rectangle of the location: RGB texture (sharp and blurred
    for distant ground, to avoid aliasing) and the class of every texel. Texel (0, 0) is at (xmin,
    ymax)."""

    xmin: float
    ymax: float
    resolution: float
    rgb: np.ndarray
    rgb_far: np.ndarray
    classes: np.ndarray

    def texel(self, x, y):
        """Continuous texel coordinates (column, row) of global x, y."""
        return (x - self.xmin) / self.resolution, (self.ymax - y) / self.resolution

    def class_at(self, x, y) -> np.ndarray:
        col, row = self.texel(np.asarray(x), np.asarray(y))
        col = np.clip(np.round(col).astype(np.int64), 0, self.classes.shape[1] - 1)
        row = np.clip(np.round(row).astype(np.int64), 0, self.classes.shape[0] - 1)
        return self.classes[row, col]


def build_ground_texture(
    scene: Scene, geometry: LocationGeometry, seed: int, resolution: float = TEXTURE_RESOLUTION
) -> GroundTexture:
    """Rasterize the map geometry around the scene's route into a textured ground image."""
    rng = np.random.default_rng(seed)
    xmin = float(min(scene.ego_x.min(), scene.ego_x.max())) - TEXTURE_MARGIN
    xmax = float(scene.ego_x.max()) + TEXTURE_MARGIN
    ymin = float(scene.ego_y.min()) - TEXTURE_MARGIN
    ymax = float(scene.ego_y.max()) + TEXTURE_MARGIN
    w, h = int(math.ceil((xmax - xmin) / resolution)), int(math.ceil((ymax - ymin) / resolution))
    classes = np.full((h, w), VERGE, np.uint8)
    shift = 3

    def px(coords) -> np.ndarray:
        xy = np.asarray(coords, np.float64)[:, :2]
        return np.round(
            np.stack([(xy[:, 0] - xmin) / resolution, (ymax - xy[:, 1]) / resolution], 1)
            * (1 << shift)
        ).astype(np.int32)

    def fill(poly, value):
        cv2.fillPoly(classes, [px(poly.exterior.coords)], value, cv2.LINE_8, shift)
        for hole in poly.interiors:
            cv2.fillPoly(classes, [px(hole.coords)], VERGE, cv2.LINE_8, shift)

    for p in geometry.walkway:
        fill(p, SIDEWALK)
    drivable = (
        list(geometry.drivable.geoms)
        if hasattr(geometry.drivable, "geoms")
        else [geometry.drivable]
    )
    curb = max(1, int(round(0.25 / resolution)))
    for p in drivable:
        fill(p, ASPHALT)
    for p in drivable:
        for ring in [p.exterior] + list(p.interiors):
            cv2.polylines(classes, [px(ring.coords)], True, CURB, curb, cv2.LINE_8, shift)
    for m in geometry.markings:
        value = WHITE if m.color == "white" else YELLOW
        thickness = max(1, int(round(m.width / resolution)))
        pts = m.points
        if m.dash is None:
            cv2.polylines(classes, [px(pts)], False, value, thickness, cv2.LINE_8, shift)
            continue
        on, off = m.dash
        for a, b in zip(pts[:-1], pts[1:]):
            length = norm(b - a)
            u = (b - a) / max(length, 1e-9)
            s = 0.0
            while s < length:
                e = min(s + on, length)
                cv2.polylines(
                    classes,
                    [px(np.stack([a + s * u, a + e * u]))],
                    False,
                    value,
                    thickness,
                    cv2.LINE_8,
                    shift,
                )
                s = e + off
    # Grain from a tiled noise patch, large blotches, and seams between sidewalk slabs (integer
    # maths: the texture has tens of millions of texels).
    tile = rng.normal(0.0, 5.0, size=(256, 256)).astype(np.int16)
    grain = np.tile(tile, (h // 256 + 1, w // 256 + 1))[:h, :w]
    blotch = resize_cubic(
        rng.normal(0.0, 6.0, size=(max(2, h // 60), max(2, w // 60))).astype(np.float32),
        (w, h),
        np.int16,
    )
    slab = max(1, int(round(1.5 / resolution)))
    seam = np.zeros((h, w), bool)
    seam[:, ::slab] = True
    seam[::slab, :] = True
    offset = grain + blotch
    offset[(classes == SIDEWALK) & seam] -= 30
    lut = GROUND_RGB.astype(np.int16)
    rgb = np.empty((h, w, 3), np.uint8)
    for c in range(3):
        rgb[..., c] = np.clip(lut[classes, c] + offset, 0, 255)
    rgb_far = cv2.GaussianBlur(rgb, (0, 0), 2.5)
    return GroundTexture(xmin, ymax, resolution, rgb, rgb_far, classes)
