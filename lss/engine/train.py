"""`lss train`: the loop (Trainer.fit) runs one step object per optimizer step (lss.engine.step)
with hooks around it for timing, logging, evaluation, checkpoints and BEV pictures. Single
process or `torchrun --nproc_per_node=K -m lss train ...` (DDP)."""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset
from tqdm import tqdm

from lss.config import Config, ConfigError, config_to_dict, save_config
from lss.config.memory import check_device_memory
from lss.data import collate
from lss.data.loader import (
    DatasetFn,
    build_dataset,
    build_eval_loader,
    build_loader,
    ensure_dataset,
)
from lss.data.samplers import EpochSampler, StreamSampler, class_balanced_training_pool
from lss.engine.checkpointer import Checkpointer, read_resume_state
from lss.engine.distributed import (
    DistInfo,
    autocast_dtype,
    barrier,
    build_autocast,
    device_type,
    init_distributed,
    lost_peer,
    lost_peer_message,
    preserved_rng,
    seed_everything,
    select_device,
    shutdown,
    to_device,
)
from lss.engine.eval import EvalPasses, evaluate
from lss.engine.hooks import (
    CheckpointHook,
    EvalHook,
    Hook,
    LogHook,
    MetricsWriter,
    StepTimer,
    VizHook,
    is_due,
)
from lss.engine.profiling import ProfileHook
from lss.engine.run_dir import clear_run, open_run_dir
from lss.engine.optim import build_optimizer, build_scheduler, lr_factor
from lss.engine.step import StepChoice, StepLogs, StepParts, build_step, choose_step, uncompiled
from lss.errors import ProcessGroupError, ResourceError
from lss.geometry import BevGrid
from lss.models.build import ModelFn, apply_channels_last, build_model
from lss.models.losses import TotalLoss

# validation batch, the model's outputs for it (eval mode), config -> H x W x 3 uint8 picture
# (lss.viz.render_batch)
RenderFn = Callable[[dict, dict, Config], np.ndarray]


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during training; the message says which checkpoint is on disk and how to continue."""


# ------------------------------------------------------------------------------------------ trainer
class Trainer:
    """The loop: the model, optimizer and data stream, one step object (`train_step`, chosen by
    lss.engine.step.choose_step) that `run_step` calls once per optimizer step, a Checkpointer, and
    the hooks that do the rest."""

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
        choice: Optional[StepChoice] = None,
    ):
        """`model_fn`, the importable function that built `model`, lets train.compile_start
        compile in a background process; `choice`: the step to take (default: choose_step's)."""
        self.cfg, self.out_dir, self.device, self.dist = cfg, out_dir, device, dist_info
        t = cfg.train
        self.model = model.to(device)
        apply_channels_last(self.model, t.channels_last)
        optimizer = build_optimizer(cfg, self.model)
        self.scheduler = build_scheduler(cfg, optimizer)
        self.autocast = build_autocast(cfg, device)
        amp_dtype = autocast_dtype(cfg, device)
        scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
        parts = StepParts(
            self.model,
            TotalLoss(cfg).to(device),
            optimizer,
            self.scheduler,
            scaler,
            amp_dtype,
            self.autocast,
            cfg.optim.grad_clip,
            device,
            dist_info,
        )
        choice = choice or choose_step(cfg, device, dist_info, model_fn is not None)
        self.train_step = build_step(cfg, choice, parts, model_fn)
        self.checkpointer = Checkpointer(
            out_dir, cfg, self.model, optimizer, self.scheduler, scaler, dist_info.is_main
        )
        pool = class_balanced_training_pool(train_set, t.seed) if cfg.data.class_balanced else None
        # samples an epoch draws: the training set, or its class-balanced pool (data.class_balanced)
        self.epoch_draws = len(train_set) if pool is None else len(pool)
        epochs = EpochSampler(
            self.epoch_draws,
            shuffle=True,
            seed=t.seed,
            rank=dist_info.rank,
            world_size=dist_info.world_size,
            pool=pool,
        )
        self.batches_per_epoch = epochs.per_rank // t.batch_size
        if self.batches_per_epoch == 0:
            raise ConfigError(
                f"the train split has {len(train_set)} samples, fewer than train.batch_size="
                f"{t.batch_size} per process ({dist_info.world_size} processes); lower the batch "
                "size"
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
        self.val_loader, self.val_passes = None, None
        if val_set is not None and len(val_set) > 0:
            self.val_loader = build_eval_loader(
                cfg,
                val_set,
                device,
                collate_fn,
                persistent=True,
                rank=dist_info.rank,
                world_size=dist_info.world_size,
            )
            self.val_passes = EvalPasses(self.val_loader)
        self._train_iter: Optional[Iterator[dict]] = None
        self.step = 0
        self.epoch = 0
        self.state: dict = {"best_iou": None}  # hook state that a checkpoint carries
        self.hooks: list[Hook] = []

    def register_hooks(self, hooks: Sequence[Hook]) -> None:
        """Hooks run in the order given, before and after every step and once after training."""
        self.hooks.extend(hooks)

    # -- the data stream: epoch/offset follow from the step, so a resumed run sees the same batches
    def batches(self) -> Iterator[dict]:
        """Host batches (pinned when training on CUDA) from the current step on, across epochs. The
        loader's workers start, and begin to prefetch, when this is called."""
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

    def run_step(self, micro_batches: list[dict]) -> StepLogs:
        """One optimizer step over `micro_batches` (gradient accumulation): one call into the step
        object; returns its logs. `step` counts it from the call on (a captured step may report an
        earlier step's NaN loss after queuing this one's update)."""
        self.step += 1
        return self.train_step.run_step(micro_batches, self.step)

    def learning_rate(self) -> float:
        """The learning rate of the next step, from the host (a captured step keeps it on the
        device)."""
        base = self.scheduler.base_lrs[0]
        return float(base) * lr_factor(self.cfg, self.scheduler.last_epoch)

    def fit(self, stream: Optional[Iterator[dict]] = None) -> dict:
        """Train to train.max_steps on `stream` (default: self.batches()); returns what the hooks
        report at the end. A step that runs out of device (or host) memory raises ResourceError."""
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
        periods = (t.log_every, t.ckpt_every, t.eval_every, t.viz_every)
        try:
            while self.step < t.max_steps:
                start = time.perf_counter()
                micro_batches = [next(stream) for _ in range(t.grad_accum)]
                fetched = time.perf_counter()
                for hook in self.hooks:
                    hook.before_step(self, micro_batches)
                try:
                    logs = self.run_step(micro_batches)
                except (torch.OutOfMemoryError, RuntimeError) as e:
                    if not out_of_memory(e):
                        raise
                    raise ResourceError(out_of_memory_message(self, e)) from e
                logs.host.update(start=start, fetched=fetched, ran=time.perf_counter())
                logs.add(lr=self.learning_rate())
                bar.update(1)
                if any(is_due(self, period) for period in periods):
                    self.train_step.check()  # hooks read, save or evaluate now: a NaN stops first
                if is_due(self, t.log_every):
                    bar.set_postfix(epoch=self.epoch, loss=f"{logs['loss']:.4f}")
                for hook in self.hooks:
                    hook.after_step(self, logs)
            self.train_step.check()
        finally:
            bar.close()
        self.checkpointer.finish()
        final: dict = {}
        for hook in self.hooks:
            final.update(hook.after_train(self) or {})
        return final

    def save(self, name: str) -> None:
        """checkpoints/`name` of the current step (Checkpointer.save)."""
        self.checkpointer.save(name, self.step, self.state)

    def resume(self, state: dict, path: Path) -> None:
        """Continue from a checkpoint's `state` (lss.engine.checkpointer.read_resume_state of
        `path`)."""
        self.step, hook_state = self.checkpointer.resume(state, path)
        self.state.update(hook_state)

    def close(self) -> None:
        """Stop what the run holds: the hooks' (a background compile), the loaders' workers now,
        and wait for the checkpoint writes in flight (a failed one is reported on stderr: another
        error is on its way)."""
        self.checkpointer.finish(report_only=True)
        for hook in self.hooks:
            hook.close()
        # the loaders' passes stop their worker processes when they are collected: now, rather
        # than at interpreter exit, where each persistent worker of a pinning loader is joined with
        # a 5 s timeout (pytorch/pytorch#81794)
        if self.val_passes is not None:
            self.val_passes.close()
        self._train_iter = self.train_loader = self.val_loader = None
        gc.collect()


# ------------------------------------------------------------------------------------------- entry
def evaluation(trainer: Trainer) -> Callable[[], dict]:
    """The evaluation callable of EvalHook: lss.engine.eval.evaluate of the model on the val loader
    (with its "timing")."""

    def run() -> dict:
        timing: dict = {}
        with preserved_rng(), uncompiled():
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
    """The picture callable of VizHook: `render_fn` of the first validation batch and the model's
    outputs for it."""
    batch: Optional[dict] = None

    def picture() -> np.ndarray:
        nonlocal batch
        with preserved_rng():
            if batch is None:
                batch = to_device(trainer.val_passes.first_batch(), trainer.device)
            trainer.model.eval()
            with torch.no_grad(), trainer.autocast(), uncompiled():
                outputs = trainer.model(batch)
        return render_fn(batch, outputs, trainer.cfg)

    return picture


def default_hooks(
    trainer: Trainer,
    writer: Optional[MetricsWriter],
    timer: StepTimer,
    render_fn: Optional[RenderFn],
) -> list[Hook]:
    """The timer, then logging, checkpoints, evaluation and pictures at the train.*_every periods
    (writers on rank 0 only), and the profiler of train.profile_steps (rank 0)."""
    t = trainer.cfg.train
    hooks: list[Hook] = [timer]
    if writer is not None:
        hooks.append(LogHook(t.log_every, writer, timer))
    # before evaluation: a failing evaluation keeps the step's last.pt
    hooks.append(CheckpointHook(t.ckpt_every))
    if trainer.val_loader is not None:
        evaluate_fn, prepare = evaluation(trainer), trainer.val_passes.arm
        hooks.append(EvalHook(t.eval_every, evaluate_fn, writer, prepare=prepare))
    if writer is not None and trainer.val_loader is not None and render_fn is not None:
        hooks.append(VizHook(t.viz_every, bev_pictures(trainer, render_fn), writer))
    if t.profile_steps is not None and trainer.dist.is_main:
        hooks.append(ProfileHook(t.profile_steps, trainer.out_dir / "profile"))
    return hooks


# what torch's CPU allocator says when the host has no memory left (CUDA raises OutOfMemoryError)
CPU_OUT_OF_MEMORY = "DefaultCPUAllocator: can't allocate memory"


def out_of_memory(error: BaseException) -> bool:
    """Whether `error` is a failed allocation of device or host memory."""
    return isinstance(error, torch.OutOfMemoryError) or CPU_OUT_OF_MEMORY in str(error)


def out_of_memory_message(trainer: Trainer, error: BaseException) -> str:
    """A step ran out of device memory: the settings to lower and the checkpoint on disk."""
    t, data = trainer.cfg.train, trainer.cfg.data
    grid = BevGrid.from_config(trainer.cfg.grid)
    reason = str(error).strip().splitlines()[0] if str(error).strip() else "out of memory"
    return (
        f"training step {trainer.step} ran out of memory on {trainer.device} ({reason}): "
        f"lower train.batch_size (now {t.batch_size}), data.final_dim (now "
        f"{list(data.final_dim)}) or the BEV grid (grid.xbound/ybound: now {grid.nx} x {grid.ny} "
        "cells); "
        f"{trainer.checkpointer.last_checkpoint()} (with a lower train.batch_size: another "
        "final_dim or grid needs a new run)"
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

    A directory that holds an earlier run (lss.engine.run_dir.RUN_FILES) needs `resume` (continue
    from checkpoints/last.pt, refused where `cfg` changes what its weights mean) or `overwrite`
    (delete its files and start again); otherwise ArgumentError. Ctrl-C raises
    TrainingInterrupted, whose message names the last checkpoint.

    model_fn / dataset_fn / collate_fn build the model and the train/val datasets (defaults:
    LiftSplatShoot and lss.data.NuScenesBEV on data.train_split / data.val_split). `render_fn`
    (e.g. lss.viz.render_batch) draws the BEV predictions into tensorboard every train.viz_every
    steps; without it there are no pictures. `hooks` run after the default ones (default_hooks)."""
    timer = StepTimer()
    run_dir = Path(out_dir or cfg.train.out_dir)
    run_lock = open_run_dir(run_dir, resume, overwrite)  # on every rank, before any writes
    dist_info = init_distributed(device_type(cfg))
    writer, trainer = None, None
    try:
        device = select_device(cfg, dist_info)
        check_device_memory(cfg, device)  # refuses a batch that cannot fit, before building
        choice = choose_step(cfg, device, dist_info)  # refuses a step the machine cannot run
        resumed = read_resume_state(run_dir, cfg) if resume else None
        seed_everything(
            cfg.train.seed + dist_info.rank, cfg.train.deterministic, cfg.train.cudnn_benchmark
        )
        if cfg.data.make_synthetic_if_missing:
            if dist_info.is_main:  # rank 0 generates a missing synthetic set, the others wait
                ensure_dataset(cfg)
            barrier(dist_info)
        train_set = dataset_fn(cfg, cfg.data.train_split, True)
        val_set = dataset_fn(cfg, cfg.data.val_split, False)
        timer.mark("datasets")
        model = model_fn(cfg)
        timer.mark("model")
        trainer = Trainer(
            cfg, model, train_set, val_set, run_dir, device, dist_info, collate_fn, model_fn, choice
        )
        timer.mark("trainer")  # the model on the device, optimizer, loaders
        if resumed is not None:
            trainer.resume(resumed, run_dir / "checkpoints" / "last.pt")
        stream = trainer.batches()  # the workers start on the first batches while the rest starts
        timer.mark("workers")
        if dist_info.is_main:
            if overwrite:
                clear_run(run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, run_dir / "config.yaml")
            writer = MetricsWriter(run_dir, trainer.step if resume else None)
            print(
                f"lss: training on {device} ({dist_info.world_size} process(es)), "
                f"{len(train_set)} train / {len(val_set)} val samples"
                + (
                    f" ({trainer.epoch_draws} class-balanced draws an epoch)"
                    if cfg.data.class_balanced
                    else ""
                )
                + f", run directory {run_dir}; "
                f"{choice.describe()}"
            )
        step_hooks = trainer.train_step.hooks  # last: they act on what the other hooks left
        trainer.register_hooks(
            default_hooks(trainer, writer, timer, render_fn) + list(hooks) + step_hooks
        )
        timer.mark("writer")
        try:
            final = trainer.fit(stream)
        except KeyboardInterrupt:
            where = trainer.checkpointer.last_checkpoint()
            raise TrainingInterrupted(
                f"training interrupted at step {trainer.step}; {where}"
            ) from None
        except RuntimeError as e:  # another process of a torchrun run is gone: say so, not a hang
            if not lost_peer(e, dist_info):
                raise
            where = trainer.checkpointer.last_checkpoint()
            raise ProcessGroupError(lost_peer_message(e, dist_info, trainer.step, where)) from e
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
        run_lock.release()
