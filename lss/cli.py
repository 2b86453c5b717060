"""The `lss` command line:
train / eval / viz / predict / demo / bench / export / make-synthetic / config / env."""

from __future__ import annotations

import argparse
import os
import sys


def _add_config_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--config", required=required, help="YAML file (see configs/)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable), e.g. --set train.max_steps=100",
    )


def _load(args):
    from lss.config import load_config

    return load_config(args.config, args.overrides)


def _image_size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--image-size {text!r}: expected WIDTHxHEIGHT, e.g. 1600x900"
        ) from None
    if w <= 0 or h <= 0:
        raise argparse.ArgumentTypeError(
            f"--image-size {text!r}: width and height must be positive"
        )
    return w, h


# Options whose value argparse would take for an option when it starts with "-" (--image-size -5x5).
_DASH_VALUE_OPTIONS = ("--image-size",)


def _join_dash_values(argv: list[str]) -> list[str]:
    """`--image-size -5x5` as `--image-size=-5x5`, so that the value reaches its check."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in _DASH_VALUE_OPTIONS and arg[:1] == "-" and arg[1:2].isdigit():
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _sample_count(text: str) -> int:
    try:
        count: int | None = int(text)
    except ValueError:
        count = None
    if count is None or count < 0:
        raise argparse.ArgumentTypeError(f"expected a number of samples >= 0, got {text!r}")
    return count


def cmd_env(args) -> int:
    import importlib.metadata
    import platform
    import shutil
    import subprocess

    import torch

    from lss.ops import _ext

    def version(pkg):
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    nvcc = shutil.which("nvcc")
    nvcc_version = "not found"
    if nvcc:
        out = (
            subprocess.run([nvcc, "--version"], capture_output=True, text=True)
            .stdout.strip()
            .splitlines()
        )
        nvcc_version = out[-1] if out else "unknown"
    rows = [
        ("lss", version("lss")),
        ("python", platform.python_version()),
        ("platform", platform.platform()),
        ("torch", torch.__version__),
        ("torch CUDA", str(torch.version.cuda)),
        ("torchvision", version("torchvision")),
        ("nvcc", nvcc_version),
        ("lss._C", "loaded" if _ext.has_ext() else f"missing ({_ext.load_error()})"),
        ("lss CUDA kernels", f"yes, archs {_ext.cuda_archs()}" if _ext.has_cuda_ops() else "no"),
        (
            "GPU",
            ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
            or "none",
        ),
        ("nuscenes-devkit", version("nuscenes-devkit")),
        ("efficientnet-pytorch", version("efficientnet-pytorch")),
        ("numpy", version("numpy")),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def cmd_config_show(args) -> int:
    from lss.config import dump_config

    print(dump_config(_load(args)), end="")
    return 0


def cmd_make_synthetic(args) -> int:
    from lss.data.synthetic import generate

    generate(
        args.out_dir,
        version=args.version,
        scenes=args.scenes,
        samples_per_scene=args.samples_per_scene,
        image_size=args.image_size,
        seed=args.seed,
        workers=args.workers,
        force=args.force,
    )
    return 0


def cmd_train(args) -> int:
    cfg = _load(args)
    # one index build per machine under torchrun (the other ranks build their own), started before
    # the trainer's imports and the model so that they overlap it
    if os.environ.get("LOCAL_RANK", "0") == "0":
        from lss.data.loader import index_splits_in_background

        index_splits_in_background(cfg)
    from lss.engine.train import train
    from lss.viz import render_batch

    train(
        cfg,
        out_dir=args.out,
        resume=args.resume,
        overwrite=args.overwrite,
        render_fn=render_batch,
    )
    return 0


def cmd_eval(args) -> int:
    from lss.engine.eval import evaluate_checkpoint

    evaluate_checkpoint(_load(args), ckpt=args.ckpt, out_dir=args.out, decode=args.decode)
    return 0


def cmd_viz(args) -> int:
    from lss.viz import render_checkpoint

    render_checkpoint(_load(args), ckpt=args.ckpt, out_dir=args.out, num=args.num)
    return 0


def cmd_demo(args) -> int:
    from lss.engine.demo import demo

    demo(config=args.config, overrides=args.overrides, out_dir=args.out, device=args.device)
    return 0


def cmd_bench(args) -> int:
    from lss.engine import bench

    bench.run(suites=args.suite or None, device=args.device, out_dir=args.out, quick=args.quick)
    return 0


def cmd_export(args) -> int:
    from lss.export import export_checkpoint
    from lss.export.check import check_export, format_check

    cfg = _load(args)
    done = export_checkpoint(
        cfg,
        args.ckpt,
        args.out,
        rig_file=args.rig,
        rig_sample=args.rig_sample,
        rig_inputs=args.rig_inputs,
        splat=args.bev_pool,
        opset=args.opset,
        resize_mode=args.resize_mode,
    )
    rig_note = "rig inputs" if done["rig_path"] is None else f"fixed rig in {done['rig_path']}"
    print(
        f"wrote {done['path']} (opset {args.opset}, bev_pool {args.bev_pool}, {rig_note}, Resize "
        f"mode {done['resize_mode']}; trained with {done['upsample_mode']})"
    )
    if not args.check:
        return 0
    result = check_export(cfg, done["model"], done["path"], done["rig"], args.check_samples)
    print(format_check(result, done["path"]))
    if done["resize_mode"] != done["upsample_mode"]:
        print(
            f"note: the graph resizes in {done['resize_mode']} mode but the model was trained in "
            f"{done['upsample_mode']}: the differences above are what that deployment loses"
        )
    return 0 if result["passed"] else 1


def cmd_predict(args) -> int:
    import dataclasses

    from torch.utils.data import Subset

    from lss.data.camera_inputs import RigImageFolder, scene_samples
    from lss.engine.predictor import Predictor, write_predictions
    from lss.engine.streaming import sequence_step
    from lss.errors import ArgumentError

    if (args.dataroot is None) == (args.images is None) or (args.dataroot and not args.scene):
        raise ArgumentError(
            "give a nuScenes scene (--dataroot DIR --scene NAME) or camera images with their "
            "calibration (--images DIR --calib RIG.json), one of the two"
        )
    if args.images and not args.calib:
        raise ArgumentError(f"--images {args.images} needs --calib RIG.json (docs/predict.md)")
    if args.batch_size == 0:
        raise ArgumentError("--batch-size 0: give at least 1 sample per batch")
    if args.no_pictures and (args.gif or args.mp4):
        raise ArgumentError("--gif and --mp4 animate the pictures: leave out --no-pictures")
    predictor = Predictor(
        args.ckpt,
        args.device,
        config=_load(args) if args.config else None,
        overrides=() if args.config else args.overrides,
        backend=args.backend,
        onnx=args.onnx,
    )
    cfg = predictor.cfg
    if args.dataroot:
        data = dataclasses.replace(cfg.data, dataroot=args.dataroot, decoded_cache=False)
        dataset, scene = scene_samples(dataclasses.replace(cfg, data=data), args.scene), args.scene
    else:
        dataset, scene = (
            RigImageFolder(args.images, args.calib, cfg),
            os.path.basename(os.path.normpath(args.images)),
        )
    if args.num is not None:
        dataset = Subset(dataset, range(min(args.num, len(dataset))))
    predict_fn, batch_size = sequence_step(predictor, args.batch_size)
    render, animate = None, []
    if not args.no_pictures:
        from lss.viz.render import render_sample, write_scene_gifs, write_scene_videos

        def render(item, prediction):
            title = f"{prediction.name[:64]}   checkpoint step {predictor.step}"
            return render_sample(
                item, prediction.probabilities, cfg, title, prediction.detections
            ).image

        animate = [write_scene_gifs] * args.gif + [write_scene_videos] * args.mp4
    done = write_predictions(
        predictor,
        dataset,
        args.out,
        render_fn=render,
        animate_fns=animate,
        scene=scene,
        batch_size=batch_size,
        predict_fn=predict_fn,
    )
    print(
        f"wrote {len(done['written'])} file(s) for {done['samples']} sample(s) to {args.out} "
        f"({done['samples_per_s']:.2f} samples/s on {predictor.device}, {args.backend})"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lss", description="Lift-Splat-Shoot BEV perception trainer"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("env", help="print versions and build facts for a bug report")
    p.set_defaults(func=cmd_env)

    p = sub.add_parser("config", help="configuration tools")
    csub = p.add_subparsers(dest="config_command", required=True)
    ps = csub.add_parser("show", help="print the resolved config (defaults + YAML + --set)")
    _add_config_args(ps, required=False)
    ps.set_defaults(func=cmd_config_show)

    p = sub.add_parser("make-synthetic", help="generate a synthetic dataset in the nuScenes format")
    p.add_argument("out_dir")
    p.add_argument("--version", default="v1.0-mini", help="v1.0-mini or v1.0-trainval")
    p.add_argument("--scenes", type=int, default=10)
    p.add_argument("--samples-per-scene", type=int, default=40)
    p.add_argument(
        "--image-size",
        type=_image_size,
        default=(1600, 900),
        help="WIDTHxHEIGHT (default 1600x900)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--workers", type=int, default=None, help="parallel processes (default: CPU count)"
    )
    p.add_argument("--force", action="store_true", help="overwrite a non-empty OUT_DIR")
    p.set_defaults(func=cmd_make_synthetic)

    p = sub.add_parser("train", help="train from a config")
    _add_config_args(p)
    p.add_argument("--out", default=None, help="run directory (default: train.out_dir)")
    p.add_argument(
        "--resume", action="store_true", help="continue from RUN_DIR/checkpoints/last.pt"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help=(
            "delete the earlier run in RUN_DIR (metrics, checkpoints, tensorboard) and start again"
        ),
    )
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="evaluate a checkpoint on the validation split")
    _add_config_args(p)
    p.add_argument("--ckpt", required=True)
    p.add_argument(
        "--out", default=None, help="where eval.json goes (default: the checkpoint's run directory)"
    )
    p.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="NAME=detection.KEY=VALUE[;...]",
        help="also evaluate the detections under other post-processing settings, decoded from the "
        "same forward pass (repeatable), e.g. score_only=detection.refine_score_alpha=0.0",
    )
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("viz", help="render camera + BEV pictures of a checkpoint's predictions")
    _add_config_args(p)
    p.add_argument("--ckpt", required=True)
    p.add_argument(
        "--out", default=None, help="default: viz.out_dir, else the run directory's viz/"
    )
    p.add_argument(
        "--num", type=_sample_count, default=None, help="number of samples (default: viz.num)"
    )
    p.set_defaults(func=cmd_viz)

    p = sub.add_parser("demo", help="generate a synthetic set if missing, train, evaluate, render")
    p.add_argument("--config", default=None, help="default: the recipe of --device")
    recipes = "cpu: configs/synthetic_demo.yaml, cuda: configs/synthetic_segmentation.yaml (auto)"
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help=recipes)
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE"
    )
    p.add_argument("--out", default="runs/demo")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="time our ops against peers in the same run")
    p.add_argument("--suite", action="append", help="suite name (repeatable; default: all)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--out", default=None, help="directory for bench.json and bench.md")
    p.add_argument(
        "--quick", action="store_true", help="few repetitions and small cases (smoke test)"
    )
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser(
        "export", help="export a checkpoint's segmentation network to ONNX (docs/export.md)"
    )
    _add_config_args(p)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True, help="the .onnx file to write")
    p.add_argument("--opset", type=int, default=17, help="ONNX opset, 16..20 (default 17)")
    rig = p.add_mutually_exclusive_group()
    rig.add_argument(
        "--fixed-rig",
        dest="rig_inputs",
        action="store_false",
        help="the camera rig is baked into the graph (default; written to OUT.rig.json)",
    )
    rig.add_argument(
        "--rig-inputs",
        dest="rig_inputs",
        action="store_true",
        help="intrinsics, extrinsics and image augmentation are graph inputs",
    )
    p.set_defaults(rig_inputs=False)
    p.add_argument("--rig", default=None, help="fixed rig: a JSON rig file (default: --rig-sample)")
    p.add_argument(
        "--rig-sample", type=int, default=0, help="fixed rig: the validation sample to use"
    )
    p.add_argument(
        "--bev-pool",
        default="onnx",
        help=(
            "onnx: standard operators (default); custom: one lss.BevPool node "
            "(needs a runtime plugin)"
        ),
    )
    p.add_argument(
        "--resize-mode",
        default=None,
        help="Resize coordinate mode to write (default: the mode the checkpoint was trained with)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help=(
            "compare onnxruntime with PyTorch on validation samples (logits and IoU); exit 1 if off"
        ),
    )
    p.add_argument(
        "--check-samples", type=int, default=8, help="validation samples for --check (default 8)"
    )
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "predict",
        help="BEV maps of a checkpoint on a nuScenes scene or on camera images (docs/predict.md)",
    )
    _add_config_args(p, required=False)
    p.add_argument(
        "--ckpt", required=True, help="the checkpoint; its own config unless --config is given"
    )
    p.add_argument("--dataroot", default=None, help="a nuScenes (or synthetic) set; with --scene")
    p.add_argument("--scene", default=None, help="the scene's name, e.g. scene-0103")
    p.add_argument(
        "--images",
        default=None,
        help="a folder with a subfolder of images per camera; with --calib",
    )
    p.add_argument("--calib", default=None, help="the rig file of the images (docs/predict.md)")
    p.add_argument("--out", required=True, help="folder for the .npz (and .png) of every sample")
    p.add_argument("--gif", action="store_true", help="also one GIF of the pictures")
    p.add_argument("--mp4", action="store_true", help="also one MP4 of the pictures")
    p.add_argument("--no-pictures", action="store_true", help="write only the .npz files")
    p.add_argument("--backend", default="torch", choices=("torch", "onnxruntime"))
    p.add_argument(
        "--onnx",
        default=None,
        help="onnxruntime: an export made with --rig-inputs (default: "
        "the checkpoint exported into a temporary folder)",
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument(
        "--batch-size", type=_sample_count, default=None, help="default: eval.batch_size"
    )
    p.add_argument("--num", type=_sample_count, default=None, help="only the first NUM samples")
    p.set_defaults(func=cmd_predict)
    return parser


def main(argv=None) -> int:
    """Run one command. User errors (LssError: config, arguments, dataset, checkpoint; OSError: a
    file that is missing, unreadable or not writable; FloatingPointError: a NaN/inf loss or
    non-finite weights, its message names the step) print one line and return 2; anything else is a
    bug and raises with its traceback. Ctrl-C prints one line (for `lss train`: the last checkpoint
    and how to resume) and returns 130."""
    from lss.errors import LssError

    args = build_parser().parse_args(_join_dash_values(sys.argv[1:] if argv is None else argv))
    try:
        return args.func(args)
    except KeyboardInterrupt as e:
        if os.environ.get("LSS_DEBUG"):
            raise
        print(f"lss {args.command}: {str(e) or 'interrupted'}", file=sys.stderr)
        return 130
    except (LssError, OSError, FloatingPointError) as e:
        if os.environ.get("LSS_DEBUG"):
            raise
        print(f"lss {args.command}: error: {e}", file=sys.stderr)
        print("(set LSS_DEBUG=1 for the full traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
