"""The LSS network: camera encoder (lift) -> splat -> BEV encoder (shoot)."""

from lss.models.lss import LiftSplatShoot

__all__ = ["LiftSplatShoot"]
