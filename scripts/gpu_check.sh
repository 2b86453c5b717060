#!/usr/bin/env bash
# The GPU check; run it from the repository root on a CUDA machine (docs/gpu.md): build the ops for the visible GPU,
# run the CUDA tests, run compute-sanitizer memcheck on every op's smoke test, profile bev_pool's kernels, run the
# benchmarks, and write logs, bench.jsonl and bench.md under $OUT (default runs/gpu). A summary is printed last.
#   bash scripts/gpu_check.sh
#   STAGES="build bench" bash scripts/gpu_check.sh     # a subset of: build tests sanitizer profile bench
#   LSS_WHEELS=DIR bash scripts/gpu_check.sh           # install missing packages from a folder of wheels, offline
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
summary=()
step() {  # step NAME LOG CMD...: run, log to $OUT/LOG, remember pass/fail
  local name=$1 log=$2; shift 2
  local t0=$SECONDS
  "$@" > "$OUT/$log" 2>&1
  local rc=$?
  summary+=("$(printf '%-12s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$(tail -n 1 "$OUT/$log")")")
  return $rc
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
STAGES=${STAGES:-"build tests sanitizer profile bench"}
has() { [[ " $STAGES " == *" $1 "* ]]; }
if has build; then
  step build build.log python3 setup.py build_ext --inplace --force || { tail -n 40 "$OUT/build.log"; exit 1; }
fi
cuda_tests() {  # one pytest process per file: a crash in one file does not hide the others' results
  local rc=0 f
  for f in tests/test_*.py; do
    timeout ${TEST_SECONDS:-300} python3 -m pytest -q -m cuda -p no:cacheprovider "$f" ${LSS_TEST_ARGS:-} \
      > "$OUT/t.log" 2>&1
    local r=$?
    cat "$OUT/t.log"; rm -f "$OUT/t.log"
    [ $r -eq 5 ] && continue  # no CUDA tests in this file
    [ $r -ne 0 ] && { rc=$r; echo "FILE FAILED: $f (rc=$r)"; }
  done
  echo "cuda tests: rc=$rc"
  return $rc
}
has tests && step cuda-tests cuda_tests.log cuda_tests
has sanitizer && step sanitizer sanitizer.log timeout ${SANITIZER_SECONDS:-300} \
  compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitize_ops.py
has profile && step profile profile.log timeout 120 python3 scripts/profile_bev_pool.py
# the compiled train-step variants take minutes to compile; name them in LSS_TRAIN_STEP_IMPLS to include them
export LSS_TRAIN_STEP_IMPLS=${LSS_TRAIN_STEP_IMPLS:-lss_cuda_graph,lss,lss_fp32,reference_splat_fp32}
# one process and time limit per suite; bench.md collects every suite's table, bench.jsonl its JSON (a line per suite)
bench_suites() {
  local rc=0 suite
  for suite in ${BENCH_SUITES:-$(python3 -c "from benchmarks import available_suites as a; print(*a())")}; do
    timeout ${BENCH_SECONDS:-300} python3 -m lss bench --suite "$suite" --out "$OUT/bench_$suite" ${LSS_BENCH_ARGS:-} \
      || { rc=1; echo "SUITE FAILED: $suite"; }
    cat "$OUT/bench_$suite/bench.md" >> "$OUT/bench.md" 2>/dev/null
    [ -f "$OUT/bench_$suite/bench.json" ] \
      && python3 -c "import json, sys; print(json.dumps(json.load(open(sys.argv[1]))))" "$OUT/bench_$suite/bench.json" \
      >> "$OUT/bench.jsonl"
    rm -rf "$OUT/bench_$suite"
  done
  return $rc
}
has bench && step bench bench.log bench_suites
grep -sE "failed|FAILED|Error|passed" "$OUT/cuda_tests.log" | tail -n 40
grep -sE "ERROR SUMMARY|Invalid" "$OUT/sanitizer.log" | head -n 20
cat "$OUT/profile.log" 2>/dev/null
cat "$OUT/bench.md" 2>/dev/null
printf '%s\n' "${summary[@]}"
