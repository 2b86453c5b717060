"""data.decoded_cache: camera images kept decoded on disk give the same samples as decoding, and later epochs do not
decode."""
import os
import time

import numpy as np
import pytest
import torch

import lss.data.nuscenes as nuscenes_module
from lss.config import Config
from lss.data.decoded_cache import DecodedImages
from lss.data.nuscenes import NuScenesBEV


def config(decoded_cache):
    cfg = Config()
    # 400 x 225 images to about 90 x 50 before the crop: the JPEGs are decoded at DCT scale 1/4
    cfg.data.final_dim = (48, 96)
    cfg.data.resize_lim = (0.2, 0.24)
    cfg.data.rand_flip = True
    cfg.data.rot_lim = (-5.4, 5.4)
    cfg.data.decoded_cache = decoded_cache
    return cfg


def samples(root, decoded_cache, seed=3):
    ds = NuScenesBEV(root, "v1.0-mini", "mini_train", config(decoded_cache), is_train=True, verbose=False)
    torch.manual_seed(seed)
    return ds, [ds[i] for i in range(len(ds))]


def assert_same(a, b):
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], torch.Tensor):
                assert torch.equal(x[k], y[k]), k


def cached_files(root):
    return sorted(p for p in root.rglob("*.npy"))


def entry_image(file):
    """The image array of a cache entry (after its one-line source header)."""
    with open(file, "rb") as f:
        f.readline()
        return np.load(f)


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("LSS_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "decoded"


def test_same_samples_and_no_decode_after_the_first_epoch(synthetic_root, cache_root, monkeypatch):
    _, plain = samples(synthetic_root, False)
    assert not cache_root.exists()
    ds, first = samples(synthetic_root, True)
    assert_same(plain, first)
    files = cached_files(cache_root)
    assert len(files) == len(ds) * len(ds.cameras)
    image = entry_image(files[0])
    assert image.dtype == np.uint8 and image.shape == (57, 100, 3)  # ceil(225 / 4), 400 / 4

    def no_decode(*args, **kwargs):
        raise AssertionError("decoded although the image is in the cache")

    monkeypatch.setattr(nuscenes_module, "decode_scaled", no_decode)
    _, second = samples(synthetic_root, True)
    assert_same(plain, second)


def test_unreadable_entries_are_decoded_again_and_rewritten(synthetic_root, cache_root):
    _, plain = samples(synthetic_root, True)
    files = cached_files(cache_root)
    files[0].write_bytes(files[0].read_bytes()[:100])  # truncated
    np.save(files[1], np.zeros((3, 3, 3), np.uint8))  # no header
    header = files[2].read_bytes().split(b"\n", 1)[0] + b"\n"
    with open(files[2], "wb") as f:  # the right header, a wrong shape
        f.write(header)
        np.save(f, np.zeros((3, 3, 3), np.uint8))
    _, again = samples(synthetic_root, True)
    assert_same(plain, again)
    assert all(entry_image(f).shape == (57, 100, 3) for f in files[:3])


def test_a_changed_image_is_decoded_again(synthetic_root, cache_root, tmp_path):
    cache = DecodedImages()
    image = tmp_path / "cam.jpg"
    image.write_bytes(b"first")
    cache.store(str(image), np.full((2, 2, 3), 7, np.uint8), 4)
    assert cache.load(str(image), 4, (2, 2, 3))[0, 0, 0] == 7
    assert cache.load(str(image), 2, (2, 2, 3)) is None  # another scale
    image.write_bytes(b"second, longer")
    assert cache.load(str(image), 4, (2, 2, 3)) is None
    assert cache.load(str(tmp_path / "missing.jpg"), 4, (2, 2, 3)) is None


def test_an_image_rewritten_with_its_old_size_and_time_is_decoded_again(cache_root, tmp_path):
    cache = DecodedImages()
    image = tmp_path / "cam.jpg"
    image.write_bytes(b"first")
    before = image.stat()
    cache.store(str(image), np.full((2, 2, 3), 7, np.uint8), 4)
    time.sleep(0.05)  # past the file system's timestamp granularity
    image.write_bytes(b"other")  # same size
    os.utime(image, ns=(before.st_atime_ns, before.st_mtime_ns))  # and the old modification time
    assert image.stat().st_size == before.st_size and image.stat().st_mtime_ns == before.st_mtime_ns
    assert cache.load(str(image), 4, (2, 2, 3)) is None


def test_an_entry_replaced_by_another_images_is_decoded_again(synthetic_root, cache_root):
    _, plain = samples(synthetic_root, True)
    files = cached_files(cache_root)
    assert not np.array_equal(entry_image(files[0]), entry_image(files[1]))
    files[0].write_bytes(files[1].read_bytes())  # same shape, another image
    _, again = samples(synthetic_root, True)
    assert_same(plain, again)
    assert not np.array_equal(entry_image(files[0]), entry_image(files[1]))  # rewritten


def test_an_unwritable_cache_folder_only_means_no_cache(synthetic_root, tmp_path, monkeypatch):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("the cache folder's parent is a file: nothing can be created under it")
    monkeypatch.setenv("LSS_CACHE_DIR", str(blocker))
    _, plain = samples(synthetic_root, False)
    _, cached = samples(synthetic_root, True)
    assert_same(plain, cached)
    assert blocker.is_file()


def test_an_image_whose_suffix_hides_its_format_is_found(synthetic_root, cache_root, tmp_path, monkeypatch):
    """PNG files named .jpg: decoded at scale 1 (not the JPEG's 1/4) and found again in later epochs."""
    import shutil

    import cv2

    root = tmp_path / "png_as_jpg"
    shutil.copytree(synthetic_root, root)
    for path in (root / "samples").rglob("*.jpg"):
        ok, png = cv2.imencode(".png", cv2.imread(str(path)))
        path.write_bytes(png.tobytes())
    _, plain = samples(root, False)
    ds, first = samples(root, True)
    assert_same(plain, first)
    files = cached_files(cache_root)
    assert len(files) == len(ds) * len(ds.cameras) and entry_image(files[0]).shape == (225, 400, 3)

    def no_decode(*args, **kwargs):
        raise AssertionError("decoded although the image is in the cache")

    monkeypatch.setattr(nuscenes_module, "decode_scaled", no_decode)
    _, second = samples(root, True)
    assert_same(plain, second)
