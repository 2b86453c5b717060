"""The captured training step (train.cuda_graph): each step one replay of a CUDA graph
(lss.engine.step.graph.GraphedTrainStep), its loss read one step late so the device never waits for
the host."""

from __future__ import annotations

from typing import Callable, Optional

from lss.engine.step.base import StepParts, TrainStep
from lss.engine.step.graph import GraphedTrainStep
from lss.engine.step.logs import StepLogs


class CapturedStep(TrainStep):
    """Queue the batch's copy and the replay, then check the previous step's loss: the host waits
    for that step while this one is queued behind it, so the device never waits for the host's
    launch, and the host prepares the next batch while the device runs this step. A NaN loss
    therefore stops the run at most one update later; `check()` reads the last step's loss now
    (before a hook logs, saves or evaluates).

    `check_batch(batch)`: host-side validation of every batch before its copy (the graph cannot
    sync). `warmup`, `capture`: as GraphedTrainStep (capture=False runs the same step eagerly on the
    static buffers, for CPU tests of everything but the capture)."""

    graphed_step: type[GraphedTrainStep] = GraphedTrainStep  # what the loop replays

    def __init__(
        self,
        parts: StepParts,
        check_batch: Optional[Callable[[dict], None]] = None,
        warmup: int = 2,
        capture: bool = True,
    ):
        super().__init__(parts)
        self.graph = self.graphed_step.from_parts(
            parts, warmup=warmup, capture=capture, check_batch=check_batch
        )

    @property
    def setup_seconds(self) -> dict[str, float]:
        return self.graph.setup_seconds

    def run_step(self, micro_batches: list[dict], step: int) -> StepLogs:
        self.train_mode()
        self.graph.load(micro_batches[0])
        logs = StepLogs(self.graph.replay())
        self.parts.scheduler.step()
        return self._defer(step, logs)
