"""Output contracts of the CLI: files written 0644 (mkstemp's 0600 hid memory PNGs from other
users), shell completion on (typer's --install-completion / --show-completion)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.cli_run import run_captured

ROOT = Path(__file__).resolve().parents[1]
MINI = ROOT / "examples" / "mini_2x4_tp2-dp4.toml"


def mode(p: Path) -> str:
    return oct(p.stat().st_mode & 0o777)


def run(argv, capsys) -> tuple[int, str]:
    """``meshplan ARGV`` in this process: (exit status, stderr)."""
    from meshplan.cli import main

    with pytest.raises(SystemExit) as done:
        main([str(a) for a in argv])
    return done.value.code or 0, capsys.readouterr().err


def test_files_are_written_0644_even_under_umask_0077(tmp_path, capsys):
    old = os.umask(0o077)  # a plain open() would now make 0600 files; mkstemp always does
    try:
        for argv in (["memory", MINI, "--out", tmp_path / "mem"], ["step", MINI, "--trace", tmp_path / "trace.json"],
                     ["plan", MINI, "--json", tmp_path / "plan.json"]):
            rc, err = run(argv, capsys)
            assert rc == 0, err
    finally:
        os.umask(old)
    pngs = sorted((tmp_path / "mem").glob("*.png"))
    assert [p.name for p in pngs] == ["mini_2x4_tp2-dp4_memory_stage0.png"]
    assert {p.name: mode(p) for p in [*pngs, tmp_path / "trace.json", tmp_path / "plan.json"]} == \
        {"mini_2x4_tp2-dp4_memory_stage0.png": "0o644", "trace.json": "0o644", "plan.json": "0o644"}


def test_shell_completion_is_on(monkeypatch, capsys):
    from meshplan.cli import app

    def complete(words: str) -> list[str]:
        monkeypatch.setenv("_MESHPLAN_COMPLETE", "complete_bash")
        monkeypatch.setenv("COMP_WORDS", words)
        monkeypatch.setenv("COMP_CWORD", str(len(words.split()) - 1))
        with pytest.raises(SystemExit):
            app(prog_name="meshplan")
        return capsys.readouterr().out.split()

    assert complete("meshplan pl") == ["plan", "place"]
    assert complete("meshplan step x.toml --tr") == ["--trace"]
    monkeypatch.delenv("_MESHPLAN_COMPLETE")
    with pytest.raises(SystemExit):
        app(["--help"], prog_name="meshplan")
    assert "--install-completion" in capsys.readouterr().out


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_show_completion_prints_a_script(shell):
    # completion is on (the options are in --help); typer's --show-completion is a flag that
    # detects the shell from the process tree (under make: sh, which typer refuses), so the
    # script is asked for by the shell's name
    from typer.completion import get_completion_script

    assert "--show-completion" in run_captured("--help").stdout
    assert "_MESHPLAN_COMPLETE" in get_completion_script(prog_name="meshplan", complete_var="_MESHPLAN_COMPLETE",
                                                         shell=shell)


def test_place_states_traffic_as_bytes_sent_per_rank_per_step_in_gb():
    """One unit for traffic: ``place`` says GB sent per rank per step, as ``step`` and ``compare``
    do (it said TiB of full buffers)."""
    import re

    from meshplan.config import load_config
    from meshplan.plan import build_plan

    r = run_captured("place", str(MINI))
    assert r.returncode == 0, r.stderr
    assert "TiB" not in r.stdout and "GiB" not in r.stdout
    line = next(x for x in r.stdout.splitlines() if "weights:" in x)
    assert "bytes each rank sends per step by axis" in line and "GB = 1e9 B" in line
    printed = {a: float(v.replace(",", "")) for a, v in re.findall(r"(\w+) ([\d,.]+) GB", line)}
    plan = build_plan(load_config(MINI))
    share = lambda op, n: (2 if op == "all-reduce" else 1) * (n - 1) / n  # ring: bytes sent / buffer
    want: dict[str, float] = {}
    for rows in plan.collectives.values():
        per_axis: dict[str, float] = {}
        for x in rows:
            per_axis[x.axis] = per_axis.get(x.axis, 0.0) + x.size_bytes * share(x.op, x.group_size) * x.per_step
        for a, b in per_axis.items():
            want[a] = max(want.get(a, 0.0), b)
    assert printed == {a: round(b / 1e9, 1) for a, b in want.items()}


@pytest.mark.parametrize("argv,field", [
    (["export", MINI, "--to", "megatron", "-o", "{d}/x.args"], "-o"),
    (["plan", MINI, "--json", "{d}/plan.json"], "--json"),
    (["plan", MINI, "--html", "{d}/sub/plan.html"], "--html"),
    (["step", MINI, "--trace", "{d}/trace.json"], "--trace"),
    (["memory", MINI, "--out", "{d}/sub/mem"], "--out"),
])
def test_a_missing_folder_is_refused_not_created(tmp_path, capsys, argv, field):
    """Was: ``export -o /nonexistent_dir/x.args`` made the folder (a typo in a folder name made a
    new tree). Every output refuses a missing folder in one line before any work; only the
    commands' defaults under out/ are created (``fileio.OUTPUT_ROOT``)."""
    d = tmp_path / "nodir"
    rc, err = run([str(a).format(d=d) for a in argv], capsys)
    target = Path(str(argv[-1]).format(d=d))
    assert rc == 2 and err.strip().splitlines()[-1] == (
        f"error: {field}: cannot write {target}: folder {target.parent} does not exist; create it or choose "
        "another path"), err
    assert not d.exists()


def test_default_outputs_under_out_are_created(tmp_path):
    r = run_captured("export", str(MINI), "--to", "megatron", "-o", "out/a/b/x.args", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "a" / "b" / "x.args").is_file()


def test_search_export_beyond_top_is_refused_before_searching(tmp_path, capsys):
    """Was: the whole search ran, then "--export: 99: the search ranked 10 row(s)"."""
    from meshplan.cli import main

    with pytest.raises(SystemExit) as done:
        main(["search", str(MINI), "--top", "3", "--export", "4", "--to", "meshplan", "-o", str(tmp_path / "r.toml")])
    cap = capsys.readouterr()
    assert done.value.code == 2 and cap.err.strip().splitlines()[-1] == (
        "error: --export: 4 > --top 3: the search lists 3 row(s); pass --top 4 or export a lower rank"), cap.err
    assert "candidates" not in cap.out  # no search header: refused before searching
