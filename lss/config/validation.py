"""Load-time checks of a merged config: value ranges and the rules that tie keys together.

One `validate` holds every such rule, so that a bad value is refused with its key when the config
loads (lss.config runs it), not where the value is used.
"""

from __future__ import annotations

import math
import typing
from typing import Any

from lss.geometry.boxes import DETECTION_CLASSES, REGRESSION_CHANNELS, RESIDUAL_PARTS
from lss.config.schema import Config
from lss.errors import ConfigError
from lss.geometry import NUSCENES_CAMERAS, BevGrid, depth_bin_count
from lss.config.memory import check_config_memory

MAX_VISIBILITY = 4  # nuScenes visibility tokens: 1 (0-40 % visible) to 4 (80-100 %)
# the camera trunk's deepest reduction: the input height and width must divide by it
CAMERA_STRIDE = 32
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
    """Check ranges and cross-field rules of a merged config (enumerations are checked as it
    merges); returns it.

    Raises ConfigError naming the key, its value and what is allowed. Rules that need the device or
    the dataset on disk (a CUDA GPU, class names of the nuScenes vocabulary, split sizes) are
    checked where those are known.
    """

    data, grid, model, loss, t = cfg.data, cfg.grid, cfg.model, cfg.loss, cfg.train
    _check(
        len(data.cameras) > 0 and len(set(data.cameras)) == len(data.cameras),
        f"data.cameras must be distinct names from {list(NUSCENES_CAMERAS)}, got "
        f"{list(data.cameras)}",
    )
    _check(
        data.num_train_cameras is None or 1 <= data.num_train_cameras <= len(data.cameras),
        f"data.num_train_cameras must be in [1, {len(data.cameras)}] (the number of data.cameras) "
        f"or null, got {data.num_train_cameras}",
    )
    height, width = data.final_dim
    _check(
        height > 0 and width > 0 and height % CAMERA_STRIDE == 0 and width % CAMERA_STRIDE == 0,
        f"data.final_dim={list(data.final_dim)}: height and width must be multiples of "
        f"{CAMERA_STRIDE} and > 0, e.g. [128, 352] or [64, 192]",
    )
    _check(
        0 < data.resize_lim[0] <= data.resize_lim[1],
        f"data.resize_lim={list(data.resize_lim)}: expected [min, max] with 0 < min <= max",
    )
    _check(
        0.0 <= data.bot_pct_lim[0] <= data.bot_pct_lim[1] < 1.0,
        f"data.bot_pct_lim={list(data.bot_pct_lim)}: expected [min, max] with 0 <= min <= max < 1 "
        "(fractions of the resized image height below the crop)",
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
        f"data.bev_scale_lim={list(data.bev_scale_lim)}: expected [min, max] "
        "with 0 < min <= max (1.0: no scaling)",
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
        f"data.min_visibility={data.min_visibility}: expected 0 to {MAX_VISIBILITY} (the nuScenes "
        "visibility levels; 0 keeps every box)",
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
        f"data.synthetic.image_size={list(data.synthetic.image_size)}: expected at least [32, 18] "
        "(nuScenes is [1600, 900])",
    )

    try:
        bev = BevGrid.from_config(grid)
        depth_bin_count(grid.dbound)
    except ValueError as e:
        raise ConfigError(f"grid.{str(e).removeprefix('BevGrid: ')}") from None
    _check(
        bev.nx % BEV_STRIDE == 0 and bev.ny % BEV_STRIDE == 0,
        f"grid: the BEV grid is {bev.nx} x {bev.ny} cells; both must be multiples of {BEV_STRIDE} "
        "(adjust grid.xbound/ybound)",
    )

    strides = (8, 16) if model.backbone == "resnet18" else (16,)
    _check(
        model.downsample in strides,
        f"model.downsample={model.downsample}: the {model.backbone} camera encoder outputs stride "
        + " or ".join(map(str, strides)),
    )
    _check(
        model.backbone != "resnet18" or model.pretrained is None,
        f"model.pretrained={model.pretrained!r}: ImageNet weights are loaded for efficientnet-b0 "
        "only; set model.pretrained: null with model.backbone: resnet18",
    )
    _check(
        "segmentation" in model.heads,
        f"model.heads={list(model.heads)}: the segmentation head is required "
        "(evaluation and checkpoint selection use its IoU)",
    )
    _at_least(model, "model", ("context_channels", "camera_channels"), 1)
    _check(
        model.temporal.frames in (1, 2),
        f"model.temporal.frames={model.temporal.frames}: expected 1 (this sample only) or 2 (also "
        "the previous sample of its scene, docs/temporal.md); longer histories are not supported",
    )
    _check(
        isinstance(model.temporal.gap, int) and model.temporal.gap >= 1,
        f"model.temporal.gap={model.temporal.gap}: expected a whole number of key frames >= 1 (1: "
        "the previous sample, 2: the one before it)",
    )
    _check(
        isinstance(model.temporal.frame_blocks, int) and model.temporal.frame_blocks >= 0,
        f"model.temporal.frame_blocks={model.temporal.frame_blocks}: expected a whole number of "
        "residual blocks >= 0 (0: the splatted grids are concatenated as they are)",
    )
    # settings of the previous frame: other than their default only with frames 2
    for key, default, why in (
        ("gap", 1, "a one-frame model reads no previous frame"),
        ("frame_blocks", 0, "the blocks run on each frame's grid before the fusion"),
    ):
        value = getattr(model.temporal, key)
        _check(
            value == default or model.temporal.frames == 2,
            f"model.temporal.{key}={value} needs model.temporal.frames: 2 ({why}); set frames: 2 "
            f"or remove {key}",
        )
    detecting = "detection" in model.heads
    _check(
        data.detection_targets in (None, detecting),
        f"data.detection_targets={data.detection_targets} contradicts model.heads="
        f"{list(model.heads)}: the dataset yields the detection head's fixed-shape targets exactly "
        "when model.heads has detection; remove data.detection_targets (it follows from "
        "model.heads)",
    )
    data.detection_targets = detecting
    _check(
        detecting or not data.class_balanced,
        "data.class_balanced: true balances the training samples by their detection classes, which "
        f"only a model with the detection head reads (model.heads={list(model.heads)}); add "
        "detection to model.heads or set data.class_balanced: false",
    )

    for key in ("class_weights", "class_pos_weights", "soft_iou_weights"):
        values = getattr(loss, key)
        if values is None:
            continue
        optional = key == "soft_iou_weights"  # a weight of 0 leaves that class's term out
        _check(
            len(values) == len(data.classes),
            f"loss.{key} has {len(values)} values but data.classes has {len(data.classes)} "
            f"({list(data.classes)}): give one value per class, in the same order"
            + (" (0 leaves a class out)" if optional else ""),
        )
        if optional:
            _check(
                all(0 <= v < math.inf for v in values),
                f"loss.{key}={list(values)}: expected finite values >= 0",
            )
        else:
            _check(all(v > 0 for v in values), f"loss.{key}={list(values)}: expected values > 0")
    _check(
        loss.class_pos_weights is None or loss.type == "bce",
        f"loss.class_pos_weights is set but loss.type={loss.type!r}: it weighs the positives of "
        "the BCE loss; set loss.type: bce or remove loss.class_pos_weights",
    )
    _check(
        loss.depth_weight >= 0,
        f"loss.depth_weight={loss.depth_weight}: expected >= 0 (0 turns the lidar depth loss off)",
    )
    _check(
        loss.depth_weight == 0 or data.depth_targets,
        f"loss.depth_weight={loss.depth_weight} needs lidar depth targets: set data.depth_targets: "
        "true (the dataset then projects each sample's LIDAR_TOP points into the cameras), or "
        "set loss.depth_weight: 0",
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
        f"train.compile_memory_budget={t.compile_memory_budget}: expected a fraction "
        "in (0, 1] (1 keeps what the compiler's default partition keeps)",
    )
    _at_least(t, "train", ("log_every", "eval_every", "ckpt_every", "viz_every"), 0)
    if t.profile_steps is not None:
        first, count = (list(t.profile_steps) + [0, 0])[:2]
        _check(
            len(t.profile_steps) == 2 and first >= 2 and count >= 1,
            f"train.profile_steps={list(t.profile_steps)}: expected [first step, steps] with the "
            "first step >= 2 (step 1 builds and captures the step) and at least 1 step",
        )
        _check(
            first + count - 1 <= t.max_steps,
            f"train.profile_steps={list(t.profile_steps)} ends at step {first + count - 1}, after "
            f"train.max_steps={t.max_steps}; profile earlier steps or train longer",
        )

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
        f"detection.code_weights: expected {len(REGRESSION_CHANNELS)} weights (offset x, offset y, "
        f"z, log w, log l, log h, sin yaw, cos yaw, vx, vy), got {len(d.code_weights)}",
    )
    _check(
        1 <= d.max_detections <= MAX_DETECTIONS,
        f"detection.max_detections={d.max_detections}: expected 1 to {MAX_DETECTIONS} (the "
        "nuScenes evaluation accepts at most 500 boxes per sample)",
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
        math.isfinite(d.moving_speed) and d.moving_speed >= 0,
        f"detection.moving_speed={d.moving_speed}: expected a speed in m/s >= 0 (above it a box "
        "is called moving; the devkit's baselines use 0.2)",
    )
    _check(
        0 <= d.refine_score_alpha <= 1,
        f"detection.refine_score_alpha={d.refine_score_alpha}: expected a weight in [0, 1] "
        "(0: the first stage's score, 1: the second stage's)",
    )
    _check(
        d.decoder_channels is None or (d.decoder == "own" and d.decoder_channels >= 1),
        f"detection.decoder_channels={d.decoder_channels}: the width of the detection head's own "
        "decoder stage, a count >= 1 with detection.decoder: own (null: the BEV encoder's width)",
    )
    for setting in (
        "refine_depth",
        "refine_image",
        "refine_motion",
        "refine_motion_grid",
        "refine_reversal",
    ):
        _check(
            d.refine or not getattr(d, setting),
            f"detection.{setting}: true feeds the second stage, which is off; set "
            f"detection.refine: true as well, or {setting}: false",
        )
    _check(
        0 <= d.refine_reversal_share < 1,
        f"detection.refine_reversal_share={d.refine_reversal_share}: expected the share of the "
        "jittered ground-truth proposals turned around, in [0, 1)",
    )
    _check(
        not d.refine_motion or model.temporal.frames == 2,
        "detection.refine_motion: true reads the previous frame's depth distributions; set "
        "model.temporal.frames: 2 as well, or refine_motion: false",
    )
    _check(
        not d.refine_motion_grid or model.temporal.frames == 2,
        "detection.refine_motion_grid: true reads the previous frame's splatted grid; set "
        "model.temporal.frames: 2 as well, or refine_motion_grid: false",
    )
    _check(
        set(d.refine_residuals) <= set(RESIDUAL_PARTS)
        and len(set(d.refine_residuals)) == len(d.refine_residuals),
        f"detection.refine_residuals={list(d.refine_residuals)}: expected distinct names from "
        f"{list(RESIDUAL_PARTS)} (the parts of the refined box the second stage moves; [] keeps "
        "the first stage's boxes and refines the score alone)",
    )
    _check(
        d.match_distance > 0 and d.roi_enlarge > 0,
        "detection: match_distance and roi_enlarge must be "
        f"positive; got {d.match_distance}, {d.roi_enlarge}",
    )
    _check(
        math.isfinite(d.trunk_grad_scale) and d.trunk_grad_scale >= 0,
        f"detection.trunk_grad_scale={d.trunk_grad_scale}: expected a finite factor >= 0 (1: the "
        "detection losses train the BEV encoder as they are, 0: not at all)",
    )
    check_config_memory(cfg)  # last: it reads the sizes checked above
    return cfg
