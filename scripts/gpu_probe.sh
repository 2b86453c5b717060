#!/usr/bin/env bash
# Probes of the training step (scripts/probe_step.py): layouts, a kernel profile, cold compilations. Run it from the
# repository root on a CUDA machine; logs go to $OUT (default runs/gpu).
#   bash scripts/gpu_probe.sh      (LAYOUTS=, COMPILES= pick a subset)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
t0=$SECONDS
build_ops || exit 1
for layout in ${LAYOUTS:-bev false true hybrid}; do
  extra=""; [ $layout = bev ] && extra=--profile
  timeout 120 python3 scripts/probe_step.py --layout $layout $extra > "$OUT/probe_$layout.log" 2>&1
  echo "layout $layout rc=$? at $((SECONDS - t0)) s"; head -c 600 "$OUT/probe_$layout.log" | grep -v "^ "; echo
done
grep -A 40 "Name" "$OUT/probe_bev.log" | head -n 40
for knobs in ${COMPILES:-inductor_defaults fast_start}; do  # each with empty compiler caches
  flag=""; [ $knobs = inductor_defaults ] && flag=--inductor-defaults
  export TORCHINDUCTOR_CACHE_DIR=/tmp/ind-$knobs TRITON_CACHE_DIR=/tmp/tri-$knobs
  t1=$SECONDS
  timeout ${COMPILE_SECONDS:-210} python3 scripts/probe_step.py --layout bev --compile $flag --replays 30 \
    > "$OUT/compile_$knobs.log" 2>&1
  echo "compile $knobs rc=$? wall $((SECONDS - t1)) s"; head -c 700 "$OUT/compile_$knobs.log"; echo
  phases="_compile|compile_attempt|bytecode|OutputGraph|create_aot|aot_|min_cut|compile_fx|fx_codegen|GraphLowering"
  grep -E "^($phases|Scheduler|async_compile|CachingAutotuner|backward)" "$OUT/compile_$knobs.log" | head -n 40
done
echo "total $((SECONDS - t0)) s"
