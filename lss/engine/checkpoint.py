"""Checkpoints: model (unwrapped), optimizer, scheduler, scaler, step, config and version, written atomically."""

from __future__ import annotations

import os
import queue
import re
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

import lss
from lss.config import Config, config_from_dict, config_to_dict
from lss.errors import CheckpointError

FORMAT_VERSION = 1
REQUIRED_KEYS = ("format", "model", "step", "config", "version")
# Config keys that fix what the weights mean: a checkpoint is only evaluated or resumed with the same values.
FIXED_KEYS = (
    "grid.xbound",
    "grid.ybound",
    "grid.zbound",
    "grid.dbound",
    "data.final_dim",
    "data.classes",
    "model.heads",
)
# Temp files of atomic_save: .<name>.<host>-<pid>.<random>.tmp (older releases: .<name>.<random>.tmp).
_TEMP_NAME = re.compile(r"^\.(?P<name>.+?)\.(?:(?P<host>[^.]+)-(?P<pid>\d+)\.)?[a-z0-9_]{8}\.tmp$")
# A temp file whose writer cannot be checked (another host, older name) is stale once untouched this long.
STALE_TEMP_SECONDS = 3600


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model under DistributedDataParallel and torch.compile wrappers."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def atomic_save(obj: Any, path: Union[str, Path]) -> None:
    """torch.save to a temp file in the same directory, then os.replace: readers never see a partial file."""
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
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
    """A temp file of atomic_save whose writer is gone: its process on this host has exited, or (writer on another
    host, or a name without the writer) it has not been written to for STALE_TEMP_SECONDS."""
    match = _TEMP_NAME.match(file.name)
    if match is None or not file.is_file():
        return False
    if match["host"] == _host() and int(match["pid"]) != os.getpid():
        return not _pid_alive(int(match["pid"]))
    return time.time() - file.stat().st_mtime > STALE_TEMP_SECONDS


def remove_stale_temp_files(folder: Union[str, Path]) -> list[Path]:
    """Delete the temp files that interrupted checkpoint saves left in `folder` (only names of atomic_save's
    pattern); say so in one line. Returns the removed paths."""
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
            f"removed {len(removed)} stale temp file(s) of interrupted checkpoint saves in {folder} "
            f"({size / 1e6:.1f} MB): {', '.join(f.name for f in removed)}"
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
    """What save_checkpoint writes. snapshot=True copies every tensor to host memory, so that training can go on
    changing the weights and optimizer state while the copy is written (CheckpointWriter)."""
    state = {
        "format": FORMAT_VERSION,
        "version": lss.__version__,
        "step": int(step),
        "config": config_to_dict(config),
        "model": unwrap(model).state_dict(),
        "optimizer": _portable_optimizer(optimizer.state_dict()) if optimizer is not None else None,
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


class CheckpointWriter:
    """Writes checkpoints (atomic_save) in one background thread, in the order submitted, so that training goes on
    while a file is serialized and synced to disk (about 150 MB for the LSS model with its Adam state).

    `submit(state, path, done, failed)` queues a write of a host snapshot (checkpoint_state(..., snapshot=True));
    after the file is in place the thread calls `done()`. When a write fails, the later queued ones are dropped and
    the next `submit` or `wait` raises `failed(error)` for an OSError (the error itself otherwise). At most `depth`
    writes wait in the queue (submit blocks beyond that), so the host memory of snapshots stays bounded."""

    IDLE_SECONDS = (
        0.5  # the thread ends after this long without work (a later submit starts a new one)
    )

    def __init__(self, depth: int = 2):
        self._queue: "queue.Queue" = queue.Queue(maxsize=depth)
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def submit(
        self,
        state: dict,
        path: Union[str, Path],
        done: Callable[[], None] = lambda: None,
        failed: Callable[[OSError], BaseException] = lambda e: e,
    ) -> None:
        self._raise_error()
        with self._lock:
            self._queue.put((state, Path(path), done, failed))
            if self._thread is None:
                # not a daemon: an interpreter that exits still finishes the writes (then the idle thread ends)
                self._thread = threading.Thread(target=self._run, name="lss-checkpoint-writer")
                self._thread.start()

    def wait(self) -> None:
        """Return once every submitted write is done; raise the error of a failed one (once)."""
        self._queue.join()
        self._raise_error()

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self) -> None:
        while True:
            try:
                state, path, done, failed = self._queue.get(timeout=self.IDLE_SECONDS)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            try:
                if self._error is None:
                    atomic_save(state, path)
                    done()
            except OSError as e:
                self._error = failed(e)
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                self._error = e
            finally:
                del state
                self._queue.task_done()


def _plain(value):
    return float(value) if torch.is_tensor(value) else value


def _portable_optimizer(state: dict) -> dict:
    """A captured training step (train.cuda_graph) keeps the learning rate as a device tensor and the optimizer
    capturable; the checkpoint stores the plain form, which either kind of run resumes from."""
    groups = [
        {**g, "lr": _plain(g["lr"]), **({"capturable": False} if "capturable" in g else {})}
        for g in state["param_groups"]
    ]
    return {**state, "param_groups": groups}


def _portable_scheduler(state: dict) -> dict:
    if "_last_lr" in state:
        state = {**state, "_last_lr": [_plain(v) for v in state["_last_lr"]]}
    return state


def load_checkpoint(path: Union[str, Path], map_location: Any = "cpu") -> dict:
    """Read and validate a checkpoint; raises CheckpointError naming the file and the problem. Removes the stale
    temp files of interrupted saves next to it (remove_stale_temp_files)."""
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


def _config_value(config: dict, key: str):
    value = config
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return list(value) if isinstance(value, (list, tuple)) else value


def check_config_fits(state: dict, config: Config, path: Union[str, Path] = "checkpoint") -> None:
    """Refuse a checkpoint whose FIXED_KEYS (grid, input size, classes, heads) differ from `config`: its weights
    would be evaluated on another geometry or read as other classes."""
    current = config_to_dict(config)
    for key in FIXED_KEYS:
        trained, wanted = _config_value(state["config"], key), _config_value(current, key)
        if trained is not None and trained != wanted:
            raise CheckpointError(
                f"checkpoint {path} was trained with {key}={trained}, the config has {key}="
                f"{wanted}: set {key} to the checkpoint's value (--set '{key}={trained}') or use "
                "the config it was trained with (it holds it under 'config')"
            )


def checkpoint_config(state: dict) -> Config:
    """The config a checkpoint was trained with."""
    return config_from_dict(state["config"])


# Model state keys renamed since checkpoints were first written: (old prefix, new prefix).
RENAMED_STATE_KEYS = (("bev.segmentation.", "segmentation.conv."),)


def _renamed_keys(weights: dict) -> dict:
    """The weights with the keys of RENAMED_STATE_KEYS under their current names, so older checkpoints load."""
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
