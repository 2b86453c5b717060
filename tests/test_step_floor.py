"""scripts/step_floor.py: the bytes each operation of a step must move, counted on the meta device, by kind; and the
bandwidth of a profile's kernels against them."""
import json
from pathlib import Path

import torch

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
    out = floor.main(["--config", str(REPO / "configs" / "synthetic.yaml"), "--set",
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


def math_close(a, b, tol=2e-3):
    return abs(a - b) <= tol
