"""Camera rendering of the synthetic world through the real intrinsics/extrinsics.

The ground is drawn by intersecting every pixel's ray with the plane z = 0 and sampling a top-down texture
rasterized from the map geometry (asphalt, markings, sidewalks, verges); above the horizon there is sky. Objects
are lit 3-D boxes (per-face shading by the sun, a colour per instance, windows, wheels, clothes...) drawn face by
face into a depth buffer, so occlusion is exact; an object-id buffer gives each annotation's visible fraction.
Shadows of the boxes darken the ground.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import cv2
import numpy as np

from .maps import LocationGeometry
from .rig import Sensor
from .world import SIDEWALK_WIDTH, Location, Scene

# Object kinds: how a box is painted (and what the lidar intensity looks like).
CAR, TRUCK, BUS, MOTORCYCLE, BICYCLE, PEDESTRIAN, CONE, BARRIER, BUILDING = range(9)
KIND_OF_CATEGORY = {
    "vehicle.car": CAR, "vehicle.truck": TRUCK, "vehicle.bus.rigid": BUS, "vehicle.motorcycle": MOTORCYCLE,
    "vehicle.bicycle": BICYCLE, "human.pedestrian.adult": PEDESTRIAN, "human.pedestrian.child": PEDESTRIAN,
    "movable_object.trafficcone": CONE, "movable_object.barrier": BARRIER,
}

# Ground texture classes (also used for lidar intensity).
VERGE, SIDEWALK, CURB, ASPHALT, WHITE, YELLOW = range(6)
GROUND_RGB = np.array([(92, 112, 70), (168, 165, 158), (205, 205, 200), (80, 82, 86), (228, 228, 222),
                       (232, 180, 45)], np.float32)
SKY_HORIZON = np.array([205, 218, 232], np.float32)
SKY_ZENITH = np.array([105, 145, 205], np.float32)
TEXTURE_RESOLUTION = 0.06  # metres per texel
TEXTURE_MARGIN = 120.0  # metres of ground around the route that are textured; fog hides what lies beyond
FOG_DISTANCE = 220.0
NEAR_PLANE = 0.1

# Box faces: corner indices (see box_corners) and the outward normal in the box frame.
_FACES = (
    ((0, 1, 2, 3), (1.0, 0.0, 0.0)),  # front (+x, along the heading)
    ((5, 4, 7, 6), (-1.0, 0.0, 0.0)),  # back
    ((4, 0, 3, 7), (0.0, 1.0, 0.0)),  # left
    ((1, 5, 6, 2), (0.0, -1.0, 0.0)),  # right
    ((4, 5, 1, 0), (0.0, 0.0, 1.0)),  # top
)


@dataclass
class BoxSet:
    """Boxes in the global frame: centre N x 3, size N x 3 (w, l, h), yaw N, colour N x 3 (RGB), kind N,
    agent index N (-1 for buildings)."""

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
        rows.append(((a.x[k], a.y[k], a.z), a.size, a.yaw[k], a.color, KIND_OF_CATEGORY[a.category], i))
    for b in location.buildings:
        if math.hypot(b.x - ex, b.y - ey) - max(b.size) / 2 <= radius:
            rows.append(((b.x, b.y, b.size[2] / 2), b.size, b.yaw, b.color, BUILDING, -1))
    if not rows:
        return BoxSet(np.zeros((0, 3)), np.zeros((0, 3)), np.zeros(0), np.zeros((0, 3)), np.zeros(0, int),
                      np.zeros(0, int))
    center, size, yaw, color, kind, agent = zip(*rows)
    return BoxSet(np.array(center, float), np.array(size, float), np.array(yaw, float), np.array(color, float),
                  np.array(kind, int), np.array(agent, int))


def box_corners(center, size, yaw) -> np.ndarray:
    """8 x 3 corners (global): indices 0-3 front (x = +l/2): top-left, top-right, bottom-right, bottom-left
    seen from the front; 4-7 the same at the back."""
    w, l, h = size
    x = np.array([1, 1, 1, 1, -1, -1, -1, -1]) * l / 2
    y = np.array([1, -1, -1, 1, 1, -1, -1, 1]) * w / 2
    z = np.array([1, 1, -1, -1, 1, 1, -1, -1]) * h / 2
    c, s = math.cos(yaw), math.sin(yaw)
    return np.stack([c * x - s * y, s * x + c * y, z], axis=1) + np.asarray(center)


@dataclass
class GroundTexture:
    """Top-down ground appearance over a rectangle of the location: RGB texture (sharp and blurred for distant
    ground, to avoid aliasing) and the class of every texel. Texel (0, 0) is at (xmin, ymax)."""

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


def build_ground_texture(scene: Scene, geometry: LocationGeometry, seed: int,
                         resolution: float = TEXTURE_RESOLUTION) -> GroundTexture:
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
        return np.round(np.stack([(xy[:, 0] - xmin) / resolution, (ymax - xy[:, 1]) / resolution], 1)
                        * (1 << shift)).astype(np.int32)

    def fill(poly, value):
        cv2.fillPoly(classes, [px(poly.exterior.coords)], value, cv2.LINE_8, shift)
        for hole in poly.interiors:
            cv2.fillPoly(classes, [px(hole.coords)], VERGE, cv2.LINE_8, shift)

    for p in geometry.walkway:
        fill(p, SIDEWALK)
    drivable = list(geometry.drivable.geoms) if hasattr(geometry.drivable, "geoms") else [geometry.drivable]
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
            length = float(np.linalg.norm(b - a))
            u = (b - a) / max(length, 1e-9)
            s = 0.0
            while s < length:
                e = min(s + on, length)
                cv2.polylines(classes, [px(np.stack([a + s * u, a + e * u]))], False, value, thickness,
                              cv2.LINE_8, shift)
                s = e + off
    rgb = GROUND_RGB[classes]
    # Grain everywhere, large blotches on the asphalt and the verges, seams between sidewalk slabs.
    rgb += rng.normal(0.0, 5.0, size=(h, w, 1)).astype(np.float32)
    blotch = cv2.resize(rng.normal(0.0, 1.0, size=(max(2, h // 60), max(2, w // 60))).astype(np.float32), (w, h),
                        interpolation=cv2.INTER_CUBIC)
    rgb += (blotch * np.where(classes == SIDEWALK, 3.0, 7.0).astype(np.float32))[..., None]
    slab = max(1, int(round(1.5 / resolution)))
    seam = np.zeros((h, w), bool)
    seam[:, ::slab] = True
    seam[::slab, :] = True
    rgb[(classes == SIDEWALK) & seam] *= 0.8
    rgb = np.clip(rgb, 0, 255).astype(np.uint8)
    rgb_far = cv2.GaussianBlur(rgb, (0, 0), 2.5)
    return GroundTexture(xmin, ymax, resolution, rgb, rgb_far, classes)


class CameraRays:
    """Per-pixel rays K^-1 [u, v, 1] (camera frame, z = 1) of a camera, pixel centres at integer u, v."""

    def __init__(self, sensor: Sensor):
        w, h = sensor.size
        u, v = np.meshgrid(np.arange(w, dtype=np.float64), np.arange(h, dtype=np.float64))
        pix = np.stack([u, v, np.ones_like(u)], -1)
        self.rays = (pix @ np.linalg.inv(sensor.intrinsic).T).astype(np.float32)  # H x W x 3
        self.sensor = sensor


def _clip_near(poly: np.ndarray, near: float = NEAR_PLANE) -> np.ndarray:
    """Clip a convex polygon (M x 3, camera frame) to z >= near. Returns K x 3 (K may be 0)."""
    out = []
    n = len(poly)
    for i in range(n):
        a, b = poly[i], poly[(i + 1) % n]
        ina, inb = a[2] >= near, b[2] >= near
        if ina:
            out.append(a)
        if ina != inb:
            t = (near - a[2]) / (b[2] - a[2])
            out.append(a + t * (b - a))
    return np.array(out).reshape(-1, 3)


def _project(points_cam: np.ndarray, k: np.ndarray) -> np.ndarray:
    uvw = points_cam @ k.T
    return uvw[:, :2] / uvw[:, 2:3]


def _paint(kind: int, face: int, s: np.ndarray, t: np.ndarray, base: np.ndarray, size) -> np.ndarray:
    """Face colour (N x 3) from the face-local coordinates s (across the face, 0..1) and t (height, 0..1)."""
    rgb = np.broadcast_to(base, (len(s), 3)).copy()
    side = face in (2, 3)
    if kind in (CAR, TRUCK, BUS):
        if face == 4:
            return rgb
        low, high = (0.62, 0.9) if kind == CAR else ((0.45, 0.85) if kind == BUS else (0.65, 0.9))
        glass = (t > low) & (t < high) & (s > 0.06) & (s < 0.94)
        if kind == TRUCK and side:  # only the cab (front 25 %) has side windows
            front_end = s > 0.75 if face == 3 else s < 0.25
            glass &= front_end
        rgb[glass] = (45, 55, 68) + 0.15 * rgb[glass]
        if side:
            wheel = (t < 0.3) & ((np.abs(s - 0.18) < 0.08) | (np.abs(s - 0.82) < 0.08))
            rgb[wheel] = (22, 22, 24)
        elif kind == CAR or kind == TRUCK:
            lamp = (t > 0.3) & (t < 0.42) & ((s < 0.18) | (s > 0.82))
            rgb[lamp] = (250, 245, 215) if face == 0 else (200, 25, 20)
        return rgb
    if kind in (MOTORCYCLE, BICYCLE):
        dark = t < (0.5 if kind == BICYCLE else 0.35)
        rgb[dark] = (28, 28, 30)
        return rgb
    if kind == PEDESTRIAN:
        rgb[t > 0.86] = (215, 175, 145)
        rgb[t < 0.46] = (45, 50, 75)
        return rgb
    if kind == CONE:
        rgb[(t > 0.45) & (t < 0.65)] = (240, 240, 240)
        return rgb
    if kind == BARRIER:
        if face != 4:
            stripe = (np.floor(s * 6) % 2 == 0) & (t > 0.4)
            rgb[stripe] = (210, 35, 30)
        return rgb
    # Buildings: a grid of windows (floors every 3.2 m, bays every 3 m), a darker roof.
    if face == 4:
        return rgb * 0.7
    across = size[1] if side else size[0]
    hm = (t * size[2]) % 3.2
    am = (s * across) % 3.0
    window = (hm > 1.0) & (hm < 2.4) & (am > 0.6) & (am < 2.2) & (t * size[2] > 0.5)
    rgb[window] = (62, 74, 92)
    return rgb


def render_camera(rays: CameraRays, rot: np.ndarray, pos: np.ndarray, boxes: BoxSet, texture: GroundTexture,
                  sun, rng: np.random.Generator | None = None):
    """Render one camera whose frame maps to the global frame by (rot, pos).

    Returns (image H x W x 3 uint8 RGB, ids H x W int32 (box index or -1), visible pixels per box N,
    projected (unoccluded) pixels per box N).
    """
    sensor = rays.sensor
    w, h = sensor.size
    k = sensor.intrinsic
    r_cam = rays.rays
    sun = np.asarray(sun, np.float64)

    # Ground and sky.
    d_global = r_cam @ rot.T.astype(np.float32)  # H x W x 3, not normalized (camera z = 1)
    dz = d_global[..., 2]
    ground = dz < -1e-6
    t_ground = np.where(ground, -pos[2] / np.where(ground, dz, -1.0), np.inf).astype(np.float32)
    gx = pos[0] + t_ground * d_global[..., 0]
    gy = pos[1] + t_ground * d_global[..., 1]
    col, row = texture.texel(gx, gy)
    col = np.where(ground, col, -10.0).astype(np.float32)
    row = np.where(ground, row, -10.0).astype(np.float32)
    border = tuple(float(v) for v in GROUND_RGB[VERGE])
    near_rgb = cv2.remap(texture.rgb, col, row, cv2.INTER_LINEAR, borderMode=cv2.BORDER_CONSTANT,
                         borderValue=border).astype(np.float32)
    far_rgb = cv2.remap(texture.rgb_far, col, row, cv2.INTER_LINEAR, borderMode=cv2.BORDER_CONSTANT,
                        borderValue=border).astype(np.float32)
    norm = np.linalg.norm(d_global, axis=-1)
    dist = t_ground * norm
    blend = np.clip((dist - 15.0) / 25.0, 0.0, 1.0)[..., None]
    img = near_rgb * (1 - blend) + far_rgb * blend
    elevation = np.clip(dz / norm, -1.0, 1.0)[..., None]
    sky = SKY_HORIZON + (SKY_ZENITH - SKY_HORIZON) * np.sqrt(np.clip(elevation, 0.0, 1.0))
    fog = np.where(ground, 1.0 - np.exp(-np.where(ground, dist, 0.0) / FOG_DISTANCE), 1.0)[..., None]
    img = img * (1 - fog) + SKY_HORIZON * fog
    img = np.where(ground[..., None], img, sky)
    depth = t_ground.copy()  # camera-frame z of what each pixel shows
    ids = np.full((h, w), -1, np.int32)

    n = len(boxes)
    visible = np.zeros(n, np.int64)
    projected = np.zeros(n, np.int64)
    if n:
        _draw_shadows(img, ground, depth, boxes, rot, pos, k, sun)
        _draw_boxes(img, depth, ids, projected, boxes, rot, pos, k, r_cam, sun, w, h)
        hit = ids[ids >= 0]
        visible = np.bincount(hit, minlength=n).astype(np.int64)
    if rng is not None:
        img = img + rng.normal(0.0, 2.0, size=img.shape).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8), ids, visible, projected


def _to_camera(points: np.ndarray, rot: np.ndarray, pos: np.ndarray) -> np.ndarray:
    return (points - pos) @ rot


def _draw_shadows(img, ground, depth, boxes: BoxSet, rot, pos, k, sun):
    """Darken the ground inside each box's shadow (its corners projected along the sun onto z = 0)."""
    h, w = ground.shape
    mask = np.zeros((h, w), np.uint8)
    shift = 4
    for i in range(len(boxes)):
        corners = box_corners(boxes.center[i], boxes.size[i], boxes.yaw[i])
        flat = corners - sun[None, :] * (corners[:, 2:3] / sun[2])
        hull = cv2.convexHull(np.round(flat[:, :2] * 100).astype(np.int64).astype(np.float32)).reshape(-1, 2) / 100
        poly = np.concatenate([hull, np.zeros((len(hull), 1))], 1)
        cam = _clip_near(_to_camera(poly, rot, pos))
        if len(cam) < 3:
            continue
        uv = _project(cam, k)
        if uv[:, 0].max() < 0 or uv[:, 1].max() < 0 or uv[:, 0].min() >= w or uv[:, 1].min() >= h:
            continue
        uv = np.clip(uv, -1e5, 1e5)
        cv2.fillConvexPoly(mask, np.round(uv * (1 << shift)).astype(np.int32), 1, cv2.LINE_8, shift)
    shade = (mask > 0) & ground
    img[shade] *= 0.6


def _draw_boxes(img, depth, ids, projected, boxes: BoxSet, rot, pos, k, r_cam, sun, w, h):
    shift = 4
    for i in range(len(boxes)):
        center, size, yaw = boxes.center[i], boxes.size[i], boxes.yaw[i]
        corners = box_corners(center, size, yaw)
        cam = _to_camera(corners, rot, pos)
        if cam[:, 2].max() < NEAR_PLANE:
            continue
        c, s = math.cos(yaw), math.sin(yaw)
        box_rot = np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])  # box -> global
        # Camera point -> box frame: p_box = box_rot^T (rot p_cam + pos - center).
        cam_to_box = box_rot.T @ rot
        offset = box_rot.T @ (pos - center)
        for f, (idx, normal) in enumerate(_FACES):
            n_global = box_rot @ np.asarray(normal)
            face_center = corners[list(idx)].mean(0)
            if np.dot(n_global, pos - face_center) <= 0:
                continue  # facing away
            poly = _clip_near(cam[list(idx)])
            if len(poly) < 3:
                continue
            uv = _project(poly, k)
            x0, y0 = np.floor(uv.min(0)).astype(np.int64)
            x1, y1 = np.ceil(uv.max(0)).astype(np.int64)
            x0, y0, x1, y1 = max(x0, 0), max(y0, 0), min(x1, w - 1), min(y1, h - 1)
            if x1 < x0 or y1 < y0:
                continue
            mask = np.zeros((y1 - y0 + 1, x1 - x0 + 1), np.uint8)
            local = np.clip(uv - (x0, y0), -1e5, 1e5)
            cv2.fillConvexPoly(mask, np.round(local * (1 << shift)).astype(np.int32), 1, cv2.LINE_8, shift)
            rr, cc = np.nonzero(mask)
            if len(rr) == 0:
                continue
            projected[i] += len(rr)
            rr += y0
            cc += x0
            ray = r_cam[rr, cc].astype(np.float64)  # M x 3
            n_cam = rot.T @ n_global
            z = np.dot(n_cam, poly[0]) / (ray @ n_cam)
            closer = (z > 0) & (z < depth[rr, cc])
            if not closer.any():
                continue
            rr, cc, z, ray = rr[closer], cc[closer], z[closer], ray[closer]
            p_box = (ray * z[:, None]) @ cam_to_box.T + offset
            half = np.asarray([size[1], size[0], size[2]]) / 2  # x: l, y: w, z: h
            t = (p_box[:, 2] + half[2]) / size[2]
            if f in (0, 1):
                u = (p_box[:, 1] + half[1]) / size[0]
                u = 1 - u if f == 0 else u
            elif f in (2, 3):
                u = (p_box[:, 0] + half[0]) / size[1]
                u = 1 - u if f == 2 else u
            else:
                u = (p_box[:, 0] + half[0]) / size[1]
            rgb = _paint(int(boxes.kind[i]), f, np.clip(u, 0, 1), np.clip(t, 0, 1), boxes.color[i], size)
            shade = 0.5 + 0.55 * max(0.0, float(np.dot(n_global, sun)))
            img[rr, cc] = rgb * shade
            depth[rr, cc] = z
            ids[rr, cc] = i
