"""Findings of newcomer trial 6 (issue 11): each test failed on main before its fix."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("args", [("step", EXAMPLES / "seed-64gpu.toml"),
                                  ("memory", EXAMPLES / "mini_2x4_tp2-dp4.toml")])
def test_closed_stdout_exits_141_quietly_not_as_a_verdict(args, tmp_path):
    # the reader of stdout is gone before the first write (``| head -1`` after its line):
    # click's EPIPE handler used to exit 1, which the README reads as "infeasible"
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", "meshplan.cli", *map(str, args)], stdout=w,
                           stderr=subprocess.PIPE, text=True, timeout=120, cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": str(EXAMPLES.parent)})
    finally:
        os.close(w)
    assert (p.returncode, p.stderr) == (141, "")
