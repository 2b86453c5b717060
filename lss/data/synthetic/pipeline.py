"""`generate`: write a synthetic dataset in the nuScenes on-disk format (tables, images, lidar,
maps)."""

from __future__ import annotations

import json
import os
import shutil
import socket
from multiprocessing import get_context
from pathlib import Path

import cv2
import numpy as np

from lss.data import file_lock
from lss.errors import ArgumentError
from lss.geometry.rig_file import rig_record, write_rig_file
from lss.config.memory import check_render_memory

from . import lidar as lidar_mod
from .maps import location_geometry, write_map_expansion, write_semantic_prior
from .render import CameraModel, render_camera
from .rig import CAMERAS, LIDAR, load_rig, sensor_pose
from .roads import LOCATIONS, build_location, stable_seed
from .scenery import build_ground_texture, scene_boxes
from .tables import MINI_LOCATIONS, TokenFactory, build_tables, sample_filename, write_tables
from .world import build_scene

VERSIONS = ("v1.0-mini", "v1.0-trainval")
# an example rig file of the set's cameras (lss.geometry.rig_file), for `lss predict --calib`
RIG_EXAMPLE = "rig.json"
# what generate writes next to the tables directory
OUTPUTS = ("samples", "sweeps", "maps", RIG_EXAMPLE)
# the files generate wrote into a directory: what --force may delete there
MANIFEST = ".lss-synthetic.json"
# generate writes into OUT_DIR/STAGING<host>-<pid>, holding its STAGING_LOCK (lss.data.file_lock),
# and moves the finished set into place
STAGING = ".lss-synthetic-partial-"
STAGING_LOCK = ".lock"
MIN_SCENES = 2  # one for the training split, one for the validation split
JPEG_QUALITY = 92


def scene_names(version: str, scenes: int) -> list[str]:
    """Official scene names such that create_splits_scenes() puts about a fifth of them in the
    validation split (mini_val / val) and the rest in the training split (mini_train / train); at
    least one of each from 2 on."""
    from nuscenes.utils import splits

    train, val = (
        (splits.mini_train, splits.mini_val)
        if version == "v1.0-mini"
        else (splits.train, splits.val)
    )
    limit = len(train) + len(val)
    if scenes > limit:
        raise ArgumentError(
            f"{scenes} scenes requested for {version}, but its official split lists name only "
            f"{limit} ({len(train)} train + {len(val)} val): pass --scenes {limit} or fewer, or "
            f"use {'v1.0-trainval' if version == 'v1.0-mini' else 'fewer scenes'}"
        )
    n_val = 0 if scenes < 2 else max(1, round(scenes * len(val) / limit))
    n_val = min(n_val, len(val))
    n_train = scenes - n_val
    if n_train > len(train):
        n_train, n_val = len(train), scenes - len(train)
    return list(train[:n_train]) + list(val[:n_val])


def scene_location(version: str, name: str, index: int) -> str:
    if version == "v1.0-mini" and name in MINI_LOCATIONS:
        return MINI_LOCATIONS[name]
    return LOCATIONS[index % len(LOCATIONS)]


def _written_files(out: Path, version: str) -> list[Path]:
    """Every file that generate writes: under the tables of `version`, samples/, sweeps/, maps/,
    and the rig file."""
    paths = [out / sub for sub in (version,) + OUTPUTS]
    return sorted(
        [f for p in paths if p.is_dir() for f in p.rglob("*") if not f.is_dir()]
        + [p for p in paths if p.is_file()]
    )


def previous_output(out: Path, version: str) -> set[Path]:
    """The files an earlier generate wrote into `out` (listed in its MANIFEST); FileExistsError when
    the folders generate writes hold any other file."""
    manifest = out / MANIFEST
    owned = (
        {out / name for name in json.loads(manifest.read_text())["files"]}
        if manifest.is_file()
        else set()
    )
    foreign = [f for f in _written_files(out, version) if f not in owned]
    if foreign:
        raise FileExistsError(
            f"--force: {foreign[0]} (and {len(foreign) - 1} more file(s)) was not written by "
            f"`lss make-synthetic` (not listed in {manifest}); --force only replaces a synthetic "
            "set: move those files away or choose another directory"
        )
    return owned


def remove_previous_output(out: Path, version: str) -> None:
    """Delete what an earlier generate wrote into `out` (previous_output); refuse, deleting nothing,
    when the folders generate writes hold any other file."""
    manifest = out / MANIFEST
    owned = previous_output(out, version)
    for f in owned:
        f.unlink(missing_ok=True)
    manifest.unlink(missing_ok=True)
    for folder in sorted(
        {d for f in owned for d in f.parents if out in d.parents}, key=lambda d: -len(d.parts)
    ):
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def _check_args(
    out_dir, version, scenes, samples_per_scene, image_size, force
) -> tuple[Path, tuple[int, int]]:
    if version not in VERSIONS:
        raise ArgumentError(f"unknown version {version!r}: expected one of {', '.join(VERSIONS)}")
    if not isinstance(scenes, int) or scenes < MIN_SCENES:
        raise ArgumentError(
            f"scenes must be an integer of at least {MIN_SCENES} (one training and one validation "
            f"scene), got {scenes!r}: pass --scenes {MIN_SCENES} or more"
        )
    if not isinstance(samples_per_scene, int) or samples_per_scene < 1:
        raise ArgumentError(
            f"samples_per_scene must be a positive integer, got {samples_per_scene!r}"
        )
    try:
        w, h = (int(v) for v in image_size)
    except (TypeError, ValueError):
        raise ArgumentError(
            f"image_size must be (width, height), e.g. (1600, 900), got {image_size!r}"
        ) from None
    if w < 32 or h < 18:
        raise ArgumentError(
            f"image_size {w}x{h} is too small: expected at least 32x18 (nuScenes is 1600x900)"
        )
    check_render_memory((w, h), "image_size (--image-size)", error=ArgumentError)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(
            f"output path {out} exists and is not a directory: choose a directory"
        )
    if out.is_dir():
        _remove_stale_staging(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise FileExistsError(
            f"output directory {out} is not empty: choose an empty or new directory, or pass "
            "force=True (--force) to overwrite the synthetic dataset in it"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".lss-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise PermissionError(
            f"cannot write to output directory {out} ({e.strerror or e}): choose a writable "
            "directory"
        ) from None
    return out, (w, h)


def _remove_stale_staging(out: Path) -> None:
    """Delete the staging folders in `out` of killed generates (no process holds their lock)."""
    for folder in out.glob(f"{STAGING}*"):
        fd = file_lock.try_lock(folder / STAGING_LOCK) if folder.is_dir() else None
        if fd is not None:
            shutil.rmtree(folder, ignore_errors=True)
            file_lock.release(fd)


def _move_into(source: Path, target: Path) -> None:
    """Move `source` to `target`, merging folders into an existing folder of that name."""
    if target.is_dir() and source.is_dir():
        for child in source.iterdir():
            _move_into(child, target / child.name)
        source.rmdir()
    else:
        os.replace(source, target)


# Per-process state of the render workers: scenes, rig and caches of what is expensive to rebuild.
_STATE: dict = {}


def _init_worker(state: dict) -> None:
    _STATE.clear()
    _STATE.update(state)
    _STATE["cache"] = {}
    cv2.setNumThreads(1)


def _scene_assets(scene_index: int):
    """Location, geometry and ground texture of a scene (the last scene's kept: tasks come scene by
    scene)."""
    cache = _STATE["cache"]
    scene = _STATE["scenes"][scene_index]
    seed = _STATE["seed"]
    if scene.location not in cache.setdefault("locations", {}):
        loc = build_location(scene.location, seed)
        cache["locations"][scene.location] = (loc, location_geometry(loc))
    loc, geom = cache["locations"][scene.location]
    if cache.get("texture_scene") != scene_index:
        cache["texture"] = None  # free the previous texture first
        cache["texture"] = build_ground_texture(
            scene, geom, stable_seed("texture", seed, scene.name)
        )
        cache["texture_scene"] = scene_index
    if "cameras" not in cache:
        cache["cameras"] = {ch: CameraModel(_STATE["rig"][ch]) for ch in CAMERAS}
    return scene, loc, cache["texture"], cache["cameras"]


def render_sample(task: tuple[int, int]) -> tuple[tuple[int, int], dict]:
    """Render the six cameras and the lidar of key frame k of a scene and write them; return
    per-agent stats."""
    scene_index, k = task
    scene, loc, texture, cameras = _scene_assets(scene_index)
    rig, root = _STATE["rig"], _STATE["root"]
    rng = np.random.default_rng(stable_seed("sample", _STATE["seed"], scene.name, k))
    boxes = scene_boxes(scene, loc, k)
    ego = (scene.ego_x[k], scene.ego_y[k], scene.ego_yaw[k])
    visible, projected, lidar_pts = {}, {}, {}
    for ch in CAMERAS:
        img, _, vis, proj = render_camera(cameras[ch], ego, boxes, texture, scene.sun)
        path = root / sample_filename(scene, k, ch)
        cv2.imwrite(str(path), img[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, JPEG_QUALITY])
        for b in np.nonzero(proj)[0]:
            a = int(boxes.agent[b])
            if a >= 0:
                visible[a] = visible.get(a, 0) + int(vis[b])
                projected[a] = projected.get(a, 0) + int(proj[b])
    rot, pos = sensor_pose(rig[LIDAR], *ego)
    points, ids = lidar_mod.sweep(rot, pos, boxes, texture, rng)
    points.tofile(root / sample_filename(scene, k, LIDAR))
    agents = boxes.agent[ids[ids >= 0]]
    for a, c in zip(*np.unique(agents[agents >= 0], return_counts=True)):
        lidar_pts[int(a)] = int(c)
    return (scene_index, k), {"visible": visible, "projected": projected, "lidar": lidar_pts}


def generate(
    out_dir,
    version: str = "v1.0-mini",
    scenes: int = 10,
    samples_per_scene: int = 40,
    image_size=(1600, 900),
    seed: int = 0,
    workers: int | None = None,
    force: bool = False,
) -> Path:
    """Write a synthetic nuScenes-format dataset into `out_dir` and return the dataroot (= out_dir).

    Tables go to out_dir/<version>/, key-frame images and lidar sweeps to out_dir/samples/, maps to
    out_dir/maps/. The same seed gives byte-identical tables whatever the number of workers. The set
    is written into a staging folder inside out_dir and moved into place when it is complete: a
    generate that fails or is killed part-way leaves no half set (and, with force, the earlier set
    stays until the new one is done).
    """
    out, size = _check_args(out_dir, version, scenes, samples_per_scene, image_size, force)
    workers = (os.cpu_count() or 1) if workers is None else int(workers)
    if workers < 1:
        raise ArgumentError(f"workers must be >= 1, got {workers}")
    names = scene_names(version, scenes)
    previous_output(out, version)  # refuses before any work when --force would delete foreign files
    staging = out / f"{STAGING}{socket.gethostname()}-{os.getpid()}"
    staging.mkdir()
    lock = file_lock.try_lock(staging / STAGING_LOCK)
    try:
        _write_set(staging, version, names, samples_per_scene, size, seed, workers)
        remove_previous_output(out, version)
        # the tables and the manifest last: until they are in place, out holds no dataset
        for name in OUTPUTS + (version, MANIFEST):
            _move_into(staging / name, out / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        file_lock.release(lock)
    return out


def _write_set(
    root: Path,
    version: str,
    names: list[str],
    samples_per_scene: int,
    size: tuple[int, int],
    seed: int,
    workers: int,
) -> None:
    """Everything generate writes (maps, samples, sweeps, tables, MANIFEST), into the folder
    `root`."""
    from tqdm import tqdm

    rig = load_rig(size)
    for ch in CAMERAS + (LIDAR,):
        (root / "samples" / ch).mkdir(parents=True, exist_ok=True)
        (root / "sweeps" / ch).mkdir(parents=True, exist_ok=True)

    scene_locations = [scene_location(version, n, i) for i, n in enumerate(names)]
    locations, tok = {}, TokenFactory(seed)
    map_tokens = {}
    for name in sorted(set(scene_locations)):
        loc = build_location(name, seed)
        geom = location_geometry(loc)
        locations[name] = loc
        write_map_expansion(root, loc, geom, seed)
        map_tokens[name] = tok("map", name)
        write_semantic_prior(root / "maps" / f"{map_tokens[name]}.png", loc, geom)
    scene_list = [
        build_scene(i, n, locations[scene_locations[i]], samples_per_scene, seed)
        for i, n in enumerate(names)
    ]

    state = {"scenes": scene_list, "rig": rig, "root": root, "seed": seed}
    tasks = [(i, k) for i in range(len(scene_list)) for k in range(samples_per_scene)]
    stats = {}
    bar = tqdm(total=len(tasks), desc="synthetic samples", unit="sample")
    if workers == 1:
        _init_worker(state)
        for task in tasks:
            key, st = render_sample(task)
            stats[key] = st
            bar.update()
    else:
        with get_context("fork").Pool(workers, initializer=_init_worker, initargs=(state,)) as pool:
            # Chunks small enough that every worker gets some: 24 tasks in chunks of 8 kept 13 of 16
            # workers idle.
            chunk = max(1, min(8, len(tasks) // (4 * workers)))
            for key, st in pool.imap_unordered(render_sample, tasks, chunksize=chunk):
                stats[key] = st
                bar.update()
    bar.close()
    write_tables(root / version, build_tables(scene_list, rig, stats, seed, map_tokens))
    write_rig_file(
        root / RIG_EXAMPLE,
        {
            ch: rig_record(rig[ch].intrinsic, rig[ch].rotation, rig[ch].translation, size)
            for ch in CAMERAS
        },
        note=f"the cameras of this synthetic set ({size[0]}x{size[1]} images); docs/predict.md",
    )
    files = [str(f.relative_to(root)) for f in _written_files(root, version)]
    (root / MANIFEST).write_text(json.dumps({"version": version, "files": files}, indent=0))
