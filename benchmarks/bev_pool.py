"""bev_pool (the splat) against the pure-PyTorch reference and the "cumsum trick" of the original LSS, plus the
frustum LUT build, at the LSS and a BEVDet-like configuration on the real nuScenes rig."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lss.geometry import (
    BevGrid,
    FrustumLUT,
    FrustumLUTCache,
    frustum,
    frustum_to_ego,
    image_augmentation,
    load_nuscenes_rig,
    val_augmentation,
)
from lss.ops import bev_pool, bev_pool_reference


@dataclass
class SplatCase:
    name: str
    B: int
    N: int
    C: int
    final_dim: tuple
    downsample: int
    dbound: tuple
    grid: BevGrid


CASES = [
    SplatCase(
        "lss_config",
        4,
        6,
        64,
        (128, 352),
        16,
        (4.0, 45.0, 1.0),
        BevGrid((-50.0, 50.0, 0.5), (-50.0, 50.0, 0.5), (-10.0, 10.0, 20.0)),
    ),
    SplatCase(
        "bevdet_config",
        4,
        6,
        80,
        (256, 704),
        16,
        (1.0, 60.0, 0.5),
        BevGrid((-51.2, 51.2, 0.8), (-51.2, 51.2, 0.8), (-10.0, 10.0, 20.0)),
    ),
]


def camera_inputs(case: SplatCase, device):
    """Frustum and the real nuScenes rig with the LSS evaluation transform (resize to cover, bottom crop)."""
    K, rot, trans = load_nuscenes_rig()
    aug = val_augmentation((1600, 900), case.final_dim)
    post_rot, post_trans = image_augmentation(aug, (1600, 900), case.final_dim)
    B, N = case.B, case.N
    rig = [t[:N].expand(B, *t[:N].shape) for t in (K, rot, trans)]
    rig += [post_rot.expand(B, N, 3, 3), post_trans.expand(B, N, 3)]
    fr = frustum(case.final_dim, case.downsample, case.dbound)
    return [t.contiguous().to(device) for t in [fr] + rig]


# The cumsum trick: materialise depth x feat for every frustum point, sort the kept points by cell, cumulative-sum
# along the points and difference the sums at the ends of the cell intervals; autograd differentiates all of it.
@dataclass
class CumsumPlan:
    order: torch.Tensor  # kept points sorted by cell
    interval_ends: torch.Tensor  # positions in `order` of the last point of each non-empty cell
    interval_cells: torch.Tensor  # the cell of each interval
    num_cells: int


def cumsum_plan(lut: FrustumLUT) -> CumsumPlan:
    kept = lut.num_kept()
    order = lut.sorted_points[:kept].long()
    cells = lut.point_cell.long()[order]
    last = torch.ones_like(cells, dtype=torch.bool)
    last[:-1] = cells[1:] != cells[:-1]
    ends = last.nonzero().squeeze(1)
    return CumsumPlan(order, ends, cells[ends], lut.num_cells)


def cumsum_trick(depth, feat, lut: FrustumLUT, plan: CumsumPlan):
    B, N, C, fH, fW = feat.shape
    x = (depth.unsqueeze(-1) * feat.permute(0, 1, 3, 4, 2).unsqueeze(2)).reshape(-1, C)
    x = x[plan.order].cumsum(0)[plan.interval_ends]
    x = torch.cat([x[:1], x[1:] - x[:-1]])
    grid = x.new_zeros(plan.num_cells, C).index_put((plan.interval_cells,), x)
    return (
        grid.view(B, lut.nz, lut.nx, lut.ny, C)
        .permute(0, 1, 4, 2, 3)
        .reshape(B, lut.nz * C, lut.nx, lut.ny)
    )


def _peak_mb(device, fn) -> str:
    if device.type != "cuda":
        return ""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return f"; peak +{(torch.cuda.max_memory_allocated(device) - base) / 2**20:.0f} MB"


def camera_feature_map(feat: torch.Tensor) -> torch.Tensor:
    """feat B x N x C x fH x fW as a B*N x C x fH x fW channels-last camera feature map (what a channels-last model
    produces), to be viewed back as B x N x C x fH x fW."""
    B, N, C, fH, fW = feat.shape
    return feat.reshape(B * N, C, fH, fW).contiguous(memory_format=torch.channels_last)


def _graphed_row(ctx, case_name, fn, nbytes, shape) -> dict:
    """fwd+bwd replayed from a CUDA graph: the GPU time without the Python/launch overhead of the eager call."""
    row = {
        "case": case_name,
        "impl": "lss_cuda_graph",
        "floor_ms": ctx.floor_ms(nbytes),
        "notes": shape,
    }
    try:
        row["ms"] = ctx.time_graphed(fn)
    except RuntimeError as e:
        row["ms"] = float("nan")
        row["notes"] += f"; CUDA graph capture failed: {e}"
    return row


def run(ctx) -> list[dict]:
    device = ctx.device
    rows = []
    for case in CASES:
        if ctx.quick:
            case = SplatCase(
                case.name, 1, case.N, 16, case.final_dim, case.downsample, case.dbound, case.grid
            )
        cam = camera_inputs(case, device)
        lut = FrustumLUT.build(frustum_to_ego(*cam), case.grid)
        g = torch.Generator(device="cpu").manual_seed(0)
        depth = torch.rand(case.B, case.N, lut.D, lut.fH, lut.fW, generator=g).softmax(2).to(device)
        feat = torch.randn(case.B, case.N, case.C, lut.fH, lut.fW, generator=g).to(device)
        depth.requires_grad_()
        feat.requires_grad_()
        grad_out = torch.randn(case.B, lut.nz * case.C, lut.nx, lut.ny, generator=g).to(device)
        plan = cumsum_plan(lut)
        kept = lut.num_kept()
        es = depth.element_size()
        out_bytes = grad_out.numel() * es
        io_bytes = (depth.numel() + feat.numel()) * es
        fwd_bytes = out_bytes + io_bytes + 4 * (kept + lut.num_cells)
        bwd_bytes = out_bytes + 2 * io_bytes + 4 * (lut.num_points + lut.num_cells)
        shape = (
            f"B{case.B} N{case.N} D{lut.D} {lut.fH}x{lut.fW} C{case.C} {lut.nx}x{lut.ny}x{lut.nz}; "
            f"{kept} of {lut.num_points} points kept"
        )
        impls = {
            "lss": lambda: bev_pool(depth, feat, lut),
            "reference": lambda: bev_pool_reference(depth, feat, lut),
            "cumsum_trick": lambda: cumsum_trick(depth, feat, lut, plan),
        }
        for impl, fwd in impls.items():

            def fwd_bwd(fwd=fwd):
                return torch.autograd.grad(fwd(), (depth, feat), grad_out)

            rows.append(
                {
                    "case": f"{case.name} fwd+bwd",
                    "impl": impl,
                    "ms": ctx.time(fwd_bwd),
                    "floor_ms": ctx.floor_ms(fwd_bytes + bwd_bytes),
                    "notes": shape + _peak_mb(device, fwd_bwd),
                }
            )
        for impl, fwd in impls.items():

            def fwd_only(fwd=fwd):
                with torch.no_grad():
                    return fwd()

            rows.append(
                {
                    "case": f"{case.name} fwd",
                    "impl": impl,
                    "ms": ctx.time(fwd_only),
                    "floor_ms": ctx.floor_ms(fwd_bytes),
                    "notes": shape + _peak_mb(device, fwd_only),
                }
            )

        if device.type == "cuda":
            rows.append(
                _graphed_row(
                    ctx,
                    f"{case.name} fwd+bwd",
                    lambda: torch.autograd.grad(
                        bev_pool(depth, feat, lut), (depth, feat), grad_out
                    ),
                    fwd_bytes + bwd_bytes,
                    shape,
                )
            )
            # as training runs: channels-last camera features in, channels-last BEV gradient back
            feat_map = camera_feature_map(feat.detach()).requires_grad_()
            grad_out_cl = grad_out.contiguous(memory_format=torch.channels_last)

            def fwd_bwd_channels_last():
                out = bev_pool(depth, feat_map.view(feat.shape), lut)
                return torch.autograd.grad(out, (depth, feat_map), grad_out_cl)

            rows.append(
                _graphed_row(
                    ctx,
                    f"{case.name} fwd+bwd, channels_last",
                    fwd_bwd_channels_last,
                    fwd_bytes + bwd_bytes,
                    shape + "; feat and grad_out channels-last",
                )
            )
        build_bytes = lut.num_points * (3 * 4 + 2 * 4) + 4 * lut.num_cells
        rows.append(
            {
                "case": f"{case.name} lut build",
                "impl": "lss_lut_build",
                "ms": ctx.time(lambda: FrustumLUT.build(frustum_to_ego(*cam), case.grid)),
                "floor_ms": ctx.floor_ms(build_bytes),
                "notes": "frustum_to_ego + FrustumLUT.build (every step under augmentation)",
            }
        )
        cache = FrustumLUTCache()

        def cached_step():
            cached = cache.get(*cam, case.grid)
            return torch.autograd.grad(bev_pool(depth, feat, cached), (depth, feat), grad_out)

        rows.append(
            {
                "case": f"{case.name} cached lut + fwd+bwd",
                "impl": "lss",
                "ms": ctx.time(cached_step),
                "floor_ms": ctx.floor_ms(fwd_bytes + bwd_bytes),
                "notes": "FrustumLUTCache.get (unchanged rig: hit) then bev_pool fwd+bwd",
            }
        )
    return rows


def smoke(device) -> None:
    """bev_pool forward + backward once on small inputs, every dtype and both grad layouts."""
    device = torch.device(device)
    grid = BevGrid((-20.0, 20.0, 1.0), (-20.0, 20.0, 1.0), (-4.0, 4.0, 4.0))
    case = SplatCase("smoke", 2, 3, 40, (64, 176), 16, (2.0, 30.0, 2.0), grid)
    lut = FrustumLUT.build(frustum_to_ego(*camera_inputs(case, device)), grid)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        depth = torch.rand(
            case.B, case.N, lut.D, lut.fH, lut.fW, device=device, dtype=dtype, requires_grad=True
        )
        feat = torch.randn(
            case.B, case.N, case.C, lut.fH, lut.fW, device=device, dtype=dtype, requires_grad=True
        )
        out = bev_pool(depth, feat, lut)
        for grad_out in (
            torch.randn_like(out),
            torch.randn_like(out).contiguous(memory_format=torch.channels_last),
        ):
            torch.autograd.grad(out, (depth, feat), grad_out, retain_graph=True)
