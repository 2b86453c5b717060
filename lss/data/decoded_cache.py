"""Camera images kept decoded on disk (data.decoded_cache), so that later epochs skip the JPEG
decode.

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


def _source_header(path: str, scale: int) -> Optional[bytes]:
    """One line that identifies the decode of image `path` at 1/scale as it is on disk now, or None
    when the image cannot be read. The status-change time moves on every write to the file, also
    when the modification time is set back."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    source = (
        f"{FORMAT}|{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{scale}"
    )
    return (
        _MAGIC
        + hashlib.sha256(source.encode("utf-8", "surrogateescape")).hexdigest().encode()
        + b"\n"
    )


@dataclass(frozen=True)
class DecodedImages:
    """The decoded-image cache under `root` (default: cache_dir() / "decoded")."""

    root: Path = field(default_factory=lambda: cache_dir() / "decoded")

    def _file(self, path: str, scale: int) -> Path:
        key = f"{FORMAT}|{os.path.abspath(path)}|{scale}".encode("utf-8", "surrogateescape")
        name = hashlib.sha1(key).hexdigest()
        return self.root / name[:2] / f"{name}.npy"

    def load(self, path: str, scale: int, shape: tuple[int, ...]) -> Optional[np.ndarray]:
        """The stored decode of image `path` at DCT scale 1/scale, or None when there is no valid
        one for the image as it is now."""
        header = _source_header(path, scale)
        if header is None:
            return None
        try:
            with open(self._file(path, scale), "rb") as f:
                if f.readline() != header:
                    return None
                image = np.load(f, allow_pickle=False)
        except (OSError, ValueError, EOFError):
            return None
        return image if image.shape == shape and image.dtype == np.uint8 else None

    def store(self, path: str, image: np.ndarray, scale: int) -> None:
        header = _source_header(path, scale)
        if header is None:
            return

        def write(f) -> None:
            f.write(header)
            np.save(f, image, allow_pickle=False)

        write_cache_file(self._file(path, scale), write)
