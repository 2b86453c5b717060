"""A run directory: what a run leaves in it, and the --resume / --overwrite rules that keep a new run from landing on
an earlier one."""

from __future__ import annotations

import shutil
from pathlib import Path

from lss.errors import ArgumentError

# What a run leaves in its directory (besides config.yaml, rewritten by every run): their presence means "a run is
# here", and --overwrite deletes them.
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
            f"run directory {run_dir} already holds a run ({', '.join(found)}); continue it with "
            f"--resume, start it again with --overwrite (deletes those files), or choose a new --out "
            "directory"
        )


def clear_run(run_dir: Path) -> None:
    """Delete the RUN_FILES of an earlier run (--overwrite)."""
    for name in existing_run(run_dir):
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
