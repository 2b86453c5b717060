import warnings

import pytest
import torch

import lss.ops
from lss.ops import _ext, upsample_bilinear, upsample_bilinear_reference


def test_build_queries_are_consistent():
    assert lss.ops.has_ext() == (_ext._C is not None)
    assert isinstance(lss.ops.has_cuda_ops(), bool) and isinstance(lss.ops.cuda_archs(), str)
    if not lss.ops.has_ext():
        assert not lss.ops.has_cuda_ops() and lss.ops.cuda_archs() == ""
    assert bool(lss.ops.cuda_archs()) == lss.ops.has_cuda_ops()


def test_missing_extension_falls_back_to_reference_with_one_warning(monkeypatch):
    monkeypatch.setattr(_ext, "_C", None)
    monkeypatch.setattr(_ext, "_warned", set())
    assert not lss.ops.has_ext() and not lss.ops.has_cuda_ops() and lss.ops.cuda_archs() == ""
    x = torch.randn(1, 2, 3, 4)
    with pytest.warns(RuntimeWarning, match="lss.ops.upsample_bilinear: the compiled extension lss._C is not"):
        y = upsample_bilinear(x, scale_factor=2, mode="align_corners")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y2 = upsample_bilinear(x, scale_factor=2, mode="align_corners")
    want = upsample_bilinear_reference(x, scale_factor=2, mode="align_corners")
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    torch.testing.assert_close(y2, want, rtol=0, atol=0)


class _CudaStandIn:
    """Stands in for a CUDA tensor where no GPU exists: check_device only asks `.is_cuda`."""

    is_cuda = True


def test_cuda_tensor_without_cuda_kernels_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(_ext, "has_cuda_ops", lambda: False)
    with pytest.raises(RuntimeError, match="lss.ops.upsample_bilinear: got CUDA tensors, but this build of lss has "
                                           "no CUDA kernels; rebuild the extension"):
        _ext.check_device("upsample_bilinear", torch.zeros(1), _CudaStandIn())
    _ext.check_device("upsample_bilinear", torch.zeros(1), None)


def test_cuda_tensor_passes_when_cuda_kernels_exist(monkeypatch):
    monkeypatch.setattr(_ext, "has_cuda_ops", lambda: True)
    _ext.check_device("upsample_bilinear", _CudaStandIn())


@pytest.mark.skipif(not _ext.has_ext(), reason="lss._C is not built")
def test_ops_check_the_device_of_their_inputs(monkeypatch):
    seen = []
    monkeypatch.setattr(_ext, "check_device", lambda name, *tensors: seen.append((name, tensors)))
    x = torch.randn(1, 1, 2, 2)
    upsample_bilinear(x, size=3)
    assert seen == [("upsample_bilinear", (x,))]
