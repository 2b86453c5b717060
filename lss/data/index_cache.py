"""On-disk cache of a split's dataset index (the arrays NuScenesBEV extracts from the tables, and
the map geometry).

Building the index imports nuscenes-devkit (slow: it pulls in scikit-learn, scipy and
matplotlib), parses every table and walks every sample; a cached index loads in milliseconds. The
key covers what the index depends on: the dataroot, version and split, the config fields that select
samples, objects and layers, the devkit's and lss's versions, and the size and modification time of
every table and map file, so an edited or regenerated dataset is indexed again. The cache lives in
$LSS_CACHE_DIR, else $XDG_CACHE_HOME/lss, else ~/.cache/lss (folder index/); a cache file that
cannot be read or written, or that holds anything but the record of its key with the expected fields
(a truncated write, another version's layout), is rebuilt or skipped, never an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import sys
from pathlib import Path
from typing import BinaryIO, Callable, Collection, Optional

FORMAT = 4  # bump when the cached fields change
# a background build still running after this long is stopped, the index built here
BACKGROUND_WAIT_S = 1800.0
_BACKGROUND: list = []  # this process's background builds (build_in_background), not yet waited for


def cache_dir() -> Path:
    if os.environ.get("LSS_CACHE_DIR"):
        return Path(os.environ["LSS_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lss"


def _files_state(root: Path, version: str) -> list[tuple[str, int, int]]:
    files = sorted(
        [*(root / version).glob("*.json"), *(root / "maps" / "expansion").glob("*.json")]
    )
    return [(str(f.relative_to(root)), (st := f.stat()).st_size, st.st_mtime_ns) for f in files]


def index_key(root: Path, version: str, split: str, selection: tuple) -> str:
    """The cache key of one split's index; `selection`: the config values the index depends on."""
    from importlib.metadata import PackageNotFoundError, version as package_version

    import lss

    try:
        devkit = package_version("nuscenes-devkit")
    except PackageNotFoundError:
        devkit = None
    parts = (
        FORMAT,
        lss.__version__,
        str(Path(root).resolve()),
        version,
        split,
        selection,
        devkit,
        _files_state(Path(root), version),
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def load_index(key: str, names: Collection[str]) -> Optional[dict]:
    """The cached fields of `key` (a dict with exactly the keys `names`), or None when there is no
    such record: no file, a file that cannot be unpickled, or one that holds something else."""
    path = cache_dir() / "index" / f"{key}.pkl"
    try:
        with path.open("rb") as f:
            record = pickle.load(f)
    except Exception:  # unpickling foreign or truncated bytes can raise almost anything
        return None
    if not (
        isinstance(record, dict)
        and record.get("format") == FORMAT
        and record.get("key") == key
        and isinstance(record.get("fields"), dict)
        and set(record["fields"]) == set(names)
    ):
        return None
    return record["fields"]


def write_cache_file(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """write(file) into a temporary file beside `path`, then renamed over it: a reader never sees
    half a file, and concurrent writers of the same path (loader workers) each rename a whole one. A
    read-only or full cache folder only means the entry is made again next time."""
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
    """Write the fields of `key` as the record load_index checks (write_cache_file)."""
    record = {"format": FORMAT, "key": key, "fields": fields}
    write_cache_file(
        cache_dir() / "index" / f"{key}.pkl",
        lambda f: pickle.dump(record, f, protocol=pickle.HIGHEST_PROTOCOL),
    )


def build_in_background(build: Callable[[], None]) -> bool:
    """Run build() (which builds dataset indexes, and so writes them into this cache) in a forked
    child process, its output silenced; a dataset of this process that misses the cache waits for it
    and loads the cache again (wait_for_background_builds). Linux only (a forked child inherits the
    imported modules and starts in milliseconds); elsewhere nothing runs. Returns whether the child
    started."""
    if sys.platform != "linux":
        return False
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(
        target=_silently, args=(build,), daemon=True, name="lss-index-build"
    )
    child.start()
    _BACKGROUND.append(child)
    return True


def _silently(build: Callable[[], None]) -> None:
    try:
        with (
            open(os.devnull, "w") as null,
            contextlib.redirect_stdout(null),
            contextlib.redirect_stderr(null),
        ):
            build()
    except (
        BaseException
    ):  # the dataset that waits for this child builds the index itself and reports the error
        os._exit(1)


def wait_for_background_builds(timeout_s: float = BACKGROUND_WAIT_S) -> bool:
    """Wait for this process's background builds; whether there were any. One still running after
    `timeout_s` is stopped (the caller then builds the index itself)."""
    waited = bool(_BACKGROUND)
    while _BACKGROUND:
        child = _BACKGROUND.pop()
        child.join(timeout_s)
        if child.is_alive():
            child.terminate()
            child.join()
    return waited
