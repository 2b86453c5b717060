"""Train in one resize mode, deploy in another: validation IoU of the exported model in onnxruntime for every
(training mode, deployment mode) pair, on the synthetic set (docs/export.md, "Training in the deployment's mode").

    python scripts/deploy_modes.py --out runs/deploy_modes                       # demo config, its max_steps per mode
    python scripts/deploy_modes.py --out runs/deploy_modes --steps 200 --set train.device=cpu

For each training mode it trains `--config` with model.upsample_mode set to it (or reuses RUN/checkpoints/last.pt),
exports the last checkpoint with every deployment mode's Resize and runs `check_export` over the validation split.
Prints a markdown table (device and date in its title) and writes deploy_modes.json into --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch

from lss.config import load_config
from lss.engine.distributed import device_type
from lss.engine.train import train
from lss.export import export_checkpoint
from lss.export.check import check_export


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/synthetic_demo.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--out", default="runs/deploy_modes")
    parser.add_argument("--steps", type=int, default=None, help="training steps per mode (default: the config's)")
    parser.add_argument("--train-modes", default="align_corners,asymmetric")
    parser.add_argument("--deploy-modes", default="align_corners,half_pixel,asymmetric")
    args = parser.parse_args()
    out = Path(args.out)
    steps = [f"train.max_steps={args.steps}"] if args.steps else []
    deploy_modes = args.deploy_modes.split(",")
    rows = []
    for train_mode in args.train_modes.split(","):
        cfg = load_config(args.config, args.overrides + steps + [f"model.upsample_mode={train_mode}",
                                                                 "train.eval_every=0", "train.viz_every=0"])
        run = out / f"trained_{train_mode}"
        ckpt = run / "checkpoints" / "last.pt"
        if not ckpt.is_file():
            train(cfg, out_dir=str(run), overwrite=True)
        for deploy_mode in deploy_modes:
            done = export_checkpoint(cfg, ckpt, run / f"deployed_{deploy_mode}.onnx", resize_mode=deploy_mode)
            result = check_export(cfg, done["model"], done["path"], done["rig"], samples=10**6)
            rows.append({"trained": train_mode, "deployed": deploy_mode, "samples": result["samples"],
                         "iou_torch": result["iou_torch"], "iou_onnx": result["iou_onnx"],
                         "max_abs_diff": result["max_abs_diff"]})
            print(json.dumps(rows[-1]), flush=True)
    device = torch.cuda.get_device_name() if device_type(cfg) == "cuda" else "CPU"
    title = (f"{args.config}, {cfg.train.max_steps} steps per training mode, {rows[0]['samples']} validation samples; "
             f"{device}, {datetime.date.today().isoformat()}")
    (out / "deploy_modes.json").write_text(json.dumps({"title": title, "rows": rows}, indent=1))
    print(table(rows, title))


def table(rows: list[dict], title: str) -> str:
    classes = list(rows[0]["iou_onnx"])
    head = ("| trained in | deployed in | max abs logit difference | "
            + " | ".join(f"{c} IoU (change)" for c in classes) + " |")
    lines = [f"IoU (%) in onnxruntime, and its change against the PyTorch model in its training mode: {title}", "",
             head, "|---|---|---|" + "---|" * len(classes)]
    for r in rows:
        cells = [f"{100 * r['iou_onnx'][c]:.2f} ({100 * (r['iou_onnx'][c] - r['iou_torch'][c]):+.2f})"
                 for c in classes]
        lines.append(f"| {r['trained']} | {r['deployed']} | {r['max_abs_diff']:.2g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
