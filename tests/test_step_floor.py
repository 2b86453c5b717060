"""scripts/step_floor.py: the bytes each operation of a step must move, counted on the meta device, by kind; and the
bandwidth of a profile's kernels against them."""
import json
from pathlib import Path

import torch

from lss.geometry import BevGrid
from lss.models import build_model

from conftest import load_script

REPO = Path(__file__).resolve().parents[1]


def _module():
    return load_script("step_floor")


def test_bytes_of_a_depthwise_convolution_and_a_batch_norm_by_kind():
    floor = _module()
    conv = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False).to("meta")
    norm = torch.nn.BatchNorm2d(8).to("meta")
    x = torch.empty(2, 8, 16, 16, device="meta", requires_grad=True)
    counter = floor.ByteCounter()
    with counter:
        y = conv(x)
        norm(y).sum().backward()
    activation = 2 * 8 * 16 * 16 * 4
    weight = 8 * 1 * 3 * 3 * 4
    assert counter.calls["depthwise convolution, forward"] == 1
    assert counter.bytes["depthwise convolution, forward"] == 2 * activation + weight  # input, weight, output
    # backward: grad output, input, weight in; grad input, grad weight out
    assert counter.bytes["depthwise convolution, backward"] == 3 * activation + 2 * weight
    assert counter.bytes["batch norm, forward"] >= 2 * activation
    assert counter.bytes["batch norm, backward"] >= 3 * activation
    assert "convolution, forward" not in counter.bytes  # a depthwise convolution is not a dense one


def test_floor_of_the_default_step_and_the_bandwidth_of_a_profile(tmp_path):
    floor = _module()
    profile = {"gpu_kernel_ms_per_step": 20.0, "top_kernels": [
        {"name": "void at::native::batch_norm_backward_kernel<c10::BFloat16>", "ms_per_step": 2.0},
        {"name": "void at::native::batch_norm_collect_statistics_kernel<>", "ms_per_step": 1.0},
        {"name": "sm90_xmma_gemm", "ms_per_step": 5.0}]}
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    out = floor.main(["--config", str(REPO / "configs" / "synthetic_segmentation.yaml"), "--set",
                      "data.final_dim=[64, 192]", "--set", "train.batch_size=1", "--bandwidth", "1e12",
                      "--profile", str(tmp_path / "profile.json"), "--out", str(tmp_path / "floor.json")])
    assert json.loads((tmp_path / "floor.json").read_text()) == out
    kinds = {row["kind"]: row for row in out["kinds"]}
    assert math_close(sum(row["GB"] for row in out["kinds"]), out["floor_GB"], 0.01)
    assert out["floor_ms"] > 0 and kinds["batch norm, backward"]["GB"] > 0
    achieved = {row["kind"]: row for row in out["profile"]["kinds"]}
    assert set(achieved) == {"batch norm, backward", "batch norm, forward"}  # the gemm is of no listed kind
    bn = achieved["batch norm, backward"]
    assert math_close(bn["achieved_GB_per_s"], bn["floor_GB"] / 2e-3, 0.5)
    assert math_close(out["profile"]["times_floor"], 20.0 / out["floor_ms"], 0.01)


def test_padding_copies_and_lss_kernels_in_a_profile(tmp_path):
    """efficientnet's padded copies are their own kind; a profile of lss's kernels drops them from its floor and
    reads lss's batch norm (forward and backward in the same kernels) with PyTorch's as one row."""
    floor = _module()
    x = torch.empty(1, 4, 8, 8, device="meta", requires_grad=True)
    counter = floor.ByteCounter()
    with counter:
        torch.nn.functional.pad(x, (0, 1, 0, 1)).sum().backward()
    assert counter.calls[floor.PADDING] == 2  # the copy and its gradient's slice back
    profile = {"gpu_kernel_ms_per_step": 10.0, "top_kernels": [
        {"name": "void lss::batch_norm::(anonymous namespace)::reduce_kernel<c10::BFloat16, 8, float>", "ms_per_step": 2.0},
        {"name": "void at::native::batch_norm_collect_statistics_kernel<>", "ms_per_step": 0.5},
        {"name": "void lss::depthwise_conv::(anonymous namespace)::forward_kernel<>", "ms_per_step": 1.0},
        {"name": "void lss::depthwise_conv::(anonymous namespace)::weight_grad_kernel<>", "ms_per_step": 1.5},
        {"name": "void at::native::elementwise_kernel<128, 4>", "ms_per_step": 1.0}]}
    gb = {floor.BN_FORWARD: 2e9, floor.BN_BACKWARD: 3e9, floor.DW_FORWARD: 1e9, floor.DW_BACKWARD: 1.5e9,
          floor.ELEMENTWISE: 4e9, floor.PADDING: 1e9}
    rows = {row["kind"]: row for row in floor.achieved(profile, gb)}
    bn = rows["batch norm, forward + backward (lss) | batch norm, forward"]
    assert bn["ms_per_step"] == 2.5 and bn["floor_GB"] == 5.0 and bn["achieved_GB_per_s"] == 2000.0
    assert rows[floor.DW_FORWARD]["floor_GB"] == 1.0 and rows[floor.DW_BACKWARD]["floor_GB"] == 1.5
    assert rows[floor.ELEMENTWISE]["floor_GB"] == 4.0  # no padding copies through lss's depthwise kernels
    # PyTorch's depthwise kernels: the padding copies are elementwise kernels of the floor
    torch_profile = {"top_kernels": [{"name": "void at::native::elementwise_kernel<128, 4>", "ms_per_step": 1.0}]}
    assert floor.achieved(torch_profile, gb)[0]["floor_GB"] == 5.0


def math_close(a, b, tol=2e-3):
    return abs(a - b) <= tol


def test_the_default_configs_floor_counts_the_detection_heads_maps():
    """configs/synthetic.yaml (both heads) moves the segmentation recipe's bytes plus its detection head's: the own
    decoder stage (two 3 x 3 convolutions with their batch norms, on the upsampled map the segmentation's stage reads
    too) and the heatmap and regression convolutions at the grid's size."""
    from lss.config import load_config

    floor = _module()
    small = ["data.final_dim=[64, 192]", "train.batch_size=1"]
    joint_bytes, joint_calls, _ = floor.step_bytes(load_config(REPO / "configs" / "synthetic.yaml", small))
    seg_bytes, seg_calls, _ = floor.step_bytes(load_config(REPO / "configs" / "synthetic_segmentation.yaml", small))
    cfg = load_config(REPO / "configs" / "synthetic.yaml", small)
    cells = BevGrid.from_config(cfg.grid).shape[0] * BevGrid.from_config(cfg.grid).shape[1]
    maps = 2 * cfg.detection.decoder_channels * cells  # one bf16 activation of the own stage
    extra = sum(joint_bytes.values()) - sum(seg_bytes.values())
    assert extra > 4 * maps
    model = build_model(cfg)
    norms = sum(isinstance(m, torch.nn.BatchNorm2d) for part in (model.detection, model.detection_decoder)
                for m in part.modules())
    convs = sum(isinstance(m, torch.nn.Conv2d) for part in (model.detection, model.detection_decoder)
                for m in part.modules())
    assert norms == 5 and convs == 7  # the stage's two convolutions and norms; the head's shared, heatmap, regression
    assert joint_calls["batch norm, forward"] == seg_calls["batch norm, forward"] + norms
    assert joint_calls["convolution, forward"] == seg_calls["convolution, forward"] + convs
    assert joint_calls["upsampling"] == seg_calls["upsampling"]  # one upsampled map for both last stages
