"""ONNX export: every Resize coordinate mode against our upsample op in onnxruntime, the fixed-rig and rig-input
graphs against the PyTorch model on the tiny synthetic set (logits and IoU), the lss.BevPool custom node's graph and
contract (a numpy implementation of the documented node run by onnx's reference evaluator), and the one-line
errors of `lss export`."""
import json

import numpy as np
import pytest
import torch
from torch import nn

pytestmark = [pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from conftest import val_statistics_checkpoint  # noqa: E402
from lss.cli import main  # noqa: E402
from lss.config import load_config  # noqa: E402
from lss.data import collate  # noqa: E402
from lss.data.loader import build_dataset  # noqa: E402
from lss.engine.checkpoint import load_for_inference  # noqa: E402
from lss.export import export_checkpoint, export_model  # noqa: E402
from lss.export.check import check_export  # noqa: E402
from lss.export.graph import RIG_KEYS  # noqa: E402
from lss.ops import UpsampleBilinear, upsample_bilinear_reference  # noqa: E402
from lss.ops.upsample import MODES  # noqa: E402

TINY = ["data.final_dim=[32, 96]", "data.resize_lim=[0.24, 0.26]", "grid.xbound=[-16.0, 16.0, 1.0]",
        "grid.ybound=[-16.0, 16.0, 1.0]", "grid.dbound=[4.0, 20.0, 2.0]", "model.context_channels=8",
        "data.classes=[vehicle, drivable_area]", "data.workers=0", "train.device=cpu"]


def _tiny_config(root, *extra):
    return load_config(None, TINY + [f"data.dataroot={root}", *extra])


def _checkpoint(cfg, path, logit_scale=1.0):
    """(cfg, path) of conftest.val_statistics_checkpoint."""
    return cfg, val_statistics_checkpoint(cfg, path, logit_scale)


@pytest.fixture(scope="module")
def checkpoint(synthetic_root, tmp_path_factory):
    """A tiny model trained in align_corners mode (_checkpoint). Returns (config, checkpoint)."""
    cfg = _tiny_config(synthetic_root, "model.upsample_mode=align_corners")
    return _checkpoint(cfg, tmp_path_factory.mktemp("export") / "best.pt")


def test_the_default_recipes_full_resolution_skip_exports_like_pytorch(synthetic_root, tmp_path):
    cfg, ckpt = _checkpoint(_tiny_config(synthetic_root, "model.bev_full_res_skip=true"), tmp_path / "best.pt",
                            logit_scale=8.0)
    done = export_checkpoint(cfg, ckpt, tmp_path / "m.onnx")
    assert isinstance(done["model"].bev.up2.upsample, UpsampleBilinear)
    assert len(_resize_nodes(done["path"])) == 3  # camera fuse x2, BEV x4, and the skip's x2
    result = check_export(cfg, done["model"], done["path"], done["rig"], samples=3)
    assert result["max_abs_logit"] > 5
    assert result["max_abs_diff"] <= 1e-3 and result["max_iou_diff_points"] <= 0.1 and result["passed"]


def _resize_nodes(path):
    graph = onnx.load(str(path)).graph
    return [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in graph.node
            if n.op_type == "Resize"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("resize", [dict(scale_factor=2), dict(scale_factor=(4, 2)), dict(size=(1, 7))])
def test_every_upsample_mode_exports_as_the_resize_with_its_values(mode, resize, tmp_path):
    from lss.export.graph import replace_upsampling

    net = nn.Sequential(nn.Conv2d(3, 4, 1), UpsampleBilinear(mode=mode, **resize))
    replace_upsampling(net, mode)
    x = torch.randn(2, 3, 5, 3)
    path = tmp_path / "resize.onnx"
    torch.onnx.export(net, (x,), str(path), dynamo=False, opset_version=17, input_names=["x"])
    (attrs,) = _resize_nodes(path)
    assert attrs["coordinate_transformation_mode"].decode() == mode and attrs["mode"].decode() == "linear"
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    want = upsample_bilinear_reference(net[0](x), mode=mode, onnx_rule=True, **resize)
    torch.testing.assert_close(torch.from_numpy(got), want.detach(), atol=1e-5, rtol=1e-5)


def test_fixed_rig_export_runs_in_stock_onnxruntime_like_pytorch(checkpoint, tmp_path):
    cfg, ckpt = checkpoint
    done = export_checkpoint(cfg, ckpt, tmp_path / "m.onnx")
    graph = onnx.load(str(done["path"])).graph
    assert not [n for n in graph.node if n.domain]  # standard operators only
    scatters = [n for n in graph.node if n.op_type == "ScatterND"]
    assert len(scatters) == 1 and scatters[0].attribute[0].s == b"add"
    # the decoder's three upsamplings (camera fuse x2, BEV x4 and x2), in the mode the checkpoint was trained with
    assert [a["coordinate_transformation_mode"] for a in _resize_nodes(done["path"])] == [b"align_corners"] * 3
    assert json.loads(done["path"].with_suffix(".rig.json").read_text()).keys() == set(RIG_KEYS)
    result = check_export(cfg, done["model"], done["path"], done["rig"], samples=3)
    assert result["max_abs_logit"] > 5  # logits of a useful size, so the tolerance means something
    assert result["max_abs_diff"] <= 1e-3 and result["max_iou_diff_points"] <= 0.1 and result["passed"]
    assert result["iou_torch"] == result["iou_onnx"] and result["rig_deviation"] == 0.0
    # the batch size is dynamic: two samples at once give each sample's own maps
    dataset = build_dataset(cfg, cfg.data.val_split, False)
    # the export reads normalised float images (the camera encoder's normalisation of the uint8 items)
    images = done["model"].camera.normalize(torch.stack([dataset[0]["images"], dataset[1]["images"]])).numpy()
    session = ort.InferenceSession(str(done["path"]), providers=["CPUExecutionProvider"])
    both = session.run(None, {"images": images})[0]
    for b in range(2):
        np.testing.assert_allclose(both[b:b + 1], session.run(None, {"images": images[b:b + 1]})[0], atol=1e-5)
    assert np.abs(both[0] - both[1]).max() > 0.1


def test_rig_input_export_builds_each_samples_table_in_the_graph(checkpoint, tmp_path):
    cfg, ckpt = checkpoint
    done = export_checkpoint(cfg, ckpt, tmp_path / "m.onnx", rig_inputs=True)
    dataset = build_dataset(cfg, cfg.data.val_split, False)
    batch = collate([dataset[0], dataset[2]])
    batch["sensor2ego_trans"][1, :, 0] += 3.0  # the second sample's rig moved 3 m forward: another table
    with torch.no_grad():
        want = done["model"](batch)["segmentation"]
    session = ort.InferenceSession(str(done["path"]), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["images", *RIG_KEYS]
    batch["images"] = done["model"].camera.normalize(batch["images"])
    got = session.run(None, {k: batch[k].float().numpy() for k in ["images", *RIG_KEYS]})[0]
    assert got.shape == tuple(want.shape) == (2, 2, 32, 32)
    assert np.abs(got - want.numpy()).max() <= 1e-3
    moved = collate([dataset[2], dataset[2]])
    with torch.no_grad():
        assert (done["model"](moved)["segmentation"][1] - want[1]).abs().max() > 0.1  # the shift mattered


def test_deploying_in_another_resize_mode_is_reported_as_a_loss(checkpoint, tmp_path):
    cfg, ckpt = checkpoint
    done = export_checkpoint(cfg, ckpt, tmp_path / "m.onnx", resize_mode="asymmetric")
    assert [a["coordinate_transformation_mode"] for a in _resize_nodes(done["path"])] == [b"asymmetric"] * 3
    result = check_export(cfg, done["model"], done["path"], done["rig"], samples=2)
    assert result["max_abs_diff"] > 0.1 and not result["passed"]


class _BevPoolNumpy:
    """The lss.BevPool node as docs/export.md specifies it, for onnx's reference evaluator."""

    @staticmethod
    def run(depth, feat, sorted_points, cell_start, point_cell, nz, nx, ny):
        B, N, D, fH, fW = depth.shape
        C = feat.shape[2]
        out = np.zeros((B, nz, C, nx, ny), dtype=depth.dtype)
        for c in range(nz * nx * ny):
            z, i, j = c // (nx * ny), c // ny % nx, c % ny
            for p in sorted_points[cell_start[c]:cell_start[c + 1]]:
                n, d, h, w = np.unravel_index(p, (N, D, fH, fW))
                out[:, z, :, i, j] += depth[:, n, d, h, w, None] * feat[:, n, :, h, w]
        return out.reshape(B, nz * C, nx, ny)


def test_custom_op_graph_holds_one_documented_bev_pool_node(checkpoint, tmp_path):
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.op_run import OpRun

    cfg, ckpt = checkpoint
    done = export_checkpoint(cfg, ckpt, tmp_path / "m.onnx", splat="custom")
    model = onnx.load(str(done["path"]))
    (node,) = [n for n in model.graph.node if n.domain == "lss"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert node.op_type == "BevPool" and attrs == {"nz": 1, "nx": 32, "ny": 32}
    assert {o.domain: o.version for o in model.opset_import}["lss"] == 1
    assert not [n for n in model.graph.node if n.op_type == "ScatterND"]

    class BevPool(OpRun):
        op_domain = "lss"

        def _run(self, depth, feat, sorted_points, cell_start, point_cell, nz=None, nx=None, ny=None):
            return (_BevPoolNumpy.run(depth, feat, sorted_points, cell_start, point_cell, nz, nx, ny),)

    batch = collate([build_dataset(cfg, cfg.data.val_split, False)[1]])
    batch.update({k: v[None] for k, v in done["rig"].items()})
    with torch.no_grad():
        want = done["model"](batch)["segmentation"].numpy()
    images = done["model"].camera.normalize(batch["images"]).numpy()
    got = ReferenceEvaluator(model, new_ops=[BevPool]).run(None, {"images": images})[0]
    assert np.abs(got - want).max() <= 1e-3


def _config_file(tmp_path, cfg):
    """The tiny config as a YAML file for the command line (JSON is YAML), without model.upsample_mode."""
    path = tmp_path / "tiny.yaml"
    path.write_text(json.dumps({"data": {"dataroot": cfg.data.dataroot, "final_dim": [32, 96],
                                         "classes": ["vehicle", "drivable_area"], "workers": 0},
                                "grid": {"xbound": [-16.0, 16.0, 1.0], "ybound": [-16.0, 16.0, 1.0],
                                         "dbound": [4.0, 20.0, 2.0]},
                                "model": {"context_channels": 8}, "train": {"device": "cpu"}}))
    return path


def _cli(capsys, *args):
    code = main(["export", *args])
    return code, capsys.readouterr().err.strip().splitlines()


def test_cli_errors_are_one_line_and_say_what_to_do(checkpoint, tmp_path, capsys):
    cfg, ckpt = checkpoint
    config = _config_file(tmp_path, cfg)
    base = ["--config", str(config), "--out", str(tmp_path / "m.onnx")]
    rig = tmp_path / "rig.json"
    rig.write_text(json.dumps({k: np.zeros((5, 3, 3) if k.endswith("rot") or k == "intrinsics" else (5, 3)).tolist()
                               for k in RIG_KEYS}))
    cases = [
        (["--ckpt", str(ckpt), "--rig", str(rig)], "intrinsics has shape (5, 3, 3), expected (6, 3, 3)"),
        (["--ckpt", str(tmp_path / "none.pt")], "does not exist"),
        (["--ckpt", str(ckpt), "--rig-inputs", "--bev-pool", "custom"], "--bev-pool custom needs --fixed-rig"),
        (["--ckpt", str(ckpt), "--opset", "13"], "--opset 13: supported opsets are 16..20"),
        (["--ckpt", str(ckpt), "--resize-mode", "nearest"], "--resize-mode 'nearest': expected one of"),
        (["--ckpt", str(ckpt), "--bev-pool", "custom", "--check"], "stock onnxruntime cannot run"),
    ]
    for args, message in cases:
        code, err = _cli(capsys, *base, *args)
        assert code == 2 and message in err[0] and len(err) == 2, (args, err)


def test_cli_check_passes_and_prints_both_ious(checkpoint, tmp_path, capsys):
    cfg, ckpt = checkpoint
    config = _config_file(tmp_path, cfg)
    code = main(["export", "--config", str(config), "--ckpt", str(ckpt), "--out", str(tmp_path / "m.onnx"),
                 "--check", "--check-samples", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "PASSED" in out and "IoU torch  IoU onnx" in out
    assert "Resize mode align_corners; trained with align_corners" in out  # the checkpoint's mode, not the YAML's


def test_export_benchmark_quick_runs_both_runtimes():
    from benchmarks import BenchContext
    from benchmarks import export as suite

    rows = suite.run(BenchContext(torch.device("cpu"), quick=True))
    assert [r["impl"] for r in rows] == ["lss", "onnxruntime CPU"] and all(r["ms"] > 0 for r in rows)


def test_export_model_leaves_the_callers_model_in_place(checkpoint, tmp_path):
    cfg, ckpt = checkpoint
    model, _ = load_for_inference(cfg, ckpt, torch.device("cpu"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    export_model(model, tmp_path / "m.onnx", cfg, rig_inputs=True, upsample_mode="align_corners")
    assert all(isinstance(m, UpsampleBilinear) for m in [model.bev.up2[0], model.bev.up1.upsample])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_export_reads_the_checkpoint_file_once(checkpoint, tmp_path, monkeypatch):
    cfg, ckpt = checkpoint
    reads = []
    real_load = torch.load

    def counting_load(f, *args, **kwargs):
        reads.append(str(f))
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counting_load)
    export_checkpoint(cfg, ckpt, tmp_path / "m.onnx")
    assert reads.count(str(ckpt)) == 1


def test_a_failed_export_leaves_an_existing_file_as_it_was(checkpoint, tmp_path, monkeypatch):
    import errno

    cfg, ckpt = checkpoint
    out = tmp_path / "model.onnx"
    out.write_bytes(b"an earlier export")
    real_export = torch.onnx.export

    def full_disk(model, args, f, **kwargs):
        open(f, "wb").write(b"half a gra")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch.onnx, "export", full_disk)
    with pytest.raises(OSError, match=rf"could not write {out} \(No space left on device\); the existing file "
                                      "there is unchanged; free some space or choose another --out"):
        export_checkpoint(cfg, ckpt, out)
    assert out.read_bytes() == b"an earlier export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]
    monkeypatch.setattr(torch.onnx, "export", real_export)
    export_checkpoint(cfg, ckpt, out)
    assert _resize_nodes(out) and sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.rig.json"]


@pytest.mark.parametrize("decoder", ["shared", "own"])
def test_the_detection_heads_maps_are_exported_and_checked(synthetic_root, tmp_path, decoder):
    """A model with the detection head (on the decoder's output, or on its own last stage as the default config) exports
    its heatmap logits and regression maps beside the segmentation; onnxruntime gives PyTorch's maps and boxes, and
    `lss export --check` holds the maps to the logits' tolerance."""
    from lss.models.heads.detection_decode import decode_detections

    extra = ["model.heads=[segmentation, detection]", "data.detection_targets=true", "detection.head_channels=8",
             "model.bev_full_res_skip=true", f"detection.decoder={decoder}"]
    if decoder == "own":
        extra.append("detection.decoder_channels=16")
    cfg, ckpt = _checkpoint(_tiny_config(synthetic_root, *extra), tmp_path / "det.pt", logit_scale=8.0)
    done = export_checkpoint(cfg, ckpt, tmp_path / "det.onnx", rig_inputs=True)
    session = ort.InferenceSession(str(done["path"]), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == ["segmentation", "det_heatmap", "det_regression"]
    dataset = build_dataset(cfg, cfg.data.val_split, False)
    batch = collate([dataset[0], dataset[1]])
    with torch.no_grad():
        want = done["model"](batch)
    feeds = {k: batch[k].float().numpy() for k in RIG_KEYS}
    feeds["images"] = done["model"].camera.normalize(batch["images"]).numpy()
    got = dict(zip(["segmentation", "det_heatmap", "det_regression"], session.run(None, feeds)))
    for name in ("det_heatmap", "det_regression"):
        assert got[name].shape == tuple(want[name].shape)
        assert np.abs(got[name] - want[name].numpy()).max() <= 1e-3, name
    assert want["det_heatmap"].std() > 0.1  # maps that vary, so the comparison means something
    ours = decode_detections(want, cfg)
    theirs = decode_detections({k: torch.from_numpy(v) for k, v in got.items()}, cfg)
    for a, b in zip(ours, theirs):
        assert len(a["boxes"]) > 0
        torch.testing.assert_close(b["scores"][:20], a["scores"][:20], atol=1e-4, rtol=0)
        torch.testing.assert_close(b["boxes"][:20], a["boxes"][:20], atol=1e-3, rtol=0)
    result = check_export(cfg, done["model"], done["path"], samples=2)
    assert result["passed"] and result["max_abs_diff_detection"] <= 1e-3
    from lss.export.check import format_check

    assert "detection head (heatmap logits, regression maps)" in format_check(result, done["path"])


def _add_to_output(path, out, name, value):
    """The ONNX file at `path` with the constant `value` (broadcast) added to its output `name`, written to `out`."""
    model = onnx.load(str(path))
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.asarray(value, np.float32), "added"))
    before = f"{name}_before_the_addition"
    for node in model.graph.node:
        node.output[:] = [before if o == name else o for o in node.output]
    model.graph.node.append(onnx.helper.make_node("Add", [before, "added"], [name]))
    onnx.save(model, str(out))
    return out


def test_a_detection_map_off_the_pytorch_model_fails_the_check(synthetic_root, tmp_path):
    """The check compares the detection maps: an export whose regression output is moved fails it, with the
    segmentation unchanged."""
    extra = ["model.heads=[segmentation, detection]", "data.detection_targets=true", "detection.head_channels=8"]
    cfg, ckpt = _checkpoint(_tiny_config(synthetic_root, *extra), tmp_path / "det.pt", logit_scale=8.0)
    done = export_checkpoint(cfg, ckpt, tmp_path / "det.onnx", rig_inputs=True)
    shifted = _add_to_output(done["path"], tmp_path / "shifted.onnx", "det_regression", 0.01)
    result = check_export(cfg, done["model"], shifted, samples=1)
    assert result["max_abs_diff"] <= 1e-3 and result["max_iou_diff_points"] == 0.0
    assert abs(result["max_abs_diff_detection"] - 0.01) < 1e-3 and result["off_cell_share"] == 1.0
    assert not result["passed"]


@pytest.mark.parametrize("rig_inputs", [True, False])
def test_a_few_cells_off_pass_only_an_export_that_computes_its_table(checkpoint, tmp_path, rig_inputs):
    """A rig-input export computes the frustum-to-BEV table in onnxruntime: a frustum point on a cell boundary may land
    in the neighbouring cell and move the logits around it. A few such cells pass its check (and are reported); the
    same cells off fail a fixed-rig export, whose table is PyTorch's own."""
    from lss.export.check import BOUNDARY_CELL_SHARE, format_check

    cfg, ckpt = checkpoint
    done = export_checkpoint(cfg, ckpt, tmp_path / "m.onnx", rig_inputs=rig_inputs)
    bump = np.zeros((1, len(cfg.data.classes), 32, 32), np.float32)
    bump[0, 0, 5, 7] = 0.01  # one cell of one class off in every sample
    moved = _add_to_output(done["path"], tmp_path / "bump.onnx", "segmentation", bump)
    result = check_export(cfg, done["model"], moved, done["rig"], samples=2)
    assert abs(result["max_abs_diff"] - 0.01) < 1e-3
    assert result["off_cell_share"] == 1 / (32 * 32) < BOUNDARY_CELL_SHARE
    assert result["passed"] is rig_inputs
    assert "cells off by more than 0.001: 0.098 %" in format_check(result, moved)
    spread = np.full_like(bump, 0.01)  # every cell off: a wrong export, whatever computes the table
    assert not check_export(cfg, done["model"], _add_to_output(done["path"], tmp_path / "all.onnx", "segmentation",
                                                               spread), done["rig"], samples=1)["passed"]
