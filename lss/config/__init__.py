"""Typed configuration: the schema (dataclasses, lss.config.schema), reading YAML and `--set` pairs
(io), the load-time checks (validation), the memory a config needs (memory) and loading itself
(load)."""

from lss.config.load import config_from_dict, config_to_dict, dump_config, load_config, save_config
from lss.config.schema import (
    Config,
    DataConfig,
    DetectionConfig,
    EvalConfig,
    GridConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    SyntheticConfig,
    TemporalConfig,
    TrainConfig,
    VizConfig,
)
from lss.config.validation import validate
from lss.errors import ConfigError
from lss.geometry import NUSCENES_CAMERAS
from lss.geometry.boxes import DETECTION_CLASSES

__all__ = [
    "DETECTION_CLASSES",
    "NUSCENES_CAMERAS",
    "Config",
    "ConfigError",
    "DataConfig",
    "DetectionConfig",
    "EvalConfig",
    "GridConfig",
    "LossConfig",
    "ModelConfig",
    "OptimConfig",
    "SyntheticConfig",
    "TemporalConfig",
    "TrainConfig",
    "VizConfig",
    "config_from_dict",
    "config_to_dict",
    "dump_config",
    "load_config",
    "save_config",
    "validate",
]
