import os
import tempfile

import pytest
import torch

from lss.ops import has_cuda_ops

# the dataset-index cache of the test session (and of the runs it starts) stays out of the user's cache
os.environ.setdefault("LSS_CACHE_DIR", tempfile.mkdtemp(prefix="lss-test-cache-"))


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


def strided_grads(shape, device, dtype=torch.float32, seed=1) -> dict:
    """Non-contiguous incoming gradients of `shape` (K x C x PH x PW), as autograd hands them to a backward: the
    expanded ones of out.sum(), a permuted copy, every other element of a larger tensor, a channels-last one."""
    g = torch.Generator().manual_seed(seed)
    k, c, ph, pw = shape
    dense = torch.randn(shape, generator=g).to(device, dtype)
    return {
        "expanded": torch.ones((), device=device, dtype=dtype).expand(shape),
        "permuted": dense.permute(1, 0, 3, 2).contiguous().permute(1, 0, 3, 2),
        "sliced": torch.randn(k, 2 * c, ph, pw + 3, generator=g).to(device, dtype)[:, ::2, :, 1:pw + 1],
        "channels_last": dense.contiguous(memory_format=torch.channels_last),
    }


def assert_backward_reads_strided_grad(pool, x, kind, deterministic):
    """x's gradient through `pool(x)` (K x C x PH x PW) for a non-contiguous incoming gradient of `kind`
    (strided_grads) equals the one for its contiguous copy, with deterministic algorithms on or off."""
    out_shape = pool(x).shape
    grad = strided_grads(tuple(out_shape), x.device)[kind]
    assert not grad.is_contiguous()
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        got, want = (torch.autograd.grad(pool(x.requires_grad_(True)), x, g)[0] for g in (grad, grad.contiguous()))
    finally:
        torch.use_deterministic_algorithms(before)
    assert got.abs().sum() > 0
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


# the arguments of lss.data.synthetic.generate for synthetic_root
SYNTHETIC_SET = dict(version="v1.0-mini", scenes=2, samples_per_scene=3, image_size=(400, 225), seed=0, workers=1)


@pytest.fixture(scope="session")
def synthetic_root(tmp_path_factory):
    """A tiny synthetic nuScenes v1.0-mini (2 scenes x 3 key frames, 400 x 225 images; one scene in mini_train,
    one in mini_val), generated once per test session. Returns the dataroot (pathlib.Path)."""
    from lss.data.synthetic import generate

    return generate(tmp_path_factory.mktemp("synthetic_nuscenes"), **SYNTHETIC_SET)


def val_statistics_checkpoint(cfg, path, logit_scale=1.0, step=1):
    """A tiny model of `cfg` whose batch-norm statistics come from the validation images (so that the logits have the
    spread of a trained model: tens, not hundredths; `logit_scale` multiplies its segmentation head), saved to path at
    `step`. Returns path."""
    from torch import nn

    from lss.data import collate
    from lss.data.loader import build_dataset
    from lss.engine.checkpoint import save_checkpoint
    from lss.models.build import build_model

    torch.manual_seed(3)
    model = build_model(cfg)
    dataset = build_dataset(cfg, cfg.data.val_split, False, verbose=False)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.reset_running_stats()
            module.momentum = None
    with torch.no_grad():
        model.train()(collate([dataset[i] for i in range(len(dataset))]))
        model.segmentation.conv.weight.mul_(logit_scale)
    save_checkpoint(path, model.eval(), step=step, config=cfg)
    return path


def load_script(name: str):
    """scripts/<name>.py imported as a module (the scripts are not a package)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass of the script looks its module up
    spec.loader.exec_module(module)
    return module
