"""A training run's pace from its metrics.jsonl (and its console log for the switch to compiled steps): the first
step, the steps/s before and after the switch (median over the logging intervals, evaluation intervals left out),
the seconds the switch cost the run, and the last validation IoU. Prints one JSON line.

    python scripts/run_rates.py RUN_DIR/metrics.jsonl [RUN.log]

scripts/gpu_background_compile.sh runs it after each training run (docs/benchmarks.md)."""
from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

SWITCH = re.compile(r"lss: compiled steps from step (\d+)")


def rates(records: list[dict], log_text: str = "") -> dict:
    train = [r for r in records if r["kind"] == "train"]
    evaluated = {r["step"] for r in records if r["kind"] == "val"}
    startup = next((r for r in records if r["kind"] == "startup"), {})
    match = SWITCH.search(log_text)
    switch = int(match.group(1)) if match else None
    before, after, across = [], [], None
    for a, b in zip(train, train[1:]):
        if a["step"] in evaluated:  # the interval holds an evaluation
            continue
        pace = (b["step"] - a["step"]) / (b["elapsed"] - a["elapsed"])
        if switch is not None and a["step"] < switch <= b["step"]:
            across = (a, b)
        elif switch is None or b["step"] < switch:
            before.append(pace)
        else:
            after.append(pace)
    out = {"first_step_s": startup.get("phases", {}).get("first_step"), "switch_step": switch,
           "steps": train[-1]["step"] if train else 0, "elapsed_s": round(train[-1]["elapsed"], 1) if train else None,
           "steps_per_s_before": round(statistics.median(before), 2) if before else None,
           "steps_per_s_after": round(statistics.median(after), 2) if after else None}
    if across is not None and before:
        a, b = across
        at_eager_pace = (b["step"] - a["step"]) / out["steps_per_s_before"]
        out["switch_cost_s"] = round(b["elapsed"] - a["elapsed"] - at_eager_pace, 1)
        out["switch_at_s"] = round(a["elapsed"], 1)
    vals = [r for r in records if r["kind"] == "val"]
    if vals:
        out["val_iou"] = {k: round(100 * v, 2) for k, v in vals[-1]["iou"].items()}
    return out


def main(argv: list[str]) -> None:
    records = [json.loads(line) for line in Path(argv[0]).read_text().splitlines() if line.strip()]
    log_text = Path(argv[1]).read_text(errors="replace") if len(argv) > 1 else ""
    print(json.dumps(rates(records, log_text)))


if __name__ == "__main__":
    main(sys.argv[1:])
