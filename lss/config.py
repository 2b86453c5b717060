"""Typed configuration: dataclass defaults (the LSS paper recipe), overridden by YAML, then by `--set` pairs.

Unknown keys and wrong types are errors that name the key, where it came from and what is allowed.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml

NUSCENES_CAMERAS = (
    "CAM_FRONT_LEFT",
    "CAM_FRONT",
    "CAM_FRONT_RIGHT",
    "CAM_BACK_LEFT",
    "CAM_BACK",
    "CAM_BACK_RIGHT",
)


class ConfigError(ValueError):
    """A configuration value or key is not valid; the message says which and what is allowed."""


@dataclass
class SyntheticConfig:
    """What `lss make-synthetic` writes when data.make_synthetic_if_missing generates the dataset."""

    scenes: int = 10
    samples_per_scene: int = 40
    image_size: tuple[int, int] = (1600, 900)  # width, height
    seed: int = 0


@dataclass
class DataConfig:
    dataroot: str = "data/nuscenes"
    version: str = "v1.0-mini"
    train_split: str = "train"
    val_split: str = "val"
    make_synthetic_if_missing: bool = False
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    cameras: tuple[str, ...] = NUSCENES_CAMERAS
    num_train_cameras: Optional[int] = None  # random subset per training sample (LSS used 5 of 6); None = all
    final_dim: tuple[int, int] = (128, 352)  # network input height, width
    resize_lim: tuple[float, float] = (0.193, 0.225)
    bot_pct_lim: tuple[float, float] = (0.0, 0.22)
    rot_lim: tuple[float, float] = (-5.4, 5.4)  # degrees
    rand_flip: bool = True
    # BEV-space augmentation of training samples (BEVDet): the ego frame, camera extrinsics and targets together
    bev_rot_lim: tuple[float, float] = (0.0, 0.0)  # degrees about z
    bev_scale_lim: tuple[float, float] = (1.0, 1.0)
    bev_flip: bool = False  # mirror ego x and ego y, each with p = 0.5
    classes: tuple[str, ...] = ("vehicle", "pedestrian", "drivable_area", "lane_divider")
    min_visibility: int = 0  # keep boxes whose visibility token >= this (0 keeps all)
    min_lidar_pts: int = 0
    divider_width: int = 2  # lane/road dividers are drawn this many BEV cells wide
    visibility_mask: bool = False
    detection_targets: bool = False
    depth_targets: bool = False  # per camera feature cell: depth bin of the nearest LIDAR_TOP return (docs/training.md)
    workers: int = 4
    image_mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    image_std: tuple[float, float, float] = (0.229, 0.224, 0.225)


@dataclass
class GridConfig:
    """Each bound is (min, max, cell size) in metres; dbound is the depth bins (min, max, step)."""

    xbound: tuple[float, float, float] = (-50.0, 50.0, 0.5)
    ybound: tuple[float, float, float] = (-50.0, 50.0, 0.5)
    zbound: tuple[float, float, float] = (-10.0, 10.0, 20.0)
    dbound: tuple[float, float, float] = (4.0, 45.0, 1.0)


@dataclass
class ModelConfig:
    backbone: str = "efficientnet-b0"
    pretrained: Optional[str] = None  # local path to ImageNet weights for the camera backbone
    downsample: int = 16
    context_channels: int = 64
    splat: str = "bev_pool"  # "bev_pool" (our op) or "reference" (pure PyTorch, for comparison)
    heads: tuple[str, ...] = ("segmentation",)


@dataclass
class LossConfig:
    type: str = "focal"  # "focal" (our sigmoid focal loss op) or "bce" (the LSS paper's BCE with pos_weight)
    focal_alpha: float = 0.25
    focal_gamma: float = 2.0
    pos_weight: float = 2.13
    class_weights: Optional[tuple[float, ...]] = None
    depth_weight: float = 0.0  # lidar depth cross-entropy on the camera depth distribution; needs data.depth_targets


@dataclass
class OptimConfig:
    name: str = "adam"  # "adam" or "adamw"
    lr: float = 1e-3
    weight_decay: float = 1e-7
    grad_clip: float = 5.0
    schedule: str = "constant"  # "constant", "cosine" or "onecycle"
    warmup_steps: int = 0


@dataclass
class TrainConfig:
    batch_size: int = 4
    max_steps: int = 30000
    grad_accum: int = 1
    amp: str = "bf16"  # "bf16", "fp16" or "none"; autocast applies on CUDA only
    channels_last: bool = True
    compile: bool = False
    compile_mode: str = "default"  # torch.compile mode: "default", "reduce-overhead" (CUDA graphs), "max-autotune..."
    compile_memory_budget: float = 1.0  # with compile: < 1 recomputes activations in the backward (less memory)
    cuda_graph: bool = False  # capture the whole step (LUT, forward, loss, backward, optimizer) as one CUDA graph
    seed: int = 0
    deterministic: bool = False
    device: str = "auto"  # "auto", "cpu" or "cuda"
    out_dir: str = "runs/lss"
    log_every: int = 10
    eval_every: int = 1000
    ckpt_every: int = 1000
    viz_every: int = 1000


@dataclass
class EvalConfig:
    threshold: float = 0.5
    sweep: tuple[float, ...] = (0.3, 0.4, 0.5, 0.6, 0.7)
    batch_size: int = 4
    max_batches: Optional[int] = None


@dataclass
class VizConfig:
    num: int = 8
    gif: bool = False
    out_dir: Optional[str] = None  # default: RUN_DIR/viz


@dataclass
class DetectionConfig:
    """3D box head on the BEV features (active when "detection" is in model.heads); see docs/detection.md."""

    head_channels: int = 64
    gaussian_overlap: float = 0.1  # heatmap radius: the centre shift that keeps this box IoU (CenterNet rule)
    min_radius: int = 2  # heatmap cells
    focal_alpha: float = -1.0  # heatmap focal loss (our sigmoid_focal_loss op); negative: no alpha (CornerNet)
    focal_gamma: float = 2.0
    heatmap_weight: float = 1.0
    regression_weight: float = 0.25
    # per channel: offset x, y, z, log w, l, h, sin, cos yaw, vx, vy
    code_weights: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.2, 0.2)
    top_k: int = 500  # heatmap peaks per sample before NMS
    score_threshold: float = 0.05
    nms_iou: float = 0.2  # on the boxes' axis-aligned BEV envelopes, per class; <= 0 disables NMS
    max_detections: int = 300  # per sample (the nuScenes evaluation accepts at most 500)
    refine: bool = True  # second stage: RoIAlign on the BEV features + MLP refining score and box
    refine_proposals: int = 128  # first-stage boxes refined per sample while training
    refine_gt_proposals: bool = True  # add jittered ground-truth boxes as proposals while training
    roi_size: int = 7
    roi_enlarge: float = 1.5  # envelope scale, for context around the box
    refine_hidden: int = 256
    refine_weight: float = 1.0
    match_distance: float = 2.0  # metres between centres: a proposal's positive ground truth


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    grid: GridConfig = field(default_factory=GridConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    viz: VizConfig = field(default_factory=VizConfig)
    detection: DetectionConfig = field(default_factory=DetectionConfig)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, where: str) -> Any:
    """Convert a YAML value to the annotated type, or raise ConfigError naming `where`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping for section {tp.__name__}, got {value!r}")
        return _merge(tp(), value, where)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{where}: expected {len(args)} values, got {len(value)}: {value!r}")
            return tuple(_convert(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        elem = args[0] if args else Any
        out = [_convert(v, elem, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    raise ConfigError(f"{where}: unsupported type {_type_name(tp)}")


def _merge(obj: Any, values: dict, where: str) -> Any:
    hints = typing.get_type_hints(type(obj))
    allowed = [f.name for f in dataclasses.fields(obj)]
    for key, value in values.items():
        if key not in allowed:
            raise ConfigError(f"{where or 'top level'}: unknown key '{key}'. Allowed keys: {', '.join(allowed)}")
        path = f"{where}.{key}" if where else key
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current) and isinstance(value, dict):
            _merge(current, value, path)  # a later source overrides single keys, keeping the section's other values
        else:
            setattr(obj, key, _convert(value, hints[key], path))
    return obj


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. --set train.max_steps=100")
    key, raw = item.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw)


def load_config(path: Optional[Union[str, Path]] = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Defaults, then the YAML file at `path`, then `overrides` ("section.key=value", value parsed as YAML)."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist (see configs/ for the shipped ones)")
        try:
            values = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(values, dict):
            raise ConfigError(f"config file {path}: expected a mapping of sections at the top level")
        try:
            _merge(cfg, values, "")
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
    for item in overrides:
        keys, value = _parse_override(item)
        nested: Any = value
        for k in reversed(keys):
            nested = {k: nested}
        try:
            _merge(cfg, nested, "")
        except ConfigError as e:
            raise ConfigError(f"--set {item}: {e}") from None
    return cfg


def config_to_dict(cfg: Any) -> dict:
    """Plain dict (tuples as lists) suitable for YAML/JSON."""

    def plain(v):
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    return plain(cfg)


def config_from_dict(values: dict) -> Config:
    return _merge(Config(), values, "config")


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def save_config(cfg: Config, path: Union[str, Path]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(dump_config(cfg))
    tmp.replace(path)
