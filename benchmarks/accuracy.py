"""Accuracy benchmark: named recipes trained for K steps with several seeds on one fixed synthetic
set, as parallel `lss train` subprocesses on one GPU; validation IoU per class at threshold 0.5 and
at the best threshold of the eval sweep, mean +- std over seeds, and the validation IoU curve.
Writes accuracy.json, accuracy.md, accuracy.png.

A recipe is NAME=CONFIG[,section.key=value...] (or a name of DEFAULT_RECIPES). Every run also gets
the benchmark set, steps, seed, eval_every and data.workers as overrides, so recipes differ only in
what they set themselves. The recipe `original` (CONFIG `original`) trains the original LSS code
from a checkout of nv-tlabs/lift-splat-shoot (AccuracyOptions.original_lss) through
benchmarks/original_lss.py, with the same set, steps, seeds, validation period and workers; its
overrides are settings of the original train() by keyword name (e.g.
`original_6cams=original,ncams=6`), and train.max_steps=N sets its steps as for lss recipes. Its IoU
is lss's evaluation of its predictions (one ground truth for every row), with its own evaluation
beside it. As suite `accuracy` of `lss bench`, options come from LSS_ACC_* environment variables
(see options_from_env); scripts/accuracy.py is the command-line entry. See docs/benchmarks.md and
docs/accuracy.md.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from benchmarks._runs import (
    SyntheticSet,
    child_env,
    ensure_synthetic_set,
    lss_command,
    log_tail,
    read_jsonl,
    tail,
)

# about a fifth of the scenes go to val: 40 scenes give 32 train (1280 samples) and 8 val (320)
BENCHMARK_SET = SyntheticSet(
    "v1.0-trainval", scenes=40, samples_per_scene=40, image_size=(1600, 900), seed=11
)
QUICK_SET = SyntheticSet("v1.0-mini", scenes=2, samples_per_scene=3, image_size=(400, 225), seed=0)
# screening set: the 10 v1.0-mini scenes at 1600x900 of configs/synthetic_segmentation.yaml (8 train, 2 val)
SCREEN_SET = SyntheticSet(
    "v1.0-mini", scenes=10, samples_per_scene=40, image_size=(1600, 900), seed=0
)
# the confirmation set: the benchmark set's size with another seed (other scenes, traffic and calibration draws), on
# which no recipe was chosen: recipes are chosen on one 40-scene set and confirmed on the other
CONFIRM_SET = dataclasses.replace(BENCHMARK_SET, seed=23)
NAMED_SETS = {"benchmark": BENCHMARK_SET, "confirm": CONFIRM_SET, "screen": SCREEN_SET}
# the CONFIG of recipes that run the original LSS code (benchmarks/original_lss.py)
ORIGINAL = "original"
# the default recipe before 2026-11-27: 1 m depth bins, the pedestrian's class weight 1; with the
# full-resolution skip and its pos_weight 6 (SKIP_PW6), and before that without either (NOSKIP); every
# recipe measured before 2026-11-28 ran without the soft-IoU term (BEFORE_SOFT_IOU)
BEFORE_SOFT_IOU = ("loss.soft_iou_weights=null",)
BEFORE_D05 = BEFORE_SOFT_IOU + ("grid.dbound=[4.0,45.0,1.0]", "loss.class_weights=[2.0,1.0,0.5,0.5]")
SKIP_PW6 = BEFORE_D05 + ("loss.class_pos_weights=[4.0,6.0,1.5,2.6]",)
NOSKIP = BEFORE_D05 + ("model.bev_full_res_skip=false", "loss.class_pos_weights=[4.0,10.0,1.5,2.6]")
# the paper's 128x352 images: the same crop of the 1600x900 images as configs/lss_paper.yaml
AT_128 = ("data.final_dim=[128,352]", "data.resize_lim=[0.193,0.225]")
DEFAULT_RECIPES = {  # name -> (config, overrides)
    "paper": ("configs/lss_paper.yaml", ()),
    "default": ("configs/synthetic_segmentation.yaml", ()),
    # the same recipes at twice the benchmark's steps (a recipe's max_steps wins over --steps)
    "paper_4k": ("configs/lss_paper.yaml", ("train.max_steps=4000",)),
    "default_4k": ("configs/synthetic_segmentation.yaml", ("train.max_steps=4000",)),
    # the default recipe before its soft-IoU term (until 2026-11-28: the per-pixel BCE alone)
    "no_soft_iou": ("configs/synthetic_segmentation.yaml", BEFORE_SOFT_IOU),
    "no_soft_iou_4k": ("configs/synthetic_segmentation.yaml", BEFORE_SOFT_IOU + ("train.max_steps=4000",)),
    # the default recipe trained on vehicles alone: what the other classes cost (or give) the
    # vehicle class (a single class's loss weight cancels: the loss is divided by the weights' sum)
    "default_vehicle": (
        "configs/synthetic_segmentation.yaml",
        BEFORE_SOFT_IOU
        + ("data.classes=[vehicle]", "loss.class_pos_weights=[4.0]", "loss.class_weights=null"),
    ),
    # the default recipe with equal class weights: better map classes, a weaker vehicle class
    "balanced": ("configs/synthetic_segmentation.yaml", BEFORE_SOFT_IOU + ("loss.class_weights=null",)),
    # the default recipe as it was until 2026-11-26: the paper's 128x352 images, centred frustum
    # pixels, no full-resolution skip, pedestrian pos_weight 10, 1 m depth bins
    "default_128": ("configs/synthetic_segmentation.yaml", AT_128 + ("model.frustum_pixels=centres",) + NOSKIP),
    # the default recipe as it is, at the paper's 128x352 images (the same crop of the 1600x900
    # images): beside the original code, what comes from the recipe and what from the image size
    "default_at_128": ("configs/synthetic_segmentation.yaml", AT_128),
    "no_soft_iou_at_128": ("configs/synthetic_segmentation.yaml", BEFORE_SOFT_IOU + AT_128),
    # the default recipe before its soft-IoU term with the pedestrian's class weight 4 instead of 3
    # (docs/accuracy.md, "Pedestrians")
    "ped_cw4": (
        "configs/synthetic_segmentation.yaml",
        BEFORE_SOFT_IOU + ("loss.class_weights=[2.0,4.0,0.5,0.5]",),
    ),
    # the default recipe on PyTorch's batch norm and depthwise convolution kernels instead of lss's
    # (model.batch_norm / depthwise_conv: torch): the same model and recipe (docs/benchmarks.md)
    "default_torch_kernels": (
        "configs/synthetic_segmentation.yaml",
        ("model.batch_norm=torch", "model.depthwise_conv=torch"),
    ),
    # the default recipe before the full-resolution skip (pedestrian pos_weight 10, no skip)
    "default_noskip": ("configs/synthetic_segmentation.yaml", NOSKIP),
    "default_noskip_4k": ("configs/synthetic_segmentation.yaml", NOSKIP + ("train.max_steps=4000",)),
    # the default recipe before its 0.5 m depth bins and pedestrian class weight 3: a stronger
    # vehicle at 4,000 steps, a weaker pedestrian (docs/accuracy.md, "Pedestrians")
    "skip_pw6": ("configs/synthetic_segmentation.yaml", SKIP_PW6),
    "skip_pw6_4k": ("configs/synthetic_segmentation.yaml", SKIP_PW6 + ("train.max_steps=4000",)),
    # the original LSS code (its loader, model, loss, Adam, fp32) from --original-lss
    "original": (ORIGINAL, ()),
    "original_4k": (ORIGINAL, ("train.max_steps=4000",)),
}
# the paper recipe with one of lss's conventions set the original code's way (docs/accuracy.md,
# "configs/lss_paper.yaml against the original LSS code"); orig_all sets all of them but imagenet
ABLATIONS = {
    "pil": ("data.image_resize=pil",),
    "post_orig": ("data.post_matrices=original",),
    "imagenet": ("model.pretrained=imagenet",),
    "linspace": ("model.frustum_pixels=linspace",),
    "trunc": ("model.splat_binning=trunc",),
    "zero_init": ("model.bev_zero_init_residual=true",),
    "gt_orig": ("data.target_raster=original",),
    "fp32_eager": ("train.amp=none", "train.channels_last=false", "train.cuda_graph=false"),
}
ABLATIONS["orig_all"] = tuple(o for k, v in ABLATIONS.items() if k != "imagenet" for o in v)
# the original's switches but its ground-truth raster and its fp32 eager steps: scored against lss's
# ground truth at lss's speed settings
ABLATIONS["paper_orig"] = tuple(
    o for k in ("pil", "post_orig", "linspace", "trunc", "zero_init") for o in ABLATIONS[k]
)
DEFAULT_RECIPES.update({k: ("configs/lss_paper.yaml", v) for k, v in ABLATIONS.items()})
# CPU smoke runs (CI): the tiny grid and images of tests/test_recorded_run.py, no compile or graph
QUICK_OVERRIDES = (
    "data.final_dim=[32, 96]",
    "data.resize_lim=[0.24, 0.26]",
    "grid.xbound=[-16.0, 16.0, 1.0]",
    "grid.ybound=[-16.0, 16.0, 1.0]",
    "grid.dbound=[4.0, 20.0, 2.0]",
    "model.context_channels=8",
    "train.batch_size=2",
    "eval.batch_size=2",
    "train.device=cpu",
    "train.compile=false",
    "train.cuda_graph=false",
)
# the same tiny sizes for the original code (settings of its train() by keyword name), on the CPU
QUICK_ORIGINAL = (
    "final_dim=[32, 96]",
    "resize_lim=[0.24, 0.26]",
    "xbound=[-16.0, 16.0, 1.0]",
    "ybound=[-16.0, 16.0, 1.0]",
    "dbound=[4.0, 20.0, 2.0]",
    "bsz=2",
)


@dataclass
class Recipe:
    name: str
    config: str
    overrides: tuple[str, ...] = ()

    @property
    def is_original(self) -> bool:
        return self.config == ORIGINAL


@dataclass
class AccuracyOptions:
    recipes: list[Recipe] = field(
        default_factory=lambda: [parse_recipe("paper"), parse_recipe("default")]
    )
    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int = 2000
    eval_every: int = 500
    parallel: int = 6  # training processes at once (~2 GB of GPU memory each)
    gpus: int = 1  # GPUs the processes are spread over (CUDA_VISIBLE_DEVICES per process)
    workers: int = (
        2  # data.workers per process: parallel * (workers + 1) should stay near the CPU count
    )
    data_dir: str = "data/benchmark_accuracy"
    out_dir: str = "runs/bench_accuracy"
    quick: bool = False
    run_timeout: Optional[float] = (
        None  # seconds per training run; a run past it is killed and reported failed
    )
    dataset: SyntheticSet = BENCHMARK_SET
    # a checkout of nv-tlabs/lift-splat-shoot: runs the `original` recipes
    original_lss: Optional[str] = None
    # (class, IoU): report each recipe's training time to that validation IoU (time_to_accuracy)
    time_to: Optional[tuple[str, float]] = None


def split_overrides(text: str) -> list[str]:
    """Split "a=1,b=[2, 3],c=x" at the commas outside brackets."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += (ch in "[{(") - (ch in "]})")
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def parse_recipe(text: str) -> Recipe:
    """NAME=CONFIG[,section.key=value...], or NAME alone for a recipe of DEFAULT_RECIPES."""
    if "=" not in text:
        if text not in DEFAULT_RECIPES:
            raise ValueError(
                f"recipe {text!r}: not one of the named recipes {sorted(DEFAULT_RECIPES)}; give "
                "NAME=CONFIG[,section.key=value...], e.g. "
                "paper_lr=configs/lss_paper.yaml,optim.lr=0.002"
            )
        config, overrides = DEFAULT_RECIPES[text]
        return Recipe(text, config, tuple(overrides))
    name, rest = text.split("=", 1)
    parts = split_overrides(rest)
    if not name or not parts or "=" in parts[0]:
        raise ValueError(f"recipe {text!r}: expected NAME=CONFIG[,section.key=value...]")
    config = DEFAULT_RECIPES[parts[0]][0] if parts[0] in DEFAULT_RECIPES else parts[0]
    base = tuple(DEFAULT_RECIPES[parts[0]][1]) if parts[0] in DEFAULT_RECIPES else ()
    return Recipe(name.strip(), config, base + tuple(parts[1:]))


def run_overrides(opts: AccuracyOptions, recipe: Recipe, seed: int) -> list[str]:
    """What every run of the benchmark shares, then the recipe's own overrides (a recipe may set its
    own train.max_steps, e.g. the 2K rows). train.compile is off: a speed setting, and parallel runs
    would spend minutes compiling."""
    common = [
        "train.compile=false",
        f"data.dataroot={Path(opts.data_dir).resolve()}",
        f"data.version={opts.dataset.version}",
        "data.train_split=train",
        "data.val_split=val",
        "data.make_synthetic_if_missing=false",
        f"data.workers={opts.workers}",
        f"train.max_steps={opts.steps}",
        f"train.seed={seed}",
        f"train.eval_every={opts.eval_every}",
        f"train.ckpt_every={opts.steps}",
        "train.viz_every=0",
        f"train.log_every={min(20, opts.steps)}",
    ]
    return common + (list(QUICK_OVERRIDES) if opts.quick else []) + list(recipe.overrides)


def original_command(opts: AccuracyOptions, recipe: Recipe, seed: int, run_dir: Path) -> list[str]:
    """benchmarks/original_lss.py for a recipe of the original code: the set, steps, seed,
    validation period and workers of every run; the recipe's overrides as settings of the original
    train() (its train.max_steps, the last one given, as the steps; its data.workers as the
    loader's workers)."""
    if opts.original_lss is None:
        raise ValueError(
            f"recipe {recipe.name!r} runs the original LSS code: pass --original-lss PATH"
        )
    steps, workers, settings = opts.steps, opts.workers, []
    for item in recipe.overrides:
        if item.startswith("train.max_steps="):
            steps = int(item.split("=", 1)[1])
        elif item.startswith("data.workers="):  # its PIL loader needs more workers than lss's
            workers = int(item.split("=", 1)[1])
        else:
            settings.append(item)
    cmd = [sys.executable, "-m", "benchmarks.original_lss", "--checkout", str(opts.original_lss)]
    cmd += ["--dataroot", str(Path(opts.data_dir).resolve()), "--version", opts.dataset.version]
    cmd += ["--out", str(run_dir), "--steps", str(steps), "--seed", str(seed)]
    cmd += ["--eval-every", str(opts.eval_every), "--workers", str(workers)]
    cmd += ["--log-every", str(min(20, steps))] + (["--device", "cpu"] if opts.quick else [])
    for item in (list(QUICK_ORIGINAL) if opts.quick else []) + settings:
        cmd += ["--set", item]
    return cmd


def run_command(opts: AccuracyOptions, recipe: Recipe, seed: int, run_dir: Path) -> list[str]:
    if recipe.is_original:
        return original_command(opts, recipe, seed, run_dir)
    # --overwrite: a benchmark run replaces an earlier run of the same name
    overrides = run_overrides(opts, recipe, seed)
    return lss_command("train", recipe.config, overrides, "--out", str(run_dir), "--overwrite")


def least_loaded_gpu(running_gpus: Sequence[int], gpus: int) -> int:
    """The GPU (0 .. gpus - 1) with the fewest running processes, the lowest index on a tie."""
    if gpus < 1:
        raise ValueError(f"gpus must be at least 1, got {gpus}")
    return min(range(gpus), key=lambda g: (sum(1 for r in running_gpus if r == g), g))


def gpu_devices(gpus: int, environ: dict) -> list[str]:
    """The CUDA device of each of `gpus` GPUs as a child's CUDA_VISIBLE_DEVICES value: the
    caller's own CUDA_VISIBLE_DEVICES entries where it set them (a run limited to GPUs 2,3 stays
    on them), else 0 .. gpus - 1."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(g) for g in range(gpus)]
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    if gpus > len(devices):
        raise ValueError(
            f"--gpus {gpus}, but CUDA_VISIBLE_DEVICES={visible!r} names {len(devices)}: "
            "give at most that many, or widen CUDA_VISIBLE_DEVICES"
        )
    return devices[:gpus]


def train_runs(opts: AccuracyOptions) -> list[dict]:
    """Every (recipe, seed) as an `lss train` subprocess (benchmarks/original_lss.py for the
    original code), `opts.parallel` at a time, each on the least loaded of `opts.gpus` GPUs
    (CUDA_VISIBLE_DEVICES, when gpus > 1); one record per run."""
    jobs = [(r, s) for r in opts.recipes for s in opts.seeds]
    devices = gpu_devices(opts.gpus, os.environ) if opts.gpus > 1 else []
    threads = max(1, (os.cpu_count() or 1) // max(1, min(opts.parallel, len(jobs))))
    pending, running, done = list(jobs), [], []
    while pending or running:
        while pending and len(running) < opts.parallel:
            recipe, seed = pending.pop(0)
            run_dir = Path(opts.out_dir) / "runs" / recipe.name / f"seed{seed}"
            run_dir.mkdir(parents=True, exist_ok=True)
            cmd = run_command(opts, recipe, seed, run_dir)
            log = (run_dir / "train.log").open("w")
            env = child_env(threads)
            gpu = least_loaded_gpu([entry[-1] for entry in running], opts.gpus)
            if devices:
                env["CUDA_VISIBLE_DEVICES"] = devices[gpu]
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            running.append((proc, log, recipe, seed, run_dir, time.perf_counter(), gpu))
        time.sleep(0.2)
        for entry in list(running):
            proc, log, recipe, seed, run_dir, start, _ = entry
            late = opts.run_timeout is not None and time.perf_counter() - start > opts.run_timeout
            if proc.poll() is None and not late:
                continue
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
            running.remove(entry)
            record = collect_run(
                run_dir, recipe, seed, proc.returncode, time.perf_counter() - start, late
            )
            done.append(record)
            print(
                f"accuracy: {recipe.name} seed {seed}: {record['status']} in "
                f"{record['seconds']:.0f} s",
                flush=True,
            )
    return done


def collect_run(
    run_dir: Path,
    recipe: Recipe,
    seed: int,
    returncode: int,
    seconds: float,
    timed_out: bool = False,
) -> dict:
    """The run's final validation result (final.json "val": IoU at eval.threshold and over
    eval.sweep, as in eval.json) and its validation curve (metrics.jsonl "val" records); failed runs
    keep their log tail. A run of the original code also has "own_iou" (its own evaluation) and
    "cellwise_iou" (lss's evaluation without the half-cell grid alignment;
    benchmarks/original_lss.py)."""
    record = {
        "recipe": recipe.name,
        "config": recipe.config,
        "overrides": list(recipe.overrides),
        "seed": seed,
        "run_dir": str(run_dir),
        "seconds": seconds,
        "returncode": returncode,
    }
    final_path = Path(run_dir) / "final.json"
    val = json.loads(final_path.read_text()).get("val") if final_path.is_file() else None
    if returncode != 0 or not val or "sweep" not in val:
        why = (
            "timed out"
            if timed_out
            else f"exit code {returncode}"
            if returncode
            else "no validation result"
        )
        record.update(
            status="failed", reason=why, log_tail=log_tail(Path(run_dir) / "train.log", 40)
        )
        return record
    record.update(
        status="ok",
        threshold=val["threshold"],
        iou=val["iou"],
        sweep=val["sweep"],
        best=best_thresholds(val["sweep"]),
    )
    if "own" in val:
        record.update(own_iou=val["own"]["iou"], cellwise_iou=val["cellwise"]["iou"])
    records = read_jsonl(Path(run_dir) / "metrics.jsonl")
    seconds_at = training_seconds(records)
    record["curve"] = [
        {"step": r["step"], "iou": r["iou"], "seconds": seconds_at.get(r["step"])}
        for r in records
        if r.get("kind") == "val"
    ]
    record["steps"] = max((r["step"] for r in records if r.get("kind") == "train"), default=0)
    return record


def training_seconds(records: Sequence[dict]) -> dict:
    """val step -> seconds of training up to that validation, the validations before it left out:
    the "elapsed" clock of the run's "train" records (lss: from train(); the original's runner:
    from its first step), linearly interpolated between the records around the step, minus the
    seconds of every earlier validation (lss: "timing"."seconds"; the original's: "seconds").
    Empty when the run's train records carry no clock."""
    clock = sorted(
        (r["step"], r["elapsed"]) for r in records if r.get("kind") == "train" and "elapsed" in r
    )
    if not clock:
        return {}
    vals = sorted(
        (r["step"], (r.get("timing") or {}).get("seconds", r.get("seconds")) or 0.0)
        for r in records
        if r.get("kind") == "val"
    )
    steps = [c[0] for c in clock]
    out, spent = {}, 0.0
    for step, eval_seconds in vals:
        i = bisect.bisect_left(steps, step)
        if i < len(clock) and steps[i] == step:
            elapsed = clock[i][1]
        elif i == 0:  # before the first record: its pace from the start
            elapsed = clock[0][1] * step / clock[0][0]
        elif i == len(clock):  # after the last record: its pace from the one before
            (s0, e0), (s1, e1) = clock[max(0, i - 2)], clock[i - 1]
            rate = (e1 - e0) / (s1 - s0) if s1 > s0 else e1 / s1
            elapsed = e1 + rate * (step - s1)
        else:
            (s0, e0), (s1, e1) = clock[i - 1], clock[i]
            elapsed = e0 + (e1 - e0) * (step - s0) / (s1 - s0)
        out[step] = elapsed - spent
        spent += eval_seconds
    return out


def parse_time_to(text: str) -> tuple[str, float]:
    """--time-to CLASS=IOU ("vehicle=0.30", IoU as a fraction) -> (class, IoU); else ValueError."""
    name, sep, value = text.partition("=")
    try:
        target = float(value)
    except ValueError:
        target = None
    if not sep or not name.strip() or target is None or not 0.0 < target < 1.0:
        raise ValueError(
            f"--time-to {text!r}: expected CLASS=IOU with the IoU as a fraction, e.g. vehicle=0.30"
        )
    return name.strip(), target


def time_to_accuracy(runs: list[dict], cls: str, target: float, steps: int) -> dict:
    """recipe -> the training seconds (validations left out) to the first validation with IoU of
    `cls` >= `target`: {"reached": runs that got there, "runs", "seconds" and "step" [mean, std]
    over those}, and "best_by": {N: {"iou", "seconds"} [mean, std]} for N = steps / 2 and steps:
    each run's best validation IoU up to step N and when it was reached."""
    out = {}
    for recipe in dict.fromkeys(r["recipe"] for r in runs):
        ok = [
            r
            for r in runs
            if r["recipe"] == recipe
            and r["status"] == "ok"
            and r.get("curve")
            and all(p.get("seconds") is not None for p in r["curve"])
        ]
        if not ok or any(cls not in p["iou"] for r in ok for p in r["curve"]):
            continue
        hits = [next((p for p in r["curve"] if p["iou"][cls] >= target), None) for r in ok]
        hits = [h for h in hits if h is not None]
        row = {"reached": len(hits), "runs": len(ok)}
        if hits:
            row["seconds"] = list(mean_std([h["seconds"] for h in hits]))
            row["step"] = list(mean_std([h["step"] for h in hits]))
        row["best_by"] = {}
        for by in dict.fromkeys((steps // 2, steps)):
            best = [
                max(
                    (p for p in r["curve"] if p["step"] <= by),
                    key=lambda p: p["iou"][cls],
                    default=None,
                )
                for r in ok
            ]
            best = [b for b in best if b is not None]
            if best:
                row["best_by"][by] = {
                    "iou": list(mean_std([b["iou"][cls] for b in best])),
                    "seconds": list(mean_std([b["seconds"] for b in best])),
                }
        out[recipe] = row
    return out


def best_thresholds(sweep: dict) -> dict:
    """Per class: the threshold of the sweep with the highest IoU and that IoU -> {class:
    {"threshold", "iou"}}."""
    classes = list(next(iter(sweep.values())))
    out = {}
    for c in classes:
        t, iou = max(
            ((float(t), v[c]) for t, v in sweep.items()), key=lambda p: (p[1], -abs(p[0] - 0.5))
        )
        out[c] = {"threshold": t, "iou": iou}
    return out


def mean_std(values: Sequence[float]) -> tuple[float, Optional[float]]:
    """Mean and sample standard deviation (n - 1 in the denominator; None for a single value)."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_std of no values")
    mean = sum(values) / n
    if n == 1:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def summarize(runs: list[dict]) -> dict:
    """recipe -> class -> {"iou_0.5", "iou_best", "iou_own": [mean, std], "best_threshold": mean,
    "seeds": [...]} over the successful runs, and recipe -> class -> curve {"steps", "mean", "std"}
    over the steps every seed evaluated. "iou_own" is the IoU at 0.5 by the evaluation of the code
    that trained the run (lss's for lss runs); runs of the original code also give "iou_cellwise"
    (lss's evaluation, grids not aligned)."""
    table, curves = {}, {}
    for recipe in dict.fromkeys(r["recipe"] for r in runs):
        ok = [r for r in runs if r["recipe"] == recipe and r["status"] == "ok"]
        if not ok:
            continue
        table[recipe], curves[recipe] = {}, {}
        for c in ok[0]["iou"]:
            table[recipe][c] = {
                "iou_0.5": list(mean_std([r["iou"][c] for r in ok])),
                "iou_best": list(mean_std([r["best"][c]["iou"] for r in ok])),
                "iou_own": list(mean_std([r.get("own_iou", r["iou"])[c] for r in ok])),
                "best_threshold": mean_std([r["best"][c]["threshold"] for r in ok])[0],
                "seeds": [r["seed"] for r in ok],
                "steps": max(r.get("steps", 0) for r in ok),
            }
            if all(c in r.get("cellwise_iou", {}) for r in ok):
                table[recipe][c]["iou_cellwise"] = list(
                    mean_std([r["cellwise_iou"][c] for r in ok])
                )
            steps = sorted(set.intersection(*[{p["step"] for p in r["curve"]} for r in ok]))
            points = [
                [next(p["iou"][c] for p in r["curve"] if p["step"] == s) for r in ok] for s in steps
            ]
            stats = [mean_std(p) for p in points]
            curves[recipe][c] = {
                "steps": steps,
                "mean": [m for m, _ in stats],
                "std": [s or 0.0 for _, s in stats],
            }
    return {"table": table, "curves": curves}


def _pm(stat: list) -> str:
    mean, std = stat
    return (
        f"{100 * mean:.2f} ± {100 * std:.2f}" if std is not None else f"{100 * mean:.2f} (1 seed)"
    )


def to_markdown(result: dict) -> str:
    s, meta = result["settings"], result["meta"]
    lines = [
        f"Accuracy benchmark: {s['steps']} steps unless a recipe sets its own, seeds {s['seeds']}, "
        f"set {s['dataset']}; device {meta.get('device', '?')}, torch {meta.get('torch', '?')}, "
        f"date {meta.get('date', '?')}. Validation IoU (%), mean ± std over seeds, by lss's "
        "evaluation; \"own evaluation\": by the evaluation of the code that trained the recipe.",
        "",
        "| recipe | steps | class | IoU @0.5 | IoU @0.5, own evaluation | IoU @best threshold "
        "| mean best threshold | seeds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for recipe, classes in result["summary"]["table"].items():
        for c, row in classes.items():
            own = row.get("iou_own", row["iou_0.5"])
            lines.append(
                f"| {recipe} | {row.get('steps', s['steps'])} | {c} | {_pm(row['iou_0.5'])} | "
                f"{_pm(own)} | {_pm(row['iou_best'])} | {row['best_threshold']:.2f} | "
                f"{len(row['seeds'])} |"
            )
            if "iou_cellwise" in row:
                notes.append(
                    f"{recipe} {c}: lss's evaluation without the half-cell grid alignment "
                    f"{_pm(row['iou_cellwise'])} at 0.5"
                )
    lines += [""] + notes if notes else []
    if "time_to" in result:
        lines += [""] + time_to_markdown(result["time_to"])
    for r in [r for r in result["runs"] if r["status"] == "skipped"]:
        lines += ["", f"SKIPPED: {r['recipe']} seed {r['seed']}: {r['reason']}"]
    failed = [r for r in result["runs"] if r["status"] == "failed"]
    for r in failed:
        lines += [
            "",
            f"FAILED: {r['recipe']} seed {r['seed']} ({r['reason']}), log tail:",
            "```",
            r.get("log_tail", ""),
            "```",
        ]
    return "\n".join(lines) + "\n"


def _seconds(stat: list) -> str:
    mean, std = stat
    return f"{mean:.0f} ± {std:.0f} s" if std is not None else f"{mean:.0f} s"


def time_to_markdown(time_to: dict) -> list[str]:
    """The lines of the time-to-accuracy table (benchmark()'s "time_to")."""
    cls, target = time_to["class"], time_to["target"]
    bys = sorted({int(b) for row in time_to["recipes"].values() for b in row["best_by"]})
    lines = [
        f"Training time (validations left out, mean ± std over the runs) to {cls} IoU >= "
        f"{100 * target:.1f}, and the best {cls} IoU up to step N with when it was reached:",
        "",
        f"| recipe | runs that reached it | seconds | at step | "
        + " | ".join(f"best by {b}: IoU, seconds" for b in bys)
        + " |",
        "|---|---|---|---|" + "---|" * len(bys),
    ]
    for recipe, row in time_to["recipes"].items():
        cells = [
            f"{row['reached']} of {row['runs']}",
            _seconds(row["seconds"]) if row["reached"] else "not reached",
            f"{row['step'][0]:.0f}" if row["reached"] else "",
        ]
        for b in bys:
            best = row["best_by"].get(b) or row["best_by"].get(str(b))
            cells.append(f"{_pm(best['iou'])}, {_seconds(best['seconds'])}" if best else "")
        lines.append(f"| {recipe} | " + " | ".join(cells) + " |")
    return lines


def plot_curves(summary: dict, path: Path) -> None:
    """Mean validation IoU against steps per recipe with a +-1 std band, one subplot per class."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classes = list(dict.fromkeys(c for per in summary["curves"].values() for c in per))
    fig, axes = plt.subplots(
        1, max(1, len(classes)), figsize=(5 * max(1, len(classes)), 4), squeeze=False
    )
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {
        recipe: palette[i % len(palette)] for i, recipe in enumerate(summary["curves"])
    }  # one per recipe
    for ax, c in zip(axes[0], classes):
        for recipe, per in summary["curves"].items():
            if c not in per or not per[c]["steps"]:
                continue
            steps, mean, std = per[c]["steps"], per[c]["mean"], per[c]["std"]
            ax.plot(steps, [100 * m for m in mean], marker="o", label=recipe, color=color[recipe])
            ax.fill_between(
                steps,
                [100 * (m - d) for m, d in zip(mean, std)],
                [100 * (m + d) for m, d in zip(mean, std)],
                alpha=0.25,
                color=color[recipe],
            )
        ax.set_title(f"{c}: validation IoU @0.5")
        ax.set_xlabel("step")
        ax.set_ylabel("IoU (%)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


NO_CHECKOUT = (
    "runs the original LSS code, and no checkout of it was given: pass --original-lss PATH (a "
    "clone of https://github.com/nv-tlabs/lift-splat-shoot; LSS_ACC_ORIGINAL under `lss bench`)"
)


def without_unrunnable(opts: AccuracyOptions) -> tuple[AccuracyOptions, list[dict]]:
    """`opts` without the original code's recipes when no checkout is given (one "skipped" record
    per seed of each, with the reason, also printed); with a checkout, its path checked and made
    absolute."""
    if opts.original_lss is not None:
        from benchmarks.original_lss import check_checkout

        return dataclasses.replace(opts, original_lss=str(check_checkout(opts.original_lss))), []
    skipped = []
    for recipe in [r for r in opts.recipes if r.is_original]:
        print(f"accuracy: recipe {recipe.name} skipped: it {NO_CHECKOUT}", flush=True)
        skipped += [
            {
                "recipe": recipe.name,
                "config": recipe.config,
                "overrides": list(recipe.overrides),
                "seed": seed,
                "status": "skipped",
                "reason": f"it {NO_CHECKOUT}",
            }
            for seed in opts.seeds
        ]
    runnable = [r for r in opts.recipes if not r.is_original]
    return dataclasses.replace(opts, recipes=runnable), skipped


def benchmark(opts: AccuracyOptions, meta: Optional[dict] = None) -> dict:
    """Generate (or reuse) the set, train the runs, write accuracy.{json,md,png} to opts.out_dir."""
    out = Path(opts.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = [r.name for r in opts.recipes]
    if len(set(names)) != len(names):
        raise ValueError(f"recipe names must be distinct, got {names}")
    runnable, skipped = without_unrunnable(opts)
    gen_seconds = ensure_synthetic_set(Path(opts.data_dir), opts.dataset)
    order = {name: i for i, name in enumerate(names)}
    runs = sorted(
        train_runs(runnable) + skipped, key=lambda r: (order[r["recipe"]], r["seed"])
    )  # not the order runs finished in
    result = {
        "meta": meta or {},
        "summary": summarize(runs),
        "runs": runs,
        "settings": {
            "recipes": {
                r.name: {"config": r.config, "overrides": list(r.overrides)} for r in opts.recipes
            },
            "seeds": list(opts.seeds),
            "steps": opts.steps,
            "eval_every": opts.eval_every,
            "parallel": opts.parallel,
            "gpus": opts.gpus,
            "workers": opts.workers,
            "quick": opts.quick,
            "dataset": opts.dataset.describe(),
            "generation_seconds": gen_seconds,
            "original_lss": opts.original_lss,
        },
    }
    if opts.time_to is not None:
        cls, target = opts.time_to
        result["time_to"] = {
            "class": cls,
            "target": target,
            "recipes": time_to_accuracy(runs, cls, target, opts.steps),
        }
    (out / "accuracy.json").write_text(json.dumps(result, indent=1))
    md = to_markdown(result)
    (out / "accuracy.md").write_text(md)
    plot_curves(result["summary"], out / "accuracy.png")
    print(md)
    return result


def quick_options(out_dir: str, data_dir: Optional[str] = None) -> AccuracyOptions:
    return AccuracyOptions(
        seeds=(0, 1),
        steps=2,
        eval_every=2,
        parallel=4,
        workers=0,
        out_dir=out_dir,
        data_dir=data_dir or str(Path(out_dir) / "data"),
        quick=True,
        dataset=QUICK_SET,
    )


def build_parser():
    """scripts/accuracy.py's arguments (options_from_args turns them into AccuracyOptions)."""
    import argparse

    p = argparse.ArgumentParser(
        prog="scripts/accuracy.py",
        description="Accuracy benchmark: recipes x seeds trained on one synthetic set.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--recipe",
        action="append",
        default=None,
        metavar="NAME[=CONFIG[,key=value...]]",
        help=f"repeatable; named recipes: {', '.join(DEFAULT_RECIPES)} (default: paper, default)",
    )
    p.add_argument("--seeds", default=None, help="comma-separated (default 0,1,2; quick 0,1)")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 2000)")
    p.add_argument(
        "--eval-every", type=int, default=None, help="validation every N steps (default 500)"
    )
    p.add_argument(
        "--parallel", type=int, default=None, help="training processes at once (default 6)"
    )
    p.add_argument("--workers", type=int, default=None, help="data workers per process (default 2)")
    p.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="spread the processes over this many GPUs, each new one on the least loaded "
        "(default 1; with CUDA_VISIBLE_DEVICES set, over its first N)",
    )
    p.add_argument(
        "--set",
        dest="set_name",
        choices=sorted(NAMED_SETS),
        default="benchmark",
        help="benchmark: 40 v1.0-trainval scenes of seed 11 (the docs' tables); confirm: the same "
        "size of seed 23 (recipes chosen on one set are confirmed on the other); screen: 10 "
        "v1.0-mini scenes",
    )
    p.add_argument(
        "--data-dir", default=None, help="the set, generated once (default data/<set>_accuracy)"
    )
    p.add_argument("--out-dir", default="runs/bench_accuracy")
    p.add_argument(
        "--run-timeout", type=float, default=None, help="seconds per run before it is killed"
    )
    p.add_argument(
        "--scenes", type=int, default=None, help="scenes of the generated set (default: the set's)"
    )
    p.add_argument("--samples-per-scene", type=int, default=None, help="default: the set's")
    p.add_argument(
        "--original-lss",
        default=None,
        metavar="PATH",
        help="a checkout of nv-tlabs/lift-splat-shoot: runs the original code's recipes (original, "
        "original_4k, NAME=original[,setting=value...]); without it they are skipped",
    )
    p.add_argument(
        "--time-to",
        default=None,
        metavar="CLASS=IOU",
        help="also report each recipe's training time to that validation IoU (a fraction, e.g. "
        "vehicle=0.30) and its best IoU by half the steps and by the last step",
    )
    p.add_argument("--quick", action="store_true", help="tiny set, 2 seeds x 2 steps on CPU")
    return p


def options_from_args(args) -> AccuracyOptions:
    """AccuracyOptions from build_parser()'s arguments; a bad recipe or checkout is a ValueError."""
    if args.quick:
        opts = quick_options(args.out_dir, args.data_dir)
    else:
        opts = AccuracyOptions(out_dir=args.out_dir, dataset=NAMED_SETS[args.set_name])
        opts.data_dir = args.data_dir or f"data/{args.set_name}_accuracy"
    if args.recipe:
        opts.recipes = [parse_recipe(r) for r in args.recipe]
    if args.seeds:
        opts.seeds = tuple(int(s) for s in args.seeds.split(","))
    for name in ("steps", "eval_every", "parallel", "workers", "gpus", "run_timeout"):
        if getattr(args, name) is not None:
            setattr(opts, name, getattr(args, name))
    if opts.gpus < 1:
        raise ValueError(f"--gpus {opts.gpus}: give 1 or more GPUs to spread the runs over")
    gpu_devices(opts.gpus, os.environ)  # fails now, not after the set is generated
    if args.scenes or args.samples_per_scene:
        opts.dataset = dataclasses.replace(
            opts.dataset,
            scenes=args.scenes or opts.dataset.scenes,
            samples_per_scene=args.samples_per_scene or opts.dataset.samples_per_scene,
        )
    if args.time_to is not None:
        opts.time_to = parse_time_to(args.time_to)
    if args.original_lss is not None:
        from benchmarks.original_lss import check_checkout

        opts.original_lss = str(check_checkout(args.original_lss))
    return opts


def options_from_env(quick: bool) -> AccuracyOptions:
    """LSS_ACC_RECIPES (space-separated recipes), LSS_ACC_SEEDS (comma-separated), LSS_ACC_STEPS,
    LSS_ACC_PARALLEL, LSS_ACC_WORKERS, LSS_ACC_GPUS, LSS_ACC_DATA, LSS_ACC_OUT, LSS_ACC_ORIGINAL
    (a checkout of the original LSS code, for the `original` recipes) over the defaults (or
    quick_options)."""
    env = os.environ
    out = env.get("LSS_ACC_OUT") or (
        tempfile.mkdtemp(prefix="lss_accuracy_") if quick else "runs/bench_accuracy"
    )
    opts = quick_options(out, env.get("LSS_ACC_DATA")) if quick else AccuracyOptions(out_dir=out)
    if env.get("LSS_ACC_DATA"):
        opts.data_dir = env["LSS_ACC_DATA"]
    opts.original_lss = env.get("LSS_ACC_ORIGINAL") or None
    if env.get("LSS_ACC_RECIPES"):
        opts.recipes = [parse_recipe(t) for t in env["LSS_ACC_RECIPES"].split()]
    if env.get("LSS_ACC_SEEDS"):
        opts.seeds = tuple(int(s) for s in env["LSS_ACC_SEEDS"].split(","))
    for key, name in (
        ("LSS_ACC_STEPS", "steps"),
        ("LSS_ACC_PARALLEL", "parallel"),
        ("LSS_ACC_WORKERS", "workers"),
        ("LSS_ACC_GPUS", "gpus"),
    ):
        if env.get(key):
            setattr(opts, name, int(env[key]))
    return opts


def run(ctx) -> list[dict]:
    result = benchmark(options_from_env(ctx.quick), ctx.meta)
    rows = []
    for recipe, classes in result["summary"]["table"].items():
        for c, row in classes.items():
            rows.append(
                {
                    "case": f"val IoU {c}",
                    "impl": recipe,
                    "ms": None,
                    "iou_0.5": row["iou_0.5"],
                    "iou_best": row["iou_best"],
                    "best_threshold": row["best_threshold"],
                    "notes": f"IoU@0.5 {_pm(row['iou_0.5'])}, @best {_pm(row['iou_best'])} "
                    f"(t={row['best_threshold']:.2f}), {len(row['seeds'])} seeds",
                }
            )
    for r in result["runs"]:
        if r["status"] != "ok":
            failed = r["status"] == "failed"
            rows.append(
                {
                    "case": f"run seed {r['seed']}",
                    "impl": r["recipe"],
                    "ms": None,
                    "notes": f"FAILED ({r['reason']}): {tail(r['log_tail'], 3)}"
                    if failed
                    else f"SKIPPED: {r['reason']}",
                }
            )
    return rows
