"""Benchmark suites of a source checkout, run by `lss bench` (not shipped with the installed package).

Each suite module exposes run(ctx: BenchContext) -> list of row dicts; the harness lives in _harness.py."""

from benchmarks._harness import (
    OPT_IN_SUITES,
    BenchContext,
    available_suites,
    device_meta,
    kernel_table,
    measure_bandwidth,
    run,
)

__all__ = [
    "OPT_IN_SUITES",
    "BenchContext",
    "available_suites",
    "device_meta",
    "kernel_table",
    "measure_bandwidth",
    "run",
]
