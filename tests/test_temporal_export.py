"""ONNX export of a two-frame model (rig inputs): the previous frame's camera features and rig and the ego motion
are graph inputs, this frame's features outputs; onnxruntime gives the PyTorch model's outputs, `lss export
--check`'s comparison passes on the synthetic set, and the onnxruntime Predictor refuses the model."""
import numpy as np
import pytest
import torch

from lss.errors import ArgumentError
from lss.export import export_checkpoint, export_model
from lss.export.check import check_export, onnxruntime_session
from lss.export.temporal import INPUT_NAMES, OUTPUT_NAMES
from lss.models.build import build_model
from test_temporal_model import previous_of, rig_batch, small_config
from test_temporal_predict import two_frame_checkpoint  # noqa: F401 (a fixture)

pytest.importorskip("onnxruntime")


@pytest.mark.parametrize("frame_blocks", [0, 1])
def test_two_frame_export_matches_the_model_in_onnxruntime(tmp_path, frame_blocks):
    cfg = small_config(frames=2, frame_blocks=frame_blocks)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    path = export_model(model, tmp_path / "two.onnx", cfg, rig_inputs=True)
    session = onnxruntime_session(path)
    assert [i.name for i in session.get_inputs()] == list(INPUT_NAMES)
    assert [o.name for o in session.get_outputs()] == list(OUTPUT_NAMES)
    segmentations = []
    for forward in (3.0, 9.0):  # another ego motion: another prediction, in both
        batch = previous_of(rig_batch(), forward=forward)
        with torch.no_grad():
            before = model({**batch, "images": batch["prev_images"]})  # the previous frame's own pass
            ours = model(batch)
        feeds = {k: batch[k].numpy() for k in INPUT_NAMES if k in batch}
        feeds["prev_depth"], feeds["prev_context"] = before["camera_depth"].numpy(), before["camera_context"].numpy()
        theirs = dict(zip(OUTPUT_NAMES, session.run(None, feeds)))
        # float32 through the network in another runtime: onnxruntime's kernels (their choice varies with the build
        # and threads) differ by up to about 1e-4 of the logits' size; another ego motion moves them by more than
        # 1e-3 of it (below)
        scale = float(ours["segmentation"].abs().max())
        np.testing.assert_allclose(theirs["segmentation"], ours["segmentation"].numpy(), rtol=0, atol=2e-4 * scale)
        for name in ("camera_depth", "camera_context"):
            np.testing.assert_allclose(theirs[name], ours[name].numpy(), rtol=0, atol=1e-5)
        segmentations.append(theirs["segmentation"])
    if not frame_blocks:  # the untrained blocks' residual paths flatten the random model's output further
        assert np.abs(segmentations[0] - segmentations[1]).max() > 1e-3 * scale


def test_two_frame_checkpoint_export_passes_the_check(two_frame_checkpoint, tmp_path):  # noqa: F811
    path, cfg = two_frame_checkpoint
    done = export_checkpoint(cfg, path, tmp_path / "two.onnx", rig_inputs=True)
    result = check_export(cfg, done["model"], done["path"], done["rig"], samples=3)
    assert result["samples"] == 3 and result["passed"], result


def test_onnxruntime_predictor_refuses_a_two_frame_checkpoint(two_frame_checkpoint):  # noqa: F811
    from lss.engine.predictor import Predictor

    with pytest.raises(ArgumentError, match="backend onnxruntime runs one-frame exports"):
        Predictor(two_frame_checkpoint[0], device="cpu", backend="onnxruntime")


def test_a_two_frame_export_with_the_detection_head_outputs_its_maps(tmp_path):
    from lss.export.temporal import output_names

    cfg = small_config(frames=2, heads=("segmentation", "detection"))
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    path = export_model(model, tmp_path / "two_det.onnx", cfg, rig_inputs=True)
    session = onnxruntime_session(path)
    names = ["segmentation", "det_heatmap", "det_regression", "camera_depth", "camera_context"]
    assert [o.name for o in session.get_outputs()] == names == list(output_names(model))
    batch = previous_of(rig_batch(), forward=3.0)
    with torch.no_grad():
        before = model({**batch, "images": batch["prev_images"]})
        ours = model(batch)
    feeds = {k: batch[k].numpy() for k in INPUT_NAMES if k in batch}
    feeds["prev_depth"], feeds["prev_context"] = before["camera_depth"].numpy(), before["camera_context"].numpy()
    theirs = dict(zip(names, session.run(None, feeds)))
    for name in ("det_heatmap", "det_regression"):
        assert theirs[name].shape == tuple(ours[name].shape)
        scale = float(ours[name].abs().max())
        np.testing.assert_allclose(theirs[name], ours[name].numpy(), rtol=0, atol=2e-4 * scale)
    assert float(ours["det_heatmap"].std()) > 0
