"""Config loading: YAML over dataclass defaults, --set overrides, clear errors, validation at load time (enumerations,
ranges, cross-field rules), and the shipped configs."""
import dataclasses
import typing
from pathlib import Path
from typing import Literal

import pytest
import yaml

import lss.errors
from lss.config import Config, ConfigError, config_from_dict, config_to_dict, dump_config, load_config, validate
from lss.errors import DatasetError, LssError

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def write(tmp_path, text, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_yaml_overrides_defaults_and_set_overrides_yaml(tmp_path):
    path = write(tmp_path, "train:\n  batch_size: 2\n  max_steps: 50\noptim:\n  lr: 0.01\n")
    cfg = load_config(path, ["train.max_steps=7", "grid.xbound=[-8, 8, 1]", "model.pretrained=null"])
    assert cfg.train.batch_size == 2
    assert cfg.train.max_steps == 7
    assert cfg.optim.lr == 0.01
    assert cfg.grid.xbound == (-8.0, 8.0, 1.0)
    assert cfg.model.pretrained is None
    assert cfg.data == validate(Config()).data


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

    cfg = load_config(path, ["model.pretrained=null"])  # no ImageNet download (tests/test_ablation_switches.py)
    LiftSplatShoot(cfg)  # final_dim / grid divisibility and heads are validated at construction


def test_expected_configs_are_shipped():
    names = {p.name for p in CONFIGS}
    assert {"synthetic_demo.yaml", "synthetic.yaml", "synthetic_segmentation.yaml", "nuscenes_mini.yaml", "nuscenes_trainval.yaml"} <= names


def test_demo_config_is_embedded_identically():
    from lss.engine.demo import DEMO_CONFIG_YAML, demo_config

    assert (ROOT / "configs" / "synthetic_demo.yaml").read_text() == DEMO_CONFIG_YAML
    assert config_to_dict(demo_config()) == config_to_dict(load_config(ROOT / "configs" / "synthetic_demo.yaml"))
    assert demo_config(["train.max_steps=5"]).train.max_steps == 5


def test_each_demo_recipe_is_the_packaged_copy_of_its_config():
    from lss.engine.demo import CPU_RECIPE, CUDA_RECIPE, describe, recipe_config

    for recipe, name in ((CPU_RECIPE, "synthetic_demo.yaml"), (CUDA_RECIPE, "synthetic_segmentation.yaml")):
        assert recipe.config == f"configs/{name}"
        assert (ROOT / recipe.config).read_text() == recipe.yaml()
        expected = load_config(ROOT / recipe.config, recipe.overrides)
        assert config_to_dict(recipe_config(recipe)) == config_to_dict(expected)
    assert CPU_RECIPE.overrides == ()  # the CPU demo is configs/synthetic_demo.yaml as it is
    cuda = recipe_config(CUDA_RECIPE)  # the segmentation recipe on a set of 24 scenes, 4 of them for validation
    assert (cuda.data.version, cuda.data.synthetic.scenes, cuda.data.dataroot) == (
        "v1.0-trainval", 24, "data/synthetic-demo-cuda")
    assert describe(recipe_config(CUDA_RECIPE, ["train.device=cuda"])) == (
        "6 cameras at 256x704, 200 x 200 grid of 0.5 m cells, efficientnet-b0 camera trunk, 4,000 steps of batch 4 "
        "on cuda")
    assert recipe_config(CUDA_RECIPE, ["train.max_steps=7"]).train.max_steps == 7
    assert recipe_config(CPU_RECIPE).train.device == "cpu"  # the CPU recipe stays on the CPU on a CUDA machine


@pytest.mark.parametrize("device, cuda, expected", [
    ("auto", False, "cpu"), ("auto", True, "cuda"), ("cpu", True, "cpu"), ("cpu", False, "cpu"), ("cuda", True, "cuda")])
def test_the_demo_picks_its_recipe_from_the_device(device, cuda, expected):
    from lss.engine.demo import CPU_RECIPE, CUDA_RECIPE, choose_recipe

    assert choose_recipe(device, cuda) == {"cpu": CPU_RECIPE, "cuda": CUDA_RECIPE}[expected]


def test_the_demo_refuses_cuda_without_a_gpu():
    from lss.engine.demo import choose_recipe

    with pytest.raises(ConfigError, match="^lss demo --device cuda: no CUDA GPU is visible; use --device cpu$"):
        choose_recipe("cuda", False)


def literal_fields():
    """(section.key, allowed values, is a list) of every Literal-typed config field."""
    out = []
    for section in dataclasses.fields(Config):
        hints = typing.get_type_hints(type(getattr(Config(), section.name)))
        for key, tp in hints.items():
            is_list = typing.get_origin(tp) is tuple and typing.get_args(tp)[-1] is Ellipsis
            elem = typing.get_args(tp)[0] if is_list else tp
            if typing.get_origin(elem) is Literal:
                out.append((f"{section.name}.{key}", typing.get_args(elem), is_list))
    return out


LITERAL_FIELDS = literal_fields()


def test_the_enumerated_fields_are_literals():
    keys = {key for key, _, _ in LITERAL_FIELDS}
    assert {"data.cameras", "model.backbone", "model.splat", "model.heads", "loss.type", "optim.name",
            "optim.schedule", "train.amp", "train.compile_mode", "train.device"} <= keys


@pytest.mark.parametrize("key, allowed, is_list", LITERAL_FIELDS, ids=[k for k, _, _ in LITERAL_FIELDS])
def test_a_bad_enumerated_value_names_key_value_and_allowed_values(tmp_path, key, allowed, is_list):
    value = "[segmentation, bogus_value]" if key == "model.heads" else "[bogus_value]" if is_list else "bogus_value"
    section, name = key.split(".")
    yaml_file = write(tmp_path, yaml.safe_dump({section: {name: yaml.safe_load(value)}}))
    for load in (lambda: load_config(None, [f"{key}={value}"]), lambda: load_config(yaml_file)):
        with pytest.raises(ConfigError) as e:
            load()
        message = str(e.value)
        assert key in message and "bogus_value" in message
        assert all(repr(a) in message for a in allowed), message
    good = allowed[:1] if is_list else allowed[0]
    assert getattr(getattr(load_config(None, [f"{key}={list(good) if is_list else good}"]), section), name) == good


@pytest.mark.parametrize("overrides, message", [
    (["data.final_dim=[40, 96]"], r"data.final_dim=\[40, 96\]: height and width must be multiples of 32"),
    (["grid.xbound=[-5.0, 5.0, 1.0]"], "the BEV grid is 10 x 200 cells; both must be multiples of 8"),
    (["grid.xbound=[1.0, -1.0, 0.5]"], r"grid.xbound = \(1.0, -1.0, 0.5\) needs finite min < max"),
    (["grid.dbound=[45.0, 4.0, 1.0]"], r"grid.dbound = \(45.0, 4.0, 1.0\) needs min < max"),
    (["model.heads=[detection]"], "segmentation head is required"),
    (["model.downsample=8"], "model.downsample=8: the efficientnet-b0 camera encoder outputs stride 16"),
    (["loss.depth_weight=1.0"], "loss.depth_weight=1.0 needs lidar depth targets: set data.depth_targets: true"),
    (["loss.depth_weight=-1.0", "data.depth_targets=true"], "loss.depth_weight=-1.0: expected >= 0"),
    (["loss.class_weights=[1.0]"], r"loss.class_weights has 1 values but data.classes has 4"),
    (["train.grad_accum=0"], "train.batch_size, train.grad_accum and train.max_steps must be >= 1, got 4, 0"),
    (["train.compile_memory_budget=1.5"], r"train.compile_memory_budget=1.5: expected a fraction in \(0, 1\]"),
    (["model.heads=[segmentation, detection]", "data.detection_targets=false"],
     r"data.detection_targets=False contradicts model.heads=\['segmentation', 'detection'\].*remove "
     "data.detection_targets"),
    (["data.detection_targets=true"], "data.detection_targets=True contradicts model.heads"),
    (["train.cuda_graph=maybe"], "train.cuda_graph.*auto"),
    (["data.num_train_cameras=7"], r"data.num_train_cameras must be in \[1, 6\]"),
    (["data.cameras=[CAM_FRONT, CAM_FRONT]"], "data.cameras must be distinct"),
    (["data.bot_pct_lim=[0.3, 0.1]"], r"data.bot_pct_lim=\[0.3, 0.1\]: expected \[min, max\]"),
    (["data.divider_width=0"], "data.divider_width=0: expected >= 1"),
    (["optim.lr=inf"], "optim.lr=inf: expected a finite value > 0"),
    (["optim.weight_decay=-1e-4"], r"optim.weight_decay=-0.0001: expected a finite value >= 0"),
    (["data.bev_rot_lim=[10.0, -10.0]"], r"data.bev_rot_lim=\[10.0, -10.0\]: expected \[min, max\] in degrees"),
    (["data.bev_scale_lim=[0.0, 1.1]"], r"data.bev_scale_lim=\[0.0, 1.1\]: expected \[min, max\] with 0 < min"),
    (["data.bev_scale_lim=[1.1, 0.9]"], r"data.bev_scale_lim=\[1.1, 0.9\]"),
    (["eval.sweep=[0.5, 1.0]"], r"IoU thresholds must lie in \(0, 1\), got 1.0"),
    (["detection.max_detections=600"], "detection.max_detections=600: expected 1 to 500"),
    (["detection.code_weights=[1, 1, 1, 1, 1, 1, 1, 1, 1]"], "detection.code_weights: expected 10 weights"),
    (["detection.roi_size=0"], "detection.roi_size=0: expected >= 1"),
    (["detection.gaussian_overlap=1.0"], r"detection.gaussian_overlap=1.0: expected a fraction in \(0, 1\)"),
])
def test_range_and_cross_field_rules(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_cross_field_rules_see_every_source_and_the_defaults_pass(tmp_path):
    defaults = Config()
    defaults.data.detection_targets = False  # derived from model.heads by validate, the one change it makes
    assert validate(Config()) == defaults
    path = write(tmp_path, "data:\n  depth_targets: true\n")
    assert load_config(path, ["loss.depth_weight=1.0"]).loss.depth_weight == 1.0  # YAML + --set together
    with pytest.raises(ConfigError, match="needs lidar depth targets"):
        load_config(path, ["loss.depth_weight=1.0", "data.depth_targets=false"])


def test_load_config_and_config_from_dict_run_validate(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr("lss.config.load.validate", lambda cfg: seen.append(cfg) or cfg)
    loaded = load_config(write(tmp_path, "model:\n  downsample: 8\n"))
    rebuilt = config_from_dict({"model": {"downsample": 8}})
    assert seen == [loaded, rebuilt] and loaded.model.downsample == 8
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="model.downsample=8"):
        load_config(write(tmp_path, "model:\n  downsample: 8\n"))
    with pytest.raises(ConfigError, match="model.downsample=8"):
        config_from_dict({"model": {"downsample": 8}})


def test_user_error_types():
    from lss.data.nuscenes import DatasetNotFoundError
    from lss.engine.checkpoint import CheckpointError

    assert issubclass(ConfigError, LssError) and issubclass(ConfigError, ValueError)
    assert issubclass(DatasetNotFoundError, DatasetError) and issubclass(DatasetNotFoundError, FileNotFoundError)
    assert CheckpointError is lss.errors.CheckpointError and issubclass(CheckpointError, LssError)


@pytest.mark.parametrize("written, key, expected", [
    ("1e-7", "optim.weight_decay", 1e-7),
    ("1E3", "optim.grad_clip", 1000.0),
    ("inf", "optim.grad_clip", float("inf")),
    ("-2.5E-1", "detection.focal_alpha", -0.25),
    ("4e-3", "optim.lr", 4e-3),
])
def test_float_fields_read_every_python_float_literal_in_yaml_and_set(tmp_path, written, key, expected):
    section, name = key.split(".")
    from_set = load_config(None, [f"{key}={written}"])
    from_yaml = load_config(write(tmp_path, f"{section}:\n  {name}: {written}\n"))
    for cfg in (from_set, from_yaml):
        value = getattr(getattr(cfg, section), name)
        assert value == expected and type(value) is float


def test_float_tuples_read_exponents_and_nan_is_refused(tmp_path):
    cfg = load_config(write(tmp_path, "grid:\n  xbound: [-5e1, 5E1, 5e-1]\n"), ["eval.sweep=[4e-1, 5e-1]"])
    assert cfg.grid.xbound == (-50.0, 50.0, 0.5) and cfg.eval.sweep == (0.4, 0.5)
    with pytest.raises(ConfigError, match=r"optim.lr: expected a number \(not NaN\), got 'nan'"):
        load_config(None, ["optim.lr=nan"])
    with pytest.raises(ConfigError, match=r"data.image_mean\[1\]: expected a number \(not NaN\)"):
        load_config(write(tmp_path, "data:\n  image_mean: [0.5, .nan, 0.5]\n"))


def test_int_fields_take_integral_exponents_and_refuse_fractions(tmp_path):
    cfg = load_config(write(tmp_path, "train:\n  max_steps: 1e3\n"), ["train.eval_every=2E2", "train.seed=7.0"])
    assert (cfg.train.max_steps, cfg.train.eval_every, cfg.train.seed) == (1000, 200, 7)
    assert all(type(v) is int for v in (cfg.train.max_steps, cfg.train.eval_every, cfg.train.seed))
    for bad, shown in (("1.5", "1.5"), ("1e-3", "'1e-3'"), ("inf", "'inf'"), ("true", "True")):
        with pytest.raises(ConfigError, match=f"train.max_steps: expected an integer, got {shown}"):
            load_config(None, [f"train.max_steps={bad}"])
    with pytest.raises(ConfigError, match=r"train.max_steps: expected an integer, got 2.5"):
        load_config(write(tmp_path, "train:\n  max_steps: 2.5\n"))


@pytest.mark.parametrize("overrides, message", [
    (["data.final_dim=[0, 0]"], r"data.final_dim=\[0, 0\]: height and width must be multiples of 32 and > 0"),
    (["data.final_dim=[-128, 352]"], r"data.final_dim=\[-128, 352\]: height and width must be multiples of 32 "
                                     "and > 0"),
    (["data.workers=-1"], "data.workers=-1: expected >= 0"),
    (["eval.batch_size=0"], "eval.batch_size=0: expected >= 1"),
    (["data.resize_lim=[0.3, 0.2]"], r"data.resize_lim=\[0.3, 0.2\]: expected \[min, max\] with 0 < min <= max"),
    (["data.rot_lim=[5.0, -5.0]"], r"data.rot_lim=\[5.0, -5.0\]: expected \[min, max\], min <= max"),
    (["model.context_channels=0"], "model.context_channels=0: expected >= 1"),
    (["data.classes=[]"], "data.classes is empty: expected at least one class"),
    (["data.image_std=[0.229, 0.0, 0.225]"], r"data.image_std=\[0.229, 0.0, 0.225\]: expected values > 0"),
    (["eval.max_batches=-1"], "eval.max_batches=-1: expected >= 1 or null"),
    (["loss.pos_weight=-1"], "loss.pos_weight=-1.0: expected > 0"),
    (["data.min_visibility=5"], r"data.min_visibility=5: expected 0 to 4 \(the nuScenes visibility levels"),
    (["data.min_visibility=-1"], "data.min_visibility=-1: expected 0 to 4"),
    (["data.bot_pct_lim=[0.0, 1.0]"], r"data.bot_pct_lim=\[0.0, 1.0\]: expected \[min, max\] with 0 <= min <= max < 1"),
    (["data.bot_pct_lim=[-0.1, 0.2]"], r"data.bot_pct_lim=\[-0.1, 0.2\]: expected \[min, max\] with 0 <= min"),
])
def test_values_that_would_fail_deep_in_torch_are_refused_by_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.parametrize("item", ["data.classes=[unclosed", "train={max_steps: 1", "optim.lr='1e-3"])
def test_a_set_value_that_is_not_yaml_names_the_argument(item):
    with pytest.raises(ConfigError) as e:
        load_config(None, [item])
    message = str(e.value)
    assert message.startswith(f"--set {item!r}: the value is not valid YAML") and "\n" not in message
    assert e.value.__cause__ is None and e.value.__suppress_context__


def test_an_empty_config_file_is_an_error(tmp_path):
    for text in ("", "# only a comment\n"):
        path = write(tmp_path, text)
        with pytest.raises(ConfigError, match=rf"config file {path} is empty.*{{}}"):
            load_config(path)
    assert load_config(write(tmp_path, "{}\n")) == validate(Config())


def test_a_key_given_twice_names_the_key_lines_and_file(tmp_path):
    path = write(tmp_path, "train:\n  max_steps: 10\n  seed: 1\n  max_steps: 20\n")
    with pytest.raises(ConfigError, match=rf"{path}: key 'max_steps' appears twice in one mapping \(lines 2 and 4\)"):
        load_config(path)
    path = write(tmp_path, "train:\n  seed: 1\noptim:\n  lr: 0.1\ntrain:\n  max_steps: 20\n")
    with pytest.raises(ConfigError, match=rf"{path}: key 'train' appears twice"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"--set 'train=\{seed: 1, seed: 2\}': key 'seed' appears twice"):
        load_config(None, ["train={seed: 1, seed: 2}"])
    merged = write(tmp_path, "base: &b {seed: 3, max_steps: 9}\ntrain:\n  <<: *b\n  seed: 4\n")
    with pytest.raises(ConfigError, match="unknown key 'base'"):  # a merge key's override is not a duplicate
        load_config(merged)


def test_a_yaml_syntax_error_is_one_line_with_the_position(tmp_path):
    path = write(tmp_path, "train:\n  max_steps: [1, 2\n")
    with pytest.raises(ConfigError, match=rf"config file {path} is not valid YAML: .*line \d+, column \d+") as e:
        load_config(path)
    assert "\n" not in str(e.value)


def test_auto_loader_workers_follow_the_cpus_and_ranks(monkeypatch):
    import lss.data.loader as data_loader

    cfg = load_config(None, ["data.workers=auto"])
    assert cfg.data.workers == "auto" and load_config(None, ["data.workers=3"]).data.workers == 3
    monkeypatch.setattr(data_loader.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert data_loader.loader_workers(cfg) == 12
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two torchrun ranks share the 16 CPUs
    assert data_loader.loader_workers(cfg) == 6
    monkeypatch.setattr(data_loader.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert data_loader.loader_workers(cfg) == 1  # never none: a 2-core machine still loads in a worker
    with pytest.raises(ConfigError, match=r"data.workers='many': expected int or 'auto'"):
        load_config(None, ["data.workers=many"])


def test_a_config_file_that_is_not_utf8_names_the_file_and_the_byte(tmp_path, capsys):
    from lss.cli import main

    path = tmp_path / "latin1.yaml"
    path.write_bytes("train:\n  out_dir: runs/caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"config file {path} is not UTF-8 text \(byte 0xe9 at offset 26\): "
                                          "save it as UTF-8"):
        load_config(path)
    assert main(["config", "show", "--config", str(path)]) == 2
    assert f"config file {path} is not UTF-8" in capsys.readouterr().err


def test_a_config_path_that_is_a_directory_says_so(tmp_path):
    with pytest.raises(ConfigError, match=rf"config path {tmp_path} is a directory: pass a YAML file"):
        load_config(tmp_path)
