"""Helpers the CLI tests share: run ``meshplan`` in-process and plan a config file."""

from __future__ import annotations

import contextlib
import io
from types import SimpleNamespace

import pytest


def run_main(*argv) -> int:
    """Exit code of ``meshplan ARGV...`` run in-process (0 when it returns without exiting)."""
    from meshplan.cli import main
    with pytest.raises(SystemExit) as done:
        main([str(a) for a in argv])
    return done.value.code or 0


def run_cli(argv, capsys) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of ``meshplan ARGV...`` run in-process (:func:`run_main`), the
    output read from pytest's ``capsys``."""
    code = run_main(*argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def step_json(tmp_path, capsys, text: str, name: str) -> tuple[dict, str]:
    """``meshplan step`` of the config ``text`` (written to ``tmp_path/NAME.toml``) with ``--json``:
    ``(the JSON document, stdout)``; the run must exit 0."""
    import json

    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(text, encoding="utf-8")
    code, out, err = run_cli(["step", cfg, "--json", tmp_path / f"{name}.json"], capsys)
    assert code == 0, err
    return json.loads((tmp_path / f"{name}.json").read_text(encoding="utf-8")), out


def run_captured(*argv, cwd=None) -> SimpleNamespace:
    """``meshplan ARGV...`` in-process (:func:`run_main`), its output captured, read as the console
    script's ``subprocess.CompletedProcess`` would be: ``returncode``, ``stdout``, ``stderr``; run in
    ``cwd`` when given (as the subprocess's ``cwd``). For tests
    that ran ``python -m meshplan.cli`` only to read these: each such run re-imported meshplan and
    re-read the catalogs and kernel tables, 1.5-2.5 s of CPU (``main`` is the console script's whole
    body, meshplan/cli/__main__.py)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd) if cwd else contextlib.nullcontext(), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        code = run_main(*argv)
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def help_words(*argv) -> str:
    """``meshplan ARGV... --help`` at 200 columns (:func:`run_captured`), its words joined by one
    space; fails the test on a non-zero exit. The text a ``python -m meshplan.cli`` subprocess
    prints but the usage line's program name, without its interpreter start-up (about 2 CPU-s)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLUMNS", "200")
        r = run_captured(*argv, "--help")
    assert r.returncode == 0, r.stderr
    return " ".join(r.stdout.split())


def plan_file(path):
    """The plan of the config at ``path`` (:func:`meshplan.plan.build_plan`)."""
    from meshplan.config import load_config
    from meshplan.plan import build_plan
    return build_plan(load_config(path))
