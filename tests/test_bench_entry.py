"""`lss bench` is a thin entry into the checkout's benchmarks/ package, which the installed package
does not ship: it finds the package beside lss/ or in the current directory, and says what to do
when there is none."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lss.engine import bench
from lss.cli import main
from lss.errors import LssError

REPO = Path(__file__).resolve().parents[1]


def test_the_checkout_is_found_beside_the_lss_package():
    assert bench.find_checkout() == REPO
    assert set(bench.load_benchmarks().available_suites()) >= {"bev_pool", "roi", "train_step"}


def test_the_first_candidate_holding_the_suites_wins(tmp_path):
    assert bench.find_checkout([tmp_path, REPO]) == REPO
    assert bench.find_checkout([tmp_path]) is None


def test_no_checkout_says_where_it_looked_and_what_to_do(tmp_path):
    with pytest.raises(LssError) as e:
        bench.load_benchmarks([tmp_path])
    msg = str(e.value)
    assert str(tmp_path) in msg
    assert "pip install -e ." in msg and "source checkout" in msg


def test_no_checkout_exits_2_from_the_command_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "find_checkout", lambda candidates=None: None)
    assert main(["bench", "--suite", "roi", "--device", "cpu", "--quick"]) == 2
    assert "source checkout" in capsys.readouterr().err


def test_an_unknown_suite_exits_2_naming_the_available_ones(capsys):
    assert main(["bench", "--suite", "no_such_suite", "--device", "cpu", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "no_such_suite" in err and "bev_pool" in err


def test_bench_runs_a_suite_from_outside_the_checkout(tmp_path):
    """From another directory the suites are still found beside the lss package (an editable
    install; here lss comes from the checkout through PYTHONPATH)."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lss",
            "bench",
            "--suite",
            "upsample",
            "--device",
            "cpu",
            "--quick",
            "--out",
            str(tmp_path / "out"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "out" / "bench.json").is_file()
    assert "| upsample |" in (tmp_path / "out" / "bench.md").read_text()
