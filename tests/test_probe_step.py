"""scripts/probe_step.py (the GPU probe of the captured step's layouts) on the CPU at a tiny size: it runs the step,
keeps the depthwise convolutions NCHW in its "hybrid" layout, and prints its JSON row first."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["data.final_dim=[32, 96]", "grid.xbound=[-8.0, 8.0, 1.0]", "grid.ybound=[-8.0, 8.0, 1.0]",
        "grid.dbound=[4.0, 12.0, 2.0]", "train.batch_size=1"]


@pytest.mark.slow
def test_probe_step_runs_the_hybrid_layout_on_cpu():
    args = [sys.executable, str(ROOT / "scripts" / "probe_step.py"), "--layout", "hybrid"]
    for pair in TINY:
        args += ["--set", pair]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "depthwise convolutions kept NCHW: 16"  # EfficientNet-B0 has 16 blocks, one each
    row = json.loads(lines[1])
    assert row["first_call_s"] > 0
