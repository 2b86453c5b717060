"""Hooks around the trainer's run_step: metrics, evaluation, checkpoints and pictures. Hooks that need more than
the trainer's own state receive callables (an evaluation function, a picture function), so the engine does not
depend on what computes them.

A hook sees the trainer (lss.engine.train.Trainer: step, cfg, model, state, save) after every optimizer step and
once after training; what `after_train` returns goes into train()'s final metrics."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Mapping, Optional

import numpy as np
import torch
from tqdm import tqdm


class StepLogs(Mapping):
    """The logs of one step: host values, plus the step's loss terms as device tensors copied to pinned host memory
    behind the step. Reading one of those waits for that copy (the one host sync of a step), so the loop reads them
    only where it must: at the logging interval, and for the finiteness check before the next step's update."""

    def __init__(self, tensors: Optional[dict] = None, **values: float):
        self._values = dict(values)
        self._pending: Optional[tuple] = None
        if tensors:
            names = sorted(tensors)
            stacked = torch.stack([tensors[k].detach().float() for k in names])
            if stacked.is_cuda:
                host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
                host.copy_(stacked, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._pending = (names, host, event)
            else:
                self._values.update(zip(names, stacked.tolist()))

    def add(self, **values: float) -> None:
        self._values.update(values)

    def _resolve(self) -> None:
        names, host, event = self._pending
        event.synchronize()
        self._values.update(zip(names, host.tolist()))
        self._pending = None

    def __getitem__(self, key: str) -> float:
        if self._pending is not None and key in self._pending[0]:
            self._resolve()
        return self._values[key]

    def __iter__(self):
        return iter([*self._values, *(self._pending[0] if self._pending is not None else ())])

    def __len__(self) -> int:
        return len(self._values) + (len(self._pending[0]) if self._pending is not None else 0)


class Hook:
    def after_step(self, trainer, logs: dict) -> None:
        """`logs`: the step's loss terms, grad_norm, lr, step_time and samples_per_s."""

    def after_train(self, trainer) -> Optional[dict]:
        return None


def is_due(trainer, period: int) -> bool:
    """Every `period` optimizer steps (never when period <= 0) and at the last step."""
    step = trainer.step
    return step == trainer.cfg.train.max_steps or (period > 0 and step % period == 0)


class MetricsWriter:
    """metrics.jsonl plus tensorboard events in the run directory (rank 0 only). The tensorboard writer is made at
    the first record: its import (tensorboard, protobuf, fsspec) comes after the first step."""

    def __init__(self, out_dir: Path, resume_step: Optional[int]):
        self.path = out_dir / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            # drop records past the resumed checkpoint so the file reads as one continuous run
            kept = [
                ln
                for ln in self.path.read_text().splitlines()
                if ln and json.loads(ln)["step"] <= resume_step
            ]
            self.path.write_text("".join(ln + "\n" for ln in kept))
        self.tb_dir, self.resume_step = out_dir / "tensorboard", resume_step
        self._tb = None

    @property
    def tb(self):
        """The tensorboard SummaryWriter (made on first use; events past `resume_step` are purged)."""
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.tb_dir), purge_step=self.resume_step)
        return self._tb

    def write(self, kind: str, step: int, values: dict) -> None:
        record = {"kind": kind, "step": step, **values}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for k, v in _flatten(values):
            self.tb.add_scalar(f"{kind}/{k}", v, step)

    def add_image(self, tag: str, image: np.ndarray, step: int) -> None:
        """`image`: H x W x 3 uint8."""
        self.tb.add_image(tag, image, step, dataformats="HWC")

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def _flatten(values: dict, prefix: str = ""):
    for k, v in values.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}/")
        elif isinstance(v, (int, float)):
            yield f"{prefix}{k}", v


class LogHook(Hook):
    """A "train" record every `period` steps, with `elapsed`: seconds since `started` (time.perf_counter() when
    train() was called, so the record shows the time to the first step, start-up included). After the first step
    also a "startup" record: {"phases": the trainer's start-up phases, each the seconds since train() was called
    when it ended, "first_step_detail": the parts of the first step, each its own seconds (with train.cuda_graph: the
    warm-up steps and the capture; else empty)}. Reading the step's loss terms waits for the step (StepLogs): only at
    the period. A "train" record also holds "host": the trainer's take_host_split() since the previous record."""

    def __init__(self, period: int, writer: MetricsWriter, started: float):
        self.period, self.writer, self.started = period, writer, started
        self.startup_written = False

    def after_step(self, trainer, logs) -> None:
        if not self.startup_written:
            graph_step = getattr(trainer, "graph_step", None)
            detail = graph_step.setup_seconds if graph_step is not None else {}
            startup = {
                "phases": dict(getattr(trainer, "phases", {})),
                "first_step_detail": {k: round(v, 3) for k, v in detail.items()},
            }
            self.writer.write("startup", trainer.step, startup)
            self.startup_written = True
        if is_due(trainer, self.period):
            record = {**logs, "elapsed": time.perf_counter() - self.started}
            if hasattr(trainer, "take_host_split"):
                record["host"] = trainer.take_host_split()
            self.writer.write("train", trainer.step, record)

    def after_train(self, trainer) -> None:
        self.writer.close()


def detection_curve_point(summary: dict) -> dict:
    """What the metrics file keeps of a detection evaluation (lss.engine.detection_eval.summarize): mAP, NDS, the
    vehicle classes' mAP and NDS and every class's AP."""
    vehicles = summary.get("vehicles", {})
    return {
        "mAP": summary["mAP"],
        "NDS": summary["NDS"],
        "vehicle_mAP": vehicles.get("mAP"),
        "vehicle_NDS": vehicles.get("NDS"),
        "AP": {n: row["AP"] for n, row in summary["per_class"].items()},
    }


class EvalHook(Hook):
    """`eval_function()` (returning lss.engine.eval.evaluate's dict) every `period` steps and at the end; best.pt
    follows the mean IoU. Every rank runs it (evaluation sums over ranks); only rank 0 has a `writer`.
    `prepare()` (EvalPasses.arm) starts the next evaluation's data ahead: after the run's first step and after
    each evaluation but the last."""

    def __init__(
        self,
        period: int,
        eval_function: Callable[[], dict],
        writer: Optional[MetricsWriter] = None,
        prepare: Optional[Callable[[], None]] = None,
    ):
        self.period, self.eval_function, self.writer, self.prepare = (
            period,
            eval_function,
            writer,
            prepare,
        )
        self.last: dict = {}
        self._prepared = False

    def after_step(self, trainer, logs: dict) -> None:
        due = is_due(trainer, self.period)
        if due:
            self._evaluate(trainer)
        if (
            self.prepare is not None
            and (due or not self._prepared)
            and trainer.step < trainer.cfg.train.max_steps
        ):
            self._prepared = True
            self.prepare()

    def _evaluate(self, trainer) -> None:
        result = self.eval_function()
        self.last = result
        if self.writer is not None:
            values = {"iou": result["iou"], "mean_iou": result["mean_iou"]}
            if "timing" in result:
                values["timing"] = result["timing"]
            if "detection" in result:
                values["detection"] = detection_curve_point(result["detection"])
            self.writer.write("val", trainer.step, values)
            tqdm.write(
                f"step {trainer.step}: val IoU "
                + ", ".join(f"{c} {100 * v:.2f}" for c, v in result["iou"].items())
            )
        best = trainer.state.get("best_iou")
        if best is None or result["mean_iou"] > best:
            trainer.state["best_iou"] = result["mean_iou"]
            trainer.state["best_step"] = trainer.step
            trainer.save("best.pt")

    def after_train(self, trainer) -> dict:
        return {"val": self.last} if self.last else {}


class CheckpointHook(Hook):
    """last.pt every `period` steps and at the end."""

    def __init__(self, period: int):
        self.period = period

    def after_step(self, trainer, logs: dict) -> None:
        if is_due(trainer, self.period):
            trainer.save("last.pt")

    def after_train(self, trainer) -> dict:
        return {
            "step": trainer.step,
            "best_iou": trainer.state.get("best_iou"),
            "best_step": trainer.state.get("best_step"),
        }


class VizHook(Hook):
    """The picture of `picture_function()` (H x W x 3 uint8) into tensorboard every `period` steps and at the end."""

    def __init__(
        self,
        period: int,
        picture_function: Callable[[], np.ndarray],
        writer: MetricsWriter,
        tag: str = "val/bev_prediction",
    ):
        self.period, self.picture_function, self.writer, self.tag = (
            period,
            picture_function,
            writer,
            tag,
        )

    def after_step(self, trainer, logs: dict) -> None:
        if is_due(trainer, self.period):
            self.writer.add_image(self.tag, self.picture_function(), trainer.step)
