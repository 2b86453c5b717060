"""`train.cuda_graph`: the whole training step (lookup-table build, forward, loss, backward,
gradient clipping, optimizer update) captured once as one CUDA graph and replayed on static input
buffers.

The eager step launches about 2,000 small kernels (EfficientNet-B0 has many small layers), so it is
bound by the host; a replay is one launch. The graph's private memory pool reuses freed blocks
within the step as the eager step does, so the step needs about the eager step's memory (per-module
CUDA graphs, `train.compile_mode: reduce-overhead`, keep forward and backward memory apart and need
about twice that).

What it needs (lss.engine.step.factory.cuda_graph_problems and the process rules there): gradient
accumulation 1, bf16 or no autocast (fp16 needs a GradScaler and its host-side skip logic),
Adam/AdamW, the detection head in fixed shapes (the dataset yields its targets so,
lss.geometry.boxes.dense_targets), no per-module CUDA graphs, one CUDA process, and batches
of one fixed set of shapes (the train loader drops the last partial batch)."""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Optional

import torch
from torch import nn

from lss.engine.step.base import StepParts


def make_capturable(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """The optimizer as a captured step needs it: each learning rate a device tensor (the scheduler
    fills it in place, the graph reads it at every replay) and capturable updates. Its state_dict
    keeps the plain form (a float learning rate, capturable off), which eager and captured runs both
    resume from."""
    if all(torch.is_tensor(group["lr"]) for group in optimizer.param_groups):
        return
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(float(group["lr"]), device=device)
        group["capturable"] = True
    optimizer.register_state_dict_post_hook(_plain_state)


def _plain_state(optimizer: torch.optim.Optimizer, state: dict) -> dict:
    groups = [{**g, "lr": float(g["lr"]), "capturable": False} for g in state["param_groups"]]
    return {**state, "param_groups": groups}


class GraphedTrainStep:
    """step(batch) -> {"loss": ..., "loss/<class>": ..., "grad_norm": ...} (0-dim device tensors,
    valid until the next call) for one optimizer step on `batch`, under autocast to `amp_dtype`
    (None: no autocast).

    The first call copies the batch into static buffers, runs `warmup` eager steps on a side stream
    (cuDNN autotuning, optimizer state allocation), puts the parameters, buffers, optimizer state
    and RNG back as they were, and captures one step; every call then copies its batch into the
    buffers and replays. The result is the same parameter trajectory as eager steps. The capture
    resets the CUDA peak-memory statistics and records the step's peak in `peak_bytes`.
    `capture=False` runs the same step eagerly on the static buffers (for CPU tests of everything
    but the capture).

    `setup_seconds` says where the first call's time went: "warmup_step_<i>" for each eager warm-up
    step (the first one holds cuDNN autotuning and the optimizer state's allocation) and "capture"
    (with `capture`), each measured after a device synchronize.

    `check_batch(batch)` runs on every incoming batch before it is copied (host-side validation that
    the captured step cannot do without a sync). The optimizer's learning rate becomes a device
    tensor (the scheduler fills it in place; the graph reads it at every replay)."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: nn.Module,
        optimizer: torch.optim.Optimizer,
        amp_dtype: Optional[torch.dtype],
        grad_clip: float,
        warmup: int = 2,
        capture: bool = True,
        check_batch: Optional[Callable[[dict], None]] = None,
    ):
        if warmup < 1:
            raise ValueError(
                f"GraphedTrainStep: warmup must be >= 1 (the optimizer state must exist before the "
                f"capture), got {warmup}"
            )
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer
        self.amp_dtype = amp_dtype
        self.grad_clip = grad_clip if grad_clip > 0 else float("inf")
        self.warmup, self.capture = warmup, capture
        self.check_batch = check_batch
        self.static: Optional[dict] = None
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.outputs: Optional[dict] = None
        # peak allocated device memory of a step (CUDA, after the capture)
        self.peak_bytes: Optional[int] = None
        self.setup_seconds: dict[str, float] = {}  # part of the first call -> seconds

    @classmethod
    def from_parts(cls, parts: StepParts, **options) -> GraphedTrainStep:
        """The step over a StepParts' model, loss, optimizer, autocast and clipping; `options`: the
        other arguments, by keyword."""
        return cls(
            parts.model,
            parts.loss_fn,
            parts.optimizer,
            parts.amp_dtype,
            parts.grad_clip,
            **options,
        )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def __call__(self, batch: dict) -> dict:
        self.load(batch)
        return self.replay()

    def load(self, batch: dict) -> None:
        """Check `batch` and queue its copy into the static buffers (from pinned host memory the
        copy does not wait for the host); the first call also warms up and captures the step."""
        if self.check_batch is not None:
            self.check_batch(batch)
        if self.static is None:
            self._setup(batch)
        else:
            self._load(batch)

    def replay(self) -> dict:
        """One optimizer step on the loaded batch; returns the step's values (see the class)."""
        if self.graph is not None:
            self.graph.replay()  # the captured backward writes (not adds to) the gradients
            return self.outputs
        self.optimizer.zero_grad(set_to_none=True)
        return self._step()

    # -- static inputs
    def _load(self, batch: dict) -> None:
        tensors = {k: v for k, v in batch.items() if torch.is_tensor(v)}
        if tensors.keys() != self.static.keys():
            raise ValueError(
                f"train.cuda_graph: the batch holds tensors {sorted(tensors)} but the captured "
                f"step was built for {sorted(self.static)}; every batch must hold the same entries"
            )
        for k, v in tensors.items():
            buf = self.static[k]
            if v.shape != buf.shape or v.dtype != buf.dtype:
                raise ValueError(
                    f"train.cuda_graph: batch[{k!r}] is {tuple(v.shape)} {v.dtype} but the "
                    f"captured step was built for {tuple(buf.shape)} {buf.dtype}; every batch must "
                    "have the same shapes (fixed image size, drop_last) or set "
                    "train.cuda_graph: false"
                )
            buf.copy_(v, non_blocking=True)

    def _setup(self, batch: dict) -> None:
        self._allocate_static(batch)
        self._warm_up(self._fresh_step)
        # the captured backward allocates the gradients in its pool
        self.optimizer.zero_grad(set_to_none=True)
        if self.capture:
            self._timed_capture()

    def _fresh_step(self) -> dict:
        self.optimizer.zero_grad(set_to_none=True)
        return self._step()

    def _capture(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.outputs = self._step()

    def _allocate_static(self, batch: dict) -> None:
        """The static buffers, filled with the first batch; the optimizer made capturable."""
        self.static = {k: v.to(self.device).clone() for k, v in batch.items() if torch.is_tensor(v)}
        if self.capture:
            make_capturable(self.optimizer, self.device)

    def _warm_up(self, step: Callable[[], dict]) -> None:
        """`warmup` calls of `step` on a side stream (timed in setup_seconds), then parameters,
        buffers, optimizer state and RNG put back as they were (the snapshot goes on return, so its
        copies do not count in the captured step's peak)."""
        device = self.device
        snapshot = StateSnapshot(self.model, self.optimizer)
        side = torch.cuda.Stream(device) if self.capture else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for i in range(1, self.warmup + 1):
                start = self._clock()
                step()
                self.setup_seconds[f"warmup_step_{i}"] = self._clock() - start
        if side is not None:
            torch.cuda.current_stream(device).wait_stream(side)
        snapshot.restore()

    def _timed_capture(self) -> None:
        """Capture the step's graphs (`_capture`), recording the step's peak memory in `peak_bytes`
        and the time in setup_seconds["capture"]."""
        device = self.device
        start = self._clock()  # synchronized: the peak below is the captured step's alone
        torch.cuda.reset_peak_memory_stats(device)
        self._capture()
        # the capture allocates and frees as a replay does, so its peak is the step's peak
        self.peak_bytes = torch.cuda.max_memory_allocated(device)
        torch.cuda.empty_cache()  # the warm-up's blocks; the graph's pool keeps what it needs
        self.setup_seconds["capture"] = self._clock() - start

    def _clock(self) -> float:
        """time.perf_counter() once the device has done the work queued so far (on every stream)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        # no cast cache: cached casts would outlive the capture that allocated them
        return torch.autocast(self.device.type, dtype=self.amp_dtype, cache_enabled=False)

    def _step(self) -> dict:
        with self.autocast():
            outputs = self.model(self.static)
        losses = self.loss_fn(outputs, self.static)
        losses["loss"].backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.grad_clip, foreach=True
        )
        self.optimizer.step()
        out = {k: v.detach() for k, v in losses.items()}
        out["grad_norm"] = grad_norm.detach()
        return out


class StateSnapshot:
    """Parameters, buffers, optimizer state and RNG as they were, to undo the warm-up steps in place
    (the graph binds the tensors' addresses, so the same tensors get their old values back)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        self.tensors = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
        self.optimizer_state = {
            id(p): {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for p, s in optimizer.state.items()
        }
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    @torch.no_grad()
    def restore(self) -> None:
        for k, v in self.model.state_dict(keep_vars=True).items():
            v.detach().copy_(self.tensors[k])
        for p, state in self.optimizer.state.items():
            old = self.optimizer_state.get(id(p))
            for k, v in state.items():
                if not torch.is_tensor(v):
                    continue
                if old is None:
                    v.zero_()  # Adam's fresh state: step 0 and zero moments
                else:
                    v.copy_(old[k])
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
