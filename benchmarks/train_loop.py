"""Training-loop benchmark: the real `lss train` loop in a subprocess on a small synthetic set, against the step alone.

Rows: time from process start to the first completed step (the wrapper's spawn time to the first "train" record of
metrics.jsonl, split at train()'s call by the record's `elapsed`), then one "startup:" row per start-up phase (from
the "startup" record the trainer writes: datasets, model, trainer, workers, writer, first_batch, first_step; ms is
the phase's own duration; with train.cuda_graph also one "startup: first_step: <part>" row per part of the first
step: each warm-up step, the capture and the rest) and the import time of the trainer's modules in a fresh process,
once before the run (it writes the bytecode where missing; see child_env_with_stacks) and once after (its notes: the
longest imports by package); steps/s of the loop in steady state (from `elapsed` of later records;
from the times the wrapper saw the records appear where `elapsed` is missing), steps/s of the training loader alone
(the same dataset, sampler and workers, no model: above the loop's rate the loop is bound by the step, near it by
the data), steps/s of the step alone at the same config (benchmarks.train_step's step on random batches of the
same shape), their ratio, and validation samples/s of `lss eval` on the training split (more batches than the small
val split; the rate after the first batch, from the "timing" of eval.json).

A run past its time limit gets SIGABRT first, so that the log (train.log / the eval row) ends with the Python stack
of every thread (PYTHONFAULTHANDLER): where it hung.

Environment: LSS_LOOP_CONFIG (default configs/synthetic_segmentation.yaml), LSS_LOOP_STEPS, LSS_LOOP_DATA (a synthetic set to
reuse; LSS_LOOP_VERSION its version, default v1.0-mini), LSS_LOOP_OUT (run directory; default a temporary one),
LSS_LOOP_SET (more config overrides, separated by ";", e.g. "train.cudnn_benchmark=false;data.workers=8"),
LSS_LOOP_TIMEOUT (seconds for the training run, default 180).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from benchmarks._runs import (
    SyntheticSet,
    child_env,
    ensure_synthetic_set,
    log_tail,
    lss_command,
    read_jsonl,
    resolve_config,
    stop,
)
from benchmarks.accuracy import QUICK_OVERRIDES, QUICK_SET

LOOP_SET = SyntheticSet("v1.0-mini", scenes=4, samples_per_scene=20, image_size=(1600, 900), seed=0)
WARMUP_FRACTION = 0.2  # records before this fraction of the run (compile, capture, autotuning) are not steady state
POLL_S = 0.01


STARTUP_PHASES = ("datasets", "model", "trainer", "workers", "writer", "first_batch", "first_step")
RECORDS = 40  # "train" records per run: logging reads the loss (a host sync), so not at every step


def loop_overrides(dataroot: Path, version: str, steps: int, quick: bool) -> list[str]:
    return (
        (list(QUICK_OVERRIDES) if quick else [])
        + [
            f"data.dataroot={dataroot}",
            f"data.version={version}",
            "data.make_synthetic_if_missing=false",
            f"train.max_steps={steps}",
            f"train.log_every={max(1, steps // RECORDS)}",
            "train.eval_every=0",
            "train.ckpt_every=0",
            "train.viz_every=0",
        ]
        + (["data.workers=0"] if quick else [])
    )


def child_env_with_stacks() -> dict:
    """The children's environment: every thread's stack on SIGABRT, and bytecode written and reused as after a pip
    install (which compiles it), also where PYTHONDONTWRITEBYTECODE is set: then under PYTHONPYCACHEPREFIX (default
    <tmp>/lss-pycache), so that no installed package is written to."""
    env = dict(child_env(os.cpu_count() or 1), PYTHONFAULTHANDLER="1")
    if env.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
        env.setdefault("PYTHONPYCACHEPREFIX", str(Path(tempfile.gettempdir()) / "lss-pycache"))
    return env


def watch_train(
    cmd: list[str], run_dir: Path, timeout: float
) -> tuple[float, dict[int, float], int]:
    """Run `cmd`, noting when each "train" record of run_dir/metrics.jsonl appears (seconds after the spawn).
    Returns (total seconds, step -> seconds seen, exit code)."""
    metrics = run_dir / "metrics.jsonl"
    seen: dict[int, float] = {}
    start = time.perf_counter()
    with (run_dir / "train.log").open("w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env_with_stacks()
        )
        while True:
            code = proc.poll()
            now = time.perf_counter() - start
            for r in read_jsonl(metrics):
                if r.get("kind") == "train":
                    seen.setdefault(r["step"], now)
            if code is not None:
                return now, seen, code
            if now > timeout:
                stop(proc, signal.SIGABRT, 5)
                return now, seen, -9
            time.sleep(POLL_S)


def steady_window(records: list[dict]) -> tuple[list[dict], int]:
    """The "train" records by step, and the index of the first one of the steady state (the records before it,
    WARMUP_FRACTION of them and at least one, hold the start-up)."""
    records = sorted((r for r in records if r.get("kind") == "train"), key=lambda r: r["step"])
    return records, max(1, int(len(records) * WARMUP_FRACTION))


def host_split_rows(case: str, records: list[dict]) -> list[dict]:
    """One row per part of the loop's host time per step (the trainer's take_host_split in each "train" record),
    step-weighted over loop_rates' steady window (the steps after the record at its start)."""
    records, skip = steady_window(records)
    steady = [
        (b["step"] - a["step"], b["host"])
        for a, b in zip(records[skip:], records[skip + 1 :])
        if b.get("host")
    ]
    steps = sum(n for n, _ in steady)
    if not steps:
        return []
    notes = {
        "fetch_ms": "waiting for the loader's next batch",
        "wait_ms": "waiting for the device in the loss check "
        "(with train.cuda_graph: the previous step still running)",
        "other_ms": "the rest: the batch's copy, launches, logging, hooks",
    }
    return [
        {
            "case": case,
            "impl": f"loop host: {part[:-3]}",
            "ms": sum(n * h[part] for n, h in steady) / steps,
            "notes": f"{text}, mean per step over {steps} steps",
        }
        for part, text in notes.items()
    ]


def loop_rates(records: list[dict], seen: dict[int, float]) -> dict:
    """First-step and steady-state numbers from the train records (with `elapsed` where the trainer writes it)."""
    records, skip = steady_window(records)
    if len(records) < 3:
        raise ValueError(f"need at least 3 train records to time the loop, got {len(records)}")
    has_elapsed = all("elapsed" in r for r in records)
    clock = {r["step"]: (r["elapsed"] if has_elapsed else seen[r["step"]]) for r in records}
    first = records[0]["step"]
    a, b = records[skip]["step"], records[-1]["step"]
    out = {
        "first_step": first,
        "first_step_s": seen.get(first),
        "steady_steps": b - a,
        "steady_steps_per_s": (b - a) / max(clock[b] - clock[a], 1e-9),
        "source": "elapsed"
        if has_elapsed
        else "wrapper clock (metrics.jsonl has no elapsed field)",
    }
    if has_elapsed and first in seen:
        out["train_call_s"] = seen[first] - records[0]["elapsed"]  # process start -> train() called
        out["train_to_first_step_s"] = records[0]["elapsed"]
    return out


def startup_rows(case: str, records: list[dict], train_call_s: Optional[float]) -> list[dict]:
    """One row per start-up phase of the "startup" record (ms: the phase alone; notes: seconds since the process
    started, where the wrapper knows when train() was called, else since train() was called), the first step's
    parts after its row."""
    startup = next((r for r in records if r.get("kind") == "startup"), None)
    if startup is None:
        return [
            {
                "case": case,
                "impl": "startup",
                "ms": None,
                "notes": "metrics.jsonl has no startup record",
            }
        ]
    phases, rows, before = startup["phases"], [], 0.0
    base, since = (
        (train_call_s, "process start") if train_call_s is not None else (0.0, "train() called")
    )
    for name in [p for p in STARTUP_PHASES if p in phases] + [
        p for p in phases if p not in STARTUP_PHASES
    ]:
        at = phases[name]
        rows.append(
            {
                "case": case,
                "impl": f"startup: {name}",
                "ms": 1e3 * (at - before),
                "notes": f"done {base + at:.2f} s after {since}",
            }
        )
        if name == "first_step":
            rows += first_step_rows(case, startup.get("first_step_detail") or {}, at - before)
        before = at
    return rows


def first_step_rows(case: str, detail: dict[str, float], first_step_s: float) -> list[dict]:
    """One row per part of the first step (the startup record's first_step_detail), then the rest of it."""
    if not detail:
        return []
    rows = [
        {
            "case": case,
            "impl": f"startup: first_step: {part}",
            "ms": 1e3 * seconds,
            "notes": f"{first_step_part(part)}, {100 * seconds / max(first_step_s, 1e-9):.0f} % of the first step",
        }
        for part, seconds in detail.items()
    ]
    rest = first_step_s - sum(detail.values())
    rows.append(
        {
            "case": case,
            "impl": "startup: first_step: rest",
            "ms": 1e3 * rest,
            "notes": "the batch check and copy, undoing the warm-up, the first replay",
        }
    )
    return rows


def first_step_part(part: str) -> str:
    """A part of the first step (GraphedTrainStep.setup_seconds) in words."""
    if part == "capture":
        return "the CUDA-graph capture"
    if part == "warmup_step_1":
        return "eager warm-up step 1 (cuDNN autotuning, optimizer state allocation)"
    if part.startswith("warmup_step_"):
        return f"eager warm-up step {part.removeprefix('warmup_step_')}"
    return part


def import_profile(top: int = 8) -> tuple[float, list[tuple[str, float]]]:
    """One fresh interpreter importing the trainer (torch, torchvision, the model, the data code) under
    `python -X importtime`: its wall seconds, and the `top` longest imports as (package, seconds), each module's own
    time summed over its package's first two name parts (torch._dynamo, sympy.polys)."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import lss.engine.train"],
        check=True,
        capture_output=True,
        text=True,
        env=child_env_with_stacks(),
    )
    wall = time.perf_counter() - start
    seconds: dict[str, float] = {}
    for own_us, module in re.findall(
        r"^import time:\s+(\d+) \|\s+\d+ \|\s*(\S+)", done.stderr, re.M
    ):
        package = ".".join(module.split(".")[:2])
        seconds[package] = seconds.get(package, 0.0) + int(own_us) / 1e6
    return wall, sorted(seconds.items(), key=lambda item: -item[1])[:top]


def import_row(case: str, impl: str, when: str) -> dict:
    """The row of one import_profile (a fresh interpreter importing the trainer), `when` said in its notes."""
    try:
        wall, breakdown = import_profile()
    except subprocess.CalledProcessError as e:
        return {"case": case, "impl": impl, "ms": None, "notes": f"FAILED: {e}"}
    longest = ", ".join(f"{package} {s:.2f} s" for package, s in breakdown)
    return {
        "case": case,
        "impl": impl,
        "ms": 1e3 * wall,
        "notes": f"a fresh interpreter importing lss.engine.train (part of process start -> train()), {when}; "
        f"longest (own time by package, -X importtime): {longest}",
    }


def loader_rate(
    config: str, overrides: list[str], device: torch.device, batches: int
) -> tuple[float, int]:
    """Batches/s of the training loader alone (dataset, sampler, workers and pinning as the trainer builds them),
    after every worker has delivered a first batch; returns (rate, workers)."""
    from lss.config import load_config
    from lss.data.loader import build_dataset, build_loader, loader_workers
    from lss.data.samplers import EpochSampler, StreamSampler

    cfg = load_config(resolve_config(config), overrides)
    t = cfg.train
    dataset = build_dataset(cfg, cfg.data.train_split, True)
    sampler = StreamSampler(EpochSampler(len(dataset), shuffle=True, seed=t.seed), t.batch_size)
    loader = build_loader(cfg, dataset, sampler, t.batch_size, True, device, t.seed)
    stream = iter(loader)
    for _ in range(max(2 * loader_workers(cfg), 1)):
        next(stream)
    start = time.perf_counter()
    for _ in range(batches):
        next(stream)
    rate = batches / (time.perf_counter() - start)
    del stream
    return rate, loader_workers(cfg)


def step_impl(cfg, device: torch.device) -> str:
    """The benchmarks.train_step variant that runs what cfg.train selects."""
    from lss.engine.distributed import DistInfo
    from lss.engine.step import choose_step

    t = cfg.train
    if device.type == "cuda" and choose_step(cfg, device, DistInfo()).kind == "captured":
        if not t.compile:
            return "lss_cuda_graph"
        return (
            "lss_cuda_graph_compiled_budget"
            if t.compile_memory_budget < 1
            else "lss_cuda_graph_compiled"
        )
    if device.type == "cuda" and t.compile:
        return "lss_compiled"
    return "lss_fp32" if t.amp == "none" else "lss"


def step_rate(ctx, config: str, overrides: list[str]) -> tuple[float, str]:
    """Steps/s of train_step's step at the loop's config (batch size, cameras per sample, grid, recipe, memory
    layout)."""
    from benchmarks import train_step
    from lss.config import NUSCENES_CAMERAS, load_config

    cfg = load_config(resolve_config(config), overrides)
    torch.backends.cudnn.benchmark = cfg.train.cudnn_benchmark  # as the trainer sets it
    device = ctx.device
    impl = step_impl(cfg, device)
    if cfg.data.num_train_cameras:
        cfg.data.cameras = tuple(c for c in NUSCENES_CAMERAS if c in cfg.data.cameras)[
            : cfg.data.num_train_cameras
        ]
    model, loss_fn, autocast = train_step._build(
        cfg, impl, device, channels_last=cfg.train.channels_last
    )
    batches = train_step.random_batches(cfg, cfg.train.batch_size, device)
    if (
        cfg.data.depth_targets
    ):  # the loop's batches carry lidar depth bins; random ones cost the step the same
        lo, hi, size = cfg.grid.dbound
        h, w = (d // cfg.model.downsample for d in cfg.data.final_dim)
        g = torch.Generator().manual_seed(0)
        for batch in batches:
            shape = (*batch["images"].shape[:2], h, w)
            batch["depth_targets"] = torch.randint(
                -1, round((hi - lo) / size), shape, generator=g
            ).to(device)
    if impl.startswith("lss_cuda_graph"):
        step, _, _ = train_step.make_graphed_train_step(cfg, model, loss_fn, batches)
    else:
        step, _ = train_step.make_train_step(cfg, model, loss_fn, autocast, batches)
    model.train()
    for _ in range(1 if ctx.quick else 3):
        step()
    ms = ctx.time(step, warmup=3, reps=20)
    return 1e3 / ms, impl


def eval_rate(config: str, overrides: list[str], ckpt: Path, out: Path, timeout: float) -> dict:
    """`lss eval` of `ckpt` on the training split: eval.json's "timing" (samples/s after the first batch)."""
    target = out / "eval"
    cmd = lss_command(
        "eval",
        config,
        overrides + ["data.val_split=train"],
        "--ckpt",
        str(ckpt),
        "--out",
        str(target),
    )
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env_with_stacks(),
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc, signal.SIGABRT, 5)
        output, _ = (
            proc.communicate()
        )  # what communicate() had read before the timeout, and the rest
        raise RuntimeError(
            f"`{shlex.join(cmd)}` ran past {timeout:.0f} s:\n{output[-3000:]}"
        ) from None
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"`{shlex.join(cmd)}` failed:\n{output[-2000:]}")
    result = json.loads((target / "eval.json").read_text())
    return {"wall_s": wall, **result["timing"]}


def run(ctx) -> list[dict]:
    env = os.environ
    quick = ctx.quick
    config = env.get("LSS_LOOP_CONFIG", "configs/synthetic_segmentation.yaml")
    steps = int(env.get("LSS_LOOP_STEPS", 5 if quick else 300))
    out = Path(env.get("LSS_LOOP_OUT") or tempfile.mkdtemp(prefix="lss_train_loop_"))
    out.mkdir(parents=True, exist_ok=True)
    if env.get("LSS_LOOP_DATA"):
        dataroot, version = Path(env["LSS_LOOP_DATA"]), env.get("LSS_LOOP_VERSION", "v1.0-mini")
    else:
        spec = QUICK_SET if quick else LOOP_SET
        dataroot, version = out / "data", spec.version
        ensure_synthetic_set(dataroot, spec)
    overrides = loop_overrides(dataroot.resolve(), version, steps, quick)
    if not quick and torch.cuda.is_available():
        overrides.append(f"data.workers={min(12, os.cpu_count() or 1)}")
    overrides += [o.strip() for o in env.get("LSS_LOOP_SET", "").split(";") if o.strip()]
    run_dir = out / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    case = f"{Path(config).stem}, {steps} steps"
    imports = [
        import_row(case, "startup: imports, first", "writes the bytecode where it is missing")
    ]
    cmd = lss_command("train", config, overrides, "--out", str(run_dir), "--overwrite")
    total, seen, code = watch_train(cmd, run_dir, timeout=float(env.get("LSS_LOOP_TIMEOUT", 180)))
    records = read_jsonl(run_dir / "metrics.jsonl")
    failed = []
    if (
        code != 0
    ):  # the rows of what it did still come, when the loop got far enough (a hang after it, say)
        done = max((r["step"] for r in records if r.get("kind") == "train"), default=0)
        failed = [
            {
                "case": case,
                "impl": "lss train",
                "ms": None,
                "notes": f"FAILED (exit {code}) after {total:.0f} s, {done} steps logged: "
                + log_tail(run_dir / "train.log", 40).replace("\n", " | "),
            }
        ]
        if sum(r.get("kind") == "train" for r in records) < 3:
            return startup_rows(case, records, None) + failed
    loop = loop_rates(records, seen)
    call = loop.get("train_call_s")
    startup = startup_rows(case, records, call)
    first = (
        next((r for r in records if r.get("kind") == "startup"), {})
        .get("phases", {})
        .get("first_step")
    )
    first_s = call + first if call is not None and first is not None else None
    rows = [
        {
            "case": case,
            "impl": "first_step",
            "ms": 1e3 * first_s if first_s else None,
            "notes": (
                f"process start to step 1 done: process start -> train() {call:.1f} s, train() -> step 1 "
                f"{first:.1f} s"
                if first_s
                else loop["source"]
            )
            + f"; run {total:.1f} s in all",
        }
    ]
    rows += startup + failed + imports
    rows.append(
        import_row(case, "startup: imports", "bytecode on disk, as the training run had it")
    )
    rows.append(
        {
            "case": case,
            "impl": "loop",
            "ms": 1e3 / loop["steady_steps_per_s"],
            "steps_per_s": loop["steady_steps_per_s"],
            "notes": f"{loop['steady_steps_per_s']:.2f} steps/s over the last {loop['steady_steps']} steps "
            f"({loop['source']})",
        }
    )
    rows += host_split_rows(case, records)
    val = [r for r in records if r.get("kind") == "val" and r.get("timing")]
    if val:
        timing = val[-1]["timing"]
        rate = timing.get("samples_per_s")
        rows.append(
            {
                "case": case,
                "impl": "final eval (in train)",
                "ms": 1e3 * timing["seconds"],
                "samples_per_s": rate,
                "notes": f"{timing['samples']} val samples in {timing['seconds']:.2f} s (first batch "
                f"{timing.get('first_batch_s', 0):.2f} s"
                + (f", then {rate:.1f} samples/s)" if rate else ")"),
            }
        )
    try:
        rate, workers = loader_rate(config, overrides, ctx.device, 5 if quick else 300)
        rows.append(
            {
                "case": case,
                "impl": "loader alone",
                "ms": 1e3 / rate,
                "steps_per_s": rate,
                "notes": f"{rate:.2f} batches/s from {workers} workers, no model; loop / loader = "
                f"{loop['steady_steps_per_s'] / rate:.3f}",
            }
        )
    except Exception as e:  # the loop numbers stand on their own
        rows.append(
            {
                "case": case,
                "impl": "loader alone",
                "ms": None,
                "notes": f"FAILED: {type(e).__name__}: {e}",
            }
        )
    step_row: Optional[dict] = None
    try:
        rate, impl = step_rate(ctx, config, overrides)
        step_row = {
            "case": case,
            "impl": f"step alone ({impl})",
            "ms": 1e3 / rate,
            "steps_per_s": rate,
            "notes": f"{rate:.2f} steps/s; loop / step = {loop['steady_steps_per_s'] / rate:.3f}",
        }
        rows.append(step_row)
    except (
        Exception
    ) as e:  # the loop numbers stand on their own when the step benchmark cannot build this config
        rows.append(
            {
                "case": case,
                "impl": "step alone",
                "ms": None,
                "notes": f"not measured: {type(e).__name__}: {e}",
            }
        )
    if step_row is not None:
        rows.append(
            {
                "case": case,
                "impl": "loop/step",
                "ms": None,
                "ratio": loop["steady_steps_per_s"] / step_row["steps_per_s"],
                "notes": f"{loop['steady_steps_per_s'] / step_row['steps_per_s']:.3f} (1 = as fast as the step)",
            }
        )
    from lss.config import load_config

    batch = load_config(resolve_config(config), overrides).eval.batch_size
    try:
        ev = eval_rate(config, overrides, run_dir / "checkpoints" / "last.pt", out, timeout=120)
        rate = ev.get("samples_per_s")
        rows.append(
            {
                "case": case,
                "impl": "eval",
                "ms": 1e3 * batch / rate if rate else None,
                "samples_per_s": rate,
                "notes": (
                    f"{rate:.1f} samples/s after the first batch" if rate else "one batch only"
                )
                + f" ({ev['samples']} samples of the train split; first batch {ev.get('first_batch_s', 0):.2f} "
                f"s, pass {ev['seconds']:.2f} s, lss eval wall {ev['wall_s']:.1f} s); ms per batch of {batch}",
            }
        )
    except (RuntimeError, KeyError) as e:
        rows.append(
            {"case": case, "impl": "eval", "ms": None, "notes": f"FAILED: {str(e)[-1500:]}"}
        )
    return rows
