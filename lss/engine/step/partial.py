"""The eager step's fixed-shape, heavy parts as CUDA graphs (EncoderGraphs): the camera trunk over
all B*N images and the BEV encoder, each one graph forward and one graph backward
(torch.cuda.make_graphed_callables). EfficientNet-B0's many small layers and the ResNet-18 trunk
hold most of the step's kernel launches; the rest of the step stays eager (lookup table, splat,
heads and losses, the detection head's second stage, GradScaler, gradient accumulation, DDP's
gradient hooks, the optimizer), so it serves where the whole step cannot be one graph."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
from typing import Callable, Iterator, Optional

import torch
import torch.cuda.graphs as cuda_graphs  # make_graphed_callables's own module
from torch import nn

# torch.cuda.make_graphed_callables's signature: (modules, sample args per module, **options)
MakeGraphed = Callable[..., object]


def encoder_graph_problems(
    device: torch.device, compile_start: str, distributed: bool = False
) -> list[str]:
    """Why the eager steps of a run on `device` cannot replay the encoders as CUDA graphs
    (`compile_start`: lss.engine.step.factory.compile_start's answer; `distributed`: under
    torchrun, where the captured DDP step is the fast one)."""
    problems = []
    if device.type != "cuda":
        problems.append(f"CUDA graphs need a CUDA device (training runs on {device})")
    if compile_start != "off":
        problems.append("train.compile compiles the encoders instead")
    if distributed:
        problems.append("not under torchrun: capturing them inside DistributedDataParallel fails")
    return problems


@dataclasses.dataclass(frozen=True)
class _Call:
    """What a graph is captured for: its input's shape, dtype, device and requires_grad, the grad
    mode and the autocast dtype around the call (None: no autocast)."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    grad_enabled: bool
    autocast: Optional[torch.dtype]

    @staticmethod
    def of(x: torch.Tensor) -> "_Call":
        kind = x.device.type
        cast = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        return _Call(x.shape, x.dtype, x.device, x.requires_grad, torch.is_grad_enabled(), cast)


def _one_tensor(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """The call's argument where it is one tensor (the encoders' form), else None."""
    if len(args) == 1 and not kwargs and torch.is_tensor(args[0]):
        return args[0]
    return None


class EncoderGraphs:
    """The camera trunk and the BEV encoder of `model` (`camera.trunk` and `bev`) as CUDA graphs
    inside the eager step; `make_graphed`: torch.cuda.make_graphed_callables or a stand-in (tests).

    `forward()` is the context of the step's forward passes. Until `capture()` it records each
    module's first input; `capture()` (after the first step) captures both graphs on copies of those
    inputs, under the autocast they ran in without its weight cache (which make_graphed_callables
    refuses), then puts back the BatchNorm statistics and the RNG state that its warm-up passes
    moved. From then on, inside `forward()`, a module replays its graphs for an input of the
    captured shape, dtype, grad mode and autocast, and runs eagerly for any other (a last partial
    batch); outside it (evaluation, checkpoints, export) the modules are their plain selves.
    `problem` says why the modules run eagerly for the rest of the run (a model without them, a
    failed capture); None while they can be graphed.

    A graph's backward returns its parameters' gradients in its own buffers, which autograd adopts
    as a .grad that was None, and the next replay overwrites them: `keep_grads()` gives those
    parameters zero gradients before a step that accumulates micro-batches, so autograd adds."""

    def __init__(
        self, model: nn.Module, make_graphed: MakeGraphed = torch.cuda.make_graphed_callables
    ):
        self.make_graphed = make_graphed
        camera = getattr(model, "camera", None)
        found = [("camera trunk", getattr(camera, "trunk", None))]
        found.append(("BEV encoder", getattr(model, "bev", None)))
        missing = [name for name, module in found if not isinstance(module, nn.Module)]
        # the graphs and the steps set forward on the instance, and take it away again
        patched = [name for name, module in found if "forward" in getattr(module, "__dict__", {})]
        self.problem: Optional[str] = None
        if missing:
            self.problem = (
                f"{type(model).__name__} has no {' and no '.join(missing)} (.camera.trunk, .bev)"
            )
        elif patched:
            self.problem = f"the {' and the '.join(patched)} has a forward set on the instance"
        self.names = [name for name, _ in found]
        self.modules: list[nn.Module] = [m for _, m in found if isinstance(m, nn.Module)]
        self.inputs: dict[int, torch.Tensor] = {}  # module index -> a copy of its first input
        self.calls: dict[int, _Call] = {}  # module index -> what its graph is captured for
        self.graphed: Optional[list[Callable]] = None  # per module: make_graphed's forward
        self.capture_seconds: Optional[float] = None

    @property
    def captured(self) -> bool:
        return self.graphed is not None and self.problem is None

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Inside, the modules record their inputs (before the capture) or replay their graphs."""
        if self.problem is not None:
            yield
            return
        for i, module in enumerate(self.modules):
            call = self._replaying if self.graphed is not None else self._recording
            module.forward = call(i, module.forward)
        try:
            yield
        finally:
            for module in self.modules:
                del module.forward  # back to the class's forward

    def _recording(self, index: int, plain: Callable) -> Callable:
        def forward(*args, **kwargs):
            x = _one_tensor(args, kwargs)
            if x is not None and index not in self.inputs:
                self.inputs[index] = x.detach().clone()
                self.calls[index] = _Call.of(x)
            return plain(*args, **kwargs)

        return forward

    def _replaying(self, index: int, plain: Callable) -> Callable:
        graphed, captured_for = self.graphed[index], self.calls[index]

        def forward(*args, **kwargs):
            x = _one_tensor(args, kwargs)
            if x is not None and _Call.of(x) == captured_for:
                return graphed(x)
            return plain(*args, **kwargs)

        return forward

    def capture(self) -> Optional[str]:
        """Capture the modules' graphs on their recorded inputs; returns None, or why the modules
        stay eager (also kept in `problem`)."""
        if self.problem is not None or self.graphed is not None:
            return self.problem
        missing = [n for i, n in enumerate(self.names) if i not in self.inputs]
        casts = {call.autocast for call in self.calls.values()}
        if missing or len(casts) != 1:
            self.problem = (
                f"the {' and the '.join(missing)} did not run on one tensor in the first step"
                if missing
                else "the encoders ran under different autocast settings"
            )
            self.inputs.clear()
            return self.problem
        samples = tuple(
            (self.inputs[i].requires_grad_(self.calls[i].requires_grad),)
            for i in range(len(self.modules))
        )
        device = samples[0][0].device
        start = _clock(device)
        undo = _WarmupUndo(self.modules, device)
        try:
            with _autocast(device, casts.pop()), _on(device), _thread_local_capture() as mode:
                self.make_graphed(tuple(self.modules), samples, allow_unused_input=True, **mode)
            self.graphed = [m.__dict__.pop("forward") for m in self.modules]
        except Exception as e:  # noqa: BLE001 (any failure leaves the steps eager, not the run)
            for module in self.modules:
                module.__dict__.pop("forward", None)
            lines = str(e).strip().splitlines()
            self.problem = f"capture failed: {type(e).__name__}: {lines[0] if lines else ''}"
        finally:
            undo()
            self.inputs.clear()  # the graphs keep their own references to their inputs
        if self.problem is None:
            self.capture_seconds = _clock(device) - start
        return self.problem

    def keep_grads(self) -> None:
        """Zero gradients for the graphed parameters that have none (see the class)."""
        if not self.captured:
            return
        for module in self.modules:
            for p in module.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)


class _WarmupUndo:
    """The modules' buffers (BatchNorm statistics) and the device's RNG state as they are now;
    calling it puts them back in place (the graphs bind the buffers' addresses)."""

    def __init__(self, modules: list[nn.Module], device: torch.device):
        self.buffers = [b for m in modules for b in m.buffers()]
        self.saved = [b.detach().clone() for b in self.buffers]
        self.device = device
        cuda = device.type == "cuda"
        self.rng = torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state()

    @torch.no_grad()
    def __call__(self) -> None:
        for buffer, saved in zip(self.buffers, self.saved):
            buffer.copy_(saved)
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(self.rng, self.device)
        else:
            torch.set_rng_state(self.rng)


def _autocast(device: torch.device, dtype: Optional[torch.dtype]):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=False)


def _on(device: torch.device):
    """The capture's side stream and graphs on `device`, not on the current device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@contextlib.contextmanager
def _thread_local_capture() -> Iterator[dict]:
    """Capture in thread_local mode: other threads may call CUDA meanwhile (the loader's pin-memory
    thread, whose calls would invalidate a global-mode capture). Yields make_graphed_callables's
    keyword for it where torch has one; torch 2.11 has none, so its torch.cuda.graph (which
    make_graphed_callables calls) defaults to thread_local meanwhile."""
    params = inspect.signature(torch.cuda.make_graphed_callables).parameters
    if "capture_error_mode" in params:
        yield {"capture_error_mode": "thread_local"}
        return
    plain = torch.cuda.graph

    class graph(plain):  # noqa: N801 (stands in for torch.cuda.graph)
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("capture_error_mode", "thread_local")
            super().__init__(*args, **kwargs)

    torch.cuda.graph = cuda_graphs.graph = graph
    try:
        yield {}
    finally:
        torch.cuda.graph = cuda_graphs.graph = plain
