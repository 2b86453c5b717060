"""The LSS network: camera encoder (lift) -> splat -> BEV encoder (shoot), and its builder."""

from lss.models.build import ModelFn, apply_channels_last, build_model
from lss.models.lss import LiftSplatShoot

__all__ = ["LiftSplatShoot", "ModelFn", "apply_channels_last", "build_model"]
