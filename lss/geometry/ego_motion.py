"""The previous frame's rig in the current ego frame (model.temporal.frames: 2): its cameras'
extrinsics composed with the ego motion between the two samples, so that the previous frame's
frustum lands in the current BEV grid through the same LUT and bev_pool as the current frame's."""

from __future__ import annotations

import torch

from lss.geometry.camera import RIG_KEYS

# A batch's previous-frame inputs: its images and rig (camera -> its own ego frame), and the ego
# motion B x 4 x 4 taking the previous ego frame into the current (augmented) ego frame.
PREVIOUS_RIG_KEYS = tuple(f"prev_{key}" for key in RIG_KEYS)
PREVIOUS_FRAME_KEYS = ("prev_images", *PREVIOUS_RIG_KEYS, "ego_motion")
# seconds between two nuScenes key frames (2 Hz); model.temporal.gap of them lie between the frames
KEY_FRAME_INTERVAL = 0.5


def previous_cam_to_ego(
    ego_motion: torch.Tensor, sensor2ego_rot: torch.Tensor, sensor2ego_trans: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous frame's cameras -> the current ego frame: (prev ego -> current ego) @
    (camera -> prev ego).

    ego_motion B x 4 x 4, sensor2ego_rot B x N x 3 x 3, sensor2ego_trans B x N x 3. Returns
    (rotation B x N x 3 x 3, translation B x N x 3), float32 (also under autocast), in the form of
    the current frame's sensor2ego_rot / sensor2ego_trans (lss.geometry.frustum_to_ego)."""
    if ego_motion.dim() != 3 or ego_motion.shape[-2:] != (4, 4):
        raise ValueError(
            f"previous_cam_to_ego: ego_motion must be B x 4 x 4 (previous ego frame -> current ego "
            f"frame), got {tuple(ego_motion.shape)}"
        )
    B = ego_motion.shape[0]
    if sensor2ego_rot.shape[0] != B or sensor2ego_trans.shape[0] != B:
        raise ValueError(
            f"previous_cam_to_ego: ego_motion holds {B} poses but the previous rig "
            f"{tuple(sensor2ego_rot.shape)} / {tuple(sensor2ego_trans.shape)}: expected one pose "
            "per sample of the batch"
        )
    with torch.autocast(device_type=ego_motion.device.type, enabled=False):
        motion = ego_motion.float()
        rot, trans = motion[:, None, :3, :3], motion[:, None, :3, 3]
        moved_rot = rot @ sensor2ego_rot.float()
        moved_trans = (rot @ sensor2ego_trans.float().unsqueeze(-1)).squeeze(-1) + trans
        return moved_rot, moved_trans


def previous_rig(batch: dict, device: torch.device) -> dict:
    """The previous frame's rig in the current ego frame: the batch's PREVIOUS_RIG_KEYS as
    RIG_KEYS (float32 on `device`), camera -> ego replaced by previous_cam_to_ego of its
    "ego_motion". A point fixed in the world projects through it to the pixels and depth at which
    the previous frame's cameras saw it."""
    rig = {key: batch[f"prev_{key}"].to(device=device, dtype=torch.float32) for key in RIG_KEYS}
    rig["sensor2ego_rot"], rig["sensor2ego_trans"] = previous_cam_to_ego(
        batch["ego_motion"].to(device), rig["sensor2ego_rot"], rig["sensor2ego_trans"]
    )
    return rig
