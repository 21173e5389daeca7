"""Outputs (issue 13 item 5) and one verdict per command (item 4).

- Every writer refuses to replace a file without --force, with no check-then-replace race (a
  file that appears between the check and the write is kept); an unwritable destination is a
  one-line error before the work; a SIGTERM or Ctrl-C during a write leaves no temporary
  file; evidence folders are built under a temporary name, so an interrupted or failed run
  leaves nothing that blocks the rerun; ``bench comm --out`` refuses an existing folder.
- Options are checked like config fields and named as options.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import meshplan.fileio as fileio
from meshplan.errors import ConfigError
from meshplan.fileio import check_destination, staged_folder, write_output
from tests.cli_run import run_captured
from tests.conftest import EXAMPLES
from tests.configs import TP4_MB2

ROOT = Path(__file__).resolve().parents[1]
SEED = EXAMPLES / "seed-64gpu.toml"
#: the seed's tp-4 alternative at micro-batch 2 (tests/configs.py: 121.5 > 71.2 GiB usable): rejected by memory
TP4 = TP4_MB2


def _cli(*args: str) -> SimpleNamespace:
    return run_captured(*args)  # in-process: the exit status and output the console script gives


def _one_error_line(r: SimpleNamespace, field: str) -> str:
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {field}: "), r.stderr
    return lines[0]


# --------------------------------------------------------------------------- writes


def test_a_file_created_after_the_check_is_never_replaced(tmp_path, monkeypatch):
    """The race of the issue (6 of 6 trials with plan --json): someone creates the file after
    the existence check; the link-based create refuses instead of replacing it."""
    dest = tmp_path / "plan.json"
    real = fileio.check_destination

    def check_then_someone_writes(path, field="--out", force=False, folder=False, **kw):
        out = real(path, field, force, folder, **kw)
        dest.write_text("theirs")
        return out

    monkeypatch.setattr(fileio, "check_destination", check_then_someone_writes)
    with pytest.raises(ConfigError, match="plan.json exists; choose another path or pass --force"):
        write_output(dest, "ours", field="--json")
    assert dest.read_text() == "theirs" and sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_without_hard_links_the_create_is_still_exclusive(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    p = write_output(tmp_path / "a.txt", "one", mode=0o600)
    assert p.read_text() == "one" and (p.stat().st_mode & 0o777) == 0o600
    real = fileio.check_destination
    monkeypatch.setattr(fileio, "check_destination", lambda path, field="--out", force=False, folder=False, **kw: Path(path))
    with pytest.raises(ConfigError, match="exists"):
        write_output(p, "two")  # the check skipped: O_EXCL still refuses
    monkeypatch.setattr(fileio, "check_destination", real)
    assert p.read_text() == "one" and sorted(x.name for x in tmp_path.iterdir()) == ["a.txt"]
    assert write_output(p, "two", force=True).read_text() == "two"


def test_force_replaces_and_mode_is_set(tmp_path):
    p = write_output(tmp_path / "x.sh", "a", mode=0o755)
    assert (p.stat().st_mode & 0o777) == 0o755
    assert write_output(p, b"\x00b", force=True).read_bytes() == b"\x00b"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["x.sh"]


@pytest.mark.parametrize("case", ["parent is a file", "is a folder", "exists"])
def test_unwritable_destinations_are_one_line_errors(tmp_path, case):
    (tmp_path / "f").write_text("x")
    (tmp_path / "d").mkdir()
    path, words = {"parent is a file": (tmp_path / "f" / "sub" / "o.json", "f is a file, not a folder"),
                   "is a folder": (tmp_path / "d", "is a folder; give a file path"),
                   "exists": (tmp_path / "f", "exists; choose another path or pass --force")}[case]
    with pytest.raises(ConfigError) as err:
        check_destination(path, "--json")
    assert err.value.field == "--json" and words in str(err.value)


class _Vfs:
    """What ``os.statvfs`` returns, with the fields check_destination reads."""

    def __init__(self, flag=0, blocks=1000, free=1000):
        self.f_flag, self.f_blocks, self.f_bfree, self.f_bavail = flag, blocks, free, free


@pytest.mark.parametrize("vfs, words", [
    (_Vfs(flag=os.ST_RDONLY), "is on a read-only file system"),
    (_Vfs(blocks=0, free=0), "is on a pseudo file system with no storage (such as /proc or /sys)"),
    (_Vfs(free=0), "no space left on the device of"),
])
def test_unwritable_file_systems_are_named_by_their_cause(tmp_path, monkeypatch, vfs, words):
    # /sys and /proc report 0 free blocks: before, every one of them read "no space left"
    monkeypatch.setattr(fileio.os, "statvfs", lambda p: vfs)
    with pytest.raises(ConfigError) as err:
        check_destination(tmp_path / "x.json", "--json")
    assert str(err.value) == f"--json: cannot write {tmp_path / 'x.json'}: " + (
        f"{words} {tmp_path}" if words.startswith("no space") else f"{tmp_path} {words}") + "; choose another path"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="Linux /proc")
def test_proc_is_a_pseudo_file_system_not_a_full_disk():
    with pytest.raises(ConfigError, match=r"cannot write /proc/nope/x.json: /proc is on a pseudo file system"):
        check_destination("/proc/nope/x.json", "--json")


@pytest.mark.parametrize("code, words", [(errno.EROFS, "read-only file system"), (errno.EACCES, "permission denied"),
                                         (errno.ENOENT, "a folder on the way does not exist"),
                                         (errno.ENOSPC, "no space left on the device")])
def test_a_failed_write_names_its_errno(tmp_path, monkeypatch, code, words):
    def refuse(*a, **k):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(fileio.os, "fsync", refuse)
    with pytest.raises(ConfigError) as err:
        write_output(tmp_path / "x.json", "{}")
    assert str(err.value) == f"--out: cannot write {tmp_path / 'x.json'}: {words}; choose another path"
    assert list(tmp_path.iterdir()) == []  # the temporary file is gone


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    with pytest.raises(ConfigError, match="is not writable"):
        check_destination(ro / "x.json", "--json")


_SLOW_WRITE = """
import os, sys, time
import meshplan.atomic_write as a
import meshplan.fileio as f
real = os.fsync
def slow(fd):
    print("ready", flush=True)
    time.sleep(30)
os.fsync = slow
if sys.argv[1] == "file":
    f.write_output(sys.argv[2], "x" * 100000)
elif sys.argv[1] == "atomic":
    a.write_text_atomic(sys.argv[2], "x" * 100000)
else:
    with f.staged_folder(sys.argv[2]) as tmp:
        (tmp / "a.txt").write_text("partial")
        a.write_text_atomic(tmp / "b.txt", "y")
"""


@pytest.mark.parametrize("kind", ["file", "atomic", "folder"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_interrupted_write_leaves_nothing(tmp_path, kind, sig):
    """SIGTERM (as SIGINT) while the temporary file or folder exists: it is removed and the
    destination does not exist, so a rerun is not blocked (27 of 32 trials left a hidden
    partial file before)."""
    out = tmp_path / "out" / ("ev" if kind == "folder" else "o.json")
    out.parent.mkdir()
    # SIGINT at its default in the child, as under a terminal: a shell starts background jobs (CI
    # launched with `&`) with SIGINT ignored, and Python then installs no KeyboardInterrupt handler
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_WRITE, kind, str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline() == "ready\n"
    assert any(out.parent.iterdir())  # the temporary file or folder exists now
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == (143 if sig == signal.SIGTERM else -signal.SIGINT), err  # KeyboardInterrupt: -2
    assert list(out.parent.iterdir()) == []


def test_staged_folder_refuses_then_replaces_with_force(tmp_path):
    ev = tmp_path / "ev"
    with staged_folder(ev) as t:
        (t / "a").write_text("1")
    with pytest.raises(ConfigError, match="ev exists"):
        with staged_folder(ev):
            pass  # refused on entry, before any work
    with staged_folder(ev, force=True) as t:
        (t / "b").write_text("2")
    assert sorted(p.name for p in ev.iterdir()) == ["b"] and sorted(p.name for p in tmp_path.iterdir()) == ["ev"]


# --------------------------------------------------------------------------- commands


def test_plan_json_under_a_file_is_refused_before_the_work(tmp_path):
    (tmp_path / "f").write_text("x")
    r = _cli("plan", str(SEED), "--json", str(tmp_path / "f" / "plan.json"))
    line = _one_error_line(r, "--json")
    assert "f is a file, not a folder" in line


def test_search_json_existing_is_refused_before_the_search(tmp_path):
    (tmp_path / "s.json").write_text("mine")
    t0 = time.monotonic()
    r = _cli("search", str(SEED), "--json", str(tmp_path / "s.json"))
    _one_error_line(r, "--json")
    assert time.monotonic() - t0 < 30 and (tmp_path / "s.json").read_text() == "mine"


def test_compare_evidence_of_a_failed_write_does_not_block_the_rerun(tmp_path, monkeypatch):
    from meshplan.compare import compare
    from meshplan.compare import output as cmp  # the evidence writer
    from meshplan.config import load_config
    from meshplan.plan import build_plan

    c = compare(build_plan(load_config(SEED)), build_plan(load_config(TP4)), names=("seed", "tp4"))
    real = cmp._atomic_text

    def fail_on_summary(path, text):
        if path.name == "summary.md":
            raise OSError(28, "No space left on device")
        return real(path, text)

    monkeypatch.setattr(cmp, "_atomic_text", fail_on_summary)
    with pytest.raises(OSError):
        cmp.write_evidence(c, tmp_path)
    assert list(tmp_path.iterdir()) == []  # plan.json and the trace went with the temporary folder
    monkeypatch.setattr(cmp, "_atomic_text", real)
    paths = cmp.write_evidence(c, tmp_path)
    assert [p.name for p in paths] == ["plan.json", "predicted-trace.json", "summary.md", "comparison.json"]
    assert all(p.is_file() for p in paths) and sorted(x.name for x in tmp_path.iterdir()) == ["rejected-tp4-vs-seed"]


def test_bench_comm_refuses_an_existing_out_before_running(tmp_path):
    from meshplan.runtime.bench.comm import run_bench

    (tmp_path / "calibration.toml").write_text("earlier")
    with pytest.raises(ConfigError, match="--out: .* exists; choose another path or pass --force"):
        run_bench(2, [1024], tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calibration.toml"]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e-300", "0", "-5", "1e300"])
def test_reliability_bandwidth_is_checked_as_a_field(value):
    r = _cli("reliability", str(SEED), "--write-gbps", value, "--read-gbps", "10", "--restart-overhead-s", "600")
    line = _one_error_line(r, "--write-gbps")
    assert "0.001..1e+06 GB/s" in line


def test_reliability_restart_overhead_and_lost_nodes_are_checked():
    base = ["reliability", str(SEED), "--write-gbps", "10", "--read-gbps", "10"]
    _one_error_line(_cli(*base, "--restart-overhead-s", "nan"), "--restart-overhead-s")
    line = _one_error_line(_cli(*base, "--restart-overhead-s", "60", "--lost-nodes", "9"), "--lost-nodes")
    assert "more than the cluster's 8 nodes" in line
    assert _cli(*base, "--restart-overhead-s", "60").returncode == 0


def test_step_schedule_names_the_option():
    line = _one_error_line(_cli("step", str(SEED), "--schedule", "bogus"), "--schedule")
    assert "unknown schedule 'bogus'" in line


@pytest.mark.parametrize("opt,value", [("--timeout-s", "nan"), ("--tolerance", "inf"), ("--steps", "0"),
                                       ("--layers", "0")])
def test_validate_options_are_checked_before_anything_runs(opt, value, tmp_path):
    pytest.importorskip("torch")
    r = _cli("validate", str(SEED), opt, value, "--out", str(tmp_path / "v"))
    _one_error_line(r, opt)
    assert not (tmp_path / "v").exists()


@pytest.mark.parametrize("args,field,words", [
    # typer's pydantic wording ("Input should be a valid integer, unable to parse ...") said in ours (nc55 #13)
    (["plan", str(SEED), "--rank", "abc"], "--rank", "'abc' is not an integer; fix: give --rank a whole number"),
    (["export", str(SEED), "-o", "out.toml"], "--to", "Missing option '--to'"),
    (["plan", str(SEED), "--bogus"], "--bogus", "No such option: --bogus"),
    (["plan"], "config", "Missing argument 'config'")])
def test_usage_errors_are_one_line_naming_the_option(args, field, words):
    """A value that does not parse, a missing or unknown option: one line naming it (typer's
    boxed usage text before), exit 2."""
    line = _one_error_line(_cli(*args), field)
    assert words in line and line.endswith("--help")


def test_help_and_a_bare_group_still_show_the_help():
    assert _cli("--help").returncode == 0
    r = _cli("bench")
    assert r.returncode == 2 and r.stderr.startswith("Usage:") and "gemm" in r.stderr


# --------------------------------------------------------------------------- refused before planning


def _no_planning(*a, **kw):
    raise AssertionError("planned before refusing an existing output")


@pytest.mark.parametrize("command, made, extra", [
    ("memory", "m.json", ["--json", "m.json"]),  # its PNG: refused after the timeline (test_rerun_outputs)
    ("launch", "launch/torchrun.sh", ["--out", "launch"]),
    ("report", "r.html", ["--out", "r.html"]),
    ("step", "t.json", ["--trace", "t.json"]),
    ("export", "x.toml", ["--to", "torchtitan", "-o", "x.toml"])])
def test_an_existing_output_is_refused_before_planning(tmp_path, monkeypatch, command, made, extra):
    """Issue 11 (newcomer trial 4): ``memory`` run a second time failed only after the whole
    computation. Every command that writes files refuses an existing one before it plans (the
    planner is replaced by one that fails the test), names --force, and leaves the file as it was."""
    from typer.testing import CliRunner

    import meshplan.cli as cli
    for mod in [m for name, m in sys.modules.items() if name.startswith("meshplan.cli.")]:
        for planner in ("_load", "load_any"):  # the loader as each command module imported it
            if hasattr(mod, planner):
                monkeypatch.setattr(mod, planner, _no_planning)
    monkeypatch.chdir(tmp_path)
    dest = tmp_path / made
    dest.parent.mkdir(exist_ok=True)
    dest.write_text("theirs")
    r = CliRunner().invoke(cli.app, [command, str(EXAMPLES / "mini_2x4_tp2-dp4.toml"), *extra])
    assert isinstance(r.exception, ConfigError), r.exception  # main() prints it as one line, exit 2
    line = str(r.exception)
    assert f"{made} exists; choose another" in line and "pass --force to replace it" in line, line
    assert dest.read_text() == "theirs"
