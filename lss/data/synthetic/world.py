"""The synthetic world: a road grid per nuScenes location, and per scene the ego route and the
agents around it.

Everything lives in the global frame of a location (metres, x east, y north, z up, ground at z = 0),
as in nuScenes. A location is a grid of straight two-way roads with lanes, optional parking
shoulders, sidewalks and buildings; a scene is the ego driving along one lane of one road, with
moving, stopped and parked vehicles, walking pedestrians, parked bicycles and traffic cones /
barriers around it.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import numpy as np

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

SAMPLE_PERIOD = 0.5  # key frames at 2 Hz
ANNOTATION_RANGE = 80.0  # objects closer than this to the ego are annotated (and rendered)
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
        return float(np.linalg.norm(self.end - self.start))

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
                if abs(float(np.dot(pos - road.start, road.left))) > 1.0:
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
