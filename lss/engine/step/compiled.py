"""train.compile: the model's trainable modules compiled in place (compile_encoders), the compiler
set up for a short first step, evaluation and pictures run uncompiled, and CompiledStep, the step
variant over compiled modules (now, or once a background compile has filled the compiler's caches).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch
from torch import nn

from lss.engine.step.base import StepParts, TrainStep
from lss.engine.step.logs import StepLogs
from lss.errors import ConfigError

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# Inductor settings for a shorter first step: no benchmarking of several launch configurations per
# pointwise kernel, no pattern-rewrite passes (the first step's gain: docs/benchmarks.md).
FAST_START_INDUCTOR = (("triton.autotune_pointwise", False), ("pattern_matcher", False))


def fast_start_compiler(start_workers: bool) -> list[str]:
    """Apply FAST_START_INDUCTOR where this torch release has the setting (a missing one is skipped:
    these are Inductor's settings, not a stable API) and, with `start_workers`, start Inductor's
    compile worker pool now instead of at the first compiled call. Returns the names of the settings
    applied."""
    import torch._inductor.config as inductor_config

    applied = []
    for name, value in FAST_START_INDUCTOR:
        *path, leaf = name.split(".")
        owner = functools.reduce(lambda obj, attr: getattr(obj, attr, None), path, inductor_config)
        if owner is not None and hasattr(owner, leaf):
            setattr(owner, leaf, value)
            applied.append(name)
    if start_workers:
        from torch._inductor import async_compile

        warm_pool = getattr(getattr(async_compile, "AsyncCompile", None), "warm_pool", None)
        if callable(warm_pool):
            warm_pool()
    return applied


@contextlib.contextmanager
def uncompiled() -> Iterator[None]:
    """Inside, compiled modules run their eager code: evaluation and pictures use other shapes and
    modes than the training step (each would be a compilation of its own, for a second of work)."""
    with torch.compiler.set_stance("force_eager"):
        yield


def compile_encoders(model: nn.Module, mode: str = "default", memory_budget: float = 1.0) -> None:
    """torch.compile every trainable submodule (camera and BEV encoders, heads) in place; the LUT
    build stays eager. "reduce-overhead" replays them as CUDA graphs, which removes the host cost of
    launching their kernels one by one. memory_budget < 1 lets the compiler recompute activations in
    the backward instead of keeping them, down to that fraction of the activation memory
    (process-wide: torch._functorch's activation_memory_budget). The compiler is set up for a
    shorter first step (fast_start_compiler), its workers started now for a CUDA model."""
    if mode not in COMPILE_MODES:
        raise ConfigError(
            f"train.compile_mode={mode!r}: expected one of {', '.join(COMPILE_MODES)}"
        )
    if not 0.0 < memory_budget <= 1.0:
        raise ConfigError(
            f"train.compile_memory_budget={memory_budget}: expected a fraction in (0, 1] (1 keeps "
            "what the compiler's default partition keeps)"
        )
    import torch._functorch.config as functorch_config

    functorch_config.activation_memory_budget = memory_budget
    fast_start_compiler(start_workers=any(p.is_cuda for p in model.parameters()))
    for module in model.children():
        if any(p.requires_grad for p in module.parameters()):
            module.compile(mode=mode)


class CompiledStep(TrainStep):
    """The step of `make_step()` (eager or captured) over the model's compiled modules
    (compile_encoders with train.compile_mode and train.compile_memory_budget). `now`: compile
    before the first step; otherwise the steps run uncompiled until `rebuild()`, which the
    background compile's hook calls once the compiler's caches hold the model."""

    def __init__(
        self,
        parts: StepParts,
        make_step: Callable[[], TrainStep],
        mode: str,
        memory_budget: float,
        now: bool,
    ):
        super().__init__(parts)
        self.make_step, self.mode, self.memory_budget = make_step, mode, memory_budget
        if now:
            self._compile()
        self.inner = make_step()

    @property
    def setup_seconds(self) -> dict[str, float]:
        return self.inner.setup_seconds

    def run_step(self, micro_batches: list[dict], step: int) -> StepLogs:
        return self.inner.run_step(micro_batches, step)

    def check(self) -> None:
        self.inner.check()

    def rebuild(self) -> None:
        """Compile the modules now and start a new step over them (a captured step captures again at
        its first call; the old graph's memory goes with the old step)."""
        self.inner.check()  # reads the old step's outputs before they go
        self._compile()
        self.inner = self.make_step()

    def _compile(self) -> None:
        compile_encoders(self.parts.model, self.mode, self.memory_budget)
