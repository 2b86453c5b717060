"""`lss train`: a short run_step (batch -> loss -> backward -> step) with hooks around it for logging, evaluation,
checkpoints and BEV pictures. Single process or `torchrun --nproc_per_node=K -m lss train ...` (DDP)."""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset
from tqdm import tqdm

from lss.config import Config, ConfigError, config_to_dict, save_config
from lss.data import collate
from lss.engine import checkpoint as ckpt_io
from lss.engine.build import (
    DatasetFn,
    ModelFn,
    apply_channels_last,
    autocast_dtype,
    build_autocast,
    build_dataset,
    build_eval_loader,
    build_loader,
    build_model,
    build_optimizer,
    build_scheduler,
    compile_encoders,
    device_type,
    ensure_dataset,
    lr_factor,
    preserved_rng,
    rng_state,
    seed_everything,
    select_device,
    set_rng_state,
    StreamSampler,
    to_device,
    uncompiled,
)
from lss.engine import background_compile
from lss.engine.distributed import DistInfo, EpochSampler, init_distributed, shutdown
from lss.engine.eval import EvalPasses, evaluate
from lss.engine.graph_step import GraphedTrainStep, decide_cuda_graph
from lss.engine.hooks import (
    CheckpointHook,
    EvalHook,
    Hook,
    LogHook,
    MetricsWriter,
    StepLogs,
    VizHook,
    is_due,
)
from lss.engine.losses import TotalLoss, check_depth_targets
from lss.engine.run_dir import check_run_dir, clear_run

# probs, targets (B x K x nx x ny, CPU), class names -> H x W x 3 uint8 picture (lss.viz.bev_grid_image)
RenderFn = Callable[[torch.Tensor, torch.Tensor, Sequence[str]], np.ndarray]

RESUME_HINT = "lss train (the same --config/--set) --out {} --resume"


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during training; the message says which checkpoint is on disk and how to continue."""


# --------------------------------------------------------------------------------------------------- trainer
class Trainer:
    """Holds the model, optimizer and data stream; `run_step` does one optimizer step, hooks do the rest."""

    def __init__(
        self,
        cfg: Config,
        model: nn.Module,
        train_set: Dataset,
        val_set: Optional[Dataset],
        out_dir: Path,
        device: torch.device,
        dist_info: DistInfo,
        collate_fn: Callable = collate,
        model_fn: Optional[ModelFn] = None,
    ):
        """`model_fn`, the function that built `model`, lets train.compile_start compile in the background."""
        self.cfg, self.out_dir, self.device, self.dist = cfg, out_dir, device, dist_info
        t = cfg.train
        self.model = model.to(device)
        apply_channels_last(self.model, t.channels_last)
        self.loss_fn = TotalLoss(cfg).to(device)
        self.optimizer = build_optimizer(cfg, self.model)
        self.scheduler = build_scheduler(cfg, self.optimizer)
        self.amp_dtype = autocast_dtype(cfg, device)
        self.autocast = build_autocast(cfg, device)
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.amp_dtype == torch.float16)
        self.model_fn, self.background = (
            model_fn,
            None,
        )  # background: the compiling child (compile_start)
        self.compile_later = model_fn is not None and background_compile.wanted(
            cfg, device, dist_info.enabled
        )
        if t.compile and not self.compile_later:
            self.compile()
        captured, self.eager_because = decide_cuda_graph(cfg, device, dist_info.enabled)
        self.graph_step = self.new_graph_step() if captured else None
        self.net = self.model
        if dist_info.enabled:
            ids = [device.index] if device.type == "cuda" else None
            self.net = DistributedDataParallel(self.model, device_ids=ids)
        epochs = EpochSampler(
            len(train_set),
            shuffle=True,
            seed=t.seed,
            rank=dist_info.rank,
            world_size=dist_info.world_size,
        )
        self.batches_per_epoch = epochs.per_rank // t.batch_size
        if self.batches_per_epoch == 0:
            raise ConfigError(
                f"the train split has {len(train_set)} samples, fewer than train.batch_size="
                f"{t.batch_size} per process ({dist_info.world_size} processes); lower the batch size"
            )
        self.train_sampler = StreamSampler(epochs, t.batch_size)
        self.train_loader = build_loader(
            cfg,
            train_set,
            self.train_sampler,
            t.batch_size,
            True,
            device,
            t.seed,
            collate_fn=collate_fn,
        )
        self.val_loader = None
        if val_set is not None and len(val_set) > 0:
            self.val_loader = build_eval_loader(
                cfg, val_set, device, dist_info, collate_fn, persistent=True
            )
        self.val_passes = EvalPasses(self.val_loader) if self.val_loader is not None else None
        self.step = 0
        self.epoch = 0
        self.state: dict = {"best_iou": None}  # hook state that a checkpoint carries
        self.saved: dict[str, int] = {}  # checkpoint name -> step of the file on disk
        self.hooks: list[Hook] = []
        self.phases: dict[
            str, float
        ] = {}  # start-up phase -> seconds since train() was called (LogHook writes them)
        self.started = time.perf_counter()
        self._unchecked: Optional[tuple[int, StepLogs]] = (
            None  # the captured step's last values, not yet checked
        )
        self._fetch_s = self._wait_s = (
            0.0  # host seconds since the last take_host_split (see there)
        )
        self._split_since, self._split_step = time.perf_counter(), 0
        self._writer = ckpt_io.CheckpointWriter()

    def register_hooks(self, hooks: Sequence[Hook]) -> None:
        """Hooks run in the order given, after every step and once after training."""
        self.hooks.extend(hooks)

    def mark(self, phase: str) -> None:
        """Note the seconds since train() was called at the end of start-up phase `phase`."""
        self.phases[phase] = round(time.perf_counter() - self.started, 3)

    # -- the data stream: epoch/offset follow from the step, so a resumed run sees the same batches
    def batches(self) -> Iterator[dict]:
        """Host batches (pinned when training on CUDA) from the current step on, across epochs. The loader's
        workers start, and begin to prefetch, when this is called."""
        micro = self.step * self.cfg.train.grad_accum
        epoch, offset = divmod(micro, self.batches_per_epoch)
        self.epoch = epoch
        self.train_sampler.set_start(epoch, offset * self.cfg.train.batch_size)
        self.train_loader.generator.manual_seed(self.cfg.train.seed * 100_003 + epoch)
        loader = self._train_iter = iter(self.train_loader)

        def stream() -> Iterator[dict]:
            for n, batch in enumerate(loader, micro):
                self.epoch = n // self.batches_per_epoch
                yield batch

        return stream()

    def compile(self) -> None:
        """Compile the model's trainable parts in place (train.compile_mode, train.compile_memory_budget)."""
        compile_encoders(
            self.model, self.cfg.train.compile_mode, self.cfg.train.compile_memory_budget
        )

    def new_graph_step(self) -> GraphedTrainStep:
        return GraphedTrainStep(
            self.model,
            self.loss_fn,
            self.optimizer,
            self.amp_dtype,
            self.cfg.optim.grad_clip,
            check_batch=self._check_batch,
        )

    def _check_batch(self, batch: dict) -> None:
        """Host-side checks of a batch for the captured step (which cannot sync inside)."""
        splat = getattr(self.model, "splat", None)
        if "depth_targets" in batch and splat is not None:
            check_depth_targets(batch["depth_targets"], splat.depth_bins)

    def run_step(self, micro_batches: list[dict]) -> dict:
        """One optimizer step over `micro_batches` (gradient accumulation); returns the mean loss terms."""
        if (
            not self.model.training
        ):  # Module.train() walks every submodule: about 1 ms per step on a GPU machine
            self.net.train()
        if self.graph_step is not None:
            return self._run_graph_step(micro_batches[0])
        totals = self._forward_backward([to_device(b, self.device) for b in micro_batches])
        loss = float(totals["loss"])
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"loss is {loss} at step {self.step + 1}; lower optim.lr, check the data, or "
                "resume from the last good checkpoint"
            )
        grad_norm = self._optimizer_step()
        self.step += 1
        return StepLogs(**{k: float(v) for k, v in totals.items()}, grad_norm=float(grad_norm))

    def _forward_backward(self, micro_batches: list[dict]) -> dict:
        """Gradients of the mean loss over `micro_batches`; returns the mean loss terms (over all ranks)."""
        totals: dict = {}
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            sync = (
                self.net.no_sync() if self.dist.enabled and not last else contextlib.nullcontext()
            )
            with sync:
                with self.autocast():
                    outputs = self.net(batch)
                losses = self.loss_fn(outputs, batch)
                self.scaler.scale(losses["loss"] / len(micro_batches)).backward()
            for k, v in losses.items():
                totals[k] = totals.get(k, 0.0) + v.detach() / len(micro_batches)
        if (
            self.dist.enabled
        ):  # log the global batch's mean, and let every rank see a non-finite loss together
            names = sorted(totals)
            stacked = torch.stack(
                [torch.as_tensor(totals[k], device=self.device, dtype=torch.float32) for k in names]
            )
            torch.distributed.all_reduce(stacked)
            totals = dict(zip(names, stacked / self.dist.world_size))
        return totals

    def _optimizer_step(self) -> torch.Tensor:
        """Unscale, clip (optim.grad_clip), step, schedule; returns the gradient norm before clipping."""
        self.scaler.unscale_(self.optimizer)
        clip = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return grad_norm

    def _run_graph_step(self, batch: dict) -> StepLogs:
        """Queue the batch's copy and the replay, then check the previous step's loss: the host waits for that step
        while this one is queued behind it, so the device never waits for the host's launch, and the host prepares
        the next batch while the device runs this step."""
        self.graph_step.load(batch)
        logs = StepLogs(self.graph_step.replay())
        self.scheduler.step()
        self.step += 1
        self.check_last_step()
        self._unchecked = (self.step, logs)
        return logs

    def close(self) -> None:
        """Stop the loaders' workers now. Left to interpreter exit, each persistent worker of a pinning loader is
        joined with a 5 s timeout (pytorch/pytorch#81794): minutes for 2 x 12 workers after the run is done. Waits
        for the checkpoint writes in flight (a failed one is reported on stderr: another error is on its way)."""
        self.finish_checkpoints(report_only=True)
        background_compile.stop(self)
        iterators = [
            getattr(self, "_train_iter", None),
            getattr(self.val_loader, "_iterator", None),
        ]
        for iterator in iterators:
            if iterator is not None and hasattr(
                iterator, "_shutdown_workers"
            ):  # single-process ones have none
                iterator._shutdown_workers()
        self._train_iter = None
        if self.val_loader is not None:
            self.val_loader._iterator = None

    def check_last_step(self) -> None:
        """FloatingPointError when the last captured step's loss was not finite (before any later update)."""
        if self._unchecked is None:
            return
        step, logs = self._unchecked
        self._unchecked = None
        waited = time.perf_counter()
        loss = logs["loss"]  # waits for that step
        self._wait_s += time.perf_counter() - waited
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"loss is {loss} at step {step} (train.cuda_graph: the updates of this step "
                "and at most one more were applied; the checkpoints on disk predate them); "
                "lower optim.lr, check the data, or resume from the last good checkpoint"
            )

    def take_host_split(self) -> dict:
        """Where the loop's host time went since the last call, in mean ms per step: "fetch_ms" waiting for the
        loader's next batch, "wait_ms" waiting for the device in the captured step's loss check (train.cuda_graph),
        "other_ms" everything else (the batch's copy, launches, logging, hooks). Resets the sums."""
        now = time.perf_counter()
        steps = self.step - self._split_step
        split = {}
        if steps > 0:
            total = now - self._split_since
            split = {
                "fetch_ms": 1e3 * self._fetch_s / steps,
                "wait_ms": 1e3 * self._wait_s / steps,
                "other_ms": 1e3 * (total - self._fetch_s - self._wait_s) / steps,
            }
        self._fetch_s = self._wait_s = 0.0
        self._split_since, self._split_step = now, self.step
        return split

    def learning_rate(self) -> float:
        """The learning rate of the next step, from the host (the captured step keeps it in a device tensor)."""
        base = self.scheduler.base_lrs[0]
        return float(base) * lr_factor(self.cfg, self.scheduler.last_epoch)

    def fit(self, stream: Optional[Iterator[dict]] = None) -> dict:
        """Train to train.max_steps on `stream` (default: self.batches()); returns what the hooks report at the end.
        Host syncs: with train.cuda_graph one per step, for the loss check, after the next batch is ready."""
        t = self.cfg.train
        stream = stream if stream is not None else self.batches()
        bar = tqdm(
            total=t.max_steps,
            initial=self.step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            disable=not self.dist.is_main,
        )
        first = True
        try:
            while self.step < t.max_steps:
                start = time.perf_counter()
                micro_batches = [next(stream) for _ in range(t.grad_accum)]
                self._fetch_s += time.perf_counter() - start
                if first:
                    self.mark("first_batch")
                if self.compile_later:
                    background_compile.start(self, micro_batches[0])
                logs = self.run_step(micro_batches)
                if first:
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    self.mark("first_step")
                    self.take_host_split()  # the split covers the steps after the first (start-up has its record)
                    first = False
                step_time = time.perf_counter() - start
                logs.add(
                    step_time=step_time,
                    lr=self.learning_rate(),
                    samples_per_s=t.batch_size * t.grad_accum * self.dist.world_size / step_time,
                )
                bar.update(1)
                if any(
                    is_due(self, period)
                    for period in (t.log_every, t.ckpt_every, t.eval_every, t.viz_every)
                ):
                    self.check_last_step()  # hooks read, save or evaluate now: a NaN stops first, with its step
                if is_due(self, t.log_every):
                    bar.set_postfix(epoch=self.epoch, loss=f"{logs['loss']:.4f}")
                for hook in self.hooks:
                    hook.after_step(self, logs)
                if self.background is not None and self.background.poll() is not None:
                    background_compile.switch(self)
            self.check_last_step()
        finally:
            bar.close()
        self.finish_checkpoints()
        final: dict = {}
        for hook in self.hooks:
            final.update(hook.after_train(self) or {})
        return final

    def save(self, name: str) -> None:
        """checkpoints/`name` of the current step, on rank 0 (every rank checks the weights, so all stop together).
        Non-finite weights are never written, and a failed write leaves the previous file in place. Rank 0 copies
        the state to host memory here and writes the file in the background (ckpt_io.CheckpointWriter): a failed
        write raises at the next save or when training ends (`finish_checkpoints`)."""
        path = self.out_dir / "checkpoints" / name
        if not bool(
            torch.stack([p.detach().isfinite().all() for p in self.model.parameters()]).all()
        ):
            self.finish_checkpoints()  # the earlier writes: `saved` says what is on disk, and their error comes first
            raise FloatingPointError(
                f"weights are not finite after step {self.step}; {path} was not written and {self._on_disk(name)}"
                f"{' (the last good checkpoint is kept)' if name in self.saved else ''}. Lower optim.lr (now "
                f"{self.cfg.optim.lr:g}) or set optim.grad_clip, check the data, then {self._continue_hint()}"
            )
        if not self.dist.is_main:
            self.saved[name] = self.step
            return
        step = self.step
        state = ckpt_io.checkpoint_state(
            self.model,
            step,
            self.cfg,
            self.optimizer,
            self.scheduler,
            self.scaler,
            extra={"rng": rng_state(), "state": dict(self.state)},
            snapshot=True,
        )

        def failed(
            e: OSError,
        ) -> OSError:  # in the writer's thread, after the earlier writes: `saved` is current
            error = OSError(
                e.errno,
                f"{e.strerror or e} while writing {path}; {self._on_disk(name)}: free some "
                f"space, then {self._continue_hint()}",
            )
            error.__cause__ = e
            return error

        self._writer.submit(
            state, path, done=lambda: self.saved.__setitem__(name, step), failed=failed
        )

    def finish_checkpoints(self, report_only: bool = False) -> None:
        """Wait until the checkpoints saved so far are on disk; raise the error of a failed write (`report_only`:
        print it on stderr instead, where another error already ends the run)."""
        try:
            self._writer.wait()
        except Exception as e:  # noqa: BLE001 - any error of the writer's thread
            if not report_only:
                raise
            print(f"lss: {e}", file=sys.stderr)

    def _on_disk(self, name: str) -> str:
        """What checkpoints/`name` holds before this save, in words."""
        step = self.saved.get(name)
        if step is None:
            return f"no earlier {name} exists"
        return f"the previous {self.out_dir / 'checkpoints' / name} (step {step}) is intact"

    def _continue_hint(self) -> str:
        if "last.pt" in self.saved:
            return f"continue with `{RESUME_HINT.format(self.out_dir)}`"
        return "start again with --overwrite"

    def resume(self, path: Path) -> None:
        state = ckpt_io.load_checkpoint(path, map_location=self.device)
        ckpt_io.load_model_state(self.model, state, path)
        for name, obj in (
            ("optimizer", self.optimizer),
            ("scheduler", self.scheduler),
            ("scaler", self.scaler),
        ):
            if state.get(name) is None:
                raise ckpt_io.CheckpointError(
                    f"checkpoint {path} has no {name} state; it cannot be resumed "
                    "(start a new run from it instead)"
                )
            obj.load_state_dict(state[name])
        self.step = state["step"]
        self.state.update(state["extra"].get("state", {}))
        self.saved["last.pt"] = self.step
        self._adopt_best(path.parent / "best.pt")
        if "rng" in state["extra"]:
            set_rng_state(state["extra"]["rng"])

    def _adopt_best(self, path: Path) -> None:
        """last.pt is written before the evaluation of its step, so best.pt may hold a newer best than last.pt's
        state: take it when it comes from a step the resumed run has done."""
        if not path.is_file():
            return
        best = ckpt_io.load_checkpoint(path)
        if best["step"] > self.step:
            return
        self.saved["best.pt"] = best["step"]
        state = best["extra"].get("state", {})
        if state.get("best_step") is not None and state["best_step"] > (
            self.state.get("best_step") or -1
        ):
            self.state.update(best_iou=state["best_iou"], best_step=state["best_step"])


# ---------------------------------------------------------------------------------------------------- entry
def evaluation(trainer: Trainer) -> Callable[[], dict]:
    """The evaluation callable of EvalHook: lss.engine.eval.evaluate of the model on the val loader (with its
    "timing")."""

    def run() -> dict:
        timing: dict = {}
        with preserved_rng(), uncompiled(trainer.model):
            result = evaluate(
                trainer.model,
                trainer.val_loader,
                trainer.cfg,
                trainer.device,
                trainer.autocast,
                show_progress=trainer.dist.is_main,
                timing=timing,
                batches=trainer.val_passes.take(),
            )
        return {**result, "timing": timing}

    return run


def bev_pictures(trainer: Trainer, render_fn: RenderFn) -> Callable[[], np.ndarray]:
    """The picture callable of VizHook: `render_fn` of the predicted probabilities and the targets of the first
    validation batch."""
    batch: Optional[dict] = None

    def picture() -> np.ndarray:
        nonlocal batch
        with preserved_rng():
            if batch is None:
                batch = to_device(trainer.val_passes.first_batch(), trainer.device)
            trainer.model.eval()
            with torch.no_grad(), trainer.autocast(), uncompiled(trainer.model):
                logits = trainer.model(batch)["segmentation"].float()
        return render_fn(logits.sigmoid().cpu(), batch["targets"].cpu(), trainer.cfg.data.classes)

    return picture


def default_hooks(
    trainer: Trainer, writer: Optional[MetricsWriter], started: float, render_fn: Optional[RenderFn]
) -> list[Hook]:
    """Logging, checkpoints, evaluation and pictures at the train.*_every periods (writers on rank 0 only)."""
    t = trainer.cfg.train
    hooks: list[Hook] = [LogHook(t.log_every, writer, started)] if writer is not None else []
    hooks.append(
        CheckpointHook(t.ckpt_every)
    )  # before evaluation: a failing evaluation keeps the step's last.pt
    if trainer.val_loader is not None:
        hooks.append(
            EvalHook(t.eval_every, evaluation(trainer), writer, prepare=trainer.val_passes.arm)
        )
    if writer is not None and trainer.val_loader is not None and render_fn is not None:
        hooks.append(VizHook(t.viz_every, bev_pictures(trainer, render_fn), writer))
    return hooks


def step_mode(trainer: Trainer) -> str:
    """How the trainer runs its steps, for the run's first line (train.cuda_graph, train.compile_start)."""
    mode = "each step one CUDA graph replay" if trainer.graph_step is not None else "eager steps"
    if (
        trainer.graph_step is None and trainer.eager_because
    ):  # only auto falls back (true raises instead)
        mode += " (train.cuda_graph: auto: " + "; ".join(trainer.eager_because) + ")"
    if trainer.compile_later:
        mode += (
            ", uncompiled until a background process has compiled the model (train.compile_start)"
        )
    return mode


def interrupted_message(trainer: Trainer) -> str:
    """Ctrl-C: which checkpoint is on disk (once the writes in flight are done) and how to continue."""
    trainer.finish_checkpoints(
        report_only=True
    )  # a failed write: the message names the checkpoint before it
    step = trainer.saved.get("last.pt")
    if step is None:
        return (
            f"training interrupted at step {trainer.step}; no checkpoint was written (train.ckpt_every="
            f"{trainer.cfg.train.ckpt_every}): start again with --overwrite"
        )
    return (
        f"training interrupted at step {trainer.step}; the last checkpoint is step {step} in "
        f"{trainer.out_dir / 'checkpoints' / 'last.pt'}: continue with `{RESUME_HINT.format(trainer.out_dir)}`"
    )


def train(
    cfg: Config,
    out_dir: Optional[str] = None,
    resume: bool = False,
    *,
    overwrite: bool = False,
    model_fn: ModelFn = build_model,
    dataset_fn: DatasetFn = build_dataset,
    collate_fn: Callable = collate,
    render_fn: Optional[RenderFn] = None,
    hooks: Sequence[Hook] = (),
) -> dict:
    """Train from `cfg` into `out_dir` (default train.out_dir); returns the final metrics.

    A directory that holds an earlier run (lss.engine.run_dir.RUN_FILES) needs `resume` (continue from
    checkpoints/last.pt) or `overwrite` (delete its files and start again); otherwise ArgumentError. Ctrl-C raises
    TrainingInterrupted, whose message names the last checkpoint.

    model_fn / dataset_fn / collate_fn build the model and the train/val datasets (defaults: LiftSplatShoot and
    lss.data.NuScenesBEV on data.train_split / data.val_split). `render_fn` (e.g. lss.viz.bev_grid_image) draws
    the BEV predictions into tensorboard every train.viz_every steps; without it there are no pictures. `hooks`
    run after the default ones (default_hooks).
    """
    started = time.perf_counter()
    run_dir = Path(out_dir or cfg.train.out_dir)
    check_run_dir(run_dir, resume, overwrite)  # on every rank, before any of them writes
    dist_info = init_distributed(device_type(cfg))
    writer, trainer = None, None
    try:
        device = select_device(cfg, dist_info)
        seed_everything(
            cfg.train.seed + dist_info.rank, cfg.train.deterministic, cfg.train.cudnn_benchmark
        )
        if cfg.data.make_synthetic_if_missing:
            ensure_dataset(cfg, dist_info)
        train_set = dataset_fn(cfg, cfg.data.train_split, True)
        val_set = dataset_fn(cfg, cfg.data.val_split, False)
        datasets_done = time.perf_counter() - started
        model = model_fn(cfg)
        model_done = time.perf_counter() - started
        trainer = Trainer(
            cfg, model, train_set, val_set, run_dir, device, dist_info, collate_fn, model_fn
        )
        trainer.started = started
        trainer.phases.update(datasets=round(datasets_done, 3), model=round(model_done, 3))
        trainer.mark("trainer")  # the model on the device, optimizer, loaders
        if resume:
            trainer.resume(run_dir / "checkpoints" / "last.pt")
        stream = (
            trainer.batches()
        )  # the workers start on the first batches while the rest starts up
        trainer.mark("workers")
        if dist_info.is_main:
            if overwrite:
                clear_run(run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, run_dir / "config.yaml")
            writer = MetricsWriter(run_dir, trainer.step if resume else None)
            print(
                f"lss: training on {device} ({dist_info.world_size} process(es)), {len(train_set)} train / "
                f"{len(val_set)} val samples, run directory {run_dir}; {step_mode(trainer)}"
            )
        trainer.register_hooks(default_hooks(trainer, writer, started, render_fn) + list(hooks))
        trainer.mark("writer")
        try:
            final = trainer.fit(stream)
        except KeyboardInterrupt:
            raise TrainingInterrupted(interrupted_message(trainer)) from None
        final["run_dir"] = str(run_dir)
        if dist_info.is_main:
            (run_dir / "final.json").write_text(
                json.dumps({"config": config_to_dict(cfg), **final}, indent=1)
            )
        return final
    finally:
        if trainer is not None:
            trainer.close()
        if writer is not None:
            writer.close()  # flushes tensorboard also when the run stops early
        shutdown(dist_info)
