#!/usr/bin/env bash
# Multi-GPU check on a 2-GPU machine (device kind nvidia-h200-x2): train the same steps on 1 GPU with batch 4 and
# with torchrun on 2 GPUs with batch 2 per process (same global batch), augmentation off, and compare the loss
# curves (scripts/compare_losses.py). Logs under $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
ls lss/_C*.so > /dev/null 2>&1 || python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -n 30 "$OUT/build.log"; exit 1; }
SET=(--set data.synthetic.scenes=4 --set data.synthetic.samples_per_scene=10 --set data.synthetic.image_size=[800,450]
     --set data.dataroot=data/synthetic-ddp --set "data.resize_lim=[0.4,0.4]" --set "data.rot_lim=[0.0,0.0]"
     --set data.rand_flip=false --set "data.bot_pct_lim=[0.0,0.0]" --set data.workers=4 --set train.compile=false
     --set train.max_steps=${DDP_STEPS:-40} --set train.log_every=2 --set train.eval_every=${DDP_STEPS:-40}
     --set train.ckpt_every=100000 --set train.viz_every=100000 --set optim.schedule=constant --set optim.lr=0.0005)
python3 -m lss make-synthetic data/synthetic-ddp --scenes 4 --samples-per-scene 10 --image-size 800x450 \
  --workers 16 > "$OUT/ddp_gen.log" 2>&1 || { tail -n 20 "$OUT/ddp_gen.log"; exit 1; }
t0=$SECONDS
python3 -m lss train --config configs/synthetic.yaml --out runs/gpu1 --set train.batch_size=4 "${SET[@]}" \
  > "$OUT/ddp_1gpu.log" 2>&1
echo "1 GPU, batch 4: rc=$? in $((SECONDS - t0)) s"; t0=$SECONDS
torchrun --standalone --nproc_per_node=2 -m lss train --config configs/synthetic.yaml --out runs/gpu2 \
  --set train.batch_size=2 "${SET[@]}" > "$OUT/ddp_2gpu.log" 2>&1
echo "2 GPUs (torchrun), batch 2 per process: rc=$? in $((SECONDS - t0)) s"
cp runs/gpu1/metrics.jsonl "$OUT/metrics_1gpu.jsonl"; cp runs/gpu2/metrics.jsonl "$OUT/metrics_2gpu.jsonl"
python3 scripts/compare_losses.py runs/gpu1 runs/gpu2 --tol ${DDP_TOL:-0.05}
grep -h "IoU\|vehicle" "$OUT/ddp_1gpu.log" "$OUT/ddp_2gpu.log" | tail -n 12
