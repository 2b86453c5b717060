"""Arithmetic of the generator that rounds the same on every CPU, so that a seed gives the same set
on every machine.

numpy's `@`, `np.dot`, `np.linalg` (and pyquaternion's rotation matrix, built on them) run in
BLAS/LAPACK kernels chosen for the CPU, which sum in other orders and fuse multiply-adds
differently; cv2.resize of float images runs in IPP code chosen for the CPU; np.exp of float64 has
its own AVX-512 code. They moved object edges and ground texels by a pixel between CPUs.
Elementwise multiplies and adds in a fixed order, and the C library's exp, round the same
everywhere.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

# cubic convolution kernel parameter of cv2.INTER_CUBIC
CUBIC_A = -0.75


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b for a: ... x M x K (or K) and b: K x N (or K), summed over K in index order. Returns
    the shape of a @ b."""
    a, b = np.asarray(a), np.asarray(b)
    if a.ndim == 1 and b.ndim == 1:
        return np.asarray(dot(a, b))
    a2 = a[None, :] if a.ndim == 1 else a
    b2 = b[:, None] if b.ndim == 1 else b
    out = a2[..., :, 0:1] * b2[0:1, :]
    for j in range(1, a2.shape[-1]):
        out = out + a2[..., :, j : j + 1] * b2[j : j + 1, :]
    if b.ndim == 1:
        out = out[..., 0]
    return out[0] if a.ndim == 1 else out


def dot(a: Sequence[float], b: Sequence[float]) -> float:
    """Dot product of two vectors, summed in index order."""
    total = 0.0
    for x, y in zip(np.asarray(a, np.float64).tolist(), np.asarray(b, np.float64).tolist()):
        total += x * y
    return total


def matvec(m: np.ndarray, v: np.ndarray) -> np.ndarray:
    """m @ v for stacks of matrices m (... x M x K) and vectors v (... x K), broadcast against each
    other, summed over K in index order (each element rounds as in matmul). Returns ... x M."""
    out = m[..., 0] * v[..., None, 0]
    for j in range(1, m.shape[-1]):
        out = out + m[..., j] * v[..., None, j]
    return out


def dots(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Dot products over the last axis of a and b (broadcast), each summed in index order as in
    dot."""
    total = 0.0 + a[..., 0] * b[..., 0]
    for j in range(1, a.shape[-1]):
        total = total + a[..., j] * b[..., j]
    return total


def _cross(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cross products over the last axis, each component rounded as in np.cross."""
    a0, a1, a2 = a[..., 0], a[..., 1], a[..., 2]
    b0, b1, b2 = b[..., 0], b[..., 1], b[..., 2]
    return np.stack([a1 * b2 - a2 * b1, a2 * b0 - a0 * b2, a0 * b1 - a1 * b0], -1)


def inverses3(m: np.ndarray) -> np.ndarray:
    """inverse3 of each 3 x 3 matrix of a stack (... x 3 x 3)."""
    a, b, c = m[..., :, 0], m[..., :, 1], m[..., :, 2]
    rows = np.stack([_cross(b, c), _cross(c, a), _cross(a, b)], -2)
    return rows / dots(a, rows[..., 0, :])[..., None, None]


def norm(v: Sequence[float]) -> float:
    """Euclidean length of a vector."""
    return math.sqrt(dot(v, v))


def inverse3(m: np.ndarray) -> np.ndarray:
    """Inverse of a 3 x 3 matrix by cross products."""
    m = np.asarray(m, np.float64)
    a, b, c = m[:, 0], m[:, 1], m[:, 2]
    rows = np.stack([np.cross(b, c), np.cross(c, a), np.cross(a, b)])
    return rows / dot(a, rows[0])


def quaternion_matrix(q: Sequence[float]) -> np.ndarray:
    """3 x 3 rotation matrix of the quaternion q = (w, x, y, z), normalised first."""
    n = norm(q)
    w, x, y, z = (float(v) / n for v in q)
    return np.array(
        [
            [1.0 - 2.0 * (y * y + z * z), 2.0 * (x * y - w * z), 2.0 * (x * z + w * y)],
            [2.0 * (x * y + w * z), 1.0 - 2.0 * (x * x + z * z), 2.0 * (y * z - w * x)],
            [2.0 * (x * z - w * y), 2.0 * (y * z + w * x), 1.0 - 2.0 * (x * x + y * y)],
        ]
    )


def exp(x: np.ndarray) -> np.ndarray:
    """Elementwise e**x of a float array, by the C library's exp (float64)."""
    x = np.asarray(x, np.float64)
    return np.fromiter(map(math.exp, x.ravel().tolist()), np.float64, x.size).reshape(x.shape)


def _cubic_taps(src_len: int, dst_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Source indices (4 x dst_len, clamped to the edge) and weights (4 x dst_len) of a cubic
    resize from src_len to dst_len samples, pixel centres aligned as in cv2.resize."""
    pos = (np.arange(dst_len, dtype=np.float64) + 0.5) * (src_len / dst_len) - 0.5
    left = np.floor(pos)
    f = pos - left
    x = np.stack([1.0 + f, f, 1.0 - f, 2.0 - f])  # distance to each of the four taps
    near = ((CUBIC_A + 2.0) * x - (CUBIC_A + 3.0)) * x * x + 1.0
    far = ((CUBIC_A * x - 5.0 * CUBIC_A) * x + 8.0 * CUBIC_A) * x - 4.0 * CUBIC_A
    weights = np.where(x <= 1.0, near, far)
    index = np.clip(left.astype(np.int64)[None, :] + np.arange(-1, 3)[:, None], 0, src_len - 1)
    return index, weights


def resize_cubic(src: np.ndarray, size: tuple[int, int], dtype=np.float32) -> np.ndarray:
    """A 2-D float image resized to size (width, height) by cubic convolution (cv2.INTER_CUBIC's
    kernel and pixel alignment, edges replicated), cast to `dtype` (truncating, as astype does).
    Returns height x width."""
    w, h = size
    src = np.asarray(src, np.float64)
    rows, wy = _cubic_taps(src.shape[0], h)
    cols, wx = _cubic_taps(src.shape[1], w)
    tall = wy[0][:, None] * src[rows[0]]
    for j in range(1, 4):
        tall = tall + wy[j][:, None] * src[rows[j]]  # h x source width
    # An upsampling reads the same four source columns for runs of output columns: each run is a
    # product of a source column and a run of weights, without gathering a full-size image.
    tall_t = np.ascontiguousarray(tall.T)  # source width x h
    out = np.empty((h, w), dtype)
    starts = np.flatnonzero(np.r_[True, np.any(cols[:, 1:] != cols[:, :-1], 0)]).tolist()
    for a, b in zip(starts, starts[1:] + [w]):
        acc = tall_t[cols[0, a]][:, None] * wx[0, a:b]
        for j in range(1, 4):
            acc += tall_t[cols[j, a]][:, None] * wx[j, a:b]
        out[:, a:b] = acc
    return out
