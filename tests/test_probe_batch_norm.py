"""scripts/probe_batch_norm.py: the batch-norm shapes of a forward found on the meta device (the module untouched),
the variant argument's errors, and one timed variant on the CPU."""
import pytest
import torch

from conftest import load_script


def _module():
    return load_script("probe_batch_norm")


def test_batch_norm_shapes_in_call_order_without_touching_the_module():
    probe = _module()
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, stride=2, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 4, 3, stride=2, padding=1), torch.nn.BatchNorm2d(4),
        torch.nn.BatchNorm2d(4),  # called twice on one shape: two calls
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert probe.batch_norm_shapes(model, (2, 3, 16, 24)) == [(2, 8, 8, 12), (2, 4, 4, 6), (2, 4, 4, 6)]
    after = model.state_dict()
    assert all(after[k].device.type == "cpu" and torch.equal(before[k], after[k]) for k in before)
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_variants_are_parsed_and_bad_ones_name_the_choices():
    probe = _module()
    assert probe.parse_variants("bf16:nchw, fp32:nhwc,bf16:nchw:lss") == [
        ("bf16", "nchw", "torch"), ("fp32", "nhwc", "torch"), ("bf16", "nchw", "lss")]
    with pytest.raises(ValueError, match="DTYPE one of"):
        probe.parse_variants("fp8:nchw")
    with pytest.raises(ValueError, match="LAYOUT one of"):
        probe.parse_variants("bf16:nhcw")
    with pytest.raises(ValueError, match="KERNEL one of"):
        probe.parse_variants("bf16:nchw:cudnn")
    with pytest.raises(ValueError, match="NCHW inputs only"):
        probe.parse_variants("bf16:nhwc:lss")
    with pytest.raises(ValueError, match="no variant"):
        probe.parse_variants(" , ")


def test_one_variant_times_every_call_and_counts_its_floor():
    probe = _module()
    shapes = [(2, 8, 8, 12), (2, 4, 4, 6)]
    out = probe.time_variant(shapes, torch.float32, torch.channels_last, torch.device("cpu"), repeats=3)
    assert out["ms"] > 0 and out["min_ms"] <= out["ms"]
    # x twice, y, the gradient twice, x again, dx: 7 float32 tensors of each shape
    assert out["floor_bytes"] == 7 * 4 * (2 * 8 * 8 * 12 + 2 * 4 * 4 * 6)
    assert out["kernels"] == []  # kernel names come from the CUDA profiler only


def test_lss_kernels_are_timed_and_compared_with_torch():
    import lss.ops  # noqa: F401  (registers torch.ops.lss)
    from lss.ops import _ext

    if not _ext.has_ext():
        pytest.skip("lss._C not built")
    probe = _module()
    out = probe.time_variant([(2, 3, 8, 8), (2, 5, 4, 4)], torch.float32, torch.contiguous_format,
                             torch.device("cpu"), repeats=2, kernel="lss")
    assert out["ms"] > 0
    assert out["max_abs_diff_from_torch"]["output"] < 1e-5
    assert out["max_abs_diff_from_torch"]["input_grad"] < 1e-4
