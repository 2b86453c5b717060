"""`lss eval`: dataset-level IoU per class of a checkpoint on the validation split, written to
eval.json."""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from lss.config import Config, ConfigError
from lss.data.loader import build_dataset, build_eval_loader
from lss.engine.distributed import build_autocast, select_device, to_device
from lss.engine.checkpoint import load_checkpoint_model, run_directory
from lss.engine.detection_eval import DetectionCollector, decode_variants, format_decode_table
from lss.engine.metrics import IoUMeter, format_iou_table


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Optional[DataLoader],
    cfg: Config,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    show_progress: bool = True,
    detection_dir: Optional[Path] = None,
    timing: Optional[dict] = None,
    batches: Optional[Iterable[dict]] = None,
    decode: Optional[dict[str, Config]] = None,
) -> dict:
    """IoU per class over every batch of `loader` (summed over distributed ranks); see
    IoUMeter.compute. With the detection head, also "detection": the nuScenes detection metrics
    (files in `detection_dir` when given). `timing`, when given, receives "samples", "seconds" (the
    IoU pass, workers' start included), "first_batch_s" and "samples_per_s" (the samples after the
    first batch over the time after it: the steady rate).
    `batches`: a pass over `loader` already started (EvalPasses), instead of a new one.
    `decode`: {name: config} of post-processing variants (decode_variants), each decoded from the
    same outputs and evaluated: result["detection_decode"][name] (files in
    `detection_dir`/decode/name)."""
    meter = IoUMeter(cfg.data.classes, cfg.eval.threshold, cfg.eval.sweep)
    detections = (
        DetectionCollector(cfg) if "detection" in cfg.model.heads and loader is not None else None
    )
    if decode and detections is None:
        raise ValueError("decode variants need the detection head (model.heads) and a loader")
    variants = {name: DetectionCollector(c) for name, c in (decode or {}).items()}
    was_training = model.training
    model.eval()
    limit = cfg.eval.max_batches
    total = len(loader) if loader is not None else 0
    total = min(total, limit) if limit is not None else total
    started, first, samples = time.perf_counter(), None, 0
    try:
        source = batches if batches is not None else (loader or [])
        for i, batch in enumerate(
            tqdm(
                source,
                total=total,
                desc="eval",
                unit="batch",
                leave=False,
                dynamic_ncols=True,
                disable=not show_progress,
            )
        ):
            if limit is not None and i >= limit:
                break
            size = len(batch["targets"])
            if detections is None and loader.batch_size and size < loader.batch_size:
                batch = pad_batch(batch, loader.batch_size)
            batch = to_device(batch, device)
            with autocast():
                outputs = model(batch)
            meter.update(outputs["segmentation"][:size], batch["targets"][:size])
            if detections is not None:
                detections.add(outputs, batch)
                for collector in variants.values():
                    collector.add(outputs, batch)
            samples += size
            if first is None and timing is not None:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                first = (time.perf_counter(), size)
    finally:
        model.train(was_training)
    meter.all_reduce()
    result = meter.compute()  # waits for the device
    if timing is not None:
        end = time.perf_counter()
        timing.update(samples=samples, seconds=end - started)
        if first is not None:
            timing["first_batch_s"] = first[0] - started
            rest = samples - first[1]
            timing["samples_per_s"] = rest / max(end - first[0], 1e-9) if rest else None
    if detections is not None:
        result["detection"] = detections.evaluate_dataset(loader.dataset, detection_dir)
    if variants:
        result["detection_decode"] = {
            name: collector.evaluate_dataset(
                loader.dataset,
                None if detection_dir is None else Path(detection_dir) / "decode" / name,
                print_table=False,
            )
            for name, collector in variants.items()
        }
    return result


class EvalPasses:
    """Passes over an evaluation loader with persistent workers, started ahead of time. `arm()`
    starts the next pass: its workers decode the first batches while training goes on, so an
    evaluation does not wait for them (seconds at the first one, when the workers start). `take()`
    hands out the armed pass as it is (iter() on such a loader would reset it and drop what the
    workers prefetched), else starts one. `first_batch()`: the loader's first batch, kept (the armed
    pass still yields it)."""

    def __init__(self, loader: DataLoader):
        self.loader = loader
        self._armed: Optional[Iterator[dict]] = None
        self._first: Optional[dict] = None

    def arm(self) -> None:
        if self._armed is None:
            self._armed = iter(self.loader)

    def close(self) -> None:
        """Let go of the loader and its passes (their workers stop when they are collected)."""
        self.loader = self._armed = self._first = None

    def take(self) -> Iterator[dict]:
        armed, self._armed = self._armed, None
        return armed if armed is not None else iter(self.loader)

    def first_batch(self) -> dict:
        if self._first is None:
            rest = self.take()
            try:
                self._first = next(rest)
            except StopIteration:
                raise ValueError("the validation split has no samples: no batch to draw") from None
            self._armed = itertools.chain([self._first], rest)
        return self._first


def pad_batch(batch: dict, size: int) -> dict:
    """`batch` filled up to `size` samples with copies of its last one (the model then always sees
    the shapes of a full batch: no new cuDNN autotuning, no new kernels for the last batch of a
    split). Per-sample results are unchanged (BatchNorm in eval mode treats every sample alone); the
    caller drops the copies' outputs."""

    def pad(value):
        extra = size - len(value)
        if torch.is_tensor(value):
            return torch.cat([value, value[-1:].expand(extra, *value.shape[1:])])
        return list(value) + [value[-1]] * extra

    return {k: pad(v) for k, v in batch.items()}


def evaluate_checkpoint(
    cfg: Config, ckpt: str, out_dir: Optional[str] = None, decode: Iterable[str] = ()
) -> dict:
    """Evaluate checkpoint `ckpt` on data.val_split; writes eval.json to `out_dir` (default: the run
    directory that holds the checkpoint) and prints the IoU table. `decode`: `lss eval --decode`
    specs (decode_variants), the detections also evaluated under each."""
    path = Path(ckpt)
    if decode and "detection" not in cfg.model.heads:
        raise ConfigError(
            "--decode: the config has no detection head (model.heads); decode variants change "
            "the detection post-processing"
        )
    variants = decode_variants(cfg, decode)
    device = select_device(cfg)
    model, state = load_checkpoint_model(cfg, path, device)
    dataset = build_dataset(cfg, cfg.data.val_split, False)
    loader = build_eval_loader(cfg, dataset, device)
    out = Path(out_dir) if out_dir else run_directory(path)
    out.mkdir(parents=True, exist_ok=True)
    timing: dict = {}
    result = evaluate(
        model,
        loader,
        cfg,
        device,
        build_autocast(cfg, device),
        detection_dir=out,
        timing=timing,
        decode=variants,
    )
    result.update(
        {
            "checkpoint": str(path),
            "step": state["step"],
            "split": cfg.data.val_split,
            "samples": len(dataset),
            "timing": timing,
        }
    )
    (out / "eval.json").write_text(json.dumps(result, indent=1))
    print(
        format_iou_table(
            result,
            title=f"IoU (%) of {path} at step {state['step']} on {cfg.data.val_split} "
            f"({len(dataset)} samples)",
        )
    )
    if variants:
        print(format_decode_table(result["detection"], result["detection_decode"]), end="")
    print(f"wrote {out / 'eval.json'}")
    return result
