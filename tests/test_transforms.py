"""Image augmentation: sampled parameters follow the LSS recipe and post_rot/post_trans match the pixels."""
import math

import cv2
import numpy as np
import pytest
import torch
from nuscenes.utils.data_classes import Box
from nuscenes.utils.geometry_utils import view_points
from PIL import Image
from pyquaternion import Quaternion

from lss.data.transforms import (decode_resized, image_size_from_header, jpeg_scale, load_augmented_image,
                                 sample_augmentation)
from lss.geometry import ImageAugmentation, crop_flip_rotate_affine, image_augmentation

FINAL_DIM = (128, 352)
LSS_TRAIN = dict(resize_lim=(0.193, 0.225), bot_pct_lim=(0.0, 0.22), rot_lim=(-5.4, 5.4), rand_flip=True)
COLORS = np.array([[230, 30, 30], [30, 220, 30], [40, 40, 235], [235, 220, 20], [20, 220, 220], [220, 30, 220]],
                  dtype=np.uint8)


def front_camera(width, height):
    """A CAM_FRONT-like rig: intrinsics, sensor2ego rotation (camera z forward = ego x) and translation."""
    f = 1266.0 * width / 1600
    intrinsics = np.array([[f, 0.0, width / 2 - 3.5], [0.0, f, height / 2 + 4.0], [0.0, 0.0, 1.0]])
    rot = Quaternion(axis=[0, 0, 1], angle=-math.pi / 2) * Quaternion(axis=[1, 0, 0], angle=-math.pi / 2)
    return intrinsics, rot.rotation_matrix, np.array([1.7, 0.02, 1.5])


def ego_to_pixels(points_ego, intrinsics, rot, trans):
    """3 x P ego points -> 2 x P source pixels and depths through the devkit's view_points."""
    cam = rot.T @ (points_ego - trans[:, None])
    return view_points(cam, intrinsics, normalize=True)[:2], cam[2]


def box_corner_points():
    """Corners of two devkit boxes ahead of the camera, in the ego frame (3 x 16)."""
    boxes = [Box([14.0, 2.5, 0.8], [1.9, 4.5, 1.6], Quaternion(axis=[0, 0, 1], angle=0.4)),
             Box([22.0, -4.0, 1.0], [2.5, 10.0, 3.0], Quaternion(axis=[0, 0, 1], angle=-0.2))]
    return np.concatenate([b.corners() for b in boxes], axis=1)


def marker_image(path, size, pixels, radius, quality=95):
    """Grey image with a coloured disc centred at each source pixel; saved as JPEG (or PNG by suffix)."""
    width, height = size
    img = np.full((height, width, 3), 110, dtype=np.uint8)
    for k, (u, v) in enumerate(pixels.T):
        cv2.circle(img, (int(round(u * 16)), int(round(v * 16))), int(radius * 16), COLORS[k % len(COLORS)].tolist(),
                   -1, lineType=cv2.LINE_AA, shift=4)
    Image.fromarray(img).save(path, quality=quality)


def blob_centroid(image, color, tol=60):
    mask = np.abs(image.astype(int) - color.astype(int)).max(-1) < tol
    vs, us = np.nonzero(mask)
    return (us.mean(), vs.mean()) if len(us) else None


@pytest.mark.parametrize("size,suffix", [((1600, 900), ".jpg"), ((400, 225), ".jpg"), ((640, 360), ".png")])
def test_markers_land_where_post_rot_and_post_trans_send_them(tmp_path, size, suffix):
    """Disc centroids in the augmented image match post_rot @ (u, v, 1) + post_trans within 0.3 px."""
    rng = np.random.default_rng(0)
    count = len(COLORS)
    pixels = np.stack([np.linspace(0.12, 0.88, count) * size[0],
                       np.where(np.arange(count) % 2 == 0, 0.55, 0.75) * size[1]])
    pixels += rng.uniform(-0.5, 0.5, pixels.shape)
    radius = 7.0 * size[0] / 400
    path = tmp_path / f"cam{suffix}"
    marker_image(path, size, pixels, radius)
    checked = 0
    for trial in range(12):
        aug = sample_augmentation(size, FINAL_DIM, is_train=trial > 0, rng=rng,
                                  **{**LSS_TRAIN, "resize_lim": (0.193 * 1600 / size[0], 0.225 * 1600 / size[0])})
        image, post_rot, post_trans = load_augmented_image(path.read_bytes(), size, aug, FINAL_DIM)
        assert image.shape == (*FINAL_DIM, 3) and image.dtype == np.uint8
        aug_px = post_rot @ np.concatenate([pixels, np.ones((1, pixels.shape[1]))]) + post_trans[:, None]
        for k in range(pixels.shape[1]):
            u, v = aug_px[0, k], aug_px[1, k]
            r_out = radius * abs(np.linalg.det(post_rot[:2, :2])) ** 0.5
            if not (r_out + 1 < u < FINAL_DIM[1] - r_out - 2 and r_out + 1 < v < FINAL_DIM[0] - r_out - 2):
                continue
            found = blob_centroid(image, COLORS[k])
            assert found is not None, (trial, k)
            assert abs(found[0] - u) < 0.3 and abs(found[1] - v) < 0.3, (trial, aug, k, found, (u, v))
            checked += 1
    assert checked > 25


@pytest.mark.parametrize("size,suffix", [((1600, 900), ".jpg"), ((640, 360), ".png")])
def test_data_path_and_geometry_build_the_same_augmentation(tmp_path, size, suffix):
    """NuScenesBEV's path (sample_augmentation, then load_augmented_image) reports exactly the post_rot/post_trans
    of lss.geometry.image_augmentation, and a source point goes to the same output pixel through both: the one
    where the decoded image shows it."""
    rng = np.random.default_rng(5)
    point = np.array([0.5 * size[0] + 3.3, 0.7 * size[1] - 1.7])
    path = tmp_path / f"cam{suffix}"
    marker_image(path, size, point[:, None], radius=7.0 * size[0] / 400)
    flips = rotations = 0
    for trial in range(8):
        aug = sample_augmentation(size, FINAL_DIM, is_train=trial > 0, rng=rng,
                                  **{**LSS_TRAIN, "resize_lim": (0.193 * 1600 / size[0], 0.225 * 1600 / size[0])})
        image, post_rot, post_trans = load_augmented_image(path.read_bytes(), size, aug, FINAL_DIM)
        geo_rot, geo_trans = image_augmentation(aug, size, FINAL_DIM)
        assert np.array_equal(post_rot, geo_rot.numpy()) and np.array_equal(post_trans, geo_trans.numpy()), aug
        data_uv = (post_rot @ [*point, 1.0] + post_trans)[:2]
        geo_uv = (geo_rot.double() @ torch.tensor([*point, 1.0], dtype=torch.float64) + geo_trans.double())[:2]
        assert np.array_equal(np.floor(data_uv + 0.5), np.floor(geo_uv.numpy() + 0.5))
        found = blob_centroid(image, COLORS[0])
        assert found is not None and np.abs(np.array(found) - geo_uv.numpy()).max() < 0.3, (aug, found, geo_uv)
        flips += aug.flip
        rotations += aug.rotate != 0.0
    assert flips and rotations


def test_projected_devkit_box_corners_hit_drawn_corners(tmp_path):
    """Ego box corners drawn where the devkit projects them are found where post_rot/post_trans send them."""
    size = (1600, 900)
    intrinsics, rot, trans = front_camera(*size)
    src, _ = ego_to_pixels(box_corner_points()[:, :4], intrinsics, rot, trans)
    path = tmp_path / "corners.jpg"
    marker_image(path, size, src, radius=14)
    rng = np.random.default_rng(3)
    for _ in range(5):
        aug = sample_augmentation(size, FINAL_DIM, is_train=True, rng=rng, **{**LSS_TRAIN, "bot_pct_lim": (0.3, 0.4)})
        image, post_rot, post_trans = load_augmented_image(path.read_bytes(), size, aug, FINAL_DIM)
        cam = rot.T @ (box_corner_points()[:, :4] - trans[:, None])
        uvd = np.concatenate([view_points(cam, intrinsics, normalize=True)[:2], cam[2:]])
        aug_px = post_rot @ uvd + post_trans[:, None]
        assert np.allclose(aug_px[2], cam[2])  # depth passes through unchanged
        for k in range(4):
            u, v = int(round(aug_px[0, k])), int(round(aug_px[1, k]))
            if 0 <= u < FINAL_DIM[1] and 0 <= v < FINAL_DIM[0]:
                assert np.abs(image[v, u].astype(int) - COLORS[k]).max() < 60, (aug, k, image[v, u])


def test_validation_augmentation_is_the_fixed_bottom_crop():
    aug = sample_augmentation((1600, 900), FINAL_DIM, is_train=False, **LSS_TRAIN)
    resize = max(128 / 900, 352 / 1600)
    new_w, new_h = int(1600 * resize), int(900 * resize)
    assert aug.resize_dims == (new_w, new_h)
    assert aug.crop == (int((new_w - 352) / 2), int((1 - 0.11) * new_h) - 128)
    assert not aug.flip and aug.rotate == 0.0
    assert aug == sample_augmentation((1600, 900), FINAL_DIM, is_train=False, **LSS_TRAIN)


def test_train_augmentation_stays_in_its_ranges():
    rng = np.random.default_rng(1)
    flips = 0
    for _ in range(200):
        aug = sample_augmentation((1600, 900), FINAL_DIM, is_train=True, rng=rng, **LSS_TRAIN)
        w, h = aug.resize_dims
        assert int(1600 * 0.193) <= w <= int(1600 * 0.225)
        assert 0 <= aug.crop[0] <= max(0, w - 352)
        bottom = aug.crop[1] + 128
        assert int((1 - 0.22) * h) - 1 <= bottom <= h
        assert -5.4 <= aug.rotate <= 5.4
        flips += aug.flip
    assert 60 < flips < 140
    no_flip = sample_augmentation((1600, 900), FINAL_DIM, is_train=True, rng=rng, **{**LSS_TRAIN, "rand_flip": False})
    assert not no_flip.flip
    with pytest.raises(ValueError, match="rng"):
        sample_augmentation((1600, 900), FINAL_DIM, is_train=True, **LSS_TRAIN)


def test_flip_and_rotation_affines():
    h, w = FINAL_DIM
    flip = crop_flip_rotate_affine(ImageAugmentation((400, 200), (0, 0), flip=True), FINAL_DIM)
    assert np.allclose(flip @ [0, 5, 1], [w - 1, 5, 1]) and np.allclose(flip @ [w - 1, 5, 1], [0, 5, 1])
    rot = crop_flip_rotate_affine(ImageAugmentation((400, 200), (10, 20), rotate=90.0), FINAL_DIM)
    centre = np.array([(w - 1) / 2 + 10, (h - 1) / 2 + 20, 1.0])
    assert np.allclose(rot @ centre, [(w - 1) / 2, (h - 1) / 2, 1])
    # Counter-clockwise on screen: a point right of the centre moves above it (smaller v).
    assert np.allclose(rot @ (centre + [5, 0, 0]), [(w - 1) / 2, (h - 1) / 2 - 5, 1])


def test_decode_resized_edge_alignment(tmp_path):
    """A sharp vertical edge at source column boundary c ends at c * scale in the resized image."""
    img = np.zeros((900, 1600, 3), dtype=np.uint8)
    img[:, 800:] = 255
    path = tmp_path / "edge.png"
    Image.fromarray(img).save(path)
    out, affine = decode_resized(path.read_bytes(), (1600, 900), (320, 180))
    assert out.shape == (180, 320, 3)
    # The boundary between source pixels 799 and 800 sits at u = 799.5.
    edge = affine @ [799.5, 0, 1]
    assert edge[0] == pytest.approx(159.5)
    assert out[90, 159, 0] == 0 and out[90, 160, 0] == 255


def test_importing_the_data_pipeline_limits_opencv_to_one_thread():
    # a parent-process OpenCV thread pool can deadlock forked DataLoader workers
    import subprocess
    import sys

    code = "import cv2; cv2.setNumThreads(4); import lss.data; print(cv2.getNumThreads())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


def textured_jpeg(path, size=(1600, 900), seed=0):
    """Smooth random colour texture (so DCT-scaled decodes of different decoders can be compared)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (size[1] // 25, size[0] // 25, 3), dtype=np.uint8)
    img = cv2.resize(small, size, interpolation=cv2.INTER_CUBIC)
    Image.fromarray(img).save(path, quality=92)
    return img


@pytest.mark.parametrize("resize_dims", [(340, 191), (700, 400), (1000, 560), (150, 80), (1600, 900)])
def test_reduced_decode_matches_pil_draft(tmp_path, resize_dims):
    """OpenCV's reduced decode uses the DCT scale PIL's draft picks and gives the same pixels (RGB order)."""
    path = tmp_path / "tex.jpg"
    textured_jpeg(path)
    with Image.open(path) as im:
        _, (_, _, draft_w, _) = im.draft("RGB", resize_dims)
        pil = np.asarray(im.convert("RGB"))
    assert jpeg_scale((1600, 900), resize_dims) == 1600 // draft_w
    pil = cv2.resize(pil, resize_dims, interpolation=cv2.INTER_AREA) if pil.shape[1] != resize_dims[0] else pil
    ours, _ = decode_resized(path.read_bytes(), (1600, 900), resize_dims)
    diff = np.abs(ours[..., ::-1].astype(int) - pil.astype(int))
    assert diff.mean() < 1.0 and diff.max() <= 12


def test_decode_rejects_wrong_size_and_garbage(tmp_path):
    path = tmp_path / "tex.jpg"
    textured_jpeg(path, size=(800, 450))
    with pytest.raises(OSError, match=r"image is 800x452 pixels, expected 1600x900"):
        decode_resized(path.read_bytes(), (1600, 900), (340, 191))
    with pytest.raises(OSError, match="not a decodable image"):
        decode_resized(b"\xff\xd8\xff garbage", (1600, 900), (340, 191))
    assert image_size_from_header(path.read_bytes()) == (800, 450)


def test_normalize_images_is_the_per_channel_formula():
    from lss.data.nuscenes import normalize_images

    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    lut = ((np.arange(256)[:, None] / 255.0 - mean) / std).astype(np.float32)
    images = np.random.default_rng(0).integers(0, 256, (3, 16, 24, 3), dtype=np.uint8)
    out = normalize_images(list(images), lut)
    want = (images.transpose(0, 3, 1, 2) / 255.0 - mean[:, None, None]) / std[:, None, None]
    assert out.shape == (3, 3, 16, 24) and out.dtype == torch.float32
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=1e-6)
    assert normalize_images([], lut).shape == (0, 3, 0, 0)
