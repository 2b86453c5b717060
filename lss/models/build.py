"""The model of a config, and the memory layout of its convolutions (train.channels_last)."""

from __future__ import annotations

from typing import Callable, Union

import torch
from torch import nn

from lss.config import Config, ConfigError
from lss.models.lss import LiftSplatShoot

ModelFn = Callable[[Config], nn.Module]


def build_model(cfg: Config) -> nn.Module:
    return LiftSplatShoot(cfg)


def apply_channels_last(model: nn.Module, setting: Union[bool, str]) -> nn.Module:
    """train.channels_last in place: True puts every convolution weight of `model` in
    torch.channels_last memory format (cuDNN then runs those convolutions channels-last),
    "camera" only the camera encoder's (`model.camera`), "bev" everything but the camera encoder
    (BEV encoder and heads), False none. Returns `model`."""
    if setting is False:
        return model
    if setting is True:
        return model.to(memory_format=torch.channels_last)
    camera = getattr(model, "camera", None)
    if not isinstance(camera, nn.Module):
        raise ConfigError(
            f"train.channels_last={setting!r} picks a part of the LSS model but "
            f"{type(model).__name__} has no camera encoder (.camera); use true or false"
        )
    parts = [camera] if setting == "camera" else [m for m in model.children() if m is not camera]
    for part in parts:
        part.to(memory_format=torch.channels_last)
    return model
