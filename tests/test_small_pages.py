"""meshplan.cli.small_pages changes process-wide settings (numpy's huge-page advice, glibc's mmap and trim
thresholds through ctypes' ``mallopt``): only the CLI's entry (meshplan.cli.main) may make them, never an
import of meshplan, so a program that uses meshplan as a library keeps its own (newcomer trial 31 #5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Run in a fresh interpreter (the test process has run meshplan.cli.main already): ctypes.CDLL spied on
#: before meshplan is imported, numpy's huge-page advice forced on (NUMPY_MADVISE_HUGEPAGE=1); then
#: ``import meshplan`` and its packages a library user imports, a plan built, and what was touched printed:
#: the libraries opened through ctypes and numpy's advice (``_set_madvise_hugepage`` returns the previous state).
PROBE = """
import ctypes, json, sys
opened = []
class Spy(ctypes.CDLL):
    def __init__(self, name, *args, **kwargs):
        opened.append(name)
        super().__init__(name, *args, **kwargs)
ctypes.CDLL = Spy
import numpy as np
import meshplan, meshplan.cli, meshplan.plan, meshplan.config
from meshplan.config import load_config
from meshplan.plan import build_plan
build_plan(load_config("examples/seed-64gpu.toml"))
advise = (getattr(np, "_core", None) or np.core).multiarray._set_madvise_hugepage
imported = {"opened": opened, "hugepage": advise(True)}
if sys.argv[1:] == ["call"]:
    meshplan.cli.small_pages()
    imported = {"opened": opened, "hugepage": advise(True)}
print(json.dumps(imported))
"""


def _probe(*argv: str) -> dict:
    env = dict(os.environ, NUMPY_MADVISE_HUGEPAGE="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_meshplan_leaves_the_process_settings_alone():
    assert _probe() == {"opened": [], "hugepage": True}


def test_the_probe_sees_small_pages_when_called():
    # the same probe, small_pages() called as main() calls it: glibc opened (ctypes.CDLL(None)) and the advice off,
    # so the test above can fail
    assert _probe("call") == {"opened": [None], "hugepage": False}
