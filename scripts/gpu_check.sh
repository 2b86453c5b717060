#!/usr/bin/env bash
# The GPU check, in one call on the GPU machine (see docs/gpu.md): install the wheels the machine lacks, build the
# ops for sm_90, run the CUDA tests, run compute-sanitizer memcheck on every op's smoke test, run the benchmarks,
# profile bev_pool's kernels, and write logs, bench.json and bench.md under $OUT. A summary is printed last.
#   device run: bash scripts/gpu_check.sh            (carry .whl, made by ../shared/tools/device_wheels.sh .whl)
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
STAGES=${STAGES:-"build tests sanitizer profile bench"}  # a subset, e.g. STAGES="build bench", on a warm machine
has() { [[ " $STAGES " == *" $1 "* ]]; }
if has build; then
  step build build.log python3 setup.py build_ext --inplace || { tail -n 40 "$OUT/build.log"; exit 1; }
fi
has tests && step cuda-tests cuda_tests.log timeout ${TEST_SECONDS:-300} python3 -m pytest -q -m cuda tests ${LSS_TEST_ARGS:-}
has sanitizer && step sanitizer sanitizer.log timeout ${SANITIZER_SECONDS:-300} \
  compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitize_ops.py
has profile && step profile profile.log timeout 120 python3 scripts/profile_bev_pool.py
has bench && step bench bench.log timeout ${BENCH_SECONDS:-400} python3 -m lss bench --out "$OUT" ${LSS_BENCH_ARGS:-}
grep -sE "failed|FAILED|Error" "$OUT/cuda_tests.log" | tail -n 30
grep -sE "ERROR SUMMARY|Invalid" "$OUT/sanitizer.log" | head -n 20
cat "$OUT/profile.log" 2>/dev/null
cat "$OUT/bench.md" 2>/dev/null
printf '%s\n' "${summary[@]}"
