"""Benchmark suites for `lss bench`: each module exposes run(ctx: lss.bench.BenchContext) -> list of row dicts."""
