"""The nuScenes tables on disk: where they are, loading them through nuscenes-devkit with errors
that name the file, the split's scenes, and the checks of what a sample reads (annotations, image
files)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, TypeVar

from lss.errors import ConfigError, DatasetError

# The original LSS release nests each version one level down: DATAROOT/mini/v1.0-mini,
# DATAROOT/trainval/...
_LSS_LAYOUT_FOLDER = {"v1.0-mini": "mini", "v1.0-trainval": "trainval", "v1.0-test": "test"}
# Global translations of annotations beyond this many metres are corrupt (nuScenes maps span a few
# kilometres).
MAX_TRANSLATION_M = 1e5
Loaded = TypeVar("Loaded")


class DatasetNotFoundError(DatasetError, FileNotFoundError):
    """The dataroot holds no nuScenes tables for the requested version."""


class MapNotFoundError(DatasetError, FileNotFoundError):
    """A map-expansion file needed for a map class is missing."""


class SampleError(DatasetError, OSError):
    """A sample cannot be read; the message names the sample and the file.

    DataLoader raises it again in the main process with "Caught SampleError in DataLoader worker
    process N" and the worker's traceback as its message; the constructor puts the original message
    first, in one line."""

    def __init__(self, message: str = ""):
        marker = f"{type(self).__name__}: "
        if message.startswith(f"Caught {type(self).__name__} ") and marker in message:
            where = (
                message.split("\n", 1)[0].removeprefix(f"Caught {type(self).__name__} ").rstrip(".")
            )
            message = f"{message.rstrip().rsplit(marker, 1)[1]} ({where})"
        super().__init__(message)


class SampleFileNotFoundError(SampleError, FileNotFoundError):
    """A file that a sample names (camera image, lidar sweep) is missing."""


def _has_tables(folder: Path) -> bool:
    return (folder / "sample.json").is_file() and (folder / "scene.json").is_file()


def locate_dataroot(dataroot: str | Path, version: str) -> tuple[Path, str]:
    """Find the devkit dataroot (the folder holding `<version>/`) for either supported layout.

    Returns (devkit dataroot, layout description). Raises DatasetNotFoundError listing what was
    looked for and which versions were found instead.
    """
    root = Path(dataroot).expanduser()
    candidates = [(root, f"DATAROOT/{version}/")]
    if version in _LSS_LAYOUT_FOLDER:
        sub = _LSS_LAYOUT_FOLDER[version]
        candidates.append((root / sub, f"DATAROOT/{sub}/{version}/ (original LSS layout)"))
    for base, layout in candidates:
        if _has_tables(base / version):
            return base, layout
    looked = ", ".join(str(base / version) for base, _ in candidates)
    if not root.is_dir():
        found = f"{root} does not exist"
    else:
        versions = sorted(
            {str(p.parent) for p in root.glob("*/sample.json")}
            | {str(p.parent) for p in root.glob("*/*/sample.json")}
        )
        found = (
            ("tables found in: " + ", ".join(versions))
            if versions
            else f"no nuScenes tables under {root}"
        )
    synthetic = (
        f"`lss make-synthetic {root} --version {version}`"
        if version in ("v1.0-mini", "v1.0-trainval")
        else f"`lss make-synthetic {root}` (and data.version=v1.0-mini)"
    )
    raise DatasetNotFoundError(
        f"nuScenes {version} not found: looked for the tables (sample.json, scene.json, ...) in "
        f"{looked}; {found}. Set data.dataroot to the folder holding {version}/ (or "
        f"mini/{version}/), set data.version to the version you have, or generate a synthetic set "
        f"with {synthetic}."
    )


def resolve_split(version: str, split: str) -> tuple[str, list[str]]:
    """Map a split name to the devkit split ("train"/"val" become mini_train/mini_val on v1.0-mini).

    Returns (devkit split name, scene names)."""
    from nuscenes.utils.splits import create_splits_scenes

    splits = create_splits_scenes()
    name = f"mini_{split}" if version.endswith("mini") and split in ("train", "val") else split
    if name not in splits:
        raise ConfigError(
            f"unknown split {split!r} for {version}; expected 'train', 'val' or one of the devkit "
            f"splits {sorted(splits)}"
        )
    return name, list(splits[name])


def json_file_problem(path: Path, expect: type) -> str | None:
    """What is wrong with JSON file `path` (not readable, not JSON, top level not of type `expect`),
    or None."""
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        return f"{path} is not valid JSON ({type(e).__name__}: {e})"
    if not isinstance(value, expect):
        return f"{path} holds a JSON {type(value).__name__}, expected a JSON {expect.__name__}"
    if expect is list and any(not isinstance(r, dict) for r in value):
        return f"{path} holds a list whose records are not all JSON objects"
    return None


def _target_table(field: str, table: str) -> str:
    """The table a token field points into: sample_token -> sample, first_sample_token -> sample,
    prev / next -> the record's own table."""
    if field in ("prev", "next"):
        return table
    return field.removeprefix("first_").removeprefix("last_").removesuffix("_token")


def missing_record_problem(files: list[Path], token: str) -> str | None:
    """What refers to the record `token` that none of the tables `files` holds (the devkit's
    KeyError), in one sentence; None when a table holds it or nothing refers to it."""
    tables = {}
    for f in files:
        try:
            records = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(records, list):
            tables[f.stem] = [r for r in records if isinstance(r, dict)]
    if any(r.get("token") == token for records in tables.values() for r in records):
        return None
    refs = [
        (table, field, r)
        for table, records in tables.items()
        for r in records
        for field, value in r.items()
        if value == token and field != "token"
    ]
    if not refs:
        return None
    # a scene names the problem best
    table, field, record = next((ref for ref in refs if ref[0] == "scene"), refs[0])
    target = _target_table(field, table)
    folder = files[0].parent
    source = f"scene {record.get('name')}" if table == "scene" else f"{table} {record.get('token')}"
    others = f"{len(refs) - 1} other record(s) refer to it too"
    if target in tables and not tables[target]:
        return (
            f"{folder / target}.json holds no records, but {source} refers to one (its {field} "
            f"{token}; {others})"
        )
    what = "has no samples" if table == "scene" and target == "sample" else "refers to no record"
    return (
        f"{source} in {folder / table}.json {what}: {folder / target}.json holds no record {token} "
        f"(its {field}; {others})"
    )


def loaded_or_named(
    load: Callable[[], Loaded], files: list[Path], expect: type, what: str
) -> Loaded:
    """`load()` (a devkit constructor reading `files`); when it fails on their content, a
    DatasetError naming the first file that is not a valid JSON `expect` (or all of them when each
    parses)."""
    try:
        return load()
    except (AssertionError, KeyError, TypeError, AttributeError, ValueError) as e:
        problem = next(
            (p for f in files if f.is_file() and (p := json_file_problem(f, expect))), None
        )
        if problem is None and isinstance(e, KeyError) and e.args and isinstance(e.args[0], str):
            problem = missing_record_problem(files, e.args[0])
        if problem:
            raise DatasetError(
                f"{what}: {problem}. Restore the file from the dataset archive (or regenerate "
                "a synthetic set)"
            ) from None
        raise DatasetNotFoundError(
            f"nuscenes-devkit could not load {what}: {type(e).__name__}: {e}. Check that "
            "its JSON files and the files they name (maps/*.png, samples/) are "
            "complete."
        ) from None


_TABLES: dict = {}


def load_tables(root: Path, version: str):
    """The devkit's NuScenes object for (root, version), loaded once per process."""
    from nuscenes.nuscenes import NuScenes

    key = (str(Path(root).resolve()), version)
    if key not in _TABLES:
        files = sorted((Path(root) / version).glob("*.json"))
        nusc = loaded_or_named(
            lambda: NuScenes(version=version, dataroot=str(root), verbose=False),
            files,
            list,
            f"the {version} tables under {root}",
        )
        for name in (
            nusc.table_names
        ):  # an object instead of a list can load without an error, and index nothing
            if not isinstance(getattr(nusc, name), list):
                raise DatasetError(
                    f"the {version} tables under {root}: {Path(nusc.table_root) / name}.json "
                    f"holds a JSON {type(getattr(nusc, name)).__name__}, expected a JSON list. "
                    "Restore the file from the dataset archive (or regenerate a synthetic set)"
                )
        _TABLES[key] = nusc
    return _TABLES[key]


def check_annotation(ann: dict, table_file: Path) -> None:
    """Refuse an annotation whose size or pose is not finite, whose size is negative, or whose
    translation is beyond MAX_TRANSLATION_M: its box would be rasterized anywhere (or nowhere)
    without a word."""
    values = [*ann["size"], *ann["translation"], *ann["rotation"]]
    finite = all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)
    problem = (
        "is not finite"
        if not finite
        else "has a negative size"
        if min(ann["size"]) < 0
        else f"lies beyond {MAX_TRANSLATION_M:g} m"
        if max(map(abs, ann["translation"])) > MAX_TRANSLATION_M
        else None
    )
    if problem:
        raise DatasetError(
            f"annotation {ann['token']} in {table_file} {problem} (size {ann['size']}, translation "
            f"{ann['translation']}, rotation {ann['rotation']}): fix or remove the record"
        )
