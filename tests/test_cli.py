"""The command line: config show, config errors as exit code 2, and `python -m lss env`."""
import os
import subprocess
import sys
from pathlib import Path

import yaml

from lss.cli import main

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
