"""Re-running a command with its default output (issue 11, newcomer trial 7, uxsmall item 1).

``meshplan memory CFG`` twice refused its own PNG (``out/memory/...png exists``, exit 2). Now
a file or folder meshplan wrote under ``out/`` (where every default goes) and nobody changed
since is replaced by the rerun (:func:`meshplan.fileio.owned`, the ledger
``out/.meshplan-written.json``); a file meshplan did not write there, or one changed since, is
kept and the error names the option; a path outside ``out/`` is never replaced without --force.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from meshplan import cli
from meshplan.errors import ConfigError
from meshplan.fileio import LEDGER, owned, staged_folder, write_output
from tests.conftest import EXAMPLES

MINI = EXAMPLES / "mini_2x4_tp2-dp4.toml"
PNG = Path("out/memory/mini_2x4_tp2-dp4_memory_stage0.png")


def _main(capsys, *argv) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        cli.main(list(argv))
    out = capsys.readouterr()
    return e.value.code or 0, out.out, out.err


def test_memory_twice_replaces_its_own_png_and_keeps_a_foreign_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc, out, _ = _main(capsys, "memory", str(MINI))
    assert rc == 0 and f"wrote {PNG}" in out and PNG.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc, out, err = _main(capsys, "memory", str(MINI))  # was: exit 2, "... png exists"
    assert (rc, err) == (0, "") and f"wrote {PNG}" in out
    PNG.write_bytes(b"my own picture")
    rc, out, err = _main(capsys, "memory", str(MINI))
    assert rc == 2 and err == (f"error: --out: {PNG} exists; choose another path or pass --force to replace it "
                               f"(meshplan replaces only what it wrote under out/ itself, unchanged since)\n")
    assert PNG.read_bytes() == b"my own picture"
    assert sorted(p.name for p in Path("out").iterdir()) == [LEDGER, "memory"]  # the ledger lists nothing


def test_a_changed_output_is_no_longer_meshplans(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = write_output(Path("out/x.csv"), "a,b\n")
    assert owned(p) and json.loads(Path("out", LEDGER).read_text()) == {
        "x.csv": "sha256:" + hashlib.sha256(b"a,b\n").hexdigest()}
    write_output(p, "c,d\n")  # its own: replaced without --force
    assert p.read_text() == "c,d\n"
    p.write_text("c,d,e\n")  # edited by hand: kept
    with pytest.raises(ConfigError, match=r"--out: out/x.csv exists; .* unchanged since\)$"):
        write_output(p, "f\n")
    assert p.read_text() == "c,d,e\n"


def test_outside_out_nothing_is_replaced_even_when_meshplan_wrote_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = write_output(tmp_path / "plan.json", "{}")  # a path the user named
    assert not owned(p) and not Path("out").exists()  # no ledger made outside out/
    with pytest.raises(ConfigError, match=r"plan.json exists; choose another path or pass --force to replace it$"):
        write_output(p, "{}")


def test_an_evidence_folder_of_its_own_is_rebuilt_and_a_touched_one_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dest = Path("out/compare/rejected-b")
    for text in ("one", "two"):  # the second build replaces the first: meshplan's own, unchanged
        with staged_folder(dest) as tmp:
            (tmp / "summary.md").write_text(text)
    assert (dest / "summary.md").read_text() == "two" and owned(dest)
    (dest / "notes.md").write_text("mine")
    with pytest.raises(ConfigError, match=r"--out: out/compare/rejected-b exists"):
        with staged_folder(dest) as tmp:
            (tmp / "summary.md").write_text("three")
    assert sorted(p.name for p in dest.iterdir()) == ["notes.md", "summary.md"]


def test_calibrate_default_moved_under_out_and_rerun_works(tmp_path, monkeypatch, capsys):
    """calibrate wrote calibration.toml into the current folder, refused on the rerun; its default
    (as validate's, validate-slice's and bench comm's folders) is now under out/, where a rerun
    replaces meshplan's own unchanged file."""
    monkeypatch.chdir(tmp_path)
    log = Path(__file__).parent / "data" / "nccl" / "all_reduce_perf_8nodes-x1gpu.txt"
    for _ in range(2):
        rc, out, err = _main(capsys, "calibrate", str(log))
        assert (rc, err) == (0, "") and "wrote out/calibration.toml" in out
    assert not Path("calibration.toml").exists() and owned(Path("out/calibration.toml"))


def test_memory_prints_the_timeline_then_refuses_an_existing_png(tmp_path, monkeypatch, capsys):
    """n26small #1: ``memory --out DIR`` a second time refused with only the one-line error, the
    timeline computed and not shown. Now the timeline is printed, then the error (exit 2), and
    neither the PNG nor the memory document is written (--json holds the error document); a PNG of a stage not shown is no conflict."""
    monkeypatch.chdir(tmp_path)
    png = Path("mine/mini_2x4_tp2-dp4_memory_stage0.png")
    png.parent.mkdir()
    png.write_bytes(b"theirs")
    Path("mine/mini_2x4_tp2-dp4_memory_stage3.png").write_bytes(b"old stage 3")  # mini is pp 1: stage 0 only
    rc, out, err = _main(capsys, "memory", str(MINI), "--out", "mine", "--json", "m.json")
    assert rc == 2 and err == f"error: --out: {png} exists; choose another path or pass --force to replace it\n"
    assert "Memory timeline per rank" in out and "headroom" in out and "wrote" not in out
    # the PNG kept; --json holds the meshplan.error/v1 document of the refusal, not the memory one (nc55fixB,
    # newcomer trial 55 #8: before it nothing was written there)
    assert png.read_bytes() == b"theirs" and json.loads(Path("m.json").read_text())["error"]["field"] == "--out"
    rc, out, err = _main(capsys, "memory", str(MINI), "--out", "mine", "--force")
    assert (rc, err) == (0, "") and f"wrote {png}" in out and png.read_bytes()[:4] == b"\x89PNG"
    assert Path("mine/mini_2x4_tp2-dp4_memory_stage3.png").read_bytes() == b"old stage 3"


def test_memory_help_says_which_png_is_replaced(capsys):
    rc, out, _ = _main(capsys, "memory", "--help")
    words = " ".join(out.replace("│", " ").split())
    assert rc == 0 and ("Without it, a PNG meshplan wrote under out/ (the default out/memory) and unchanged since is "
                        "replaced; any other existing PNG (as in an explicit --out) is refused after the timeline is "
                        "printed") in words, words
