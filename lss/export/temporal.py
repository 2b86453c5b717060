"""A two-frame LiftSplatShoot (model.temporal.frames: 2) for export, with rig inputs: the previous
frame's camera features are graph inputs and this frame's are outputs, so that a runtime feeds each
frame's features to the next frame (the streaming of lss.engine.streaming)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from lss.export.graph import DeployModel, head_outputs
from lss.geometry import RIG_KEYS
from lss.geometry.ego_motion import PREVIOUS_RIG_KEYS, previous_cam_to_ego

INPUT_NAMES = ("images", *RIG_KEYS, "prev_depth", "prev_context", *PREVIOUS_RIG_KEYS, "ego_motion")
OUTPUT_NAMES = ("segmentation", "camera_depth", "camera_context")


def output_names(model: nn.Module) -> tuple:
    """The export's outputs for `model`: OUTPUT_NAMES, with the detection head's maps
    (DETECTION_OUTPUTS) after the segmentation where the model has the head."""
    return (*head_outputs(model), *OUTPUT_NAMES[1:])


class TemporalDeployModel(nn.Module):
    """forward(images B x N x 3 x H x W, the RIG_KEYS B x N x ..., prev_depth B x N x D x fH x fW,
    prev_context B x N x C x fH x fW, the previous frame's rig (PREVIOUS_RIG_KEYS), ego_motion
    B x 4 x 4) -> (segmentation logits B x K x nx x ny[, det_heatmap, det_regression: with the
    detection head], camera_depth, camera_context: this frame's features, the next frame's
    prev_depth / prev_context; output_names). Both frames' tables are computed in the
    graph (DeployModel's "rig_inputs" splat); resize_mode and upsample_mode as DeployModel's."""

    def __init__(self, model: nn.Module, resize_mode=None, upsample_mode="pytorch_half_pixel"):
        super().__init__()
        if getattr(model, "temporal", None) is None:
            raise ValueError(
                "TemporalDeployModel: the model has no temporal fusion (model.temporal.frames: 1); "
                "export it with DeployModel"
            )
        self.frame = DeployModel(model, "rig_inputs", None, resize_mode, upsample_mode)
        self.temporal = copy.deepcopy(model.temporal).cpu().eval()

    def forward(self, images: torch.Tensor, *inputs: torch.Tensor) -> tuple:
        rig, (prev_depth, prev_context), previous = inputs[:5], inputs[5:7], inputs[7:12]
        ego_motion = inputs[12]
        B, N = images.shape[0], images.shape[1]
        depth, context = self.frame.camera(images.flatten(0, 1))
        current = self.frame.splat(depth, context, B, N, rig)
        intrinsics, rot, trans, post_rot, post_trans = previous
        rot, trans = previous_cam_to_ego(ego_motion, rot, trans)
        moved = (intrinsics, rot, trans, post_rot, post_trans)
        before = self.frame.splat(prev_depth.flatten(0, 1), prev_context.flatten(0, 1), B, N, moved)
        heads = self.frame.heads(self.temporal(current, before))
        return (
            *(heads if isinstance(heads, tuple) else (heads,)),
            depth.unflatten(0, (B, N)),
            context.unflatten(0, (B, N)),
        )
