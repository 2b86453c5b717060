"""The first training call of the channels-last camera encoder and BEV encoder (configs/synthetic_segmentation.yaml's sizes:
B4 x 6 cameras at 256x704, the splatted 200x200 grid), with or without their convolutions warmed up first on
`--threads` threads (warm_convolutions below), and the steady call after it. One process per measurement (cuDNN
keeps what it built for the life of the process); prints one JSON line. On a CUDA machine:

    python scripts/probe_cudnn_warmup.py --threads 0     # cuDNN builds its kernels inside the first call
    python scripts/probe_cudnn_warmup.py --threads 16    # ... on 16 threads before it

The warm-up: every distinct `F.conv2d` call of the forward (shapes, stride, padding, dilation, groups, layout, which
operands need gradients), found by running the forward on the meta device, is called forward and backward on random
tensors of its shapes, one thread per call, so that cuDNN's kernel choices (and run-time compilations of
channels-last kernels) could run side by side instead of in a row inside the first step.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from lss.config import load_config  # noqa: E402
from lss.geometry import BevGrid  # noqa: E402
from lss.models import apply_channels_last, build_model  # noqa: E402


@dataclasses.dataclass(frozen=True)
class ConvCall:
    """One distinct convolution call: shapes B x C x H x W and O x C/groups x kH x kW."""

    input_shape: tuple[int, ...]
    weight_shape: tuple[int, ...]
    bias: bool
    stride: tuple[int, ...]
    padding: tuple[int, ...] | str
    dilation: tuple[int, ...]
    groups: int
    channels_last: bool
    input_grad: bool


def _pair(value) -> tuple[int, ...] | str:
    if isinstance(value, str):
        return value
    return tuple(value) if isinstance(value, (tuple, list)) else (int(value), int(value))


class _RecordConvolutions(TorchFunctionMode):
    def __init__(self, channels_last: bool):
        super().__init__()
        self.channels_last = channels_last
        self.calls: dict[ConvCall, None] = {}  # insertion-ordered set

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (F.conv2d, torch.conv2d):
            names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
            defaults = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}
            given = {**defaults, **dict(zip(names, args)), **kwargs}
            x, w = given["input"], given["weight"]
            if x.dim() == 4:
                self.calls[ConvCall(
                    tuple(x.shape), tuple(w.shape), given["bias"] is not None,
                    _pair(given["stride"]), _pair(given["padding"]), _pair(given["dilation"]),
                    int(given["groups"]), self.channels_last, x.requires_grad,
                )] = None
        return func(*args, **kwargs)


def convolution_calls(
    module: torch.nn.Module,
    input_shapes: tuple[tuple[int, ...], ...],
    channels_last: bool,
    inputs_need_grad: bool = False,
) -> list[ConvCall]:
    """The distinct 2-D convolution calls of `module(*inputs)` for float32 inputs of `input_shapes`
    (`inputs_need_grad`: inputs that gradients flow back to, as the splatted grid into the BEV
    encoder; not the camera images), in the order of the forward, found on the meta device (the
    parameters and buffers are swapped for meta tensors for the call). `channels_last`: whether the module's
    convolution weights are channels-last (train.channels_last); PyTorch then hands cuDNN both
    operands channels-last, whatever the input's layout."""
    def meta(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        return out.requires_grad_(t.requires_grad)

    state = {name: meta(t) for name, t in module.named_parameters()}
    state.update({name: meta(t) for name, t in module.named_buffers()})
    inputs = tuple(
        torch.empty(s, device="meta", requires_grad=inputs_need_grad) for s in input_shapes
    )
    recorder = _RecordConvolutions(channels_last)
    with recorder, torch.enable_grad():
        torch.func.functional_call(module, state, inputs)
    return list(recorder.calls)


def _format(channels_last: bool) -> torch.memory_format:
    return torch.channels_last if channels_last else torch.contiguous_format


def _run_call(call: ConvCall, device: torch.device, dtype: torch.dtype) -> None:
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        x = torch.randn(call.input_shape, device=device, dtype=dtype)
        x = x.contiguous(memory_format=_format(call.channels_last))
        w = torch.randn(call.weight_shape, device=device, dtype=dtype)
        w = w.contiguous(memory_format=_format(call.channels_last)).requires_grad_()
        b = torch.zeros(call.weight_shape[0], device=device, dtype=dtype, requires_grad=True) \
            if call.bias else None
        x.requires_grad_(call.input_grad)
        y = F.conv2d(x, w, b, call.stride, call.padding, call.dilation, call.groups)
        y.backward(torch.ones_like(y))
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()


def warm_convolutions(
    calls: list[ConvCall],
    device: torch.device,
    dtype: torch.dtype,
    threads: int,
    run: Optional[Callable[[ConvCall, torch.device, torch.dtype], None]] = None,
) -> int:
    """Calls each of `calls` forward and backward on `device` in `dtype` (the autocast dtype of
    the step), on `threads` threads; returns how many ran. The first exception is raised."""
    run = run or _run_call
    if threads <= 1:
        for call in calls:
            run(call, device, dtype)
        return len(calls)
    with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
        for future in [pool.submit(run, call, device, dtype) for call in calls]:
            future.result()
    return len(calls)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def without_cudnn(forward):
    def run(*args, **kwargs):
        with torch.backends.cudnn.flags(enabled=False):
            return forward(*args, **kwargs)

    return run


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/synthetic_segmentation.yaml")
    p.add_argument("--threads", type=int, default=0, help="0: no warm-up; else warm-up threads")
    p.add_argument("--channels-last", default="true", choices=["true", "false", "bev"])
    p.add_argument("--steady", type=int, default=10)
    p.add_argument("--device", default="cuda")
    p.add_argument("--native-depthwise", action="store_true", help="depthwise convolutions without cuDNN")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"], help="the autocast dtype")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    t_start = time.perf_counter()
    cfg = load_config(args.config)
    setting = {"true": True, "false": False}.get(args.channels_last, args.channels_last)
    torch.manual_seed(0)
    model = apply_channels_last(build_model(cfg).to(device), setting).train()
    if args.native_depthwise:
        for m in model.modules():
            if isinstance(m, torch.nn.Conv2d) and m.groups > 1:
                m.forward = without_cudnn(m.forward)
    b, n = cfg.train.batch_size, len(cfg.data.cameras)
    h, w = cfg.data.final_dim
    grid_shape = (b, next(m for m in model.bev.modules() if isinstance(m, torch.nn.Conv2d)).in_channels,
                  *BevGrid.from_config(cfg.grid).shape)
    images = torch.randn(b * n, 3, h, w, device=device)
    grid = torch.randn(grid_shape, device=device, requires_grad=True)
    sync(device)
    t_ready = time.perf_counter()
    calls, find_s, warm_s = [], 0.0, 0.0
    if args.threads:
        t0 = time.perf_counter()
        calls = convolution_calls(model.camera, ((b * n, 3, h, w),), setting in (True, "camera"))
        calls += convolution_calls(model.bev, (grid_shape,), setting in (True, "bev"), True)
        find_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        warm_convolutions(calls, device, dtype, args.threads)
        sync(device)
        warm_s = time.perf_counter() - t0

    def step():
        with torch.autocast(device.type, dtype=dtype):
            depth, context = model.camera(images)
            out = model.bev(grid)
        loss = depth.float().mean() + context.float().mean()
        loss = loss + sum(v.float().mean() for v in (out if isinstance(out, (tuple, list)) else [out]))
        loss.backward()
        model.zero_grad(set_to_none=True)
        grid.grad = None

    t0 = time.perf_counter()
    step()
    sync(device)
    first_s = time.perf_counter() - t0
    times = []
    for _ in range(args.steady):
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(1e3 * (time.perf_counter() - t0))
    on_gpu = device.type == "cuda"
    out = {"device": torch.cuda.get_device_name(device) if on_gpu else "cpu", "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version() if on_gpu else None,
           "cudnn_v8_api": os.environ.get("TORCH_CUDNN_V8_API_DISABLED", "0") != "1", "channels_last": args.channels_last, "threads": args.threads,
           "convolutions": len(calls), "native_depthwise": args.native_depthwise, "dtype": args.dtype, "setup_s": round(t_ready - t_start, 2), "find_s": round(find_s, 3),
           "warmup_s": round(warm_s, 2), "first_call_s": round(first_s, 2),
           "warmup_plus_first_s": round(warm_s + find_s + first_s, 2),
           "steady_ms": round(statistics.median(times), 2)}
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
