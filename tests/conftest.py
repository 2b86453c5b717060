import pytest
import torch

from lss.ops import has_cuda_ops


def cuda_ready() -> bool:
    return torch.cuda.is_available() and has_cuda_ops()


def pytest_collection_modifyitems(config, items):
    if cuda_ready():
        return
    why = "no CUDA GPU" if not torch.cuda.is_available() else "lss built without CUDA kernels"
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def devices():
    """Parametrize helper: ["cpu"] plus a cuda-marked "cuda" entry."""
    return ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
