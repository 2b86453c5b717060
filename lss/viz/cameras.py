"""The camera mosaic: the six cameras as nuScenes lays them out (front row FL / F / FR, back row BL
/ B / BR)."""

from __future__ import annotations

from typing import Sequence

import cv2
import numpy as np
import torch

FRONT_ROW = ("CAM_FRONT_LEFT", "CAM_FRONT", "CAM_FRONT_RIGHT")
BACK_ROW = ("CAM_BACK_LEFT", "CAM_BACK", "CAM_BACK_RIGHT")
CAMERA_TILE_WIDTH = 352
LABEL_COLOR = (255, 255, 0)


def denormalize(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """N x 3 x H x W images (normalised float, or uint8 RGB as data.image_dtype "uint8" yields
    them) -> N x H x W x 3 uint8 RGB."""
    if images.dtype == torch.uint8:
        return np.ascontiguousarray(images.detach().cpu().numpy().transpose(0, 2, 3, 1))
    # numpy, not torch: torch's thread pool costs more than the arithmetic on a busy CPU
    m = np.asarray(mean, np.float32).reshape(1, 3, 1, 1)
    s = np.asarray(std, np.float32).reshape(1, 3, 1, 1)
    rgb = np.rint(np.clip(images.detach().float().cpu().numpy() * s + m, 0, 1) * 255)
    return np.ascontiguousarray(rgb.astype(np.uint8).transpose(0, 2, 3, 1))


def tile_height(image_size: Sequence[int], tile_width: int = CAMERA_TILE_WIDTH) -> int:
    """The height of a mosaic tile `tile_width` wide for images of image_size = (height, width)."""
    return max(1, round(image_size[0] * tile_width / image_size[1]))


def camera_mosaic(
    images: np.ndarray, cameras: Sequence[str], tile_width: int = CAMERA_TILE_WIDTH
) -> np.ndarray:
    """N x H x W x 3 uint8 images named by `cameras` -> one image of 2 x 3 tiles, each `tile_width`
    wide: front row FL/F/FR, back row BL/B/BR (a camera that is not in `cameras` stays black)."""
    if len(images) != len(cameras):
        raise ValueError(
            f"camera_mosaic: {len(images)} images but {len(cameras)} camera names "
            f"({list(cameras)}); pass one name per image, in the order of the images (data.cameras)"
        )
    tile_h = tile_height(images.shape[1:3], tile_width)
    rows = []
    for row in (FRONT_ROW, BACK_ROW):
        tiles = []
        for name in row:
            tile = np.zeros((tile_h, tile_width, 3), np.uint8)
            if name in cameras:
                tile = cv2.resize(
                    images[list(cameras).index(name)],
                    (tile_width, tile_h),
                    interpolation=cv2.INTER_LINEAR,
                )
                if tile_h >= 40:  # a label only where the tile can hold it
                    cv2.putText(
                        tile,
                        name.replace("CAM_", ""),
                        (6, 18),
                        cv2.FONT_HERSHEY_SIMPLEX,
                        0.5,
                        LABEL_COLOR,
                        1,
                        cv2.LINE_AA,
                    )
            tiles.append(tile)
        rows.append(np.concatenate(tiles, axis=1))
    return np.concatenate(rows, axis=0)
