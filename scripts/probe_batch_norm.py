"""The camera trunk's batch norms alone, forward and backward in training mode, in each activation dtype and memory
layout: which kernels PyTorch picks (its own or cuDNN's) and how long the step's batch norms take with each. The
shapes are those of the camera encoder of `--config` (configs/synthetic_segmentation.yaml: B4 x 6 cameras at 256x704), found on
the meta device; the weights stay float32 as under autocast. Prints one JSON line. On a CUDA machine:

    python scripts/probe_batch_norm.py
    python scripts/probe_batch_norm.py --variants bf16:nchw,bf16:nchw:lss --repeats 50

A third field `lss` times lss's own kernels (torch.ops.lss.batch_norm_train and its backward, NCHW only) instead of
PyTorch's. `--jit-ops` compiles just those kernels (csrc/ops/*batch_norm*, with torch.utils.cpp_extension) when the
lss._C extension is not built.
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
KERNELS = ("torch", "lss")


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


def parse_variants(text: str) -> list[tuple[str, str, str]]:
    """"bf16:nchw,fp16:nhwc,bf16:nchw:lss" -> [("bf16", "nchw", "torch"), ("fp16", "nhwc", "torch"), ("bf16",
    "nchw", "lss")]; a bad entry is a ValueError naming the choices."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        dtype, layout, kernel = (item.split(":") + ["torch"])[:3] if item.count(":") in (1, 2) else ("", "", "")
        if dtype not in DTYPES or layout not in LAYOUTS or kernel not in KERNELS:
            raise ValueError(
                f"variant {item!r}: give DTYPE:LAYOUT[:KERNEL] with DTYPE one of {sorted(DTYPES)}, LAYOUT one of "
                f"{sorted(LAYOUTS)} and KERNEL one of {list(KERNELS)}, e.g. bf16:nchw or bf16:nchw:lss"
            )
        if kernel == "lss" and layout != "nchw":
            raise ValueError(f"variant {item!r}: lss's batch norm kernels take NCHW inputs only")
        out.append((dtype, layout, kernel))
    if not out:
        raise ValueError("no variant given: e.g. --variants bf16:nchw,fp16:nchw")
    return out


def jit_ops() -> None:
    """Compile and load lss's batch norm kernels alone (no lss._C needed) into torch.ops.lss."""
    import shutil
    import tempfile

    from torch.utils.cpp_extension import load

    import lss.ops  # noqa: F401  (loads lss._C where it is built)

    if hasattr(torch.ops.lss, "batch_norm_train"):
        return  # lss._C is built: its kernels are the ones to time

    root = Path(__file__).resolve().parents[1]
    ops = root / "csrc" / "ops"
    # copied under distinct names: the build rules are named after the files
    named = {"schema.cpp": ops / "batch_norm.cpp", "common.cpp": ops / "common.cpp",
             "cpu.cpp": ops / "cpu" / "batch_norm.cpp"}
    if torch.cuda.is_available():
        named["cuda.cu"] = ops / "cuda" / "batch_norm.cu"
    folder = Path(tempfile.mkdtemp(prefix="lss_bn_"))
    for name, src in named.items():
        shutil.copy(src, folder / name)
    load("lss_batch_norm_jit", [str(folder / n) for n in named], extra_include_paths=[str(root / "csrc")],
         extra_cflags=["-O3"], extra_cuda_cflags=["-O3"], is_python_module=False, verbose=False)


def time_variant(shapes, dtype: torch.dtype, layout, device: torch.device, repeats: int, kernel: str = "torch"
                 ) -> dict:
    """Forward + backward of one training-mode batch norm per shape (float32 weight and bias, as under autocast),
    each call on its own tensors, through PyTorch's batch norm or (kernel "lss") lss's ops; returns the
    milliseconds of all of them per pass (median of `repeats` passes, CUDA events), the names of the kernels the
    first shape ran and, for "lss", the largest difference of its output and input gradient from PyTorch's."""
    calls = []
    for shape in shapes:
        bn = nn.BatchNorm2d(shape[1]).to(device).train()
        x = torch.randn(shape, device=device).to(dtype).contiguous(memory_format=layout).requires_grad_()
        grad = torch.randn(shape, device=device).to(dtype).contiguous(memory_format=layout)
        calls.append((bn, x, grad))

    def run(bn, x, grad, which=kernel):
        if which == "lss":
            y, mean, invstd = torch.ops.lss.batch_norm_train(x.detach(), bn.weight.detach(), bn.bias.detach(),
                                                             bn.eps)
            dx = torch.ops.lss._batch_norm_train_backward(grad, x.detach(), bn.weight.detach(), mean, invstd)[0]
            return y, dx
        y = torch.nn.functional.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, True, 0.1,
                                           bn.eps)
        y.backward(grad)
        dx, x.grad = x.grad, None
        bn.weight.grad = bn.bias.grad = None
        return y.detach(), dx

    def one_pass():
        for call in calls:
            run(*call)

    max_diff = None
    if kernel == "lss":
        y_lss, dx_lss = run(*calls[0])
        y_torch, dx_torch = run(*calls[0], which="torch")
        max_diff = {"output": float((y_lss.float() - y_torch.float()).abs().max()),
                    "input_grad": float((dx_lss.float() - dx_torch.float()).abs().max())}

    for _ in range(3):
        one_pass()
    kernels: list[str] = []
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        bn, x, grad = calls[0]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(bn, x, grad)
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
    out = {"ms": round(ms, 3), "min_ms": round(times[0], 3), "floor_bytes": floor_bytes,
           "floor_gb": round(floor_bytes / 1e9, 3), "gb_per_s": round(floor_bytes / (ms * 1e-3) / 1e9, 1),
           "kernels": kernels}
    if max_diff is not None:
        out["max_abs_diff_from_torch"] = max_diff
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/synthetic_segmentation.yaml")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="DTYPE:LAYOUT,... (dtypes bf16, fp16, fp32)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--jit-ops", action="store_true", help="compile lss's batch norm kernels here (no lss._C)")
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
    if args.jit_ops:
        jit_ops()
    elif any(k == "lss" for _, _, k in variants):
        import lss.ops  # noqa: F401  (loads lss._C, which registers torch.ops.lss)
    for dtype, layout, kernel in variants:
        name = f"{dtype}:{layout}" + (":lss" if kernel == "lss" else "")
        out["variants"][name] = time_variant(shapes, DTYPES[dtype], LAYOUTS[layout], device, args.repeats, kernel)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
