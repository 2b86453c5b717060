"""`lss train`: a short run_step (batch -> loss -> backward -> step) with hooks around it for logging, evaluation,
checkpoints and BEV pictures. Single process or `torchrun --nproc_per_node=K -m lss train ...` (DDP)."""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from lss.config import Config, ConfigError, config_to_dict, save_config
from lss.engine import checkpoint as ckpt_io
from lss.engine.distributed import DistInfo, EpochSampler, barrier, init_distributed, shutdown
from lss.engine.eval import evaluate
from lss.engine.graph_step import GraphedTrainStep, check_graph_config
from lss.engine.losses import TotalLoss, check_depth_targets

ModelFn = Callable[[Config], nn.Module]
DatasetFn = Callable[[Config, str, bool], Dataset]


# ----------------------------------------------------------------------------------------------- setup helpers
def select_device(cfg: Config, dist_info: Optional[DistInfo] = None) -> torch.device:
    want = cfg.train.device
    if want not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"train.device={want!r}: expected 'auto', 'cpu' or 'cuda'")
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device='cuda' but no CUDA GPU is visible; use --set train.device=cpu")
    use_cuda = want == "cuda" or (want == "auto" and torch.cuda.is_available())
    if use_cuda:
        return torch.device("cuda", dist_info.local_rank if dist_info else torch.cuda.current_device())
    return torch.device("cpu")


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it for deterministic GEMMs
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    else:
        torch.backends.cudnn.benchmark = True


def autocast_dtype(cfg: Config, device: torch.device) -> Optional[torch.dtype]:
    """The autocast dtype for the camera/BEV networks, or None (fp32). Autocast applies on CUDA only."""
    amp = cfg.train.amp
    if amp not in ("bf16", "fp16", "none"):
        raise ConfigError(f"train.amp={amp!r}: expected 'bf16', 'fp16' or 'none'")
    if device.type != "cuda" or amp == "none":
        return None
    return torch.bfloat16 if amp == "bf16" else torch.float16


def build_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    o = cfg.optim
    params = [p for p in model.parameters() if p.requires_grad]
    # on the GPU the fused implementation updates all parameters in a few kernels instead of several per tensor
    fused = bool(params) and all(p.is_cuda for p in params)
    if o.name == "adam":
        return torch.optim.Adam(params, lr=o.lr, weight_decay=o.weight_decay, fused=fused or None)
    if o.name == "adamw":
        return torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay, fused=fused or None)
    raise ConfigError(f"optim.name={o.name!r}: expected 'adam' or 'adamw'")


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_encoders(model: nn.Module, mode: str = "default", memory_budget: float = 1.0) -> None:
    """torch.compile every trainable submodule (camera and BEV encoders, heads) in place; the LUT build stays eager.
    "reduce-overhead" replays them as CUDA graphs, which removes the host cost of launching their kernels one by
    one. memory_budget < 1 lets the compiler recompute activations in the backward instead of keeping them, down to
    that fraction of the activation memory (process-wide: torch._functorch's activation_memory_budget)."""
    if mode not in COMPILE_MODES:
        raise ConfigError(f"train.compile_mode={mode!r}: expected one of {', '.join(COMPILE_MODES)}")
    if not 0.0 < memory_budget <= 1.0:
        raise ConfigError(f"train.compile_memory_budget={memory_budget}: expected a fraction in (0, 1] (1 keeps "
                          "what the compiler's default partition keeps)")
    import torch._functorch.config as functorch_config

    functorch_config.activation_memory_budget = memory_budget
    for module in model.children():
        if any(p.requires_grad for p in module.parameters()):
            module.compile(mode=mode)


def lr_factor(cfg: Config, step: int) -> float:
    """Multiplier of optim.lr at optimizer step `step`: linear warm-up, then constant, cosine or one-cycle decay."""
    o, total = cfg.optim, max(cfg.train.max_steps, 1)
    if o.schedule not in ("constant", "cosine", "onecycle"):
        raise ConfigError(f"optim.schedule={o.schedule!r}: expected 'constant', 'cosine' or 'onecycle'")
    warmup = o.warmup_steps if o.schedule != "onecycle" or o.warmup_steps else int(0.3 * total)
    if step < warmup:
        start = 1.0 / 25 if o.schedule == "onecycle" else 0.0
        return start + (1.0 - start) * (step + 1) / warmup
    if o.schedule == "constant":
        return 1.0
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    end = 1e-4 if o.schedule == "onecycle" else 0.0
    return end + (1.0 - end) * 0.5 * (1.0 + math.cos(math.pi * progress))


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def default_model_fn(cfg: Config) -> nn.Module:
    from lss.models import LiftSplatShoot

    return LiftSplatShoot(cfg)


def default_dataset_fn(cfg: Config, split: str, is_train: bool) -> Dataset:
    from lss.data import NuScenesBEV

    return NuScenesBEV(cfg.data.dataroot, version=cfg.data.version, split=split, config=cfg, is_train=is_train)


def default_collate():
    from lss.data import collate

    return collate


def ensure_dataset(cfg: Config, dist_info: DistInfo) -> None:
    """Generate the synthetic dataset at data.dataroot when data.make_synthetic_if_missing and it is absent (on rank
    0 while the other ranks wait)."""
    if dist_info.is_main:
        from lss.data.loader import ensure_dataset as generate_if_missing

        generate_if_missing(cfg)
    barrier(dist_info)


def make_loader(cfg: Config, dataset: Dataset, sampler: EpochSampler, batch_size: int, drop_last: bool,
                collate_fn, device: torch.device, seed: int, persistent: bool = False) -> DataLoader:
    """`persistent`: keep the worker processes from epoch to epoch (the training loader: starting them again every
    epoch stalls training on small sets, whose epochs last seconds)."""
    workers = cfg.data.workers
    # an own generator keeps the loaders from drawing on the global RNG (resume then continues the same stream)
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers, collate_fn=collate_fn,
                      pin_memory=device.type == "cuda", drop_last=drop_last, generator=generator,
                      persistent_workers=persistent and workers > 0, worker_init_fn=_seed_worker if workers else None)


def _seed_worker(worker_id: int) -> None:
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


@contextlib.contextmanager
def preserved_rng():
    """Evaluation and pictures inside leave the training RNG stream as it was (the curve does not depend on
    how often they run)."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------------------------------- trainer
class Trainer:
    """Holds the model, optimizer and data stream; `run_step` does one optimizer step, hooks do the rest."""

    def __init__(self, cfg: Config, model: nn.Module, train_set: Dataset, val_set: Optional[Dataset],
                 out_dir: Path, device: torch.device, dist_info: DistInfo, collate_fn):
        self.cfg, self.out_dir, self.device, self.dist = cfg, out_dir, device, dist_info
        t = cfg.train
        if t.grad_accum < 1 or t.batch_size < 1 or t.max_steps < 1:
            raise ConfigError("train.batch_size, train.grad_accum and train.max_steps must be >= 1, got "
                              f"{t.batch_size}, {t.grad_accum}, {t.max_steps}")
        self.model = model.to(device)
        if t.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.loss_fn = TotalLoss(cfg).to(device)
        self.optimizer = build_optimizer(cfg, self.model)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(cfg, s))
        self.amp_dtype = autocast_dtype(cfg, device)
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.amp_dtype == torch.float16)
        if t.compile:
            compile_encoders(self.model, t.compile_mode, t.compile_memory_budget)
        self.graph_step: Optional[GraphedTrainStep] = None
        if t.cuda_graph:
            check_graph_config(cfg, device, dist_info.enabled)
            self.graph_step = GraphedTrainStep(self.model, self.loss_fn, self.optimizer, self.amp_dtype,
                                               cfg.optim.grad_clip, check_batch=self._check_batch)
        self.net = self.model
        if dist_info.enabled:
            ids = [device.index] if device.type == "cuda" else None
            self.net = DistributedDataParallel(self.model, device_ids=ids)
        self.train_sampler = EpochSampler(len(train_set), shuffle=True, seed=t.seed, rank=dist_info.rank,
                                          world_size=dist_info.world_size)
        self.batches_per_epoch = self.train_sampler.per_rank // t.batch_size
        if self.batches_per_epoch == 0:
            raise ConfigError(f"the train split has {len(train_set)} samples, fewer than train.batch_size="
                              f"{t.batch_size} per process ({dist_info.world_size} processes); lower the batch size")
        self.train_loader = make_loader(cfg, train_set, self.train_sampler, t.batch_size, True, collate_fn, device,
                                        t.seed, persistent=True)
        self.val_loader = None
        if val_set is not None and len(val_set) > 0:
            val_sampler = EpochSampler(len(val_set), shuffle=False, rank=dist_info.rank,
                                       world_size=dist_info.world_size, pad=False)
            self.val_loader = make_loader(cfg, val_set, val_sampler, cfg.eval.batch_size, False, collate_fn, device,
                                          t.seed)
        self.step = 0
        self.epoch = 0
        self.state: dict = {"best_iou": None}  # hook state that a checkpoint carries
        self.hooks: list[Hook] = []

    # -- the data stream: epoch/offset follow from the step, so a resumed run sees the same batches
    def batches(self) -> Iterator[dict]:
        micro = self.step * self.cfg.train.grad_accum
        epoch, offset = divmod(micro, self.batches_per_epoch)
        while True:
            self.epoch = epoch
            self.train_sampler.set_epoch(epoch, start=offset * self.cfg.train.batch_size)
            self.train_loader.generator.manual_seed(self.cfg.train.seed * 100_003 + epoch)
            for batch in self.train_loader:
                yield to_device(batch, self.device)
            epoch, offset = epoch + 1, 0

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)

    def _check_batch(self, batch: dict) -> None:
        """Host-side checks of a batch for the captured step (which cannot sync inside)."""
        splat = getattr(self.model, "splat", None)
        if "depth_targets" in batch and splat is not None:
            check_depth_targets(batch["depth_targets"], splat.depth_bins)

    def run_step(self, micro_batches: list[dict]) -> dict:
        """One optimizer step over `micro_batches` (gradient accumulation); returns the mean loss terms."""
        self.net.train()
        if self.graph_step is not None:
            return self._run_graph_step(micro_batches[0])
        totals: dict = {}
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            sync = self.net.no_sync() if self.dist.enabled and not last else contextlib.nullcontext()
            with sync:
                with self.autocast():
                    outputs = self.net(batch)
                losses = self.loss_fn(outputs, batch)
                self.scaler.scale(losses["loss"] / len(micro_batches)).backward()
            for k, v in losses.items():
                totals[k] = totals.get(k, 0.0) + v.detach() / len(micro_batches)
        if self.dist.enabled:  # log the global batch's mean, and let every rank see a non-finite loss together
            names = sorted(totals)
            stacked = torch.stack([torch.as_tensor(totals[k], device=self.device, dtype=torch.float32)
                                   for k in names])
            torch.distributed.all_reduce(stacked)
            totals = dict(zip(names, stacked / self.dist.world_size))
        loss = float(totals["loss"])
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {self.step + 1}; lower optim.lr, check the data, or "
                                     "resume from the last good checkpoint")
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                   self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else
                                                   float("inf"))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        out = {k: float(v) for k, v in totals.items()}
        out["grad_norm"] = float(grad_norm)
        return out

    def _run_graph_step(self, batch: dict) -> dict:
        values = self.graph_step(batch)
        names = sorted(values)
        out = dict(zip(names, torch.stack([values[k].float() for k in names]).tolist()))  # the one sync per step
        if not math.isfinite(out["loss"]):
            raise FloatingPointError(f"loss is {out['loss']} at step {self.step + 1} (train.cuda_graph: this step's "
                                     "update was applied; the checkpoints on disk predate it); lower optim.lr, "
                                     "check the data, or resume from the last good checkpoint")
        self.scheduler.step()
        self.step += 1
        return out

    def fit(self) -> dict:
        t = self.cfg.train
        stream = self.batches()
        bar = tqdm(total=t.max_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not self.dist.is_main)
        try:
            while self.step < t.max_steps:
                start = time.perf_counter()
                logs = self.run_step([next(stream) for _ in range(t.grad_accum)])
                logs["step_time"] = time.perf_counter() - start
                logs["samples_per_s"] = t.batch_size * t.grad_accum * self.dist.world_size / logs["step_time"]
                logs["lr"] = float(self.scheduler.get_last_lr()[0])  # a device tensor with train.cuda_graph
                bar.update(1)
                bar.set_postfix(epoch=self.epoch, loss=f"{logs['loss']:.4f}")
                for hook in self.hooks:
                    hook.after_step(self, logs)
        finally:
            bar.close()
        final: dict = {}
        for hook in self.hooks:
            final.update(hook.after_train(self) or {})
        return final

    def evaluate(self) -> dict:
        with preserved_rng():
            return evaluate(self.model, self.val_loader, self.cfg, self.device, self.autocast,
                            show_progress=self.dist.is_main)

    def save(self, name: str) -> None:
        if not self.dist.is_main:
            return
        ckpt_io.save_checkpoint(self.out_dir / "checkpoints" / name, self.model, self.step, self.cfg,
                                self.optimizer, self.scheduler, self.scaler,
                                extra={"rng": rng_state(), "state": dict(self.state)})

    def resume(self, path: Path) -> None:
        state = ckpt_io.load_checkpoint(path, map_location=self.device)
        ckpt_io.load_model_state(self.model, state, path)
        for name, obj in (("optimizer", self.optimizer), ("scheduler", self.scheduler), ("scaler", self.scaler)):
            if state.get(name) is None:
                raise ckpt_io.CheckpointError(f"checkpoint {path} has no {name} state; it cannot be resumed "
                                              "(start a new run from it instead)")
            obj.load_state_dict(state[name])
        self.step = state["step"]
        self.state.update(state["extra"].get("state", {}))
        if "rng" in state["extra"]:
            set_rng_state(_cpu_rng(state["extra"]["rng"]))


def _cpu_rng(state: dict) -> dict:
    """RNG states must be CPU byte tensors; map_location may have moved them."""
    out = dict(state)
    out["torch"] = state["torch"].cpu()
    if "cuda" in state:
        out["cuda"] = [s.cpu() for s in state["cuda"]]
    return out


# ------------------------------------------------------------------------------------------------------ hooks
class Hook:
    def after_step(self, trainer: Trainer, logs: dict) -> None:
        pass

    def after_train(self, trainer: Trainer) -> Optional[dict]:
        return None


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


class MetricsWriter:
    """metrics.jsonl plus tensorboard events in the run directory (rank 0 only)."""

    def __init__(self, out_dir: Path, resume_step: Optional[int]):
        from torch.utils.tensorboard import SummaryWriter

        self.path = out_dir / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            # drop records past the resumed checkpoint so the file reads as one continuous run
            kept = [ln for ln in self.path.read_text().splitlines() if ln and json.loads(ln)["step"] <= resume_step]
            self.path.write_text("".join(ln + "\n" for ln in kept))
        self.tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"), purge_step=resume_step)

    def write(self, kind: str, step: int, values: dict) -> None:
        record = {"kind": kind, "step": step, **values}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for k, v in _flatten(values):
            self.tb.add_scalar(f"{kind}/{k}", v, step)

    def close(self) -> None:
        self.tb.close()


def _flatten(values: dict, prefix: str = ""):
    for k, v in values.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}/")
        elif isinstance(v, (int, float)):
            yield f"{prefix}{k}", v


class LogHook(Hook):
    def __init__(self, writer: Optional[MetricsWriter]):
        self.writer = writer

    def after_step(self, trainer: Trainer, logs: dict) -> None:
        if self.writer is not None and _due(trainer.step, trainer.cfg.train.log_every, trainer.cfg.train.max_steps):
            self.writer.write("train", trainer.step, logs)

    def after_train(self, trainer: Trainer) -> None:
        if self.writer is not None:
            self.writer.close()


class EvalHook(Hook):
    """Validation IoU every eval.every steps and at the end; best.pt follows the mean IoU."""

    def __init__(self, writer: Optional[MetricsWriter]):
        self.writer = writer
        self.last: dict = {}

    def after_step(self, trainer: Trainer, logs: dict) -> None:
        t = trainer.cfg.train
        if trainer.val_loader is None or not _due(trainer.step, t.eval_every, t.max_steps):
            return
        result = trainer.evaluate()
        self.last = result
        if self.writer is not None:
            self.writer.write("val", trainer.step, {"iou": result["iou"], "mean_iou": result["mean_iou"]})
            tqdm.write(f"step {trainer.step}: val IoU " +
                       ", ".join(f"{c} {100 * v:.2f}" for c, v in result["iou"].items()))
        best = trainer.state.get("best_iou")
        if best is None or result["mean_iou"] > best:
            trainer.state["best_iou"] = result["mean_iou"]
            trainer.state["best_step"] = trainer.step
            trainer.save("best.pt")

    def after_train(self, trainer: Trainer) -> dict:
        return {"val": self.last} if self.last else {}


class CheckpointHook(Hook):
    def after_step(self, trainer: Trainer, logs: dict) -> None:
        if _due(trainer.step, trainer.cfg.train.ckpt_every, trainer.cfg.train.max_steps):
            trainer.save("last.pt")

    def after_train(self, trainer: Trainer) -> dict:
        return {"step": trainer.step, "best_iou": trainer.state.get("best_iou"),
                "best_step": trainer.state.get("best_step")}


class VizHook(Hook):
    """BEV prediction images of the first validation batch into tensorboard."""

    def __init__(self, writer: Optional[MetricsWriter]):
        self.writer = writer
        self.batch: Optional[dict] = None

    def after_step(self, trainer: Trainer, logs: dict) -> None:
        t = trainer.cfg.train
        if self.writer is None or trainer.val_loader is None or not _due(trainer.step, t.viz_every, t.max_steps):
            return
        from lss.viz import bev_grid_image

        with preserved_rng():
            if self.batch is None:
                self.batch = to_device(next(iter(trainer.val_loader)), trainer.device)
            trainer.model.eval()
            with torch.no_grad(), trainer.autocast():
                logits = trainer.model(self.batch)["segmentation"].float()
        image = bev_grid_image(logits.sigmoid().cpu(), self.batch["targets"].cpu(), trainer.cfg.data.classes)
        self.writer.tb.add_image("val/bev_prediction", image, trainer.step, dataformats="HWC")


# ---------------------------------------------------------------------------------------------------- entry
def train(cfg: Config, out_dir: Optional[str] = None, resume: bool = False, *, model_fn: ModelFn = default_model_fn,
          dataset_fn: DatasetFn = default_dataset_fn, collate_fn=None) -> dict:
    """Train from `cfg` into `out_dir` (default train.out_dir); returns the final metrics.

    model_fn / dataset_fn / collate_fn build the model and the train/val datasets (defaults: LiftSplatShoot and
    lss.data.NuScenesBEV on data.train_split / data.val_split).
    """
    run_dir = Path(out_dir or cfg.train.out_dir)
    last = run_dir / "checkpoints" / "last.pt"
    if resume and not last.is_file():
        raise FileNotFoundError(f"--resume: {last} does not exist; train without --resume to start the run")
    device_type = "cuda" if cfg.train.device == "cuda" or (cfg.train.device == "auto" and
                                                           torch.cuda.is_available()) else "cpu"
    dist_info = init_distributed(device_type)
    try:
        device = select_device(cfg, dist_info)
        seed_everything(cfg.train.seed + dist_info.rank, cfg.train.deterministic)
        if cfg.data.make_synthetic_if_missing:
            ensure_dataset(cfg, dist_info)
        train_set = dataset_fn(cfg, cfg.data.train_split, True)
        val_set = dataset_fn(cfg, cfg.data.val_split, False)
        trainer = Trainer(cfg, model_fn(cfg), train_set, val_set, run_dir, device, dist_info,
                          collate_fn or default_collate())
        if resume:
            trainer.resume(last)
        writer = None
        if dist_info.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, run_dir / "config.yaml")
            if not resume:
                (run_dir / "metrics.jsonl").unlink(missing_ok=True)
            writer = MetricsWriter(run_dir, trainer.step if resume else None)
            print(f"lss: training on {device} ({dist_info.world_size} process(es)), {len(train_set)} train / "
                  f"{len(val_set)} val samples, run directory {run_dir}")
        trainer.hooks = [LogHook(writer), EvalHook(writer), CheckpointHook(), VizHook(writer)]
        final = trainer.fit()
        final["run_dir"] = str(run_dir)
        if dist_info.is_main:
            (run_dir / "final.json").write_text(json.dumps({"config": config_to_dict(cfg), **final}, indent=1))
        return final
    finally:
        shutdown(dist_info)
