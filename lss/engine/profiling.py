"""`train.profile_steps`: torch.profiler over chosen steps of the real training loop (the loader,
the step as the run takes it: eager, compiled or one CUDA graph replay, and the hooks), so that the
loop's time per step can be set beside the GPU's kernel time of the same steps."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import torch
from torch.profiler import ProfilerActivity, profile

from lss.engine.hooks import Hook


class ProfileHook(Hook):
    """Profiles steps first .. first + count - 1 (`profile_steps`): the profiler starts when step
    first - 1 has ended and stops (after a device synchronize) when the last profiled step has, so
    the window holds each step's batch fetch, the step and the hooks. Writes `out_dir`/trace.json
    (chrome://tracing, Perfetto) and summary.json (summarize) and prints one line."""

    def __init__(self, profile_steps: tuple[int, int], out_dir: Path):
        self.first, self.count = int(profile_steps[0]), int(profile_steps[1])
        self.out_dir = Path(out_dir)
        self.prof: Optional[profile] = None
        self.started = 0.0
        self.fetch_s = 0.0
        self.summary: Optional[dict] = None
        self.done = False

    def after_step(self, trainer, logs) -> None:
        step = trainer.step
        if step == self.first - 1 and self.prof is None:
            activities = [ProfilerActivity.CPU]
            if trainer.device.type == "cuda":
                torch.cuda.synchronize(trainer.device)
                activities.append(ProfilerActivity.CUDA)
            self.prof = profile(activities=activities)
            self.prof.__enter__()
            self.started = time.perf_counter()
            return
        if self.prof is None or not self.first <= step < self.first + self.count:
            return
        self.fetch_s += logs.host["fetched"] - logs.host["start"]
        if step == self.first + self.count - 1:
            if trainer.device.type == "cuda":
                torch.cuda.synchronize(trainer.device)
            wall = time.perf_counter() - self.started
            self.prof.__exit__(None, None, None)
            self.write(summarize(self.prof, self.count, wall, self.fetch_s, trainer.device))
            self.prof = None
            self.done = True

    def write(self, summary: dict) -> None:
        self.summary = summary
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        self.prof.export_chrome_trace(str(self.out_dir / "trace.json"))
        gpu = summary["gpu_kernel_ms_per_step"]
        print(
            f"lss: profiled steps {self.first}-{self.first + self.count - 1}: "
            f"{summary['wall_ms_per_step']:.2f} ms per step in the loop ("
            f"{summary['data_wait_ms_per_step']:.2f} ms waiting for data)"
            + (f", GPU kernels {gpu:.2f} ms per step" if gpu is not None else "")
            + f"; {self.out_dir}/summary.json, trace.json"
        )

    def close(self) -> None:
        if self.prof is not None and not self.done:  # training ended inside the window
            self.prof.__exit__(None, None, None)
            self.prof = None


def summarize(
    prof: profile, steps: int, wall_s: float, fetch_s: float, device: torch.device, top: int = 25
) -> dict:
    """Per-step figures of a profiled window of `steps` steps that took `wall_s` seconds, `fetch_s`
    of them waiting for batches: the loop's time, the summed GPU kernel time and its share of the
    loop's (None on a CPU), memory copies (their own line: host-to-device batch copies), kernel
    launches, and the top kernels and host operators by time."""
    events = prof.key_averages()
    cuda = torch.autograd.DeviceType.CUDA
    kernels = [e for e in events if e.device_type == cuda and e.device_time_total > 0]
    on_gpu = device.type == "cuda"
    gpu_us = sum(e.device_time_total for e in kernels)
    copies = [e for e in kernels if "memcpy" in e.key.lower() or "memset" in e.key.lower()]

    def per_step(us: float) -> float:
        return round(us / steps / 1e3, 4)

    wall_ms = wall_s / steps * 1e3
    host = sorted(
        (e for e in events if e.self_cpu_time_total > 0), key=lambda e: -e.self_cpu_time_total
    )
    return {
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "torch": torch.__version__,
        "steps": steps,
        "wall_ms_per_step": round(wall_ms, 4),
        "data_wait_ms_per_step": round(fetch_s / steps * 1e3, 4),
        "gpu_kernel_ms_per_step": per_step(gpu_us) if on_gpu else None,
        "gpu_busy_share": round(gpu_us / steps / 1e3 / wall_ms, 4) if on_gpu else None,
        "copy_ms_per_step": per_step(sum(e.device_time_total for e in copies)) if on_gpu else None,
        "kernels_per_step": round(sum(e.count for e in kernels) / steps, 1) if on_gpu else None,
        "top_kernels": [
            {
                "name": e.key[:160],
                "ms_per_step": per_step(e.device_time_total),
                "calls_per_step": round(e.count / steps, 2),
                "share": round(e.device_time_total / gpu_us, 4),
            }
            for e in sorted(kernels, key=lambda e: -e.device_time_total)[:top]
        ],
        "top_host_ops": [
            {
                "name": e.key[:160],
                "self_ms_per_step": per_step(e.self_cpu_time_total),
                "calls_per_step": round(e.count / steps, 2),
            }
            for e in host[:top]
        ],
    }
