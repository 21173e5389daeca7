"""What a new user's first trial found (helper trial of the README on a fresh clone): each is
one line and the exit code the README documents."""

import subprocess
import sys
from pathlib import Path

import pytest

from meshplan import cli
from meshplan.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "meshplan.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def test_unknown_schedule_is_one_line_exit_2():
    r = _run("step", EXAMPLES / "seed-64gpu.toml", "--schedule", "foo")
    assert r.returncode == 2
    assert r.stderr.strip() == ("error: --schedule: unknown schedule 'foo'; use gpipe, 1f1b, interleaved_1f1b, zb_h1, "
                                "zbv, dualpipev")


def test_plan_of_a_mesh_that_does_not_fit_says_why_on_stderr():
    r = _run("plan", EXAMPLES / "seed-64gpu-tp4.toml")
    assert r.returncode == 1
    assert r.stderr.startswith("infeasible: peak 69.7 GiB")  # at the head's reduce-scatter (torchtitan's units)
    assert "> 67.1 GiB usable (74.5 GiB - 10% reserve)" in r.stderr


def test_plan_json_refused_before_the_report(tmp_path):
    out = tmp_path / "p.json"
    out.write_text("keep me")
    r = _run("plan", EXAMPLES / "seed-64gpu.toml", "--json", out)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == f"error: --json: {out} exists; choose another path or pass --force to replace it"
    assert out.read_text() == "keep me"


def test_torch_commands_without_torch_name_the_install(monkeypatch):
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError) as e:
        cli._require_torch("validate")
    assert e.value.field == "torch" and "pip install torch==2.13.0" in str(e.value)
