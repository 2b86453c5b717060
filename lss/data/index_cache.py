"""On-disk cache of a split's dataset index (the arrays NuScenesBEV extracts from the tables, and the map geometry).

Building the index imports nuscenes-devkit (about 2 s: it pulls in scikit-learn, scipy and matplotlib), parses every
table and walks every sample; a cached index loads in milliseconds. The key covers what the index depends on: the
dataroot, version and split, the config fields that select samples, objects and layers, the devkit's version, and
the size and modification time of every table and map file, so an edited or regenerated dataset is indexed again.
The cache lives in $LSS_CACHE_DIR, else $XDG_CACHE_HOME/lss, else ~/.cache/lss (folder index/); a cache that cannot
be read or written is rebuilt or skipped, never an error.
"""
from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path
from typing import BinaryIO, Callable, Optional

FORMAT = 1  # bump when the cached fields change


def cache_dir() -> Path:
    if os.environ.get("LSS_CACHE_DIR"):
        return Path(os.environ["LSS_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lss"


def _files_state(root: Path, version: str) -> list[tuple[str, int, int]]:
    files = sorted([*(root / version).glob("*.json"), *(root / "maps" / "expansion").glob("*.json")])
    return [(str(f.relative_to(root)), (st := f.stat()).st_size, st.st_mtime_ns) for f in files]


def index_key(root: Path, version: str, split: str, selection: tuple) -> str:
    """The cache key of one split's index; `selection`: the config values the index depends on."""
    from importlib.metadata import PackageNotFoundError, version as package_version

    try:
        devkit = package_version("nuscenes-devkit")
    except PackageNotFoundError:
        devkit = None
    parts = (FORMAT, str(Path(root).resolve()), version, split, selection, devkit, _files_state(Path(root), version))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def load_index(key: str) -> Optional[dict]:
    """The cached fields of `key`, or None when there are none (or they cannot be read)."""
    path = cache_dir() / "index" / f"{key}.pkl"
    try:
        with path.open("rb") as f:
            return pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
        return None


def write_cache_file(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """write(file) into a temporary file beside `path`, then renamed over it: a reader never sees half a file, and
    concurrent writers of the same path (loader workers) each rename a whole one. A read-only or full cache folder
    only means the entry is made again next time."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tmp.open("wb") as f:
            write(f)
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # e.g. a parent that is not a folder
            pass


def save_index(key: str, fields: dict) -> None:
    """Write the fields of `key` (write_cache_file)."""
    write_cache_file(cache_dir() / "index" / f"{key}.pkl",
                     lambda f: pickle.dump(fields, f, protocol=pickle.HIGHEST_PROTOCOL))
