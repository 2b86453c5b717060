"""A synthetic scene: the ego driving along one lane of one road of a location (roads.py), with
moving, stopped and parked vehicles, walking pedestrians, parked bicycles and traffic cones /
barriers around it, sampled at the key frames.

Everything lives in the global frame of the location (metres, x east, y north, z up, ground at
z = 0), as in nuScenes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lss.geometry.ego_motion import KEY_FRAME_INTERVAL

from .reproducible import dot
from .roads import (
    CROSSING_DEPTH,
    CROSSING_GAP,
    SIDEWALK_WIDTH,
    STOP_LINE_GAP,
    Location,
    Road,
    stable_seed,
)

SAMPLE_PERIOD = KEY_FRAME_INTERVAL  # key frames at 2 Hz, as nuScenes'
ANNOTATION_RANGE = 80.0  # objects closer than this to the ego are annotated (and rendered)


# Categories: sizes (w, l, h) ranges and colour palettes (RGB) of the instances we place.
VEHICLE_COLORS = [
    (200, 30, 30),
    (30, 60, 190),
    (235, 235, 235),
    (170, 175, 180),
    (60, 62, 68),
    (230, 190, 20),
    (30, 140, 60),
    (120, 30, 140),
    (20, 160, 190),
    (240, 120, 20),
]
SHIRT_COLORS = [
    (220, 40, 40),
    (40, 90, 220),
    (240, 200, 30),
    (40, 170, 80),
    (240, 240, 240),
    (200, 60, 170),
    (250, 130, 30),
]
SIZES = {
    "vehicle.car": ((1.7, 2.0), (4.0, 4.9), (1.45, 1.75)),
    "vehicle.truck": ((2.3, 2.6), (6.0, 9.0), (2.6, 3.4)),
    "vehicle.bus.rigid": ((2.6, 2.9), (10.0, 12.5), (3.0, 3.5)),
    "vehicle.motorcycle": ((0.7, 0.9), (1.9, 2.2), (1.35, 1.55)),
    "vehicle.bicycle": ((0.5, 0.7), (1.6, 1.8), (1.0, 1.2)),
    "human.pedestrian.adult": ((0.55, 0.75), (0.6, 0.9), (1.55, 1.9)),
    "human.pedestrian.child": ((0.45, 0.55), (0.45, 0.6), (1.05, 1.35)),
    "movable_object.barrier": ((0.4, 0.5), (1.8, 2.4), (0.9, 1.1)),
    "movable_object.trafficcone": ((0.35, 0.45), (0.35, 0.45), (0.65, 0.8)),
}


@dataclass
class Agent:
    """One annotated object over the scene's key frames (arrays of length T, global frame)."""

    category: str
    size: tuple[float, float, float]  # w, l, h
    color: tuple[int, int, int]
    x: np.ndarray
    y: np.ndarray
    yaw: np.ndarray
    attribute: list  # per key frame: attribute name or None

    @property
    def z(self) -> float:
        return self.size[2] / 2


@dataclass
class Scene:
    """One scene: the ego route and the agents, sampled at the key frames."""

    index: int
    name: str
    location: str
    ego_x: np.ndarray
    ego_y: np.ndarray
    ego_yaw: np.ndarray
    agents: list[Agent]
    sun: tuple[float, float, float]  # unit vector towards the sun (global)

    @property
    def num_samples(self) -> int:
        return len(self.ego_x)

    def visible_agents(self, k: int) -> list[int]:
        """Indices of agents within annotation range of the ego at key frame k."""
        out = []
        for i, a in enumerate(self.agents):
            if math.hypot(a.x[k] - self.ego_x[k], a.y[k] - self.ego_y[k]) <= ANNOTATION_RANGE:
                out.append(i)
        return out


def _size(rng, category):
    return tuple(float(rng.uniform(lo, hi)) for lo, hi in SIZES[category])


def build_scene(index: int, name: str, location: Location, num_samples: int, seed: int) -> Scene:
    """The ego drives one lane of one road at 4-9 m/s; traffic fills the road, vehicles wait on the
    crossing roads, cars park on the shoulders, pedestrians walk the sidewalks."""
    rng = np.random.default_rng(stable_seed("scene", name, seed))
    t = np.arange(num_samples) * SAMPLE_PERIOD
    duration = float(t[-1])
    side = location.drive_side
    road = location.roads[int(rng.integers(len(location.roads)))]
    direction = int(rng.choice([-1, 1]))
    lane = int(rng.integers(road.lanes))
    speed = float(rng.uniform(4.0, 9.0))
    usable = road.length - 2 * 60.0
    speed = min(speed, usable / max(duration, 1e-6))
    travel = speed * duration
    s_start = float(rng.uniform(60.0, 60.0 + usable - travel))
    if direction < 0:
        s_start = road.length - s_start
    # A slight, smooth speed variation; the amplitude (< 1 m) keeps followers clear.
    ego_s = s_start + direction * (speed * t + 0.8 * np.sin(2 * math.pi * t / 9.0))
    lateral = road.lane_offset(direction, lane, side)
    ego_xy = road.point(ego_s, np.full_like(ego_s, lateral))
    ego_yaw = np.full(num_samples, road.heading if direction > 0 else road.heading + math.pi)
    s_lo, s_hi = min(ego_s[0], ego_s[-1]), max(ego_s[0], ego_s[-1])

    agents: list[Agent] = []
    yaw_of = {1: road.heading, -1: road.heading + math.pi}

    def add_track(category, size, color, s, lat, rd, yaw, attrs):
        if category == "vehicle.motorcycle":
            # nuScenes gives cycles the rider attribute, never vehicle.moving/stopped (the detection
            # metric's AAE)
            attrs = ["cycle.with_rider"] * len(attrs)
        xy = rd.point(s, lat)
        agents.append(
            Agent(
                category,
                size,
                color,
                xy[..., 0],
                xy[..., 1],
                np.broadcast_to(yaw, t.shape).copy(),
                attrs,
            )
        )

    def vehicle_category():
        return str(
            rng.choice(
                ["vehicle.car"] * 14
                + ["vehicle.truck"] * 2
                + ["vehicle.bus.rigid", "vehicle.motorcycle"]
            )
        )

    # Moving traffic on the ego road, one speed per lane so that no vehicle runs into another.
    for d in (-1, 1):
        for ln in range(road.lanes):
            lat = road.lane_offset(d, ln, side)
            ego_lane = d == direction and ln == lane
            v = (
                speed
                if ego_lane
                else (speed * rng.uniform(0.7, 1.3) if d == direction else rng.uniform(5.0, 12.0))
            )
            # Positions at t = 0 covering whatever comes within range during the scene.
            reach = ANNOTATION_RANGE + v * duration + 20.0
            s = s_lo - reach - 20.0 if d > 0 else s_hi + reach + 20.0
            end = s_hi + ANNOTATION_RANGE + 20.0 if d > 0 else s_lo - ANNOTATION_RANGE - 20.0
            prev_half = 0.0
            while (s < end) if d > 0 else (s > end):
                cat = vehicle_category()
                size = _size(rng, cat)
                gap = rng.uniform(8.0, 45.0)
                s += d * (prev_half + gap + size[1] / 2)
                prev_half = size[1] / 2
                track = s + d * v * t
                if ego_lane and np.min(np.abs(track - ego_s)) < size[1] / 2 + 2.6 + 6.0:
                    continue
                if np.any((track < 0) | (track > road.length)):
                    continue
                color = VEHICLE_COLORS[int(rng.integers(len(VEHICLE_COLORS)))]
                add_track(
                    cat,
                    size,
                    color,
                    track,
                    np.full_like(track, lat),
                    road,
                    yaw_of[d],
                    ["vehicle.moving"] * num_samples,
                )

    # Roads of the location near the route: crossing roads get queues and parked cars, all get
    # parking.
    route_xy = np.stack([ego_xy[0], ego_xy[-1]])
    near_lo = route_xy.min(0) - ANNOTATION_RANGE - 10.0
    near_hi = route_xy.max(0) + ANNOTATION_RANGE + 10.0

    def s_window(rd):
        """Range of s along `rd` inside the neighbourhood box of the route, or None."""
        ts = []
        for axis in range(2):
            if abs(rd.direction[axis]) > 0.5:
                a = (near_lo[axis] - rd.start[axis]) / rd.direction[axis]
                b = (near_hi[axis] - rd.start[axis]) / rd.direction[axis]
                ts = [max(0.0, min(a, b)), min(rd.length, max(a, b))]
            elif not (near_lo[axis] <= rd.start[axis] <= near_hi[axis]):
                return None
        return ts if ts and ts[1] > ts[0] else None

    for rd in location.roads:
        window = s_window(rd)
        if window is None:
            continue
        crossing = rd is not road
        if crossing:
            # Vehicles stopped before each intersection with the ego road, in the incoming lanes.
            for st, hw in rd.stations:
                if not (window[0] - 5 <= st <= window[1] + 5):
                    continue
                pos = rd.point(st, 0.0)
                if abs(dot(pos - road.start, road.left)) > 1.0:
                    continue
                for d in (-1, 1):
                    for ln in range(rd.lanes):
                        s = st - d * (hw + CROSSING_GAP + CROSSING_DEPTH + STOP_LINE_GAP + 1.0)
                        for _ in range(int(rng.integers(0, 4))):
                            cat = vehicle_category()
                            size = _size(rng, cat)
                            s -= d * size[1] / 2
                            color = VEHICLE_COLORS[int(rng.integers(len(VEHICLE_COLORS)))]
                            add_track(
                                cat,
                                size,
                                color,
                                np.full(t.shape, s),
                                np.full(t.shape, rd.lane_offset(d, ln, side)),
                                rd,
                                yaw_of_road(rd, d),
                                ["vehicle.stopped"] * num_samples,
                            )
                            s -= d * (size[1] / 2 + rng.uniform(1.5, 3.0))
        _place_roadside(rng, rd, window, t, side, agents, num_samples)

    _place_pedestrians(
        rng, location, road, window_of=s_window, t=t, agents=agents, num_samples=num_samples
    )

    # Keep only agents that come within range of the ego at some key frame.
    keep = []
    for a in agents:
        dist = np.hypot(a.x - ego_xy[:, 0], a.y - ego_xy[:, 1])
        if np.any(dist <= ANNOTATION_RANGE):
            keep.append(a)
    az = rng.uniform(0, 2 * math.pi)
    el = rng.uniform(math.radians(30), math.radians(65))
    sun = (math.cos(el) * math.cos(az), math.cos(el) * math.sin(az), math.sin(el))
    return Scene(index, name, location.name, ego_xy[:, 0], ego_xy[:, 1], ego_yaw, keep, sun)


def yaw_of_road(rd: Road, d: int) -> float:
    return rd.heading if d > 0 else rd.heading + math.pi


def _in_section(rd: Road, s0: float, s1: float, margin: float):
    """Yields (a, b) free stretches of s of the road's sections, `margin` away from
    intersections/crossings."""
    for a, b, at_start, at_end in rd.sections():
        lo = a + (CROSSING_GAP + CROSSING_DEPTH + STOP_LINE_GAP + margin if at_start else margin)
        hi = b - (CROSSING_GAP + CROSSING_DEPTH + STOP_LINE_GAP + margin if at_end else margin)
        lo, hi = max(lo, s0), min(hi, s1)
        if hi - lo > 3.0:
            yield lo, hi


def _place_roadside(rng, rd: Road, window, t, side, agents, num_samples):
    """Parked cars, cone rows and barriers on the parking shoulders of `rd`; parked bicycles on the
    sidewalk."""
    for lat_sign in (-1, 1):
        if rd.parking > 0:
            lat = lat_sign * (rd.lane_half_width + rd.parking / 2)
            d = -side * lat_sign  # parked in the direction of the adjacent traffic
            for lo, hi in _in_section(rd, window[0], window[1], 2.0):
                s = lo + rng.uniform(0.0, 6.0)
                while s < hi:
                    kind = rng.random()
                    if kind < 0.6:  # parked car
                        size = _size(rng, "vehicle.car")
                        if s + size[1] > hi:
                            break
                        color = VEHICLE_COLORS[int(rng.integers(len(VEHICLE_COLORS)))]
                        _add_static(
                            agents,
                            rd,
                            s + size[1] / 2,
                            lat + rng.uniform(-0.15, 0.15),
                            yaw_of_road(rd, d),
                            "vehicle.car",
                            size,
                            color,
                            "vehicle.parked",
                            t,
                        )
                        s += size[1] + rng.uniform(1.0, 4.0)
                    elif kind < 0.8:  # a row of traffic cones, or of barriers along the shoulder
                        cones = kind < 0.72
                        cat = "movable_object.trafficcone" if cones else "movable_object.barrier"
                        spacing = 2.0 if cones else 2.6
                        n = int(rng.integers(3, 7) if cones else rng.integers(1, 4))
                        if s + spacing * n > hi:
                            break
                        for c in range(n):
                            _add_static(
                                agents,
                                rd,
                                s + spacing * (c + 0.5),
                                lat + (lat_sign * 0.3 if cones else 0.0),
                                0.0 if cones else yaw_of_road(rd, 1),
                                cat,
                                _size(rng, cat),
                                (250, 110, 20) if cones else (235, 235, 225),
                                None,
                                t,
                            )
                        s += spacing * n + 1.0
                    else:
                        s += rng.uniform(4.0, 15.0)
        # Parked bicycles near the outer edge of the sidewalk.
        lat = lat_sign * (rd.half_width + SIDEWALK_WIDTH - 0.6)
        for lo, hi in _in_section(rd, window[0], window[1], 4.0):
            for _ in range(int(rng.poisson((hi - lo) / 60.0))):
                size = _size(rng, "vehicle.bicycle")
                color = VEHICLE_COLORS[int(rng.integers(len(VEHICLE_COLORS)))]
                _add_static(
                    agents,
                    rd,
                    rng.uniform(lo, hi),
                    lat,
                    yaw_of_road(rd, 1) + math.pi / 2,
                    "vehicle.bicycle",
                    size,
                    color,
                    "cycle.without_rider",
                    t,
                )


def _add_static(agents, rd, s, lat, yaw, category, size, color, attribute, t):
    xy = rd.point(s, lat)
    agents.append(
        Agent(
            category,
            size,
            color,
            np.full(t.shape, xy[0]),
            np.full(t.shape, xy[1]),
            np.full(t.shape, yaw),
            [attribute] * len(t),
        )
    )


def _place_pedestrians(rng, location: Location, ego_road: Road, window_of, t, agents, num_samples):
    """Pedestrians on both sidewalks of every road near the route, walking along it (crossing side
    roads on the zebra crossings) or standing."""
    for rd in location.roads:
        window = window_of(rd)
        if window is None:
            continue
        length = window[1] - window[0]
        density = 1 / 14.0 if rd is ego_road else 1 / 30.0
        for lat_sign in (-1, 1):
            for _ in range(int(rng.poisson(length * density))):
                adult = rng.random() > 0.1
                cat = "human.pedestrian.adult" if adult else "human.pedestrian.child"
                size = _size(rng, cat)
                lat = lat_sign * (rd.half_width + rng.uniform(0.7, SIDEWALK_WIDTH - 1.4))
                s0 = rng.uniform(window[0], window[1])
                if rng.random() < 0.2:
                    v, attr = 0.0, "pedestrian.standing"
                    yaw = rng.uniform(-math.pi, math.pi)
                else:
                    v, attr = rng.choice([-1, 1]) * rng.uniform(0.8, 1.6), "pedestrian.moving"
                    yaw = yaw_of_road(rd, 1 if v > 0 else -1)
                s = s0 + v * t
                if np.any((s < 0) | (s > rd.length)):
                    continue
                # The sidewalk is interrupted by crossing roads: walkers on the ego road's sidewalks
                # keep clear of the ego road itself, others keep to sidewalk stretches only.
                if rd is not ego_road and _crosses_station(rd, s, lat):
                    continue
                color = SHIRT_COLORS[int(rng.integers(len(SHIRT_COLORS)))]
                xy = rd.point(s, np.full_like(s, lat))
                agents.append(
                    Agent(
                        cat,
                        size,
                        color,
                        xy[:, 0],
                        xy[:, 1],
                        np.full(t.shape, yaw),
                        [attr] * num_samples,
                    )
                )


def _crosses_station(rd: Road, s: np.ndarray, lat: float) -> bool:
    for st, hw in rd.stations:
        if np.any(np.abs(s - st) < hw + SIDEWALK_WIDTH + 1.0):
            return True
    return False
