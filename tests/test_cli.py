"""The command line: config show, user errors as one line and exit code 2, bugs with their traceback, and
`python -m lss env`."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lss.cli import main
from lss.config import ConfigError
from lss.errors import ArgumentError, CheckpointError, DatasetError

ROOT = Path(__file__).resolve().parents[1]


def test_config_show_prints_resolved_config(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  max_steps: 12\n")
    assert main(["config", "show", "--config", str(path), "--set", "optim.lr=0.5"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["train"]["max_steps"] == 12
    assert shown["optim"]["lr"] == 0.5
    assert shown["grid"]["xbound"] == [-50.0, 50.0, 0.5]


def test_config_error_exits_2_with_message(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  max_stepz: 12\n")
    assert main(["config", "show", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "max_stepz" in err and "max_steps" in err


def test_python_m_lss_env_runs():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "lss", "env"], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "torch" in out.stdout and "lss._C" in out.stdout and "efficientnet-pytorch" in out.stdout


def failing(exc):
    def command(args):
        raise exc
    return command


@pytest.mark.parametrize("exc", [
    ConfigError("train.amp='fp8': expected one of 'bf16', 'fp16', 'none'"),
    ArgumentError("scenes must be a positive integer, got 0"),
    DatasetError("sample abc has no CAM_BACK image"),
    CheckpointError("checkpoint run/last.pt does not exist"),
    FileNotFoundError(2, "No such file or directory", "weights.pth"),
    FloatingPointError("loss is nan at step 12; lower optim.lr, check the data, or train.amp: none"),
], ids=lambda e: type(e).__name__)
def test_user_errors_print_one_line_and_exit_2(monkeypatch, capsys, exc):
    monkeypatch.setattr("lss.cli.cmd_config_show", failing(exc))
    assert main(["config", "show"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"lss config: error: {exc}" and len(lines) == 2 and "LSS_DEBUG" in lines[1]


def test_a_bad_config_value_exits_2_naming_key_and_allowed_values(capsys):
    assert main(["config", "show", "--set", "train.amp=fp8"]) == 2
    err = capsys.readouterr().err
    assert "train.amp='fp8'" in err and "'bf16', 'fp16', 'none'" in err and "Traceback" not in err


def test_a_set_value_that_is_not_yaml_exits_2_naming_the_argument(capsys):
    assert main(["config", "show", "--set", "data.classes=[unclosed"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("lss config: error: --set 'data.classes=[unclosed': the value is not valid YAML")
    assert len(lines) == 2 and "Traceback" not in lines[0]


@pytest.mark.parametrize("num", ["-3", "two"])
def test_viz_num_must_be_a_count(capsys, num):
    with pytest.raises(SystemExit) as e:
        main(["viz", "--config", "c.yaml", "--ckpt", "c.pt", "--out", "v", "--num", num])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --num: expected a number of samples >= 0, got {num!r}" in err and "Traceback" not in err


def test_viz_num_passes_a_count_on(monkeypatch):
    seen = []
    monkeypatch.setattr("lss.cli.cmd_viz", lambda args: seen.append(args.num) or 0)
    assert main(["viz", "--config", "c.yaml", "--ckpt", "c.pt", "--out", "v", "--num", "3"]) == 0
    assert main(["viz", "--config", "c.yaml", "--ckpt", "c.pt", "--out", "v"]) == 0
    assert seen == [3, None]


@pytest.mark.parametrize("exc", [ValueError("shape mismatch 3 vs 4"), RuntimeError("CUDA error"), KeyError("det")],
                         ids=lambda e: type(e).__name__)
def test_unexpected_errors_keep_their_traceback(monkeypatch, exc):
    monkeypatch.setattr("lss.cli.cmd_config_show", failing(exc))
    with pytest.raises(type(exc)) as e:
        main(["config", "show"])
    assert e.value is exc


def test_a_bug_prints_its_traceback_from_the_command_line():
    code = ("import lss.cli as cli\n"
            "def bug(args):\n    raise ValueError('expected 3 channels, got 4')\n"
            "cli.cmd_config_show = bug\nraise SystemExit(cli.main(['config', 'show']))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("LSS_DEBUG", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 1
    assert "Traceback (most recent call last)" in out.stderr and "in bug" in out.stderr
    assert out.stderr.rstrip().endswith("ValueError: expected 3 channels, got 4")


@pytest.mark.parametrize("value, says", [("-5x5", "width and height must be positive"),
                                         ("-1600x900", "width and height must be positive"),
                                         ("big", "expected WIDTHxHEIGHT")])
def test_image_size_values_reach_their_check(tmp_path, capsys, value, says):
    with pytest.raises(SystemExit) as info:
        main(["make-synthetic", str(tmp_path / "set"), "--image-size", value])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"--image-size {value!r}: {says}" in err
    assert not (tmp_path / "set").exists()
