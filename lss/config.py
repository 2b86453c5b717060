"""Typed configuration: dataclass defaults (the LSS paper recipe), overridden by YAML, then by `--set` pairs.

Unknown keys, wrong types and values outside a `Literal[...]` are errors that name the key, where it came from and
what is allowed; `validate` then checks ranges and cross-field rules (of the device or the data where known).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from lss.config_io import parse_override, read_number, read_yaml_file
from lss.errors import ConfigError
from lss.boxes import DETECTION_CLASSES, REGRESSION_CHANNELS
from lss.geometry import NUSCENES_CAMERAS, BevGrid, depth_bin_count
from lss.memory_estimate import check_config_memory


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
    cameras: tuple[Literal[NUSCENES_CAMERAS], ...] = NUSCENES_CAMERAS
    num_train_cameras: Optional[int] = (
        None  # random subset per training sample (LSS used 5 of 6); None = all
    )
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
    # derived from model.heads (the dataset yields detection targets for the detection head); a
    # config that sets it must agree
    detection_targets: Optional[bool] = None
    depth_targets: bool = False  # per camera feature cell: depth bin of the nearest LIDAR_TOP return (docs/training.md)
    # keep camera images decoded on disk after their first decode (lss.data.decoded_cache; about 1.6 MB per sample at
    # 1600x900 -> 128x352): later epochs skip the JPEG decode, the batches stay the same
    decoded_cache: bool = False
    # loader processes per rank; "auto": min(12, this rank's share of the CPUs - 2), at least 1
    workers: Union[int, Literal["auto"]] = 4
    # scheduling niceness added to the loader workers (0-19): a positive value lets the training process, which feeds
    # the GPU, run first whenever it and the workers want the same cores
    worker_niceness: int = 0
    image_mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    image_std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    # the original LSS code's conventions, for ablations (lss.data.original_conventions,
    # docs/accuracy.md). Images: "fast" (JPEG DCT-domain downscale, area resize, one bilinear warp)
    # or "pil" (full PIL decode, bicubic resize, nearest-neighbour rotation)
    image_resize: Literal["fast", "pil"] = "fast"
    # post_rot/post_trans: "exact" (the pixels' affine) or "original" (its approximate composition)
    post_matrices: Literal["exact", "original"] = "exact"
    # object footprints, every split: "exact" (sub-cell, centred) or "original" (corners rounded to
    # whole cells: half a cell off)
    target_raster: Literal["exact", "original"] = "exact"


@dataclass
class GridConfig:
    """Each bound is (min, max, cell size) in metres; dbound is the depth bins (min, max, step)."""

    xbound: tuple[float, float, float] = (-50.0, 50.0, 0.5)
    ybound: tuple[float, float, float] = (-50.0, 50.0, 0.5)
    zbound: tuple[float, float, float] = (-10.0, 10.0, 20.0)
    dbound: tuple[float, float, float] = (4.0, 45.0, 1.0)


@dataclass
class ModelConfig:
    backbone: Literal["efficientnet-b0"] = "efficientnet-b0"
    # ImageNet weights for the camera backbone: "imagenet" (efficientnet-pytorch's, through
    # torch.hub's download cache), a local state-dict path, or null (random initialisation)
    pretrained: Optional[str] = None
    downsample: int = 16  # the EfficientNet camera encoder's output stride: 16 only
    context_channels: int = 64
    splat: Literal["bev_pool", "reference"] = "bev_pool"  # our op, or pure PyTorch (for comparison)
    heads: tuple[Literal["segmentation", "detection"], ...] = (
        "segmentation",
    )  # segmentation is required
    # coordinate mode of every bilinear upsampling in the camera and BEV decoders (lss.ops.upsample_bilinear): the
    # original LSS code used align_corners; a deployment runtime may need half_pixel or asymmetric
    upsample_mode: Literal["pytorch_half_pixel", "half_pixel", "align_corners", "asymmetric"] = (
        "pytorch_half_pixel"
    )
    # frustum (u, v): the feature cells' centres, or "linspace": first to last pixel (original LSS)
    frustum_pixels: Literal["centres", "linspace"] = "centres"
    # frustum point -> BEV cell: floor, or "trunc" toward zero (original LSS: keeps points up to a
    # cell below the grid)
    splat_binning: Literal["floor", "trunc"] = "floor"
    # the BEV ResNet-18's last BatchNorm of every residual branch starts at 0 (original LSS: true)
    bev_zero_init_residual: bool = False


@dataclass
class LossConfig:
    type: Literal["focal", "bce"] = (
        "focal"  # our sigmoid focal loss op, or the LSS paper's BCE with pos_weight
    )
    focal_alpha: float = 0.25
    focal_gamma: float = 2.0
    pos_weight: float = 2.13  # BCE weight of the positive cells, every class
    class_pos_weights: Optional[tuple[float, ...]] = (
        None  # BCE: one pos_weight per class (replaces pos_weight)
    )
    class_weights: Optional[tuple[float, ...]] = None
    depth_weight: float = (
        0.0  # lidar depth cross-entropy on the camera depth distribution; needs data.depth_targets
    )


@dataclass
class OptimConfig:
    name: Literal["adam", "adamw"] = "adam"
    lr: float = 1e-3
    weight_decay: float = 1e-7
    grad_clip: float = 5.0
    schedule: Literal["constant", "cosine", "onecycle"] = "constant"
    warmup_steps: int = 0


@dataclass
class TrainConfig:
    batch_size: int = 4
    max_steps: int = 30000
    grad_accum: int = 1
    amp: Literal["bf16", "fp16", "none"] = "bf16"  # autocast applies on CUDA only
    # channels_last memory format for the convolutions: true (whole model), "camera" (camera encoder), "bev" (BEV
    # encoder and heads) or false; step time and first-step cost of each:
    # docs/benchmarks.md#training-step
    channels_last: Union[bool, Literal["camera", "bev"]] = False
    compile: bool = (
        False  # torch.compile; compile_mode "reduce-overhead" replays CUDA graphs per module
    )
    compile_mode: Literal[
        "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"
    ] = "default"
    # "background": uncompiled steps until a child process has compiled the model; "auto": that on one CUDA process
    compile_start: Literal["auto", "now", "background"] = "auto"
    compile_memory_budget: float = (
        1.0  # with compile: < 1 recomputes activations in the backward (less memory)
    )
    # the whole step as one CUDA graph: true (an error where it cannot be), "auto" (where it can, else eager) or false
    cuda_graph: Union[bool, Literal["auto"]] = False
    seed: int = 0
    deterministic: bool = False
    # cuDNN autotuning: tries the convolution algorithms of every new shape (a slower first step for the same
    # captured step time, docs/training.md); false: cuDNN's heuristics pick them
    cudnn_benchmark: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"
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
    # the prediction panel: probabilities as opacity, or the cells above eval.threshold (what the IoU counts)
    mode: Literal["probability", "threshold"] = "probability"


@dataclass
class DetectionConfig:
    """3D box head on the BEV features (active when "detection" is in model.heads); see docs/detection.md."""

    head_channels: int = 64
    gaussian_overlap: float = (
        0.1  # heatmap radius: the centre shift that keeps this box IoU (CenterNet rule)
    )
    min_radius: int = 2  # heatmap cells
    focal_alpha: float = (
        -1.0
    )  # heatmap focal loss (our sigmoid_focal_loss op); negative: no alpha (CornerNet)
    focal_gamma: float = 2.0
    heatmap_weight: float = 1.0
    # one weight per detection class scaling that class's heatmap loss (e.g. more for rare classes); null: all 1
    heatmap_class_weights: Optional[tuple[float, ...]] = None
    regression_weight: float = 0.25
    # per channel: offset x, y, z, log w, l, h, sin, cos yaw, vx, vy
    code_weights: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.2, 0.2)
    top_k: int = 500  # heatmap peaks per sample before NMS
    score_threshold: float = 0.05
    nms_iou: float = 0.2  # on the boxes' axis-aligned BEV envelopes, per class; <= 0 disables NMS
    max_detections: int = 300  # per sample (the nuScenes evaluation accepts at most 500)
    max_objects: int = 256  # per training sample: the fixed size of the dataset's padded targets
    # second stage: RoIAlign on the BEV features + MLP refining score and box; off by default: at 2,000 steps it
    # scored below the first stage alone (docs/detection.md#measured)
    refine: bool = False
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
    if tp is bool:
        return "true/false"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _allowed(values: tuple) -> str:
    return ", ".join(repr(v) for v in values)


def _convert(value: Any, tp: Any, where: str) -> Any:
    """Convert a YAML value to the annotated type, or raise ConfigError naming `where`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        if isinstance(value, bool) or value not in args:
            raise ConfigError(f"{where}={value!r}: expected one of {_allowed(args)}")
        return value
    if origin is Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for option in inner:  # the first type that takes the value
            try:
                return _convert(value, option, where)
            except ConfigError:
                pass
        raise ConfigError(
            f"{where}={value!r}: expected "
            + " or ".join(
                _type_name(a)
                if typing.get_origin(a) is not Literal
                else _allowed(typing.get_args(a))
                for a in inner
            )
        )
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(
                f"{where}: expected a mapping for section {tp.__name__}, got {value!r}"
            )
        return _merge(tp(), value, where)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(
                    f"{where}: expected {len(args)} values, got {len(value)}: {value!r}"
                )
            return tuple(
                _convert(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args))
            )
        elem = args[0] if args else Any
        if typing.get_origin(elem) is Literal:
            unknown = [v for v in value if isinstance(v, bool) or v not in typing.get_args(elem)]
            if unknown:
                noun = where.rsplit(".", 1)[-1].removesuffix("s")  # model.heads -> "head"
                raise ConfigError(
                    f"{where}={list(value)!r}: unknown {noun}(s) {unknown}; expected values from "
                    f"{_allowed(typing.get_args(elem))}"
                )
        out = [_convert(v, elem, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        number = read_number(value)
        if isinstance(number, float) and number.is_integer():
            number = int(number)  # 1e3 or 1000.0 written for a count
        if isinstance(number, int):
            return number
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        number = read_number(value)
        if number is None:
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if number != number:
            raise ConfigError(f"{where}: expected a number (not NaN), got {value!r}")
        return float(number)
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
            raise ConfigError(
                f"{where or 'top level'}: unknown key '{key}'. Allowed keys: {', '.join(allowed)}"
            )
        path = f"{where}.{key}" if where else key
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current) and isinstance(value, dict):
            _merge(
                current, value, path
            )  # a later source overrides single keys, keeping the section's other values
        else:
            setattr(obj, key, _convert(value, hints[key], path))
    return obj


MAX_VISIBILITY = 4  # nuScenes visibility tokens: 1 (0-40 % visible) to 4 (80-100 %)
CAMERA_STRIDE = (
    32  # the camera trunk's deepest reduction: the input height and width must divide by it
)
BEV_STRIDE = 8  # the BEV trunk's deepest reduction: the grid's cell counts must divide by it
MAX_DETECTIONS = 500  # boxes per sample the nuScenes detection evaluation accepts


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _at_least(section: Any, prefix: str, keys: typing.Sequence[str], low: float) -> None:
    for key in keys:
        value = getattr(section, key)
        _check(value >= low, f"{prefix}.{key}={value}: expected >= {low}")


def validate(cfg: Config) -> Config:
    """Check ranges and cross-field rules of a merged config (enumerations are checked as it merges); returns it.

    Raises ConfigError naming the key, its value and what is allowed. Rules that need the device or the dataset
    on disk (a CUDA GPU, class names of the nuScenes vocabulary, split sizes) are checked where those are known.
    """

    data, grid, model, loss, t = cfg.data, cfg.grid, cfg.model, cfg.loss, cfg.train
    _check(
        len(data.cameras) > 0 and len(set(data.cameras)) == len(data.cameras),
        f"data.cameras must be distinct names from {list(NUSCENES_CAMERAS)}, got {list(data.cameras)}",
    )
    _check(
        data.num_train_cameras is None or 1 <= data.num_train_cameras <= len(data.cameras),
        f"data.num_train_cameras must be in [1, {len(data.cameras)}] (the number of data.cameras) or null, got "
        f"{data.num_train_cameras}",
    )
    height, width = data.final_dim
    _check(
        height > 0 and width > 0 and height % CAMERA_STRIDE == 0 and width % CAMERA_STRIDE == 0,
        f"data.final_dim={list(data.final_dim)}: height and width must be multiples of {CAMERA_STRIDE} and > 0, "
        "e.g. [128, 352] or [64, 192]",
    )
    _check(
        0 < data.resize_lim[0] <= data.resize_lim[1],
        f"data.resize_lim={list(data.resize_lim)}: expected [min, max] with 0 < min <= max",
    )
    _check(
        0.0 <= data.bot_pct_lim[0] <= data.bot_pct_lim[1] < 1.0,
        f"data.bot_pct_lim={list(data.bot_pct_lim)}: expected [min, max] with 0 <= min <= max < 1 (fractions of "
        "the resized image height below the crop)",
    )
    _check(
        data.rot_lim[0] <= data.rot_lim[1],
        f"data.rot_lim={list(data.rot_lim)}: expected [min, max], min <= max",
    )
    _check(
        data.bev_rot_lim[0] <= data.bev_rot_lim[1],
        f"data.bev_rot_lim={list(data.bev_rot_lim)}: expected [min, max] in degrees, min <= max",
    )
    _check(
        0 < data.bev_scale_lim[0] <= data.bev_scale_lim[1],
        f"data.bev_scale_lim={list(data.bev_scale_lim)}: expected [min, max] with 0 < min <= max (1.0: no scaling)",
    )
    _check(
        len(data.classes) > 0, "data.classes is empty: expected at least one class, e.g. [vehicle]"
    )
    _at_least(data, "data", ("min_lidar_pts",), 0)
    _check(
        data.workers == "auto" or data.workers >= 0,
        f"data.workers={data.workers}: expected >= 0 or auto",
    )
    _check(
        0 <= data.worker_niceness <= 19,
        f"data.worker_niceness={data.worker_niceness}: expected 0 to 19",
    )
    _check(
        0 <= data.min_visibility <= MAX_VISIBILITY,
        f"data.min_visibility={data.min_visibility}: expected 0 to {MAX_VISIBILITY} (the nuScenes visibility "
        "levels; 0 keeps every box)",
    )
    _at_least(data, "data", ("divider_width",), 1)
    _check(
        not (data.decoded_cache and data.image_resize == "pil"),
        "data.decoded_cache keeps the fast path's reduced JPEG decodes, but data.image_resize=pil "
        "decodes every image in full: set data.decoded_cache: false, or data.image_resize: fast",
    )
    _check(
        all(s > 0 for s in data.image_std),
        f"data.image_std={list(data.image_std)}: expected values > 0",
    )
    _at_least(data.synthetic, "data.synthetic", ("scenes", "samples_per_scene"), 1)
    _check(
        data.synthetic.image_size[0] >= 32 and data.synthetic.image_size[1] >= 18,
        f"data.synthetic.image_size={list(data.synthetic.image_size)}: expected at least [32, 18] (nuScenes is "
        "[1600, 900])",
    )

    try:
        bev = BevGrid.from_config(grid)
        depth_bin_count(grid.dbound)
    except ValueError as e:
        raise ConfigError(f"grid.{str(e).removeprefix('BevGrid: ')}") from None
    _check(
        bev.nx % BEV_STRIDE == 0 and bev.ny % BEV_STRIDE == 0,
        f"grid: the BEV grid is {bev.nx} x {bev.ny} cells; both must be multiples of {BEV_STRIDE} (adjust "
        "grid.xbound/ybound)",
    )

    _check(
        model.downsample == 16,
        f"model.downsample={model.downsample}: the EfficientNet camera encoder outputs stride 16",
    )
    _check(
        "segmentation" in model.heads,
        f"model.heads={list(model.heads)}: the segmentation head is required "
        "(evaluation and checkpoint selection use its IoU)",
    )
    _at_least(model, "model", ("context_channels",), 1)
    detecting = "detection" in model.heads
    _check(
        data.detection_targets in (None, detecting),
        f"data.detection_targets={data.detection_targets} contradicts model.heads="
        f"{list(model.heads)}: the dataset yields the detection head's fixed-shape targets exactly "
        "when model.heads has detection; remove data.detection_targets (it follows from "
        "model.heads)",
    )
    data.detection_targets = detecting

    for key in ("class_weights", "class_pos_weights"):
        values = getattr(loss, key)
        if values is not None:
            _check(
                len(values) == len(data.classes),
                f"loss.{key} has {len(values)} values but data.classes has {len(data.classes)} "
                f"({list(data.classes)}): give one value per class, in the same order",
            )
            _check(all(v > 0 for v in values), f"loss.{key}={list(values)}: expected values > 0")
    _check(
        loss.class_pos_weights is None or loss.type == "bce",
        f"loss.class_pos_weights is set but loss.type={loss.type!r}: it weighs the positives of the BCE loss; "
        "set loss.type: bce or remove loss.class_pos_weights",
    )
    _check(
        loss.depth_weight >= 0,
        f"loss.depth_weight={loss.depth_weight}: expected >= 0 (0 turns the lidar depth loss off)",
    )
    _check(
        loss.depth_weight == 0 or data.depth_targets,
        f"loss.depth_weight={loss.depth_weight} needs lidar depth targets: set data.depth_targets: true (the "
        "dataset then projects each sample's LIDAR_TOP points into the cameras), or set loss.depth_weight: 0",
    )
    _at_least(loss, "loss", ("focal_gamma",), 0)
    _check(loss.pos_weight > 0, f"loss.pos_weight={loss.pos_weight}: expected > 0")

    _check(0 < cfg.optim.lr < math.inf, f"optim.lr={cfg.optim.lr}: expected a finite value > 0")
    _check(
        0 <= cfg.optim.weight_decay < math.inf,
        f"optim.weight_decay={cfg.optim.weight_decay}: expected a finite value >= 0",
    )
    _at_least(cfg.optim, "optim", ("grad_clip", "warmup_steps"), 0)

    _check(
        t.grad_accum >= 1 and t.batch_size >= 1 and t.max_steps >= 1,
        "train.batch_size, train.grad_accum and train.max_steps must be >= 1, got "
        f"{t.batch_size}, {t.grad_accum}, {t.max_steps}",
    )
    _check(
        0.0 < t.compile_memory_budget <= 1.0,
        f"train.compile_memory_budget={t.compile_memory_budget}: expected a fraction in (0, 1] (1 keeps what "
        "the compiler's default partition keeps)",
    )
    _at_least(t, "train", ("log_every", "eval_every", "ckpt_every", "viz_every"), 0)

    e = cfg.eval
    for threshold in (e.threshold, *e.sweep):
        _check(
            0.0 < threshold < 1.0,
            f"eval.threshold/eval.sweep: IoU thresholds must lie in (0, 1), got {threshold}",
        )
    _at_least(e, "eval", ("batch_size",), 1)
    _check(
        e.max_batches is None or e.max_batches >= 1,
        f"eval.max_batches={e.max_batches}: expected >= 1 or null",
    )
    _at_least(cfg.viz, "viz", ("num",), 0)

    d = cfg.detection
    _check(
        len(d.code_weights) == len(REGRESSION_CHANNELS),
        f"detection.code_weights: expected {len(REGRESSION_CHANNELS)} weights (offset x, offset y, z, log w, log l, "
        f"log h, sin yaw, cos yaw, vx, vy), got {len(d.code_weights)}",
    )
    _check(
        1 <= d.max_detections <= MAX_DETECTIONS,
        f"detection.max_detections={d.max_detections}: expected 1 to {MAX_DETECTIONS} (the nuScenes evaluation "
        "accepts at most 500 boxes per sample)",
    )
    _at_least(
        d,
        "detection",
        ("head_channels", "top_k", "roi_size", "refine_hidden", "refine_proposals", "max_objects"),
        1,
    )
    _at_least(d, "detection", ("min_radius",), 0)
    _check(
        d.heatmap_class_weights is None
        or (
            len(d.heatmap_class_weights) == len(DETECTION_CLASSES)
            and all(0 <= w < math.inf for w in d.heatmap_class_weights)
        ),
        f"detection.heatmap_class_weights={d.heatmap_class_weights}: expected null or "
        f"{len(DETECTION_CLASSES)} finite weights >= 0, one per class of {list(DETECTION_CLASSES)}",
    )
    _check(
        0 < d.gaussian_overlap < 1,
        f"detection.gaussian_overlap={d.gaussian_overlap}: expected a fraction in (0, 1)",
    )
    _check(
        d.match_distance > 0 and d.roi_enlarge > 0,
        "detection: match_distance and roi_enlarge must be "
        f"positive; got {d.match_distance}, {d.roi_enlarge}",
    )
    check_config_memory(cfg)  # last: it reads the sizes checked above
    return cfg


def load_config(
    path: Optional[Union[str, Path]] = None, overrides: typing.Sequence[str] = ()
) -> Config:
    """Defaults, then the YAML file at `path`, then `overrides` ("section.key=value", value parsed as YAML)."""
    cfg = Config()
    if path is not None:
        values = read_yaml_file(path)
        try:
            _merge(cfg, values, "")
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
    for item in overrides:
        nested = parse_override(item)
        try:
            _merge(cfg, nested, "")
        except ConfigError as e:
            raise ConfigError(f"--set {item}: {e}") from None
    return validate(cfg)


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
    return validate(_merge(Config(), values, "config"))


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def save_config(cfg: Config, path: Union[str, Path]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(dump_config(cfg))
    tmp.replace(path)
