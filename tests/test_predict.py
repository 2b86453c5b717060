"""lss.Predictor and `lss predict`: the Predictor's maps equal the forward of `lss eval` on dataset samples (and its
boxes the evaluation's decoding); a rig file written from a nuScenes sample gives the sample's output; inputs of another
resolution, cropped or rotated land on the same content; every bad input gets one line; the npz round trip; the
command line end to end on the tiny synthetic set; the CUDA-graph path (captured on a GPU, its buffers on the CPU);
the onnxruntime backend; the benchmark suite in its tiny form."""
import json
import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

import lss
from conftest import val_statistics_checkpoint
from lss.cli import main
from lss.config import load_config
from lss.data import collate
from lss.data.camera_inputs import RigImageFolder, camera_inputs
from lss.data.loader import build_dataset
from lss.data.tables import load_tables
from lss.engine.predictor import CapturedForward, EagerForward, Prediction, Predictor
from lss.errors import ArgumentError, CheckpointError
from lss.geometry import RIG_KEYS, ego_to_pixels
from lss.geometry.rig_file import read_rig_file, rig_record, write_rig_file

TINY = ["data.final_dim=[32, 96]", "data.resize_lim=[0.24, 0.26]", "grid.xbound=[-16.0, 16.0, 1.0]",
        "grid.ybound=[-16.0, 16.0, 1.0]", "grid.dbound=[4.0, 20.0, 2.0]", "model.context_channels=8",
        "data.classes=[vehicle, drivable_area]", "data.workers=0", "train.device=cpu", "eval.batch_size=2"]
DETECTION = ["model.heads=[segmentation, detection]", "data.detection_targets=true", "detection.head_channels=8"]


def _checkpoint(cfg, path):
    return val_statistics_checkpoint(cfg, path, step=7)


@pytest.fixture(scope="module")
def tiny(synthetic_root, tmp_path_factory):
    """(config, checkpoint) of the tiny segmentation model."""
    cfg = load_config(None, TINY + [f"data.dataroot={synthetic_root}"])
    return cfg, _checkpoint(cfg, tmp_path_factory.mktemp("predict") / "best.pt")


@pytest.fixture(scope="module")
def val_set(tiny):
    cfg, _ = tiny
    return build_dataset(cfg, cfg.data.val_split, False, verbose=False)


@pytest.fixture(scope="module")
def predictor(tiny):
    return Predictor(tiny[1], "cpu")


def cam_to_ego(rot, trans):
    """N x 4 x 4 from N x 3 x 3 rotations and N x 3 translations."""
    out = np.tile(np.eye(4), (len(rot), 1, 1))
    out[:, :3, :3], out[:, :3, 3] = rot, trans
    return out


def sample_calibration(dataset, index):
    """(intrinsics, cam_to_ego) of a dataset sample, float64."""
    return (dataset.intrinsics[index].astype(np.float64),
            cam_to_ego(dataset.sensor2ego_rot[index], dataset.sensor2ego_trans[index]))


def rgb_images(dataset, index):
    return [cv2.imread(path)[..., ::-1].copy() for path in dataset.image_paths[index]]


def eval_logits(cfg, ckpt, monkeypatch):
    """The segmentation logits of every validation sample as `lss eval` computes them (its IoU meter's input)."""
    from lss.engine import eval as eval_mod

    seen = []
    real = eval_mod.IoUMeter.update
    monkeypatch.setattr(eval_mod.IoUMeter, "update", lambda self, logits, targets: (
        seen.append(logits.detach().clone()), real(self, logits, targets))[-1])
    eval_mod.evaluate_checkpoint(cfg, str(ckpt), out_dir=str(ckpt.parent / "eval"))
    return torch.cat(seen)


# ---------------------------------------------------------------------------------------------- equal to lss eval
def test_predictor_equals_the_eval_forward_on_dataset_samples(tiny, val_set, predictor, monkeypatch):
    cfg, ckpt = tiny
    want = torch.sigmoid(eval_logits(cfg, ckpt, monkeypatch)).numpy()
    assert len(want) == len(val_set) == 3 and want.std() > 0.01
    # the dataset's items, batched as the evaluation batches them (its last batch filled up with copies)
    got = [p.probabilities for ids in ([0, 1], [2, 2]) for p in
           predictor.predict_batch(collate([val_set[i] for i in ids]))][:3]
    np.testing.assert_array_equal(np.stack(got), want)
    # the sample's image files with its calibration, one sample and a batch: decoded as the dataset decodes them
    # (batches of another size: the CPU convolutions round differently)
    calibration = [sample_calibration(val_set, i) for i in range(3)]
    one = predictor.predict(list(val_set.image_paths[1]), *calibration[1])
    assert isinstance(one, Prediction) and one.name == ""
    np.testing.assert_allclose(one.probabilities, want[1], rtol=0, atol=1e-5)
    pair = predictor([list(val_set.image_paths[i]) for i in range(2)], *map(np.stack, zip(*calibration[:2])))
    np.testing.assert_array_equal(np.stack([p.probabilities for p in pair]), want[:2])
    # decoded pixels (uint8 RGB arrays, tensors): the network sees the image decoded in full instead of the JPEG's
    # reduced decode, resampled at nearly the same positions
    arrays = predictor.predict(rgb_images(val_set, 2), *calibration[2])
    tensors = predictor.predict(torch.from_numpy(np.stack(rgb_images(val_set, 2))),
                                *map(torch.from_numpy, calibration[2]))
    np.testing.assert_array_equal(arrays.probabilities, tensors.probabilities)
    decoded, files = predictor.inputs(rgb_images(val_set, 2), *calibration[2]), val_set[2]
    assert (decoded["images"][0].float() - files["images"].float()).abs().mean() < 8  # of 255 levels
    for key in RIG_KEYS:
        torch.testing.assert_close(decoded[key][0], files[key], rtol=0, atol=0.02)
    assert one.probabilities.shape == (2, 32, 32) and one.classes == ("vehicle", "drivable_area")
    assert one.extent == (-16.0, 16.0, -16.0, 16.0) and one.boxes is None


def test_boxes_are_the_evaluations_decoding(synthetic_root, tmp_path):
    from lss.engine.detection_eval import DetectionCollector
    from lss.engine.checkpoint import load_checkpoint_model

    cfg = load_config(None, TINY + DETECTION + [f"data.dataroot={synthetic_root}"])
    ckpt = _checkpoint(cfg, tmp_path / "det.pt")
    batch = collate([build_dataset(cfg, cfg.data.val_split, False, verbose=False)[i] for i in range(2)])
    model, _ = load_checkpoint_model(cfg, ckpt, torch.device("cpu"))
    collector = DetectionCollector(cfg)
    with torch.no_grad():
        collector.add(model(batch), batch)
    got = Predictor(ckpt, "cpu").predict_batch(batch)
    for token, prediction in zip(batch["sample_token"], got):
        want = collector.detections[token]
        assert prediction.name == token and len(prediction.boxes) > 0
        for key in ("boxes", "scores", "labels"):
            np.testing.assert_array_equal(getattr(prediction, key), want[key].numpy())
    assert Prediction.load(got[0].save(tmp_path / "det.npz")).detections.keys() == {"boxes", "scores", "labels"}


# ------------------------------------------------------------------------------------------------------ rig files
def test_a_rig_file_written_from_a_nuscenes_sample_gives_the_samples_output(tiny, val_set, predictor, tmp_path):
    cfg, _ = tiny
    index = 1
    nusc = load_tables(val_set.root, val_set.version)
    sample = nusc.get("sample", val_set.sample_tokens[index])
    records, folder = {}, tmp_path / "frame"
    folder.mkdir()
    for camera in cfg.data.cameras:
        data = nusc.get("sample_data", sample["data"][camera])
        calib = nusc.get("calibrated_sensor", data["calibrated_sensor_token"])
        records[camera] = rig_record(calib["camera_intrinsic"], calib["rotation"], calib["translation"],
                                     (data["width"], data["height"]))
        shutil.copy(val_set.root / data["filename"], folder / f"{camera}.jpg")
    rig = write_rig_file(tmp_path / "rig.json", records, note="from " + sample["token"])
    frames = RigImageFolder(folder, rig, cfg)
    assert len(frames) == 1 and frames[0]["sample_token"] == "frame"
    item, want = frames[0], val_set[index]
    for key in ("images",) + RIG_KEYS:
        torch.testing.assert_close(item[key], want[key], rtol=0, atol=0)
    np.testing.assert_array_equal(predictor.predict_batch(collate([item]))[0].probabilities,
                                  predictor.predict_batch(collate([want]))[0].probabilities)


def test_make_synthetic_writes_the_rig_of_its_cameras(synthetic_root, val_set):
    K, cam_to_ego_, sizes = read_rig_file(synthetic_root / "rig.json", val_set.cameras)
    np.testing.assert_allclose(K, val_set.intrinsics[0], rtol=1e-6)
    np.testing.assert_allclose(cam_to_ego_[:, :3, :3], val_set.sensor2ego_rot[0], atol=1e-6)
    np.testing.assert_allclose(cam_to_ego_[:, :3, 3], val_set.sensor2ego_trans[0], atol=1e-6)
    assert sizes == [(400, 225)] * 6 and json.loads((synthetic_root / "rig.json").read_text())["_note"]


# ------------------------------------------------------------------------- other resolutions, crops and rotations
def colours_at(item, points, cfg):
    """The RGB (0..255) of the item's network images where `points` (ego metres) project, and where they are seen."""
    H, W = cfg.data.final_dim
    colours, seen = [], []
    for n in range(len(cfg.data.cameras)):
        pixels, depth = ego_to_pixels(points, *(item[k][n].numpy() for k in RIG_KEYS))
        u, v = np.round(pixels[:, 0]).astype(int), np.round(pixels[:, 1]).astype(int)
        seen.append((depth > 1) & (u >= 1) & (u < W - 1) & (v >= 1) & (v < H - 1))
        image = item["images"][n].numpy().transpose(1, 2, 0).astype(np.float64)
        colours.append(image[np.clip(v, 0, H - 1), np.clip(u, 0, W - 1)])
    return np.stack(colours), np.stack(seen)


def transformed_inputs(images, K, rot, size, how):
    """The images, intrinsics and camera rotations of the same cameras seen through an image transform."""
    W, H = size
    if how == "2x":  # nearest-neighbour upscale: pixel edges scale by 2
        return ([cv2.resize(im, (2 * W, 2 * H), interpolation=cv2.INTER_NEAREST) for im in images],
                np.array([[2, 0, 0.5], [0, 2, 0.5], [0, 0, 1.0]]) @ K, rot)
    if how == "crop":
        K = K.copy()
        K[:, 0, 2] -= 60
        K[:, 1, 2] -= 40
        return [np.ascontiguousarray(im[40:, 60:360]) for im in images], K, rot
    if how == "upside_down":  # the camera turned by 180 degrees about its optical axis
        K = np.stack([[[k[0, 0], 0, W - 1 - k[0, 2]], [0, k[1, 1], H - 1 - k[1, 2]], [0, 0, 1]] for k in K])
        return [np.ascontiguousarray(im[::-1, ::-1]) for im in images], K, rot @ np.diag([-1.0, -1.0, 1.0])
    # portrait: the camera turned by 90 degrees; np.rot90 maps pixel (u, v) to (v, W - 1 - u)
    K = np.stack([[[k[1, 1], 0, k[1, 2]], [0, k[0, 0], W - 1 - k[0, 2]], [0, 0, 1]] for k in K])
    turn = np.array([[0.0, 1.0, 0.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    return [np.ascontiguousarray(np.rot90(im)) for im in images], K, rot @ turn.T


@pytest.mark.parametrize("how", ["crop", "upside_down", "portrait"])
def test_cropped_and_rotated_inputs_land_on_the_same_content(tiny, val_set, how):
    cfg, _ = tiny
    images = rgb_images(val_set, 0)
    K, T = sample_calibration(val_set, 0)
    reference = camera_inputs(images, K, T, cfg)
    points = np.random.default_rng(0).uniform((-30, -30, 0), (30, 30, 3), (4000, 3))
    want, seen = colours_at(reference, points, cfg)
    new_images, new_K, new_rot = transformed_inputs(images, K, T[:, :3, :3], (400, 225), how)
    item = camera_inputs(new_images, new_K, cam_to_ego(new_rot, T[:, :3, 3]), cfg)
    got, seen_too = colours_at(item, points, cfg)
    both = seen & seen_too
    assert both.sum() > 500
    # resampled at other positions: equal colours up to the interpolation at edges
    assert np.median(np.abs(got - want)[both]) <= 4 and np.abs(got - want)[both].mean() < 10
    if how != "portrait":  # the transformed images with the original calibration: other content
        wrong = camera_inputs(new_images, K, T, cfg)
        got, seen_too = colours_at(wrong, points, cfg)
        assert np.median(np.abs(got - want)[seen & seen_too]) > 15


def test_a_larger_resolution_with_its_intrinsics_gives_the_same_maps(tiny, val_set, predictor):
    images = rgb_images(val_set, 0)
    K, T = sample_calibration(val_set, 0)
    larger, K2, _ = transformed_inputs(images, K, T[:, :3, :3], (400, 225), "2x")
    assert larger[0].shape == (450, 800, 3)
    np.testing.assert_array_equal(predictor.predict(larger, K2, T).probabilities,
                                  predictor.predict(images, K, T).probabilities)


# -------------------------------------------------------------------------------------------------- bad inputs
def bad_inputs(val_set, tmp_path):
    images = rgb_images(val_set, 0)
    K, T = sample_calibration(val_set, 0)
    skewed, nan_K = T.copy(), K.copy()
    skewed[2, :3, :3] *= 1.5
    nan_K[4, 0, 2] = np.nan
    text = tmp_path / "notes.jpg"
    text.write_text("not an image")
    return {
        "five images": ((images[:5], K, T), r"5 images for a model of 6 cameras: .*CAM_FRONT_LEFT, CAM_FRONT,"),
        "sizes differ": ((images[:5] + [images[5][:200]], K, T),
                         r"differ in size \(.*CAM_BACK_RIGHT 400x200\): give the cameras' images at one size"),
        "not a rotation": ((images, K, skewed), r"cam_to_ego of CAM_FRONT_RIGHT: its 3 x 3 block is not a rotation"),
        "NaN": ((images, nan_K, T), r"intrinsics of CAM_BACK holds NaN or inf"),
        "unreadable file": (([str(text)] + images[1:], K, T),
                            rf"image {text} \(CAM_FRONT_LEFT\) is not a JPEG or PNG image \(12 bytes\)"),
        "missing file": (([str(tmp_path / "gone.jpg")] + images[1:], K, T),
                         r"gone.jpg \(CAM_FRONT_LEFT\) cannot be read: No such file"),
        "float pixels": (([images[0] / 255.0] + images[1:], K, T), r"float64 \(225, 400, 3\): expected H x W x 3 uint8"),
        "3 x 3 extrinsics": ((images, K, T[:, :3, :3]), r"cam_to_ego is 6 x 3 x 3, expected 6 x 4 x 4"),
    }


@pytest.mark.parametrize("case", ["five images", "sizes differ", "not a rotation", "NaN", "unreadable file",
                                  "missing file", "float pixels", "3 x 3 extrinsics"])
def test_bad_inputs_get_one_line_saying_what_to_do(val_set, predictor, tmp_path, case):
    args, message = bad_inputs(val_set, tmp_path)[case]
    with pytest.raises(ArgumentError, match=message) as error:
        predictor.predict(*args)
    assert "\n" not in str(error.value)


def test_a_rig_file_without_a_camera_or_with_images_of_another_size_is_refused(tiny, synthetic_root, tmp_path):
    cfg, _ = tiny
    rig = json.loads((synthetic_root / "rig.json").read_text())
    del rig["CAM_BACK"]
    (tmp_path / "rig.json").write_text(json.dumps(rig))
    with pytest.raises(ArgumentError, match=r"rig.json has no calibration of camera\(s\) CAM_BACK; it has CAM_FRONT, "):
        RigImageFolder(synthetic_root / "samples", tmp_path / "rig.json", cfg)
    frames = RigImageFolder(synthetic_root / "samples", synthetic_root / "rig.json", cfg)
    assert len(frames) == 6  # both scenes, in name order
    rig = json.loads((synthetic_root / "rig.json").read_text())
    rig["CAM_FRONT"]["image_size"] = [1600, 900]
    (tmp_path / "rig.json").write_text(json.dumps(rig))
    with pytest.raises(ArgumentError, match=r"CAM_FRONT is 400x225 but its calibration is for 1600x900 images"):
        RigImageFolder(synthetic_root / "samples", tmp_path / "rig.json", cfg)[0]


def test_a_checkpoint_of_another_grid_or_class_list_is_refused(tiny):
    cfg, ckpt = tiny
    for change, named in (("grid.xbound=[-20.0, 20.0, 1.0]", "grid.xbound"), ("data.classes=[vehicle]", "data.classes")):
        other = load_config(None, TINY + [change])
        with pytest.raises(CheckpointError, match=rf"checkpoint .*best.pt was trained with {named}=.*set the"):
            Predictor(ckpt, "cpu", config=other)
        with pytest.raises(CheckpointError, match=rf"trained with {named}="):
            Predictor(ckpt, "cpu", config=other, backend="onnxruntime")


# ------------------------------------------------------------------------------------------------- npz round trip
def test_the_npz_round_trip_keeps_every_field(val_set, predictor, tmp_path):
    prediction = predictor.predict_batch(collate([val_set[0]]))[0]
    loaded = Prediction.load(prediction.save(tmp_path / "p.npz"))
    np.testing.assert_array_equal(loaded.probabilities, prediction.probabilities)
    assert loaded.probabilities.dtype == np.float32
    assert (loaded.classes, loaded.xbound, loaded.ybound, loaded.name, loaded.boxes) == (
        prediction.classes, (-16.0, 16.0, 1.0), (-16.0, 16.0, 1.0), val_set.sample_tokens[0], None)
    with_boxes = Prediction(prediction.probabilities, prediction.classes, prediction.xbound, prediction.ybound,
                            boxes=np.ones((2, 9), np.float32), scores=np.array([0.9, 0.5], np.float32),
                            labels=np.array([0, 3]), name="x")
    loaded = Prediction.load(with_boxes.save(tmp_path / "b.npz"))
    for key in ("boxes", "scores", "labels"):
        np.testing.assert_array_equal(getattr(loaded, key), getattr(with_boxes, key))
    assert list(np.load(tmp_path / "b.npz")["detection_classes"])[:2] == ["car", "truck"]


# ---------------------------------------------------------------------------------------------------- the CLI
def test_lss_predict_on_a_scene_and_on_its_images_with_the_rig_file(tiny, val_set, predictor, tmp_path, capsys):
    cfg, ckpt = tiny
    root = val_set.root
    scene = load_tables(root, val_set.version).get("scene", load_tables(root, val_set.version).get(
        "sample", val_set.sample_tokens[0])["scene_token"])["name"]
    assert main(["predict", "--ckpt", str(ckpt), "--dataroot", str(root), "--scene", scene,
                 "--out", str(tmp_path / "scene"), "--gif", "--mp4", "--device", "cpu"]) == 0
    assert "wrote 8 file(s) for 3 sample(s)" in capsys.readouterr().out
    npz = sorted((tmp_path / "scene").glob("*.npz"))
    assert [p.name[:17] for p in npz] == [f"{i:04d}_{t[:12]}" for i, t in enumerate(val_set.sample_tokens)]
    # batched as the command batches them: eval.batch_size 2, the last batch filled up
    want = [p for ids in ([0, 1], [2, 2]) for p in predictor.predict_batch(collate([val_set[i] for i in ids]))]
    for file, prediction in zip(npz, want):
        np.testing.assert_array_equal(Prediction.load(file).probabilities, prediction.probabilities)
    picture = cv2.imread(str(npz[0].with_suffix(".png")))
    assert picture is not None and picture.std() > 0
    assert (tmp_path / "scene" / f"{scene}.gif").is_file()
    video = cv2.VideoCapture(str(tmp_path / "scene" / f"{scene}.mp4"))
    assert int(video.get(cv2.CAP_PROP_FRAME_COUNT)) == 3
    # the set's images with make-synthetic's rig file: frames in name order, the same maps for the same images
    assert main(["predict", "--ckpt", str(ckpt), "--images", str(root / "samples"), "--calib",
                 str(root / "rig.json"), "--out", str(tmp_path / "images"), "--no-pictures", "--batch-size", "4"]) == 0
    frames = sorted((tmp_path / "images").glob("*.npz"))
    assert len(frames) == 6 and not list((tmp_path / "images").glob("*.png"))
    by_name = {p.name: p for p in map(Prediction.load, frames)}
    for index, prediction in enumerate(want[:3]):
        name = Path(val_set.image_paths[index][0]).stem.replace("__CAM_FRONT_LEFT__", "__")
        np.testing.assert_allclose(by_name[name].probabilities, prediction.probabilities, rtol=0, atol=1e-5)


def test_lss_predict_draws_the_prediction_alone_without_ground_truth(tiny, synthetic_root, tmp_path):
    from lss.viz.render import render_sample

    cfg, ckpt = tiny
    frames = RigImageFolder(synthetic_root / "samples", synthetic_root / "rig.json", cfg)
    prediction = Predictor(ckpt, "cpu").predict_batch(collate([frames[0]]))[0]
    figure = render_sample(frames[0], prediction.probabilities, cfg, "t")
    assert "prediction" in figure.regions and "truth" not in figure.regions


@pytest.mark.parametrize("argv, says", [
    (["--out", "o"], "give a nuScenes scene (--dataroot DIR --scene NAME) or camera images"),
    (["--dataroot", "d", "--out", "o"], "give a nuScenes scene"),
    (["--images", "d", "--out", "o"], "--images d needs --calib RIG.json"),
    (["--images", "d", "--calib", "r", "--out", "o", "--gif", "--no-pictures"], "--gif and --mp4 animate the pictures"),
])
def test_lss_predict_argument_errors_exit_2_with_one_line(tiny, capsys, argv, says):
    assert main(["predict", "--ckpt", str(tiny[1])] + argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert says in err[0] and err[0].startswith("lss predict: error:")


def test_lss_predict_names_a_missing_scene_and_a_missing_camera_folder(tiny, synthetic_root, tmp_path, capsys):
    ckpt = str(tiny[1])
    assert main(["predict", "--ckpt", ckpt, "--dataroot", str(synthetic_root), "--scene", "scene-9999",
                 "--out", str(tmp_path)]) == 2
    assert "no scene 'scene-9999' in the v1.0-mini tables" in capsys.readouterr().err
    (tmp_path / "images" / "CAM_FRONT").mkdir(parents=True)
    assert main(["predict", "--ckpt", ckpt, "--images", str(tmp_path / "images"), "--calib",
                 str(synthetic_root / "rig.json"), "--out", str(tmp_path)]) == 2
    assert "no images of camera(s) CAM_FRONT_LEFT, CAM_FRONT, CAM_FRONT_RIGHT" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- backends and graphs
def test_the_static_buffers_of_the_graph_path_carry_every_batch(tiny, val_set, predictor):
    """CapturedForward without the capture (CPU): each batch size gets its buffers, refilled on every call."""
    model = predictor.model
    eager, captured = EagerForward(model, None), CapturedForward(model, None, capture=False)
    batches = [collate([val_set[i] for i in ids]) for ids in ([0, 1], [2, 0], [1])]
    for batch in batches:
        torch.testing.assert_close(captured(batch)["segmentation"], eager(batch)["segmentation"], rtol=0, atol=0)
    assert sorted(captured.graphs) == [1, 2]


def test_the_onnxruntime_backend_gives_the_torch_maps(tiny, val_set, predictor, tmp_path):
    pytest.importorskip("onnxruntime")
    cfg, ckpt = tiny
    onnx = Predictor(ckpt, "cpu", backend="onnxruntime")
    batch = collate([val_set[i] for i in range(2)])
    for ours, theirs in zip(predictor.predict_batch(batch), onnx.predict_batch(batch)):
        np.testing.assert_allclose(theirs.probabilities, ours.probabilities, atol=1e-4)
    from lss.export import export_checkpoint

    fixed = export_checkpoint(cfg, ckpt, tmp_path / "fixed.onnx")["path"]
    with pytest.raises(ArgumentError, match="was exported with a fixed rig .*lss export --rig-inputs"):
        Predictor(ckpt, "cpu", backend="onnxruntime", onnx=fixed)


def test_the_onnxruntime_backend_gives_the_torch_boxes(synthetic_root, tmp_path):
    pytest.importorskip("onnxruntime")
    cfg = load_config(None, TINY + DETECTION + [f"data.dataroot={synthetic_root}"])
    ckpt = _checkpoint(cfg, tmp_path / "det.pt")
    batch = collate([build_dataset(cfg, cfg.data.val_split, False, verbose=False)[i] for i in range(2)])
    onnx = Predictor(ckpt, "cpu", backend="onnxruntime")
    assert onnx.forward.outputs == ["segmentation", "det_heatmap", "det_regression"]
    for ours, theirs in zip(Predictor(ckpt, "cpu").predict_batch(batch), onnx.predict_batch(batch)):
        assert len(ours.boxes) > 0 and theirs.boxes.shape[1] == 9
        np.testing.assert_allclose(theirs.probabilities, ours.probabilities, atol=1e-4)
        np.testing.assert_allclose(theirs.scores[:20], ours.scores[:20], atol=1e-4)
        np.testing.assert_allclose(theirs.boxes[:20], ours.boxes[:20], atol=1e-3)
        np.testing.assert_array_equal(theirs.labels[:20], ours.labels[:20])


@pytest.mark.cuda
def test_the_cuda_graph_replays_the_eager_bf16_forward_on_any_calibration(tiny, val_set):
    cfg, ckpt = tiny
    graphed, eager = Predictor(ckpt, "cuda"), Predictor(ckpt, "cuda", cuda_graph=False)
    fp32 = Predictor(ckpt, "cpu")
    assert isinstance(graphed.forward, CapturedForward) and type(eager.forward) is EagerForward
    items = [val_set[i] for i in range(3)]
    # another calibration in the same buffers: the graph builds its lookup table from the replayed rig
    moved = dict(items[1], sensor2ego_trans=items[1]["sensor2ego_trans"] + torch.tensor([1.5, -0.5, 0.0]))
    for batch in (collate(items[:2]), collate([items[2], moved]), collate([moved]), collate(items[:2])):
        got, want = graphed.predict_batch(batch), eager.predict_batch(batch)
        reference = fp32.predict_batch(batch)
        for g, w, r in zip(got, want, reference):
            np.testing.assert_allclose(g.probabilities, w.probabilities, atol=1e-3)
            # bf16 against fp32: this random model's maps move by up to 0.05 on average under the CPU's bf16 autocast,
            # its maps of two samples differ by 0.16
            assert np.abs(g.probabilities - r.probabilities).mean() < 0.1
    assert sorted(graphed.forward.graphs) == [1, 2]
    assert all(entry[0] is not None for entry in graphed.forward.graphs.values())
    moved_map = graphed.predict_batch(collate([moved]))[0].probabilities
    assert np.abs(moved_map - graphed.predict_batch(collate([items[1]]))[0].probabilities).max() > 0.01


@pytest.mark.cuda
def test_the_detection_head_is_graphed_without_its_second_stage(synthetic_root, tmp_path):
    cfg = load_config(None, TINY + DETECTION + [f"data.dataroot={synthetic_root}"])
    ckpt = _checkpoint(cfg, tmp_path / "det.pt")
    batch = collate([build_dataset(cfg, cfg.data.val_split, False, verbose=False)[i] for i in range(2)])
    graphed, eager = Predictor(ckpt, "cuda"), Predictor(ckpt, "cuda", cuda_graph=False)
    for g, e in zip(graphed.predict_batch(batch), eager.predict_batch(batch)):
        np.testing.assert_allclose(g.scores[:20], e.scores[:20], atol=1e-3)
        np.testing.assert_allclose(g.boxes[:20], e.boxes[:20], atol=1e-2)
    refine = load_config(None, TINY + DETECTION + ["detection.refine=true", f"data.dataroot={synthetic_root}"])
    assert type(Predictor(_checkpoint(refine, tmp_path / "refine.pt"), "cuda").forward) is EagerForward


# ------------------------------------------------------------------------------------------------- API, bench
def test_lss_predictor_is_imported_on_first_use():
    import subprocess
    import sys

    code = "import sys, lss; assert 'torch' not in sys.modules; print(lss.Predictor.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "lss.engine.predictor" and lss.Prediction is Prediction
    with pytest.raises(AttributeError, match="no attribute 'Predicter'"):
        lss.Predicter


def test_the_predict_benchmark_measures_a_scene_and_batch_one(tiny, val_set, tmp_path):
    from benchmarks import BenchContext
    from benchmarks.predict import measure

    cfg, ckpt = tiny
    scene = load_tables(val_set.root, val_set.version).scene[1]["name"]
    rows = measure(BenchContext(torch.device("cpu"), quick=True), cfg, ckpt, scene)
    impls = {(r["case"].split(" ")[0], r["impl"]) for r in rows}
    assert {("scene", "lss"), ("batch-1", "lss"), ("scene", "onnxruntime"), ("batch-1", "onnxruntime")} <= impls
    assert all(r["ms"] > 0 for r in rows)
    assert all("samples/s" in r["notes"] for r in rows if r["case"].startswith("scene"))
