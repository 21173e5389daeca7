"""The runtime package is meshplan's torch side: without torch, pytest's doctest collection
skips all of its modules (the tests skip through ``pytest.importorskip``), instead of a list
of the ones that import torch that would drift as modules are added."""

import importlib.util
from pathlib import Path

collect_ignore = [] if importlib.util.find_spec("torch") else sorted(
    p.name for p in Path(__file__).parent.glob("*.py") if p.name != "conftest.py")
