"""Loading of the compiled extension `lss._C` and the rules for falling back to the pure-PyTorch
references."""

from __future__ import annotations

import warnings

import torch

try:
    from lss import _C  # registers torch.ops.lss.*

    _LOAD_ERROR: Exception | None = None
except ImportError as e:  # not built, or built against another torch
    _C = None
    _LOAD_ERROR = e

_warned: set[str] = set()

REBUILD_HINT = (
    "rebuild the extension with a CUDA toolkit: "
    "CUDA_HOME=/path/to/cuda FORCE_CUDA=1 pip install --no-build-isolation -e ."
)


def has_ext() -> bool:
    """Whether the compiled extension `lss._C` is loaded (else every op runs its pure-PyTorch
    reference)."""
    return _C is not None


_HAS_CUDA = _C is not None and bool(
    _C.has_cuda()
)  # read once: torch.compile cannot trace into lss._C


def has_cuda_ops() -> bool:
    """Whether the CUDA kernels were compiled into the loaded extension."""
    return _C is not None and _HAS_CUDA


def cuda_archs() -> str:
    """TORCH_CUDA_ARCH_LIST the CUDA kernels were built for ("" without CUDA kernels)."""
    return _C.cuda_archs() if _C is not None else ""


def load_error() -> Exception | None:
    return _LOAD_ERROR


def use_reference(op_name: str) -> bool:
    """True when `lss._C` is missing: the op must run its reference. Warns once per op, naming the
    cause."""
    if _C is not None:
        return False
    if op_name not in _warned:
        _warned.add(op_name)
        warnings.warn(
            f"lss.ops.{op_name}: the compiled extension lss._C is not available ({_LOAD_ERROR}); "
            "using the slow pure-PyTorch reference. Build it with "
            "`pip install --no-build-isolation -e .`.",
            RuntimeWarning,
            stacklevel=3,
        )
    return True


def check_device(op_name: str, *tensors: torch.Tensor) -> None:
    """Raise a clear error when a CUDA tensor reaches an op whose CUDA kernel is not in this
    build."""
    if not has_cuda_ops() and any(t is not None and t.is_cuda for t in tensors):
        raise RuntimeError(
            f"lss.ops.{op_name}: got CUDA tensors, but this build of lss has no CUDA kernels; "
            f"{REBUILD_HINT}"
        )


def kernels_take(tensor: torch.Tensor, on_cpu: bool) -> bool:
    """Whether a module that swaps PyTorch's kernels for lss's (BatchNorm2d, the depthwise
    convolutions) runs lss's on `tensor`: CUDA with the CUDA kernels built, or the CPU when
    `on_cpu`; never while tracing (export keeps PyTorch's operators) or without the extension."""
    if torch.jit.is_tracing() or not has_ext():
        return False
    if tensor.is_cuda:
        return has_cuda_ops()
    return on_cpu and tensor.device.type == "cpu"
