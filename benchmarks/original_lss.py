r"""The original Lift-Splat-Shoot code as a row of the accuracy benchmark (recipe `original`).

Runs as a subprocess of benchmarks/accuracy.py:

  python -m benchmarks.original_lss --checkout PATH --dataroot DIR --version v1.0-trainval \
      --out RUN_DIR --steps 2000 --seed 0 --eval-every 500 --workers 2 [--set NAME=VALUE ...]

PATH is a checkout of github.com/nv-tlabs/lift-splat-shoot. Its license keeps its code out of this
repository, so this module imports it from the checkout and calls it: its loader
(src.data.compile_data), model (src.models.compile_model), loss (src.tools.SimpleLoss) and
evaluation (src.tools.get_val_info), with the settings of its training entry point (the defaults of
src.train.train: Adam learning rate and weight decay, gradient clipping, pos_weight, batch size,
image augmentation, grid; `--set NAME=VALUE` overrides one of them by its keyword name). The
training loop is ours: the steps of src.train.train (zero_grad, forward, SimpleLoss, backward,
clip_grad_norm_, Adam step, fp32), stopped after --steps, with torch, numpy and random seeded by
--seed. The camera encoder starts from random weights, as lss does without model.pretrained:
EfficientNet.from_pretrained is replaced by EfficientNet.from_name while the model is built.

Each validation (every --eval-every steps and at the last) scores the same forward passes twice: by
the original's own evaluation (get_val_info: logits > 0 against its own ground truth) and by lss's
(IoUMeter at eval.threshold and eval.sweep against lss's rasterisation of the same samples,
NuScenesBEV.bev_targets), so that the original's row and the lss rows share one ground truth. The
run directory gets what `lss train` writes for the harness: metrics.jsonl ("train" and "val"
records) and final.json (its "val" as in eval.json, plus "own": the original's evaluation, and
"cellwise": lss's evaluation without the grid alignment below).

Grids: both index the BEV as [x, y] (row along ego x, forward; column along ego y, left) with the
same bounds, so no axis swap or flip. The original's ground truth rounds box corners to integer
cells and fills with cv2 at pixel centres, so its cell i stands for the point xmin + i * dx, while
lss's cell i covers [xmin + i * dx, xmin + (i + 1) * dx) around its centre xmin + (i + 0.5) * dx:
the original's masks, and the logits trained on them, sit half a cell towards +x and +y of lss's.
align_to_lss_grid resamples the logits at lss's cell centres (the mean of each 2 x 2 block of
neighbouring cells) before lss's evaluation.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import json
import random
import sys
import time
import types
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
import yaml

from lss.geometry import NUSCENES_CAMERAS

# train()'s keyword arguments that are not the recipe: data and log folders, GPU, epochs
NOT_RECIPE = ("version", "dataroot", "nepochs", "gpuid", "logdir")
# compile_data reads DATAROOT/<short name>/<version>/ (tables), the images beside that folder
SHORT_VERSION = {"v1.0-trainval": "trainval", "v1.0-mini": "mini"}
CHECKOUT_FILES = ("src/__init__.py", "src/data.py", "src/models.py", "src/tools.py", "src/train.py")


def check_checkout(path: str | Path) -> Path:
    """`path` resolved, when it holds the original code's src/ package; else a ValueError naming
    what is missing."""
    root = Path(path).expanduser().resolve()
    missing = [f for f in CHECKOUT_FILES if not (root / f).is_file()]
    if missing:
        raise ValueError(
            f"--original-lss {path}: not a checkout of nv-tlabs/lift-splat-shoot "
            f"({root / missing[0]} is missing); clone https://github.com/nv-tlabs/lift-splat-shoot "
            "and pass the folder that holds its src/ and main.py"
        )
    return root


class _NoTensorboardX:
    """tensorboardX.SummaryWriter where tensorboardX is not installed: src/__init__ imports
    src.train, which imports tensorboardX, but only its training loop (not used here) writes
    events."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("tensorboardX is not installed (pip install tensorboardX)")


def import_checkout(path: str | Path) -> types.SimpleNamespace:
    """The original's modules from the checkout at `path`: data, models, tools, train (src.*)."""
    root = check_checkout(path)
    loaded = sys.modules.get("src")
    if (
        loaded is not None
        and Path(getattr(loaded, "__file__", "")).resolve().parent != root / "src"
    ):
        raise RuntimeError(f"another module named 'src' is already imported ({loaded.__file__})")
    if importlib.util.find_spec("tensorboardX") is None:
        sys.modules["tensorboardX"] = types.ModuleType("tensorboardX")
        sys.modules["tensorboardX"].SummaryWriter = _NoTensorboardX
    sys.path.insert(0, str(root))
    names = ("data", "models", "tools", "train")
    return types.SimpleNamespace(**{n: importlib.import_module(f"src.{n}") for n in names})


def recipe_settings(train_fn, overrides: Sequence[str] = ()) -> dict:
    """The keyword defaults of the original's train() that make its recipe (NOT_RECIPE left out),
    then `overrides` ("name=value", value in YAML) by keyword name; an unknown name is an error
    listing the known."""
    settings = {
        name: p.default
        for name, p in inspect.signature(train_fn).parameters.items()
        if name not in NOT_RECIPE and p.default is not inspect.Parameter.empty
    }
    for item in overrides:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or name not in settings:
            raise ValueError(
                f"--set {item!r}: expected NAME=VALUE with NAME one of the original train()'s "
                f"settings {sorted(settings)}"
            )
        settings[name] = yaml.safe_load(raw)
    return settings


def grid_conf(settings: dict) -> dict:
    return {k: list(settings[k]) for k in ("xbound", "ybound", "zbound", "dbound")}


def data_aug_conf(settings: dict) -> dict:
    """The original's data_aug_conf (the dict its train() builds) from `settings`."""
    return {
        "resize_lim": tuple(settings["resize_lim"]),
        "final_dim": tuple(settings["final_dim"]),
        "rot_lim": tuple(settings["rot_lim"]),
        "H": int(settings["H"]),
        "W": int(settings["W"]),
        "rand_flip": bool(settings["rand_flip"]),
        "bot_pct_lim": tuple(settings["bot_pct_lim"]),
        "cams": list(NUSCENES_CAMERAS),  # the order of the original's data_aug_conf["cams"]
        "Ncams": int(settings["ncams"]),
    }


def original_layout(dataroot: str | Path, version: str, scratch: Path) -> Path:
    """A folder in which compile_data finds `version`: it reads DATAROOT/<short name>/<version>/, so
    `scratch` gets <short name> as a link to the folder that holds <version>/ (either layout lss
    reads)."""
    from lss.data.tables import locate_dataroot

    if version not in SHORT_VERSION:
        raise ValueError(
            f"--version {version!r}: the original code reads {sorted(SHORT_VERSION)} only"
        )
    root, _ = locate_dataroot(dataroot, version)
    scratch.mkdir(parents=True, exist_ok=True)
    link = scratch / SHORT_VERSION[version]
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(root.resolve(), target_is_directory=True)
    return scratch


@contextlib.contextmanager
def without_imagenet_weights() -> Iterator[None]:
    """EfficientNet.from_pretrained builds the network from its name without loading (or
    downloading) weights."""
    from efficientnet_pytorch import EfficientNet

    original = EfficientNet.__dict__["from_pretrained"]

    def from_name(
        cls, model_name, weights_path=None, advprop=False, in_channels=3, num_classes=1000, **kw
    ):
        return cls.from_name(model_name, in_channels=in_channels, num_classes=num_classes, **kw)

    EfficientNet.from_pretrained = classmethod(from_name)
    try:
        yield
    finally:
        EfficientNet.from_pretrained = original


def align_to_lss_grid(logits: torch.Tensor) -> torch.Tensor:
    """B x K x nx x ny logits of the original's grid (cell i at xmin + i * dx) resampled bilinearly
    at lss's cell centres (xmin + (i + 0.5) * dx): the mean of cells i and i + 1 along both axes;
    the last row and column, whose neighbours lie outside the grid, keep their own value there (edge
    replication)."""
    padded = F.pad(logits, (0, 1, 0, 1), mode="replicate")
    return 0.25 * (
        padded[..., :-1, :-1] + padded[..., 1:, :-1] + padded[..., :-1, 1:] + padded[..., 1:, 1:]
    )


class SharedEvaluation:
    """lss's evaluation of another model's BEV logits: lss's ground truth (NuScenesBEV.bev_targets
    of the validation split, classes `classes`, grid `xbound` x `ybound`) and lss's IoUMeter
    (eval.threshold and eval.sweep of lss's defaults), once on logits aligned to lss's grid
    (align_to_lss_grid) and once cell by cell as they come."""

    def __init__(
        self,
        dataroot: str | Path,
        version: str,
        xbound: Sequence[float],
        ybound: Sequence[float],
        classes: Sequence[str] = ("vehicle",),
        split: str = "val",
    ):
        from lss.config import load_config
        from lss.data.nuscenes import NuScenesBEV

        self.cfg = load_config(
            None,
            [
                f"data.dataroot={Path(dataroot).resolve()}",
                f"data.version={version}",
                f"data.classes=[{', '.join(classes)}]",
                f"grid.xbound=[{', '.join(str(float(v)) for v in xbound)}]",
                f"grid.ybound=[{', '.join(str(float(v)) for v in ybound)}]",
                "data.depth_targets=false",
            ],
        )
        self.dataset = NuScenesBEV(
            dataroot, version, split, self.cfg, is_train=False, verbose=False
        )
        self.row = {str(t): i for i, t in enumerate(self.dataset.sample_tokens)}
        self._targets: dict[str, torch.Tensor] = {}
        self.reset()

    def reset(self) -> None:
        from lss.engine.metrics import IoUMeter

        ev = self.cfg.eval
        self.aligned = IoUMeter(self.cfg.data.classes, ev.threshold, ev.sweep)
        self.cellwise = IoUMeter(self.cfg.data.classes, ev.threshold, ev.sweep)
        self.samples = 0

    def targets(self, tokens: Sequence[str]) -> torch.Tensor:
        """len(tokens) x K x nx x ny lss ground truth (uint8), rasterised once per sample."""
        out = []
        for token in tokens:
            if token not in self._targets:
                if token not in self.row:
                    raise KeyError(
                        f"sample {token} is not in lss's {self.dataset.split} split of "
                        f"{self.dataset.root / self.dataset.version}: the two loaders read "
                        "different splits"
                    )
                raster = self.dataset.bev_targets(self.row[token]).astype(np.uint8)
                self._targets[token] = torch.from_numpy(raster)
            out.append(self._targets[token])
        return torch.stack(out)

    def update(self, logits: torch.Tensor, tokens: Sequence[str]) -> None:
        """Add a batch: B x K x nx x ny logits of the samples `tokens`, on the original's grid."""
        logits = logits.detach().float()
        truth = self.targets(tokens).to(logits.device)
        if logits.shape != truth.shape:
            raise ValueError(
                f"logits {tuple(logits.shape)} against lss's ground truth "
                f"{tuple(truth.shape)}: the grids or classes differ"
            )
        self.aligned.update(align_to_lss_grid(logits), truth)
        self.cellwise.update(logits, truth)
        self.samples += len(tokens)

    def compute(self) -> dict:
        """IoUMeter.compute of the aligned logits; "cellwise": the same without the alignment."""
        result = self.aligned.compute()
        result["cellwise"] = {
            k: v for k, v in self.cellwise.compute().items() if k in ("iou", "sweep")
        }
        result["samples"] = self.samples
        return result


@contextlib.contextmanager
def scored_by(
    model: torch.nn.Module, shared: SharedEvaluation, tokens: Sequence[str]
) -> Iterator[None]:
    """While open, every forward of `model` is one batch of the validation samples `tokens`, in
    order (a loader without shuffling), and goes to `shared`; on closing, every sample must have
    been seen once."""
    shared.reset()
    seen = [0]

    def hook(module, args, output):
        batch = tokens[seen[0] : seen[0] + len(output)]
        if len(batch) != len(output):
            raise RuntimeError(
                f"more predictions than the {len(tokens)} validation samples: the loader and "
                "the sample list differ"
            )
        shared.update(output, batch)
        seen[0] += len(output)

    handle = model.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
    if seen[0] != len(tokens):
        raise RuntimeError(f"the evaluation saw {seen[0]} of the {len(tokens)} validation samples")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def image_size(path: str | Path) -> tuple[int, int]:
    """(W, H) of the image at `path`: the original takes both from its settings (H, W), not from the
    files."""
    from PIL import Image

    with Image.open(path) as img:
        return img.size


class Writer:
    """metrics.jsonl records as `lss train` writes them ({"kind", "step", ...})."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "metrics.jsonl"
        self.path.write_text("")

    def write(self, kind: str, step: int, values: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"kind": kind, "step": step, **values}) + "\n")


def validate(src, model, valloader, loss_fn, device, shared: SharedEvaluation) -> dict:
    """One pass of the original's get_val_info, its forwards scored by lss's evaluation too."""
    tokens = [rec["token"] for rec in valloader.dataset.ixes]
    started = time.perf_counter()
    with scored_by(model, shared, tokens):
        own = src.tools.get_val_info(model, valloader, loss_fn, device)
    result = shared.compute()
    result["own"] = {"iou": {"vehicle": own["iou"]}, "loss": own["loss"]}
    result["seconds"] = time.perf_counter() - started
    return result


def train(args: argparse.Namespace) -> dict:
    src = import_checkout(args.checkout)
    settings = recipe_settings(src.train.train, args.set)
    run_dir = Path(args.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    seed_everything(args.seed)
    if args.workers is not None:
        settings["nworkers"] = args.workers
    (run_dir / "final.json").unlink(missing_ok=True)
    root = original_layout(args.dataroot, args.version, run_dir / "nuscenes")
    grid = grid_conf(settings)
    shared = SharedEvaluation(args.dataroot, args.version, grid["xbound"], grid["ybound"])
    if not any(item.split("=", 1)[0].strip() in ("H", "W") for item in args.set):
        settings["W"], settings["H"] = image_size(shared.dataset.image_paths[0][0])
    aug = data_aug_conf(settings)
    trainloader, valloader = src.data.compile_data(
        SHORT_VERSION[args.version],
        str(root),
        data_aug_conf=aug,
        grid_conf=grid,
        bsz=settings["bsz"],
        nworkers=settings["nworkers"],
        parser_name="segmentationdata",
    )
    with without_imagenet_weights():
        model = src.models.compile_model(grid, aug, outC=1)
    model.to(device)
    opt = torch.optim.Adam(
        model.parameters(), lr=settings["lr"], weight_decay=settings["weight_decay"]
    )
    loss_fn = src.tools.SimpleLoss(settings["pos_weight"]).to(device)
    (run_dir / "settings.json").write_text(
        json.dumps({"original": settings, **vars(args)}, indent=1)
    )
    print(
        f"original LSS ({args.checkout}) on {device}: {len(trainloader.dataset)} train / "
        f"{len(valloader.dataset)} val samples, {args.steps} steps, seed {args.seed}; "
        f"settings {settings}",
        flush=True,
    )
    writer, started, step, last = Writer(run_dir), time.perf_counter(), 0, None
    model.train()
    while step < args.steps:
        for imgs, rots, trans, intrins, post_rots, post_trans, binimgs in trainloader:
            opt.zero_grad()
            inputs = (imgs, rots, trans, intrins, post_rots, post_trans)
            preds = model(*(t.to(device) for t in inputs))
            loss = loss_fn(preds, binimgs.to(device))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings["max_grad_norm"])
            opt.step()
            step += 1
            if step % args.log_every == 0 or step == args.steps:
                elapsed = time.perf_counter() - started
                writer.write("train", step, {"loss": loss.item(), "elapsed": elapsed})
                print(f"step {step} loss {loss.item():.4f} ({elapsed:.0f} s)", flush=True)
            if step == args.steps or (args.eval_every > 0 and step % args.eval_every == 0):
                last = validate(src, model, valloader, loss_fn, device, shared)
                writer.write(
                    "val",
                    step,
                    {k: last[k] for k in ("iou", "mean_iou", "own", "cellwise", "seconds")},
                )
                print(
                    f"step {step}: val IoU vehicle {100 * last['iou']['vehicle']:.2f} (lss's "
                    f"evaluation), {100 * last['own']['iou']['vehicle']:.2f} (the original's own)",
                    flush=True,
                )
            if step == args.steps:
                break
        if step == 0:
            raise RuntimeError(
                "the training loader yielded no batch: fewer samples than one batch?"
            )
    final = {"original": settings, "step": step, "val": last, "run_dir": str(run_dir)}
    (run_dir / "final.json").write_text(json.dumps(final, indent=1))
    return final


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.original_lss",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--checkout", required=True, help="a checkout of nv-tlabs/lift-splat-shoot")
    p.add_argument(
        "--dataroot", required=True, help="the nuScenes-format set (either layout lss reads)"
    )
    p.add_argument("--version", default="v1.0-trainval", choices=sorted(SHORT_VERSION))
    p.add_argument("--out", required=True, help="run directory: metrics.jsonl, final.json")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--eval-every", type=int, default=500, help="validation period in steps (0: at the end)"
    )
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument(
        "--workers", type=int, default=None, help="loader workers (default: train()'s nworkers)"
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a setting of the original train() by its keyword name, e.g. ncams=6",
    )
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: expected at least 1")
    try:
        check_checkout(args.checkout)
    except ValueError as e:
        parser.error(str(e))
    train(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
