"""A run directory: what a run leaves in it, the --resume / --overwrite rules that keep a new run
from landing on an earlier one, and the lock that keeps a second process out of a live one."""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path
from typing import Optional

from lss.data import file_lock
from lss.errors import ArgumentError, RunDirInUseError

# Locked (lss.data.file_lock) by the process that trains into the directory, released when it dies.
LOCK_FILE = ".lss-run.lock"

# What a run leaves in its directory (besides config.yaml, rewritten by every run): their presence
# means "a run is here", and --overwrite deletes them.
RUN_FILES = (
    "metrics.jsonl",
    "final.json",
    "checkpoints/last.pt",
    "checkpoints/best.pt",
    "tensorboard",
)


def existing_run(run_dir: Path) -> list[str]:
    """The files of RUN_FILES that `run_dir` holds."""
    return [name for name in RUN_FILES if (run_dir / name).exists()]


def check_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """A new run never lands on an earlier one by accident: it needs --resume or --overwrite."""
    if resume and overwrite:
        raise ArgumentError(
            "--resume continues the run in the directory and --overwrite deletes it; pass one"
        )
    last = run_dir / "checkpoints" / "last.pt"
    if resume and not last.is_file():
        raise FileNotFoundError(
            f"--resume: {last} does not exist; train without --resume to start the run"
        )
    found = existing_run(run_dir)
    if found and not resume and not overwrite:
        raise ArgumentError(
            f"run directory {run_dir} already holds a run ({', '.join(found)}); continue it "
            "with --resume, start it again with --overwrite (deletes those files), or choose a "
            "new --out directory"
        )


def clear_run(run_dir: Path) -> None:
    """Delete the RUN_FILES of an earlier run (--overwrite)."""
    for name in existing_run(run_dir):
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


class RunDirLock:
    """The lock (lss.data.file_lock) on RUN_DIR/LOCK_FILE, held until `release` or the process
    ends."""

    def __init__(self, path: Path, fd: Optional[int]):
        self.path, self._fd = path, fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            file_lock.release(self._fd)
            self._fd = None

    def __enter__(self) -> "RunDirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def _holder(path: Path) -> str:
    """What the holder wrote into the lock file ("pid 123 on HOST, since ..."), right after it
    locked."""
    for _ in range(20):
        try:
            text = path.read_text(errors="replace").strip()
        except OSError:
            text = ""
        if text:
            return text
        time.sleep(0.01)
    return "a process that has not written its id yet"


def lock_run_dir(run_dir: Path) -> RunDirLock:
    """Lock `run_dir` (created if missing) for this process, or raise RunDirInUseError naming the
    process that holds it. Under torchrun only rank 0 (RANK) locks: the ranks of one run share the
    directory; the others get a lock object that holds nothing."""
    run_dir = Path(run_dir)
    path = run_dir / LOCK_FILE
    if os.environ.get("RANK", "0") != "0":
        return RunDirLock(path, None)
    run_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    fd = file_lock.try_lock(path, f"pid {os.getpid()} on {socket.gethostname()}, since {stamp}\n")
    if fd is None:
        raise RunDirInUseError(
            f"run directory {run_dir} is in use by another training process ({_holder(path)}; "
            f"lock file {path}): wait for it to end or stop it, or choose another --out directory "
            "(--resume and --overwrite are refused too while it runs)"
        )
    return RunDirLock(path, fd)


def open_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> RunDirLock:
    """Lock `run_dir` (lock_run_dir), then apply the --resume / --overwrite rules (check_run_dir);
    on a refusal the lock is released and a directory this call created is removed again."""
    run_dir = Path(run_dir)
    created = not run_dir.exists()
    lock = lock_run_dir(run_dir)
    try:
        check_run_dir(run_dir, resume, overwrite)
    except BaseException:
        lock.release()
        if created:
            lock.path.unlink(missing_ok=True)
            if run_dir.is_dir() and not any(run_dir.iterdir()):
                run_dir.rmdir()
        raise
    return lock
