"""A script of benchmarks/ as a module, for the tests that read its rows and helpers: loaded once per
``alias`` (each test file its own instance, so nothing one file patches reaches another) and
registered in ``sys.modules`` under it, where its dataclasses resolve their annotations."""

from __future__ import annotations

import importlib.util
import sys
from functools import lru_cache
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@lru_cache(maxsize=None)
def bench(script: str, alias: str):
    """``benchmarks/<script>.py`` as the module ``alias``."""
    spec = importlib.util.spec_from_file_location(alias, BENCHMARKS / f"{script}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[alias] = mod
    spec.loader.exec_module(mod)
    return mod
