"""lss: Lift-Splat-Shoot bird's-eye-view perception with fused CUDA ops."""

__version__ = "0.1.0"
