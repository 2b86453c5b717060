"""Streaming inference of a two-frame model (model.temporal.frames: 2) over a sequence: each frame's
camera features are kept for the next frame, whose previous frame they are, instead of being
computed again from the previous images (the camera trunk then runs once per frame, not twice)."""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable, Iterator, Optional

import torch

from lss.engine.predictor import (
    PREDICTION_OUTPUTS,
    CapturedForward,
    EagerForward,
    Prediction,
    Predictor,
)
from lss.errors import ArgumentError

# a frame's camera features kept for the next frame (model outputs), and the inputs they become
KEPT_FEATURES = ("camera_depth", "camera_context")
STREAMED_INPUTS = ("prev_depth", "prev_context")


class StreamingPredictor:
    """`StreamingPredictor(predictor)` over a Predictor of a two-frame checkpoint (backend "torch").

    `step(batch)` takes a model input batch with the previous frame's entries (lss.data.collate of
    NuScenesBEV items of a model.temporal.frames: 2 config: "prev_sample_token" names each sample's
    previous sample) and returns its Predictions. The camera features of the last
    model.temporal.gap batches are kept: where every sample's previous sample is the sample of the
    same place in one of them (the batch just before; with gap 2, the one before that), that
    batch's features stand in for "prev_images" ("prev_depth", "prev_context"); otherwise (a
    sequence's first batch, a scene's first sample, a jump) they are computed from "prev_images",
    as Predictor.predict_batch does.
    Either way the predictions are those of the two-frame forward. `stream(batches)` steps through
    an iterable in time order; `reset()` forgets the kept features; `reused` counts the batches
    that reused them.

    `cuda_graph` (default: as the Predictor's forward, captured on a GPU unless the Predictor was
    made with cuda_graph=False): each step replays one of two CUDA graphs, the first frame's (it
    reads "prev_images") or the streamed frame's (it reads the kept features instead), each
    captured on its first use; False: the eager forward. On a CPU, True runs the same two forwards
    on their static buffers without capturing (what the tests check)."""

    def __init__(self, predictor: Predictor, cuda_graph: Optional[bool] = None):
        if predictor.cfg.model.temporal.frames != 2 or predictor.model is None:
            raise ArgumentError(
                "StreamingPredictor needs a Predictor of a two-frame model (model.temporal.frames: "
                f"2, backend torch); this one has frames={predictor.cfg.model.temporal.frames}, "
                f"backend {predictor.backend}: use Predictor.predict_batch"
            )
        self.predictor = predictor
        self.forward: EagerForward = predictor.forward
        refine = "detection" in predictor.cfg.model.heads and predictor.cfg.detection.refine
        if cuda_graph is None:
            cuda_graph = isinstance(predictor.forward, CapturedForward)
        elif cuda_graph and refine:
            raise ArgumentError(
                "StreamingPredictor(cuda_graph=True): the checkpoint's detection head has its "
                "second stage (detection.refine), whose proposals depend on the data and cannot be "
                "captured; leave cuda_graph unset or False"
            )
        self._graphs: Optional[tuple[CapturedForward, CapturedForward]] = None
        if cuda_graph:
            capture = self.forward.device.type == "cuda"
            model, amp, inputs = self.forward.model, self.forward.amp_dtype, self.forward.inputs
            outputs = PREDICTION_OUTPUTS + KEPT_FEATURES
            streamed = tuple(k for k in inputs if k != "prev_images") + STREAMED_INPUTS
            self._graphs = (
                CapturedForward(model, amp, capture=capture, inputs=inputs, outputs=outputs),
                CapturedForward(model, amp, capture=capture, inputs=streamed, outputs=outputs),
            )
        # (the samples, their camera features) of the last model.temporal.gap batches, oldest first
        self._kept: deque[tuple[list[str], tuple[torch.Tensor, torch.Tensor]]] = deque(
            maxlen=predictor.cfg.model.temporal.gap
        )
        self.reused = 0

    def reset(self) -> None:
        self._kept.clear()

    def _previous_features(self, batch: dict) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The kept features of the batch whose samples are this batch's previous samples, or
        None."""
        previous = batch.get("prev_sample_token")
        if previous is None or list(previous) == list(batch["sample_token"]):
            return None
        for tokens, features in self._kept:
            if tokens == list(previous):
                return features
        return None

    def step(self, batch: dict) -> list[Prediction]:
        if "sample_token" not in batch:
            raise ArgumentError(
                "StreamingPredictor.step: the batch has no 'sample_token'; give collated "
                "NuScenesBEV items (of a config with model.temporal.frames: 2), in time order"
            )
        previous = self._previous_features(batch)
        follows = previous is not None
        if self._graphs is not None:
            first, streamed = self._graphs
            if follows:
                outputs = streamed({**batch, **dict(zip(STREAMED_INPUTS, previous))})
            else:
                outputs = first(batch)
        else:
            device = self.forward.device
            keys = [k for k in self.forward.inputs if k != "prev_images" or not follows]
            inputs = {k: batch[k].to(device, non_blocking=True) for k in keys}
            if follows:
                inputs.update(zip(STREAMED_INPUTS, previous))
            outputs = EagerForward.run(self.forward, inputs)
        self.reused += int(follows)
        # (a captured forward returns copies of its output buffers: no later replay overwrites them)
        features = tuple(outputs[k] for k in KEPT_FEATURES)
        self._kept.append((list(batch["sample_token"]), features))
        return self.predictor.predictions(outputs, batch["sample_token"])

    def stream(self, batches: Iterable[dict]) -> Iterator[list[Prediction]]:
        for batch in batches:
            yield self.step(batch)


def sequence_step(
    predictor: Predictor, batch_size: Optional[int]
) -> tuple[Optional[Callable[[dict], list[Prediction]]], Optional[int]]:
    """How `lss predict` steps through a scene (lss.engine.predictor.write_predictions'
    predict_fn and batch size): a two-frame model of the torch backend streams, one sample a batch
    in time order (StreamingPredictor.step: each frame reuses the camera features of the frame
    before instead of running the camera trunk on the previous images again); any other batches
    as given (None: predict_batch)."""
    if predictor.cfg.model.temporal.frames == 2 and predictor.model is not None:
        return StreamingPredictor(predictor).step, 1
    return None, batch_size
