#!/usr/bin/env bash
# GPU training check, in one call after scripts/gpu_check.sh built the ops: generate the synthetic set at 1600x900,
# train configs/synthetic.yaml for TRAIN_STEPS steps, evaluate, and train + evaluate the detection head on a small
# synthetic v1.0-trainval set. Metrics, curves and eval tables go to $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
[ -f lss/_C*.so ] || python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -n 30 "$OUT/build.log"; exit 1; }
STEPS=${TRAIN_STEPS:-2000}
t0=$SECONDS
python3 -m lss make-synthetic data/synthetic --scenes 10 --samples-per-scene 40 --workers 16 > "$OUT/gen.log" 2>&1
echo "segmentation set generated in $((SECONDS - t0)) s"
timeout ${TRAIN_SECONDS:-300} python3 -m lss train --config configs/synthetic.yaml --out runs/synthetic \
  --set train.max_steps=$STEPS --set train.eval_every=500 --set train.ckpt_every=500 --set train.viz_every=100000 \
  > "$OUT/train_seg.log" 2>&1
echo "segmentation training rc=$? in $((SECONDS - t0)) s"
cp runs/synthetic/metrics.jsonl "$OUT/seg_metrics.jsonl" 2>/dev/null
python3 -m lss eval --config configs/synthetic.yaml --ckpt runs/synthetic/checkpoints/last.pt --out "$OUT" \
  > "$OUT/eval_seg.log" 2>&1
tail -n 25 "$OUT/eval_seg.log"
if [ "${DETECTION:-1}" = 1 ]; then
  t1=$SECONDS
  timeout ${DET_SECONDS:-240} python3 -m lss train --config configs/synthetic_detection.yaml --out runs/det \
    --set data.synthetic.scenes=${DET_SCENES:-16} --set data.synthetic.samples_per_scene=20 \
    --set train.max_steps=${DET_STEPS:-1500} --set train.eval_every=100000 --set train.viz_every=100000 \
    > "$OUT/train_det.log" 2>&1
  echo "detection training rc=$? in $((SECONDS - t1)) s"
  cp runs/det/metrics.jsonl "$OUT/det_metrics.jsonl" 2>/dev/null
  mkdir -p "$OUT/det"
  python3 -m lss eval --config configs/synthetic_detection.yaml --set data.synthetic.scenes=${DET_SCENES:-16} \
    --set data.synthetic.samples_per_scene=20 --ckpt runs/det/checkpoints/last.pt --out "$OUT/det" \
    > "$OUT/eval_det.log" 2>&1
  tail -n 30 "$OUT/eval_det.log"
fi
