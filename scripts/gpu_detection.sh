#!/usr/bin/env bash
# Detection recipe runs for docs/detection.md, run from the repository root on a CUDA machine:
# configs/synthetic_detection.yaml trained on the accuracy benchmark set (data/benchmark_accuracy: v1.0-trainval,
# 40 scenes x 40 samples, 1600x900, seed 11) as parallel processes with the same steps and seed: the RoIAlign
# refinement on, off, and the segmentation head alone. Each evaluates every DET_EVAL_EVERY steps (nuScenes
# DetectionEval: mAP, NDS, AP per class; BEV IoU). Writes $OUT/detection_runs.json, $OUT/detection_curve.png,
# $OUT/det_runs.tgz (metrics.jsonl, final.json, train.log of each run), $OUT/detection_latency.json (batch-1
# inference latency with and without the head) and prints the summary ($OUT: default runs/gpu). Builds lss._C unless
# built; generates the set when it is missing. DET_TIMEOUT stops a run still going after that many seconds.
#   bash scripts/gpu_detection.sh
#   CPU check of the same path (tiny set and model, a few steps): DET_QUICK=1 bash scripts/gpu_detection.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
T0=$SECONDS
DET=${DET_OUT:-/tmp/lss-detection}
rm -rf "$DET"
if [ "${DET_QUICK:-0}" = 1 ]; then
  ARGS="--quick --steps 4 --eval-every 2 --runs refine_on,refine_off,segmentation_alone"
else
  nvidia-smi --query-gpu=name,driver_version,memory.total,utilization.gpu --format=csv,noheader
  if ! ls lss/_C*.so > /dev/null 2>&1; then
    python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -n 30 "$OUT/build.log"; exit 1; }
    echo "build done at $((SECONDS - T0)) s"
  fi
  ARGS="--data-dir ${DET_DATA:-data/benchmark_accuracy} --steps ${DET_STEPS:-2000} \
--eval-every ${DET_EVAL_EVERY:-500} --workers ${DET_WORKERS:-6} \
--runs ${DET_RUNS:-refine_on,refine_off,segmentation_alone}${DET_TIMEOUT:+ --run-timeout $DET_TIMEOUT}"
fi
python3 scripts/detection_runs.py $ARGS --out-dir "$DET" ${DET_ARGS:-}
RC=$?
# Batch-1 inference latency with the trained weights (random ones where a run left no checkpoint), after the runs.
LAT=()
for r in on off; do
  [ -f "$DET/runs/refine_$r/checkpoints/last.pt" ] && LAT+=(--ckpt-$r "$DET/runs/refine_$r/checkpoints/last.pt")
done
if [ "${DET_QUICK:-0}" = 1 ]; then
  LAT+=(--data-dir "$DET/data" --reps 2 --set "data.final_dim=[32, 96]" --set "data.resize_lim=[0.24, 0.26]"
        --set "grid.xbound=[-16.0, 16.0, 1.0]" --set "grid.ybound=[-16.0, 16.0, 1.0]"
        --set "grid.dbound=[4.0, 20.0, 2.0]" --set model.context_channels=8 --set train.device=cpu)
else
  LAT+=(--data-dir "${DET_DATA:-data/benchmark_accuracy}")
fi
[ "${DET_LATENCY:-1}" = 1 ] && timeout 90 python3 scripts/detection_latency.py "${LAT[@]}" \
  --out "$OUT/detection_latency.json"
cp "$DET"/detection_runs.json "$DET"/detection_curve.png "$OUT"/ 2>/dev/null
[ -d "$DET/runs" ] && (cd "$DET" && tar czf "$OUT/det_runs.tgz" --exclude='*.pt' --exclude=tensorboard runs)
[ "${DET_QUICK:-0}" = 1 ] || nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
echo "gpu_detection rc=$RC after $((SECONDS - T0)) s"
exit $RC
