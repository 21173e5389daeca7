"""`meshplan validate` on the real engine: torchrun + gloo on CPU, real collectives.

Multi-process tests (marked ``slow``): staged worlds 2 and 4 of tensor 2 + SP x FSDP2 in one
CLI call (the 4-rank world is tp 2 x dp_shard 2; tests/conftest.py's run, whose world 4
tests/test_validate_memory_kinds.py also reads), 8-rank HSDP 2 x 2 x tp 2 + SP; in each,
every rank's collectives must equal the plan's table exactly (count, group, bytes, dtype), and
the staged run's evidence holds, per world, the message curves, arrival skew, kernel and
checkpoint rows with finite values and the cross-world table;
a rank killed with SIGKILL and a rank that hangs (ended by the wall-clock limit, and by the
process-group timeout) are named within the limit and nothing is left running; a 2-node
netns testbed run (root only, skipped elsewhere with the reason). Fast tests: mesh scaling,
the torchrun failure parser, diagnosis from status files, the evidence-folder guard. About
2.5 minutes on 2 cores (8 ranks cost ~32 s, mostly start-up).
"""

import json
import math
import os
import time
from pathlib import Path

import pytest

from meshplan.errors import ConfigError
from meshplan.fileio import staged_folder
from meshplan.runtime.execution.launch import RunOutcome, diagnose, parse_root_cause
from meshplan.runtime.validation import host
from meshplan.runtime.validation.options import Options
from meshplan.runtime.validation.scaling import scale_mesh
from meshplan.runtime.validation.validate import MARKER, prepare_out
from meshplan.spec.mesh import MeshSpec

DATA = Path(__file__).parent / "data"
TP_FSDP = DATA / "validate_llama8b_tp2sp_fsdp.toml"
HSDP = DATA / "validate_llama8b_hsdp_tp2sp.toml"
FAST = dict(layers=2, seq_len=32, vocab=512, steps=1)


def _our_processes(marker: str) -> list[int]:
    """Live processes whose command line mentions ``marker`` (the evidence folder)."""
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmd = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if marker in cmd and state != "Z":
                out.append(int(entry.name))
    return out


def _world(out: Path, w: int) -> dict:
    return json.loads((out / f"world{w}" / "comparison.json").read_text())


# Fast ---------------------------------------------------------------------------------------

def test_scale_mesh_keeps_tp_and_resizes_the_outermost_data_axis():
    spec = MeshSpec(names=["dp_replicate", "dp_shard", "tp"], shape=[2, 2, 2], sequence_parallel=True)
    small, why = scale_mesh(spec, 8, 4)
    assert small.shape == [1, 2, 2] and small.sequence_parallel and small.world == 4
    assert why == "dp_replicate = 4 / (dp_shard 2 * tp 2) = 1 (config: dp_replicate 2)"
    single, _ = scale_mesh(MeshSpec(names=["dp_replicate", "dp_shard", "tp"], shape=[1, 4, 2]), 8, 16)
    assert single.shape == [1, 8, 2]  # dp_replicate 1: the first data axis of degree > 1 absorbs it
    with pytest.raises(ConfigError, match="world 6 is not a multiple of dp_shard 2 \\* tp 2 = 4"):
        scale_mesh(spec, 8, 6)
    with pytest.raises(ConfigError, match="no data axis"):
        scale_mesh(MeshSpec(names=["tp"], shape=[4]), 4, 8)


def test_root_cause_parser_reads_torchrun_block():
    log = ("Failures:\n[1]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : -15 (pid: 1)\n"
           "Root Cause (first observed failure):\n[0]:\n  time      : x\n  host      : localhost\n"
           "  rank      : 3 (local_rank: 3)\n  exitcode  : -9 (pid: 2)  (SIGKILL)\n")
    assert parse_root_cause(log) == (3, -9)
    assert parse_root_cause("all fine") is None


def _status(folder, rank, step, phase, state="running", error=""):
    (folder / f"rank{rank}").mkdir(parents=True, exist_ok=True)
    (folder / f"rank{rank}" / "status.json").write_text(json.dumps(
        dict(rank=rank, pid=1, state=state, step=step, phase=phase, elapsed_s=1.0, error=error)))


def test_diagnose_names_the_rank_behind_on_a_wall_clock_timeout(tmp_path):
    for r in (0, 1, 3):
        _status(tmp_path, r, 2, "forward")
    _status(tmp_path, 2, 1, "optimizer")
    (tmp_path / "torchrun.log").write_text("")
    out = RunOutcome(4, [], None, True, 30.0, str(tmp_path / "torchrun.log"))
    d = diagnose(out, tmp_path, 30, 60)
    assert d["failed_ranks"] == [2]
    assert "wall-clock limit of 30 s" in d["message"] and "last at optimizer of step 1" in d["message"]


def test_diagnose_names_an_exception(tmp_path):
    _status(tmp_path, 0, 0, "forward", "error", "RuntimeError: boom")
    _status(tmp_path, 1, 0, "forward")
    (tmp_path / "torchrun.log").write_text("")
    d = diagnose(RunOutcome(2, [], 1, False, 3.0, str(tmp_path / "torchrun.log")), tmp_path, 30, 60)
    assert d["failed_ranks"] == [0] and "boom" in d["message"]


def test_out_folder_guard(tmp_path):
    (tmp_path / "mine.txt").write_text("keep")
    with pytest.raises(ConfigError, match="not empty"):
        prepare_out(tmp_path, force=False)
    with pytest.raises(ConfigError, match="not a meshplan validate folder"):
        prepare_out(tmp_path, force=True)
    assert (tmp_path / "mine.txt").exists()
    ours = tmp_path / "ev"
    ours.mkdir()
    (ours / MARKER).write_text("{}")
    prepare_out(ours, force=True)
    assert [p.name for p in ours.iterdir()] == [MARKER]  # kept until the new folder is renamed into place
    with staged_folder(ours, force=True) as tmp:
        (tmp / "summary.md").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ev", "mine.txt"]
    assert [p.name for p in ours.iterdir()] == ["summary.md"]
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="f is a file, not a folder"):
        prepare_out(tmp_path / "f" / "out", force=False)


def test_host_record_marks_times_unreliable_when_ranks_outnumber_cores():
    """4 ranks on the 2 cores of this project's machine: every time row is marked, and the
    record keeps the cores and both loads; 2 ranks on 8 idle cores are reliable; 2 ranks on 8
    cores with 7 already busy are not (7 + 2 > 8)."""
    rows = [{"quantity": "step time", "unit": "s", "note": "median"}, {"quantity": "peak memory", "unit": "B",
                                                                        "note": "tracker"}]
    h = host.verdict(4, {"cores": 2, "cpu_count": 4, "load": 0.5}, {"cores": 2, "cpu_count": 4, "load": 4.2})
    assert h == {"ranks": 4, "cores": 2, "cpu_count": 4, "load_before": 0.5, "load_after": 4.2, "reliable": False,
                 "why": ["4 ranks on 2 cores: ranks time-share cores"]}
    host.mark(rows, h)
    assert rows[0]["note"] == "median; unreliable: 4 ranks on 2 cores: ranks time-share cores"
    assert rows[1]["note"] == "tracker"
    assert "UNRELIABLE" in host.line(h) and "2 cores usable of 4" in host.line(h)
    idle = {"cores": 8, "cpu_count": 8, "load": 0.0}
    assert host.verdict(2, idle, idle)["reliable"]
    assert not host.verdict(2, {**idle, "load": 7.0}, idle)["reliable"]
    now = host.state()
    assert now["cores"] == len(os.sched_getaffinity(0)) and now["load"] == pytest.approx(os.getloadavg()[0], abs=5)


def test_a_mesh_the_runtime_cannot_build_is_refused_before_anything_runs(tmp_path):
    """Expert tensor parallelism (etp > 1) is not built by the runtime: validate says so as a
    one-line ConfigError (exit 2) before it creates the evidence folder or starts torchrun."""
    from dataclasses import replace as dc_replace

    from meshplan.runtime.validation.validate import validate
    from meshplan.config import load_config

    cfg = load_config(DATA / "validate_mixtral_ep2_fsdp.toml")
    etp = dict(names=["dp_shard", "ep", "etp"], shape=[8, 2, 2])
    moe_etp = dc_replace(cfg, mesh=cfg.mesh.model_copy(update=etp))
    with pytest.raises(ConfigError, match=r"mesh: world 4: the runtime cannot build this mesh: etp > 1"):
        validate(moe_etp, Options(worlds=(4,)), tmp_path / "ev")
    assert not (tmp_path / "ev").exists()


# Multi-process ------------------------------------------------------------------------------

torch = pytest.importorskip("torch")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_staged_worlds_2_4_tp2_sp_fsdp2_match_the_plan_exactly(staged_tp2_fsdp):
    out, cp = staged_tp2_fsdp  # TP_FSDP at worlds 2,4, one step, seq 64 (tests/conftest.py)
    assert "dp_shard = 4 / (tp 2) = 2 (config: dp_shard 4)" in cp.stdout
    top = json.loads((out / MARKER).read_text())
    assert [w["world"] for w in top["worlds"]] == [2, 4]
    # world 2 is tp 2 alone (dp_shard 1, no FSDP): the SequenceParallel norm weights keep
    # Partial gradients after backward and the fused AdamW (the default optimizer_impl)
    # all-reduces each once (5 weights) in the optimizer step; the table models exactly that.
    w2 = _world(out, 2)["comparison"]
    assert w2["ok"] and w2["differences"] == [], w2["differences"]
    assert cp.returncode == 0, cp.stdout + cp.stderr
    for w in (2, 4):
        comp = _world(out, w)
        rows = comp["comparison"]["collectives"]
        assert rows and all(row[f"rank{r}"] == row["rank0"] for row in rows for r in range(w))
        assert {row["axis"] for row in rows} == ({"tp"} if w == 2 else {"tp", "dp_shard"})
    comp = _world(out, 4)  # tp 2 + SP x dp_shard 2 (FSDP2): exact on every rank
    assert comp["ok"] and comp["comparison"]["differences"] == []
    assert all(row[f"rank{r}"] == row["meshplan"] for row in comp["comparison"]["collectives"] for r in range(4))
    for w in (2, 4):
        comp = _world(out, w)
        for r in range(w):
            assert (out / f"world{w}" / f"rank{r}" / "trace.json").stat().st_size > 10_000
        table = {row["quantity"]: row for row in comp["comparison"]["predicted_vs_measured"]}
        assert table["step time"]["measured"] > 0 and table["step time"]["predicted"] > 0
        assert table["peak memory"]["measured"] > 0
        # the in-run probe timed every collective kind of the table; the calibrated rows use them
        spec = json.loads((out / f"world{w}" / "probe_spec.json").read_text())
        probe = json.loads((out / f"world{w}" / "rank0" / "probe.json").read_text())
        assert [(p["axis"], p["op"], p["size_bytes"]) for p in probe["rows"]] == [
            (e["axis"], e["op"], e["size_bytes"]) for e in spec] and spec
        assert all(p["time_s"] > 0 and p["iters"] >= 3 for p in probe["rows"])
        assert table["step time (calibrated)"]["predicted"] > 0
        assert table["step time (calibrated)"]["measured"] == table["step time"]["measured"]
        # GEMMs and the causal attention were timed before the run, for the model
        gemm = json.loads((out / f"world{w}" / "gemm_table.json").read_text())["rows"]
        assert [g["op"] for g in gemm if "op" in g] == ["attention"] and len(gemm) > 1
        # the profiled step split into GEMM, attention, waits and the rest, measured and predicted
        parts = {q.removeprefix("step part: "): row for q, row in table.items() if q.startswith("step part: ")}
        assert list(parts) == ["GEMM kernels", "attention kernels", "waits on collectives", "the rest"]
        slow = parts["the rest"]["rank"]
        prof = [s["step_s"] for s in json.loads((out / f"world{w}" / f"rank{slow}" / "timings.json").read_text())[
            "steps"] if s["kind"] == "profiled"][0]
        # the parts cover the step (they overlap where two threads ran different parts at once)
        assert sum(p["measured"] for p in parts.values()) >= prof * (1 - 1e-9)
        assert 0 <= parts["the rest"]["measured"] <= prof
        assert parts["GEMM kernels"]["measured"] > 0 and parts["attention kernels"]["measured"] > 0
        assert all(p["predicted"] >= 0 for k, p in parts.items() if k != "the rest")
    # the profiler trace holds every collective the recorder saw: one gloo:* event each
    n = len(json.loads((out / "world4" / "rank0" / "collectives.json").read_text())["records"])
    coll = {row["quantity"]: row for row in comp["comparison"]["predicted_vs_measured"]}["collective time (sum)"]
    # 36 with one root unit (its forward all-gather and its reduce-scatter); torchtitan's units
    # (embedding resharded after forward: AG forward, AG backward, RS; [norm, output]: AG, RS):
    # 36 - 2 + 5 = 39
    assert n == 39 and f"{n} gloo:* events" in coll["note"] and coll["measured"] > 0
    start = json.loads((out / "world4" / "rank3" / "startup.json").read_text())
    assert start["coordinates"] == {"dp_shard": 1, "tp": 1}
    assert start["groups"] == {"dp_shard": [1, 3], "tp": [2, 3]} and start["group_differences"] == []
    # hidden 4096 / 16 = 256 split over tp 2: wq is (q_heads 32 x head_dim 8) / 2 rows, then FSDP halves them
    assert start["local_shapes"]["layers.0.attention.wq.weight"] == {
        "local": [64, 256], "global": [256, 256], "placements": ["_S(0, 2)", "S(0)"]}
    # staged evidence (issue 14 item 6): message curves, arrival skew, kernels, checkpoint, per world
    for w in (2, 4):
        folder = out / f"world{w}"
        st = json.loads((folder / "staged.json").read_text())
        kinds = {(e["axis"], e["op"]) for e in json.loads((folder / "probe_spec.json").read_text())}
        assert {(r["axis"], r["op"]) for r in st["curves"]} == kinds
        assert len(st["curves"]) == 7 * len(kinds) and max(r["size_bytes"] for r in st["curves"]) == 4 << 20
        for r in st["curves"]:
            assert r["measured_time_s"] > 0 and r["predicted_time_s"] > 0 and r["iters"] >= 3
            n = r["n_ranks"]  # nccl-tests: busbw = S / t x 2(n-1)/n (all-reduce), (n-1)/n (the others)
            factor = (2 if r["op"] == "all-reduce" else 1) * (n - 1) / n
            assert math.isclose(r["measured_busbw_bytes_per_s"], r["size_bytes"] / r["measured_time_s"] * factor)
        # one skew row per call of every group: the calls each group's lowest rank recorded
        recs = {r: json.loads((folder / f"rank{r}" / "collectives.json").read_text())["records"] for r in range(w)}
        calls = sum(1 for r in range(w) for c in recs[r] if c["op"] != "send/recv" and min(c["group"]) == r)
        assert len(st["skew"]) == calls > 0 and all(c["entry_s"] > 0 for c in recs[0])
        assert all(math.isfinite(r["skew_s"]) and r["skew_s"] >= 0 and r["last_rank"] in r["group"] and
                   r["predicted_s"] == 0.0 for r in st["skew"])
        s = st["skew_summary"]
        assert s["count"] == len(st["skew"]) and 0 <= s["median_s"] <= s["p90_s"] <= s["max_s"] < 60
        assert all(all(math.isfinite(r[k]) and r[k] > 0 for k in ("predicted_s", "measured_s")) for r in st["kernels"])
        assert {r["kernel"] for r in st["kernels"]} == {"gemm", "attention forward", "attention backward"}
        assert [r["rank"] for r in st["checkpoint"]] == list(range(w))
        assert all(r["measured_bytes"] > 0 and abs(r["bytes_error"]) < 0.1 and r["save_s"] > 0 and r["load_s"] > 0
                   for r in st["checkpoint"])
        for name in ("message_curves", "arrival_skew", "kernels", "checkpoint"):
            assert (folder / f"{name}.csv").read_text().count("\n") > 1
        assert st["curve_wall_s"] < _world(out, w)["elapsed_s"] / 2  # the curves do not double the launch
    summary = (out / "summary.md").read_text()
    assert "## Staged evidence across worlds" in summary
    assert summary.count("### Message curves") == summary.count("### Rank arrival skew") == 2
    assert summary.count("### Local kernels") == summary.count("### Checkpoint per rank") == 2
    table = summary.split("## Staged evidence across worlds")[1].split("\n\n")[1].splitlines()
    assert [row.split(" | ")[0] for row in table[2:]] == ["| 2", "| 4"] and "n/a" not in "".join(table[2:])
    assert summary.startswith("# meshplan validate: " + ("PASSED" if w2["ok"] else "FAILED"))
    assert "| step time |" in summary and "## world 4: OK" in summary
    assert "times and memory are reported, not gated" in summary and "How to read the table:" in summary
    assert "step time (calibrated): predicted" in cp.stdout and "peak memory: predicted" in cp.stdout
    assert _our_processes(str(out)) == []


def shared_validate_runs() -> dict:
    """HSDP x tp 2 + SP at world 8 without the probe, in the shared 8-rank launch (tests/conftest.py
    ``world8_runs``, tests/validate_runs.py); the faults, the testbed and the staged worlds run
    their own launches (validate_batch refuses faults and testbeds; the staged run is the CLI's)."""
    return {"hsdp_tp2_sp": (HSDP, Options(worlds=(8,), timeout_s=100, probe=False, **FAST))}


@pytest.mark.slow
def test_8_ranks_hsdp_tp2_sp_match_the_plan_exactly(world8_runs):
    run = world8_runs["hsdp_tp2_sp"]
    code, res = run.code, run.results
    assert code == 0, res[0]["message"]
    comp = res[0]["comparison"]
    assert comp["differences"] == []
    # without the probe (--no-probe): no probe files, no calibrated rows
    assert not list(run.out.rglob("probe*.json"))
    assert not [r for r in comp["predicted_vs_measured"] if "calibrated" in r["quantity"]]
    axes = {row["axis"] for row in comp["collectives"]}
    assert axes == {"tp", "dp_shard", "dp_replicate"}
    hsdp = [row for row in comp["collectives"] if row["axis"] == "dp_replicate"]
    assert hsdp and all(row["op"] == "all-reduce" and row["phase"] == "backward" for row in hsdp)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_killed_rank_is_named_and_nothing_is_left(tmp_path):
    from meshplan.runtime.validation.validate import validate
    from meshplan.config import load_config

    out = tmp_path / "ev"
    t0 = time.monotonic()
    code, res = validate(load_config(TP_FSDP), Options(worlds=(4,), timeout_s=60, fail_rank=1, **FAST), out,
                         echo=lambda *_: None)
    assert code == 1 and time.monotonic() - t0 < 60
    fault = res[0]["fault"]
    assert fault["failed_ranks"] == [1] and "rank 1 died (exit code -9 (SIGKILL))" in res[0]["message"]
    assert fault["ranks"][1]["files"] == ["startup.json", "collectives.json"]
    assert not (out / "world4" / "predicted_vs_measured.csv").exists()
    assert "FAILED" in (out / "summary.md").read_text().splitlines()[0]
    assert _our_processes(str(out)) == []


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_hung_rank_is_named_at_the_wall_clock_limit_and_killed(tmp_path):
    from meshplan.runtime.validation.validate import validate
    from meshplan.config import load_config

    out = tmp_path / "ev"
    t0 = time.monotonic()
    # the process-group timeout (180 s) is longer than the wall-clock limit (45 s): the
    # launcher must end the run itself and kill every process. The limit leaves room for a
    # slow start-up on a loaded machine (every rank must get past start-up to tell the hung one)
    code, res = validate(load_config(TP_FSDP), Options(worlds=(4,), timeout_s=45, pg_timeout_s=180, hang_rank=2,
                                                       **FAST), out, echo=lambda *_: None)
    took = time.monotonic() - t0
    assert code == 1 and took < 45 + 25, took
    assert res[0]["timed_out"] and res[0]["fault"]["failed_ranks"] == [2]
    assert "wall-clock limit of 45 s" in res[0]["message"] and "rank(s) [2] hung" in res[0]["message"]
    assert res[0]["leftover_pids"] == [] and _our_processes(str(out)) == []


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_hung_rank_is_named_after_the_process_group_timeout(tmp_path):
    from meshplan.runtime.validation.validate import validate
    from meshplan.config import load_config

    out = tmp_path / "ev"
    code, res = validate(load_config(TP_FSDP), Options(worlds=(2,), timeout_s=60, pg_timeout_s=8, hang_rank=0,
                                                       **FAST), out, echo=lambda *_: None)
    assert code == 1 and not res[0]["timed_out"]
    assert res[0]["fault"]["failed_ranks"] == [0]
    assert "process-group timeout (8 s)" in res[0]["message"]
    assert _our_processes(str(out)) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_node_testbed_run_matches_the_plan_and_counts_nic_bytes(tmp_path, monkeypatch):
    from meshplan.runtime.testbed.netns import testbed_available, testbed_down, testbed_up
    from meshplan.runtime.validation.validate import validate
    from meshplan.config import load_config

    ok, why = testbed_available()
    if not ok:
        pytest.skip(f"netns testbed unavailable here: {why}")
    monkeypatch.setenv("MESHPLAN_TESTBED_DIR", str(tmp_path / "state"))
    prefix = f"v{os.getpid() % 100000}"
    testbed_up(prefix, 2, 1, 1000.0)
    try:
        # 2 nodes x 2 ranks: tp 2 inside each node, dp_shard 2 across the nodes
        code, res = validate(load_config(TP_FSDP), Options(worlds=(4,), timeout_s=90, testbed=prefix, **FAST),
                             tmp_path / "ev", echo=lambda *_: None)
    finally:
        testbed_down(prefix)
    assert code == 0, res[0]["message"]
    assert res[0]["comparison"]["differences"] == []
    nic = res[0]["nic_bytes"]
    assert set(nic) == {"node0 nic0", "node1 nic0"} and all(v["tx_bytes"] > 1_000_000 for v in nic.values())
    assert "2 nodes x 2 ranks" in " ".join(res[0]["notes"])
