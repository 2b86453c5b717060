"""The original LSS code's image path, augmentation matrices and ground-truth raster, as switches
for ablations (docs/accuracy.md).

lss's own conventions are exact (lss.geometry, lss.data.transforms, lss.data.targets); these
reproduce what the 2020 code (nv-tlabs/lift-splat-shoot) does instead, so that a recipe can measure
what each difference costs:
- `data.image_resize: pil`: the whole JPEG decoded by PIL, resized by PIL (bicubic), cropped,
  flipped and rotated by PIL (nearest-neighbour rotation). PIL's resize scales pixel edges and its
  rotation turns about the image centre, so the exact matrices of lss.geometry describe its output.
- `data.post_matrices: original`: post_rot / post_trans composed as the original does: the drawn
  resize factor (not the whole-pixel size it gives) with no half-pixel terms, a flip about W
  instead of W - 1, the rotation about (W / 2, H / 2); off the content by up to about a pixel.
- `data.target_raster: original`: box corners rounded to whole cells and filled at pixel centres
  (OpenCV, boundary included): masks half a cell off the boxes.
"""

from __future__ import annotations

import io
import math

import cv2
import numpy as np
from PIL import Image

from lss.geometry import (
    BevGrid,
    ImageAugmentation,
    affine_to_post,
    crop_flip_rotate_affine,
    resize_affine,
)


def load_augmented_pil(
    data: bytes, image_size: tuple[int, int], aug: ImageAugmentation, final_dim: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode one encoded camera image of `image_size` (W, H) in full with PIL, then resize
    (bicubic, PIL's default for RGB), crop, flip and rotate (nearest) it with PIL. Returns
    (final_dim H x W x 3 uint8 RGB, post_rot 3 x 3, post_trans 3), the matrices mapping source
    pixels to the returned image's pixels. Raises OSError when the data cannot be decoded or its
    size is not `image_size`."""
    if not data:
        raise OSError("the file is empty (0 bytes; expected a JPEG or PNG file): re-extract it")
    with Image.open(io.BytesIO(data)) as opened:
        if opened.size != tuple(image_size):
            raise OSError(
                f"image is {opened.size[0]}x{opened.size[1]} pixels, expected "
                f"{image_size[0]}x{image_size[1]} (the size recorded for it); re-extract the file "
                "or fix the sample_data table"
            )
        image = opened.convert("RGB")
    out_h, out_w = final_dim
    left, top = aug.crop
    image = image.resize(aug.resize_dims, Image.Resampling.BICUBIC)
    image = image.crop((left, top, left + out_w, top + out_h))
    if aug.flip:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    image = image.rotate(aug.rotate, resample=Image.Resampling.NEAREST)
    scale = (aug.resize_dims[0] / image_size[0], aug.resize_dims[1] / image_size[1])
    post_rot, post_trans = affine_to_post(
        crop_flip_rotate_affine(aug, final_dim) @ resize_affine(*scale)
    )
    return np.asarray(image), post_rot, post_trans


def original_post_matrices(
    aug: ImageAugmentation, final_dim: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """(post_rot 3 x 3, post_trans 3) float32 of `aug` as the original code composes them: scale
    by the drawn factor aug.resize, shift by the crop, mirror u -> W - u when flipped, rotate about
    (W / 2, H / 2)."""
    if aug.resize is None:
        raise ValueError(
            "original_post_matrices needs the drawn resize factor (ImageAugmentation.resize); "
            "draw the augmentation with lss.data.transforms.sample_augmentation"
        )
    out_h, out_w = final_dim
    left, top = aug.crop
    m = np.array([[aug.resize, 0.0, -left], [0.0, aug.resize, -top], [0.0, 0.0, 1.0]])
    if aug.flip:
        m = np.array([[-1.0, 0.0, float(out_w)], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]) @ m
    c, s = math.cos(math.radians(aug.rotate)), math.sin(math.radians(aug.rotate))
    rot = np.array([[c, s], [-s, c]])
    centre = np.array([out_w / 2.0, out_h / 2.0])
    turn = np.eye(3)
    turn[:2, :2] = rot
    turn[:2, 2] = centre - rot @ centre
    return affine_to_post(turn @ m)


def rasterize_footprints_original(
    canvas: np.ndarray, footprints: np.ndarray, grid: BevGrid
) -> np.ndarray:
    """Fill M x 4 x 2 box footprints (ego metres) into `canvas` (nx x ny uint8) with 1 as the
    original code does: each corner rounded to the nearest whole cell coordinate of `grid` (0 = its
    lower edge) and the polygon filled with OpenCV, which takes those integers as pixel centres and
    marks its boundary too."""
    for corners in np.asarray(footprints, dtype=np.float64).reshape(-1, 4, 2):
        rows = np.round(grid.to_cells(corners[:, 0], 0))
        cols = np.round(grid.to_cells(corners[:, 1], 1))
        points = np.stack([cols, rows], axis=-1).astype(np.int32)
        cv2.fillPoly(canvas, [points], 1)
    return canvas
