#!/usr/bin/env bash
# GPU training-loop check, run from the repository root on a CUDA machine: builds the ops if needed, then
# `lss bench --suite train_loop` (configs/synthetic_segmentation.yaml, compile off, LOOP_STEPS steps, 12 workers) once with cuDNN
# autotuning and once without. Each run prints its rows (start-up phases, loop, loader alone, step alone, loop/step,
# eval) and writes $OUT/train_loop_<name>.{json,log} ($OUT: default runs/gpu); a run past its limit ends with the
# Python stacks of the stuck process in its rows. RUNS=cudnn_benchmark (or no_cudnn_benchmark) runs one of them.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
ls lss/_C*.so > /dev/null 2>&1 || python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 \
  || { tail -n 30 "$OUT/build.log"; exit 1; }
export LSS_LOOP_DATA=/tmp/lss-loop-data LSS_LOOP_STEPS=${LOOP_STEPS:-400}
if [ ! -d "$LSS_LOOP_DATA" ]; then  # one set for both runs (the suite would generate it again per run)
  t0=$SECONDS
  python3 -m lss make-synthetic "$LSS_LOOP_DATA" --scenes 4 --samples-per-scene 20 --workers "$(nproc)" > /dev/null 2>&1
  echo "loop set generated in $((SECONDS - t0)) s"
fi
for name in ${RUNS:-cudnn_benchmark no_cudnn_benchmark}; do
  flag=true; [ $name = no_cudnn_benchmark ] && flag=false
  t0=$SECONDS
  LSS_LOOP_SET="train.compile=false;train.cudnn_benchmark=$flag" LSS_LOOP_OUT=/tmp/lss-loop-$name \
    timeout 400 python3 -m lss bench --suite train_loop --out "$OUT/train_loop_$name" > "$OUT/train_loop_$name.log" 2>&1
  echo "== train.cudnn_benchmark=$flag: rc=$? in $((SECONDS - t0)) s"
  python3 - "$OUT/train_loop_$name.log" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    if line.startswith("{"):
        r = json.loads(line)
        ms = f"{r['ms']:.1f}" if r.get("ms") else "-"
        print(f"  {r['impl']:<28} {ms:>9} ms  {r.get('notes', '')[:600]}")
PY
done
