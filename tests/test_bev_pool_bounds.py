"""bev_pool never reads outside its inputs, however its FrustumLUT was made: a table whose fields were replaced
past the frozen guard (object.__setattr__, never validated) is refused by the kernel with a message naming the
field, the bad value and what to do, instead of crashing the process."""
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from lss.ops import bev_pool, bev_pool_reference, has_ext
from test_bev_pool import TWO_LEVEL_GRID, channels_last_feat, inputs, random_lut

pytestmark = pytest.mark.skipif(not has_ext(), reason="lss._C not built")

ADVICE = "build the table again with lss.geometry.FrustumLUT.build"


def bypassed(lut, **fields):
    """`lut` with fields replaced past its frozen guard, as no FrustumLUT method allows: the new tensors are never
    validated, and (fresh, unmodified tensors) they pass the in-place check that bev_pool makes."""
    for name, value in fields.items():
        object.__setattr__(lut, name, value)
    lut.check_unchanged()
    return lut


def with_value(t, index, value):
    """t with t[index] = value, out of place (a fresh tensor, as a replaced field would be)."""
    return t.index_put((torch.tensor([index]),), torch.tensor(value, dtype=t.dtype))


def table(index_dtype, seed=21):
    """A LUT from the nuScenes rig (depth bins past the grid's 50 m: some points fall outside) whose index tensors
    have `index_dtype` (int64 ones replaced past the guard: the values stay valid)."""
    lut = random_lut(B=1, N=2, dbound=(4.0, 60.0, 4.0), grid=TWO_LEVEL_GRID, seed=seed)
    if index_dtype == torch.int64:
        bypassed(lut, **{name: getattr(lut, name).long() for name in ("point_cell", "sorted_points", "cell_start")})
    assert lut.point_cell.dtype == index_dtype
    return lut


def feat_in(layout, feat):
    return channels_last_feat(feat) if layout == "channels_last" else feat


def refused(message):
    return pytest.raises(RuntimeError, match=re.escape(message) + ".*" + re.escape(ADVICE))


def forward_cases(lut):
    """(field, bad tensor, message) for tables whose forward would read outside depth and feat."""
    P = lut.num_points
    cs, sp, pc = lut.cell_start, lut.sorted_points, lut.point_cell
    first = int(pc[sp[0]])  # the first cell with points
    after = int(cs[first + 1])
    assert after < P and int(cs[-1]) > 3
    return [
        ("sorted_points", with_value(sp, 3, 10**9),
         f"sorted_points[3] = 1000000000, expected a point index in [0, P) = [0, {P})"),
        ("sorted_points", with_value(sp, 3, -5), f"sorted_points[3] = -5, expected a point index in [0, P) = [0, {P})"),
        ("cell_start", with_value(cs, first + 1, 10**8),
         f"cell_start[{first + 1}] = 100000000, expected an offset in [0, P] = [0, {P}]"),
        ("cell_start", with_value(cs, first + 1, -2), f"cell_start[{first + 1}] = -2, expected an offset in [0, P]"),
        ("cell_start", with_value(cs, first, after + 1),
         f"cell_start[{first + 1}] = {after}, expected a value >= cell_start[{first}] = {after + 1} (cell_start is "
         "non-decreasing)"),
    ]


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_forward_refuses_a_bypassed_table(index_dtype, layout):
    for field, bad, message in forward_cases(table(index_dtype)):
        lut = bypassed(table(index_dtype), **{field: bad})
        depth, feat = inputs(lut, 5)
        with refused(message):
            bev_pool(depth, feat_in(layout, feat), lut)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("value", [10**9, -7])
def test_backward_refuses_a_bypassed_point_cell(index_dtype, layout, value):
    """The forward does not read point_cell; the backward checks it before it gathers gradient rows."""
    lut = table(index_dtype)
    depth, feat = inputs(lut, 5)
    depth.requires_grad_()
    feat = feat_in(layout, feat).requires_grad_()
    out = bev_pool(depth, feat, bypassed(lut, point_cell=with_value(lut.point_cell, 5, value)))
    with refused(f"point_cell[5] = {value}, expected -1 (outside the grid) or a cell in [0, B*nz*nx*ny) = "
                 f"[0, {lut.num_cells})"):
        torch.autograd.grad(out, (depth, feat), torch.randn_like(out))


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_valid_table_replaced_past_the_guard_still_matches_the_reference(index_dtype, layout):
    """The checks refuse nothing valid: fresh copies of a table's tensors (points outside the grid and empty cells
    included) give the reference's values and gradients."""
    built = table(torch.int32)
    lut = table(index_dtype)
    lut = bypassed(lut, **{name: getattr(lut, name).clone() for name in ("point_cell", "sorted_points", "cell_start")})
    assert bool((lut.point_cell == -1).any()) and bool((lut.cell_start.diff() == 0).any())
    depth, feat = inputs(lut, 5, torch.float64)
    depth.requires_grad_()
    feat = feat_in(layout, feat).requires_grad_()
    out = bev_pool(depth, feat, lut)
    want = bev_pool_reference(depth, feat, built)
    torch.testing.assert_close(out, want)
    grad_out = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, (depth, feat), grad_out),
                               torch.autograd.grad(want, (depth, feat), grad_out))


def run_script(body, device):
    """Runs `body` in a fresh interpreter with `lut` (fields replaced past the guard by the script) and inputs on
    `device`; returns the finished process (a crash shows as a negative return code, not a dead test session)."""
    script = textwrap.dedent("""
        import os, sys, torch
        sys.path.insert(0, {tests!r})
        from test_bev_pool import TWO_LEVEL_GRID, inputs, random_lut
        from lss.ops import bev_pool
        lut = random_lut(B=1, N=2, dbound=(4.0, 60.0, 4.0), grid=TWO_LEVEL_GRID, seed=21, device={device!r})
        depth, feat = (t.to({device!r}).requires_grad_() for t in inputs(lut, 5))
        bad = lut.sorted_points.clone().index_fill(0, torch.tensor([3], device={device!r}), 10**9)
        object.__setattr__(lut, "sorted_points", bad)
    """).format(tests=str(pathlib.Path(__file__).parent), device=device) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)


def test_bypassed_table_raises_and_the_process_lives_on():
    proc = run_script("""
        try:
            bev_pool(depth, feat, lut)
        except RuntimeError as e:
            print("refused:", e)
        print("alive")
    """, "cpu")
    assert proc.returncode == 0, proc.stderr
    assert "refused: bev_pool: sorted_points[3] = 1000000000, expected a point index in [0, P)" in proc.stdout
    assert proc.stdout.rstrip().endswith("alive")


@pytest.mark.cuda
def test_cuda_bypassed_table_fails_a_device_assertion_not_a_memory_error():
    """On CUDA the check is a device-side assertion (no host sync per call); it leaves the CUDA context unusable,
    hence the separate process."""
    proc = run_script("""
        try:
            bev_pool(depth, feat, lut)
            torch.cuda.synchronize()
        except RuntimeError as e:
            print("refused:", e)
        sys.stdout.flush()
        os._exit(0)
    """, "cuda")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "refused:" in proc.stdout and "device-side assert triggered" in proc.stdout, output
    assert "sorted_points holds an index outside [0, P)" in output, output
    assert "illegal memory access" not in output, output
