"""The memory floor of a training step: the bytes every operation of the model's forward and backward must read and
write at least once (its inputs and outputs, bf16 activations), found by running the step on the meta device (no
memory, no kernels), summed per kind of operation and divided by the memory bandwidth; and, given a profile of the
real step (`train.profile_steps`' summary.json), the bandwidth each kind of kernel reached.

The floor is the unfused one: each operation as the model writes it, none fused with its neighbour; a step cannot
move less unless operations are fused (a fused kernel reads once what two read twice). The splat (bev_pool) and the
lookup table are not counted (a few MB a step); the optimizer is, as fused Adam in fp32 (28 bytes a parameter).

    python scripts/step_floor.py --config configs/synthetic.yaml \
        --profile results/step-256x704-2026-11-28/profile_default.json --bandwidth 4.3e12
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from lss.config import load_config  # noqa: E402
from lss.geometry import BevGrid  # noqa: E402
from lss.models import build_model  # noqa: E402

aten = torch.ops.aten
# operations that move no bytes (views, metadata)
VIEWS = {aten.detach.default, aten.expand.default, aten.view.default, aten._unsafe_view.default, aten.t.default,
         aten.slice.Tensor, aten.select.int, aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim,
         aten.as_strided.default, aten.alias.default, aten.transpose.int, aten.split.Tensor,
         aten.split_with_sizes.default, aten.unbind.int, aten.reshape.default}
ELEMENTWISE = "elementwise (activations, padding, arithmetic, copies)"
# profile kernel name fragments -> kind (the first that matches)
KERNEL_KINDS = (
    ("batch_norm_backward", "batch norm, backward"),
    ("batch_norm", "batch norm, forward"),
    ("conv_depthwise2d_forward", "depthwise convolution, forward"),
    ("conv_depthwise2d", "depthwise convolution, backward"),
    ("elementwise", ELEMENTWISE),
)


def op_kind(func, args) -> str:
    """The kind of an aten operation for the floor table."""
    name = func.overloadpacket.__name__
    if name in ("convolution", "convolution_backward"):
        groups = args[8] if name == "convolution" else args[-2]
        depthwise = int(groups) > 1
        what = "depthwise convolution" if depthwise else "convolution"
        return f"{what}, {'backward' if name.endswith('backward') else 'forward'}"
    if "batch_norm" in name:
        return f"batch norm, {'backward' if 'backward' in name else 'forward'}"
    if name.startswith("upsample") or name.startswith("_upsample"):
        return "upsampling"
    return ELEMENTWISE


class ByteCounter(TorchDispatchMode):
    """Bytes of every operation's tensor inputs and outputs (each tensor once per operation), by kind."""

    def __init__(self):
        super().__init__()
        self.bytes: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func not in VIEWS:
            seen, total = set(), 0
            for t in tree_leaves((args, kwargs, out)):
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
            kind = op_kind(func, args)
            self.bytes[kind] += total
            self.calls[kind] += 1
        return out


def step_bytes(cfg, dtype=torch.bfloat16) -> tuple[dict, dict, int]:
    """(bytes by kind, calls by kind, parameters) of one training forward + backward of the camera encoder, the BEV
    encoder and the segmentation head at `cfg`'s sizes, on the meta device in `dtype`."""
    model = build_model(cfg).to(device="meta", dtype=dtype).train()
    b, n = cfg.train.batch_size, len(cfg.data.cameras)
    h, w = cfg.data.final_dim
    grid = BevGrid.from_config(cfg.grid)
    channels = next(m for m in model.bev.modules() if isinstance(m, torch.nn.Conv2d)).in_channels
    images = torch.empty(b * n, 3, h, w, device="meta", dtype=dtype)
    splatted = torch.empty(b, channels, *grid.shape, device="meta", dtype=dtype, requires_grad=True)
    counter = ByteCounter()
    with counter:
        depth, context = model.camera(images)
        features = model.bev(splatted)
        logits = model.segmentation(features)
        loss = depth.float().sum() + context.float().sum() + logits.float().sum()
        loss.backward()
    return dict(counter.bytes), dict(counter.calls), sum(p.numel() for p in model.parameters())


def achieved(profile: dict, floor_bytes: dict) -> list[dict]:
    """Per kernel kind of the profile's top kernels: its time per step, and the bandwidth its floor bytes mean."""
    times: collections.Counter = collections.Counter()
    for kernel in profile["top_kernels"]:
        kind = next((k for frag, k in KERNEL_KINDS if frag in kernel["name"]), None)
        if kind is not None:
            times[kind] += kernel["ms_per_step"]
    rows = []
    for kind, ms in times.most_common():
        gb = floor_bytes.get(kind, 0) / 1e9
        rows.append({"kind": kind, "ms_per_step": round(ms, 3), "floor_GB": round(gb, 3),
                     "achieved_GB_per_s": round(gb / (ms / 1e3), 1) if gb else None})
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/synthetic.yaml")
    p.add_argument("--set", action="append", default=[], dest="overrides")
    p.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s (4.3e12: an H200 as measured)")
    p.add_argument("--profile", default=None, help="a train.profile_steps summary.json of the same config")
    p.add_argument("--out", default=None, help="JSON file of the figures")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    by_kind, calls, params = step_bytes(cfg)
    by_kind["optimizer (fused Adam, fp32)"] = 28 * params
    calls["optimizer (fused Adam, fp32)"] = 1
    total = sum(by_kind.values())
    out = {"config": args.config, "overrides": args.overrides, "bandwidth": args.bandwidth,
           "final_dim": list(cfg.data.final_dim), "batch_size": cfg.train.batch_size,
           "floor_GB": round(total / 1e9, 3), "floor_ms": round(total / args.bandwidth * 1e3, 3),
           "kinds": [{"kind": k, "GB": round(v / 1e9, 3), "calls": calls[k],
                      "floor_ms": round(v / args.bandwidth * 1e3, 3)}
                     for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])]}
    print(f"floor of one training step ({args.config}, B{cfg.train.batch_size}, {cfg.data.final_dim}): "
          f"{out['floor_GB']:.2f} GB, {out['floor_ms']:.2f} ms at {args.bandwidth / 1e12:.1f} TB/s")
    for row in out["kinds"]:
        print(f"  {row['kind']}: {row['GB']:.3f} GB in {row['calls']} calls, {row['floor_ms']:.3f} ms")
    if args.profile:
        profile = json.loads(Path(args.profile).read_text())
        out["profile"] = {"gpu_kernel_ms_per_step": profile["gpu_kernel_ms_per_step"],
                          "times_floor": round(profile["gpu_kernel_ms_per_step"] / out["floor_ms"], 2),
                          "kinds": achieved(profile, by_kind)}
        print(f"profiled step: {profile['gpu_kernel_ms_per_step']:.2f} ms of GPU kernels, "
              f"{out['profile']['times_floor']:.1f}x the floor")
        for row in out["profile"]["kinds"]:
            print(f"  {row['kind']}: {row['ms_per_step']:.2f} ms for {row['floor_GB']:.3f} GB, "
                  f"{row['achieved_GB_per_s']} GB/s")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
