"""`train.compile_start: background`: train uncompiled steps at once while a child process compiles the same model.

Compiling configs/synthetic.yaml's model costs 72-139 s on a first run on an H100, almost all of it Inductor's own
Python work on one core (docs/benchmarks.md); a run that compiles first trains nothing meanwhile. Here the run's first
batch goes to a child process that builds the same model and optimizer, compiles them as the trainer does and runs one
training step on that batch. That fills torch's compiler caches on disk (Inductor's FX graph cache, the AOTAutograd
cache, the Triton kernels), which both processes share. When the child reports success the trainer compiles its own
modules, now from those caches (`switch`), and captures its step again. The compiled kernels compute the same step
in another order, so the losses after the switch differ from an uncompiled run's in the last bits.

The functions here take the trainer (lss.engine.train.Trainer), as hooks do. The child runs no code of the trainer's
loop: it needs the model function, the config and one batch, all passed by pickle to a spawned interpreter (a model
function must therefore be importable, as build_model is). A failed child leaves the run uncompiled, with a message;
a run that ends first stops the child.
"""

from __future__ import annotations

import sys
import time
from typing import Optional

import torch
from tqdm import tqdm

from lss.config import Config, ConfigError
from lss.engine.build import (
    ModelFn,
    apply_channels_last,
    autocast_dtype,
    build_autocast,
    build_optimizer,
    compile_encoders,
    seed_everything,
)
from lss.engine.graph_step import GraphedTrainStep
from lss.engine.losses import TotalLoss


def wanted(cfg: Config, device: torch.device, distributed: bool) -> bool:
    """Whether the trainer compiles in a child process (train.compile_start): "background" wherever the run has one
    process, "auto" on one CUDA process (on a CPU the child would take the cores the steps need), "now" never."""
    t = cfg.train
    if not t.compile or t.compile_start == "now":
        return False
    if distributed:
        if t.compile_start == "background":
            raise ConfigError(
                "train.compile_start: background needs a run of one process (every DDP process would "
                "have to switch at the same step); set train.compile_start: now (or auto) with torchrun"
            )
        return False
    return t.compile_start == "background" or device.type == "cuda"


# The switch costs the run 17-20 s (this process compiles from the caches and captures its step again) and the compiled
# step took 0.58x the time of the uncompiled one (configs/synthetic.yaml, NVIDIA H100, docs/benchmarks.md): it pays
# back after about 45 s of uncompiled steps. Below this many seconds left, the run stays uncompiled.
SWITCH_PAYS_AFTER_S = 60.0


def start(trainer, batch: dict) -> None:
    """Start the child that compiles the trainer's model on `batch`; compile here and now instead where the model
    function cannot be sent to a child."""
    trainer.compile_later = False
    try:
        trainer.background = BackgroundCompile(
            trainer.cfg, trainer.model_fn, batch, trainer.device, trainer.graph_step is not None
        )
    except Exception as e:  # noqa: BLE001 - pickling errors differ by object: a lambda, a local function...
        tqdm.write(
            f"lss: the model function cannot go to a compile process ({type(e).__name__}: {e}); compiling "
            "before the first step instead"
        )
        trainer.compile()


def seconds_left(trainer) -> float:
    """The run's remaining seconds at its pace since the first step (evaluations included); right after the first
    step, at the pace of the first step."""
    elapsed = time.perf_counter() - trainer.started
    first = trainer.phases.get("first_step")
    if trainer.step > 1 and first is not None:
        pace = (elapsed - first) / (trainer.step - 1)
    else:
        pace = elapsed / max(trainer.step, 1)
    return (trainer.cfg.train.max_steps - trainer.step) * pace


def switch(trainer) -> None:
    """Once the child is done: compile the trainer's modules, now from the compiler's caches, and capture its step
    again at the next step (the old graph's memory goes with it), where the rest of the run is long enough to pay
    for that (SWITCH_PAYS_AFTER_S); a failed child leaves the steps uncompiled."""
    ok, words = trainer.background.poll()
    trainer.background = None
    if not ok:
        tqdm.write(f"lss: the background compilation failed ({words}); training goes on uncompiled")
        return
    left = seconds_left(trainer)
    if left < SWITCH_PAYS_AFTER_S:
        tqdm.write(
            f"lss: the compile process {words}, but the run has about {left:.0f} s of steps left, less than "
            f"the {SWITCH_PAYS_AFTER_S:.0f} s a switch to compiled steps needs to pay off: the steps stay "
            "uncompiled (the compiler caches on disk now hold the model for the next run)"
        )
        return
    trainer.check_last_step()  # reads the old graph's outputs before the graph goes
    trainer.compile()
    if trainer.graph_step is not None:
        trainer.graph_step = trainer.new_graph_step()
    trainer.mark("compiled")
    tqdm.write(f"lss: compiled steps from step {trainer.step + 1} (the compile process {words})")


def stop(trainer) -> None:
    """At the end of training: stop a child that is still compiling."""
    if trainer.background is not None:
        ran = trainer.background.stop()
        trainer.background = None
        print(
            f"lss: training ended before the background compilation was done ({ran:.0f} s in); it was stopped",
            file=sys.stderr,
        )


class BackgroundCompile:
    """The child process of one run: `poll()` says whether it is done, `stop()` ends it."""

    def __init__(
        self, cfg: Config, model_fn: ModelFn, batch: dict, device: torch.device, captured: bool
    ):
        # the child gets copies: pickling a tensor for another process moves its storage into shared memory
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
        """None while the child compiles; then (succeeded, what happened in words). Costs one select() call."""
        if self.result is None:
            if self._receive.poll():
                try:
                    self.result = self._receive.recv()
                except EOFError:
                    self.result = (
                        False,
                        f"the compile process ended with exit code {self.process.exitcode}",
                    )
                self.process.join(timeout=10)
            elif not self.process.is_alive():
                self.result = (
                    False,
                    f"the compile process ended with exit code {self.process.exitcode} and no word",
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
    """The child's work: the trainer's model, optimizer and compiler settings, one compiled step on `batch` (as the
    captured step's warm-up runs it where the trainer captures, else as the eager step). Sends (ok, words)."""
    started = time.perf_counter()
    # pickle names an object such as torch.contiguous_format by the first module in sys.modules that reaches it, and
    # the compiler's cache keys are such pickles: a main script that imports torch is first here (as __mp_main__, the
    # parent skips its __main__), which would give the child other keys than the parent. Last, it reaches nothing first.
    if "__mp_main__" in sys.modules:
        sys.modules["__mp_main__"] = sys.modules.pop("__mp_main__")
    try:
        t = cfg.train
        device = torch.device(device_name)
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)
        seed_everything(
            t.seed, t.deterministic, t.cudnn_benchmark
        )  # the global flags the compiler's cache keys see
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
    except BaseException as e:  # noqa: BLE001 - every failure is the parent's message, the run goes on uncompiled
        send.send((False, f"{type(e).__name__}: {e}"))
    finally:
        send.close()
