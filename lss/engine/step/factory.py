"""The one place that picks the training step: `choose_step` decides once from the config, the
device and the process layout (and says why), `build_step` makes the step object.

The kinds: "eager" (EagerStep: any device, any number of processes), "captured" (CapturedStep:
one CUDA graph per step) and "captured-ddp" (CapturedDDPStep: the captured step under torchrun, two
graphs around one gradient all-reduce per process). Each may run over compiled modules
(CompiledStep), compiled before the first step or by a background process (BackgroundCompileHook).
A new kind is a new StepChoice.kind, its rules in `device_problems`, and its class in
`build_step`: nothing outside lss/engine/step/ asks which kind runs."""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal, Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lss.config import Config
from lss.models.build import ModelFn
from lss.engine.distributed import DistInfo
from lss.models.depth_loss import check_depth_targets
from lss.engine.step.background import BackgroundCompileHook
from lss.engine.step.base import StepParts, TrainStep
from lss.engine.step.captured import CapturedStep
from lss.engine.step.compiled import CompiledStep
from lss.engine.step.ddp import CapturedDDPStep
from lss.engine.step.eager import EagerStep
from lss.engine.step.partial import EncoderGraphs, encoder_graph_problems
from lss.errors import ConfigError

StepKind = Literal["eager", "captured", "captured-ddp"]
CompileStart = Literal["off", "now", "background"]


@dataclasses.dataclass(frozen=True)
class StepChoice:
    """Which step a run trains with; `eager_because`: why train.cuda_graph: auto runs eager;
    `encoder_graphs`: eager steps replay the camera trunk and the BEV encoder as CUDA graphs."""

    kind: StepKind = "eager"
    compile_start: CompileStart = "off"
    eager_because: tuple[str, ...] = ()
    encoder_graphs: bool = False

    def describe(self) -> str:
        """How the run takes its steps, for its first line."""
        mode = {
            "captured": "each step one CUDA graph replay",
            "captured-ddp": "each step two CUDA graph replays per process around one all-reduce "
            "of the gradients",
        }.get(self.kind, "eager steps")
        if self.eager_because:  # only auto falls back (true raises instead)
            mode += " (train.cuda_graph: auto: " + "; ".join(self.eager_because) + ")"
        if self.encoder_graphs:
            mode += ", the camera trunk and the BEV encoder as CUDA graphs"
        if self.compile_start == "background":
            mode += (
                ", uncompiled until a background process has compiled the model "
                "(train.compile_start)"
            )
        return mode


def cuda_graph_problems(cfg: Config) -> list[str]:
    """Why the config's step cannot be one CUDA graph (train.cuda_graph); the device's rule:
    device_problems."""
    t, problems = cfg.train, []
    if t.grad_accum != 1:
        problems.append(f"it needs train.grad_accum: 1 (got {t.grad_accum})")
    if t.amp == "fp16":
        problems.append("it needs train.amp: bf16 or none (fp16 needs a loss scaler)")
    if t.compile and t.compile_mode == "reduce-overhead":
        problems.append(
            "train.compile_mode: reduce-overhead already uses CUDA graphs per module; use one or "
            "the other"
        )
    return problems


def device_problems(device: torch.device) -> list[str]:
    """Why this device cannot run the captured step (one CUDA process, or each of torchrun's:
    captured-ddp)."""
    problems = []
    if device.type != "cuda":
        problems.append(f"it needs a CUDA device (training runs on {device})")
    return problems


def cuda_graph_refusal(problems: list[str]) -> str:
    """The ConfigError message of train.cuda_graph: true where `problems` hold."""
    return (
        f"train.cuda_graph: true cannot be used here: {'; '.join(problems)}. Set "
        "train.cuda_graph: false (or auto)"
    )


def compile_start(cfg: Config, device: torch.device, dist: DistInfo) -> CompileStart:
    """When the model compiles (train.compile, train.compile_start): "background" (a child process
    compiles while the run trains uncompiled steps) for compile_start: background on one process,
    and for auto on one CUDA process (on a CPU the child would take the cores the steps need); "now"
    (before the first step) otherwise; "off" without train.compile."""
    t = cfg.train
    if not t.compile:
        return "off"
    if dist.enabled and t.compile_start == "background":
        raise ConfigError(
            "train.compile_start: background needs a run of one process (every DDP process "
            "would have to switch at the same step); set train.compile_start: now (or auto) with "
            "torchrun"
        )
    alone = not dist.enabled and t.compile_start != "now"
    if alone and (t.compile_start == "background" or device.type == "cuda"):
        return "background"
    return "now"


def choose_step(
    cfg: Config, device: torch.device, dist: DistInfo, background: bool = True
) -> StepChoice:
    """The step of this run. train.cuda_graph false: eager; true: captured, or a ConfigError naming
    the setting to change where a rule fails; "auto": captured where every rule holds, else eager
    with the reasons. `background`: whether a background compile is possible (a model function to
    send)."""
    setting, start = cfg.train.cuda_graph, compile_start(cfg, device, dist)
    if start == "background" and not background:
        start = "now"
    # the eager step's partial capture (train.eager_encoder_graphs, on by default)
    graphs = cfg.train.eager_encoder_graphs and not encoder_graph_problems(
        device, start, dist.enabled
    )
    if setting is False:
        return StepChoice("eager", start, encoder_graphs=graphs)
    problems = cuda_graph_problems(cfg) + device_problems(device)
    if setting is True and problems:
        raise ConfigError(cuda_graph_refusal(problems))
    if problems:
        return StepChoice("eager", start, tuple(problems), graphs)
    return StepChoice("captured-ddp" if dist.enabled else "captured", start)


def build_step(
    cfg: Config, choice: StepChoice, parts: StepParts, model_fn: Optional[ModelFn] = None
) -> TrainStep:
    """The step object of `choice` over `parts` (wrapped for DDP under torchrun); a background
    compile adds its hook to the step's `hooks`, and needs `model_fn`, the importable function that
    built the model."""
    if parts.dist.enabled and choice.kind != "captured-ddp":  # that one all-reduces itself
        ids = [parts.device.index] if parts.device.type == "cuda" else None
        parts = dataclasses.replace(parts, net=DistributedDataParallel(parts.model, device_ids=ids))

    def make_step() -> TrainStep:
        if choice.kind == "captured":
            return CapturedStep(parts, check_batch=depth_check(parts.model))
        if choice.kind == "captured-ddp":
            return CapturedDDPStep(parts, check_batch=depth_check(parts.model))
        return EagerStep(parts, EncoderGraphs(parts.model) if choice.encoder_graphs else None)

    if choice.compile_start == "off":
        return make_step()
    t = cfg.train
    step = CompiledStep(
        parts, make_step, t.compile_mode, t.compile_memory_budget, choice.compile_start == "now"
    )
    if choice.compile_start == "background":
        captured = choice.kind == "captured"
        step.hooks.append(BackgroundCompileHook(step, cfg, model_fn, parts.device, captured))
    return step


def depth_check(model: nn.Module) -> Optional[Callable[[dict], None]]:
    """The host-side check of a batch's depth targets for a step that cannot sync (the captured
    one)."""
    splat = getattr(model, "splat", None)
    if splat is None:
        return None

    def check(batch: dict) -> None:
        if "depth_targets" in batch:
            check_depth_targets(batch["depth_targets"], splat.depth_bins)

    return check
