"""Hooks around the trainer's run_step: host timing, metrics, evaluation, checkpoints and pictures.
Hooks that need more than the trainer's own state receive callables (an evaluation function, a
picture function), so the engine does not depend on what computes them.

A hook sees the trainer (lss.engine.train.Trainer: step, cfg, device, model, state, save) before and
after every optimizer step and once after training; what `after_train` returns goes into train()'s
final metrics."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from tqdm import tqdm


class Hook:
    def before_step(self, trainer, batches: list[dict]) -> None:
        """`batches`: the step's micro-batches (host memory), fetched and not yet run."""

    def after_step(self, trainer, logs: dict) -> None:
        """`logs`: the step's loss terms, grad_norm, lr, step_time and samples_per_s."""

    def after_train(self, trainer) -> Optional[dict]:
        return None

    def close(self) -> None:
        """Release what the hook holds; runs when training ends, also with an error."""


class StepTimer(Hook):
    """The loop's clock (register it first: it adds step_time and samples_per_s to the logs the
    later hooks read). `phases`: each start-up phase's end in seconds since `started`
    (time.perf_counter() when train() was called): train() marks its own, this hook "first_batch"
    and "first_step" (after a device synchronize). `first_step_detail`: the step's own split of its
    first call (its setup_seconds)."""

    def __init__(self, started: Optional[float] = None):
        self.started = time.perf_counter() if started is None else started
        self.phases: dict[str, float] = {}
        self.first_step_detail: dict[str, float] = {}
        self._fetch_s = self._wait_s = 0.0  # host seconds since the last take_host_split
        self._split_since, self._split_step = time.perf_counter(), 0

    def mark(self, phase: str, at: Optional[float] = None) -> None:
        """Note the end of start-up phase `phase` (default: now) in seconds since `started`."""
        end = time.perf_counter() if at is None else at
        self.phases[phase] = round(end - self.started, 3)

    def after_step(self, trainer, logs) -> None:
        host = logs.host
        if "first_step" not in self.phases:
            if trainer.device.type == "cuda":
                torch.cuda.synchronize(trainer.device)
            self.mark("first_batch", host["fetched"])
            self.mark("first_step")
            self.first_step_detail = {
                k: round(v, 3) for k, v in trainer.train_step.setup_seconds.items()
            }
            self.take_host_split(trainer.step)  # the split covers the steps after the first
            step_time = time.perf_counter() - host["start"]
        else:
            self._fetch_s += host["fetched"] - host["start"]
            self._wait_s += host["wait"]
            step_time = host["ran"] - host["start"]
        t = trainer.cfg.train
        samples = t.batch_size * t.grad_accum * trainer.dist.world_size
        logs.add(step_time=step_time, samples_per_s=samples / step_time)

    def take_host_split(self, step: int) -> dict:
        """Where the loop's host time went since the last call, in mean ms per step: "fetch_ms"
        waiting for the loader's next batch, "wait_ms" waiting for the device in a deferred loss
        check (the captured step), "other_ms" everything else (the batch's copy, launches, logging,
        hooks). Resets the sums."""
        now = time.perf_counter()
        steps = step - self._split_step
        split = {}
        if steps > 0:
            total = now - self._split_since
            split = {
                "fetch_ms": 1e3 * self._fetch_s / steps,
                "wait_ms": 1e3 * self._wait_s / steps,
                "other_ms": 1e3 * (total - self._fetch_s - self._wait_s) / steps,
            }
        self._fetch_s = self._wait_s = 0.0
        self._split_since, self._split_step = now, step
        return split


def is_due(trainer, period: int) -> bool:
    """Every `period` optimizer steps (never when period <= 0) and at the last step."""
    step = trainer.step
    return step == trainer.cfg.train.max_steps or (period > 0 and step % period == 0)


class MetricsWriter:
    """metrics.jsonl plus tensorboard events in the run directory (rank 0 only). The tensorboard
    writer is made at the first record: its import (tensorboard, protobuf, fsspec) comes after the
    first step."""

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
        """The tensorboard SummaryWriter (made on first use; events past `resume_step` are
        purged)."""
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
    """A "train" record every `period` steps, with `elapsed`: seconds since the timer's start (when
    train() was called, so the record shows the time to the first step, start-up included) and
    "host": the timer's take_host_split() since the previous record. After the first step also a
    "startup" record: {"phases": the timer's start-up phases, "first_step_detail": the parts of the
    first step, each its own seconds (the captured step's warm-up steps and capture; else empty)}.
    Reading the step's loss terms waits for the step (StepLogs): only at the period. Runs after the
    timer (StepTimer)."""

    def __init__(self, period: int, writer: MetricsWriter, timer: StepTimer):
        self.period, self.writer, self.timer = period, writer, timer
        self.startup_written = False

    def after_step(self, trainer, logs) -> None:
        if not self.startup_written:
            startup = {
                "phases": dict(self.timer.phases),
                "first_step_detail": dict(self.timer.first_step_detail),
            }
            self.writer.write("startup", trainer.step, startup)
            self.startup_written = True
        if is_due(trainer, self.period):
            record = {**logs, "elapsed": time.perf_counter() - self.timer.started}
            record["host"] = self.timer.take_host_split(trainer.step)
            self.writer.write("train", trainer.step, record)

    def after_train(self, trainer) -> None:
        self.writer.close()


def detection_curve_point(summary: dict) -> dict:
    """What the metrics file keeps of a detection evaluation (lss.engine.detection_eval.summarize):
    mAP, NDS, the vehicle classes' mAP and NDS and every class's AP."""
    vehicles = summary.get("vehicles", {})
    return {
        "mAP": summary["mAP"],
        "NDS": summary["NDS"],
        "vehicle_mAP": vehicles.get("mAP"),
        "vehicle_NDS": vehicles.get("NDS"),
        "AP": {n: row["AP"] for n, row in summary["per_class"].items()},
    }


class EvalHook(Hook):
    """`eval_function()` (returning lss.engine.eval.evaluate's dict) every `period` steps and at the
    end; best.pt follows the mean IoU. Every rank runs it (evaluation sums over ranks); only rank 0
    has a `writer`. `prepare()` (EvalPasses.arm) starts the next evaluation's data ahead: after the
    run's first step and after each evaluation but the last."""

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
    """The picture of `picture_function()` (H x W x 3 uint8) into tensorboard every `period` steps
    and at the end."""

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
