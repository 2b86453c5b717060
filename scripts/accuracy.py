"""Accuracy benchmark from the command line: train recipes x seeds on the fixed synthetic benchmark set as parallel
`lss train` processes and write accuracy.{json,md,png} (lss/benchmarks/accuracy.py; docs/benchmarks.md).

  python scripts/accuracy.py --recipe paper --recipe default --seeds 0,1,2 --steps 2000 --parallel 6
  python scripts/accuracy.py --recipe paper --recipe bevaug=configs/lss_paper.yaml,data.bev_flip=true
  python scripts/accuracy.py --quick          # CPU smoke run on a tiny set (CI)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lss.bench import device_meta  # noqa: E402
from lss.benchmarks import accuracy  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", action="append", default=None, metavar="NAME[=CONFIG[,key=value...]]",
                   help=f"repeatable; named recipes: {', '.join(accuracy.DEFAULT_RECIPES)} (default: paper, default)")
    p.add_argument("--seeds", default=None, help="comma-separated (default 0,1,2; quick 0,1)")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 2000; quick 2)")
    p.add_argument("--eval-every", type=int, default=None, help="validation every N steps (default 500)")
    p.add_argument("--parallel", type=int, default=None, help="training processes at once (default 6)")
    p.add_argument("--workers", type=int, default=None, help="data.workers per process (default 2)")
    p.add_argument("--data-dir", default=None, help="benchmark set, generated once (default data/benchmark_accuracy)")
    p.add_argument("--out-dir", default="runs/bench_accuracy")
    p.add_argument("--run-timeout", type=float, default=None, help="seconds per run before it is killed")
    p.add_argument("--scenes", type=int, default=None, help="scenes of the generated set (default: BENCHMARK_SET's)")
    p.add_argument("--samples-per-scene", type=int, default=None, help="default: BENCHMARK_SET's")
    p.add_argument("--quick", action="store_true", help="tiny set, 2 seeds x 2 steps on CPU")
    args = p.parse_args(argv)

    opts = accuracy.quick_options(args.out_dir, args.data_dir) if args.quick else accuracy.AccuracyOptions(
        out_dir=args.out_dir)
    if args.recipe:
        opts.recipes = [accuracy.parse_recipe(r) for r in args.recipe]
    if args.seeds:
        opts.seeds = tuple(int(s) for s in args.seeds.split(","))
    for name in ("steps", "eval_every", "parallel", "workers", "data_dir", "run_timeout"):
        if getattr(args, name) is not None:
            setattr(opts, name, getattr(args, name))
    if args.scenes or args.samples_per_scene:
        opts.dataset = accuracy.SyntheticSet(opts.dataset.version, args.scenes or opts.dataset.scenes,
                                             args.samples_per_scene or opts.dataset.samples_per_scene,
                                             opts.dataset.image_size, opts.dataset.seed)
    import torch

    meta = device_meta(torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu"))
    result = accuracy.benchmark(opts, meta)
    return 1 if any(r["status"] != "ok" for r in result["runs"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
