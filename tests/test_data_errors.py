"""Broken data on disk (tables, maps, images, annotations) is a DatasetError whose first line names the file,
also when a DataLoader worker meets it."""
import json
import os
import re
import shutil

import numpy as np
import pytest
import torch

from lss.cli import build_parser
from lss.config import Config
from lss.data import collate
from lss.data.nuscenes import NuScenesBEV, locate_dataroot
from lss.errors import DatasetError

VERSION = "v1.0-mini"


def make_config(classes=("vehicle",)):
    cfg = Config()
    cfg.data.final_dim = (64, 128)
    cfg.data.classes = classes
    return cfg


@pytest.fixture
def root(synthetic_root, tmp_path):
    """A private copy of the tiny synthetic set, to corrupt."""
    return shutil.copytree(synthetic_root, tmp_path / "data")


def dataset(root, classes=("vehicle",)):
    return NuScenesBEV(root, VERSION, "train", make_config(classes), is_train=False, verbose=False)


@pytest.mark.parametrize("content", [b"", b"\xff\xd8\xff\xe0 not really a jpeg", b"\x89PNG garbage"])
def test_broken_camera_image_names_the_file(root, content):
    ds = dataset(root)
    image = ds.image_paths[1, 2]
    open(image, "wb").write(content)
    with pytest.raises(DatasetError, match=rf"camera image {re.escape(image)} could not be decoded \(sample "):
        ds[1]


def test_worker_error_names_the_file_first(root):
    ds = dataset(root)
    image = ds.image_paths[1, 0]
    open(image, "wb").write(b"")
    loader = torch.utils.data.DataLoader(ds, batch_size=1, num_workers=1, collate_fn=collate)
    with pytest.raises(DatasetError) as info:
        list(loader)
    first = str(info.value).splitlines()[0]
    assert first.startswith(f"camera image {image} could not be decoded") and "empty (0 bytes" in first
    assert "worker process" in first and "Traceback" not in str(info.value)


def test_missing_image_in_a_worker_names_the_file_first(root):
    ds = dataset(root)
    image = ds.image_paths[1, 3]
    os.unlink(image)
    loader = torch.utils.data.DataLoader(ds, batch_size=1, num_workers=1, collate_fn=collate)
    with pytest.raises(FileNotFoundError) as info:
        list(loader)
    assert isinstance(info.value, DatasetError)
    assert str(info.value).splitlines()[0].startswith(f"camera image {image} not found")


@pytest.mark.parametrize("table,content", [("sample.json", "[{\"token\": "), ("scene.json", "{\"token\": \"x\"}"),
                                           ("sample_data.json", "{}")])
def test_broken_table_names_the_file(root, table, content):
    path = root / VERSION / table
    path.write_text(content)
    with pytest.raises(DatasetError, match=rf"{re.escape(str(path))} (is not valid JSON|holds a JSON dict, expected a JSON list)"):
        dataset(root)


def test_broken_map_names_the_file(root):
    path = next((root / "maps" / "expansion").glob("*.json"))
    path.write_text(path.read_text()[:100])
    with pytest.raises(DatasetError, match=rf"{re.escape(str(path))} is not valid JSON"):
        dataset(root, classes=("vehicle", "drivable_area"))


@pytest.mark.parametrize("field,value,says", [("size", [float("nan"), 1.0, 1.0], "is not finite"),
                                              ("translation", [2e5, 0.0, 0.0], "lies beyond 100000 m"),
                                              ("size", [-1.0, 1.0, 1.0], "has a negative size")])
def test_absurd_annotation_is_refused(root, field, value, says):
    path = root / VERSION / "sample_annotation.json"
    records = json.loads(path.read_text())
    records[0][field] = value
    path.write_text(json.dumps(records))
    token = records[0]["token"]
    with pytest.raises(DatasetError, match=rf"annotation {token} in {re.escape(str(path))} {says}"):
        for split in ("train", "val"):  # the record is in one of them
            NuScenesBEV(root, VERSION, split, make_config(), verbose=False)


def test_dataset_not_found_suggests_a_real_command(tmp_path):
    with pytest.raises(DatasetError) as info:
        locate_dataroot(tmp_path / "nowhere", VERSION)
    command = str(info.value).split("`")[1]
    assert command.startswith("lss make-synthetic ")
    args = build_parser().parse_args(command.split()[1:])
    assert args.out_dir == str(tmp_path / "nowhere") and args.version == VERSION


def test_empty_sample_table_is_named(root):
    path = root / VERSION / "sample.json"
    path.write_text("[]")
    with pytest.raises(DatasetError, match=rf"{re.escape(str(path))} holds no records, but scene scene-\d+ "
                                           r"refers to one \(its first_sample_token \w+; \d+ other record"):
        dataset(root)


def test_scene_without_samples_is_named(root):
    path = root / VERSION / "sample.json"
    scene = json.loads((root / VERSION / "scene.json").read_text())[0]
    samples = json.loads(path.read_text())
    path.write_text(json.dumps([s for s in samples if s["scene_token"] != scene["token"]]))
    with pytest.raises(DatasetError, match=rf"scene {scene['name']} in .*scene.json has no samples: "
                                           rf"{re.escape(str(path))} holds no record {scene['first_sample_token']}"):
        dataset(root)


def test_split_whose_scenes_have_no_samples_is_refused(root, tmp_path, monkeypatch):
    monkeypatch.setenv("LSS_CACHE_DIR", str(tmp_path / "cache"))
    for table in ("sample", "sample_data", "sample_annotation"):
        (root / VERSION / f"{table}.json").write_text("[]")
    with pytest.raises(DatasetError, match=r"split 'train' \(mini_train\): its 1 scene\(s\) \(scene-\d+\) have no "
                                           r"samples in .*sample.json"):
        dataset(root)


@pytest.mark.parametrize("content", [b"\x80\x05K\x03.", b"\x80\x05}\x94.", b"\x80\x05\x95\x10"])
def test_index_cache_of_another_shape_is_rebuilt(root, tmp_path, monkeypatch, content):
    """An int, an empty dict, a truncated pickle in place of the cached index: built again, the same."""
    from lss.data.nuscenes import INDEX_FIELDS

    monkeypatch.setenv("LSS_CACHE_DIR", str(tmp_path / "cache"))
    first = dataset(root)
    (cached,) = (tmp_path / "cache" / "index").glob("*.pkl")
    cached.write_bytes(content)
    again = dataset(root)
    for name in INDEX_FIELDS:
        a, b = getattr(first, name), getattr(again, name)
        assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b, name
    assert len(cached.read_bytes()) > 100  # rewritten whole
    from_cache = dataset(root)
    assert sorted(vars(from_cache)) == sorted(vars(first))  # INDEX_FIELDS is all the index sets
