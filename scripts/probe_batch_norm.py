"""The camera trunk's batch norms alone, forward and backward in training mode, in each activation dtype and memory
layout: which kernels PyTorch picks (its own or cuDNN's) and how long the step's batch norms take with each. The
shapes are those of the camera encoder of `--config` (configs/synthetic.yaml: B4 x 6 cameras at 256x704), found on
the meta device; the weights stay float32 as under autocast. Prints one JSON line. On a CUDA machine:

    python scripts/probe_batch_norm.py
    python scripts/probe_batch_norm.py --variants bf16:nchw,fp16:nchw --repeats 50
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from lss.config import load_config  # noqa: E402
from lss.models import build_model  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LAYOUTS = {"nchw": torch.contiguous_format, "nhwc": torch.channels_last}
DEFAULT_VARIANTS = "bf16:nchw,bf16:nhwc,fp16:nchw,fp16:nhwc,fp32:nchw"


def batch_norm_shapes(module: nn.Module, input_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The input shape of every BatchNorm2d call of `module(torch.empty(input_shape))`, in call order, found on the
    meta device (the module is copied there; the original is left as it was)."""
    meta = copy.deepcopy(module).to("meta")
    shapes: list[tuple[int, ...]] = []
    hooks = [m.register_forward_pre_hook(lambda _m, args: shapes.append(tuple(args[0].shape)))
             for m in meta.modules() if isinstance(m, nn.BatchNorm2d)]
    try:
        with torch.no_grad():
            meta(torch.empty(input_shape, device="meta"))
    finally:
        for h in hooks:
            h.remove()
    return shapes


def parse_variants(text: str) -> list[tuple[str, str]]:
    """"bf16:nchw,fp16:nhwc" -> [("bf16", "nchw"), ("fp16", "nhwc")]; a bad entry is a ValueError naming the
    choices."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        dtype, _, layout = item.partition(":")
        if dtype not in DTYPES or layout not in LAYOUTS:
            raise ValueError(
                f"variant {item!r}: give DTYPE:LAYOUT with DTYPE one of {sorted(DTYPES)} and LAYOUT one of "
                f"{sorted(LAYOUTS)}, e.g. bf16:nchw"
            )
        out.append((dtype, layout))
    if not out:
        raise ValueError("no variant given: e.g. --variants bf16:nchw,fp16:nchw")
    return out


def time_variant(shapes, dtype: torch.dtype, layout, device: torch.device, repeats: int) -> dict:
    """Forward + backward of one training-mode batch norm per shape (float32 weight and bias, as under autocast),
    each call on its own tensors; returns the milliseconds of all of them per pass (median of `repeats` passes,
    CUDA events) and the names of the kernels the first shape ran."""
    calls = []
    for shape in shapes:
        bn = nn.BatchNorm2d(shape[1]).to(device).train()
        x = torch.randn(shape, device=device).to(dtype).contiguous(memory_format=layout).requires_grad_()
        grad = torch.randn(shape, device=device).to(dtype).contiguous(memory_format=layout)
        calls.append((bn, x, grad))

    def one_pass():
        for bn, x, grad in calls:
            y = torch.nn.functional.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, True, 0.1,
                                               bn.eps)
            y.backward(grad)
            x.grad = None
            bn.weight.grad = bn.bias.grad = None

    for _ in range(3):
        one_pass()
    kernels: list[str] = []
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        bn, x, grad = calls[0]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            y = torch.nn.functional.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, True, 0.1,
                                               bn.eps)
            y.backward(grad)
            torch.cuda.synchronize(device)
        kernels = sorted({e.name[:90] for e in prof.events() if e.device_type.name == "CUDA"})
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            one_pass()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            one_pass()
            times.append(1e3 * (time.perf_counter() - t0))
    times.sort()
    # bytes a fused forward + backward must move at least: x read twice (statistics, apply), y written, grad read
    # twice (reductions, input gradient) and x again, dx written: 7 tensors of the activation dtype
    size = torch.finfo(dtype).bits // 8
    floor_bytes = sum(7 * size * torch.Size(s).numel() for s in shapes)
    ms = times[len(times) // 2]
    return {"ms": round(ms, 3), "min_ms": round(times[0], 3), "floor_bytes": floor_bytes,
            "floor_gb": round(floor_bytes / 1e9, 3),
            "gb_per_s": round(floor_bytes / (ms * 1e-3) / 1e9, 1), "kernels": kernels}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/synthetic.yaml")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="DTYPE:LAYOUT,... (dtypes bf16, fp16, fp32)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    try:
        variants = parse_variants(args.variants)
    except ValueError as e:
        p.error(str(e))
    device = torch.device(args.device)
    cfg = load_config(args.config)
    model = build_model(cfg)
    b, n = cfg.train.batch_size, len(cfg.data.cameras)
    h, w = cfg.data.final_dim
    shapes = batch_norm_shapes(model.camera, (b * n, 3, h, w))
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
           "config": args.config, "batch_norms": len(shapes), "variants": {}}
    for dtype, layout in variants:
        out["variants"][f"{dtype}:{layout}"] = time_variant(shapes, DTYPES[dtype], LAYOUTS[layout], device,
                                                            args.repeats)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
