"""Run `lss demo` once per seed, each from a clean state (no synthetic set, no run directory), and
print one JSON line per seed: the recipe, the whole process's wall time, the val IoU per class (%).

    python scripts/demo_seeds.py                       # seeds 0 1 2, the recipe of this machine
    python scripts/demo_seeds.py --device cpu --seeds 0 1 2 --work /tmp/demo-seeds
    python scripts/demo_seeds.py --keep-data -- --set train.max_steps=600   # extra `lss demo` args

Each run generates the set into WORK/data (deleted first unless --keep-data keeps the first run's),
trains into WORK/seed-S (train.seed=S; the generated set is the same for every seed) and logs to
WORK/seed-S.log. The last line is the mean and standard deviation over the seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def machine() -> dict:
    import torch

    names = (
        [
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ]
        if Path("/proc/cpuinfo").is_file()
        else []
    )
    cpu = names[0] if names else platform.processor()
    info = {"torch": torch.__version__, "cpus": len(os.sched_getaffinity(0)), "cpu": cpu}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def run_seed(seed: int, args, extra: list[str]) -> dict:
    work = Path(args.work)
    data, run, log = work / "data", work / f"seed-{seed}", work / f"seed-{seed}.log"
    if not args.keep_data:
        shutil.rmtree(data, ignore_errors=True)
    shutil.rmtree(run, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "lss",
        "demo",
        "--device",
        args.device,
        "--out",
        str(run),
        "--set",
        f"train.seed={seed}",
        "--set",
        f"data.dataroot={data}",
        *extra,
    ]
    start = time.perf_counter()
    with log.open("w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - start
    text = log.read_text()
    if rc != 0:
        sys.exit(f"seed {seed}: `{' '.join(cmd)}` exited with {rc}; see {log}")
    recipe = re.search(r"^lss demo: (.*)$", text, re.M)
    report = json.loads((run / "eval.json").read_text())
    return {
        "seed": seed,
        "seconds": round(seconds, 1),
        "iou": {c: round(100 * v, 2) for c, v in report["iou"].items()},
        "step": report["step"],
        "recipe": recipe.group(1) if recipe else None,
        "log": str(log),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--work", default="runs/demo-seeds")
    parser.add_argument(
        "--keep-data", action="store_true", help="generate the set once, not per seed"
    )
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    Path(args.work).mkdir(parents=True, exist_ok=True)
    print(json.dumps({"machine": machine(), "date": time.strftime("%Y-%m-%d")}), flush=True)
    rows = []
    for seed in args.seeds:
        rows.append(run_seed(seed, args, extra))
        print(json.dumps(rows[-1]), flush=True)
    summary = {"seeds": args.seeds}
    for key in ["seconds"] + [f"iou/{c}" for c in rows[0]["iou"]]:
        values = [r["seconds"] if key == "seconds" else r["iou"][key[4:]] for r in rows]
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        summary[key] = f"{statistics.mean(values):.2f} +- {spread:.2f}"
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
