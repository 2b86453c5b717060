"""Config loading: YAML over dataclass defaults, --set overrides, clear errors, and the shipped configs."""
from pathlib import Path

import pytest

from lss.config import Config, ConfigError, config_to_dict, dump_config, load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def write(tmp_path, text, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_yaml_overrides_defaults_and_set_overrides_yaml(tmp_path):
    path = write(tmp_path, "train:\n  batch_size: 2\n  max_steps: 50\noptim:\n  lr: 0.01\n")
    cfg = load_config(path, ["train.max_steps=7", "grid.xbound=[-10, 10, 1]", "model.pretrained=null"])
    assert cfg.train.batch_size == 2
    assert cfg.train.max_steps == 7
    assert cfg.optim.lr == 0.01
    assert cfg.grid.xbound == (-10.0, 10.0, 1.0)
    assert cfg.model.pretrained is None
    assert cfg.data == Config().data


def test_unknown_key_names_key_file_and_allowed_keys(tmp_path):
    path = write(tmp_path, "train:\n  batch_sise: 2\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert "batch_sise" in msg and str(path) in msg and "batch_size" in msg and "max_steps" in msg


def test_unknown_section_and_unknown_set_key(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'trian'.*train"):
        load_config(write(tmp_path, "trian:\n  seed: 1\n"))
    with pytest.raises(ConfigError, match=r"--set.*unknown key 'nope'"):
        load_config(None, ["optim.nope=1"])


@pytest.mark.parametrize("text, where, expected", [
    ("train:\n  max_steps: ten\n", "train.max_steps", "integer"),
    ("train:\n  channels_last: 1\n", "train.channels_last", "true/false"),
    ("optim:\n  lr: fast\n", "optim.lr", "number"),
    ("grid:\n  xbound: [1, 2]\n", "grid.xbound", "3 values"),
    ("data:\n  classes: vehicle\n", "data.classes", "list"),
    ("train: 3\n", "train", "mapping"),
])
def test_wrong_types_name_the_key(tmp_path, text, where, expected):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert where in str(e.value) and expected in str(e.value)


def test_bad_set_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["train.max_steps"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_dump_round_trips(tmp_path):
    cfg = load_config(None, ["train.max_steps=3", "data.classes=[vehicle]"])
    again = load_config(write(tmp_path, dump_config(cfg)))
    assert config_to_dict(again) == config_to_dict(cfg)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_load_and_build_a_model(path):
    from lss.models import LiftSplatShoot

    cfg = load_config(path)
    LiftSplatShoot(cfg)  # final_dim / grid divisibility and heads are validated at construction


def test_expected_configs_are_shipped():
    names = {p.name for p in CONFIGS}
    assert {"synthetic_demo.yaml", "synthetic.yaml", "nuscenes_mini.yaml", "nuscenes_trainval.yaml"} <= names


def test_demo_config_is_embedded_identically():
    from lss.engine.demo import DEMO_CONFIG_YAML, demo_config

    assert (ROOT / "configs" / "synthetic_demo.yaml").read_text() == DEMO_CONFIG_YAML
    assert config_to_dict(demo_config()) == config_to_dict(load_config(ROOT / "configs" / "synthetic_demo.yaml"))
    assert demo_config(["train.max_steps=5"]).train.max_steps == 5
