"""Camera rendering of the synthetic world through the real intrinsics/extrinsics.

The ground is drawn by intersecting every pixel's ray with the plane z = 0 and sampling the
top-down ground texture (scenery.py); above the horizon there is sky. Objects are lit 3-D boxes
(per-face shading by the sun, a colour per instance, windows, wheels, clothes...) drawn face by face
into a depth buffer, so occlusion is exact; an object-id buffer gives each annotation's visible
fraction. Shadows of the boxes darken the ground.
"""

from __future__ import annotations

import math

import cv2
import numpy as np

from .reproducible import dots, exp, inverse3, inverses3, matmul, matvec
from .rig import Sensor
from .scenery import (
    BARRIER,
    BICYCLE,
    BUILDING,
    BUS,
    CAR,
    CONE,
    GROUND_RGB,
    MOTORCYCLE,
    PEDESTRIAN,
    TRUCK,
    VERGE,
    BoxSet,
    GroundTexture,
    boxes_corners,
    yaw_matrices,
    yaw_matrix,
)

SKY_HORIZON = np.array([205, 218, 232], np.float32)
SKY_ZENITH = np.array([105, 145, 205], np.float32)
FOG_DISTANCE = 220.0
NEAR_PLANE = 0.1

# Box faces in the box frame (x along the heading, unit half-sizes): outward normal, origin corner,
# and the corners that the face coordinates s (across) and t (up) reach at 1. On the sides s runs
# from back to front; on the ends and sides t is the height fraction. Bottoms are never seen from
# above the ground.
FRONT, BACK, LEFT, RIGHT, TOP = range(5)
_FACES = np.array(
    [
        # normal          origin          s = 1           t = 1
        [(1, 0, 0), (1, -1, -1), (1, 1, -1), (1, -1, 1)],
        [(-1, 0, 0), (-1, 1, -1), (-1, -1, -1), (-1, 1, 1)],
        [(0, 1, 0), (-1, 1, -1), (1, 1, -1), (-1, 1, 1)],
        [(0, -1, 0), (-1, -1, -1), (1, -1, -1), (-1, -1, 1)],
        [(0, 0, 1), (-1, -1, 1), (1, -1, 1), (-1, 1, 1)],
    ],
    np.float64,
)


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
            out.append(a + (near - a[2]) / (b[2] - a[2]) * (b - a))
    return np.array(out).reshape(-1, 3)


def _project(points_cam: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Pixel coordinates (M x 2) of camera-frame points (M x 3, z > 0)."""
    uvw = matmul(points_cam, k.T)
    return uvw[:, :2] / uvw[:, 2:3]


class CameraModel:
    """What does not change while the ego moves on the ground plane, per camera: the pixel rays,
    where each pixel meets the ground in the ego frame, its inverse depth, and the sky / fog /
    distance-blend weights."""

    def __init__(self, sensor: Sensor):
        w, h = sensor.size
        self.sensor = sensor
        self.k = sensor.intrinsic
        self.u = np.arange(w, dtype=np.float64)  # pixel centres at integer coordinates
        self.v = np.arange(h, dtype=np.float64)
        uu, vv = np.meshgrid(self.u, self.v)
        rays = matmul(np.stack([uu, vv, np.ones_like(uu)], -1), inverse3(self.k).T)  # z = 1
        d_ego = matmul(rays, sensor.rotation_matrix.T)
        height = sensor.translation[2]
        self.ground = d_ego[..., 2] < -1e-6
        t = np.where(self.ground, height / np.where(self.ground, -d_ego[..., 2], 1.0), 0.0)
        self.ground_x = (sensor.translation[0] + t * d_ego[..., 0]).astype(np.float32)
        self.ground_y = (sensor.translation[1] + t * d_ego[..., 1]).astype(np.float32)
        self.inv_ground_depth = np.where(self.ground, 1.0 / np.where(self.ground, t, 1.0), 0.0)
        length = np.sqrt(d_ego[..., 0] ** 2 + d_ego[..., 1] ** 2 + d_ego[..., 2] ** 2)
        dist = t * length
        fog = np.where(self.ground, 1.0 - exp(-dist / FOG_DISTANCE), 1.0)[..., None]
        blend = np.clip((dist - 15.0) / 25.0, 0.0, 1.0)[..., None]
        self.w_near = np.repeat((1 - blend) * (1 - fog), 3, axis=2).astype(np.float32)
        self.w_far = np.repeat(blend * (1 - fog), 3, axis=2).astype(np.float32)
        elevation = np.clip(d_ego[..., 2] / length, 0.0, 1.0)[..., None]
        sky = SKY_HORIZON + (SKY_ZENITH - SKY_HORIZON) * np.sqrt(elevation)
        self.background = np.where(self.ground[..., None], fog * SKY_HORIZON, sky).astype(
            np.float32
        )


# Window bands (fraction of the height) of the vehicle kinds.
_GLASS_LOW = np.zeros(9)
_GLASS_HIGH = np.zeros(9)
_GLASS_LOW[[CAR, TRUCK, BUS]] = (0.62, 0.65, 0.45)
_GLASS_HIGH[[CAR, TRUCK, BUS]] = (0.9, 0.9, 0.85)


def render_camera(
    cam: CameraModel, ego: tuple[float, float, float], boxes: BoxSet, texture: GroundTexture, sun
):
    """Render one camera for the ego pose (x, y, yaw) on the ground plane.

    Returns (image H x W x 3 uint8 RGB, ids H x W int32 (box index or -1), visible pixels per box N,
    projected (unoccluded) pixels per box N).
    """
    ex, ey, eyaw = ego
    w, h = cam.sensor.size
    c, s = math.cos(eyaw), math.sin(eyaw)
    # Ground: the ego-frame ground points move rigidly with the ego; sample the texture there.
    to_col = np.float32(1.0 / texture.resolution)
    col = ((ex + c * cam.ground_x - s * cam.ground_y) - texture.xmin) * to_col
    row = (texture.ymax - (ey + s * cam.ground_x + c * cam.ground_y)) * to_col
    # cv2.remap needs float32 maps; numpy 2 promotes by the float64 texture bounds.
    col = col.astype(np.float32, copy=False)
    row = row.astype(np.float32, copy=False)
    col[~cam.ground] = -10.0
    border = tuple(float(v) for v in GROUND_RGB[VERGE])
    near = cv2.remap(
        texture.rgb, col, row, cv2.INTER_LINEAR, borderMode=cv2.BORDER_CONSTANT, borderValue=border
    )
    far = cv2.remap(
        texture.rgb_far,
        col,
        row,
        cv2.INTER_LINEAR,
        borderMode=cv2.BORDER_CONSTANT,
        borderValue=border,
    )
    img = cv2.add(
        cv2.add(
            cv2.multiply(near, cam.w_near, dtype=cv2.CV_32F),
            cv2.multiply(far, cam.w_far, dtype=cv2.CV_32F),
        ),
        cam.background,
    )

    rot = matmul(yaw_matrix(eyaw), cam.sensor.rotation_matrix)  # camera -> global
    pos = matmul(yaw_matrix(eyaw), cam.sensor.translation) + np.array([ex, ey, 0.0])
    n = len(boxes)
    ids = np.full((h, w), -1, np.int32)
    visible = np.zeros(n, np.int64)
    projected = np.zeros(n, np.int64)
    if n == 0:
        return cv2.convertScaleAbs(img), ids, visible, projected
    sun = np.asarray(sun, np.float64)
    shadow = _shadow_mask(boxes, rot, pos, cam.k, w, h, sun)
    inv_depth = cam.inv_ground_depth.copy()
    face_id = np.full((h, w), -1, np.int32)
    face_st = np.zeros((2, h, w), np.float32)
    faces = _rasterize_faces(boxes, rot, pos, cam, sun, inv_depth, face_id, face_st, projected)
    pix = np.flatnonzero(face_id >= 0)
    ground_shadow = shadow & (face_id < 0) & cam.ground
    np.multiply(img, np.float32(0.6), out=img, where=ground_shadow[..., None])
    if len(pix):
        fid = face_id.reshape(-1)[pix]
        ids.reshape(-1)[pix] = faces["box"][fid]
        visible = np.bincount(ids.reshape(-1)[pix], minlength=n).astype(np.int64)
        # the object pixels sorted by their face's kind (a stable radix sort of small integers), so
        # that each kind is painted on one contiguous slice
        kind = faces["kind"].astype(np.uint8)[fid]
        order = np.argsort(kind, kind="stable")
        pix, fid = pix[order], fid[order]
        st = np.take(face_st.reshape(2, -1), pix, axis=1)
        _put_pixels(img, pix, _paint_pixels(faces, fid, st[0], st[1], kind[order]))
    return cv2.convertScaleAbs(img), ids, visible, projected


def _put_pixels(img: np.ndarray, pix: np.ndarray, rgb: np.ndarray) -> None:
    """img.reshape(-1, 3)[pix] = rgb for a C-contiguous H x W x 3 float32 image, as one np.put of
    12-byte pixels (indexed assignment of rows is several times slower)."""
    if not (img.flags.c_contiguous and img.dtype == np.float32 and img.shape[-1] == 3):
        raise ValueError("_put_pixels: img must be a C-contiguous H x W x 3 float32 array")
    rows = np.dtype((np.void, 12))
    np.put(img.view(rows).reshape(-1), pix, np.ascontiguousarray(rgb, np.float32).view(rows))


def _shadow_mask(boxes: BoxSet, rot, pos, k, w, h, sun) -> np.ndarray:
    """Pixels where the ground lies in the shadow of a box (its corners projected along the sun onto
    z = 0)."""
    mask = np.zeros((h, w), np.uint8)
    shift = 4
    # building shadows would fall on the verges and blocks, which we keep plain
    cast = np.flatnonzero(boxes.kind != BUILDING)
    if len(cast) == 0:
        return mask.astype(bool)
    corners = boxes_corners(boxes)[cast]
    flat = corners[..., :2] - sun[None, None, :2] * (corners[..., 2:3] / sun[2])
    flat32 = flat.astype(np.float32)
    hulls = [cv2.convexHull(f).reshape(-1, 2).astype(np.float64) for f in flat32]
    ground = np.concatenate(hulls)
    ground = np.concatenate([ground, np.zeros((len(ground), 1))], 1)
    cam_pts = matmul(ground - pos, rot)  # every hull point in the camera frame, at once
    with np.errstate(divide="ignore", invalid="ignore"):
        uv_all = _project(cam_pts, k)
    start = 0
    for hull in hulls:
        stop = start + len(hull)
        pts = cam_pts[start:stop]
        ahead = pts[:, 2] >= NEAR_PLANE
        if ahead.all() and len(pts) >= 3:
            uv = uv_all[start:stop]
        else:
            clipped = _clip_near(pts)
            if len(clipped) < 3:
                start = stop
                continue
            uv = _project(clipped, k)
        start = stop
        if uv[:, 0].max() < 0 or uv[:, 1].max() < 0 or uv[:, 0].min() >= w or uv[:, 1].min() >= h:
            continue
        cv2.fillConvexPoly(
            mask,
            np.round(np.clip(uv, -1e5, 1e5) * (1 << shift)).astype(np.int32),
            1,
            cv2.LINE_8,
            shift,
        )
    return mask.astype(bool)


def _face_geometry(boxes: BoxSet, rot, pos, k) -> dict:
    """The camera-facing box faces within reach of the camera at pos (rotation rot, intrinsic k), in
    box-then-face order, and what rasterizing them needs: box index, face type, global normal,
    edges e_s and e_t, corners in the camera frame, the inverse-depth plane (a, b, c) and the
    homography from pixels to face coordinates. Every value rounds as the per-face products of
    reproducible.py do."""
    n = len(boxes)
    half = np.stack([boxes.size[:, 1], boxes.size[:, 0], boxes.size[:, 2]], 1) / 2
    box_rot = yaw_matrices(boxes.yaw)[:, None]  # N x 1 x 3 x 3
    normal = matvec(box_rot, np.broadcast_to(_FACES[None, :, 0], (n, 5, 3)))
    origin = matvec(box_rot, _FACES[None, :, 1] * half[:, None]) + boxes.center[:, None]
    e_s = matvec(box_rot, (_FACES[None, :, 2] - _FACES[None, :, 1]) * half[:, None])
    e_t = matvec(box_rot, (_FACES[None, :, 3] - _FACES[None, :, 1]) * half[:, None])
    offset = boxes.center - pos
    near = ~(np.sqrt(dots(offset, offset)) > 400.0)
    facing = ~(dots(normal, pos - origin) <= 1e-9)
    box, face = np.nonzero(near[:, None] & facing)
    normal, origin, e_s, e_t = (v[box, face] for v in (normal, origin, e_s, e_t))
    quad = np.stack([origin, origin + e_s, origin + e_s + e_t, origin + e_t], 1)
    quad_cam = matmul(quad - pos, rot)  # F x 4 x 3
    # Plane n . X = d in the camera frame; 1/z = (n^T K^-1 [u, v, 1]) / d.
    n_cam = matvec(rot.T, normal)
    plane = matmul(n_cam, inverse3(k)) / dots(n_cam, quad_cam[:, 0])[:, None]
    # [u, v, 1] ~ K [e_s, e_t, origin] [s, t, 1] (camera frame), so [s, t, 1] ~ M^-1 [u, v, 1].
    cols = np.stack([matmul(e_s, rot), matmul(e_t, rot), quad_cam[:, 0]], -1)
    hinv = inverses3(matvec(k, np.swapaxes(cols, -1, -2)).swapaxes(-1, -2))
    return {
        "box": box,
        "type": face,
        "normal": normal,
        "e_s": e_s,
        "e_t": e_t,
        "quad": quad_cam,
        "plane": plane,
        "hinv": hinv,
    }


def _rasterize_faces(
    boxes: BoxSet, rot, pos, cam: CameraModel, sun, inv_depth, face_id, face_st, projected
) -> dict:
    """Depth-test every camera-facing box face into (inv_depth, face_id) and record the face
    coordinates (s, t) of the pixels it wins in face_st. A planar face's inverse depth is affine in
    the pixel coordinates and its face coordinates are a homography of them, so each face costs a
    few operations on its bounding rectangle.

    Returns per-face arrays: box index, kind, face type, colour, shade, metric size (across, up)."""
    k = cam.k
    h, w = face_id.shape
    shift = 4
    geo = _face_geometry(boxes, rot, pos, k)
    quads = geo["quad"]
    ahead = quads[..., 2] >= NEAR_PLANE
    with np.errstate(divide="ignore", invalid="ignore"):
        uv_all = _project(quads.reshape(-1, 3), k).reshape(-1, 4, 2)
        lo = np.floor(uv_all.min(1)).astype(np.int64)  # used only where all 4 corners are ahead
        hi = np.ceil(uv_all.max(1)).astype(np.int64)
    whole = ahead.all(1)
    won = []
    for j in range(len(quads)):
        if whole[j]:
            uv = uv_all[j]
            x0, y0 = lo[j].tolist()
            x1, y1 = hi[j].tolist()
        elif not ahead[j].any():
            continue
        else:
            quad = _clip_near(quads[j])
            if len(quad) < 3:
                continue
            uv = _project(quad, k)
            x0, y0 = np.floor(uv.min(0)).astype(np.int64).tolist()
            x1, y1 = np.ceil(uv.max(0)).astype(np.int64).tolist()
        x0, y0, x1, y1 = max(x0, 0), max(y0, 0), min(x1, w - 1), min(y1, h - 1)
        if x1 < x0 or y1 < y0:
            continue
        mask = np.zeros((y1 - y0 + 1, x1 - x0 + 1), np.uint8)
        local = np.clip(uv - (x0, y0), -1e5, 1e5)
        cv2.fillConvexPoly(
            mask, np.round(local * (1 << shift)).astype(np.int32), 1, cv2.LINE_8, shift
        )
        inside = mask.view(bool)
        count = int(np.count_nonzero(inside))
        if count == 0:
            continue
        i = int(geo["box"][j])
        projected[i] += count
        a, b, c0 = geo["plane"][j].tolist()
        uu, vv = cam.u[x0 : x1 + 1], cam.v[y0 : y1 + 1]
        inv_z = (a * uu)[None, :] + (b * vv + c0)[:, None]
        sub = inv_depth[y0 : y1 + 1, x0 : x1 + 1]
        win = inside & (inv_z > sub)
        if not win.any():
            continue
        np.copyto(sub, inv_z, where=win)
        np.copyto(face_id[y0 : y1 + 1, x0 : x1 + 1], len(won), where=win)
        won.append(j)
        hinv = geo["hinv"][j].tolist()
        uu, vv = uu[None, :], vv[:, None]
        q = [hinv[r][0] * uu + (hinv[r][1] * vv + hinv[r][2]) for r in range(3)]
        np.copyto(face_st[0, y0 : y1 + 1, x0 : x1 + 1], q[0] / q[2], where=win, casting="unsafe")
        np.copyto(face_st[1, y0 : y1 + 1, x0 : x1 + 1], q[1] / q[2], where=win, casting="unsafe")
    if not won:
        return {"box": np.zeros(0, np.int32)}
    won = np.array(won)
    box = geo["box"][won]
    light = dots(geo["normal"][won], sun)
    e_s, e_t = geo["e_s"][won], geo["e_t"][won]
    return {
        "box": box,
        "kind": boxes.kind[box],
        "type": geo["type"][won],
        "color": boxes.color[box],
        "shade": 0.5 + 0.55 * np.where(light > 0.0, light, 0.0),
        "extent": np.stack([np.sqrt(dots(e_s, e_s)), np.sqrt(dots(e_t, e_t))], 1),
    }


def _paint_pixels(
    faces: dict, fid: np.ndarray, s: np.ndarray, t: np.ndarray, kind: np.ndarray | None = None
) -> np.ndarray:
    """Colour of object pixels showing faces `fid` (sorted by the faces' kind) at face coordinates
    (s, t): the face's base colour with its details (windows, wheels, lamps, clothes, stripes),
    times the face's sun shading. `kind`: the pixels' faces' kinds (faces["kind"][fid]) where the
    caller has them. Returns M x 3 float32."""
    s = np.clip(s, 0.0, 1.0)
    t = np.clip(t, 0.0, 1.0)
    if kind is None:
        kind = faces["kind"][fid]
    if np.any(kind[1:] < kind[:-1]):
        raise ValueError("_paint_pixels: the pixels must be sorted by their face's kind")
    # per-face values cast before the per-pixel gathers (the same float32 values, fewer bytes);
    # np.take gathers rows of a small table several times faster than indexing does
    rgb = np.take(faces["color"].astype(np.float32), fid, axis=0)
    bounds = np.concatenate([[0], np.cumsum(np.bincount(kind, minlength=BUILDING + 1))])
    for group in range(BUILDING + 1):
        a, b = int(bounds[group]), int(bounds[group + 1])
        if a == b:
            continue
        f = fid[a:b]
        # _paint_kind paints the slice in place; only buildings read the faces' extents
        extent = np.take(faces["extent"], f, axis=0) if group == BUILDING else None
        _paint_kind(group, faces["type"][f], s[a:b], t[a:b], rgb[a:b], extent)
    rgb *= np.take(faces["shade"].astype(np.float32), fid)[:, None]
    return rgb


def _paint_kind(
    kind: int,
    ftype: np.ndarray,
    s: np.ndarray,
    t: np.ndarray,
    rgb: np.ndarray,
    extent: np.ndarray | None,
) -> np.ndarray:
    side = (ftype == LEFT) | (ftype == RIGHT)
    ends = (ftype == FRONT) | (ftype == BACK)
    if kind in (CAR, TRUCK, BUS):
        glass = (
            (ftype != TOP)
            & (t > _GLASS_LOW[kind])
            & (t < _GLASS_HIGH[kind])
            & (s > 0.06)
            & (s < 0.94)
        )
        if kind == TRUCK:
            glass &= ~(side & (s < 0.75))  # a truck's box has no side windows, its cab does
        rgb[glass] = np.float32((45, 55, 68)) + 0.15 * rgb[glass]
        rgb[side & (t < 0.3) & ((np.abs(s - 0.18) < 0.08) | (np.abs(s - 0.82) < 0.08))] = (
            22,
            22,
            24,
        )
        if kind != BUS:
            lamp = ends & (t > 0.3) & (t < 0.42) & ((s < 0.18) | (s > 0.82))
            rgb[lamp & (ftype == FRONT)] = (250, 245, 215)
            rgb[lamp & (ftype == BACK)] = (200, 25, 20)
    elif kind in (MOTORCYCLE, BICYCLE):
        rgb[t < (0.35 if kind == MOTORCYCLE else 0.5)] = (28, 28, 30)
    elif kind == PEDESTRIAN:
        rgb[t > 0.86] = (215, 175, 145)
        rgb[t < 0.46] = (45, 50, 75)
    elif kind == CONE:
        rgb[(t > 0.45) & (t < 0.65)] = (240, 240, 240)
    elif kind == BARRIER:
        rgb[(ftype != TOP) & (np.floor(s * 6) % 2 == 0) & (t > 0.4)] = (210, 35, 30)
    elif kind == BUILDING:
        # A grid of windows: floors every 3.2 m, bays every 3 m; darker roofs.
        up_m = t * extent[:, 1]
        floor_m = up_m % 3.2
        bay_m = (s * extent[:, 0]) % 3.0
        window = (
            (ftype != TOP)
            & (floor_m > 1.0)
            & (floor_m < 2.4)
            & (bay_m > 0.6)
            & (bay_m < 2.2)
            & (up_m > 0.5)
        )
        rgb[window] = (62, 74, 92)
        rgb[ftype == TOP] *= 0.7
    return rgb
