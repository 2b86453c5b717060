"""nuScenes data pipeline: dataset, augmentation, BEV targets, batching."""

from lss.geometry.boxes import DETECTION_CLASSES
from lss.data.classes import MAP_LINE_LAYERS, MAP_POLYGON_LAYERS, OBJECT_CLASSES
from lss.data.loader import collate
from lss.data.nuscenes import DatasetNotFoundError, MapNotFoundError, NuScenesBEV, locate_dataroot

__all__ = [
    "NuScenesBEV",
    "collate",
    "DETECTION_CLASSES",
    "OBJECT_CLASSES",
    "MAP_POLYGON_LAYERS",
    "MAP_LINE_LAYERS",
    "DatasetNotFoundError",
    "MapNotFoundError",
    "locate_dataroot",
]
