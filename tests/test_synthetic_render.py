"""The renderer's array helpers: the fast pixel scatter and the kind-sorted painting equal the plain
numpy indexing they replace, and refuse what they cannot handle."""

import numpy as np
import pytest

from lss.data.synthetic import render


def test_put_pixels_equals_indexed_assignment():
    rng = np.random.default_rng(0)
    img = rng.random((7, 9, 3), dtype=np.float32)
    pix = rng.permutation(63)[:20]
    rgb = rng.random((20, 3), dtype=np.float32)
    expected = img.copy()
    expected.reshape(-1, 3)[pix] = rgb
    render._put_pixels(img, pix, rgb)
    np.testing.assert_array_equal(img, expected)


def test_put_pixels_refuses_an_image_it_would_not_write_into():
    img = np.zeros((4, 6, 3), np.float32)
    with pytest.raises(ValueError, match="C-contiguous"):
        render._put_pixels(img[:, ::2], np.array([0]), np.ones((1, 3), np.float32))
    with pytest.raises(ValueError, match="float32"):
        render._put_pixels(img.astype(np.float64), np.array([0]), np.ones((1, 3), np.float32))


def _faces(rng, n):
    kinds = rng.integers(0, render.BUILDING + 1, n)
    kinds[:2] = (render.CAR, render.BUILDING)
    return {
        "kind": kinds,
        "type": rng.integers(0, 5, n),
        "color": rng.uniform(0, 255, (n, 3)),
        "shade": rng.uniform(0.5, 1.05, n),
        "extent": rng.uniform(0.5, 30.0, (n, 2)),
    }


def test_paint_pixels_paints_each_pixel_as_its_kind_does():
    rng = np.random.default_rng(1)
    faces = _faces(rng, 12)
    fid = rng.integers(0, 12, 500)
    fid = fid[np.argsort(faces["kind"][fid], kind="stable")]
    s, t = rng.uniform(-0.1, 1.1, (2, 500)).astype(np.float32)
    got = render._paint_pixels(faces, fid, s, t)
    # each pixel painted alone by its kind's rule, times its face's shade
    for i in range(0, 500, 7):
        f = fid[i : i + 1]
        one = (
            render._paint_kind(
                int(faces["kind"][f[0]]),
                faces["type"][f],
                np.clip(s[i : i + 1], 0.0, 1.0),
                np.clip(t[i : i + 1], 0.0, 1.0),
                faces["color"][f].astype(np.float32),
                faces["extent"][f],
            )
            * faces["shade"][f].astype(np.float32)[:, None]
        )
        np.testing.assert_array_equal(got[i], one[0])


def test_paint_pixels_refuses_pixels_not_sorted_by_kind():
    rng = np.random.default_rng(2)
    faces = _faces(rng, 4)
    fid = np.array([1, 0])  # a building's face before a car's
    with pytest.raises(ValueError, match="sorted"):
        render._paint_pixels(faces, fid, np.zeros(2, np.float32), np.zeros(2, np.float32))
