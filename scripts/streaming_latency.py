"""Latency per frame of a two-frame model streaming a scene (lss.engine.streaming.StreamingPredictor: the camera
trunk once per frame, the previous frame's features kept), beside a one-frame model on the same frames and the
two-frame forward that runs the trunk on both frames (Predictor.predict_batch). Batch 1, in time order, one val scene
of the checkpoints' data set; each path is the Predictor's eager forward in bf16 on a GPU, so the three differ only in
the model's work. Per frame: the copy to the device, the forward and the decoding of boxes, synchronized; the median over the scene's frames after `--warmup` frames. On a GPU the same
three again with the Predictor's CUDA graphs (one frame: one graph; streamed: the first frame's and the streamed
frame's graphs; both trunks: one graph), each against its own one-frame row.

    python scripts/streaming_latency.py --single runs/synthetic-detection/checkpoints/last.pt \
        --temporal runs/synthetic-temporal/checkpoints/last.pt --out latency.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from lss import Predictor  # noqa: E402
from lss.data import collate  # noqa: E402
from lss.data.camera_inputs import scene_samples  # noqa: E402
from lss.engine.streaming import StreamingPredictor  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--single", required=True, help="checkpoint of a one-frame model")
    p.add_argument("--temporal", required=True, help="checkpoint of a two-frame model (model.temporal.frames: 2)")
    p.add_argument("--scene", default=None, help="scene name (default: the first scene of the val split)")
    p.add_argument("--warmup", type=int, default=5, help="frames run before the timing starts")
    p.add_argument("--passes", type=int, default=2, help="passes over the scene; the frames of the last are timed")
    p.add_argument("--device", default=None)
    p.add_argument("--set", action="append", default=[], dest="overrides", help="config override of both models")
    p.add_argument("--out", default=None, help="JSON file of the figures")
    return p.parse_args(argv)


def first_val_scene(cfg) -> str:
    from lss.data.tables import load_tables, locate_dataroot, resolve_split

    root, _ = locate_dataroot(cfg.data.dataroot, cfg.data.version)
    scenes = sorted(resolve_split(cfg.data.version, cfg.data.val_split)[1])
    names = {s["name"] for s in load_tables(root, cfg.data.version).scene}
    present = [s for s in scenes if s in names]
    if not present:
        raise SystemExit(f"no scene of the {cfg.data.val_split} split at {root}: give --scene")
    return present[0]


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def time_frames(step, batches: list[dict], device: torch.device, warmup: int, passes: int) -> list[float]:
    """Milliseconds of `step(batch)` per frame of the last pass (the first `warmup` frames of each pass untimed,
    as a stream restarts there)."""
    times = []
    for _ in range(passes):
        times = []
        for i, batch in enumerate(batches):
            t0 = _clock(device)
            step(batch)
            t1 = _clock(device)
            if i >= warmup:
                times.append(1e3 * (t1 - t0))
    return times


def summary(times: list[float]) -> dict:
    return {"median_ms": round(statistics.median(times), 3), "min_ms": round(min(times), 3),
            "frames": len(times)}


def predictors(args, cuda_graph: bool) -> tuple[Predictor, Predictor]:
    """The one-frame and the two-frame Predictor of the checkpoints."""
    return tuple(Predictor(path, args.device, overrides=args.overrides, cuda_graph=cuda_graph)
                 for path in (args.single, args.temporal))


def main(argv=None) -> dict:
    args = parse_args(argv)
    single, temporal = predictors(args, cuda_graph=False)
    if temporal.cfg.model.temporal.frames != 2 or single.cfg.model.temporal.frames != 1:
        raise SystemExit("--single needs a model.temporal.frames: 1 checkpoint, --temporal a frames: 2 one")
    scene = args.scene or first_val_scene(temporal.cfg)
    items = list(scene_samples(temporal.cfg, scene))
    if len(items) <= args.warmup:
        raise SystemExit(f"scene {scene} has {len(items)} samples; --warmup {args.warmup} leaves none to time")
    batches = [collate([item]) for item in items]
    device = temporal.device
    modes = [("eager", (single, temporal))]
    if device.type == "cuda":
        modes.append(("CUDA graphs", predictors(args, cuda_graph=True)))
    rows = {}
    for mode, (single, temporal) in modes:
        stream = StreamingPredictor(temporal)
        one = summary(time_frames(single.predict_batch, batches, device, args.warmup, args.passes))
        rows[f"{mode}: one frame"] = one
        rows[f"{mode}: two frames, streamed"] = summary(
            time_frames(stream.step, batches, device, args.warmup, args.passes))
        rows[f"{mode}: two frames, both trunks"] = summary(
            time_frames(temporal.predict_batch, batches, device, args.warmup, args.passes))
        for name in list(rows)[-3:]:
            rows[name]["ratio_to_one_frame"] = round(rows[name]["median_ms"] / one["median_ms"], 3)
        rows[f"{mode}: two frames, streamed"]["reused_batches"] = stream.reused
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d", time.gmtime()), "scene": scene,
           "frames_in_scene": len(batches), "final_dim": list(temporal.cfg.data.final_dim), "rows": rows}
    for name, row in rows.items():
        print(f"{name}: median {row['median_ms']:.2f} ms per frame ({row['ratio_to_one_frame']:.3f}x one frame), "
              f"min {row['min_ms']:.2f} ms, {row['frames']} frames")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
