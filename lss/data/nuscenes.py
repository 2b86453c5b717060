"""nuScenes multi-camera BEV dataset: tables, splits, boxes and maps through nuscenes-devkit.

Everything a sample needs except its pixels (file paths, calibration, ego pose, object boxes in the ego frame,
map geometry per location) is extracted once at construction into numpy arrays, so `__getitem__` only decodes
images and rasterizes, and forked loader workers share the arrays without copying Python objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import cv2
import numpy as np
import torch
from pyquaternion import Quaternion

from lss.config import DETECTION_CLASSES, Config
from lss.data import targets as T
from lss.data.bev_augmentation import BevAugmentation, sample_bev_augmentation
from lss.data.decoded_cache import DecodedImages
from lss.boxes import box_footprints, dense_targets
from lss.data.depth import lidar_to_camera_matrix, load_lidar_points, project_depth_targets
from lss.data.index_cache import index_key, load_index, save_index, wait_for_background_builds
from lss.data.original_conventions import (
    load_augmented_pil,
    original_post_matrices,
    rasterize_footprints_original,
)
from lss.data.tables import (
    DatasetNotFoundError,
    MapNotFoundError,
    SampleError,
    SampleFileNotFoundError,
    check_annotation,
    load_tables,
    loaded_or_named,
    locate_dataroot,
    resolve_split,
)
from lss.data.transforms import (
    augment_decoded,
    decode_scaled,
    image_size_from_header,
    jpeg_scale,
    sample_augmentation,
    scaled_shape,
)
from lss.errors import ConfigError, DatasetError
from lss.geometry import BevGrid

__all__ = [
    "DatasetNotFoundError",
    "MapNotFoundError",
    "NuScenesBEV",
    "load_tables",
    "locate_dataroot",
    "resolve_split",
]

# Segmentation object classes: nuScenes category-name prefixes (LSS: all vehicles; all pedestrians).
OBJECT_CLASSES = {"vehicle": "vehicle.", "pedestrian": "human.pedestrian."}
MAP_POLYGON_LAYERS = (
    "drivable_area",
    "road_segment",
    "road_block",
    "lane",
    "ped_crossing",
    "walkway",
    "stop_line",
    "carpark_area",
)
MAP_LINE_LAYERS = ("road_divider", "lane_divider")
# The attributes NuScenesBEV._build_index sets: what the on-disk index cache holds of a split.
INDEX_FIELDS = (
    "devkit_split",
    "scene_count",
    "locations",
    "sample_tokens",
    "location_index",
    "image_sizes",
    "intrinsics",
    "sensor2ego_rot",
    "sensor2ego_trans",
    "ego_pose",
    "lidar_to_camera",
    "image_paths",
    "lidar_paths",
    "object_offsets",
    "object_footprints",
    "object_class_bits",
    "det_boxes",
    "det_labels",
    "maps",
)


@dataclass
class MapGeometry:
    """Map layers of one location in global metres: polygons (rings: exterior then holes) and polylines,
    each with its axis-aligned bounds (P x 4: xmin, ymin, xmax, ymax) for culling."""

    polygons: dict[str, list[list[np.ndarray]]]
    polygon_bounds: dict[str, np.ndarray]
    lines: dict[str, list[np.ndarray]]
    line_bounds: dict[str, np.ndarray]

    def rasterize(
        self,
        layer: str,
        ego_xy: Sequence[float],
        ego_yaw: float,
        grid: BevGrid,
        line_width: int,
        bev: Optional[BevAugmentation] = None,
    ) -> np.ndarray:
        """nx x ny uint8 raster of `layer` in the ego frame at (ego_xy, ego_yaw), moved by `bev` when given."""
        canvas = np.zeros(grid.shape, dtype=np.uint8)
        (x_lo, x_hi, dx), (y_lo, y_hi, dy) = grid.xbound, grid.ybound
        reach = np.hypot(max(abs(x_lo), abs(x_hi)), max(abs(y_lo), abs(y_hi)))
        reach += line_width * max(dx, dy)
        reach /= bev.scale if bev is not None else 1.0

        def to_ego(points: np.ndarray) -> np.ndarray:
            ego = T.global_to_ego_xy(points, ego_xy, ego_yaw)
            return bev.apply_to_points_xy(ego) if bev is not None else ego

        lo, hi = np.asarray(ego_xy[:2]) - reach, np.asarray(ego_xy[:2]) + reach

        def near(bounds: np.ndarray) -> np.ndarray:
            if len(bounds) == 0:
                return np.zeros(0, dtype=np.int64)
            keep = (
                (bounds[:, 0] <= hi[0])
                & (bounds[:, 2] >= lo[0])
                & (bounds[:, 1] <= hi[1])
                & (bounds[:, 3] >= lo[1])
            )
            return np.flatnonzero(keep)

        if layer in self.polygons:
            polys = [
                [to_ego(r) for r in self.polygons[layer][i]]
                for i in near(self.polygon_bounds[layer])
            ]
            T.rasterize_polygons(canvas, polys, grid)
        else:
            lines = [to_ego(self.lines[layer][i]) for i in near(self.line_bounds[layer])]
            T.rasterize_lines(canvas, lines, grid, line_width)
        return canvas


_MAPS: dict = {}


def map_file(root: Path, location: str) -> Path:
    return Path(root) / "maps" / "expansion" / f"{location}.json"


def load_map_geometry(root: Path, location: str, layers: Sequence[str]) -> MapGeometry:
    """Extract `layers` of one location from the devkit's NuScenesMap (cached per process)."""
    key = (str(Path(root).resolve()), location, tuple(sorted(layers)))
    if key in _MAPS:
        return _MAPS[key]
    path = map_file(root, location)
    if not path.is_file():
        raise MapNotFoundError(
            f"map expansion for location '{location}' not found: expected {path}. Download the nuScenes map "
            f"expansion (v1.3) and unpack it into {Path(root) / 'maps'} so that maps/expansion/<location>.json "
            f"exist, or configure only object classes ({', '.join(OBJECT_CLASSES)}) in data.classes."
        )
    from nuscenes.map_expansion.map_api import NuScenesMap

    nmap = loaded_or_named(
        lambda: NuScenesMap(dataroot=str(root), map_name=location),
        [path],
        dict,
        f"the map expansion of location '{location}'",
    )
    node_xy = {n["token"]: (n["x"], n["y"]) for n in nmap.node}

    def ring(tokens: Sequence[str]) -> np.ndarray:
        return np.asarray([node_xy[t] for t in tokens], dtype=np.float64).reshape(-1, 2)

    def bounds(arrays: Sequence[np.ndarray]) -> np.ndarray:
        if not arrays:
            return np.zeros((0, 4))
        return np.asarray([[*a.min(0), *a.max(0)] for a in arrays])

    polygons, polygon_bounds, lines, line_bounds = {}, {}, {}, {}
    for layer in layers:
        if layer in MAP_POLYGON_LAYERS:
            polys = []
            for record in getattr(nmap, layer):
                tokens = (
                    record["polygon_tokens"]
                    if layer == "drivable_area"
                    else [record["polygon_token"]]
                )
                for token in tokens:
                    poly = nmap.get("polygon", token)
                    rings = [ring(poly["exterior_node_tokens"])] + [
                        ring(h["node_tokens"]) for h in poly["holes"]
                    ]
                    if len(rings[0]):
                        polys.append(rings)
            polygons[layer] = polys
            polygon_bounds[layer] = bounds([p[0] for p in polys])
        else:
            found = [
                ring(nmap.get("line", r["line_token"])["node_tokens"]) for r in getattr(nmap, layer)
            ]
            lines[layer] = [line for line in found if len(line)]
            line_bounds[layer] = bounds(lines[layer])
    _MAPS[key] = MapGeometry(polygons, polygon_bounds, lines, line_bounds)
    return _MAPS[key]


def _class_kinds(classes: Sequence[str]) -> list[str]:
    """'object' or 'map' per configured class; unknown names are an error listing the allowed ones."""
    kinds = []
    for name in classes:
        if name in OBJECT_CLASSES or (name in DETECTION_CLASSES and name != "pedestrian"):
            kinds.append("object")
        elif name in MAP_POLYGON_LAYERS or name in MAP_LINE_LAYERS:
            kinds.append("map")
        else:
            allowed = list(OBJECT_CLASSES) + [c for c in DETECTION_CLASSES if c != "pedestrian"]
            raise ConfigError(
                f"data.classes: unknown class {name!r}. Object classes: {', '.join(allowed)}; map "
                f"classes: {', '.join(MAP_POLYGON_LAYERS + MAP_LINE_LAYERS)}"
            )
    return kinds


def _category_matches(class_name: str, category: str) -> bool:
    from nuscenes.eval.detection.utils import category_to_detection_name

    if class_name in OBJECT_CLASSES:
        return category.startswith(OBJECT_CLASSES[class_name])
    return category_to_detection_name(category) == class_name


def normalize_images(images: Sequence[np.ndarray], lut: np.ndarray) -> torch.Tensor:
    """N images H x W x 3 uint8 RGB -> N x 3 x H x W float32 through a 256 x 3 per-channel lookup table."""
    if not len(images):
        return torch.zeros(0, 3, 0, 0)
    out = np.empty((len(images), 3, *images[0].shape[:2]), dtype=np.float32)
    planes = [np.ascontiguousarray(lut[:, c]) for c in range(3)]
    for n, image in enumerate(images):
        # cv2.LUT on contiguous planes is much faster than numpy fancy indexing of interleaved channels.
        for c, plane in enumerate(cv2.split(image)):
            out[n, c] = cv2.LUT(plane, planes[c])
    return torch.from_numpy(out)


class NuScenesBEV(torch.utils.data.Dataset):
    """Multi-camera images with calibration and augmentation, plus BEV targets, for one split.

    Item (all tensors float32 unless noted; N cameras, K classes, grid nx x ny from config.grid):
      "images" N x 3 x H x W normalized RGB (H, W = config.data.final_dim), "intrinsics" N x 3 x 3,
      "sensor2ego_rot" N x 3 x 3, "sensor2ego_trans" N x 3, "post_rot" N x 3 x 3, "post_trans" N x 3,
      "targets" K x nx x ny in {0, 1} (config.data.classes order), "sample_token" str;
      "visibility_mask" nx x ny bool when config.data.visibility_mask;
      "det_boxes" M x 9 [x, y, z, w, l, h, yaw, vx, vy] and "det_labels" M int64 (index into DETECTION_CLASSES)
      when config.data.detection_targets, and in a training set also the first stage's fixed-shape targets
      (lss.boxes.dense_targets: "det_target_heatmap", "det_target_index", ...);
      "depth_targets" N x fH x fW int64 when config.data.depth_targets: per camera feature cell (fH, fW =
      final_dim // model.downsample) the grid.dbound bin of the nearest LIDAR_TOP return, -1 where there is none
      (lss.data.depth).
    Boxes, map and targets are in the ego frame of the sample's LIDAR_TOP ego pose; in training, data.bev_* move that
    frame, the extrinsics with it (lss.data.bev_augmentation).
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
        self.class_kinds = _class_kinds(self.classes)
        self.grid = BevGrid.from_config(self.config.grid)
        self.grid_shape = self.grid.shape

        # Normalized value of every uint8 level per channel: (level / 255 - mean) / std, 256 x 3.
        self._pixel_lut = (
            (np.arange(256, dtype=np.float64)[:, None] / 255.0 - np.asarray(data.image_mean))
            / np.asarray(data.image_std)
        ).astype(np.float32)
        self._decoded = DecodedImages() if data.decoded_cache else None
        self.root, self.layout = locate_dataroot(dataroot, version)
        key = index_key(
            self.root,
            version,
            split,
            (
                self.cameras,
                self.classes,
                data.min_visibility,
                data.min_lidar_pts,
                data.detection_targets,
                data.depth_targets,
            ),
        )
        cached = load_index(key, INDEX_FIELDS)
        if (
            cached is None and wait_for_background_builds()
        ):  # `lss train` builds it ahead (index_cache)
            cached = load_index(key, INDEX_FIELDS)
        if cached is not None:
            self.__dict__.update(cached)
        else:
            self._build_index(split)
            save_index(key, {k: getattr(self, k) for k in INDEX_FIELDS})
        self._check_first_images()
        if verbose:
            print(
                f"nuScenes {version} at {self.root} (layout {self.layout}): split {split} -> "
                f"{len(self)} samples from {self.scene_count} scenes"
                + (" (cached index)" if cached else "")
            )

    def _build_index(self, split: str) -> None:
        """Everything `split` takes from the tables and maps (through nuscenes-devkit): the attributes
        this sets, INDEX_FIELDS, are what the on-disk index cache holds (lss.data.index_cache)."""
        nusc = load_tables(self.root, self.version)
        self.devkit_split, split_scenes = resolve_split(self.version, split)
        scenes = sorted(
            (s for s in nusc.scene if s["name"] in set(split_scenes)), key=lambda s: s["name"]
        )
        if not scenes:
            have = sorted(s["name"] for s in nusc.scene)
            raise DatasetError(
                f"split {split!r} ({self.devkit_split}) has none of its {len(split_scenes)} scenes in "
                f"{self.root / self.version}: the tables hold {have[:12]}"
                f"{' ...' if len(have) > 12 else ''}"
            )
        self.scene_count = len(scenes)
        self._extract(nusc, scenes)
        if not len(self.sample_tokens):
            raise DatasetError(
                f"split {split!r} ({self.devkit_split}): its {len(scenes)} scene(s) "
                f"({', '.join(s['name'] for s in scenes[:12])}) have no samples in "
                f"{self.root / self.version / 'sample.json'}; restore the tables from the dataset "
                "archive (or regenerate a synthetic set)"
            )
        map_layers = sorted({c for c, k in zip(self.classes, self.class_kinds) if k == "map"})
        self.maps = (
            {loc: load_map_geometry(self.root, loc, map_layers) for loc in self.locations}
            if map_layers
            else {}
        )

    def _extract(self, nusc, scenes: list[dict]) -> None:
        from nuscenes.eval.detection.utils import category_to_detection_name

        data = self.config.data
        samples = []
        for scene in scenes:
            recs = [
                nusc.get("sample", t)
                for t in nusc.field2token("sample", "scene_token", scene["token"])
            ]
            location = nusc.get("log", scene["log_token"])["location"]
            samples += [(location, r) for r in sorted(recs, key=lambda r: r["timestamp"])]
        self.locations = sorted({loc for loc, _ in samples})
        n, c = len(samples), len(self.cameras)
        self.sample_tokens = np.asarray([r["token"] for _, r in samples])
        self.location_index = np.asarray(
            [self.locations.index(loc) for loc, _ in samples], dtype=np.int16
        )
        paths = [[""] * c for _ in range(n)]
        # source (W, H) per image from sample_data; 0 where the table has none (then read from the file header)
        self.image_sizes = np.zeros((n, c, 2), dtype=np.int64)
        self.intrinsics = np.zeros((n, c, 3, 3), dtype=np.float32)
        self.sensor2ego_rot = np.zeros((n, c, 3, 3), dtype=np.float32)
        self.sensor2ego_trans = np.zeros((n, c, 3), dtype=np.float32)
        self.ego_pose = np.zeros(
            (n, 3), dtype=np.float64
        )  # global x, y, yaw of LIDAR_TOP's ego pose
        lidar_paths = [""] * n
        # lidar frame -> camera frame per sample and camera (through both ego poses); filled for data.depth_targets
        self.lidar_to_camera = np.zeros((n if data.depth_targets else 0, c, 4, 4), dtype=np.float64)
        object_classes = [k for k, kind in enumerate(self.class_kinds) if kind == "object"]
        # once, not per annotation
        annotation_table = self.root / self.version / "sample_annotation.json"
        class_bits, det_boxes, det_labels, offsets = [], [], [], [0]
        for i, (_, sample) in enumerate(samples):
            for k, cam in enumerate(self.cameras):
                if cam not in sample["data"]:
                    raise DatasetError(
                        f"sample {sample['token']} has no {cam} image; its channels: "
                        f"{sorted(sample['data'])}"
                    )
                sd = nusc.get("sample_data", sample["data"][cam])
                calib = nusc.get("calibrated_sensor", sd["calibrated_sensor_token"])
                paths[i][k] = str(self.root / sd["filename"])
                self.image_sizes[i, k] = (int(sd.get("width") or 0), int(sd.get("height") or 0))
                self.intrinsics[i, k] = np.asarray(calib["camera_intrinsic"])
                self.sensor2ego_rot[i, k] = Quaternion(calib["rotation"]).rotation_matrix
                self.sensor2ego_trans[i, k] = calib["translation"]
            if "LIDAR_TOP" not in sample["data"]:
                raise DatasetError(
                    f"sample {sample['token']} has no LIDAR_TOP sample_data (the ego pose of the "
                    f"targets and the depth targets come from it); its channels: "
                    f"{sorted(sample['data'])}"
                )
            lidar_sd = nusc.get("sample_data", sample["data"]["LIDAR_TOP"])
            if data.depth_targets:
                lidar_paths[i] = str(self.root / lidar_sd["filename"])
                for k, cam in enumerate(self.cameras):
                    self.lidar_to_camera[i, k] = lidar_to_camera_matrix(
                        nusc, lidar_sd["token"], sample["data"][cam]
                    )
            pose = nusc.get("ego_pose", lidar_sd["ego_pose_token"])
            ego_rot = Quaternion(pose["rotation"]).rotation_matrix
            ego_t = np.asarray(pose["translation"])
            self.ego_pose[i] = (ego_t[0], ego_t[1], np.arctan2(ego_rot[1, 0], ego_rot[0, 0]))
            for ann_token in sample["anns"]:
                ann = nusc.get("sample_annotation", ann_token)
                check_annotation(ann, annotation_table)
                if (
                    int(ann["visibility_token"] or 0) < data.min_visibility
                    or ann["num_lidar_pts"] < data.min_lidar_pts
                ):
                    continue
                category = ann["category_name"]
                bits = sum(
                    1 << b
                    for b, k in enumerate(object_classes)
                    if _category_matches(self.classes[k], category)
                )
                label = (
                    DETECTION_CLASSES.index(name)
                    if (name := category_to_detection_name(category))
                    else -1
                )
                if not bits and not (data.detection_targets and label >= 0):
                    continue
                center = ego_rot.T @ (np.asarray(ann["translation"]) - ego_t)
                box_rot = ego_rot.T @ Quaternion(ann["rotation"]).rotation_matrix
                yaw = np.arctan2(box_rot[1, 0], box_rot[0, 0])
                w, l, h = ann["size"]
                velocity = np.zeros(2)
                if data.detection_targets and label >= 0:
                    v = ego_rot.T @ np.nan_to_num(nusc.box_velocity(ann_token), nan=0.0)
                    velocity = v[:2]
                class_bits.append(bits)
                det_boxes.append([*center, w, l, h, yaw, *velocity])
                det_labels.append(label)
            offsets.append(len(det_boxes))
        self.image_paths = np.asarray(paths, dtype=str).reshape(n, c)
        self.lidar_paths = np.asarray(lidar_paths, dtype=str)
        self.object_offsets = np.asarray(offsets, dtype=np.int64)
        boxes = np.asarray(det_boxes, dtype=np.float64).reshape(
            -1, 9
        )  # x y z w l h yaw vx vy, ego frame
        self.object_footprints = box_footprints(boxes[:, :2], boxes[:, 3:5], boxes[:, 6]).astype(
            np.float32
        )
        self.object_class_bits = np.asarray(class_bits, dtype=np.int64)
        self.det_boxes = boxes.astype(np.float32)
        self.det_labels = np.asarray(det_labels, dtype=np.int64)

    def _check_first_images(self) -> None:
        """Fail at construction, not in a worker, when the image (or lidar) folders are missing altogether."""
        for k, path in enumerate(self.image_paths[0] if len(self) else []):
            if not Path(path).is_file():
                raise FileNotFoundError(self._missing_image_message(0, k))
        if self.config.data.depth_targets and len(self):
            load_lidar_points(self.lidar_paths[0], self.sample_tokens[0])

    def _missing_image_message(self, index: int, cam: int) -> str:
        return (
            f"camera image {self.image_paths[index, cam]} not found (sample {self.sample_tokens[index]}, channel "
            f"{self.cameras[cam]}). The tables are at {self.root / self.version}; unpack the camera blobs "
            f"(samples/CAM_*) under {self.root}."
        )

    def __len__(self) -> int:
        return len(self.sample_tokens)

    def _camera_subset(self, rng: Optional[np.random.Generator]) -> np.ndarray:
        count = self.config.data.num_train_cameras
        if not self.is_train or count is None or count >= len(self.cameras):
            return np.arange(len(self.cameras))
        return np.sort(rng.choice(len(self.cameras), size=count, replace=False))

    def _load_images(self, index: int, cams: np.ndarray, rng: Optional[np.random.Generator]):
        data = self.config.data
        images, post_rots, post_trans, sizes = [], [], [], []
        for k in cams:
            path = self.image_paths[index, k]
            try:
                encoded = None
                size = tuple(int(v) for v in self.image_sizes[index, k])
                if min(size) <= 0:
                    encoded = Path(path).read_bytes()
                    size = image_size_from_header(encoded)
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
                    image, rot, trans = load_augmented_pil(
                        encoded if encoded is not None else Path(path).read_bytes(),
                        size,
                        aug,
                        tuple(data.final_dim),
                    )
                else:
                    decoded = self._cached_decode(path, size, aug.resize_dims)
                    if decoded is None:
                        decoded = decode_scaled(
                            encoded if encoded is not None else Path(path).read_bytes(),
                            size,
                            aug.resize_dims,
                        )
                        if self._decoded is not None:
                            self._decoded.store(path, *decoded)
                    image, rot, trans = augment_decoded(*decoded, aug, tuple(data.final_dim))
                if data.post_matrices == "original":
                    rot, trans = original_post_matrices(aug, tuple(data.final_dim))
            except FileNotFoundError:
                raise FileNotFoundError(self._missing_image_message(index, k)) from None
            except OSError as e:
                raise OSError(
                    f"camera image {path} could not be decoded (sample {self.sample_tokens[index]}, "
                    f"channel {self.cameras[k]}): {e}"
                ) from None
            sizes.append(size)
            images.append(image)
            post_rots.append(rot)
            post_trans.append(trans)
        return (
            normalize_images(images, self._pixel_lut),
            torch.from_numpy(np.stack(post_rots)),
            torch.from_numpy(np.stack(post_trans)),
            np.asarray(sizes),
        )

    def _cached_decode(
        self, path: str, size: tuple[int, int], resize_dims: tuple[int, int]
    ) -> Optional[tuple[np.ndarray, int]]:
        """(image, scale) of `path` from the decoded-image cache (data.decoded_cache), or None. decode_scaled picks the
        scale by the file's bytes (a JPEG's DCT scale, else 1): the suffix's guess is looked up first, the other
        scale after it, so a file whose suffix does not tell its format is found too."""
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
        """K x nx x ny float32 targets of sample `index`, in the frame moved by the BEV augmentation `bev`."""
        targets = np.zeros((len(self.classes), *self.grid_shape), dtype=np.float32)
        for k in range(len(self.classes)):
            targets[k] = self.class_raster(index, k, bev)
        return targets

    def class_raster(self, index: int, k: int, bev: Optional[BevAugmentation] = None) -> np.ndarray:
        """nx x ny uint8 raster of class `k` (data.classes order) for sample `index` (moved by `bev`)."""
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
        """N x fH x fW int64 depth-bin targets of cameras `cams` of sample `index` under their augmentation
        (post_rot N x 3 x 3, post_trans N x 3; image_sizes N x 2 source W, H); see lss.data.depth."""
        points = load_lidar_points(self.lidar_paths[index], self.sample_tokens[index])
        return project_depth_targets(
            points,
            self.lidar_to_camera[index, cams],
            self.intrinsics[index, cams],
            post_rot,
            post_trans,
            image_sizes,
            tuple(self.config.data.final_dim),
            self.config.model.downsample,
            tuple(self.config.grid.dbound),
        )

    def detection_targets(
        self, index: int, bev: Optional[BevAugmentation] = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(M x 9 boxes, M labels) of detection-class objects whose centre lies inside the BEV grid (after `bev`)."""
        lo, hi = self.object_offsets[index], self.object_offsets[index + 1]
        boxes, labels = self.det_boxes[lo:hi], self.det_labels[lo:hi]
        boxes = bev.apply_to_boxes(boxes) if bev is not None else boxes
        inside = (labels >= 0) & self.grid.contains(boxes[:, 0], boxes[:, 1])
        return boxes[inside], labels[inside]

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range for {len(self)} samples")
        # SampleError keeps the message (which names the file) first when DataLoader re-raises it from a worker.
        try:
            return self._item(index)
        except FileNotFoundError as e:
            raise SampleFileNotFoundError(str(e)) from None
        except OSError as e:
            raise SampleError(str(e)) from None

    def _item(self, index: int) -> dict:
        rng = np.random.default_rng(int(torch.randint(0, 2**62, ()))) if self.is_train else None
        cams = self._camera_subset(rng)
        images, post_rot, post_trans, image_sizes = self._load_images(index, cams, rng)
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
        if self.config.data.visibility_mask:
            dbound = self.config.grid.dbound
            # the mask inverts rot by transposing: pass its orthonormal part, and depths measured in scaled metres
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
            if (
                self.is_train
            ):  # fixed-shape targets: the loss needs no host work (a capturable training step)
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
