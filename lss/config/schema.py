"""The configuration schema: one dataclass per section, its defaults the LSS paper recipe.

Enumerations are `Literal[...]`, so that loading (lss.config) refuses other values by name; ranges
and cross-field rules are checked by lss.config.validation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from lss.geometry import NUSCENES_CAMERAS


@dataclass
class SyntheticConfig:
    """The set `lss make-synthetic` writes when data.make_synthetic_if_missing generates one."""

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
    # random subset per training sample (LSS used 5 of 6); None = all
    num_train_cameras: Optional[int] = None
    final_dim: tuple[int, int] = (128, 352)  # network input height, width
    resize_lim: tuple[float, float] = (0.193, 0.225)
    bot_pct_lim: tuple[float, float] = (0.0, 0.22)
    rot_lim: tuple[float, float] = (-5.4, 5.4)  # degrees
    rand_flip: bool = True
    # BEV-space augmentation of training samples (BEVDet): the ego frame, camera extrinsics and
    # targets together
    bev_rot_lim: tuple[float, float] = (0.0, 0.0)  # degrees about z
    bev_scale_lim: tuple[float, float] = (1.0, 1.0)
    bev_flip: bool = False  # mirror ego x and ego y, each with p = 0.5
    # class-balanced sampling of the training samples (CBGS, lss.data.samplers.class_balanced_pool:
    # samples with rare detection classes drawn more often; needs the detection head)
    class_balanced: bool = False
    classes: tuple[str, ...] = ("vehicle", "pedestrian", "drivable_area", "lane_divider")
    min_visibility: int = 0  # keep boxes whose visibility token >= this (0 keeps all)
    min_lidar_pts: int = 0
    divider_width: int = 2  # lane/road dividers are drawn this many BEV cells wide
    visibility_mask: bool = False
    # derived from model.heads (the dataset yields detection targets for the detection head); a
    # config that sets it must agree
    detection_targets: Optional[bool] = None
    # per camera feature cell: depth bin of the nearest LIDAR_TOP return (docs/training.md)
    depth_targets: bool = False
    # keep camera images decoded on disk after their first decode (lss.data.decoded_cache;
    # about 1.6 MB per sample at 1600x900 -> 128x352), and with depth_targets each lidar sweep's
    # projection into each camera: later epochs skip the JPEG decode and the sweep, the batches
    # stay the same
    decoded_cache: bool = False
    # loader processes per rank; "auto": min(12, this rank's share of the CPUs - 2), at least 1
    workers: Union[int, Literal["auto"]] = 4
    # scheduling niceness added to the loader workers (0-19): a positive value lets the training
    # process, which feeds the GPU, run first whenever it and the workers want the same cores
    worker_niceness: int = 0
    image_mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    image_std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    # the camera images in a batch: "uint8" (the augmented 0-255 RGB pixels; the model normalises
    # them with image_mean / image_std on its own device, so the loader's shared memory, pinning
    # and host-to-device copy move a quarter of the bytes) or "float32" (normalised by the loader)
    image_dtype: Literal["uint8", "float32"] = "uint8"
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
class TemporalConfig:
    """Frames per sample (docs/temporal.md): 1, the sample alone; 2, also the previous sample of
    its scene, its camera features splatted into this sample's BEV grid through the ego motion and
    fused with this sample's before the BEV encoder (BEVDet4D). `gap`: with frames 2, how many key
    frames back the previous frame is (1: the sample before, 0.5 s on nuScenes; 2: the one before
    that, 1 s): a longer gap moves an object further between the two frames for the same speed. A
    scene's first samples use the scene's first sample."""

    frames: int = 1
    gap: int = 1
    # with frames 2: residual blocks run on each frame's splatted grid (the same weights for both)
    # before the two are concatenated, BEVDet4D's extra BEV encoder; 0: the grids as splatted
    frame_blocks: int = 0


@dataclass
class ModelConfig:
    # the camera trunk: EfficientNet-B0 (the LSS paper's), or torchvision's ResNet-18, cheaper per
    # image on a CPU (the CPU demo's)
    backbone: Literal["efficientnet-b0", "resnet18"] = "efficientnet-b0"
    # ImageNet weights for efficientnet-b0: "imagenet" (efficientnet-pytorch's, through torch.hub's
    # download cache), a local state-dict path, or null (random initialisation; resnet18: only null)
    pretrained: Optional[str] = None
    # the camera encoder's output stride: 16 (efficientnet-b0), 8 or 16 (resnet18: its stride-8
    # and stride-16 maps fused, or its stride-16 and stride-32 maps)
    downsample: int = 16
    # channels of the camera encoder's fused map, before its depth and context head
    camera_channels: int = 512
    context_channels: int = 64
    splat: Literal["bev_pool", "reference"] = "bev_pool"  # our op, or pure PyTorch (for comparison)
    # segmentation is required
    heads: tuple[Literal["segmentation", "detection"], ...] = ("segmentation",)
    # coordinate mode of every bilinear upsampling in the camera and BEV decoders
    # (lss.ops.upsample_bilinear): the original LSS code used align_corners; a deployment runtime
    # may need half_pixel or asymmetric
    upsample_mode: Literal["pytorch_half_pixel", "half_pixel", "align_corners", "asymmetric"] = (
        "pytorch_half_pixel"
    )
    # frustum (u, v): the feature cells' centres, "linspace": first to last pixel (original LSS), or
    # "receptive_field": where the trunk's features are centred (lss.geometry.camera.frustum)
    frustum_pixels: Literal["centres", "linspace", "receptive_field"] = "centres"
    # frustum point -> BEV cell: floor, or "trunc" toward zero (original LSS: keeps points up to a
    # cell below the grid)
    splat_binning: Literal["floor", "trunc"] = "floor"
    # the BEV ResNet-18's last BatchNorm of every residual branch starts at 0 (original LSS: true)
    bev_zero_init_residual: bool = False
    # the BEV decoder's last upsampling also reads the splatted grid at full resolution (a skip
    # around the ResNet-18 trunk: one- or two-cell objects such as pedestrians stay sharp)
    bev_full_res_skip: bool = False
    # the kernels of every BatchNorm2d in training: "lss": lss's own (lss.ops.batch_norm_train:
    # PyTorch's NCHW bfloat16 kernels are the slow path), "torch": PyTorch's, "auto": lss's on
    # CUDA unless train.compile (the compiler writes its own), PyTorch's on the CPU (lss's CPU
    # kernels are the exact reference, not faster); the weights, statistics and evaluation are the
    # same either way
    batch_norm: Literal["auto", "torch", "lss"] = "auto"
    # the kernels of the EfficientNet trunk's depthwise convolutions, the same choices: "lss":
    # lss.ops.depthwise_conv2d (NCHW, the "same" padding inside the kernel instead of a padded copy
    # of the input), "torch": PyTorch's after the padded copy; the weights are the same either way
    depthwise_conv: Literal["auto", "torch", "lss"] = "auto"
    temporal: TemporalConfig = field(default_factory=TemporalConfig)


@dataclass
class LossConfig:
    # our sigmoid focal loss op, or the LSS paper's BCE with pos_weight
    type: Literal["focal", "bce"] = "focal"
    focal_alpha: float = 0.25
    focal_gamma: float = 2.0
    pos_weight: float = 2.13  # BCE weight of the positive cells, every class
    # BCE: one pos_weight per class (replaces pos_weight)
    class_pos_weights: Optional[tuple[float, ...]] = None
    class_weights: Optional[tuple[float, ...]] = None
    # one weight per class (0 = off) of a soft-IoU term, 1 - sum(p t) / sum(p + t - p t) over the
    # batch's cells, added to the per-pixel loss: it rewards the overlap the IoU metric counts
    soft_iou_weights: Optional[tuple[float, ...]] = None
    # lidar depth cross-entropy on the camera depth distribution; needs data.depth_targets
    depth_weight: float = 0.0


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
    # channels_last memory format for the convolutions: true (whole model), "camera" (camera
    # encoder), "bev" (BEV encoder and heads) or false; step time and first-step cost of each:
    # docs/benchmarks.md#training-step
    channels_last: Union[bool, Literal["camera", "bev"]] = False
    # torch.compile; compile_mode "reduce-overhead" replays CUDA graphs per module
    compile: bool = False
    compile_mode: Literal[
        "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"
    ] = "default"
    # "background": uncompiled steps until a child process has compiled the model; "auto": that on
    # one CUDA process
    compile_start: Literal["auto", "now", "background"] = "auto"
    # with compile: < 1 recomputes activations in the backward (less memory)
    compile_memory_budget: float = 1.0
    # the whole step as one CUDA graph: true (an error where it cannot be), "auto" (where it can,
    # else eager) or false
    cuda_graph: Union[bool, Literal["auto"]] = False
    # eager steps on one CUDA process replay the camera trunk and the BEV encoder as CUDA graphs
    # (not under torchrun, whose captured DDP step is the fast one; docs/training.md)
    eager_encoder_graphs: bool = True
    seed: int = 0
    deterministic: bool = False
    # cuDNN autotuning: tries the convolution algorithms of every new shape (a slower first step for
    # the same captured step time, docs/training.md); false: cuDNN's heuristics pick them
    cudnn_benchmark: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"
    out_dir: str = "runs/lss"
    log_every: int = 10
    eval_every: int = 1000
    ckpt_every: int = 1000
    viz_every: int = 1000
    # [first step, steps]: torch.profiler over these steps of the real loop (loader, step, hooks),
    # written to <run>/profile/ (docs/training.md#profiling-a-run); null: off
    profile_steps: Optional[tuple[int, int]] = None


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
    # the prediction panel: probabilities as opacity, or the cells above eval.threshold (what the
    # IoU counts)
    mode: Literal["probability", "threshold"] = "probability"


@dataclass
class DetectionConfig:
    """3D box head on the BEV features (active when "detection" is in model.heads); see
    docs/detection.md."""

    head_channels: int = 64
    # heatmap radius: the centre shift that keeps this box IoU (CenterNet rule)
    gaussian_overlap: float = 0.1
    min_radius: int = 2  # heatmap cells
    # heatmap focal loss (our sigmoid_focal_loss op); negative: no alpha (CornerNet)
    focal_alpha: float = -1.0
    focal_gamma: float = 2.0
    heatmap_weight: float = 1.0
    # one weight per detection class scaling that class's heatmap loss (e.g. more for rare classes);
    # null: all 1
    heatmap_class_weights: Optional[tuple[float, ...]] = None
    regression_weight: float = 0.25
    # per channel: offset x, y, z, log w, l, h, sin, cos yaw, vx, vy
    code_weights: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.2, 0.2)
    top_k: int = 500  # heatmap peaks per sample before NMS
    score_threshold: float = 0.05
    nms_iou: float = 0.2  # on the boxes' axis-aligned BEV envelopes, per class; <= 0 disables NMS
    max_detections: int = 300  # per sample (the nuScenes evaluation accepts at most 500)
    max_objects: int = 256  # per training sample: the fixed size of the dataset's padded targets
    # second stage: RoIAlign reads the BEV features of each first-stage box, an MLP refines its
    # score and box (docs/detection.md#second-stage-roialign-refinement)
    refine: bool = False
    refine_proposals: int = 128  # first-stage boxes refined per sample while training
    refine_gt_proposals: bool = True  # add jittered ground-truth boxes as proposals while training
    # what RoIAlign reads: the box centre and its four face middles (CenterPoint), or the whole
    # axis-aligned envelope at roi_size x roi_size
    refine_features: Literal["points", "envelope"] = "points"
    # the second stage also reads each camera's depth distribution at the pixel its box's centre
    # projects to (lss.models.heads.camera_cues): where along the ray the camera puts a surface
    refine_depth: bool = False
    # the second stage also reads the cameras' context features (what the splat lifts) where the
    # box's centre and four face middles project: the object as the cameras see it, not blurred
    # along the rays
    refine_image: bool = False
    # with model.temporal.frames: 2, the second stage also reads the previous frame's depth
    # distributions where each box's centre projects into the previous frame's cameras (moved by
    # the ego motion): a vehicle that moved along the camera ray, which the splat blurs, shows as a
    # surface nearer or farther than the box (lss.models.heads.camera_cues)
    refine_motion: bool = False
    # with model.temporal.frames: 2, the second stage also reads both frames' splatted grids at the
    # box's centre and face middles: this frame's there, the previous frame's where those points
    # were one frame interval before if the box moved at its velocity, and where they were if it
    # moved the other way (lss.models.heads.box_refiner.motion_reads): which way it moves,
    # whichever way its heading points
    refine_motion_grid: bool = False
    # the second stage also predicts whether each proposal faces the wrong way (heading more than
    # 90 degrees off); a proposal it calls reversed is turned around (heading + 180 degrees,
    # velocity negated: the head's velocity follows its heading) before the residuals apply
    refine_reversal: bool = False
    # the share of the jittered ground-truth proposals turned around while training with it, so
    # that the reversal logit sees wrong-way boxes from the first step
    refine_reversal_share: float = 0.25
    # final score = first stage^(1 - alpha) x second stage^alpha
    refine_score_alpha: float = 0.5
    # which parts of the second stage's box residuals the final boxes take (any of centre, size,
    # yaw, velocity; the others stay the first stage's); the score is refined either way
    refine_residuals: tuple[str, ...] = ("centre", "size", "yaw", "velocity")
    roi_size: int = 7  # envelope only
    roi_enlarge: float = 1.5  # envelope scale, for context around the box
    refine_hidden: int = 256
    refine_weight: float = 1.0
    match_distance: float = 2.0  # metres between centres: a proposal's positive ground truth
    # the second stage's score target from the distance d of a proposal's centre to its nearest
    # same-class ground truth: "distance", max(0, 1 - d / match_distance); "thresholds", the share
    # of the nuScenes matching distances (0.5, 1, 2, 4 m) within which it would be a true positive
    refine_quality: Literal["distance", "thresholds"] = "distance"
    # the evaluation's attribute of a box (moving / parked, standing, with / without rider): moving
    # above this predicted speed, m/s (the devkit's baselines: 0.2)
    moving_speed: float = 0.2
    # where the head reads the BEV features (a model with both heads): "shared", the segmentation
    # head's; "own", its own copy of the BEV decoder's last stage on the same stride-2 features
    # (and grid skip), so that the detection losses do not train the last stage that the map
    # classes read
    decoder: Literal["shared", "own"] = "shared"
    # with decoder "own": that stage's width (null: the BEV encoder's 128); a narrower stage costs
    # less GPU time per step
    decoder_channels: Optional[int] = None
    # the detection losses' gradient into the BEV encoder is multiplied by this (1: as is; 0: the
    # encoder learns from segmentation alone); the forward is unchanged
    trunk_grad_scale: float = 1.0


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
