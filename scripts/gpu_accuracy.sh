#!/usr/bin/env bash
# The accuracy benchmark in ONE GPU call (<= 10 minutes, bare machine): install the wheels, build the ops for sm_90,
# generate the benchmark set (reused when present), train ACC_RECIPES x ACC_SEEDS for ACC_STEPS steps as ACC_PARALLEL
# processes with scripts/accuracy.py, copy accuracy.{json,md,png} and every run's metrics.jsonl, final.json,
# config.yaml and train.log (no checkpoints) to $OUT; with LOOP=1 then the train_loop suite. Every stage is
# time-boxed against one deadline (TOTAL_SECONDS), so $OUT always holds what finished.
#   device run (carry .whl): ACC_RECIPES="paper default" ACC_SEEDS=0,1,2 ACC_STEPS=600 bash scripts/gpu_accuracy.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
DEADLINE=$((SECONDS + ${TOTAL_SECONDS:-570}))
left() { echo $((DEADLINE - SECONDS - ${1:-0})); }
cap() { local l; l=$(left "${2:-0}"); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }  # min(stage cap, time left)
ACC_OUT=runs/bench_accuracy
summary=()
stage() {  # stage NAME SECONDS CMD...: run under a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  if [ "$limit" -le 5 ]; then summary+=("$name: skipped (no time left)"); return 124; fi
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-10s rc=%-3s %4ss (limit %ss)  %s' "$name" "$rc" "$((SECONDS - t0))" "$limit" \
    "$(tail -n 1 "$OUT/$name.log")")")
  return $rc
}
collect() {  # what finished so far: the report and the run logs, never checkpoints
  cp "$ACC_OUT"/accuracy.{json,md,png} "$OUT"/ 2>/dev/null
  (cd "$ACC_OUT" 2>/dev/null && find runs \( -name metrics.jsonl -o -name final.json -o -name eval.json \
    -o -name config.yaml -o -name train.log \) -exec cp --parents {} "$OUT"/ \;)
}
trap collect EXIT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if ! ls lss/_C*.so > /dev/null 2>&1; then
  stage build "$(cap 300 240)" python3 setup.py build_ext --inplace || { tail -n 30 "$OUT/build.log"; exit 1; }
fi
stage env 60 python3 -m lss env
read -r SCENES SAMPLES < <(python3 -c "from lss.benchmarks.accuracy import BENCHMARK_SET as B; print(B.scenes, B.samples_per_scene)")
SCENES=${ACC_SCENES:-$SCENES} SAMPLES=${ACC_SAMPLES:-$SAMPLES}
stage generate "$(cap 240 120)" python3 -c "
from pathlib import Path
from lss.benchmarks._runs import ensure_synthetic_set
from lss.benchmarks.accuracy import BENCHMARK_SET as B, SyntheticSet
spec = SyntheticSet(B.version, $SCENES, $SAMPLES, B.image_size, B.seed)
print(f'benchmark set {spec.describe()} ready after {ensure_synthetic_set(Path(\"data/benchmark_accuracy\"), spec, 16):.0f} s of generation')"
recipes=()
for r in ${ACC_RECIPES:-paper default}; do recipes+=(--recipe "$r"); done
LOOP_RESERVE=$([ "${LOOP:-0}" = 1 ] && echo 150 || echo 0)
RUN_LIMIT=$(left $((LOOP_RESERVE + 40)))  # each run is killed (and reported) before the stage's own limit
stage accuracy "$(left $((LOOP_RESERVE + 15)))" python3 scripts/accuracy.py "${recipes[@]}" \
  --seeds "${ACC_SEEDS:-0,1,2}" --steps "${ACC_STEPS:-600}" --eval-every "${ACC_EVAL_EVERY:-100}" \
  --parallel "${ACC_PARALLEL:-6}" --workers "${ACC_WORKERS:-2}" --data-dir data/benchmark_accuracy \
  --scenes "$SCENES" --samples-per-scene "$SAMPLES" --out-dir "$ACC_OUT" --run-timeout "$RUN_LIMIT"
collect
if [ "${LOOP:-0}" = 1 ]; then
  LSS_LOOP_DATA=data/benchmark_accuracy LSS_LOOP_VERSION=v1.0-trainval LSS_LOOP_STEPS=${LOOP_STEPS:-200} \
  LSS_LOOP_TIMEOUT=$(left 60) LSS_LOOP_OUT=/tmp/lss-loop stage train_loop "$(left 10)" \
    python3 -m lss bench --suite train_loop --out "$OUT/bench_train_loop"
fi
cat "$OUT/accuracy.md" 2>/dev/null
cat "$OUT/bench_train_loop/bench.md" 2>/dev/null
printf '%s\n' "${summary[@]}"
