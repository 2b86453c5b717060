"""Camera images kept decoded on disk (data.decoded_cache), so that later epochs skip the JPEG decode.

A loader worker spends about 40 % of a training sample on decoding its six JPEGs (docs/benchmarks.md). With the cache
on, each image is stored the first time it is decoded, at the DCT scale the decode used (1/4 of 1600 x 900 for the
128 x 352 final_dim: 400 x 225 x 3 bytes, 0.27 MB, so about 1.6 MB per sample), and read back in later epochs;
resize, crop, flip and rotation still run on every load, so augmentation is unchanged and the batches are the same
as without the cache. Files live in the cache folder of lss.data.index_cache (folder decoded/); the key is the
image's absolute path, size and modification time and the scale, so a changed image is decoded again. An entry that
cannot be read (truncated, wrong shape) is decoded again and rewritten; an entry that cannot be written is skipped.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from lss.data.index_cache import cache_dir, write_cache_file

FORMAT = 1  # bump when what is stored changes


@dataclass(frozen=True)
class DecodedImages:
    """The decoded-image cache under `root` (default: cache_dir() / "decoded")."""

    root: Path = field(default_factory=lambda: cache_dir() / "decoded")

    def _file(self, path: str, scale: int) -> Optional[Path]:
        try:
            st = os.stat(path)
        except OSError:
            return None
        key = hashlib.sha1(
            f"{FORMAT}|{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{scale}".encode()
        )
        name = key.hexdigest()
        return self.root / name[:2] / f"{name}.npy"

    def load(self, path: str, scale: int, shape: tuple[int, ...]) -> Optional[np.ndarray]:
        """The stored decode of image `path` at DCT scale 1/scale, or None when there is no valid one."""
        file = self._file(path, scale)
        if file is None:
            return None
        try:
            image = np.load(file, allow_pickle=False)
        except (OSError, ValueError, EOFError):
            return None
        return image if image.shape == shape and image.dtype == np.uint8 else None

    def store(self, path: str, image: np.ndarray, scale: int) -> None:
        file = self._file(path, scale)
        if file is not None:
            write_cache_file(file, lambda f: np.save(f, image, allow_pickle=False))
