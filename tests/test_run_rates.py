"""scripts/run_rates.py: the pace of a run before and after its switch to compiled steps, from its records."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from run_rates import rates  # noqa: E402


def records(switch_stall: float):
    """Steps 0..200 every 20 steps: 50 steps/s, then the switch at step 101 costs `switch_stall` s, then 100/s;
    an evaluation at step 60 (the interval after it is left out)."""
    out, elapsed = [{"kind": "startup", "phases": {"first_step": 8.5}}], 10.0
    for step in range(0, 201, 20):
        if step:
            elapsed += 20 / 50 if step <= 100 else 20 / 100
            if step == 120:
                elapsed += switch_stall
        if step == 80:
            elapsed += 5.0  # the evaluation after step 60
        out.append({"kind": "train", "step": step, "elapsed": elapsed})
        if step == 60:
            out.append({"kind": "val", "step": 60, "iou": {"vehicle": 0.25}})
    return out


def test_rates_split_the_run_at_the_switch_and_price_it():
    got = rates(records(12.0), "train ...\nlss: compiled steps from step 101 (the compile process compiled in 95 s)\n")
    assert got["first_step_s"] == 8.5 and got["switch_step"] == 101 and got["steps"] == 200
    assert got["steps_per_s_before"] == 50.0 and got["steps_per_s_after"] == 100.0
    # the interval 100-120 took 12 s + 0.2 s; at 50 steps/s it would have taken 0.4 s
    assert got["switch_cost_s"] == 11.8 and got["val_iou"] == {"vehicle": 25.0}


def test_rates_of_a_run_without_a_switch():
    got = rates(records(0.0))
    assert got["switch_step"] is None and "switch_cost_s" not in got and got["steps_per_s_after"] is None
    # every interval but the evaluation's counts as "before": 4 at 50 steps/s, 5 at 100
    assert got["steps_per_s_before"] == 100.0
