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


@pytest.mark.slow
def test_probe_step_runs_a_config_with_the_detection_head_on_cpu():
    """--config with both heads (the default's): random boxes give the detection losses their targets, the second
    stage's too."""
    args = [sys.executable, str(ROOT / "scripts" / "probe_step.py"), "--layout", "false", "--config",
            "configs/synthetic_detection.yaml", "--set", "data.resize_lim=[0.05, 0.06]",
            "--set", "grid.dbound=[4.0, 12.0, 2.0]", "--set", "detection.head_channels=8"]
    for pair in TINY:
        args += ["--set", pair]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[0])["first_call_s"] > 0  # on a CPU the probe stops after the call


def test_random_batches_carry_detection_targets_of_boxes_inside_the_grid():
    import torch

    from benchmarks.train_step import random_batches
    from lss.config import load_config
    from lss.geometry.boxes import DENSE_TARGET_KEYS, REFINE_TARGET_KEYS

    cfg = load_config("configs/synthetic.yaml", TINY)
    (batch,) = random_batches(cfg, 2, torch.device("cpu"), 1)
    assert set(DENSE_TARGET_KEYS) | set(REFINE_TARGET_KEYS) <= set(batch)
    labels, boxes = batch["det_target_labels"], batch["det_target_boxes"]
    assert labels.shape == (2, cfg.detection.max_objects) and (labels >= 0).sum(1).tolist() == [24, 24]
    centres = boxes[labels >= 0][:, :2]
    assert centres.min() > -8.0 and centres.max() < 8.0  # the tiny grid's bounds
    assert batch["det_target_heatmap"].amax() == 1.0  # a peak at every centre
    segmentation = load_config("configs/synthetic_segmentation.yaml", TINY)
    assert not set(DENSE_TARGET_KEYS) & set(random_batches(segmentation, 1, torch.device("cpu"), 1)[0])
