"""What the run-based suites (accuracy, train_loop) share: a synthetic set made once through `lss make-synthetic`,
`lss train` / `lss eval` as subprocesses, and the run-directory files they leave (metrics.jsonl, final.json)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class SyntheticSet:
    """Arguments of `lss make-synthetic`: what the set is, so a set on disk can be checked before reuse."""

    version: str
    scenes: int
    samples_per_scene: int
    image_size: tuple[int, int]  # width, height
    seed: int = 0

    def describe(self) -> dict:
        return {
            "version": self.version,
            "scenes": self.scenes,
            "samples_per_scene": self.samples_per_scene,
            "image_size": list(self.image_size),
            "seed": self.seed,
        }


def ensure_synthetic_set(root: Path, spec: SyntheticSet, workers: Optional[int] = None) -> float:
    """Generate `spec` into `root` unless it is already there; returns the seconds generation took (0 if reused).

    A stamp file records the spec; a set made with other arguments is an error rather than a silent mismatch."""
    root = Path(root)
    stamp = root / "benchmark_set.json"
    if (root / spec.version / "sample.json").is_file():
        found = json.loads(stamp.read_text()) if stamp.is_file() else None
        if found is not None and found != spec.describe():
            raise ValueError(
                f"{root} holds a synthetic set made with {found}, not {spec.describe()}: pass another "
                "data directory or delete this one"
            )
        return 0.0
    cmd = [
        sys.executable,
        "-m",
        "lss",
        "make-synthetic",
        str(root),
        "--version",
        spec.version,
        "--scenes",
        str(spec.scenes),
        "--samples-per-scene",
        str(spec.samples_per_scene),
        "--image-size",
        f"{spec.image_size[0]}x{spec.image_size[1]}",
        "--seed",
        str(spec.seed),
        "--force",
    ]
    if workers:
        cmd += ["--workers", str(workers)]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(cmd)}` failed (exit {done.returncode}):\n{tail(done.stdout + done.stderr)}"
        )
    seconds = time.perf_counter() - start
    stamp.write_text(json.dumps(spec.describe()))
    return seconds


def resolve_config(path: str) -> str:
    """A config path as given, or relative to the repository root (configs/... from any working directory)."""
    if Path(path).is_file() or Path(path).is_absolute():
        return path
    return str(REPO_ROOT / path) if (REPO_ROOT / path).is_file() else path


def lss_command(action: str, config: str, overrides: Sequence[str], *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "lss", action, "--config", resolve_config(config)]
    for item in overrides:
        cmd += ["--set", item]
    return cmd + list(extra)


def child_env(threads: int) -> dict:
    """Environment of a child run: `threads` intra-op CPU threads, so parallel runs do not oversubscribe cores."""
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, threads)), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def stop(proc: subprocess.Popen, sig: int, grace: float) -> None:
    """Send `sig` to a child run (SIGABRT: it prints every thread's stack; SIGINT: it stops as on Ctrl-C), give it
    `grace` seconds to end, then kill it."""
    proc.send_signal(sig)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def read_jsonl(path: Path) -> list[dict]:
    """Records of a metrics.jsonl file; a line cut short by a killed run is skipped."""
    rows = []
    if Path(path).is_file():
        for line in Path(path).read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.splitlines()[-lines:])


def log_tail(path: Path, lines: int = 30) -> str:
    return (
        tail(Path(path).read_text(errors="replace"), lines)
        if Path(path).is_file()
        else f"({path} missing)"
    )
