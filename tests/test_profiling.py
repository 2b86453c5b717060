"""train.profile_steps: torch.profiler over chosen steps of the real training loop, written to the run directory."""
import json

import pytest

from lss.config import ConfigError, load_config
from lss.engine.train import train

TINY = ["data.final_dim=[32, 96]", "data.resize_lim=[0.24, 0.26]", "grid.xbound=[-16.0, 16.0, 1.0]",
        "grid.ybound=[-16.0, 16.0, 1.0]", "grid.dbound=[4.0, 20.0, 2.0]", "model.context_channels=8",
        "data.classes=[vehicle, drivable_area]", "data.workers=0", "train.batch_size=2", "train.max_steps=4",
        "train.eval_every=0", "train.viz_every=0", "train.ckpt_every=0", "train.log_every=1", "train.device=cpu"]


def test_the_profiled_steps_of_a_run_are_summarised_and_traced(synthetic_root, tmp_path, capsys):
    cfg = load_config(None, TINY + [f"data.dataroot={synthetic_root}", "train.profile_steps=[2, 2]"])
    train(cfg, str(tmp_path / "run"))
    summary = json.loads((tmp_path / "run" / "profile" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["device"] == "cpu"
    assert summary["wall_ms_per_step"] > 0 and 0 <= summary["data_wait_ms_per_step"] < summary["wall_ms_per_step"]
    assert summary["gpu_kernel_ms_per_step"] is None and summary["kernels_per_step"] is None  # no GPU here
    names = [op["name"] for op in summary["top_host_ops"]]
    assert any("conv" in name for name in names)  # the model's forward and backward ran inside the window
    assert all(op["self_ms_per_step"] > 0 and op["calls_per_step"] > 0 for op in summary["top_host_ops"])
    trace = json.loads((tmp_path / "run" / "profile" / "trace.json").read_text())
    assert trace["traceEvents"]
    assert "profiled steps 2-3" in capsys.readouterr().out


@pytest.mark.parametrize("steps, message", [
    ("[1, 2]", r"first step >= 2 \(step 1 builds"),
    ("[3]", r"train.profile_steps=\[3\]: expected tuple"),
    ("[2, 0]", "at least 1 step"),
    ("[3, 5]", r"ends at step 7, after train.max_steps=4"),
])
def test_profile_steps_outside_the_run_are_refused(steps, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, TINY + [f"train.profile_steps={steps}"])
