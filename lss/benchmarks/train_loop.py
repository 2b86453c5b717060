"""Training-loop benchmark: the real `lss train` loop in a subprocess on a small synthetic set, against the step alone.

Rows: time from process start to the first completed step (the wrapper's spawn time to the first "train" record of
metrics.jsonl, split at train()'s call by the record's `elapsed`), steps/s of the loop in steady state (from
`elapsed` of later records; from the times the wrapper saw the records appear where `elapsed` is missing), steps/s
of the step alone at the same config (lss.benchmarks.train_step's step on random batches of the same shape), their
ratio, and validation samples/s of `lss eval` (two runs of different length, so that start-up cancels).

Environment: LSS_LOOP_CONFIG (default configs/synthetic.yaml), LSS_LOOP_STEPS, LSS_LOOP_DATA (a synthetic set to
reuse; LSS_LOOP_VERSION its version, default v1.0-mini), LSS_LOOP_OUT (run directory; default a temporary one),
LSS_LOOP_SET (more config overrides, separated by ";", e.g. "train.cudnn_benchmark=false;data.workers=8").
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from lss.benchmarks._runs import (SyntheticSet, child_env, ensure_synthetic_set, log_tail, lss_command,
                                  read_jsonl, resolve_config)
from lss.benchmarks.accuracy import QUICK_OVERRIDES, QUICK_SET

LOOP_SET = SyntheticSet("v1.0-mini", scenes=4, samples_per_scene=20, image_size=(1600, 900), seed=0)
WARMUP_FRACTION = 0.2  # records before this fraction of the run (compile, capture, autotuning) are not steady state
POLL_S = 0.01


def loop_overrides(dataroot: Path, version: str, steps: int, quick: bool) -> list[str]:
    return (list(QUICK_OVERRIDES) if quick else []) + [
        f"data.dataroot={dataroot}", f"data.version={version}", "data.make_synthetic_if_missing=false",
        f"train.max_steps={steps}", "train.log_every=1", "train.eval_every=0", "train.ckpt_every=0",
        "train.viz_every=0"] + (["data.workers=0"] if quick else [])


def watch_train(cmd: list[str], run_dir: Path, timeout: float) -> tuple[float, dict[int, float], int]:
    """Run `cmd`, noting when each "train" record of run_dir/metrics.jsonl appears (seconds after the spawn).
    Returns (total seconds, step -> seconds seen, exit code)."""
    metrics = run_dir / "metrics.jsonl"
    seen: dict[int, float] = {}
    start = time.perf_counter()
    with (run_dir / "train.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(os.cpu_count() or 1))
        while True:
            code = proc.poll()
            now = time.perf_counter() - start
            for r in read_jsonl(metrics):
                if r.get("kind") == "train":
                    seen.setdefault(r["step"], now)
            if code is not None:
                return now, seen, code
            if now > timeout:
                proc.kill()
                proc.wait()
                return now, seen, -9
            time.sleep(POLL_S)


def loop_rates(records: list[dict], seen: dict[int, float]) -> dict:
    """First-step and steady-state numbers from the train records (with `elapsed` where the trainer writes it)."""
    records = sorted((r for r in records if r.get("kind") == "train"), key=lambda r: r["step"])
    if len(records) < 3:
        raise ValueError(f"need at least 3 train records to time the loop, got {len(records)}")
    has_elapsed = all("elapsed" in r for r in records)
    clock = {r["step"]: (r["elapsed"] if has_elapsed else seen[r["step"]]) for r in records}
    first = records[0]["step"]
    skip = max(1, int(len(records) * WARMUP_FRACTION))
    a, b = records[skip]["step"], records[-1]["step"]
    out = {"first_step": first, "first_step_s": seen.get(first), "steady_steps": b - a,
           "steady_steps_per_s": (b - a) / max(clock[b] - clock[a], 1e-9), "source": "elapsed" if has_elapsed
           else "wrapper clock (metrics.jsonl has no elapsed field)"}
    if has_elapsed and first in seen:
        out["train_call_s"] = seen[first] - records[0]["elapsed"]  # process start -> train() called
        out["train_to_first_step_s"] = records[0]["elapsed"]
    return out


def step_impl(cfg, device: torch.device) -> str:
    """The lss.benchmarks.train_step variant that runs what cfg.train selects."""
    t = cfg.train
    if device.type == "cuda" and t.cuda_graph:
        if not t.compile:
            return "lss_cuda_graph"
        return "lss_cuda_graph_compiled_budget" if t.compile_memory_budget < 1 else "lss_cuda_graph_compiled"
    if device.type == "cuda" and t.compile:
        return "lss_compiled"
    return "lss_fp32" if t.amp == "none" else "lss"


def step_rate(ctx, config: str, overrides: list[str]) -> tuple[float, str]:
    """Steps/s of train_step's step at the loop's config (batch size, cameras per sample, grid, recipe)."""
    from lss.benchmarks import train_step
    from lss.config import NUSCENES_CAMERAS, load_config

    cfg = load_config(resolve_config(config), overrides)
    torch.backends.cudnn.benchmark = cfg.train.cudnn_benchmark  # as the trainer sets it
    device = ctx.device
    impl = step_impl(cfg, device)
    if cfg.data.num_train_cameras:
        cfg.data.cameras = tuple(c for c in NUSCENES_CAMERAS if c in cfg.data.cameras)[:cfg.data.num_train_cameras]
    model, loss_fn, autocast = train_step._build(cfg, impl, device)
    batches = train_step.random_batches(cfg, cfg.train.batch_size, device)
    if cfg.data.depth_targets:  # the loop's batches carry lidar depth bins; random ones cost the step the same
        lo, hi, size = cfg.grid.dbound
        h, w = (d // cfg.model.downsample for d in cfg.data.final_dim)
        g = torch.Generator().manual_seed(0)
        for batch in batches:
            shape = (*batch["images"].shape[:2], h, w)
            batch["depth_targets"] = torch.randint(-1, round((hi - lo) / size), shape, generator=g).to(device)
    if impl.startswith("lss_cuda_graph"):
        step, _, _ = train_step.make_graphed_train_step(cfg, model, loss_fn, batches)
    else:
        step, _ = train_step.make_train_step(cfg, model, loss_fn, autocast, batches)
    model.train()
    for _ in range(1 if ctx.quick else 3):
        step()
    ms = ctx.time(step, warmup=3, reps=20)
    return 1e3 / ms, impl


def eval_rate(config: str, overrides: list[str], ckpt: Path, out: Path, batch_size: int,
              timeout: float) -> dict:
    """Validation samples/s of `lss eval`: one run over 1 batch and one over the whole split; the difference of
    their wall times is the time of the other batches (start-up, model build and the first batch cancel)."""
    walls, samples = [], None
    for limit in (1, None):
        extra = [f"eval.max_batches={limit if limit else 'null'}"]
        target = out / f"eval_{limit or 'all'}"
        cmd = lss_command("eval", config, overrides + extra, "--ckpt", str(ckpt), "--out", str(target))
        start = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env(os.cpu_count() or 1))
        walls.append(time.perf_counter() - start)
        if done.returncode != 0:
            raise RuntimeError(f"`{shlex.join(cmd)}` failed:\n{(done.stdout + done.stderr)[-2000:]}")
        samples = json.loads((target / "eval.json").read_text())["samples"]
    if samples <= batch_size or walls[1] - walls[0] < 0.05:  # nothing left to time beyond the first batch
        return {"samples": samples, "wall_s": walls[1], "samples_per_s": None}
    rest = samples - batch_size
    return {"samples": samples, "wall_s": walls[1], "samples_per_s": rest / max(walls[1] - walls[0], 1e-9)}


def run(ctx) -> list[dict]:
    env = os.environ
    quick = ctx.quick
    config = env.get("LSS_LOOP_CONFIG", "configs/synthetic.yaml")
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
    cmd = lss_command("train", config, overrides, "--out", str(run_dir), "--overwrite")
    total, seen, code = watch_train(cmd, run_dir, timeout=float(env.get("LSS_LOOP_TIMEOUT", 540)))
    case = f"{Path(config).stem}, {steps} steps"
    if code != 0:
        return [{"case": case, "impl": "lss train", "ms": None,
                 "notes": f"FAILED (exit {code}): " + log_tail(run_dir / "train.log", 5).replace("\n", " | ")}]
    loop = loop_rates(read_jsonl(run_dir / "metrics.jsonl"), seen)
    split = (f"process start -> train() {loop['train_call_s']:.1f} s, train() -> step 1 "
             f"{loop['train_to_first_step_s']:.1f} s" if "train_call_s" in loop else loop["source"])
    rows = [{"case": case, "impl": "first_step", "ms": 1e3 * loop["first_step_s"] if loop["first_step_s"] else None,
             "notes": f"process start to step {loop['first_step']} done: {split}; run {total:.1f} s in all"},
            {"case": case, "impl": "loop", "ms": 1e3 / loop["steady_steps_per_s"],
             "steps_per_s": loop["steady_steps_per_s"],
             "notes": f"{loop['steady_steps_per_s']:.2f} steps/s over the last {loop['steady_steps']} steps "
                      f"({loop['source']})"}]
    step_row: Optional[dict] = None
    try:
        rate, impl = step_rate(ctx, config, overrides)
        step_row = {"case": case, "impl": f"step alone ({impl})", "ms": 1e3 / rate, "steps_per_s": rate,
                    "notes": f"{rate:.2f} steps/s; loop / step = {loop['steady_steps_per_s'] / rate:.3f}"}
        rows.append(step_row)
    except Exception as e:  # the loop numbers stand on their own when the step benchmark cannot build this config
        rows.append({"case": case, "impl": "step alone", "ms": None, "notes": f"not measured: {type(e).__name__}: {e}"})
    if step_row is not None:
        rows.append({"case": case, "impl": "loop/step", "ms": None,
                     "ratio": loop["steady_steps_per_s"] / step_row["steps_per_s"],
                     "notes": f"{loop['steady_steps_per_s'] / step_row['steps_per_s']:.3f} (1 = as fast as the step)"})
    from lss.config import load_config

    batch = load_config(resolve_config(config), overrides).eval.batch_size
    try:
        ev = eval_rate(config, overrides, run_dir / "checkpoints" / "last.pt", out, batch, timeout=300)
        rate = ev["samples_per_s"]
        rows.append({"case": case, "impl": "eval", "ms": 1e3 * batch / rate if rate else None,
                     "samples_per_s": rate, "notes": (f"{rate:.1f} val samples/s" if rate else "split too small")
                     + f" ({ev['samples']} samples, lss eval wall {ev['wall_s']:.1f} s); ms per batch of {batch}"})
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        rows.append({"case": case, "impl": "eval", "ms": None, "notes": f"FAILED: {str(e)[-300:]}"})
    return rows
