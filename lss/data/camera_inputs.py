"""The camera inputs of a prediction: a sample's images of any resolution with their calibration ->
the model's input item (the evaluation resize and crop to data.final_dim, in data.image_dtype, with
the matrices of lss.geometry's augmentation convention), every problem in one line (ArgumentError);
and the sources `lss predict` reads: a scene of a nuScenes set, a folder of images with a rig file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Sequence, Union

import cv2
import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from lss.config import Config
from lss.data.nuscenes import image_tensor
from lss.data.transforms import augment_image, image_size_from_header
from lss.errors import ArgumentError, DatasetError
from lss.geometry import val_augmentation
from lss.geometry.rig_file import read_rig_file

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
# |R R^T - I| and |det R - 1| above this: the matrix is not a rotation
ROTATION_TOLERANCE = 1e-3

ImageInput = Union[str, Path, bytes, np.ndarray, torch.Tensor]


def _numpy(value, dtype=None) -> np.ndarray:
    if torch.is_tensor(value):
        value = value.detach().cpu().numpy()
    return np.asarray(value, dtype=dtype)


def _encoded_size(data: bytes, what: str) -> tuple[int, int]:
    try:
        return image_size_from_header(data)
    except OSError:
        raise ArgumentError(
            f"{what} is not a JPEG or PNG image ({len(data)} bytes): give a JPEG or PNG file"
        ) from None


def _read_image(image: ImageInput, camera: str) -> tuple:
    """(the encoded file or (its H x W x 3 uint8 BGR pixels, 1), (W, H), what it is in a message):
    the source of augment_image."""
    if isinstance(image, (str, Path)):
        try:
            data = Path(image).read_bytes()
        except OSError as e:
            raise ArgumentError(
                f"image {image} ({camera}) cannot be read: {e.strerror or e}; give a JPEG or PNG "
                "file"
            ) from None
        return data, _encoded_size(data, f"image {image} ({camera})"), f"image {image}"
    if isinstance(image, bytes):
        return image, _encoded_size(image, f"the image of {camera}"), f"the image of {camera}"
    if not isinstance(image, (np.ndarray, torch.Tensor)):
        raise ArgumentError(
            f"the image of {camera} is a {type(image).__name__}: give a file path or an H x W x 3 "
            "uint8 RGB array or tensor"
        )
    pixels = _numpy(image)
    if pixels.ndim != 3 or pixels.shape[2] != 3 or pixels.dtype != np.uint8:
        raise ArgumentError(
            f"the image of {camera} is {pixels.dtype} {tuple(pixels.shape)}: expected H x W x 3 "
            "uint8 RGB (a 3 x H x W tensor: permute(1, 2, 0) it; floats: convert to 0..255 uint8)"
        )
    bgr = cv2.cvtColor(np.ascontiguousarray(pixels), cv2.COLOR_RGB2BGR)
    return (bgr, 1), (pixels.shape[1], pixels.shape[0]), f"the image of {camera}"


def check_calibration(
    intrinsics, cam_to_ego, cameras: Sequence[str]
) -> tuple[np.ndarray, np.ndarray]:
    """(intrinsics N x 3 x 3, camera -> ego N x 4 x 4) as float64, or ArgumentError naming the
    camera whose calibration is not finite, not a pinhole or not a rigid transform."""
    n = len(cameras)
    K, T = _numpy(intrinsics, np.float64), _numpy(cam_to_ego, np.float64)
    for name, value, shape in (("intrinsics", K, (n, 3, 3)), ("cam_to_ego", T, (n, 4, 4))):
        if value.shape != shape:
            raise ArgumentError(
                f"{name} is {' x '.join(map(str, value.shape))}, expected "
                f"{' x '.join(map(str, shape))}: one matrix per camera of {', '.join(cameras)}"
            )
    for k, camera in enumerate(cameras):
        for name, value in (("intrinsics", K[k]), ("cam_to_ego", T[k])):
            if not np.isfinite(value).all():
                raise ArgumentError(
                    f"{name} of {camera} holds NaN or inf: {value.tolist()}; give finite numbers"
                )
        if not (K[k, 0, 0] > 0 and K[k, 1, 1] > 0):
            raise ArgumentError(
                f"intrinsics of {camera}: focal lengths fx = {K[k, 0, 0]:g}, fy = {K[k, 1, 1]:g}; "
                "expected [[fx, 0, cx], [0, fy, cy], [0, 0, 1]] with fx, fy > 0 (pixels)"
            )
        rot = T[k, :3, :3]
        off = float(np.abs(rot @ rot.T - np.eye(3)).max())
        det = float(np.linalg.det(rot))
        if off > ROTATION_TOLERANCE or abs(det - 1.0) > ROTATION_TOLERANCE:
            raise ArgumentError(
                f"cam_to_ego of {camera}: its 3 x 3 block is not a rotation (|R R^T - I| = "
                f"{off:.3g}, det R = {det:.4g}); give the camera -> ego transform [[R, t], "
                "[0, 0, 0, 1]] with R a rotation (e.g. pyquaternion's rotation_matrix)"
            )
        if np.abs(T[k, 3] - (0.0, 0.0, 0.0, 1.0)).max() > ROTATION_TOLERANCE:
            raise ArgumentError(
                f"cam_to_ego of {camera}: its last row is {T[k, 3].tolist()}, expected [0, 0, 0, 1]"
            )
    return K, T


def camera_inputs(
    images: Sequence[ImageInput],
    intrinsics,
    cam_to_ego,
    cfg: Config,
    image_sizes: Optional[Sequence[Optional[tuple[int, int]]]] = None,
) -> dict:
    """The model's input item of one sample: N = len(data.cameras) images in data.cameras order
    (file paths or encoded files, decoded as the dataset decodes them; or H x W x 3 uint8 RGB
    arrays/tensors) of one size, intrinsics N x 3 x 3 and camera -> ego N x 4 x 4 (arrays or
    tensors). Each image gets the evaluation augmentation of its size (val_augmentation).
    `image_sizes` (W, H) per camera, where given: the size the calibration is for.

    Returns "images" N x 3 x H x W (uint8, or normalised float32: data.image_dtype), "intrinsics",
    "sensor2ego_rot", "post_rot" N x 3 x 3 and "sensor2ego_trans", "post_trans" N x 3, float32, as
    a NuScenesBEV item."""
    data = cfg.data
    cameras = tuple(data.cameras)
    if isinstance(images, (np.ndarray, torch.Tensor)) and images.ndim != 4:
        raise ArgumentError(
            f"images is {tuple(images.shape)}: expected N x H x W x 3 uint8 RGB (N = "
            f"{len(cameras)} cameras), or a list of N images"
        )
    if len(images) != len(cameras):
        raise ArgumentError(
            f"{len(images)} images for a model of {len(cameras)} cameras: give one image per "
            f"camera, in the order {', '.join(cameras)}"
        )
    K, T = check_calibration(intrinsics, cam_to_ego, cameras)
    read = [_read_image(image, camera) for image, camera in zip(images, cameras)]
    sizes = [size for _, size, _ in read]
    if len(set(sizes)) > 1:
        listed = ", ".join(f"{c} {w}x{h}" for c, (w, h) in zip(cameras, sizes))
        raise ArgumentError(
            f"the images of one sample differ in size ({listed}): give the cameras' images at "
            "one size (resize them and scale the intrinsics with them)"
        )
    for camera, size, want in zip(cameras, sizes, image_sizes or [None] * len(cameras)):
        if want is not None and tuple(size) != tuple(want):
            raise ArgumentError(
                f"the image of {camera} is {size[0]}x{size[1]} but its calibration is for "
                f"{want[0]}x{want[1]} images: resize the image, or scale the intrinsics and "
                "image_size of the rig file"
            )
    aug = val_augmentation(sizes[0], tuple(data.final_dim), tuple(data.bot_pct_lim))
    pixels, post_rot, post_trans = [], [], []
    for (source, size, what), camera in zip(read, cameras):
        try:
            image, rot, trans = augment_image(source, size, aug, data)
        except OSError as e:
            raise ArgumentError(f"{what} ({camera}) cannot be decoded: {e}") from None
        pixels.append(image)
        post_rot.append(rot)
        post_trans.append(trans)
    return {
        "images": image_tensor(pixels, data),
        "intrinsics": torch.from_numpy(K.astype(np.float32)),
        "sensor2ego_rot": torch.from_numpy(T[:, :3, :3].astype(np.float32)),
        "sensor2ego_trans": torch.from_numpy(T[:, :3, 3].astype(np.float32)),
        "post_rot": torch.from_numpy(np.stack(post_rot)),
        "post_trans": torch.from_numpy(np.stack(post_trans)),
    }


def _frames(folder: Path, cameras: Sequence[str]) -> list[tuple[str, list[Path]]]:
    """(name, the image file of every camera) per frame: FOLDER/<camera>/ folders (frame i: the
    i-th image of each in name order, as nuScenes' samples/; named after its first camera's file,
    nuScenes' LOG__CAM_FRONT__TIME as LOG__TIME) or FOLDER/<camera>.<jpg|png> (one frame, named
    after the folder)."""
    if not folder.is_dir():
        raise ArgumentError(f"--images {folder}: no such folder")

    def images_in(path: Path) -> list[Path]:
        return sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)

    if all((folder / camera).is_dir() for camera in cameras):
        per_camera = [images_in(folder / camera) for camera in cameras]
        counts = {camera: len(files) for camera, files in zip(cameras, per_camera)}
        if len(set(counts.values())) != 1 or not per_camera[0]:
            listed = ", ".join(f"{c} {n}" for c, n in counts.items())
            raise ArgumentError(
                f"--images {folder}: the camera folders hold different numbers of images ({listed}"
                "); each needs one image per frame (frame i: the i-th file of each in name order)"
            )
        return [
            (frame[0].stem.replace(f"__{cameras[0]}__", "__"), list(frame))
            for frame in zip(*per_camera)
        ]
    singles = {p.stem: p for p in images_in(folder)}
    missing = [camera for camera in cameras if camera not in singles]
    if missing:
        raise ArgumentError(
            f"--images {folder}: no images of camera(s) {', '.join(missing)}; expected a folder "
            f"per camera ({', '.join(cameras)}), each with one image per frame, or one file per "
            "camera named after it (CAM_FRONT.jpg, ...)"
        )
    return [(folder.resolve().name, [singles[camera] for camera in cameras])]


class RigImageFolder(Dataset):
    """The frames of a folder of camera images (`_frames`) with their rig file
    (lss.geometry.rig_file), as model input items (camera_inputs) with "sample_token": the frame's
    name."""

    def __init__(self, folder: Union[str, Path], rig_file: Union[str, Path], cfg: Config):
        self.cfg = cfg
        cameras = tuple(cfg.data.cameras)
        self.intrinsics, self.cam_to_ego, self.image_sizes = read_rig_file(rig_file, cameras)
        check_calibration(self.intrinsics, self.cam_to_ego, cameras)
        self.frames = _frames(Path(folder), cameras)

    def __len__(self) -> int:
        return len(self.frames)

    def __getitem__(self, index: int) -> dict:
        name, files = self.frames[index]
        item = camera_inputs(files, self.intrinsics, self.cam_to_ego, self.cfg, self.image_sizes)
        item["sample_token"] = name
        return item


def scene_samples(cfg: Config, scene: str) -> Subset:
    """The samples of nuScenes scene `scene` (data.dataroot, data.version) in time order, as the
    evaluation reads them (NuScenesBEV items of the devkit split that holds the scene:
    data.val_split, data.train_split, or any other)."""
    from lss.data.loader import build_dataset
    from lss.data.tables import load_tables, locate_dataroot, resolve_split

    data = cfg.data
    root, _ = locate_dataroot(data.dataroot, data.version)
    nusc = load_tables(root, data.version)
    names = sorted(s["name"] for s in nusc.scene)
    if scene not in names:
        raise DatasetError(
            f"no scene {scene!r} in the {data.version} tables at {root}; its scenes: "
            f"{', '.join(names[:20])}{' ...' if len(names) > 20 else ''}"
        )
    from nuscenes.utils.splits import create_splits_scenes

    splits = [data.val_split, data.train_split] + sorted(create_splits_scenes())
    split = next((s for s in splits if scene in resolve_split(data.version, s)[1]), None)
    if split is None:
        raise DatasetError(
            f"scene {scene!r} is in none of the nuScenes splits of {data.version}; lss reads the "
            "scenes of the devkit's splits (nuscenes.utils.splits)"
        )
    dataset = build_dataset(cfg, split, is_train=False, verbose=False)
    record = next(s for s in nusc.scene if s["name"] == scene)
    tokens = set(nusc.field2token("sample", "scene_token", record["token"]))
    return Subset(dataset, [i for i, t in enumerate(dataset.sample_tokens) if t in tokens])


def frame_name(token: str) -> str:
    """A sample's token or frame name as a file-name part (at most 64 characters)."""
    return re.sub(r"[^\w.-]+", "_", token)[:64]
