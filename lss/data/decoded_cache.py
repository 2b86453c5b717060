"""Camera images kept decoded on disk (data.decoded_cache), so that later epochs skip the JPEG
decode; with depth targets also each lidar sweep's projection into each camera, so that later
epochs skip reading the sweep and projecting it (only the augmentation is applied again).

Decoding its six JPEGs is a large part of a loader worker's time per sample (docs/data.md).
With the cache on, each image is stored the first time it is decoded, at the
DCT scale the decode used (1/4 of 1600 x 900 for the 128 x 352 final_dim: 400 x 225 x 3 bytes, 0.27
MB, so about 1.6 MB per sample), and read back in later epochs; resize, crop, flip and rotation
still run on every load, so augmentation is unchanged and the batches are the same as without the
cache. Files live in the cache folder of lss.data.index_cache (folder decoded/), one per image path
and scale. Each entry starts with a header that identifies its source: a hash of the image's
absolute path, size, modification time and status-change time, and the scale. An entry is used only
when that header matches the image on disk now, so an image rewritten since (even with its old size
and modification time restored) or an entry file swapped for another image's is decoded again and
rewritten; so is an entry that cannot be read (truncated, wrong shape). An entry that cannot be
written is skipped.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from lss.data.index_cache import cache_dir, write_cache_file

FORMAT = 2  # bump when what is stored changes
_MAGIC = b"LSSDEC"


def _source_header(path: str, tag: str) -> Optional[bytes]:
    """One line that identifies what an entry holds of file `path` (`tag`: the decode's scale, or
    the camera a lidar sweep was projected into) as the file is on disk now, or None when it cannot
    be read. The status-change time moves on every write to the file, also when the modification
    time is set back."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    stamp = f"{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"
    source = f"{FORMAT}|{os.path.abspath(path)}|{stamp}|{tag}"
    return (
        _MAGIC
        + hashlib.sha256(source.encode("utf-8", "surrogateescape")).hexdigest().encode()
        + b"\n"
    )


@dataclass(frozen=True)
class _Entries:
    """Arrays derived from a source file, one entry file per (source path, tag) under `root`."""

    root: Path

    def _file(self, path: str, tag: str) -> Path:
        key = f"{FORMAT}|{os.path.abspath(path)}|{tag}".encode("utf-8", "surrogateescape")
        name = hashlib.sha1(key).hexdigest()
        return self.root / name[:2] / f"{name}.npy"

    def _read(self, path: str, tag: str, count: int) -> Optional[list[np.ndarray]]:
        """The `count` arrays of the entry, or None when there is no valid one for the source as it
        is now."""
        header = _source_header(path, tag)
        if header is None:
            return None
        try:
            with open(self._file(path, tag), "rb") as f:
                if f.readline() != header:
                    return None
                return [np.load(f, allow_pickle=False) for _ in range(count)]
        except (OSError, ValueError, EOFError):
            return None

    def _write(self, path: str, tag: str, arrays: tuple[np.ndarray, ...]) -> None:
        header = _source_header(path, tag)
        if header is None:
            return

        def write(f) -> None:
            f.write(header)
            for array in arrays:
                np.save(f, array, allow_pickle=False)

        write_cache_file(self._file(path, tag), write)


@dataclass(frozen=True)
class DecodedImages(_Entries):
    """The decoded-image cache under `root` (default: cache_dir() / "decoded")."""

    root: Path = field(default_factory=lambda: cache_dir() / "decoded")

    def load(self, path: str, scale: int, shape: tuple[int, ...]) -> Optional[np.ndarray]:
        """The stored decode of image `path` at DCT scale 1/scale, or None when there is no valid
        one for the image as it is now."""
        arrays = self._read(path, str(scale), 1)
        if arrays is None or arrays[0].shape != shape or arrays[0].dtype != np.uint8:
            return None
        return arrays[0]

    def store(self, path: str, image: np.ndarray, scale: int) -> None:
        self._write(path, str(scale), (image,))


def camera_tag(lidar_to_camera: np.ndarray, intrinsics: np.ndarray, image_size) -> str:
    """What a lidar sweep's projection into one camera depends on besides the sweep: its lidar ->
    camera matrix, intrinsics and source image size (a digest)."""
    parts = (
        np.ascontiguousarray(lidar_to_camera, np.float64),
        np.ascontiguousarray(intrinsics, np.float64),
        np.ascontiguousarray(image_size, np.int64),
    )
    return hashlib.sha1(b"".join(p.tobytes() for p in parts)).hexdigest()


@dataclass(frozen=True)
class LidarProjections(_Entries):
    """A lidar sweep's returns in front of one camera and inside its source image (pixels M x 2,
    depth M, float64: lss.data.depth.source_projection), kept on disk under `root` (default:
    cache_dir() / "lidar") so that later epochs only apply the image augmentation to them."""

    root: Path = field(default_factory=lambda: cache_dir() / "lidar")

    def load(self, path: str, tag: str) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """(pixels, depth) of sweep `path` in the camera `tag` (camera_tag), or None."""
        arrays = self._read(path, tag, 2)
        if arrays is None:
            return None
        pixels, depth = arrays
        ok = (
            pixels.dtype == depth.dtype == np.float64
            and pixels.ndim == 2
            and pixels.shape[1] == 2
            and depth.shape == (len(pixels),)
        )
        return (pixels, depth) if ok else None

    def store(self, path: str, tag: str, pixels: np.ndarray, depth: np.ndarray) -> None:
        self._write(path, tag, (pixels, depth))
