"""The segmentation classes data.classes may name: object classes, drawn from the annotated boxes,
and map layers, drawn from the nuScenes map expansion."""

from __future__ import annotations

from typing import Sequence

from lss.geometry.boxes import DETECTION_CLASSES
from lss.errors import ConfigError

# Segmentation object classes: nuScenes category-name prefixes (LSS: all vehicles; all pedestrians).
OBJECT_CLASSES = {"vehicle": "vehicle.", "pedestrian": "human.pedestrian."}
MAP_POLYGON_LAYERS = (
    "drivable_area",
    "road_segment",
    "road_block",
    "lane",
    "ped_crossing",
    "walkway",
    "stop_line",
    "carpark_area",
)
MAP_LINE_LAYERS = ("road_divider", "lane_divider")


def class_kinds(classes: Sequence[str]) -> list[str]:
    """'object' or 'map' per configured class; unknown names are an error listing the allowed
    ones."""
    kinds = []
    for name in classes:
        if name in OBJECT_CLASSES or (name in DETECTION_CLASSES and name != "pedestrian"):
            kinds.append("object")
        elif name in MAP_POLYGON_LAYERS or name in MAP_LINE_LAYERS:
            kinds.append("map")
        else:
            allowed = list(OBJECT_CLASSES) + [c for c in DETECTION_CLASSES if c != "pedestrian"]
            raise ConfigError(
                f"data.classes: unknown class {name!r}. Object classes: {', '.join(allowed)}; map "
                f"classes: {', '.join(MAP_POLYGON_LAYERS + MAP_LINE_LAYERS)}"
            )
    return kinds


def category_matches(class_name: str, category: str) -> bool:
    """Whether an annotation of nuScenes `category` belongs to the object class `class_name`."""
    # imported here: only an index build needs the devkit, which is slow to import (index_cache)
    from nuscenes.eval.detection.utils import category_to_detection_name

    if class_name in OBJECT_CLASSES:
        return category.startswith(OBJECT_CLASSES[class_name])
    return category_to_detection_name(category) == class_name
