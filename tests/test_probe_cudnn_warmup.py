"""scripts/probe_cudnn_warmup.py: the distinct convolution calls of a forward found on the meta device, and their
warm-up calls, which leave the model alone."""
import torch

from conftest import load_script


def _module():
    return load_script("probe_cudnn_warmup")


def test_distinct_convolution_calls_and_their_warm_up():
    probe = _module()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False),
        torch.nn.Conv2d(8, 8, 3, padding=1, groups=8),
        torch.nn.Conv2d(8, 8, 3, padding=1, groups=8),  # the same call again: recorded once
        torch.nn.Conv2d(8, 4, 1),
    )
    before = [p.detach().clone() for p in model.parameters()]
    calls = probe.convolution_calls(model, ((2, 3, 16, 24),), True)
    assert [c.input_shape for c in calls] == [(2, 3, 16, 24), (2, 8, 8, 12), (2, 8, 8, 12)]
    assert [c.groups for c in calls] == [1, 8, 1]
    assert [c.input_grad for c in calls] == [False, True, True]  # the images need no gradient
    assert calls[1].bias and not calls[0].bias and calls[0].stride == (2, 2) and calls[0].padding == (1, 1)
    assert all(c.channels_last for c in calls)
    ran = []
    done = probe.warm_convolutions(calls, torch.device("cpu"), torch.float32, 2,
                                   run=lambda c, d, t: (ran.append(c), probe._run_call(c, d, t)))
    assert done == 3 and sorted(ran, key=calls.index) == calls
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    grid = probe.convolution_calls(model, ((1, 3, 8, 8),), False, True)
    assert grid[0].input_grad and not grid[0].channels_last
