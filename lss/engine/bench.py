"""`lss bench`: runs the benchmark suites of a source checkout (benchmarks/ beside lss/).

The suites are not part of the installed package: they are found next to an editable install
(`pip install -e .`) or in the current directory.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Optional

from lss.errors import LssError


def find_checkout(candidates: Optional[list[Path]] = None) -> Optional[Path]:
    """The first of `candidates` (default: the folder above the lss package, then the current
    directory) that holds benchmarks/_harness.py, else None."""
    if candidates is None:
        candidates = [Path(__file__).resolve().parents[2], Path.cwd()]
    for root in candidates:
        if (root / "benchmarks" / "_harness.py").is_file():
            return root
    return None


def load_benchmarks(candidates: Optional[list[Path]] = None):
    """The checkout's `benchmarks` package, its folder put first on sys.path."""
    root = find_checkout(candidates)
    if root is None:
        searched = candidates or [Path(__file__).resolve().parents[2], Path.cwd()]
        raise LssError(
            "lss bench runs the benchmark suites of a source checkout, and none was found: no "
            f"benchmarks/_harness.py under {', '.join(str(p) for p in searched)}. The installed "
            "package does not ship them; clone the repository, `pip install -e .` in it and run "
            "`lss bench` there (or run it from the checkout's root folder)."
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module("benchmarks")


def run(
    suites: Optional[list[str]] = None,
    device: Optional[str] = None,
    out_dir: Optional[str] = None,
    quick: bool = False,
) -> list[dict]:
    """Runs the named suites (default: all but the opt-in ones); see benchmarks._harness.run."""
    return load_benchmarks().run(suites=suites, device=device, out_dir=out_dir, quick=quick)
