"""lss.host_sync: the one place that asks torch.compile and CUDA-graph capture for their state."""

import pytest
import torch

from lss.host_sync import may_sync, tracing


def _read_if_allowed(t: torch.Tensor) -> torch.Tensor:
    return t + 1 if may_sync(t) and not tracing() else t - 1


def test_eager_code_may_sync_and_traced_code_may_not():
    x = torch.arange(3.0)
    assert may_sync(x) and not tracing()
    torch.testing.assert_close(_read_if_allowed(x), x + 1)
    torch._dynamo.reset()
    compiled = torch.compile(_read_if_allowed, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), x - 1)


@pytest.mark.cuda
def test_no_sync_while_a_cuda_graph_is_captured():
    x = torch.arange(3.0, device="cuda")
    assert may_sync(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        answers = (may_sync(x), may_sync(torch.zeros(1)))
        x.mul_(2)
    assert answers == (False, True)  # a CPU tensor may still be read during the capture
    assert may_sync(x)
