"""The type check of meshplan/ (issue 10 item 4): mypy with the ``[tool.mypy]`` section of
pyproject.toml (runtime modules that drive torch internals are relaxed there, with the
reason) must report no error. Skipped when mypy is not installed (``pip install -e '.[test]'``
installs it)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_clean(monkeypatch):
    api = pytest.importorskip("mypy.api", reason="mypy is not installed (the test extra installs it)")
    monkeypatch.chdir(ROOT)  # pyproject.toml's [tool.mypy]: files, cache and overrides
    limit = sys.getrecursionlimit()
    try:
        out, err, status = api.run(["--config-file", str(ROOT / "pyproject.toml")])
    finally:  # mypy raises it for good; later tests' parser depth depends on it
        sys.setrecursionlimit(limit)
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert status == 0 and not errors, "\n".join(errors[:40]) or out + err
