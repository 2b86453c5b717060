"""Runs every benchmark suite's `smoke(device)` (each op forward + backward on small CUDA inputs) so that
compute-sanitizer can check the kernels: `compute-sanitizer --tool memcheck python scripts/sanitize_ops.py`."""
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's benchmarks/
from benchmarks import available_suites


def main() -> int:
    device = torch.device("cuda")
    ran = []
    for name in available_suites():
        mod = importlib.import_module(f"benchmarks.{name}")
        if hasattr(mod, "smoke"):
            mod.smoke(device)
            torch.cuda.synchronize()
            ran.append(name)
    print(f"sanitize_ops: ran smoke of {ran}")
    return 0 if ran else 1


if __name__ == "__main__":
    sys.exit(main())
