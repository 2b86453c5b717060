"""Probe of the training step of configs/synthetic_segmentation.yaml (or --config) on a GPU: the first call (warm-up,
compilation, capture) and the captured step's replay time for one layout (train.channels_last's values, or
"hybrid": channels-last but for the depthwise convolutions), optionally compiled (with the compiler's phase times),
optionally with a kernel profile of eager steps. Random images on the real rig, random depth targets (and, with the
detection head, the targets of random boxes); prints one JSON line first.

    python scripts/probe_step.py [--config configs/synthetic.yaml] --layout bev [--compile [--inductor-defaults]]
        [--profile] [--replays 60]

scripts/gpu_probe.sh runs the layouts and two cold compilations, each in a process of its own (docs/benchmarks.md)."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

T0 = time.perf_counter()

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's benchmarks/
from benchmarks.train_step import make_train_step, random_batches  # noqa: E402
from lss.config import load_config  # noqa: E402
from lss.engine.optim import build_optimizer  # noqa: E402
from lss.models.build import apply_channels_last  # noqa: E402
from lss.engine.step import GraphedTrainStep, compile_encoders  # noqa: E402
from lss.models.losses import TotalLoss  # noqa: E402
from lss.models import LiftSplatShoot  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/synthetic_segmentation.yaml",
                   help="the config whose step is probed (with the detection head: random boxes as its targets)")
    p.add_argument("--layout", default="bev")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--replays", type=int, default=60)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--inductor-defaults", action="store_true",
                   help="with --compile: Inductor's own settings, not lss.engine.step.compiled.fast_start_compiler's")
    a = p.parse_args()
    if a.inductor_defaults:
        import lss.engine.step.compiled as compiled

        compiled.fast_start_compiler = lambda start_workers: []
    imports_s = time.perf_counter() - T0
    hybrid = a.layout == "hybrid"
    cfg = load_config(a.config, [f"train.channels_last={'true' if hybrid else a.layout}", *a.set])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = apply_channels_last(LiftSplatShoot(cfg).to(device), cfg.train.channels_last)
    if hybrid:  # channels-last everywhere but the depthwise convolutions (NCHW in and out of them)
        n_dw = 0
        for m in model.modules():
            if isinstance(m, torch.nn.Conv2d) and m.groups > 1 and m.groups == m.in_channels:
                m.weight.data = m.weight.data.contiguous()
                m.register_forward_pre_hook(lambda mod, args: (args[0].contiguous(),) + tuple(args[1:]))
                m.register_forward_hook(lambda mod, args, out: out.contiguous(memory_format=torch.channels_last))
                n_dw += 1
        print("depthwise convolutions kept NCHW:", n_dw)
    if a.compile:
        compile_encoders(model, cfg.train.compile_mode, cfg.train.compile_memory_budget)
    loss_fn = TotalLoss(cfg).to(device)
    batches = random_batches(cfg, cfg.train.batch_size, device, 2)
    fh, fw = cfg.data.final_dim[0] // 16, cfg.data.final_dim[1] // 16
    bins = model.splat.depth_bins
    g = torch.Generator().manual_seed(1)
    for b in batches:
        n = b["images"].shape[1]
        b["depth_targets"] = torch.randint(-1, bins, (cfg.train.batch_size, n, fh, fw), generator=g).to(device)
    optimizer = build_optimizer(cfg, model)
    step = GraphedTrainStep(model, loss_fn, optimizer, torch.bfloat16 if device.type == "cuda" else None,
                            cfg.optim.grad_clip, capture=device.type == "cuda")
    t = time.perf_counter()
    step(batches[0])
    if device.type == "cuda":
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t
    times = []
    if device.type != "cuda":
        print(json.dumps({"first_call_s": first_s}))
        return
    for i in range(a.replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(batches[i % 2])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    row = {"config": a.config, "layout": a.layout, "compile": a.compile, "inductor_defaults": a.inductor_defaults,
           "set": a.set,
           "imports_s": round(imports_s, 2),
           "first_call_s": round(first_s, 2), "setup": {k: round(v, 2) for k, v in step.setup_seconds.items()},
           "replay_ms": round(statistics.median(times[5:]), 3), "peak_gb": round(step.peak_bytes / 1e9, 2)}
    if a.compile:
        from torch._dynamo.utils import compile_times

        row["compile_times"] = compile_times(repr="str", aggregate=True)
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        eager_step, _ = make_train_step(cfg, model, loss_fn, lambda: torch.autocast("cuda", dtype=torch.bfloat16),
                                        batches)
        for _ in range(3):
            eager_step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                eager_step()
            torch.cuda.synchronize()
        row["kernels"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
    print(json.dumps(row), flush=True)
    if "kernels" in row:
        print(row["kernels"])
    if "compile_times" in row:
        print(row["compile_times"])


if __name__ == "__main__":
    main()
