r"""Accuracy benchmark from the command line: train recipes x seeds on a fixed synthetic set as
parallel `lss train` processes (and the original LSS code's recipes from a checkout of it) and write
accuracy.{json,md,png} (benchmarks/accuracy.py; docs/accuracy.md).

  python scripts/accuracy.py --recipe paper --recipe default --seeds 0,1,2 --steps 2000 --parallel 6
  python scripts/accuracy.py --recipe paper --recipe flip=configs/lss_paper.yaml,data.bev_flip=true
  python scripts/accuracy.py --recipe original --recipe paper --original-lss ../lift-splat-shoot
  python scripts/accuracy.py --set screen --recipe original --recipe paper --seeds 0 --parallel 8 \
      --workers 1 --original-lss ../lift-splat-shoot
  python scripts/accuracy.py --recipe default --recipe original_4k --steps 4000 --eval-every 200 \
      --parallel 4 --gpus 4 --time-to vehicle=0.30 --original-lss ../lift-splat-shoot
  python scripts/accuracy.py --quick          # CPU smoke run on a tiny set (CI)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import accuracy, device_meta  # noqa: E402


def main(argv=None) -> int:
    parser = accuracy.build_parser()
    parser.description = __doc__
    args = parser.parse_args(argv)
    try:
        opts = accuracy.options_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    import torch

    meta = device_meta(
        torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    )
    result = accuracy.benchmark(opts, meta)
    return 1 if any(r["status"] == "failed" for r in result["runs"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
