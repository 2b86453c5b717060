"""The training loss of the network: the sum of the losses of the heads it has, each beside its
head (segmentation: lss.models.heads.segmentation, detection: lss.models.heads.detection_loss,
lidar depth of the camera encoder: lss.models.depth_loss)."""

from __future__ import annotations

from torch import nn

from lss.config import Config
from lss.models.depth_loss import DepthLoss
from lss.models.heads.detection_loss import DetectionLoss
from lss.models.heads.segmentation import SegmentationLoss


def head_losses(config: Config) -> dict[str, nn.Module]:
    """The loss of every head present, by name: "segmentation" and "detection" as in model.heads,
    "depth" with data.depth_targets. Each maps (outputs, batch) to a dict whose "loss" (absent when
    the head only logs) is its weighted term of the total and whose other entries are detached
    values to log."""
    losses = {}
    if "segmentation" in config.model.heads:
        losses["segmentation"] = SegmentationLoss(config)
    if "detection" in config.model.heads:
        losses["detection"] = DetectionLoss(config)
    if config.data.depth_targets:
        losses["depth"] = DepthLoss(config)
    return losses


class TotalLoss(nn.Module):
    """forward(outputs, batch) -> {"loss": the sum of the heads' terms, and each head's logged
    values (detached)}: per class "loss/<class>", the detection terms "loss/det_*", the lidar depth
    cross-entropy "depth_loss" (logged also with loss.depth_weight 0); with more than one head also
    each head's term as "loss/<head>"."""

    def __init__(self, config: Config):
        super().__init__()
        self.heads = nn.ModuleDict(head_losses(config))

    def forward(self, outputs: dict, batch: dict) -> dict:
        total, out = None, {}
        for name, head in self.heads.items():
            part = dict(head(outputs, batch))
            loss = part.pop("loss", None)
            if loss is not None:
                total = loss if total is None else total + loss
                if len(self.heads) > 1:
                    out[f"loss/{name}"] = loss.detach()
            out.update(part)
        if total is None:
            raise ValueError(
                f"no head contributes to the loss (model.heads={list(self.heads)}); add the "
                "segmentation or detection head to model.heads"
            )
        return {"loss": total, **out}
