"""Compare the training-loss curves of two run directories (metrics.jsonl), e.g. 1 GPU against
torchrun at the same global batch. Prints both curves side by side and the relative differences;
exits 1 when the mean relative difference of the logged losses exceeds --tol.

    python scripts/compare_losses.py RUN_A RUN_B [--tol 0.05]

`lss bench --suite ddp` (scripts/gpu_ddp.sh) runs such a pair and the same comparison."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's benchmarks/
from benchmarks._runs import read_jsonl  # noqa: E402
from benchmarks.ddp import curve_difference, train_losses  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--tol", type=float, default=0.05)
    args = parser.parse_args()
    a, b = (train_losses(read_jsonl(run / "metrics.jsonl")) for run in (args.run_a, args.run_b))
    try:
        diff = curve_difference(a, b)
    except ValueError as e:
        print(f"{args.run_a} against {args.run_b}: {e}")
        return 1
    print(f"{'step':>6} {args.run_a.name:>14} {args.run_b.name:>14} {'rel diff':>9}")
    for s in diff["steps"]:
        print(f"{s:>6} {a[s]:>14.5f} {b[s]:>14.5f} {diff['per_step'][s]:>9.4f}")
    verdict = "within" if diff["mean"] <= args.tol else "OUTSIDE"
    print(
        f"mean relative difference {diff['mean']:.4f} over {len(diff['steps'])} steps (max "
        f"{diff['max']:.4f}): {verdict} tolerance {args.tol}"
    )
    return 0 if diff["mean"] <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
