#!/usr/bin/env bash
# train.compile_start, run from the repository root on a CUDA machine (logs under $OUT, default runs/gpu).
# STAGE=check: build, the background-compile tests (CPU and CUDA) and the trainer's CUDA tests, then 2,000 steps of
# configs/synthetic_segmentation.yaml end to end with compile off. STAGE=compile: the same config with train.compile: true twice,
# first with empty compiler caches, then with the caches of the first run; STAGE=now: the cold run with
# train.compile_start: now, its peer. Each run prints its wall time, its first step, the switch to compiled steps and
# its step rates (scripts/run_rates.py).
#   STAGE=check bash scripts/gpu_background_compile.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
t0=$SECONDS
build_ops || exit 1
if [ ! -d data/synthetic ]; then
  t1=$SECONDS
  python3 -m lss make-synthetic data/synthetic --scenes 10 --samples-per-scene 40 --workers "$(nproc)" > /dev/null 2>&1
  echo "set generated in $((SECONDS - t1)) s"
fi
train_run() {  # name, steps, extra --set pairs...
  local name=$1 steps=$2; shift 2
  local sets=(--set train.max_steps=$steps --set train.out_dir=/tmp/runs/$name)
  for kv in "$@"; do sets+=(--set "$kv"); done
  local t1=$SECONDS
  /usr/bin/time -f "%e s wall, %M KB max RSS" python3 -m lss train --config configs/synthetic_segmentation.yaml "${sets[@]}" \
    --overwrite > "$OUT/$name.log" 2>&1
  echo "== $name: rc=$? in $((SECONDS - t1)) s"
  grep -a -E "^lss:|wall|val IoU" "$OUT/$name.log" | grep -v "^ " | tail -n 8
  python3 scripts/run_rates.py /tmp/runs/$name/metrics.jsonl "$OUT/$name.log"
}
case ${STAGE:-check} in
  check)
    t1=$SECONDS
    python3 -m pytest -q -p no:cacheprovider tests/test_background_compile.py > "$OUT/tests_bg.log" 2>&1
    echo "background-compile tests rc=$? in $((SECONDS - t1)) s: $(tail -n 1 "$OUT/tests_bg.log")"
    t1=$SECONDS
    python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_graph_step.py tests/test_train_loop.py \
      tests/test_engine.py tests/test_probe_step.py > "$OUT/tests_cuda.log" 2>&1
    echo "trainer CUDA tests rc=$? in $((SECONDS - t1)) s: $(tail -n 1 "$OUT/tests_cuda.log")"
    grep -E "^(FAILED|ERROR)" "$OUT/tests_bg.log" "$OUT/tests_cuda.log" | head -n 20
    train_run e2e_2000 2000
    ;;
  compile)
    export TORCHINDUCTOR_CACHE_DIR=/tmp/ind-bg TRITON_CACHE_DIR=/tmp/tri-bg
    rm -rf /tmp/ind-bg /tmp/tri-bg
    train_run compile_cold ${COLD_STEPS:-12000} train.compile=true train.eval_every=4000 train.viz_every=4000 \
      train.ckpt_every=4000
    train_run compile_warm ${WARM_STEPS:-4000} train.compile=true train.eval_every=2000 train.viz_every=2000 \
      train.ckpt_every=2000
    ;;
  now)  # the peer: the same cold run compiling before its first step
    export TORCHINDUCTOR_CACHE_DIR=/tmp/ind-now TRITON_CACHE_DIR=/tmp/tri-now
    rm -rf /tmp/ind-now /tmp/tri-now
    train_run compile_now_cold ${COLD_STEPS:-12000} train.compile=true train.compile_start=now train.eval_every=4000 \
      train.viz_every=4000 train.ckpt_every=4000
    ;;
esac
echo "total $((SECONDS - t0)) s"
