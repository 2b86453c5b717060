"""Benchmark harness: times ops with CUDA events (median after warm-up) against named peers in the same run and
writes a JSON file and a markdown table. Suites live in benchmarks/<name>.py and expose `run(ctx) -> rows`."""

from __future__ import annotations

import datetime as _dt
import importlib
import json
import pkgutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from lss.errors import ArgumentError


@dataclass
class BenchContext:
    device: torch.device
    quick: bool = False  # fewer repetitions and smaller cases (CPU smoke runs, CI)
    bandwidth: float = 0.0  # measured device memory bandwidth, bytes/s (read + write), 0 if unknown
    meta: dict = field(default_factory=dict)

    def time(self, fn: Callable[[], object], warmup: int = 10, reps: int = 50) -> float:
        """Median milliseconds of `fn()` over `reps` runs after `warmup` runs."""
        if self.quick:
            warmup, reps = min(warmup, 2), min(reps, 5)
        fn()  # the cold call (lazy kernel loading, allocator growth, autotuning) decides nothing
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if (
            time.perf_counter() - t0 > 0.05
        ):  # a slow peer: a few repetitions give its median well enough
            warmup, reps = 2, min(reps, 3)
        for _ in range(warmup - 2):
            fn()
        times = []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            for _ in range(reps):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
        else:
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def time_graphed(self, fn: Callable[[], object], warmup: int = 3) -> float:
        """Median milliseconds of replaying `fn` captured as one CUDA graph: the GPU time of what `fn` launches,
        without its Python, dispatch and launch overhead. Raises RuntimeError when `fn` cannot be captured."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(
            side
        ):  # warm-up off the capture stream, as torch.cuda.graph requires
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return self.time(graph.replay)

    def floor_ms(self, nbytes: float) -> Optional[float]:
        """Time to move `nbytes` through device memory at the measured bandwidth (the physical floor)."""
        return nbytes / self.bandwidth * 1e3 if self.bandwidth > 0 else None


def kernel_table(step: Callable[[], object], iters: int) -> list[tuple[float, float, str]]:
    """(mean us per call, launches per call, name) of every device activity of `step` (CUDA kernels, memsets,
    copies) under torch.profiler, largest first: the GPU time per kernel, without host overhead."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    rows = [
        (ev.device_time_total / iters, ev.count / iters, ev.key)
        for ev in prof.key_averages()
        if ev.device_time_total > 0
    ]
    return sorted(rows, reverse=True)


def measure_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    if device.type != "cuda":
        return 0.0
    n = nbytes // 4
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ctx = BenchContext(device)
    ms = ctx.time(lambda: dst.copy_(src), warmup=3, reps=10)
    del src, dst
    return 2 * n * 4 / (ms * 1e-3)


# suites that train models for minutes or generate a data set instead of timing ops: they run only when named
# (--suite accuracy)
OPT_IN_SUITES = ("accuracy", "ddp", "predict", "train_loop")


def available_suites(opt_in: bool = False) -> list[str]:
    """The suites a plain `lss bench` runs; with `opt_in`, also OPT_IN_SUITES."""
    import benchmarks as pkg

    names = sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_"))
    return [n for n in names if opt_in or n not in OPT_IN_SUITES]


def device_meta(device: torch.device) -> dict:
    meta = {
        "date": _dt.date.today().isoformat(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    return meta


def to_markdown(rows: list[dict], meta: dict) -> str:
    head = (
        f"Device: {meta['device']}; torch {meta['torch']} (CUDA {meta['cuda']}); date {meta['date']}; "
        f"measured copy bandwidth {meta.get('bandwidth_GBps', 0):.0f} GB/s.\n\n"
    )
    cols = ["suite", "case", "impl", "ms", "vs_ours", "floor_ms", "notes"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(f"{v:.4g}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def add_ratios(rows: list[dict]) -> list[dict]:
    """For each (suite, case), vs_ours = peer time / our time (>1 means ours is faster)."""
    ours = {(r["suite"], r["case"]): r["ms"] for r in rows if r.get("impl") == "lss"}
    for r in rows:
        key = (r["suite"], r["case"])
        if key in ours and ours[key] > 0 and r.get("ms"):
            r["vs_ours"] = r["ms"] / ours[key]
    return rows


def run(
    suites: Optional[list[str]] = None,
    device: Optional[str] = None,
    out_dir: Optional[str] = None,
    quick: bool = False,
) -> list[dict]:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    names = suites or available_suites()
    unknown = sorted(set(names) - set(available_suites(opt_in=True)))
    if unknown:
        raise ArgumentError(
            f"unknown benchmark suite(s) {unknown}; available: {available_suites(opt_in=True)}"
        )
    ctx = BenchContext(dev, quick=quick, bandwidth=measure_bandwidth(dev))
    ctx.meta = device_meta(dev)
    ctx.meta["bandwidth_GBps"] = ctx.bandwidth / 1e9
    rows: list[dict] = []
    for name in names:
        mod = importlib.import_module(f"benchmarks.{name}")
        for row in mod.run(ctx):
            row.setdefault("suite", name)
            rows.append(row)
            print(json.dumps(row), flush=True)
    rows = add_ratios(rows)
    md = to_markdown(rows, ctx.meta)
    print(md)
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps({"meta": ctx.meta, "rows": rows}, indent=1))
        (out / "bench.md").write_text(md)
    return rows
