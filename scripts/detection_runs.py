"""Detection recipe runs for docs/detection.md: configs/synthetic_detection.yaml (or --config) trained as parallel `lss train`
processes on one synthetic set (same steps, same seeds), e.g. the RoIAlign refinement on and off, and optionally the
segmentation head alone on the same data, each recipe once per seed. Each run evaluates every --eval-every steps
(nuScenes DetectionEval and BEV IoU); this script collects the curves into detection_runs.json (with each recipe's
mean and standard deviation over the seeds), detection_curve.png and a printed summary.

    python scripts/detection_runs.py --data-dir data/benchmark_accuracy --out-dir /tmp/det --steps 2000
    python scripts/detection_runs.py --runs refine_off --seeds 0,1,2 --out-dir /tmp/det \
        --recipe "weighted=detection.heatmap_class_weights=[1, 2, 4, 1, 1, 1, 2, 1, 1, 1]"
    python scripts/detection_runs.py --quick --out-dir /tmp/det_quick   # a tiny CPU run of the same path

A run still going at --run-timeout seconds is stopped (SIGINT, then SIGKILL); its last evaluation is reported and
marked as such.
"""
from __future__ import annotations

import argparse
import datetime
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._runs import (SyntheticSet, child_env, ensure_synthetic_set, lss_command,  # noqa: E402
                                  log_tail, read_jsonl, stop)
from benchmarks.accuracy import NAMED_SETS, QUICK_OVERRIDES, mean_std  # noqa: E402

CONFIG = "configs/synthetic_detection.yaml"
QUICK_SET = SyntheticSet("v1.0-trainval", scenes=2, samples_per_scene=4, image_size=(400, 225), seed=0)
# configs/synthetic_detection.yaml's detector before 2026-11-29 (the first stage alone, no BEV rotation): every recipe
# measured before then starts from it, so that it runs as it was measured (HR and AT_128 include it)
PLAIN = ("detection.refine=false", "detection.refine_depth=false", "data.bev_rot_lim=[0.0,0.0]",
         "data.bev_scale_lim=[1.0,1.0]")
# the default recipe's cameras (configs/synthetic.yaml; configs/synthetic_detection.yaml's since 2026-11-28): 256x704
# images, 82 depth bins of 0.5 m, the frustum's rays where the trunk's features are centred
HR = PLAIN + ("data.final_dim=[256,704]", "data.resize_lim=[0.386,0.45]", "grid.dbound=[4.0,45.0,0.5]",
      "model.frustum_pixels=receptive_field")
# configs/synthetic_detection.yaml's cameras before 2026-11-28 (the paper's 128x352, 41 depth bins of 1 m, pixel
# centres): what the recipes measured at that size add, so that they run as they were measured
AT_128 = PLAIN + ("data.final_dim=[128,352]", "data.resize_lim=[0.193,0.225]", "grid.dbound=[4.0,45.0,1.0]",
                  "model.frustum_pixels=centres")
# the detection head added to the segmentation-only config (--config configs/synthetic_segmentation.yaml), with the
# heatmap class weights of configs/synthetic_detection.yaml; the segmentation targets stay the same
JOINT = ("model.heads=[segmentation,detection]", "data.detection_targets=true",
         "detection.heatmap_class_weights=[1.0,2.5,4.0,1.0,1.0,1.0,4.0,1.0,1.0,1.0]")
# the second stage reading the camera depth distribution at each box's projected centre, at 256x704
HR_DEPTH = HR + ("detection.refine=true", "detection.refine_depth=true")
# BEV rotations (no flips) with a scale of 0.95-1.05: any angle, and within +-22.5 degrees
ROT_ANY = ("data.bev_rot_lim=[-180.0,180.0]", "data.bev_scale_lim=[0.95,1.05]")
ROT_SMALL = ("data.bev_rot_lim=[-22.5,22.5]", "data.bev_scale_lim=[0.95,1.05]")
# name -> overrides of CONFIG; every run gets the same data, steps and seed
RUNS = {
    # the second stage on the box centre and face middles (the default design), and on the box's envelope
    "refine_on": AT_128 + ("detection.refine=true",),
    "refine_envelope": AT_128 + ("detection.refine=true", "detection.refine_features=envelope"),
    "refine_off": AT_128,
    "segmentation_alone": PLAIN + ("model.heads=[segmentation]", "data.detection_targets=false"),
    "joint": JOINT,
    # the joint model with less of the detection losses in the shared BEV encoder (docs/detection.md): its own
    # last decoder stage, half the detection gradient into the encoder, half the detection loss, the lane divider
    # weighted up
    "joint_own": JOINT + ("detection.decoder=own",),
    "joint_gs05": JOINT + ("detection.trunk_grad_scale=0.5",),
    "joint_half": JOINT + ("detection.heatmap_weight=0.5", "detection.regression_weight=0.125"),
    "joint_lane": JOINT + ("loss.class_weights=[2.0,3.0,0.5,1.5]",),
    # the own decoder stage with no detection gradient into the shared encoder (does the lane divider recover when
    # only the detection head's own layers learn from boxes?), and with the lane divider weighted up
    "joint_own_gs0": JOINT + ("detection.decoder=own", "detection.trunk_grad_scale=0.0"),
    "joint_own_lane": JOINT + ("detection.decoder=own", "loss.class_weights=[2.0,3.0,0.5,1.0]"),
    # the own stage at half the width (64 channels): less GPU time per step (configs/synthetic.yaml since 2026-11-28)
    "joint_own_narrow": JOINT + ("detection.decoder=own", "detection.decoder_channels=64"),
    # two frames (docs/temporal.md): the previous key frame, and the one two key frames back (1 s on nuScenes)
    "temporal": AT_128 + ("model.temporal.frames=2",),
    "temporal_gap2": AT_128 + ("model.temporal.frames=2", "model.temporal.gap=2"),
    # two residual blocks on each frame's grid before the fusion (BEVDet4D's extra BEV encoder)
    "temporal_blocks": AT_128 + ("model.temporal.frames=2", "model.temporal.frame_blocks=2"),
    # the same at the default recipe's camera settings (docs/detection.md: two frames there screened above the
    # detection goals): one frame with the second stage off and on, and two frames
    "hr_refine_off": HR,
    "hr_refine_on": HR + ("detection.refine=true",),
    # the second stage also reading the camera depth distribution at each box's projected centre
    "hr_refine_depth": HR_DEPTH,
    # and the cameras' context features at the box's centre and face middles
    "hr_refine_image": HR_DEPTH + ("detection.refine_image=true",),
    "temporal_hr": HR + ("model.temporal.frames=2",),
    # the BEV-space augmentation (BEVDet's flips, rotation and scale of the ego frame) against overfitting a small set;
    # a single flip mirrors the traffic (right-hand driving becomes left-hand), and the headings and velocities the
    # head reads from where a vehicle drives with it (docs/detection.md), so also without flips, any rotation
    "hr_bevaug": HR + ("data.bev_flip=true",) + ROT_SMALL,
    "hr_bevrot": HR + ROT_ANY,
    # a rotation within +-22.5 degrees, no flips: the headings keep their relation to the ego frame's axes
    "hr_bevrot_small": HR + ROT_SMALL,
    # class-balanced sampling (CBGS): samples with trucks, buses, motorcycles drawn more often
    "hr_cbgs": HR + ("data.class_balanced=true",),
    # AdamW's weight decay at 0.01 (BEVDet's; the config's is 1e-4) against overfitting a small set
    "hr_wd": HR + ("optim.weight_decay=0.01",),
    # the rotation-only augmentation with the second stage reading the camera depth distributions
    "hr_bevrot_depth": HR_DEPTH + ROT_ANY,
    # the second stage with the depth cues with class-balanced sampling, and with the small rotation: screens for
    # what lifts the 10-scene set's rare trucks and buses without losing the headings; the second is
    # configs/synthetic_detection.yaml since 2026-11-29
    "hr_depth_cbgs": HR_DEPTH + ("data.class_balanced=true",),
    "hr_depth_rot_small": HR_DEPTH + ROT_SMALL,
    # that recipe with the second stage's score trained towards the share of the evaluation's matching distances
    # within which each proposal is a true positive
    "hr_depth_rot_small_q": HR_DEPTH + ROT_SMALL + ("detection.refine_quality=thresholds",),
    # two frames on configs/synthetic_detection.yaml, and with its second stage also reading the previous frame's
    # depth distributions where each box's centre projects (docs/temporal.md: motion along the camera rays)
    "temporal_hr_depth_rot_small": HR_DEPTH + ROT_SMALL + ("model.temporal.frames=2",),
    "temporal_hr_motion": HR_DEPTH + ROT_SMALL + ("model.temporal.frames=2", "detection.refine_motion=true"),
    # that with class-balanced sampling: the trucks and buses, whose velocity error stays above what one frame can
    # reach while the car's falls below it (docs/temporal.md), drawn more often
    "temporal_hr_motion_cbgs": HR_DEPTH
    + ROT_SMALL
    + ("model.temporal.frames=2", "detection.refine_motion=true", "data.class_balanced=true"),
    # and without the BEV rotation: one frame's truck velocity error is 1.6-1.8 m/s without it and 2.3-2.7 with it
    # (docs/temporal.md)
    "temporal_hr_motion_norot": HR_DEPTH + ("model.temporal.frames=2", "detection.refine_motion=true"),
    # the second stage also calling the proposals that face the wrong way (the truck's heading flips under the
    # rotation, and its velocity with them: docs/temporal.md), on the config and on two frames with the motion cues
    "hr_depth_rot_small_reversal": HR_DEPTH + ROT_SMALL + ("detection.refine_reversal=true",),
    "temporal_hr_motion_reversal": HR_DEPTH
    + ROT_SMALL
    + ("model.temporal.frames=2", "detection.refine_motion=true", "detection.refine_reversal=true"),
    # the second stage also reading both frames' splatted grids where each box is and where it was if it moved as
    # it says or the other way (the truck's wrong-way boxes carry its velocity error: docs/temporal.md), without
    # and with the reversal logit that can act on them
    "temporal_hr_motion_grid": HR_DEPTH
    + ROT_SMALL
    + ("model.temporal.frames=2", "detection.refine_motion=true", "detection.refine_motion_grid=true"),
    "temporal_hr_motion_grid_reversal": HR_DEPTH
    + ROT_SMALL
    + (
        "model.temporal.frames=2",
        "detection.refine_motion=true",
        "detection.refine_motion_grid=true",
        "detection.refine_reversal=true",
    ),
}
METRICS = ("mAP", "NDS", "vehicle_mAP", "vehicle_NDS")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default="data/benchmark_accuracy")
    p.add_argument("--set-name", default="benchmark", choices=sorted(NAMED_SETS),
                   help="the synthetic set at --data-dir (generated there if missing): benchmark, the 40-scene set the "
                        "recipe was tuned on; screen, the 10-scene v1.0-mini set of another seed")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--config", default=CONFIG, help="the config every recipe overrides")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 2000; 4 with --quick)")
    p.add_argument("--eval-every", type=int, default=None, help="default 500; with --quick, at the end only")
    p.add_argument("--workers", type=int, default=6, help="data workers per run")
    p.add_argument("--seeds", default="0", help="comma-separated training seeds; every recipe runs once per seed")
    p.add_argument("--runs", default="refine_on,refine_off",
                   help=f"comma-separated recipes, from {', '.join(RUNS)} and the --recipe names")
    p.add_argument("--recipe", action="append", default=[],
                   help="NAME=section.key=value[;section.key=value...]: a recipe of its own (add NAME to --runs)")
    p.add_argument("--decode", action="append", default=[],
                   help="NAME=detection.key=value[;...]: each finished run's last checkpoint is also evaluated under "
                        "this post-processing (`lss eval --decode`, one forward pass for all; repeatable)")
    p.add_argument("--run-timeout", type=float, default=None, help="seconds per run before it is stopped")
    p.add_argument("--set", action="append", default=[], dest="overrides", help="extra override for every run")
    p.add_argument("--quick", action="store_true", help="tiny CPU runs on a tiny generated set (tests the path)")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 4 if args.quick else 2000
    if args.eval_every is None:
        args.eval_every = args.steps if args.quick else 500
    return args


def run_all(args: argparse.Namespace) -> dict:
    out = Path(args.out_dir).resolve()  # the runs start in the repository root
    out.mkdir(parents=True, exist_ok=True)
    recipes = dict(RUNS)
    for item in args.recipe:
        name, sep, overrides = item.partition("=")
        if not sep or not name.strip():
            raise SystemExit(f"--recipe {item!r}: expected NAME=section.key=value[;section.key=value...]")
        recipes[name.strip()] = tuple(o.strip() for o in overrides.split(";") if o.strip())
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in recipes]
    if unknown:
        raise SystemExit(f"unknown run(s) {unknown}; expected names from {list(recipes)}")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    # the names are checked first: a typo must not wait for the set's generation
    spec = QUICK_SET if args.quick else NAMED_SETS[args.set_name]
    data_dir = Path(args.data_dir if not args.quick else out / "data").resolve()
    gen_seconds = ensure_synthetic_set(data_dir, spec)
    common = [f"data.dataroot={data_dir}", f"data.version={spec.version}", f"train.max_steps={args.steps}",
              f"train.eval_every={args.eval_every}", f"train.ckpt_every={args.steps}", "train.viz_every=0",
              f"data.workers={args.workers}", "data.make_synthetic_if_missing=false"]
    quick = list(QUICK_OVERRIDES) + ["train.log_every=1", "data.workers=0", "train.cuda_graph=false"] \
        if args.quick else []
    procs = {}
    for name, seed in ((n, s) for n in names for s in seeds):
        run = f"{name}_s{seed}"
        run_dir = out / "runs" / run
        run_dir.mkdir(parents=True, exist_ok=True)
        cmd = lss_command("train", args.config, common + [f"train.seed={seed}"] + list(recipes[name]) + quick +
                          list(args.overrides), "--out", str(run_dir), "--overwrite")
        log = (run_dir / "train.log").open("w")
        procs[run] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                       env=child_env(2 if args.quick else 4)), time.perf_counter(), log)
        print(f"started {run}: {' '.join(cmd)}", flush=True)
    results, evals = {}, {}
    for name, (proc, started, log) in procs.items():
        timed_out = False
        left = None if args.run_timeout is None else max(1.0, args.run_timeout - (time.perf_counter() - started))
        try:
            proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            timed_out = True
            stop(proc, signal.SIGINT, 20)
        log.close()
        results[name] = collect(out / "runs" / name, proc.returncode, timed_out, time.perf_counter() - started)
        if proc.returncode != 0 and not timed_out:
            print(f"{name} failed (exit {proc.returncode}):\n{log_tail(out / 'runs' / name / 'train.log')}")
        elif args.decode and results[name]["finished"]:
            evals[name] = start_decode_eval(out / "runs" / name, args.decode, 2 if args.quick else 4)
    for name, proc in evals.items():  # the runs' evaluations run side by side
        proc.wait()
        results[name]["decode"] = collect_decode(out / "runs" / name, proc.returncode)
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.quick else "cpu"
    summary = {"device": device, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
               "dataset": spec.describe(), "data_dir": str(data_dir), "generation_seconds": gen_seconds,
               "config": args.config, "steps": args.steps, "eval_every": args.eval_every, "seeds": seeds,
               "workers": args.workers, "overrides": list(args.overrides), "quick": args.quick,
               "recipes": {n: {"overrides": list(recipes[n]), **over_seeds(results, n, seeds)} for n in names},
               "runs": results}
    (out / "detection_runs.json").write_text(json.dumps(summary, indent=1))
    plot(summary, out / "detection_curve.png")
    print(to_text(summary), flush=True)
    return summary


def over_seeds(results: dict, name: str, seeds: list[int]) -> dict:
    """Mean and standard deviation over the seeds of a recipe's finished runs: the final mAP, NDS, vehicle mAP and
    NDS, the IoU per class and the AP per class."""
    finals = [results[f"{name}_s{s}"] for s in seeds if results[f"{name}_s{s}"]["finished"]]
    points = [run["curve"][-1] for run in finals if run["curve"]]

    def stats(values):
        values = [v for v in values if v is not None]
        if not values:
            return None
        mean, std = mean_std(values)
        return [mean, std or 0.0]  # one seed: no spread

    errors = [((run.get("detection") or {}).get("vehicles") or {}).get("tp_errors") or {} for run in finals]
    out = {"finished_seeds": len(finals),
           "final": {m: stats([p.get(m) for p in points]) for m in METRICS},
           "vehicle_tp_errors": {k: stats([e.get(k) for e in errors]) for k in (errors[0] if errors else {})},
           "iou": {c: stats([(p.get("iou") or {}).get(c) for p in points])
                   for c in (points[0].get("iou") or {} if points else {})},
           "AP": {c: stats([(p.get("AP") or {}).get(c) for p in points])
                  for c in (points[0].get("AP") or {} if points else {})}}
    decoded = [run["decode"] for run in finals if run.get("decode")]
    if decoded:
        out["decode"] = {v: {m: stats([d.get(v, {}).get(m) for d in decoded]) for m in METRICS} for v in decoded[0]}
    return out


def start_decode_eval(run_dir: Path, decode: list[str], threads: int) -> subprocess.Popen:
    """`lss eval --decode ...` of a finished run's last checkpoint under its own config, into RUN/decode/."""
    cmd = lss_command("eval", str(run_dir / "config.yaml"), [], "--ckpt", str(run_dir / "checkpoints" / "last.pt"),
                      "--out", str(run_dir / "decode"), *[a for spec in decode for a in ("--decode", spec)])
    log = (run_dir / "decode.log").open("w")
    print(f"evaluating {run_dir.name}: {' '.join(cmd)}", flush=True)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=child_env(threads))


def collect_decode(run_dir: Path, returncode: int) -> dict:
    """{variant: mAP, NDS, vehicle mAP and NDS} of a run's decode evaluation ("(the config)": its own decoding);
    {} with a message when it failed."""
    path = run_dir / "decode" / "eval.json"
    if returncode != 0 or not path.is_file():
        print(f"{run_dir.name}: the decode evaluation failed (exit {returncode}):\n{log_tail(run_dir / 'decode.log')}")
        return {}
    result = json.loads(path.read_text())
    return {name: {"mAP": d["mAP"], "NDS": d["NDS"], "vehicle_mAP": d["vehicles"]["mAP"],
                   "vehicle_NDS": d["vehicles"]["NDS"]}
            for name, d in {"(the config)": result["detection"], **result["detection_decode"]}.items()}


def collect(run_dir: Path, returncode: int, timed_out: bool, seconds: float) -> dict:
    """Curves (every evaluation) and the last evaluation of one run directory."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    val = [r for r in rows if r.get("kind") == "val"]
    train = [r for r in rows if r.get("kind") == "train"]
    curve = [{"step": r["step"], "mean_iou": r.get("mean_iou"), "iou": r.get("iou"), **r.get("detection", {})}
             for r in val]
    final_path = run_dir / "final.json"
    final = json.loads(final_path.read_text()) if final_path.is_file() else {}
    detection = final.get("val", {}).get("detection")
    return {"returncode": returncode, "timed_out": timed_out, "wall_seconds": round(seconds, 1),
            "last_step": train[-1]["step"] if train else 0, "finished": final_path.is_file(), "curve": curve,
            "detection": detection, "iou": final.get("val", {}).get("iou", curve[-1]["iou"] if curve else None)}


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for name, run in summary["runs"].items():
        seg = [p for p in run["curve"] if p.get("iou")]
        if seg:
            line, = axes[2].plot([p["step"] for p in seg], [100 * p["iou"].get("vehicle", float("nan")) for p in seg],
                                 "o-", label=f"{name} vehicle")
            axes[2].plot([p["step"] for p in seg], [100 * p["mean_iou"] for p in seg], "s:", color=line.get_color(),
                         label=f"{name} mean")
        points = [p for p in run["curve"] if p.get("mAP") is not None]
        if not points:
            continue
        steps = [p["step"] for p in points]
        for ax, key in ((axes[0], "vehicle"), (axes[1], "all")):
            m = [p["vehicle_mAP"] if key == "vehicle" else p["mAP"] for p in points]
            n = [p["vehicle_NDS"] if key == "vehicle" else p["NDS"] for p in points]
            line, = ax.plot(steps, m, "o-", label=f"{name} mAP")
            ax.plot(steps, n, "s--", color=line.get_color(), label=f"{name} NDS")
    axes[0].set_title("vehicle classes with ground truth")
    axes[1].set_title("all 10 classes (official mAP / NDS)")
    axes[2].set_title("BEV segmentation IoU % at 0.5 (joint and alone)")
    for ax in axes:
        ax.set_xlabel("training step")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ds = summary["dataset"]
    fig.suptitle(f"{summary['config']} on synthetic {ds['version']} ({ds['scenes']} scenes x "
                 f"{ds['samples_per_scene']}, seed {ds['seed']}); {summary['device']}, {summary['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def to_text(summary: dict) -> str:
    lines = [f"detection runs: {summary['device']} {summary['date']}, {summary['steps']} steps, seeds "
             f"{summary['seeds']}, set {summary['dataset']}"]
    for name, run in summary["runs"].items():
        status = "finished" if run["finished"] else ("stopped at the time limit" if run["timed_out"] else
                                                     f"failed (exit {run['returncode']})")
        lines.append(f"{name}: {status}, last step {run['last_step']}, {run['wall_seconds']} s")
        for p in run["curve"]:
            det = "" if p.get("mAP") is None else (
                f" mAP {p['mAP']:.4f} NDS {p['NDS']:.4f} vehicles mAP {p['vehicle_mAP']:.4f} NDS "
                f"{p['vehicle_NDS']:.4f}")
            iou = " ".join(f"{c} {100 * v:.2f}" for c, v in (p.get("iou") or {}).items())
            lines.append(f"  step {p['step']}:{det} | IoU {iou}")
        det = run["detection"]
        if det:
            lines.append("  AP " + ", ".join(f"{n} {row['AP']:.3f}" for n, row in det["per_class"].items()
                                             if row["has_ground_truth"]))
            lines.append("  TP errors (vehicles) " + ", ".join(
                f"{k} {v:.3f}" for k, v in det["vehicles"]["tp_errors"].items() if v is not None))
            flips = (det.get("true_positives") or {}).get("per_class", {})
            if any(n in flips for n in det["vehicles"]["classes"]):
                lines.append("  heading flipped / velocity reversed (share of true positives) " + ", ".join(
                    f"{n} {flips[n]['heading_flipped']:.3f} / "
                    + ("-" if flips[n]["velocity_reversed"] is None else f"{flips[n]['velocity_reversed']:.3f}")
                    for n in det["vehicles"]["classes"] if n in flips))
                errors = {n: flips[n].get("velocity_error") or {} for n in det["vehicles"]["classes"] if n in flips}
                lines.append("  velocity error facing right / the wrong way (m/s) " + ", ".join(
                    f"{n} " + " / ".join("-" if e.get(k) is None else f"{e[k]:.2f}"
                                         for k in ("heading_right", "heading_flipped"))
                    for n, e in errors.items()))
    for name, recipe in summary["recipes"].items():
        final = "  ".join(f"{m} {v[0]:.4f} +- {v[1]:.4f}" for m, v in recipe["final"].items() if v)
        lines.append(f"recipe {name} ({recipe['finished_seeds']} seeds finished): {final}")
        if recipe["AP"]:
            lines.append("  AP " + ", ".join(f"{c} {v[0]:.3f}" for c, v in recipe["AP"].items() if v))
        if recipe["iou"]:
            lines.append("  IoU " + ", ".join(f"{c} {100 * v[0]:.2f} +- {100 * v[1]:.2f}"
                                             for c, v in recipe["iou"].items() if v))
        for variant, final in (recipe.get("decode") or {}).items():
            lines.append(f"  decode {variant}: " + "  ".join(f"{m} {v[0]:.4f} +- {v[1]:.4f}"
                                                           for m, v in final.items() if v))
        if recipe.get("vehicle_tp_errors"):
            lines.append("  TP errors (vehicles) " + ", ".join(
                f"{k} {v[0]:.3f} +- {v[1]:.3f}" for k, v in recipe["vehicle_tp_errors"].items() if v))
    for name, run in summary["runs"].items():
        seed = name.rsplit("_s", 1)[-1]
        alone = summary["runs"].get(f"segmentation_alone_s{seed}", {}).get("curve") or []
        common = {p["step"]: p for p in alone} if not name.startswith("segmentation_alone") else {}
        both = [p for p in run["curve"] if p["step"] in common and p.get("iou")]
        if both:
            p, q = both[-1], common[both[-1]["step"]]
            lines.append(f"segmentation {name} minus alone at step {p['step']}: vehicle IoU "
                         f"{100 * (p['iou']['vehicle'] - q['iou']['vehicle']):+.2f}, mean IoU "
                         f"{100 * (p['mean_iou'] - q['mean_iou']):+.2f} points")
    return "\n".join(lines)


if __name__ == "__main__":
    run_all(parse_args())
