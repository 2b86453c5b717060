"""Compare the training-loss curves of two run directories (metrics.jsonl), e.g. 1-GPU vs DDP at the same global
batch. Prints both curves side by side and the relative differences; exits 1 when the mean relative difference of
the logged losses exceeds --tol.

    python scripts/compare_losses.py RUN_A RUN_B [--tol 0.05]"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def train_losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if r.get("kind") == "train"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--tol", type=float, default=0.05)
    args = parser.parse_args()
    a, b = train_losses(args.run_a), train_losses(args.run_b)
    steps = sorted(set(a) & set(b))
    if not steps:
        print(f"no common logged steps: {args.run_a} has {sorted(a)[:5]}..., {args.run_b} has {sorted(b)[:5]}...")
        return 1
    print(f"{'step':>6} {args.run_a.name:>14} {args.run_b.name:>14} {'rel diff':>9}")
    diffs = []
    for s in steps:
        d = abs(a[s] - b[s]) / max(abs(a[s]), 1e-12)
        diffs.append(d)
        print(f"{s:>6} {a[s]:>14.5f} {b[s]:>14.5f} {d:>9.4f}")
    mean = sum(diffs) / len(diffs)
    verdict = "within" if mean <= args.tol else "OUTSIDE"
    print(f"mean relative difference {mean:.4f} over {len(steps)} steps (max {max(diffs):.4f}): {verdict} "
          f"tolerance {args.tol}")
    return 0 if mean <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
