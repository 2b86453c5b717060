"""Pictures of predictions (docs/viz.md): the six cameras on top, below them the prediction and the
ground truth as BEV panels of one size (every class in its colour, the ego car, forward up, a 10 m
scale bar) and a legend. `lss viz` writes one PNG per sample (and a GIF per scene); training writes
the same picture to tensorboard."""

from lss.viz.bev import BevView, bev_panel, class_colors, layer_opacity
from lss.viz.cameras import BACK_ROW, FRONT_ROW, camera_mosaic, denormalize
from lss.viz.figure import Figure, compose_figure
from lss.viz.render import render_batch, render_checkpoint, render_sample

__all__ = [
    "BACK_ROW",
    "FRONT_ROW",
    "BevView",
    "Figure",
    "bev_panel",
    "camera_mosaic",
    "class_colors",
    "compose_figure",
    "denormalize",
    "layer_opacity",
    "render_batch",
    "render_checkpoint",
    "render_sample",
]
