"""Multi-GPU scaling of the real training loop (opt-in: `lss bench --suite ddp`; scripts/gpu_ddp.sh
runs it after the DDP tests on a CUDA machine): `lss train` on 1 GPU and under `torchrun
--standalone` on 2 (and 4, 8 where the machine has them), the same per-GPU batch and the same
synthetic set, and the loss curves of 1 vs 2 GPUs at equal global batch.

Rows, one per run: the steady steps/s of the loop (train_loop.loop_rates: the "train" records'
`elapsed` after the first WARMUP_FRACTION of them) as ms per step, samples/s over all GPUs, the
scaling against 1 GPU, how the run took its steps (its first line: the captured step, the captured
DDP step, or eager steps and why), and the loop's host split (ms per step waiting for the loader's
next batch, a sign of a data-bound run, and waiting for the GPU). A run of eager DDP steps on 2
GPUs (train.cuda_graph: false) is the peer. Then one row for the curves: 1 GPU at batch 2b against
2 GPUs at b each, augmentation off and a constant learning rate (the same global batches; only the
BatchNorm batch statistics, per GPU, and the random draws differ): the mean relative difference of
the logged losses, against LSS_DDP_TOL.

Environment: LSS_DDP_STEPS (default 600; the eager peer runs a third), LSS_DDP_GPUS (the counts,
e.g. "1,2"; default 1, 2, 4, 8 up to the machine's), LSS_DDP_DATA (a synthetic set to reuse; default
one made under the output folder), LSS_DDP_OUT (run directories), LSS_DDP_SET (more overrides for
every run, separated by ";"), LSS_DDP_EAGER (0: no eager peer), LSS_DDP_CURVE_STEPS (default 40),
LSS_DDP_TOL (default 0.05), LSS_DDP_TIMEOUT (seconds per run, default 240). On a CPU (--device cpu,
with --quick) the same runs are gloo processes on the quick sizes: a smoke test of the suite."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from benchmarks._runs import (
    child_env,
    ensure_synthetic_set,
    log_tail,
    read_jsonl,
    resolve_config,
)
from benchmarks.accuracy import QUICK_OVERRIDES, QUICK_SET
from benchmarks.train_loop import LOOP_SET, host_split_rows, loop_overrides, loop_rates
from lss.errors import ArgumentError

CONFIG = "configs/synthetic_segmentation.yaml"
BATCH_PER_GPU = 4
# augmentation off: the same global batches in 1 and N processes (1600 x 900 images to 128 x 352)
NO_AUGMENTATION = (
    "data.resize_lim=[0.22, 0.22]",
    "data.bot_pct_lim=[0.0, 0.0]",
    "data.rot_lim=[0.0, 0.0]",
    "data.rand_flip=false",
    "optim.schedule=constant",
    "optim.lr=0.0005",
)
FIRST_LINE = re.compile(r"lss: training on .*?; (.*)$", re.MULTILINE)


def train_command(processes: int, overrides: list[str], run_dir: Path) -> list[str]:
    """`lss train` in one process, or under torchrun in `processes` (one host)."""
    launch = [sys.executable, "-m", "lss"]
    if processes > 1:
        launch = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={processes}",
            "-m",
            "lss",
        ]
    command = [*launch, "train", "--config", resolve_config(CONFIG), "--out", str(run_dir)]
    for item in overrides:
        command += ["--set", item]
    return command + ["--overwrite"]


def run_training(processes: int, overrides: list[str], run_dir: Path, timeout: float) -> dict:
    """One training run (its own session: a timeout stops torchrun and its workers together);
    returns its exit code, seconds, metrics records and the step description of its first line."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = dict(child_env(max(1, (os.cpu_count() or 1) // processes)), PYTHONFAULTHANDLER="1")
    start = time.perf_counter()
    with (run_dir / "train.log").open("w") as log:
        proc = subprocess.Popen(
            train_command(processes, overrides, run_dir),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # torchrun passes it on to its workers
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            code = "timeout"
    text = (run_dir / "train.log").read_text(errors="replace")
    match = FIRST_LINE.search(text)
    return {
        "code": code,
        "seconds": time.perf_counter() - start,
        "records": read_jsonl(run_dir / "metrics.jsonl"),
        "steps": match.group(1).strip() if match else "(no first line)",
    }


def train_losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if r.get("kind") == "train"}


def curve_difference(a: dict[int, float], b: dict[int, float]) -> dict:
    """The relative difference |a - b| / |a| of two loss curves at their common steps: per step,
    mean and max."""
    steps = sorted(set(a) & set(b))
    if not steps:
        raise ValueError(f"no common logged steps: {sorted(a)[:5]}... against {sorted(b)[:5]}...")
    per_step = {s: abs(a[s] - b[s]) / max(abs(a[s]), 1e-12) for s in steps}
    return {
        "steps": steps,
        "per_step": per_step,
        "mean": sum(per_step.values()) / len(steps),
        "max": max(per_step.values()),
    }


def failed_row(case: str, name: str, run: dict, run_dir: Path) -> dict:
    tail = log_tail(run_dir / "train.log", 25).replace("\n", " | ")
    return {
        "case": case,
        "impl": name,
        "ms": None,
        "notes": f"FAILED ({run['code']}) after {run['seconds']:.0f} s: {tail}",
    }


def throughput_row(
    case: str, name: str, run: dict, processes: int, batch: int, base: Optional[float]
) -> dict:
    loop = loop_rates(run["records"], {})
    samples = loop["steady_steps_per_s"] * batch * processes
    host = {r["impl"].split(": ")[1]: r["ms"] for r in host_split_rows(case, run["records"])}
    scaling = samples / base if base else None
    notes = (
        f"{samples:.1f} samples/s ({loop['steady_steps_per_s']:.2f} steps/s over the last "
        f"{loop['steady_steps']} steps)"
        + (f", x{scaling:.2f} of 1 GPU" if scaling else "")
        + f"; host per step: {host.get('fetch', float('nan')):.1f} ms waiting for data, "
        f"{host.get('wait', float('nan')):.1f} ms for the GPU; {run['steps']}"
    )
    return {
        "case": case,
        "impl": name,
        "ms": 1e3 / loop["steady_steps_per_s"],
        "samples_per_s": samples,
        "scaling": scaling,
        "processes": processes,
        "notes": notes,
    }


def gpu_counts(device: torch.device) -> list[int]:
    chosen = os.environ.get("LSS_DDP_GPUS")
    if chosen:
        return [int(n) for n in chosen.split(",")]
    if device.type != "cuda":
        return [1, 2]
    available = torch.cuda.device_count()
    return [n for n in (1, 2, 4, 8) if n <= available]


def run(ctx) -> list[dict]:
    env = os.environ
    quick, cpu = ctx.quick, ctx.device.type != "cuda"
    counts = gpu_counts(ctx.device)
    if cpu and not quick:
        raise ArgumentError("the ddp suite on a CPU is a smoke test: run it with --quick")
    if len(counts) < 2 or counts[0] != 1:
        raise ArgumentError(
            f"the ddp suite compares 1 GPU with more: this machine gives {counts} (2 GPUs or more "
            "are needed; LSS_DDP_GPUS picks the counts, e.g. 1,2)"
        )
    steps = int(env.get("LSS_DDP_STEPS", 6 if quick else 600))
    curve_steps = int(env.get("LSS_DDP_CURVE_STEPS", 6 if quick else 40))
    timeout = float(env.get("LSS_DDP_TIMEOUT", 240))
    out = Path(env.get("LSS_DDP_OUT") or tempfile.mkdtemp(prefix="lss_ddp_"))
    spec = QUICK_SET if quick else LOOP_SET
    dataroot = Path(env.get("LSS_DDP_DATA") or out / "data")
    ensure_synthetic_set(dataroot, spec)
    common = list(QUICK_OVERRIDES) if quick else []
    common += ["train.device=cpu", "data.workers=0"] if cpu else []
    common += [o.strip() for o in env.get("LSS_DDP_SET", "").split(";") if o.strip()]
    batch = 1 if quick else BATCH_PER_GPU
    rows: list[dict] = []
    base = None
    eager_steps = steps if quick else steps // 3  # eager steps take longer
    unit = "CPU process" if cpu else "GPU"
    runs = [(n, f"lss, {n} {unit}{'s' if n > 1 else ''}", [], steps) for n in counts]
    if env.get("LSS_DDP_EAGER", "1") != "0":
        peer = f"lss eager DDP, 2 {unit}s (peer)"
        runs.append((2, peer, ["train.cuda_graph=false"], eager_steps))
    for processes, name, extra, n_steps in runs:
        base_overrides = loop_overrides(dataroot.resolve(), spec.version, n_steps, quick)
        overrides = base_overrides + common + [f"train.batch_size={batch}", *extra]
        case = f"batch {batch} per GPU, {n_steps} steps"
        run_dir = out / f"run_{processes}{'_eager' if extra else ''}"
        result = run_training(processes, overrides, run_dir, timeout)
        if result["code"] != 0 or sum(r.get("kind") == "train" for r in result["records"]) < 3:
            rows.append(failed_row(case, name, result, run_dir))
            continue
        row = throughput_row(case, name, result, processes, batch, base)
        base = row["samples_per_s"] if processes == 1 and not extra else base
        rows.append(row)
    rows.append(
        curve_row(
            dataroot.resolve(),
            spec.version,
            curve_steps,
            common,
            batch,
            out,
            timeout,
            float(env.get("LSS_DDP_TOL", 0.05)),
            quick,
        )
    )
    return rows


def curve_row(
    dataroot: Path,
    version: str,
    steps: int,
    common: list[str],
    batch: int,
    out: Path,
    timeout: float,
    tol: float,
    quick: bool,
) -> dict:
    """1 process at batch 2b against 2 at b each, the same global batches (augmentation off)."""
    overrides = loop_overrides(dataroot, version, steps, quick) + common + list(NO_AUGMENTATION)
    overrides.append("train.log_every=2")
    case = f"loss curves, global batch {2 * batch}, {steps} steps"
    curves = {}
    for processes in (1, 2):
        run_dir = out / f"curve_{processes}"
        per_gpu = 2 * batch // processes
        result = run_training(
            processes, overrides + [f"train.batch_size={per_gpu}"], run_dir, timeout
        )
        if result["code"] != 0:
            return failed_row(case, f"{processes} GPU(s)", result, run_dir)
        curves[processes] = (train_losses(result["records"]), result["steps"])
    diff = curve_difference(curves[1][0], curves[2][0])
    verdict = "within" if diff["mean"] <= tol else "OUTSIDE"
    return {
        "case": case,
        "impl": "1 vs 2 GPUs",
        "ms": None,
        "mean_rel_diff": diff["mean"],
        "max_rel_diff": diff["max"],
        "within_tolerance": diff["mean"] <= tol,
        "curves": {str(n): {str(s): v for s, v in c.items()} for n, (c, _) in curves.items()},
        "notes": f"mean relative difference of the logged losses {diff['mean']:.4f} (max "
        f"{diff['max']:.4f}) over {len(diff['steps'])} steps: {verdict} tolerance {tol}; "
        f"1 GPU: {curves[1][1]}; 2 GPUs: {curves[2][1]}",
    }
