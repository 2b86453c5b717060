"""Inference of a two-frame model: the Predictor feeds it the previous frame; StreamingPredictor reuses the camera
features of the frame before instead of recomputing them, with the predictions of the two-frame forward; one-frame
entry points (camera images with a rig) refuse it with a message."""
import numpy as np
import pytest
import torch

from lss.config import config_from_dict
from lss.data import NuScenesBEV, collate
from lss.engine.checkpoint import save_checkpoint
from lss.engine.predictor import Predictor, model_inputs
from lss.engine.streaming import StreamingPredictor
from lss.errors import ArgumentError
from lss.models.build import build_model
from test_temporal_model import SMALL

VERSION = "v1.0-mini"


def two_frame_config(root, frames=2, gap=1):
    return config_from_dict({**SMALL, "data": {**SMALL["data"], "dataroot": str(root), "resize_lim": [0.45, 0.55]},
                             "model": {**SMALL["model"], "temporal": {"frames": frames, "gap": gap}}})


@pytest.fixture(scope="module")
def two_frame_checkpoint(synthetic_root, tmp_path_factory):
    cfg = two_frame_config(synthetic_root)
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():  # batch-norm statistics of real images, so that the features are not all alike
        dataset = NuScenesBEV(synthetic_root, VERSION, "train", cfg, is_train=False, verbose=False)
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.momentum = None
                module.reset_running_stats()
        model.train()(collate([dataset[i] for i in range(len(dataset))]))
    path = tmp_path_factory.mktemp("temporal_ckpt") / "two.pt"
    save_checkpoint(path, model.eval(), step=1, config=cfg)
    return path, cfg


def scene_items(root, cfg):
    dataset = NuScenesBEV(root, VERSION, "val", cfg, is_train=False, verbose=False)
    return [dataset[i] for i in range(len(dataset))]


def test_model_inputs_add_the_previous_frame_for_two_frames(synthetic_root):
    one, two = two_frame_config(synthetic_root, 1), two_frame_config(synthetic_root)
    assert model_inputs(one) == ("images", "intrinsics", "sensor2ego_rot", "sensor2ego_trans", "post_rot",
                                 "post_trans")
    assert set(model_inputs(two)) - set(model_inputs(one)) == {
        "prev_images", "prev_intrinsics", "prev_sensor2ego_rot", "prev_sensor2ego_trans", "prev_post_rot",
        "prev_post_trans", "ego_motion"}


def test_streaming_reuses_the_features_of_the_frame_before_with_the_same_predictions(synthetic_root,
                                                                                     two_frame_checkpoint):
    path, cfg = two_frame_checkpoint
    predictor = Predictor(path, device="cpu")
    items = scene_items(synthetic_root, cfg)
    assert [it["prev_sample_token"] for it in items[1:]] == [it["sample_token"] for it in items[:-1]]
    full = [predictor.predict_batch(collate([item]))[0] for item in items]
    stream = StreamingPredictor(predictor)
    streamed = [p for out in stream.stream(collate([item]) for item in items) for p in out]
    assert stream.reused == len(items) - 1  # all but the scene's first sample
    for a, b in zip(full, streamed):
        assert a.name == b.name
        np.testing.assert_allclose(b.probabilities, a.probabilities, rtol=0, atol=1e-6)
    # the previous frame matters: its features taken from the sample itself give other predictions
    own = collate([items[1]])
    own["prev_images"] = own["images"]
    assert not np.allclose(predictor.predict_batch(own)[0].probabilities, full[1].probabilities, atol=1e-4)
    # a jump (or a reset) recomputes the previous frame's features
    stream.reset()
    again = stream.step(collate([items[2]]))[0]
    assert stream.reused == len(items) - 1
    np.testing.assert_allclose(again.probabilities, full[2].probabilities, rtol=0, atol=1e-6)


def test_lss_predict_streams_a_scene_through_a_two_frame_model(synthetic_root, two_frame_checkpoint, tmp_path):
    """`lss predict --scene` steps a two-frame model through the scene one sample a batch, reusing each frame's
    camera features for the next (sequence_step), and writes the predictions of the two-frame forward."""
    from lss.cli import main
    from lss.engine.predictor import write_predictions
    from lss.engine.streaming import sequence_step

    path, cfg = two_frame_checkpoint
    predictor = Predictor(path, device="cpu")
    items = scene_items(synthetic_root, cfg)
    step, batch_size = sequence_step(predictor, 4)
    assert batch_size == 1 and isinstance(step.__self__, StreamingPredictor)
    done = write_predictions(predictor, items, tmp_path / "out", predict_fn=step, batch_size=batch_size,
                             progress=False)
    assert done["samples"] == len(items) and step.__self__.reused == len(items) - 1
    written = sorted((tmp_path / "out").glob("*.npz"))
    for item, npz in zip(items, written):
        want = predictor.predict_batch(collate([item]))[0].probabilities
        np.testing.assert_allclose(np.load(npz)["probabilities"], want, rtol=0, atol=1e-6)
    one_frame = tmp_path / "one.pt"
    save_checkpoint(one_frame, build_model(two_frame_config(synthetic_root, 1)).eval(), step=1,
                    config=two_frame_config(synthetic_root, 1))
    assert sequence_step(Predictor(one_frame, device="cpu"), 4) == (None, 4)  # batches as given
    # the command itself, on the scene's name: the same files
    from nuscenes.nuscenes import NuScenes

    nusc = NuScenes(VERSION, str(synthetic_root), verbose=False)
    scene = nusc.get("scene", nusc.get("sample", items[0]["sample_token"])["scene_token"])["name"]
    assert main(["predict", "--ckpt", str(path), "--dataroot", str(synthetic_root), "--scene", scene,
                 "--out", str(tmp_path / "cli"), "--no-pictures", "--device", "cpu"]) == 0
    from_cli = sorted((tmp_path / "cli").glob("*.npz"))
    assert [p.name for p in from_cli] == [p.name for p in written]
    for a, b in zip(from_cli, written):
        np.testing.assert_allclose(np.load(a)["probabilities"], np.load(b)["probabilities"], rtol=0, atol=1e-6)


def test_one_frame_entry_points_refuse_a_two_frame_model(two_frame_checkpoint):
    path, cfg = two_frame_checkpoint
    predictor = Predictor(path, device="cpu")
    images = np.zeros((2, 90, 160, 3), np.uint8)
    intrinsics = np.tile(np.array([[100.0, 0, 80], [0, 100, 45], [0, 0, 1]]), (2, 1, 1))
    with pytest.raises(ArgumentError, match="model.temporal.frames=2: it also reads the previous frame"):
        predictor.predict(images, intrinsics, np.tile(np.eye(4), (2, 1, 1)))
    one_frame_items = scene_items(cfg.data.dataroot, two_frame_config(cfg.data.dataroot, 1))
    with pytest.raises(ArgumentError, match=r"the batch has no prev_images, .*ego_motion, which the checkpoint's "
                                            r"model reads \(model.temporal.frames=2"):
        predictor.predict_batch(collate(one_frame_items[:1]))


def test_streaming_needs_a_two_frame_model(synthetic_root, tmp_path):
    cfg = two_frame_config(synthetic_root, frames=1)
    save_checkpoint(tmp_path / "one.pt", build_model(cfg), step=1, config=cfg)
    with pytest.raises(ArgumentError, match="StreamingPredictor needs a Predictor of a two-frame model"):
        StreamingPredictor(Predictor(tmp_path / "one.pt", device="cpu"))


def test_streaming_latency_script_times_every_path_on_the_same_frames(synthetic_root, two_frame_checkpoint,
                                                                       tmp_path):
    import json

    from conftest import load_script

    latency = load_script("streaming_latency")
    two, cfg = two_frame_checkpoint
    one_cfg = two_frame_config(synthetic_root, frames=1)
    torch.manual_seed(0)
    one = tmp_path / "one.pt"
    save_checkpoint(one, build_model(one_cfg).eval(), step=1, config=one_cfg)
    frames = len(scene_items(synthetic_root, cfg))
    out = latency.main(["--single", str(one), "--temporal", str(two), "--device", "cpu", "--warmup", "1",
                        "--passes", "1", "--out", str(tmp_path / "latency.json")])
    assert json.loads((tmp_path / "latency.json").read_text()) == out
    assert set(out["rows"]) == {"eager: one frame", "eager: two frames, streamed", "eager: two frames, both trunks"}
    assert all(row["frames"] == frames - 1 and row["median_ms"] > 0 for row in out["rows"].values())
    assert out["rows"]["eager: one frame"]["ratio_to_one_frame"] == 1.0
    assert out["rows"]["eager: two frames, streamed"]["reused_batches"] == frames - 1  # all frames but the first
    with pytest.raises(SystemExit, match="--single needs a model.temporal.frames: 1 checkpoint"):
        latency.main(["--single", str(two), "--temporal", str(two), "--device", "cpu"])
    with pytest.raises(SystemExit, match="leaves none to time"):
        latency.main(["--single", str(one), "--temporal", str(two), "--device", "cpu", "--warmup", str(frames)])


def _stream(predictor, items, **kwargs):
    stream = StreamingPredictor(predictor, **kwargs)
    return stream, [p for out in stream.stream(collate([item]) for item in items) for p in out]


def test_streaming_on_static_buffers_gives_the_predictions_of_the_two_frame_forward(synthetic_root,
                                                                                      two_frame_checkpoint):
    """cuda_graph=True on a CPU: the first frame's and the streamed frame's forwards on their own static buffers
    (what a GPU captures and replays), the kept features copied into the streamed one's."""
    path, cfg = two_frame_checkpoint
    predictor = Predictor(path, device="cpu")
    items = scene_items(synthetic_root, cfg)
    full = [predictor.predict_batch(collate([item]))[0] for item in items]
    stream, streamed = _stream(predictor, items, cuda_graph=True)
    first, again = stream._graphs
    assert stream.reused == len(items) - 1
    assert "prev_images" in first.inputs and "prev_images" not in again.inputs
    assert {"prev_depth", "prev_context"} <= set(again.inputs) and len(again.graphs) == 1
    for a, b in zip(full, streamed):
        np.testing.assert_allclose(b.probabilities, a.probabilities, rtol=0, atol=1e-6)
    eager, _ = _stream(predictor, items[:2], cuda_graph=False)
    assert eager._graphs is None and StreamingPredictor(predictor)._graphs is None  # a CPU Predictor: eager


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_streaming_two_key_frames_back_keeps_two_frames_of_features(synthetic_root, two_frame_checkpoint, tmp_path,
                                                                     cuda_graph):
    """model.temporal.gap: 2: each frame reuses the features of the frame two before (the scene's second frame those
    of its first), with the predictions of the two-frame forward; eager and on static buffers."""
    path, cfg = two_frame_checkpoint
    state = torch.load(path, weights_only=False)
    state["config"]["model"]["temporal"]["gap"] = 2
    torch.save(state, tmp_path / "gap2.pt")
    predictor = Predictor(tmp_path / "gap2.pt", device="cpu")
    assert predictor.cfg.model.temporal.gap == 2
    items = scene_items(synthetic_root, predictor.cfg)
    tokens = [it["sample_token"] for it in items]
    assert [it["prev_sample_token"] for it in items] == [tokens[0], tokens[0]] + tokens[:-2]
    full = [predictor.predict_batch(collate([item]))[0] for item in items]
    stream, streamed = _stream(predictor, items, cuda_graph=cuda_graph)
    assert stream.reused == len(items) - 1 and stream._kept.maxlen == 2
    for a, b in zip(full, streamed):
        np.testing.assert_allclose(b.probabilities, a.probabilities, rtol=0, atol=1e-6)
    # the frame one back is not the previous frame any more: with only it kept, the features are computed again
    stream.reset()
    stream.step(collate([items[1]]))
    stream.step(collate([items[2]]))  # its previous frame is items[0]
    assert stream.reused == len(items) - 1


def test_captured_streaming_refuses_the_second_stage(synthetic_root, tmp_path):
    cfg = config_from_dict({**SMALL, "data": {**SMALL["data"], "dataroot": str(synthetic_root)},
                            "model": {**SMALL["model"], "temporal": {"frames": 2},
                                      "heads": ["segmentation", "detection"]},
                            "detection": {"refine": True}})
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "refine.pt", build_model(cfg), step=1, config=cfg)
    predictor = Predictor(tmp_path / "refine.pt", device="cpu")
    with pytest.raises(ArgumentError, match="second stage .*cannot be captured; leave cuda_graph unset or False"):
        StreamingPredictor(predictor, cuda_graph=True)
    assert StreamingPredictor(predictor)._graphs is None


@pytest.mark.cuda
def test_captured_streaming_on_cuda_follows_the_two_frame_forward(synthetic_root, two_frame_checkpoint):
    path, cfg = two_frame_checkpoint
    predictor = Predictor(path, device="cuda")  # bf16, captured
    items = scene_items(synthetic_root, cfg)
    full = [predictor.predict_batch(collate([item]))[0] for item in items]
    stream, streamed = _stream(predictor, items)
    first, again = stream._graphs
    assert stream.reused == len(items) - 1
    assert all(graph is not None for graph, _, _ in list(first.graphs.values()) + list(again.graphs.values()))
    for a, b in zip(full, streamed):
        np.testing.assert_allclose(b.probabilities, a.probabilities, rtol=0, atol=2e-2)  # bf16 either way
