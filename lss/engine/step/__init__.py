"""The training step, one object per variant: EagerStep, CapturedStep (one CUDA graph per step),
CapturedDDPStep (the captured step under torchrun: two graphs around one gradient all-reduce) and
CompiledStep (any of them over compiled modules, compiled now or by a background process).
`choose_step` picks the variant once from the config, the device and the process layout;
`build_step` makes it."""

from lss.engine.step.background import BackgroundCompileHook
from lss.engine.step.base import StepParts, TrainStep
from lss.engine.step.captured import CapturedStep
from lss.engine.step.compiled import CompiledStep, compile_encoders, uncompiled
from lss.engine.step.ddp import CapturedDDPStep
from lss.engine.step.eager import EagerStep
from lss.engine.step.factory import StepChoice, build_step, choose_step, cuda_graph_problems
from lss.engine.step.graph import GraphedTrainStep
from lss.engine.step.logs import StepLogs

__all__ = [
    "BackgroundCompileHook",
    "CapturedDDPStep",
    "CapturedStep",
    "CompiledStep",
    "EagerStep",
    "GraphedTrainStep",
    "StepChoice",
    "StepLogs",
    "StepParts",
    "TrainStep",
    "build_step",
    "choose_step",
    "compile_encoders",
    "cuda_graph_problems",
    "uncompiled",
]
