"""lss: Lift-Splat-Shoot bird's-eye-view perception with fused CUDA ops.

`lss.Predictor` (lss.engine.predictor) turns a checkpoint and camera images into BEV maps; it is
imported on first use, so that `import lss` stays cheap."""

__version__ = "0.1.0"

_LAZY = {"Predictor": "lss.engine.predictor", "Prediction": "lss.engine.predictor"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lss' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
