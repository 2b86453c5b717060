"""A 32-beam spinning lidar (like the nuScenes Velodyne HDL-32E) ray-cast against the ground plane
and the boxes.

Points are written as nuScenes does (samples/LIDAR_TOP/*.pcd.bin): float32 x, y, z (sensor frame),
intensity, ring index.
"""

from __future__ import annotations

import math

import numpy as np

from .reproducible import matmul
from .scenery import (
    ASPHALT,
    BARRIER,
    BICYCLE,
    BUILDING,
    BUS,
    CAR,
    CONE,
    CURB,
    MOTORCYCLE,
    PEDESTRIAN,
    SIDEWALK,
    TRUCK,
    VERGE,
    WHITE,
    YELLOW,
    BoxSet,
    GroundTexture,
)

BEAMS = 32
ELEVATION_DEG = np.linspace(-30.67, 10.67, BEAMS)
AZIMUTH_STEPS = 1084  # about 0.33 degrees, ~35k rays per sweep as in nuScenes
MAX_RANGE = 100.0
MIN_RANGE = 1.0
# Mean reflectivity by ground class and by box kind (indexed by the constants of scenery.py).
GROUND_INTENSITY = np.zeros(6)
GROUND_INTENSITY[[VERGE, SIDEWALK, CURB, ASPHALT, WHITE, YELLOW]] = (
    8.0,
    22.0,
    30.0,
    6.0,
    70.0,
    55.0,
)
BOX_INTENSITY = np.zeros(9)
BOX_INTENSITY[[CAR, TRUCK, BUS, MOTORCYCLE, BICYCLE, PEDESTRIAN, CONE, BARRIER, BUILDING]] = (
    35.0,
    30.0,
    30.0,
    25.0,
    20.0,
    12.0,
    60.0,
    45.0,
    18.0,
)


def beam_directions() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unit ray directions in the lidar frame, BEAMS x AZIMUTH_STEPS x 3, with their azimuths
    (radians, per column) and ring indices (per row)."""
    el = np.radians(ELEVATION_DEG)[:, None]
    az = np.linspace(-math.pi, math.pi, AZIMUTH_STEPS, endpoint=False)[None, :]
    d = np.stack(
        [
            np.cos(el) * np.cos(az),
            np.cos(el) * np.sin(az),
            np.broadcast_to(np.sin(el), (BEAMS, AZIMUTH_STEPS)),
        ],
        -1,
    )
    return d, az[0], np.arange(BEAMS)


def sweep(
    rot: np.ndarray,
    pos: np.ndarray,
    boxes: BoxSet,
    texture: GroundTexture,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """Cast one sweep from a lidar whose frame maps to global by (rot, pos).

    Returns (points P x 5 float32 [x, y, z, intensity, ring] in the lidar frame, box index per point
    P (-1 for ground))."""
    d_lidar, az, rings = beam_directions()
    d = matmul(d_lidar, rot.T)  # B x A x 3 global
    rng_t = np.full(d.shape[:2], np.inf)
    hit = np.full(d.shape[:2], -1, np.int64)
    down = d[..., 2] < -1e-6
    rng_t[down] = -pos[2] / d[..., 2][down]

    # Boxes: slab test in each box's frame, on the azimuth columns its corners span.
    lidar_yaw = math.atan2(rot[1, 0], rot[0, 0])
    for i in range(len(boxes)):
        c, size, yaw = boxes.center[i], boxes.size[i], boxes.yaw[i]
        rel = c - pos
        dist = math.hypot(rel[0], rel[1])
        reach = 0.5 * math.hypot(size[0], size[1])
        if dist - reach > MAX_RANGE:
            continue
        if dist <= reach:
            cols = np.arange(AZIMUTH_STEPS)
        else:
            centre_az = math.atan2(rel[1], rel[0]) - lidar_yaw
            half = math.asin(min(1.0, reach / dist))
            step = 2 * math.pi / AZIMUTH_STEPS
            lo = int(math.floor((centre_az - half + math.pi) / step))
            hi = int(math.ceil((centre_az + half + math.pi) / step))
            cols = np.arange(lo, hi + 1) % AZIMUTH_STEPS
        cy, sy = math.cos(yaw), math.sin(yaw)
        to_box = np.array([[cy, sy, 0.0], [-sy, cy, 0.0], [0.0, 0.0, 1.0]])
        o = matmul(to_box, pos - c)
        dd = matmul(d[:, cols], to_box.T)
        half_ext = np.array([size[1], size[0], size[2]]) / 2
        with np.errstate(divide="ignore", invalid="ignore"):
            t1 = (-half_ext - o) / dd
            t2 = (half_ext - o) / dd
        tmin = np.nanmax(np.minimum(t1, t2), axis=-1)
        tmax = np.nanmin(np.maximum(t1, t2), axis=-1)
        ok = (tmax >= np.maximum(tmin, 0.0)) & (tmin > 0)
        cur = rng_t[:, cols]
        better = ok & (tmin < cur)
        if better.any():
            sub_t = np.where(better, tmin, cur)
            sub_h = np.where(better, i, hit[:, cols])
            rng_t[:, cols] = sub_t
            hit[:, cols] = sub_h

    keep = (rng_t >= MIN_RANGE) & (rng_t <= MAX_RANGE) & (rng.random(rng_t.shape) > 0.02)
    r = rng_t[keep] + rng.normal(0.0, 0.02, size=int(keep.sum()))
    ids = hit[keep]
    pts = d_lidar[keep] * r[:, None]
    ring = np.broadcast_to(rings[:, None], keep.shape)[keep]
    world = pos + (d[keep] * r[:, None])
    intensity = np.empty(len(r))
    on_ground = ids < 0
    intensity[on_ground] = GROUND_INTENSITY[
        texture.class_at(world[on_ground, 0], world[on_ground, 1])
    ]
    intensity[~on_ground] = BOX_INTENSITY[boxes.kind[ids[~on_ground]]]
    intensity = np.clip(
        intensity * rng.uniform(0.7, 1.3, size=len(r)) / np.maximum(r / 20.0, 1.0) ** 0.5, 0, 255
    )
    out = np.concatenate([pts, intensity[:, None], ring[:, None]], axis=1).astype(np.float32)
    return out, ids
