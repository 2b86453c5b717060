"""Checkpoints: model (unwrapped), optimizer, scheduler, scaler, step, config and version,
written atomically; read back with their errors in words, checked against a config, and loaded
for inference (load_for_inference, load_checkpoint_model). A run's writer of checkpoints:
lss.engine.checkpointer."""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

import lss
from lss.config import Config, config_from_dict, config_to_dict
from lss.engine.distributed import select_device
from lss.models.build import ModelFn, build_model
from lss.errors import CheckpointError

FORMAT_VERSION = 1
REQUIRED_KEYS = ("format", "model", "step", "config", "version")
# Config keys that fix what the weights mean: a checkpoint is only evaluated or resumed with the
# same values.
FIXED_KEYS = (
    "grid.xbound",
    "grid.ybound",
    "grid.zbound",
    "grid.dbound",
    "data.final_dim",
    "data.classes",
    "model.heads",
    "model.temporal.frames",
    "model.temporal.gap",
    "model.temporal.frame_blocks",
    "detection.decoder",
    "detection.decoder_channels",
    "detection.refine_depth",
    "detection.refine_image",
    "detection.refine_motion",
    "detection.refine_motion_grid",
    "detection.refine_reversal",
)
# Temp files of atomic_save: .<name>.<host>-<pid>.<random>.tmp (older releases:
# .<name>.<random>.tmp).
_TEMP_NAME = re.compile(r"^\.(?P<name>.+?)\.(?:(?P<host>[^.]+)-(?P<pid>\d+)\.)?[a-z0-9_]{8}\.tmp$")
# A temp file whose writer cannot be checked (another host, older name) is stale once untouched this
# long.
STALE_TEMP_SECONDS = 3600


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model under DistributedDataParallel wrappers (train.compile compiles modules in
    place: no wrapper)."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def atomic_save(obj: Any, path: Union[str, Path]) -> None:
    """torch.save to a temp file in the same directory, then os.replace: readers never see a
    partial file. A failed write (an OSError, or torch's writer failing on a short write) leaves
    `path` as it was and raises CheckpointWriteError."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(
        prefix=f".{path.name}.{_host()}-{os.getpid()}.", suffix=".tmp", dir=path.parent
    )
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) or _is_write_failure(e):
            raise CheckpointWriteError.of(e, obj, path) from e
        raise


class CheckpointWriteError(OSError):
    """A checkpoint file could not be written (the file at its path is left as it was). `needed`:
    the file's size in bytes; `free`: the bytes free in its folder once the partial file was
    removed."""

    def __init__(self, code: int, strerror: str, needed: int, free: int):
        super().__init__(code, strerror)
        self.needed, self.free = needed, free

    @classmethod
    def of(cls, error: BaseException, obj: Any, path: Path) -> "CheckpointWriteError":
        needed, free = serialized_size(obj), shutil.disk_usage(path.parent).free
        if isinstance(error, OSError) and error.errno is not None:
            return cls(error.errno, error.strerror or str(error), needed, free)
        if free < needed:
            return cls(errno.ENOSPC, os.strerror(errno.ENOSPC), needed, free)
        first_line = (str(error).strip() or type(error).__name__).splitlines()[0]
        return cls(errno.EIO, f"the write failed ({first_line})", needed, free)


def _is_write_failure(error: BaseException) -> bool:
    """torch's zip writer reports a short write (a full disk) as a RuntimeError of its own."""
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        mark in text for mark in ("inline_container", "PytorchStreamWriter", "file write failed")
    )


class _ByteCounter:
    def __init__(self):
        self.count = 0

    def write(self, data) -> int:
        self.count += len(data)
        return len(data)

    def flush(self) -> None:
        pass


def serialized_size(obj: Any) -> int:
    """The bytes torch.save writes for `obj` (serialized into a counter, nothing stored)."""
    counter = _ByteCounter()
    torch.save(obj, counter)
    return counter.count


def format_size(size: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{int(size)} bytes"


def _host() -> str:
    return socket.gethostname().replace(".", "_") or "host"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_stale_temp(file: Path) -> bool:
    """A temp file of atomic_save whose writer is gone: its process on this host has exited, or
    (writer on another host, or a name without the writer) it has not been written to for
    STALE_TEMP_SECONDS."""
    match = _TEMP_NAME.match(file.name)
    if match is None or not file.is_file():
        return False
    if match["host"] == _host() and int(match["pid"]) != os.getpid():
        return not _pid_alive(int(match["pid"]))
    return time.time() - file.stat().st_mtime > STALE_TEMP_SECONDS


def remove_stale_temp_files(folder: Union[str, Path]) -> list[Path]:
    """Delete the temp files that interrupted checkpoint saves left in `folder` (only names of
    atomic_save's pattern); say so in one line. Returns the removed paths."""
    folder = Path(folder)
    removed, size = [], 0
    for file in sorted(folder.glob(".*.tmp")) if folder.is_dir() else []:
        try:
            if _is_stale_temp(file):
                file_size = file.stat().st_size
                file.unlink()
                removed.append(file)
                size += file_size
        except OSError:
            continue  # gone meanwhile, or not ours to delete: leave it
    if removed:
        print(
            f"removed {len(removed)} stale temp file(s) of interrupted checkpoint saves in "
            f"{folder} ({size / 1e6:.1f} MB): {', '.join(f.name for f in removed)}"
        )
    return removed


def save_checkpoint(
    path: Union[str, Path],
    model: nn.Module,
    step: int,
    config: Config,
    optimizer: Optional[torch.optim.Optimizer] = None,
    scheduler: Optional[Any] = None,
    scaler: Optional[torch.amp.GradScaler] = None,
    extra: Optional[dict] = None,
) -> None:
    atomic_save(checkpoint_state(model, step, config, optimizer, scheduler, scaler, extra), path)


def checkpoint_state(
    model: nn.Module,
    step: int,
    config: Config,
    optimizer: Optional[torch.optim.Optimizer] = None,
    scheduler: Optional[Any] = None,
    scaler: Optional[torch.amp.GradScaler] = None,
    extra: Optional[dict] = None,
    *,
    snapshot: bool = False,
) -> dict:
    """What save_checkpoint writes. snapshot=True copies every tensor to host memory, so that
    training can go on changing the weights and optimizer state while the copy is written
    (CheckpointWriter)."""
    state = {
        "format": FORMAT_VERSION,
        "version": lss.__version__,
        "step": int(step),
        "config": config_to_dict(config),
        "model": unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": _portable_scheduler(scheduler.state_dict()) if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "extra": extra or {},
    }
    return _host_copy(state) if snapshot else state


def _host_copy(value):
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return type(value)((k, _host_copy(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_host_copy(v) for v in value)
    return value


def _portable_scheduler(state: dict) -> dict:
    """The scheduler's last learning rates as numbers (a captured step keeps them as device
    tensors)."""
    if "_last_lr" in state:
        state = {**state, "_last_lr": [float(v) for v in state["_last_lr"]]}
    return state


def run_directory(ckpt: Union[str, Path]) -> Path:
    """The run directory of a checkpoint: RUN_DIR for RUN_DIR/checkpoints/NAME.pt, else its
    folder."""
    ckpt = Path(ckpt)
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent


def load_checkpoint(path: Union[str, Path], map_location: Any = "cpu") -> dict:
    """Read and validate a checkpoint; raises CheckpointError naming the file and the problem.
    Removes the stale temp files of interrupted saves next to it (remove_stale_temp_files)."""
    path = Path(path)
    if path.is_dir():
        found = sorted(
            str(p) for p in list(path.glob("*.pt")) + list(path.glob("checkpoints/*.pt"))
        )
        raise CheckpointError(
            f"checkpoint {path} is a directory: pass a checkpoint file, "
            + (
                f"e.g. {', '.join(found[:3])}"
                if found
                else "e.g. RUN_DIR/checkpoints/last.pt (this directory holds no *.pt file)"
            )
        )
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {path} does not exist: pass the path of a checkpoint file, e.g. "
            "RUN_DIR/checkpoints/last.pt or best.pt"
        )
    remove_stale_temp_files(path.parent)
    if path.stat().st_size == 0:
        raise CheckpointError(
            f"checkpoint {path} is empty (0 bytes; its save was interrupted): use another "
            "checkpoint (e.g. best.pt instead of last.pt)"
        )
    try:
        state = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({type(e).__name__}: {e}); the file is corrupt or "
            "truncated: use another checkpoint (e.g. best.pt instead of last.pt)"
        ) from None
    if not isinstance(state, dict) or any(k not in state for k in REQUIRED_KEYS):
        have = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(
            f"checkpoint {path} is not an lss checkpoint: expected keys {list(REQUIRED_KEYS)}, "
            f"found {have}; pass a checkpoint written by `lss train` (RUN_DIR/checkpoints/*.pt)"
        )
    if state["format"] != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format {state['format']} (written by lss {state['version']}); "
            f"this lss {lss.__version__} reads format {FORMAT_VERSION}"
        )
    return state


_MISSING = object()


def _config_value(config: dict, key: str):
    """The value at the dotted `key`, _MISSING where the dict lacks it (a null value is None)."""
    value = config
    for part in key.split("."):
        value = value.get(part, _MISSING) if isinstance(value, dict) else _MISSING
    return list(value) if isinstance(value, (list, tuple)) else value


def config_mismatches(state: dict, config: Config) -> list[tuple[str, Any, Any]]:
    """(key, the checkpoint's value, the config's value) of every FIXED_KEYS entry that differs. A
    key that a checkpoint's config lacks (written before the key existed) has its default value,
    which is what such a checkpoint was trained with."""
    current, defaults = config_to_dict(config), config_to_dict(Config())
    found = []
    for key in FIXED_KEYS:
        trained, wanted = _config_value(state["config"], key), _config_value(current, key)
        if trained is _MISSING:
            trained = _config_value(defaults, key)
        if trained is not _MISSING and trained != wanted:
            found.append((key, trained, wanted))
    return found


def check_config_fits(
    state: dict,
    config: Config,
    path: Union[str, Path] = "checkpoint",
    hint: Optional[str] = None,
) -> None:
    """Refuse a checkpoint whose FIXED_KEYS (grid, input size, classes, heads) differ from
    `config`: its weights would be evaluated on another geometry or read as other classes. The
    CheckpointError names every such key with both values, then `hint` (default: how to set the
    checkpoint's values)."""
    found = config_mismatches(state, config)
    if not found:
        return
    trained = ", ".join(f"{key}={value}" for key, value, _ in found)
    wanted = ", ".join(f"{key}={value}" for key, _, value in found)
    if hint is None:
        sets = " ".join(f"--set '{key}={value}'" for key, value, _ in found)
        hint = (
            f"set the checkpoint's values ({sets}) or use the config it was trained with (it "
            "holds it under 'config')"
        )
    raise CheckpointError(
        f"checkpoint {path} was trained with {trained}, the config has {wanted}: {hint}"
    )


def checkpoint_config(state: dict, overrides: Sequence[str] = ()) -> Config:
    """The config a checkpoint was trained with, `overrides` ("section.key=value") applied."""
    return config_from_dict(state["config"], overrides)


# Model state keys renamed since checkpoints were first written: (old prefix, new prefix).
RENAMED_STATE_KEYS = (("bev.segmentation.", "segmentation.conv."),)


def _renamed_keys(weights: dict) -> dict:
    """The weights with the keys of RENAMED_STATE_KEYS under their current names, so older
    checkpoints load."""
    renamed = {}
    for key, value in weights.items():
        for old, new in RENAMED_STATE_KEYS:
            if key.startswith(old):
                key = new + key[len(old) :]
        renamed[key] = value
    return renamed


def load_model_state(model: nn.Module, state: dict, path: Union[str, Path] = "checkpoint") -> None:
    """Load the checkpoint's weights into `model`, with an error that lists what does not fit."""
    target = unwrap(model)
    own = target.state_dict()
    weights = _renamed_keys(state["model"])
    missing = [k for k in own if k not in weights]
    unexpected = [k for k in weights if k not in own]
    mismatched = [
        f"{k}: checkpoint {tuple(weights[k].shape)} vs model {tuple(v.shape)}"
        for k, v in own.items()
        if k in weights and weights[k].shape != v.shape
    ]
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} (e.g. {missing[:3]})")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} (e.g. {unexpected[:3]})")
        if mismatched:
            parts.append(f"shape mismatch {len(mismatched)} (e.g. {mismatched[:3]})")
        raise CheckpointError(
            f"checkpoint {path} does not fit this model: {'; '.join(parts)}. Use the config it was "
            "trained with (its model, grid and data.classes/final_dim sections; the checkpoint "
            "holds it under 'config')"
        )
    target.load_state_dict(weights)


def load_for_inference(
    cfg: Config,
    ckpt: Union[str, Path],
    device: Optional[torch.device] = None,
    model_fn: ModelFn = build_model,
    state: Optional[dict] = None,
) -> tuple[nn.Module, dict]:
    """The model of `cfg` with the weights of checkpoint `ckpt`, on `device` (default:
    select_device) in eval mode, and the checkpoint's state (step, config, ...); `state`: the
    file already read by load_checkpoint."""
    state = load_checkpoint(ckpt) if state is None else state
    device = device or select_device(cfg)
    # the checkpoint holds every weight: no ImageNet file to find or download (model.pretrained)
    model = model_fn(
        dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, pretrained=None))
    )
    load_model_state(model, state, ckpt)
    return model.to(device).eval(), state


def load_checkpoint_model(
    cfg: Config, path: Path, device: torch.device, state: Optional[dict] = None
) -> tuple[nn.Module, dict]:
    """load_for_inference, refusing a checkpoint trained with another grid, input size, classes
    or heads (a CheckpointError naming the keys and both values, also where the weights would not
    fit); `state`: the file already read by load_checkpoint."""
    path = Path(path)
    try:
        model, state = load_for_inference(cfg, path, device, state=state)
    except CheckpointError:
        if path.is_file():  # the clearer reason, when it is one
            check_config_fits(load_checkpoint(path) if state is None else state, cfg, path)
        raise
    check_config_fits(state, cfg, path)
    return model, state
