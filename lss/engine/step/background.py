"""`train.compile_start: background`: train uncompiled steps at once while a child process compiles
the same model.

Compiling a model costs Inductor minutes of its own Python work on one core (docs/benchmarks.md); a
run that compiles first trains nothing meanwhile. Here the run's first batch goes to a child process
that builds the same model and optimizer, compiles them as the run does and runs one training step
on that batch. That fills torch's compiler caches on disk (Inductor's FX graph cache, the
AOTAutograd cache, the Triton kernels), which both processes share. When the child reports success,
BackgroundCompileHook asks the run's CompiledStep to rebuild: it compiles its own modules, now from
those caches, and captures its step again. The compiled kernels compute the same step in another
order, so the losses after the switch differ from an uncompiled run's in the last bits.

The child runs no code of the trainer's loop: it needs the model function, the config and one batch,
all passed by pickle to a spawned interpreter (a model function must therefore be importable, as
build_model is). A failed child leaves the run uncompiled, with a message; a run that ends first
stops the child."""

from __future__ import annotations

import sys
import time
from typing import Optional

import torch
from tqdm import tqdm

from lss.config import Config
from lss.engine.distributed import autocast_dtype, build_autocast, seed_everything
from lss.engine.optim import build_optimizer
from lss.models.build import ModelFn, apply_channels_last
from lss.engine.hooks import Hook
from lss.models.losses import TotalLoss
from lss.engine.step.compiled import CompiledStep, compile_encoders
from lss.engine.step.graph import GraphedTrainStep

# The switch costs the run the compilation from the caches and a new capture, and a compiled step
# takes about half the time of an uncompiled one (docs/benchmarks.md): below this many seconds of
# steps left, the run stays uncompiled.
SWITCH_PAYS_AFTER_S = 60.0


class BackgroundCompileHook(Hook):
    """Starts the compile process on the run's first batch, polls it after every step (one select()
    call) and, once it is done, asks `step` to rebuild over compiled modules where the rest of the
    run is long enough to pay for the switch (SWITCH_PAYS_AFTER_S); a failed child leaves the steps
    uncompiled. Where the model function cannot be sent to a child, the step compiles before the
    first step instead."""

    def __init__(
        self,
        step: CompiledStep,
        cfg: Config,
        model_fn: ModelFn,
        device: torch.device,
        captured: bool,
    ):
        self.step, self.cfg, self.model_fn, self.device = step, cfg, model_fn, device
        self.captured = captured
        self.child: Optional[BackgroundCompile] = None
        self.started = False
        self._first: Optional[tuple[int, float, float]] = None  # step, its start, its end

    def before_step(self, trainer, batches: list[dict]) -> None:
        if self.started:
            return
        self.started = True
        self._first = (trainer.step + 1, time.perf_counter(), 0.0)
        try:
            self.child = BackgroundCompile(
                self.cfg, self.model_fn, batches[0], self.device, self.captured
            )
        except Exception as e:  # noqa: BLE001 - pickling errors differ: a lambda, a closure...
            tqdm.write(
                f"lss: the model function cannot go to a compile process ({type(e).__name__}: "
                f"{e}); compiling before the first step instead"
            )
            self.step.rebuild()

    def after_step(self, trainer, logs) -> None:
        first_step, first_start, first_end = self._first
        if not first_end:
            self._first = (first_step, first_start, time.perf_counter())
        if self.child is None or self.child.poll() is None:
            return
        ok, words = self.child.poll()
        self.child = None
        if not ok:
            tqdm.write(
                f"lss: the background compilation failed ({words}); training goes on uncompiled"
            )
            return
        left = self.seconds_left(trainer.step, trainer.cfg.train.max_steps)
        if left < SWITCH_PAYS_AFTER_S:
            tqdm.write(
                f"lss: the compile process {words}, but the run has about {left:.0f} s of steps "
                f"left, less than the {SWITCH_PAYS_AFTER_S:.0f} s a switch to compiled steps needs "
                "to pay off: the steps stay uncompiled (the compiler caches on disk now hold the "
                "model for the next run)"
            )
            return
        self.step.rebuild()
        tqdm.write(
            f"lss: compiled steps from step {trainer.step + 1} (the compile process {words})"
        )

    def seconds_left(self, step: int, max_steps: int) -> float:
        """The run's remaining seconds at its pace since its first step (evaluations included);
        right after the first step, at the pace of that step."""
        first_step, first_start, first_end = self._first
        now = time.perf_counter()
        if step > first_step:
            pace = (now - first_end) / (step - first_step)
        else:
            pace = now - first_start
        return (max_steps - step) * pace

    def close(self) -> None:
        """Stop a child that is still compiling (the run has ended)."""
        if self.child is not None:
            ran = self.child.stop()
            self.child = None
            print(
                f"lss: training ended before the background compilation was done ({ran:.0f} s in); "
                "it was stopped",
                file=sys.stderr,
            )


class BackgroundCompile:
    """The child process of one run: `poll()` says whether it is done, `stop()` ends it."""

    def __init__(
        self, cfg: Config, model_fn: ModelFn, batch: dict, device: torch.device, captured: bool
    ):
        # the child gets copies: a tensor pickled for another process moves into shared memory
        batch = {k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()}
        context = torch.multiprocessing.get_context("spawn")
        self._receive, send = context.Pipe(duplex=False)
        self.process = context.Process(
            target=compile_in_child,
            name="lss-compile",
            args=(cfg, model_fn, batch, str(device), captured, send),
        )
        self.started = time.perf_counter()
        self.process.start()
        send.close()
        self.result: Optional[tuple[bool, str]] = None

    def poll(self) -> Optional[tuple[bool, str]]:
        """None while the child compiles; then (succeeded, what happened in words). Costs one
        select()."""
        if self.result is None:
            if self._receive.poll():
                try:
                    self.result = self._receive.recv()
                except EOFError:
                    code = self.process.exitcode
                    self.result = (False, f"the compile process ended with exit code {code}")
                self.process.join(timeout=10)
            elif not self.process.is_alive():
                code = self.process.exitcode
                self.result = (
                    False,
                    f"the compile process ended with exit code {code} and no word",
                )
        return self.result

    def wait(self, timeout: float) -> Optional[tuple[bool, str]]:
        """poll() after waiting up to `timeout` seconds for the child's word."""
        if self.result is None:
            self._receive.poll(timeout)
        return self.poll()

    def stop(self) -> float:
        """End the child if it still runs; returns the seconds it ran."""
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        self._receive.close()
        return time.perf_counter() - self.started


def compile_in_child(
    cfg: Config, model_fn: ModelFn, batch: dict, device_name: str, captured: bool, send
) -> None:
    """The child's work: the run's model, optimizer and compiler settings, one compiled step on
    `batch` (as the captured step's warm-up runs it where the run captures, else as the eager step).
    Sends (ok, words)."""
    started = time.perf_counter()
    # pickle names an object such as torch.contiguous_format by the first module in sys.modules that
    # reaches it, and the compiler's cache keys are such pickles: a main script that imports torch
    # is first here (as __mp_main__; the parent skips its __main__), which would give the child
    # other keys than the parent. Last, it reaches nothing first.
    if "__mp_main__" in sys.modules:
        sys.modules["__mp_main__"] = sys.modules.pop("__mp_main__")
    try:
        t = cfg.train
        device = torch.device(device_name)
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)
        # the global flags the compiler's cache keys see
        seed_everything(t.seed, t.deterministic, t.cudnn_benchmark)
        model = model_fn(cfg).to(device)
        apply_channels_last(model, t.channels_last)
        loss_fn = TotalLoss(cfg).to(device)
        optimizer = build_optimizer(cfg, model)
        amp_dtype = autocast_dtype(cfg, device)
        compile_encoders(model, t.compile_mode, t.compile_memory_budget)
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        model.train()
        if captured:
            GraphedTrainStep(
                model, loss_fn, optimizer, amp_dtype, cfg.optim.grad_clip, warmup=1, capture=False
            )(batch)
        else:
            with build_autocast(cfg, device)():
                outputs = model(batch)
            loss_fn(outputs, batch)["loss"].backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        send.send((True, f"compiled in {time.perf_counter() - started:.1f} s"))
    # every failure becomes the parent's message; the run goes on
    except BaseException as e:  # noqa: BLE001
        send.send((False, f"{type(e).__name__}: {e}"))
    finally:
        send.close()
