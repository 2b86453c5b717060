"""nuScenes multi-camera BEV dataset: one split's samples as network inputs and BEV targets.

Everything a sample needs except its pixels comes from the split's index (lss.data.sample_index),
built once from the tables and maps, so `__getitem__` only decodes images and rasterizes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import cv2
import numpy as np
import torch

from lss.geometry.boxes import DETECTION_CLASSES, dense_targets
from lss.config import Config, DataConfig
from lss.data import targets as T
from lss.data.bev_augmentation import BevAugmentation, sample_bev_augmentation
from lss.data.classes import class_kinds
from lss.data.decoded_cache import DecodedImages, LidarProjections, camera_tag
from lss.data.depth import depth_targets_from_projections, load_lidar_points, source_projection
from lss.data.original_conventions import rasterize_footprints_original
from lss.data.sample_index import INDEX_FIELDS, previous_at_gap, split_index
from lss.data.tables import (
    DatasetNotFoundError,
    MapNotFoundError,
    SampleError,
    SampleFileNotFoundError,
    load_tables,
    locate_dataroot,
    resolve_split,
)
from lss.data.transforms import (
    augment_image,
    decode_scaled,
    image_size_from_header,
    jpeg_scale,
    sample_augmentation,
    scaled_shape,
)
from lss.geometry import BevGrid, ImageAugmentation
from lss.geometry.camera import pixel_lut

__all__ = [
    "INDEX_FIELDS",
    "DatasetNotFoundError",
    "MapNotFoundError",
    "NuScenesBEV",
    "load_tables",
    "locate_dataroot",
    "image_tensor",
    "normalize_images",
    "resolve_split",
]


def normalize_images(images: Sequence[np.ndarray], lut: np.ndarray) -> torch.Tensor:
    """N images H x W x 3 uint8 RGB -> N x 3 x H x W float32 through a 256 x 3 per-channel lookup
    table."""
    if not len(images):
        return torch.zeros(0, 3, 0, 0)
    out = np.empty((len(images), 3, *images[0].shape[:2]), dtype=np.float32)
    planes = [np.ascontiguousarray(lut[:, c]) for c in range(3)]
    for n, image in enumerate(images):
        # cv2.LUT on contiguous planes is much faster than numpy fancy indexing of interleaved
        # channels.
        for c, plane in enumerate(cv2.split(image)):
            out[n, c] = cv2.LUT(plane, planes[c])
    return torch.from_numpy(out)


def image_tensor(images: Sequence[np.ndarray], data: DataConfig) -> torch.Tensor:
    """N images H x W x 3 uint8 RGB -> N x 3 x H x W in data.image_dtype: uint8 as they are (the
    model normalises them on its device), or float32 through normalize_images with the table of
    data.image_mean / image_std."""
    if data.image_dtype == "float32":
        return normalize_images(images, pixel_lut(data.image_mean, data.image_std))
    if not len(images):
        return torch.zeros(0, 3, 0, 0, dtype=torch.uint8)
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()


class NuScenesBEV(torch.utils.data.Dataset):
    """Multi-camera images with calibration and augmentation, plus BEV targets, for one split.

    Item (all tensors float32 unless noted; N cameras, K classes, grid nx x ny from config.grid):
      "images" N x 3 x H x W RGB (H, W = config.data.final_dim): uint8 0-255 with
      config.data.image_dtype "uint8" (the model normalises them), else float32 normalised with
      data.image_mean / image_std; "intrinsics" N x 3 x 3,
      "sensor2ego_rot" N x 3 x 3, "sensor2ego_trans" N x 3, "post_rot" N x 3 x 3,
      "post_trans" N x 3, "targets" K x nx x ny in {0, 1} (config.data.classes order),
      "sample_token" str; "visibility_mask" nx x ny bool when config.data.visibility_mask;
      "det_boxes" M x 9 [x, y, z, w, l, h, yaw, vx, vy] and "det_labels" M int64 (index into
      DETECTION_CLASSES) when config.data.detection_targets, and in a training set also the first
      stage's fixed-shape targets (lss.geometry.boxes.dense_targets: "det_target_heatmap",
      "det_target_index", ...);
      "depth_targets" N x fH x fW int64 when config.data.depth_targets: per camera feature cell
      (fH, fW = final_dim // model.downsample) the grid.dbound bin of the nearest LIDAR_TOP return,
      -1 where there is none (lss.data.depth);
      with model.temporal.frames: 2 also the previous sample of the scene, model.temporal.gap key
      frames back (a scene's first samples: its first sample) under the same image augmentation:
      "prev_images", "prev_intrinsics", "prev_sensor2ego_rot", "prev_sensor2ego_trans" (camera ->
      its own ego frame), "prev_post_rot", "prev_post_trans", "ego_motion" 4 x 4, its ego frame ->
      this sample's, and "prev_sample_token" str (previous_frame).
    Boxes, map and targets are in the ego frame of the sample's LIDAR_TOP ego pose; in training,
    data.bev_* move that frame, the extrinsics with it (lss.data.bev_augmentation).
    """

    def __init__(
        self,
        dataroot: str | Path,
        version: str = "v1.0-mini",
        split: str = "train",
        config: Optional[Config] = None,
        is_train: Optional[bool] = None,
        verbose: bool = True,
    ):
        self.config = config if config is not None else Config()
        data = self.config.data
        self.version, self.split = version, split
        self.is_train = ("train" in split) if is_train is None else is_train
        self.cameras = tuple(data.cameras)
        self.classes = tuple(data.classes)
        self.class_kinds = class_kinds(self.classes)
        self.grid = BevGrid.from_config(self.config.grid)
        self.grid_shape = self.grid.shape

        self._decoded = DecodedImages() if data.decoded_cache else None
        self._lidar = LidarProjections() if data.decoded_cache and data.depth_targets else None
        self.root, self.layout = locate_dataroot(dataroot, version)
        index, cached = split_index(self.root, version, split, data)
        self.__dict__.update(index)
        if self.config.model.temporal.frames == 2:  # the previous frame model.temporal.gap back
            self.prev_index, self.ego_motion = previous_at_gap(
                self.prev_index, self.ego_motion, self.config.model.temporal.gap
            )
        self._check_first_images()
        if verbose:
            print(
                f"nuScenes {version} at {self.root} (layout {self.layout}): split {split} -> "
                f"{len(self)} samples from {self.scene_count} scenes"
                + (" (cached index)" if cached else "")
            )

    def _check_first_images(self) -> None:
        """Fail at construction, not in a worker, when the image (or lidar) folders are missing
        altogether."""
        for k, path in enumerate(self.image_paths[0] if len(self) else []):
            if not Path(path).is_file():
                raise FileNotFoundError(self._missing_image_message(0, k))
        if self.config.data.depth_targets and len(self):
            load_lidar_points(self.lidar_paths[0], self.sample_tokens[0])

    def _missing_image_message(self, index: int, cam: int) -> str:
        return (
            f"camera image {self.image_paths[index, cam]} not found (sample "
            f"{self.sample_tokens[index]}, channel {self.cameras[cam]}). The tables are at "
            f"{self.root / self.version}; unpack the camera blobs (samples/CAM_*) under "
            f"{self.root}."
        )

    def __len__(self) -> int:
        return len(self.sample_tokens)

    def _camera_subset(self, rng: Optional[np.random.Generator]) -> np.ndarray:
        count = self.config.data.num_train_cameras
        if not self.is_train or count is None or count >= len(self.cameras):
            return np.arange(len(self.cameras))
        return np.sort(rng.choice(len(self.cameras), size=count, replace=False))

    def _load_images(
        self,
        index: int,
        cams: np.ndarray,
        rng: Optional[np.random.Generator],
        augmentations: Optional[Sequence[ImageAugmentation]] = None,
    ):
        """(images, post_rot, post_trans, source sizes, augmentations) of cameras `cams` of sample
        `index`; each camera's augmentation drawn from `rng`, or taken from `augmentations` (the
        previous frame's images get the current frame's)."""
        data = self.config.data
        images, post_rots, post_trans, sizes, augs = [], [], [], [], []
        for n, k in enumerate(cams):
            path = self.image_paths[index, k]
            try:
                encoded = None
                size = tuple(int(v) for v in self.image_sizes[index, k])
                if min(size) <= 0:
                    encoded = Path(path).read_bytes()
                    size = image_size_from_header(encoded)
                if augmentations is not None:
                    aug = augmentations[n]
                else:
                    aug = sample_augmentation(
                        size,
                        tuple(data.final_dim),
                        tuple(data.resize_lim),
                        tuple(data.bot_pct_lim),
                        tuple(data.rot_lim),
                        data.rand_flip,
                        self.is_train,
                        rng,
                    )
                if data.image_resize == "pil":
                    source = encoded if encoded is not None else Path(path).read_bytes()
                else:
                    source = self._cached_decode(path, size, aug.resize_dims)
                    if source is None:
                        source = decode_scaled(
                            encoded if encoded is not None else Path(path).read_bytes(),
                            size,
                            aug.resize_dims,
                        )
                        if self._decoded is not None:
                            self._decoded.store(path, *source)
                image, rot, trans = augment_image(source, size, aug, data)
            except FileNotFoundError:
                raise FileNotFoundError(self._missing_image_message(index, k)) from None
            except OSError as e:
                raise OSError(
                    f"camera image {path} could not be decoded (sample "
                    f"{self.sample_tokens[index]}, channel {self.cameras[k]}): {e}"
                ) from None
            sizes.append(size)
            images.append(image)
            post_rots.append(rot)
            post_trans.append(trans)
            augs.append(aug)
        return (
            image_tensor(images, self.config.data),
            torch.from_numpy(np.stack(post_rots)),
            torch.from_numpy(np.stack(post_trans)),
            np.asarray(sizes),
            augs,
        )

    def _cached_decode(
        self, path: str, size: tuple[int, int], resize_dims: tuple[int, int]
    ) -> Optional[tuple[np.ndarray, int]]:
        """(image, scale) of `path` from the decoded-image cache (data.decoded_cache), or None.
        decode_scaled picks the scale by the file's bytes (a JPEG's DCT scale, else 1): the suffix's
        guess is looked up first, the other scale after it, so a file whose suffix does not tell its
        format is found too."""
        if self._decoded is None:
            return None
        jpeg = jpeg_scale(size, resize_dims)
        scales = (jpeg, 1) if path.lower().endswith((".jpg", ".jpeg")) else (1, jpeg)
        for scale in dict.fromkeys(scales):
            image = self._decoded.load(path, scale, scaled_shape(size, scale))
            if image is not None:
                return image, scale
        return None

    def bev_targets(self, index: int, bev: Optional[BevAugmentation] = None) -> np.ndarray:
        """K x nx x ny float32 targets of sample `index`, in the frame moved by the BEV augmentation
        `bev`."""
        targets = np.zeros((len(self.classes), *self.grid_shape), dtype=np.float32)
        for k in range(len(self.classes)):
            targets[k] = self.class_raster(index, k, bev)
        return targets

    def class_raster(self, index: int, k: int, bev: Optional[BevAugmentation] = None) -> np.ndarray:
        """nx x ny uint8 raster of class `k` (data.classes order) for sample `index` (moved by
        `bev`)."""
        if self.class_kinds[k] == "object":
            lo, hi = self.object_offsets[index], self.object_offsets[index + 1]
            bit = self.class_kinds[:k].count("object")
            chosen = self.object_footprints[lo:hi][(self.object_class_bits[lo:hi] >> bit) & 1 == 1]
            chosen = bev.apply_to_points_xy(chosen) if bev is not None else chosen
            fill = (
                rasterize_footprints_original
                if self.config.data.target_raster == "original"
                else T.rasterize_footprints
            )
            return fill(np.zeros(self.grid_shape, dtype=np.uint8), chosen, self.grid)
        x, y, yaw = self.ego_pose[index]
        location = self.locations[self.location_index[index]]
        return self.maps[location].rasterize(
            self.classes[k],
            (x, y),
            yaw,
            self.grid,
            self.config.data.divider_width,
            bev,
        )

    def lidar_depth_targets(
        self,
        index: int,
        cams: np.ndarray,
        post_rot: np.ndarray,
        post_trans: np.ndarray,
        image_sizes: np.ndarray,
    ) -> np.ndarray:
        """N x fH x fW int64 depth-bin targets of cameras `cams` of sample `index` under their
        augmentation (post_rot N x 3 x 3, post_trans N x 3; image_sizes N x 2 source W, H); see
        lss.data.depth. With data.decoded_cache the sweep's projection into each camera is read
        from the cache after its first use (the sweep is then not read at all)."""
        path = self.lidar_paths[index]
        points = None
        projections = []
        for j, cam in enumerate(cams):
            camera = (self.lidar_to_camera[index, cam], self.intrinsics[index, cam], image_sizes[j])
            tag = camera_tag(*camera) if self._lidar is not None else None
            projection = self._lidar.load(path, tag) if tag is not None else None
            if projection is None:
                if points is None:  # read once, for the cameras the cache does not hold
                    points = load_lidar_points(path, self.sample_tokens[index])
                projection = source_projection(points, *camera)
                if tag is not None:
                    self._lidar.store(path, tag, *projection)
            projections.append(projection)
        return depth_targets_from_projections(
            projections,
            post_rot,
            post_trans,
            tuple(self.config.data.final_dim),
            self.config.model.downsample,
            tuple(self.config.grid.dbound),
        )

    def detection_targets(
        self, index: int, bev: Optional[BevAugmentation] = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(M x 9 boxes, M labels) of detection-class objects whose centre lies inside the BEV grid
        (after `bev`)."""
        lo, hi = self.object_offsets[index], self.object_offsets[index + 1]
        boxes, labels = self.det_boxes[lo:hi], self.det_labels[lo:hi]
        boxes = bev.apply_to_boxes(boxes) if bev is not None else boxes
        inside = (labels >= 0) & self.grid.contains(boxes[:, 0], boxes[:, 1])
        return boxes[inside], labels[inside]

    def detection_classes(self, index: int) -> np.ndarray:
        """The distinct detection classes (labels) of the objects inside the BEV grid in sample
        `index`, without augmentation: what class-balanced sampling counts."""
        return np.unique(self.detection_targets(index)[1])

    def previous_frame(
        self,
        index: int,
        cams: np.ndarray,
        augmentations: Sequence[ImageAugmentation],
        bev: Optional[BevAugmentation] = None,
    ) -> dict:
        """The previous sample's camera inputs for sample `index` (model.temporal.frames: 2; the
        sample model.temporal.gap key frames back): its
        cameras `cams` under this sample's image `augmentations`, their calibration, and
        "ego_motion" 4 x 4, its ego frame -> this sample's ego frame moved by `bev` (the previous
        extrinsics stay in its own ego frame; the model composes the two)."""
        prev = int(self.prev_index[index])
        sizes, prev_sizes = self.image_sizes[index, cams], self.image_sizes[prev, cams]
        if not np.array_equal(sizes, prev_sizes):
            raise SampleError(
                f"sample {self.sample_tokens[prev]} has images of sizes {prev_sizes.tolist()} but "
                f"its next sample {self.sample_tokens[index]} {sizes.tolist()} (W, H per camera); "
                "model.temporal.frames: 2 gives both frames one augmentation, so the images of a "
                "scene must keep one size"
            )
        images, post_rot, post_trans, _, _ = self._load_images(prev, cams, None, augmentations)
        motion = self.ego_motion[index]
        if bev is not None:
            augment = np.eye(4)
            augment[:3, :3] = bev.matrix()
            motion = augment @ motion
        return {
            "prev_images": images,
            "prev_intrinsics": torch.from_numpy(self.intrinsics[prev, cams]),
            "prev_sensor2ego_rot": torch.from_numpy(self.sensor2ego_rot[prev, cams]),
            "prev_sensor2ego_trans": torch.from_numpy(self.sensor2ego_trans[prev, cams]),
            "prev_post_rot": post_rot,
            "prev_post_trans": post_trans,
            "ego_motion": torch.from_numpy(motion.astype(np.float32)),
            "prev_sample_token": str(self.sample_tokens[prev]),
        }

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range for {len(self)} samples")
        # SampleError keeps the message (which names the file) first when DataLoader re-raises it
        # from a worker.
        try:
            return self._item(index)
        except FileNotFoundError as e:
            raise SampleFileNotFoundError(str(e)) from None
        except OSError as e:
            raise SampleError(str(e)) from None

    def _item(self, index: int) -> dict:
        rng = np.random.default_rng(int(torch.randint(0, 2**62, ()))) if self.is_train else None
        cams = self._camera_subset(rng)
        images, post_rot, post_trans, image_sizes, augs = self._load_images(index, cams, rng)
        data = self.config.data
        bev = (
            sample_bev_augmentation(data.bev_rot_lim, data.bev_scale_lim, data.bev_flip, rng)
            if self.is_train
            else None
        )
        rot, trans = self.sensor2ego_rot[index, cams], self.sensor2ego_trans[index, cams]
        rot, trans = bev.apply_to_extrinsics(rot, trans) if bev is not None else (rot, trans)
        item = {
            "images": images,
            "intrinsics": torch.from_numpy(self.intrinsics[index, cams]),
            "sensor2ego_rot": torch.from_numpy(rot),
            "sensor2ego_trans": torch.from_numpy(trans),
            "post_rot": post_rot,
            "post_trans": post_trans,
            "targets": torch.from_numpy(self.bev_targets(index, bev)),
            "sample_token": str(self.sample_tokens[index]),
        }
        if self.config.model.temporal.frames == 2:
            item.update(self.previous_frame(index, cams, augs, bev))
        if self.config.data.visibility_mask:
            dbound = self.config.grid.dbound
            # the mask inverts rot by transposing: pass its orthonormal part, and depths measured in
            # scaled metres
            scale = bev.scale if bev is not None else 1.0
            item["visibility_mask"] = torch.from_numpy(
                T.camera_visibility_mask(
                    self.intrinsics[index, cams],
                    rot / scale,
                    trans,
                    post_rot.numpy(),
                    post_trans.numpy(),
                    tuple(self.config.data.final_dim),
                    self.grid,
                    (dbound[0] * scale, dbound[1] * scale),
                )
            )
        if self.config.data.depth_targets:
            item["depth_targets"] = torch.from_numpy(
                self.lidar_depth_targets(
                    index, cams, post_rot.numpy(), post_trans.numpy(), image_sizes
                )
            )
        if self.config.data.detection_targets:
            boxes, labels = self.detection_targets(index, bev)
            item["det_boxes"] = torch.from_numpy(boxes.copy())
            item["det_labels"] = torch.from_numpy(labels.copy())
            # fixed-shape targets: the loss needs no host work (a capturable training step)
            if self.is_train:
                det = self.config.detection
                item.update(
                    dense_targets(
                        item["det_boxes"],
                        item["det_labels"],
                        self.grid,
                        len(DETECTION_CLASSES),
                        det.gaussian_overlap,
                        det.min_radius,
                        det.max_objects,
                    )
                )
        return item
