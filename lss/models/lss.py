"""LiftSplatShoot: camera images -> depth-weighted frustum features -> BEV grid -> the heads."""

from __future__ import annotations

import torch
from torch import nn

from lss.config import Config
from lss.geometry import RIG_KEYS, BevGrid
from lss.geometry.ego_motion import KEY_FRAME_INTERVAL, PREVIOUS_FRAME_KEYS, previous_rig
from lss.models.bev import BevEncoder
from lss.models.blocks import scale_gradient
from lss.models.camera import CameraEncoder, use_lss_depthwise_conv
from lss.models.heads import DetectionHead, SegmentationHead
from lss.models.heads.detection import batch_ground_truth
from lss.models.splat import Splat
from lss.models.temporal import TemporalFusion
from lss.ops.batch_norm import use_lss_batch_norm


class LiftSplatShoot(nn.Module):
    """forward(batch) -> {"segmentation": B x K x nx x ny logits, "depth_logits":
    B x N x D x fH x fW (the camera depth distribution before its softmax, for lidar depth
    supervision)},
    K = len(config.data.classes); with "detection" in model.heads also the DetectionHead outputs
    ("det_heatmap", "det_regression", ...; lss.models.heads.detection).

    batch holds "images" B x N x 3 x H x W and the rig (lss.geometry.RIG_KEYS): "intrinsics",
    "sensor2ego_rot", "post_rot" (B x N x 3 x 3), "sensor2ego_trans", "post_trans" (B x N x 3), as
    produced by lss.data.collate. Its ground-truth boxes, when present, go to the detection head
    as they are (its second stage adds jittered copies as proposals while training,
    detection.refine_gt_proposals): the padded "det_target_boxes" / "det_target_labels" of the
    dataset's dense targets (fixed shapes, what a captured step holds), else "det_boxes" /
    "det_labels". With model.temporal.frames: 2 it also holds the previous frame's images and rig
    and the ego motion (lss.geometry.ego_motion.PREVIOUS_FRAME_KEYS): their BEV grid is fused with
    the current one before the BEV encoder (TemporalFusion).
    """

    def __init__(self, config: Config):
        super().__init__()
        model, data = config.model, config.data
        # its sizes were checked when the config loaded (lss.config.validate)
        grid = BevGrid.from_config(config.grid)
        self.classes = tuple(data.classes)
        self.grid = grid
        self.detection_grad_scale = float(config.detection.trunk_grad_scale)
        self.splat = Splat(
            grid,
            data.final_dim,
            model.downsample,
            config.grid.dbound,
            model.splat,
            model.frustum_pixels,
            model.splat_binning,
        )
        self.camera = CameraEncoder(
            self.splat.depth_bins,
            model.context_channels,
            model.backbone,
            model.pretrained,
            model.upsample_mode,
            model.downsample,
            model.camera_channels,
            config.data.image_mean,
            config.data.image_std,
        )
        self.bev = BevEncoder(
            grid.nz * model.context_channels,
            model.upsample_mode,
            model.bev_zero_init_residual,
            model.bev_full_res_skip,
        )
        self.segmentation = SegmentationHead(BevEncoder.feature_channels, len(self.classes))
        # detection.decoder: own: the detection head reads its own decoder stage, of this width
        own = config.detection.decoder == "own"
        detection_channels = BevEncoder.feature_channels
        if own and config.detection.decoder_channels:
            detection_channels = config.detection.decoder_channels
        self.detection = (
            DetectionHead(
                detection_channels,
                config.detection,
                grid,
                image_channels=model.context_channels,
                grid_channels=grid.nz * model.context_channels,
                motion_interval=KEY_FRAME_INTERVAL * model.temporal.gap,
            )
            if "detection" in model.heads
            else None
        )
        # None: a one-frame model keeps its modules and state dict as they were; built last, so
        # that the other modules start as a one-frame model of the same seed does
        self.temporal = (
            TemporalFusion(grid.nz * model.context_channels, model.temporal.frame_blocks)
            if model.temporal.frames == 2
            else None
        )
        # detection.decoder: own: the detection head's own last decoder stage (built after the
        # others, so that they start as the shared model's of the same seed do)
        self.detection_decoder = (
            BevEncoder.last_stage(
                grid.nz * model.context_channels,
                model.upsample_mode,
                model.bev_full_res_skip,
                detection_channels,
            )
            if self.detection is not None and own
            else None
        )
        # the same modules and state dict through lss's kernels ("auto": on CUDA only, and not
        # under train.compile, whose compiler writes its own)
        for setting, use in (
            (model.batch_norm, use_lss_batch_norm),
            (model.depthwise_conv, use_lss_depthwise_conv),
        ):
            if setting == "lss" or (setting == "auto" and not config.train.compile):
                use(self, on_cpu=setting == "lss")

    def forward(self, batch: dict) -> dict:
        images = batch["images"]
        if images.dim() != 5 or images.shape[2] != 3:
            raise ValueError(
                f"batch['images'] must be B x N x 3 x H x W, got {tuple(images.shape)}"
            )
        b, n = images.shape[:2]
        lut = self.splat.lut(batch)
        depth, context, depth_logits = self.camera(images.flatten(0, 1), return_logits=True)
        depth = depth.unflatten(0, (b, n))
        context = context.unflatten(0, (b, n))
        bev = self.splat(depth, context, lut)
        previous = rig = frames = None
        if self.temporal is not None:
            previous = self.previous_features(batch)
            # the previous frame's rig moved into the current ego frame, once for its LUT and the
            # second stage's motion cues (detection.refine_motion: a box of this frame projects to
            # where a static point at its centre was seen before)
            rig = previous_rig(batch, depth.device)
            frames = (bev, self.splat(*previous, self.splat.previous_lut(batch, rig)))
            bev = self.temporal(*frames)
        # detection.trunk_grad_scale: the detection branch's gradient into the shared BEV encoder
        # (and the splatted grid) scaled where the branch leaves it
        scale = self.detection_grad_scale if torch.is_grad_enabled() else 1.0
        branch = (lambda t: scale_gradient(t, scale)) if scale != 1.0 else (lambda t: t)
        if self.detection is not None:
            features, detection_features = self.bev.for_heads(bev, self.detection_decoder, branch)
        else:
            features, detection_features = self.bev(bev), None
        outputs = {
            "segmentation": self.segmentation(features),
            "depth_logits": depth_logits.unflatten(0, (b, n)),
        }
        if self.temporal is not None:  # the next frame's previous features, when streaming
            outputs["camera_depth"], outputs["camera_context"] = depth.detach(), context.detach()
        if self.detection is not None:
            gt_boxes, gt_labels = batch_ground_truth(batch)
            cameras = None
            reads = self.detection.cfg  # validated: only with detection.refine
            if reads.refine_depth or reads.refine_image or reads.refine_motion:
                cameras = {"depth": depth, "context": context, "frustum": self.splat.frustum}
                cameras.update({k: batch[k] for k in RIG_KEYS})
            if reads.refine_motion:  # validated: only with two frames
                cameras["previous"] = {"depth": previous[0], "frustum": self.splat.frustum, **rig}
            outputs.update(
                self.detection(
                    detection_features,
                    gt_boxes=gt_boxes,
                    gt_labels=gt_labels,
                    cameras=cameras,
                    frames=tuple(map(branch, frames)) if reads.refine_motion_grid else None,
                )
            )
        return outputs

    def previous_features(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous frame's camera features (depth B x N x D x fH x fW, context
        B x N x C x fH x fW), which forward splats into the current grid through their LUT
        (Splat.previous_lut): the batch's "prev_depth" and "prev_context" where given (streaming:
        the "camera_depth" and "camera_context" outputs of the frame before), else the camera
        encoder's of "prev_images", without gradients."""
        streamed = "prev_depth" in batch and "prev_context" in batch
        needed = PREVIOUS_FRAME_KEYS[1:] if streamed else PREVIOUS_FRAME_KEYS
        missing = [k for k in needed if k not in batch]
        if missing:
            raise ValueError(
                f"model.temporal.frames=2 needs the previous frame's inputs, but the batch has no "
                f"{', '.join(missing)}; the dataset yields them when the config it was built from "
                "has model.temporal.frames: 2 (lss.data.NuScenesBEV.previous_frame)"
            )
        if streamed:
            return batch["prev_depth"], batch["prev_context"]
        images = batch["prev_images"]
        if images.shape != batch["images"].shape:
            raise ValueError(
                f"batch['prev_images'] is {tuple(images.shape)} but batch['images'] "
                f"{tuple(batch['images'].shape)}: the previous frame needs the same cameras and "
                "image size"
            )
        b, n = images.shape[:2]
        with torch.no_grad():
            depth, context = self.camera(images.flatten(0, 1))
        return depth.unflatten(0, (b, n)), context.unflatten(0, (b, n))
