"""RoIAlign / RoIPool (forward + backward) and NMS against torchvision, same inputs, same process.
Each roi case is timed in eager mode (one call as a user makes it: Python, dispatch and launches included) and, on
CUDA, replayed from a CUDA graph (GPU time alone). LSS_ROI_BENCH_NMS=0 leaves out the NMS cases."""

from __future__ import annotations

import os

import torch
import torchvision

from lss.ops import batched_nms, nms, roi_align, roi_pool


def _rois(k, batch, img_h, img_w, min_size, max_size, device, seed=0):
    """K x 5 rois with sides uniform in [min_size, max_size] image pixels, inside the image."""
    g = torch.Generator().manual_seed(seed)
    wh = torch.rand(k, 2, generator=g) * (max_size - min_size) + min_size
    wh = torch.minimum(wh, torch.tensor([img_w - 1.0, img_h - 1.0]))
    xy = torch.rand(k, 2, generator=g) * (torch.tensor([img_w, img_h]) - wh)
    idx = torch.randint(0, batch, (k, 1), generator=g).float()
    return torch.cat([idx, xy, xy + wh], 1).to(device)


def _boxes(n, device, seed=0, extent=1000.0):
    """Random detector-like boxes: centres uniform over extent^2, sides 10-100 px; uniform scores."""
    g = torch.Generator().manual_seed(seed)
    c = torch.rand(n, 2, generator=g) * extent
    half = (torch.rand(n, 2, generator=g) * 90 + 10) / 2
    return torch.cat([c - half, c + half], 1).to(device), torch.rand(n, generator=g).to(device)


def _fwd_bwd(fn, x, grad_out):
    def step():
        x.grad = None
        fn(x).backward(grad_out)

    return step


def _roi_cases(quick):
    if quick:
        return [("roi_align BEV (quick)", (1, 8, 24, 24), 16, 1.0, 2, 2, 10, 24, 24)]
    return [
        # BEV features (0.5 m cells): objects of 2-20 m
        (
            "roi_align BEV 4x64x200x200, 2048 rois -> 7x7, sr 2, aligned",
            (4, 64, 200, 200),
            2048,
            1.0,
            2,
            4,
            40,
            200,
            200,
        ),
        # stride-8 FPN level of a 1216 x 800 image: proposals of 32-400 px
        (
            "roi_align FPN 2x256x100x152, 2000 rois -> 7x7, scale 1/8, adaptive, aligned",
            (2, 256, 100, 152),
            2000,
            1 / 8,
            -1,
            32,
            400,
            800,
            1216,
        ),
    ]


def run(ctx) -> list[dict]:
    dev = ctx.device
    rows = []
    for case, shape, k, scale, sr, lo, hi, img_h, img_w in _roi_cases(ctx.quick):
        torch.manual_seed(0)
        x = torch.randn(shape, device=dev, requires_grad=True)
        rois = _rois(k, shape[0], img_h, img_w, lo, hi, dev)
        grad_out = torch.randn(k, shape[1], 7, 7, device=dev)
        nbytes = 4 * (2 * x.numel() + 2 * grad_out.numel())
        impls = [
            ("lss", lambda t: roi_align(t, rois, 7, scale, sr, True)),
            ("torchvision", lambda t: torchvision.ops.roi_align(t, rois, 7, scale, sr, True)),
        ]
        # validate=True: the host reads the bad-roi record (a sync) before it queues the backward
        validated = (
            "lss validate=True",
            lambda t: roi_align(t, rois, 7, scale, sr, True, validate=True),
        )
        for impl, fn in impls[:1] + [validated] + impls[1:]:
            rows.append(
                {
                    "case": case + " fwd+bwd",
                    "impl": impl,
                    "ms": ctx.time(_fwd_bwd(fn, x, grad_out)),
                    "floor_ms": ctx.floor_ms(nbytes),
                    "notes": "float32, eager; floor: read x, grad_out; write out, dx",
                }
            )
        rows += _graphed_rows(
            ctx, case + " fwd+bwd", impls, lambda fn: _fwd_bwd(fn, x, grad_out), nbytes
        )
        torch.use_deterministic_algorithms(True)
        try:
            ms = ctx.time(_fwd_bwd(impls[0][1], x, grad_out), warmup=3, reps=10)
        finally:
            torch.use_deterministic_algorithms(False)
        rows.append(
            {
                "case": case + " fwd+bwd",
                "impl": "lss deterministic",
                "ms": ms,
                "floor_ms": None,
                "notes": "torch.use_deterministic_algorithms(True): sorted segment sum, bit-identical grads",
            }
        )
        with torch.no_grad():
            for impl, fn in impls:
                rows.append(
                    {
                        "case": case + " fwd",
                        "impl": impl,
                        "ms": ctx.time(lambda: fn(x)),
                        "floor_ms": ctx.floor_ms(4 * (x.numel() + grad_out.numel())),
                        "notes": "float32, eager",
                    }
                )
            rows += _graphed_rows(
                ctx,
                case + " fwd",
                impls,
                lambda fn: lambda: fn(x),
                4 * (x.numel() + grad_out.numel()),
            )
        # channels_last features: read in place (lss) or copied to NCHW first (torchvision)
        x_cl = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_(True)
        for impl, fn in impls:
            rows.append(
                {
                    "case": case + " channels_last fwd+bwd",
                    "impl": impl,
                    "ms": ctx.time(_fwd_bwd(fn, x_cl, grad_out)),
                    "floor_ms": ctx.floor_ms(nbytes),
                    "notes": "float32, channels_last input",
                }
            )
        with torch.no_grad():
            for impl, fn in impls:
                rows.append(
                    {
                        "case": case + " channels_last fwd",
                        "impl": impl,
                        "ms": ctx.time(lambda: fn(x_cl)),
                        "floor_ms": ctx.floor_ms(4 * (x.numel() + grad_out.numel())),
                        "notes": "float32, channels_last input",
                    }
                )
        del x_cl
        pool = [
            ("lss", lambda t: roi_pool(t, rois, 7, scale)),
            ("lss validate=True", lambda t: roi_pool(t, rois, 7, scale, validate=True)),
            ("torchvision", lambda t: torchvision.ops.roi_pool(t, rois, 7, scale)),
        ]
        pool_case = (
            case.replace("roi_align", "roi_pool")
            .replace(", adaptive, aligned", "")
            .replace(", sr 2, aligned", "")
            + " fwd+bwd"
        )
        for impl, fn in pool:
            rows.append(
                {
                    "case": pool_case,
                    "impl": impl,
                    "ms": ctx.time(_fwd_bwd(fn, x, grad_out)),
                    "floor_ms": ctx.floor_ms(nbytes),
                    "notes": "float32, eager",
                }
            )
        rows += _graphed_rows(
            ctx, pool_case, pool[::2], lambda fn: _fwd_bwd(fn, x, grad_out), nbytes
        )
        del x, grad_out
    if os.environ.get("LSS_ROI_BENCH_NMS", "1") != "0":
        rows += _nms_rows(ctx)
    return rows


def _graphed_rows(ctx, case, impls, make_step, nbytes) -> list[dict]:
    """On CUDA, one row per impl of `make_step(fn)` captured once as a CUDA graph and replayed: the GPU time alone
    (no host read of the bad-roi record while capturing)."""
    if ctx.device.type != "cuda":
        return []
    return [
        {
            "case": case + ", CUDA graph",
            "impl": impl,
            "ms": ctx.time_graphed(make_step(fn)),
            "floor_ms": ctx.floor_ms(nbytes),
            "notes": "float32; captured once, replayed",
        }
        for impl, fn in impls
    ]


def _nms_rows(ctx) -> list[dict]:
    dev = ctx.device
    rows = []
    sizes = [300] if ctx.quick else [1000, 5000, 20000, 100000]
    for n in sizes:
        boxes, scores = _boxes(n, dev)
        reps = 5 if n >= 100000 else 30
        # only the upper triangle of the N x ceil(N/64) bitmap is written
        floor = ctx.floor_ms(n * ((n + 63) // 64) * 8 / 2)
        for impl, fn in [("lss", nms), ("torchvision", torchvision.ops.nms)]:
            rows.append(
                {
                    "case": f"nms {n} boxes, IoU 0.5",
                    "impl": impl,
                    "ms": ctx.time(lambda: fn(boxes, scores, 0.5), warmup=2, reps=reps),
                    "floor_ms": floor,
                    "notes": f"kept {len(nms(boxes, scores, 0.5))}; floor: bitmap write",
                }
            )
    for n in [300] if ctx.quick else [20000, 100000]:
        boxes, scores = _boxes(n, dev, seed=1)
        boxes = boxes - 500.0  # ego-frame style coordinates around 0
        idxs = torch.randint(0, 10, (n,), generator=torch.Generator().manual_seed(0)).to(dev)
        for impl, fn in [("lss", batched_nms), ("torchvision", torchvision.ops.batched_nms)]:
            rows.append(
                {
                    "case": f"batched_nms {n} boxes, 10 classes, IoU 0.5",
                    "impl": impl,
                    "ms": ctx.time(
                        lambda: fn(boxes, scores, idxs, 0.5),
                        warmup=2,
                        reps=5 if n >= 100000 else 30,
                    ),
                    "floor_ms": None,
                    "notes": "coordinates in [-500, 500]; eager",
                }
            )
    return rows


def smoke(device) -> None:
    """Every op forward + backward once on small inputs, both backward paths (for compute-sanitizer)."""
    dev = torch.device(device)
    x_nchw = torch.randn(2, 37, 19, 23, device=dev, requires_grad=True)
    x_cl = x_nchw.detach().contiguous(memory_format=torch.channels_last).requires_grad_(True)
    rois = _rois(40, 2, 76, 92, 2, 60, dev)
    rois[0, 1:] = torch.tensor([-10.0, -10.0, 100.0, 90.0])  # partly outside the map
    for x in (x_nchw, x_cl):
        for deterministic in (False, True):
            torch.use_deterministic_algorithms(deterministic)
            try:
                for mode in ("avg", "max"):
                    roi_align(x, rois, (7, 5), 0.25, -1, True, mode).sum().backward()
                    roi_align(x.half(), rois, 3, 0.25, 2, False, mode).float().sum().backward()
                roi_pool(x, rois, (7, 5), 0.25).sum().backward()
                roi_pool(x, torch.zeros(0, 5, device=dev), 7, 0.25).sum().backward()
            finally:
                torch.use_deterministic_algorithms(False)
        bad = rois.clone()
        bad[3, 0] = 2.0
        bad[5, 2] = float("nan")
        for op in (roi_align, roi_pool):
            op(x, bad, 7, 0.25, validate=False).sum().backward()
            for inp in (
                x,
                x[:, :0],
            ):  # the pooling kernel's record, and the record-only kernel of an empty output
                try:
                    op(inp, bad, 7, 0.25, validate=True)
                    raise AssertionError(f"{op.__name__} accepted roi 5 with a NaN coordinate")
                except ValueError:
                    pass
    boxes, scores = _boxes(1000, dev)
    nms(boxes, scores, 0.5)
    nms(boxes.half(), scores, 0.5)
    batched_nms(boxes - 500, scores, torch.randint(0, 4, (1000,), device=dev), 0.5)
    nms(boxes[:0], scores[:0], 0.5)
