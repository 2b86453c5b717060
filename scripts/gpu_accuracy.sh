#!/usr/bin/env bash
# The accuracy benchmark on the GPU machine, which allows 10 minutes per call while the benchmark takes longer:
#   start    build the ops for sm_90, generate the benchmark set, then start
#            scripts/accuracy.py in the background (setsid: it outlives the call while the machine stays held)
#   collect  wait up to WAIT seconds (default 560) for it, report, and copy accuracy.{json,md,png} and the runs'
#            metrics.jsonl, final.json, config.yaml and train.log (no checkpoints) to $OUT/acc_runs.tgz
# Call `collect` again (within the machine's idle release) until it reports `rc=0`. ACC_ARGS are scripts/accuracy.py's
# arguments; the default is the table of docs/accuracy.md (6 processes of 2 data workers each on 16 cores).
# ACC_SET=screen trains on the 10-scene v1.0-mini screening set instead of the 40-scene benchmark set
# (benchmarks/accuracy.py NAMED_SETS; each set has its own folder data/<set>_accuracy). ACC_WORKERS (default 2) is
# the data workers per process: with --parallel P in ACC_ARGS keep P * (ACC_WORKERS + 1) near the machine's cores.
# On a machine of several GPUs the runs are spread over all of them (scripts/accuracy.py --gpus) unless ACC_ARGS
# names --gpus.
# The original LSS code's recipes (original, original_4k, NAME=original,...) need --original-lss PATH in ACC_ARGS,
# a checkout of nv-tlabs/lift-splat-shoot carried with the tree, and nuscenes-devkit, pyquaternion and
# efficientnet-pytorch from .whl (tensorboardX and fire are not needed).
#   device run (carry .whl): bash scripts/gpu_accuracy.sh start; then: bash scripts/gpu_accuracy.sh collect
#   e.g. ACC_SET=screen ACC_WORKERS=1 ACC_ARGS="--recipe original --recipe paper --seeds 0 --steps 2000 \
#        --parallel 8 --original-lss PATH" bash scripts/gpu_accuracy.sh start
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
T0=$SECONDS
ACC=${ACC_OUT:-/tmp/lss-accuracy}
SET=${ACC_SET:-benchmark}
DATA=data/${SET}_accuracy
ACC_ARGS=${ACC_ARGS:-"--recipe paper --recipe default --recipe paper_4k --recipe default_4k --seeds 0,1,2 \
--steps 2000 --eval-every 500 --parallel 6"}
case "${1:-}" in
start)
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  ( python3 -c "
from pathlib import Path
from benchmarks._runs import ensure_synthetic_set
from benchmarks.accuracy import NAMED_SETS
B = NAMED_SETS['$SET']
print(f'$SET set {B.describe()} ready after {ensure_synthetic_set(Path(\"$DATA\"), B, $(nproc)):.0f} s')" \
    > "$OUT/generate.log" 2>&1; echo "generate rc=$? at $((SECONDS - T0)) s: $(tail -n 1 "$OUT/generate.log")" ) &
  GEN=$!
  if ! ls lss/_C*.so > /dev/null 2>&1; then
    python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -n 30 "$OUT/build.log"; exit 1; }
    echo "build done at $((SECONDS - T0)) s"
  fi
  python3 -m lss env | grep -E "^torch |lss|GPU"
  if [[ "$ACC_ARGS" == *--original-lss* ]]; then
    python3 -c "import efficientnet_pytorch, nuscenes, pyquaternion, PIL; print('original LSS code: deps found')" \
      || { echo "the original LSS code needs nuscenes-devkit, pyquaternion, efficientnet-pytorch: carry .whl"; exit 1; }
  fi
  wait $GEN
  gpus=$(nvidia-smi -L | wc -l)  # several GPUs: the runs spread over them unless ACC_ARGS says otherwise
  [[ "$ACC_ARGS" != *--gpus* ]] && [ "$gpus" -gt 1 ] && ACC_ARGS="$ACC_ARGS --gpus $gpus"
  rm -f "$ACC.rc"
  setsid bash -c "python3 scripts/accuracy.py $ACC_ARGS --workers ${ACC_WORKERS:-2} --set $SET --data-dir $DATA \
    --out-dir $ACC > $ACC.log 2>&1; echo \$? > $ACC.rc" < /dev/null > /dev/null 2>&1 &
  sleep 15
  echo "accuracy.py started at $((SECONDS - T0)) s: $ACC_ARGS"
  ;;
collect)
  end=$((SECONDS + ${WAIT:-560}))
  while [ $SECONDS -lt $end ] && [ ! -f "$ACC.rc" ]; do sleep 10; done
  echo "rc=$(cat "$ACC.rc" 2>/dev/null || echo running)"
  grep -E "^accuracy:|^usage|error:" "$ACC.log"
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
  cp "$ACC"/accuracy.{json,md,png} "$OUT"/ 2>/dev/null
  [ -d "$ACC/runs" ] && (cd "$ACC" && tar czf "$OUT/acc_runs.tgz" --exclude='*.pt' --exclude=tensorboard runs)
  cat "$OUT/accuracy.md" 2>/dev/null
  ;;
*)
  echo "usage: bash scripts/gpu_accuracy.sh start|collect" >&2
  exit 2
  ;;
esac
