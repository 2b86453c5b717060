#!/usr/bin/env bash
# GPU training check, run from the repository root on a CUDA machine (it builds the ops unless built): generate a
# synthetic set at 1600x900, train configs/synthetic_segmentation.yaml for TRAIN_STEPS steps (at most TRAIN_SECONDS), evaluate;
# with DETECTION=1 also train and evaluate the detection head on a small synthetic v1.0-trainval set. Logs go to
# $OUT/train.log, the loss/IoU curve to $OUT/seg_metrics.jsonl ($OUT: default runs/gpu).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
LOG="$OUT/train.log"
ls lss/_C*.so > /dev/null 2>&1 || python3 setup.py build_ext --inplace >> "$LOG" 2>&1 || { tail -n 30 "$LOG"; exit 1; }
t0=$SECONDS
python3 -m lss make-synthetic data/synthetic --scenes ${SEG_SCENES:-10} --samples-per-scene ${SEG_SAMPLES:-24} \
  --workers "$(nproc)" >> "$LOG" 2>&1
echo "segmentation set generated in $((SECONDS - t0)) s" | tee -a "$LOG"
seg_train() {
  timeout ${TRAIN_SECONDS:-300} python3 -m lss train --config configs/synthetic_segmentation.yaml --out runs/synthetic \
    --set data.synthetic.scenes=${SEG_SCENES:-10} --set data.synthetic.samples_per_scene=${SEG_SAMPLES:-24} \
    --set train.max_steps=${TRAIN_STEPS:-2000} --set train.eval_every=${EVAL_EVERY:-250} --set train.ckpt_every=250 \
    --set train.viz_every=100000 "$@" >> "$LOG" 2>&1
}
seg_train; rc=$?
if [ $rc != 0 ] && [ $rc != 124 ]; then  # a failure (not the time limit): say so, and train eagerly instead
  grep -E "Error|error" "$LOG" | tail -n 5; echo "retrying without train.compile" | tee -a "$LOG"
  rm -rf runs/synthetic; seg_train --set train.compile=false; rc=$?
fi
echo "segmentation training rc=$rc after $((SECONDS - t0)) s" | tee -a "$LOG"
cp runs/synthetic/metrics.jsonl "$OUT/seg_metrics.jsonl" 2>/dev/null
python3 -m lss eval --config configs/synthetic_segmentation.yaml --set data.synthetic.scenes=${SEG_SCENES:-10} \
  --set data.synthetic.samples_per_scene=${SEG_SAMPLES:-24} --ckpt runs/synthetic/checkpoints/last.pt \
  --out /tmp/lss-eval-seg 2>&1 | tee -a "$LOG" | tail -n 20
if [ "${DETECTION:-0}" = 1 ]; then
  t1=$SECONDS
  timeout ${DET_SECONDS:-240} python3 -m lss train --config configs/synthetic_detection.yaml --out runs/det \
    --set data.synthetic.scenes=${DET_SCENES:-16} --set data.synthetic.samples_per_scene=20 \
    --set train.max_steps=${DET_STEPS:-1500} --set train.eval_every=100000 --set train.viz_every=100000 \
    --set train.compile=${DET_COMPILE:-true} >> "$LOG" 2>&1
  echo "detection training rc=$? after $((SECONDS - t1)) s" | tee -a "$LOG"
  python3 -m lss eval --config configs/synthetic_detection.yaml --set data.synthetic.scenes=${DET_SCENES:-16} \
    --set data.synthetic.samples_per_scene=20 --ckpt runs/det/checkpoints/last.pt --out /tmp/lss-eval-det 2>&1 \
    | tee -a "$LOG" | tail -n 30
fi
