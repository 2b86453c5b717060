"""The memory floor of a training step: the bytes every operation of the model's forward and backward must read and
write at least once (its inputs and outputs, bf16 activations), found by running the step on the meta device (no
memory, no kernels), summed per kind of operation and divided by the memory bandwidth; and, given a profile of the
real step (`train.profile_steps`' summary.json), the bandwidth each kind of kernel reached. On the meta device the
model runs PyTorch's kernels (lss's batch norm and depthwise modules take CPU and CUDA inputs); the padding copies in
front of efficientnet-pytorch's depthwise convolutions are counted as their own kind, and the floor is also given
without them (lss's depthwise kernels pad inside the kernel).

The floor is the unfused one: each operation as the model writes it, none fused with its neighbour; a step cannot
move less unless operations are fused (a fused kernel reads once what two read twice). The splat (bev_pool) and the
lookup table are not counted (a few MB a step); the optimizer is, as fused Adam in fp32 (28 bytes a parameter).

    python scripts/step_floor.py --config configs/synthetic_segmentation.yaml \
        --profile results/step-256x704-lss-kernels-2026-11-28/profile_shipped_default.json --bandwidth 4.3e12
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
ELEMENTWISE = "elementwise (activations, arithmetic, copies)"
# efficientnet-pytorch's "same" padding: a padded copy of every depthwise convolution's input (and its gradient
# sliced back); lss's depthwise kernels pad inside the kernel and move none of these bytes
PADDING = "padding copies"
BN_FORWARD, BN_BACKWARD = "batch norm, forward", "batch norm, backward"
DW_FORWARD, DW_BACKWARD = "depthwise convolution, forward", "depthwise convolution, backward"
# profile kernel name fragments -> (the kind, the floor kinds its time moves); the first that matches
KERNEL_KINDS = (
    # lss's batch norm runs the same two kernels forward and backward
    ("lss::batch_norm::", (f"{BN_FORWARD} + backward (lss)", (BN_FORWARD, BN_BACKWARD))),
    ("lss::depthwise_conv::(anonymous namespace)::forward", (DW_FORWARD, (DW_FORWARD,))),
    ("lss::depthwise_conv::", (DW_BACKWARD, (DW_BACKWARD,))),
    ("batch_norm_backward", (BN_BACKWARD, (BN_BACKWARD,))),
    ("batch_norm", (BN_FORWARD, (BN_FORWARD,))),
    ("conv_depthwise2d_forward", (DW_FORWARD, (DW_FORWARD,))),
    ("conv_depthwise2d", (DW_BACKWARD, (DW_BACKWARD,))),
    ("elementwise", (ELEMENTWISE, (ELEMENTWISE, PADDING))),
)


def op_kind(func, args) -> str:
    """The kind of an aten (or lss) operation for the floor table."""
    name = func.overloadpacket.__name__
    if name in ("convolution", "convolution_backward"):
        groups = args[8] if name == "convolution" else args[-2]
        depthwise = int(groups) > 1
        what = "depthwise convolution" if depthwise else "convolution"
        return f"{what}, {'backward' if name.endswith('backward') else 'forward'}"
    if name in ("depthwise_conv2d", "_depthwise_conv2d_backward"):
        return DW_BACKWARD if "backward" in name else DW_FORWARD
    if "batch_norm" in name:
        return BN_BACKWARD if "backward" in name else BN_FORWARD
    if name.startswith("upsample") or name.startswith("_upsample"):
        return "upsampling"
    if name == "constant_pad_nd":
        return PADDING
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
    encoder, the segmentation head and, where the config has one, the detection head (its decoder stage, heatmap and
    regression maps; the second stage and the losses' own reads are not counted) at `cfg`'s sizes, on the meta device
    in `dtype`."""
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
        features, detection_features = model.bev.for_heads(splatted, model.detection_decoder)
        logits = model.segmentation(features)
        loss = depth.float().sum() + context.float().sum() + logits.float().sum()
        if model.detection is not None:
            maps = model.detection(detection_features)
            loss = loss + maps["det_heatmap"].float().sum() + maps["det_regression"].float().sum()
        loss.backward()
    return dict(counter.bytes), dict(counter.calls), sum(p.numel() for p in model.parameters())


def pads_inside(profile: dict) -> bool:
    """Whether the profiled step ran lss's depthwise kernels (which pad inside the kernel)."""
    return any("lss::depthwise_conv::" in kernel["name"] for kernel in profile["top_kernels"])


def achieved(profile: dict, floor_bytes: dict) -> list[dict]:
    """Per kernel kind of the profile's top kernels: its time per step, and the bandwidth its floor bytes mean. Kinds
    whose floor bytes overlap are one row (lss's batch norm beside PyTorch's, which the channels-last BEV encoder
    keeps); with lss's depthwise kernels in the profile the padding copies are not part of any floor."""
    padded_inside = pads_inside(profile)
    rows: list[dict] = []  # {"kinds": [...], "moves": set(...), "ms": float}
    for kernel in profile["top_kernels"]:
        match = next((kind for frag, kind in KERNEL_KINDS if frag in kernel["name"]), None)
        if match is None:
            continue
        kind, moves = match[0], set(match[1]) - ({PADDING} if padded_inside else set())
        joined = [row for row in rows if row["moves"] & moves]
        row = {"kinds": [kind], "moves": set(moves), "ms": kernel["ms_per_step"]}
        for other in joined:
            rows.remove(other)
            row["kinds"] = other["kinds"] + [k for k in row["kinds"] if k not in other["kinds"]]
            row["moves"] |= other["moves"]
            row["ms"] += other["ms"]
        rows.append(row)
    out = []
    for row in sorted(rows, key=lambda r: -r["ms"]):
        gb = sum(floor_bytes.get(k, 0) for k in row["moves"]) / 1e9
        out.append({"kind": " | ".join(row["kinds"]), "ms_per_step": round(row["ms"], 3), "floor_GB": round(gb, 3),
                    "achieved_GB_per_s": round(gb / (row["ms"] / 1e3), 1) if gb else None})
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/synthetic_segmentation.yaml")
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
           # the same step with the depthwise convolutions padding inside their kernels (lss's)
           "floor_without_padding_copies_ms": round((total - by_kind.get(PADDING, 0)) / args.bandwidth * 1e3, 3),
           "kinds": [{"kind": k, "GB": round(v / 1e9, 3), "calls": calls[k],
                      "floor_ms": round(v / args.bandwidth * 1e3, 3)}
                     for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])]}
    print(f"floor of one training step ({args.config}, B{cfg.train.batch_size}, {cfg.data.final_dim}): "
          f"{out['floor_GB']:.2f} GB, {out['floor_ms']:.2f} ms at {args.bandwidth / 1e12:.1f} TB/s "
          f"({out['floor_without_padding_copies_ms']:.2f} ms without the padding copies)")
    for row in out["kinds"]:
        print(f"  {row['kind']}: {row['GB']:.3f} GB in {row['calls']} calls, {row['floor_ms']:.3f} ms")
    if args.profile:
        profile = json.loads(Path(args.profile).read_text())
        floor_ms = out["floor_without_padding_copies_ms"] if pads_inside(profile) else out["floor_ms"]
        out["profile"] = {"gpu_kernel_ms_per_step": profile["gpu_kernel_ms_per_step"],
                          "floor_ms": floor_ms,
                          "times_floor": round(profile["gpu_kernel_ms_per_step"] / floor_ms, 2),
                          "kinds": achieved(profile, by_kind)}
        print(f"profiled step: {profile['gpu_kernel_ms_per_step']:.2f} ms of GPU kernels, "
              f"{out['profile']['times_floor']:.1f}x its floor of {floor_ms:.2f} ms")
        for row in out["profile"]["kinds"]:
            print(f"  {row['kind']}: {row['ms_per_step']:.2f} ms for {row['floor_GB']:.3f} GB, "
                  f"{row['achieved_GB_per_s']} GB/s")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
