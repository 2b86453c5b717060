"""Camera image augmentation (the LSS recipe) with exact bookkeeping of the image-plane affine.

Pixel convention (owned by lss.geometry, which builds every matrix used here): integer (u, v) is the
CENTRE of a pixel (as in OpenCV and in the nuScenes intrinsics), u to the right, v down, and a
resize scales pixel EDGES. Every augmentation is one affine map `A` from source pixels to augmented
pixels; `post_rot` / `post_trans` are that map lifted to 3-D so that
`post_rot @ (u, v, d) + post_trans = (A(u, v), d)`.

Decoding path (fast and anti-aliased): JPEG DCT-domain downscaling by 1/2, 1/4 or 1/8 (OpenCV's
reduced-size libjpeg decode, as PIL's `draft` picks the scale), an area resize to the sampled resize
size, then one `cv2.warpAffine` for crop + flip + rotation straight to final_dim.
The reported matrix is the composition of exactly these maps, so projected points land on the same
content.
"""

from __future__ import annotations

import io
from typing import Optional, Union

import cv2
import numpy as np
from PIL import Image

from lss.config.schema import DataConfig
from lss.data.original_conventions import load_augmented_pil, original_post_matrices
from lss.geometry import (
    ImageAugmentation,
    affine_to_post,
    crop_flip_rotate_affine,
    resize_affine,
    resized_window,
    val_augmentation,
)

# One OpenCV thread per process (forked loader workers inherit it): parallelism comes from the
# workers, and a thread pool started in the parent before DataLoader forks them can deadlock them
# (seen on a 16-core machine).
cv2.setNumThreads(1)


def sample_augmentation(
    image_size: tuple[int, int],
    final_dim: tuple[int, int],
    resize_lim: tuple[float, float],
    bot_pct_lim: tuple[float, float],
    rot_lim: tuple[float, float],
    rand_flip: bool,
    is_train: bool,
    rng: Optional[np.random.Generator] = None,
) -> ImageAugmentation:
    """Draw the LSS augmentation for a source image of `image_size` (W, H) and output `final_dim`
    (H, W).

    Train: resize by U(resize_lim), crop a final_dim window whose bottom edge is U(bot_pct_lim) of
    the resized height above the image bottom (horizontally uniform), flip with p=0.5 when
    rand_flip, rotate by U(rot_lim).
    Validation: the smallest resize that covers final_dim, the mean bottom crop, centred
    horizontally; no flip or rotation.
    """
    width, height = image_size
    out_h, out_w = final_dim
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive (W, H), got {image_size}")
    if not is_train:
        return val_augmentation(image_size, final_dim, bot_pct_lim)
    if rng is None:
        raise ValueError("sample_augmentation(is_train=True) needs an rng (numpy Generator)")
    resize = rng.uniform(*resize_lim)
    bot_pct = rng.uniform(*bot_pct_lim)
    new_w, new_h, top = resized_window(image_size, final_dim, resize, bot_pct)
    left = int(rng.uniform(0, max(0, new_w - out_w)))
    flip = bool(rand_flip and rng.uniform() < 0.5)
    rotate = float(rng.uniform(*rot_lim))
    return ImageAugmentation((max(new_w, 1), max(new_h, 1)), (left, top), flip, rotate, resize)


_JPEG_SCALES = (8, 4, 2, 1)
_REDUCED_FLAGS = {
    1: cv2.IMREAD_COLOR,
    2: cv2.IMREAD_REDUCED_COLOR_2,
    4: cv2.IMREAD_REDUCED_COLOR_4,
    8: cv2.IMREAD_REDUCED_COLOR_8,
}


def is_jpeg(data: bytes) -> bool:
    return data[:3] == b"\xff\xd8\xff"


def image_size_from_header(data: bytes) -> tuple[int, int]:
    """(W, H) of an encoded image from its header only (no pixel decoding)."""
    if not data:
        raise OSError("the file is empty (0 bytes; expected a JPEG or PNG file): re-extract it")
    with Image.open(io.BytesIO(data)) as im:
        return im.size


def jpeg_scale(image_size: tuple[int, int], resize_dims: tuple[int, int]) -> int:
    """The largest DCT scale denominator k in {1, 2, 4, 8} whose decoded image still covers
    resize_dims."""
    ratio = min(image_size[0] // max(resize_dims[0], 1), image_size[1] // max(resize_dims[1], 1))
    return next((k for k in _JPEG_SCALES if ratio >= k), 1)


def scaled_shape(image_size: tuple[int, int], scale: int) -> tuple[int, int, int]:
    """H x W x 3 of an image of `image_size` (W, H) decoded at DCT scale 1/scale."""
    width, height = image_size
    return -(-height // scale), -(-width // scale), 3


def decode_scaled(
    data: bytes, image_size: tuple[int, int], resize_dims: tuple[int, int]
) -> tuple[np.ndarray, int]:
    """Decode an encoded image of `image_size` (W, H), a JPEG at the largest DCT scale 1/k that
    still covers resize_dims (W, H). Returns (BGR uint8 array, k); libjpeg's output pixel r covers
    source pixels [k*r, k*(r+1)) (the last one padded), so the decoded image's edges scale by
    exactly 1/k.
    Raises OSError when the data cannot be decoded or its size is not `image_size`.
    """
    width, height = image_size
    if not data:
        raise OSError("the file is empty (0 bytes; expected a JPEG or PNG file): re-extract it")
    k = jpeg_scale(image_size, resize_dims) if is_jpeg(data) else 1
    try:
        decoded = cv2.imdecode(
            np.frombuffer(data, dtype=np.uint8), _REDUCED_FLAGS[k] | cv2.IMREAD_IGNORE_ORIENTATION
        )
    except cv2.error as e:  # OpenCV asserts on some corrupt streams instead of returning None
        raise OSError(
            f"not a decodable image ({len(data)} bytes; OpenCV: {str(e).strip().splitlines()[-1]})"
        ) from None
    if decoded is None:
        raise OSError(f"not a decodable image ({len(data)} bytes; expected a JPEG or PNG file)")
    if decoded.shape != scaled_shape(image_size, k):
        raise OSError(
            f"image is {decoded.shape[1] * k}x{decoded.shape[0] * k} pixels, expected "
            f"{width}x{height} (the size recorded for it); re-extract the file or fix the "
            "sample_data table"
        )
    return decoded, k


def resize_decoded(
    decoded: np.ndarray, scale: int, resize_dims: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """Resize an image decoded at DCT scale 1/scale to resize_dims (W, H), anti-aliased (area when
    shrinking).
    Returns (H x W x 3 uint8 array, 3 x 3 affine from source pixels to the returned pixels)."""
    dec_h, dec_w = decoded.shape[:2]
    new_w, new_h = resize_dims
    if (dec_w, dec_h) != (new_w, new_h):
        shrinking = new_w < dec_w and new_h < dec_h
        decoded = cv2.resize(
            decoded, (new_w, new_h), interpolation=cv2.INTER_AREA if shrinking else cv2.INTER_LINEAR
        )
    return decoded, resize_affine(new_w / (dec_w * scale), new_h / (dec_h * scale))


def decode_resized(
    data: bytes, image_size: tuple[int, int], resize_dims: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """Decode an encoded image of `image_size` (W, H) to BGR uint8 of size resize_dims (W, H),
    anti-aliased (decode_scaled, then resize_decoded). Returns (H x W x 3 uint8 BGR array, 3 x 3
    affine from source pixels to the returned pixels)."""
    return resize_decoded(*decode_scaled(data, image_size, resize_dims), resize_dims)


def load_augmented_image(
    data: bytes, image_size: tuple[int, int], aug: ImageAugmentation, final_dim: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode, resize, crop, flip and rotate one encoded camera image of `image_size` (W, H).

    Returns (final_dim H x W x 3 uint8 RGB, post_rot 3 x 3, post_trans 3) with post_* mapping source
    pixels to the returned image's pixels. Areas outside the source image are black.
    """
    return augment_decoded(*decode_scaled(data, image_size, aug.resize_dims), aug, final_dim)


def augment_decoded(
    decoded: np.ndarray, scale: int, aug: ImageAugmentation, final_dim: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """load_augmented_image from an image already decoded at DCT scale 1/scale (decode_scaled)."""
    resized, resize_m = resize_decoded(decoded, scale, aug.resize_dims)
    warp = crop_flip_rotate_affine(aug, final_dim)
    out_h, out_w = final_dim
    image = cv2.warpAffine(
        resized,
        warp[:2].astype(np.float64),
        (out_w, out_h),
        flags=cv2.INTER_LINEAR,
        borderMode=cv2.BORDER_CONSTANT,
        borderValue=(0, 0, 0),
    )
    post_rot, post_trans = affine_to_post(warp @ resize_m)
    # Channel swap after the warp: on final_dim pixels it is the cheapest place.
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB), post_rot, post_trans


def augment_image(
    source: Union[bytes, tuple[np.ndarray, int]],
    size: tuple[int, int],
    aug: ImageAugmentation,
    data: DataConfig,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One camera image of `size` (W, H) as the data path makes it, data.image_resize and
    data.post_matrices included: (final_dim H x W x 3 uint8 RGB, post_rot 3 x 3, post_trans 3).
    `source`: the encoded file, or the image already decoded as (BGR uint8 array, DCT scale k)
    (decode_scaled; pixels decoded in full: k = 1)."""
    final_dim = tuple(data.final_dim)
    if data.image_resize == "pil":
        if not isinstance(source, bytes):  # PNG is lossless: PIL decodes the pixels as they are
            source = cv2.imencode(".png", source[0])[1].tobytes()
        image, rot, trans = load_augmented_pil(source, size, aug, final_dim)
    else:
        encoded = isinstance(source, bytes)
        decoded = decode_scaled(source, size, aug.resize_dims) if encoded else source
        image, rot, trans = augment_decoded(*decoded, aug, final_dim)
    if data.post_matrices == "original":
        rot, trans = original_post_matrices(aug, final_dim)
    return image, rot, trans
