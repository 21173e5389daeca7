"""Staged validation evidence (issue 14 item 6), the pure parts of
:mod:`meshplan.runtime.validation.staged`: arrival skew and its distribution from synthetic
timestamps, clock offsets across hosts, nccl-tests' algbw/busbw of a measured message-curve
point against the comm model on the CPU testbed, the kernel rows against the GEMM model, the
checkpoint rows and the cross-world summary table, each against values derived by hand here.
The multi-process run (``validate --worlds 2,4``) is in tests/test_validate.py."""

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("torch")

from meshplan.checkpoint_bytes import dcp_write_bytes  # noqa: E402
from meshplan.config import load_config  # noqa: E402
from meshplan.plan import build_plan  # noqa: E402
from meshplan.runtime.validation.probe import CURVE_SIZES, curve_spec, probe_spec  # noqa: E402
from meshplan.runtime.validation.staged import (  # noqa: E402
    arrival_skew,
    checkpoint_rank_rows,
    clock_offsets,
    curve_rows,
    kernel_rows,
    percentile,
    skew_summary,
    staged_world,
    write_staged,
)
from meshplan.runtime.validation.options import Options  # noqa: E402
from meshplan.runtime.validation.scaling import scale_config  # noqa: E402
from meshplan.runtime.validation.summary import cross_world_lines, world_lines  # noqa: E402

TP_FSDP = Path(__file__).parent / "data" / "validate_llama8b_tp2sp_fsdp.toml"


def _call(op, group, t, phase="forward", size=64):
    return {"op": op, "group": list(group), "size_bytes": size, "phase": phase, "entry_s": t}


def test_skew_per_call_and_its_distribution_from_synthetic_timestamps():
    # 4 ranks: tp groups (0, 1) and (2, 3), dp group (0, 2); times in seconds on one clock.
    # tp (0,1): call 0 at 1.000 / 1.004 -> 4 ms, rank 1 last; call 1 at 2.010 / 2.000 -> 10 ms, rank 0 last
    # tp (2,3): call 0 at 1.001 / 1.003 -> 2 ms, rank 3 last; call 1 at 2.006 / 2.000 -> 6 ms, rank 2 last
    # dp (0,2): call 0 at 3.000 / 3.008 -> 8 ms, rank 2 last
    # send/recv and the pipeline's set-up vote are not group collectives: left out
    recs = {
        0: [_call("all-gather", (0, 1), 1.000), _call("send/recv", (0, 1), 1.5), _call("all-gather", (0, 1), 2.010),
            _call("reduce-scatter", (0, 2), 3.000, "backward"), _call("all-reduce", (0, 1), 0.5, "schedule-setup")],
        1: [_call("all-gather", (0, 1), 1.004), _call("all-gather", (0, 1), 2.000),
            _call("all-reduce", (0, 1), 0.9, "schedule-setup")],
        2: [_call("all-gather", (2, 3), 1.001), _call("all-gather", (2, 3), 2.006),
            _call("reduce-scatter", (0, 2), 3.008, "backward")],
        3: [_call("all-gather", (2, 3), 1.003), _call("all-gather", (2, 3), 2.000)],
    }
    axis = lambda r, g, op: "dp_shard" if tuple(g) == (0, 2) else "tp"
    rows = arrival_skew(recs, axis_of=axis, stage_of=lambda r: 0)
    got = [(r["axis"], tuple(r["group"]), r["call"], round(r["skew_s"] * 1e3, 9), r["last_rank"], r["first_rank"])
           for r in rows]
    assert got == [("tp", (0, 1), 0, 4.0, 1, 0), ("tp", (0, 1), 1, 10.0, 0, 1), ("dp_shard", (0, 2), 0, 8.0, 2, 0),
                   ("tp", (2, 3), 0, 2.0, 3, 2), ("tp", (2, 3), 1, 6.0, 2, 3)]
    assert all(r["predicted_s"] == 0.0 for r in rows)
    assert [round(x * 1e3, 9) for x in rows[1]["arrivals_s"]] == [10.0, 0.0]  # rank 0 came 10 ms after rank 1
    s = skew_summary(rows)
    # skews sorted: 2, 4, 6, 8, 10 ms -> median 6; p90 at position 0.9 * 4 = 3.6: 8 + 0.6 * 2 = 9.2; max 10
    assert (s["count"], round(s["median_s"] * 1e3, 9), round(s["p90_s"] * 1e3, 9), round(s["max_s"] * 1e3, 9)) == \
        (5, 6.0, 9.2, 10.0)
    # last ranks 1, 0, 2, 3, 2: rank 2 twice, the others once
    assert (s["last_rank"], s["last_count"], s["last_share"]) == (2, 2, 0.4)
    assert round(s["by_axis"]["tp"]["median_s"] * 1e3, 9) == 5.0  # 2, 4, 6, 10 -> (4 + 6) / 2
    assert s["by_axis"]["dp_shard"]["count"] == 1


def test_skew_groups_spanning_pipeline_stages_are_not_predicted_and_clocks_shift_across_hosts():
    recs = {0: [_call("all-reduce", (0, 3), 10.0)], 3: [_call("all-reduce", (0, 3), 12.25)]}
    # rank 3 on another host whose clock is 2 s ahead: it left the barrier at 7.0 on its clock, rank 0 at 5.0
    off = clock_offsets({0: {"host": "a", "barrier_exit_s": 5.0}, 3: {"host": "b", "barrier_exit_s": 7.0}})
    assert off == {0: 0.0, 3: 2.0}
    rows = arrival_skew(recs, off, stage_of=lambda r: 0 if r < 2 else 1)
    assert math.isclose(rows[0]["skew_s"], 0.25) and rows[0]["last_rank"] == 3 and rows[0]["predicted_s"] is None
    assert skew_summary([])["count"] == 0 and skew_summary([])["median_s"] is None
    assert percentile([5.0], 0.9) == 5.0 and percentile([0, 1, 2, 3], 0.5) == 1.5
    with pytest.raises(ValueError):
        percentile([], 0.5)


@pytest.fixture(scope="module")
def plan4(request):
    """tp 2 + SP x dp_shard 2 scaled as validate does, on a CPU testbed of 2 cores (share 0.5)."""
    mp = pytest.MonkeyPatch()
    mp.setattr("meshplan.runtime.testbed.cpu.os.sched_getaffinity", lambda pid: {0, 1})
    request.addfinalizer(mp.undo)
    cfg, _ = scale_config(load_config(TP_FSDP), 4, Options(seq_len=32))
    return build_plan(cfg)


def test_message_curve_spec_and_busbw_against_the_comm_model_by_hand(plan4):
    spec = curve_spec(plan4)
    kinds = sorted({(e["axis"], e["op"]) for e in probe_spec(plan4)})
    assert kinds == [("dp_shard", "all-gather"), ("dp_shard", "reduce-scatter"), ("tp", "all-gather"),
                     ("tp", "all-reduce"), ("tp", "reduce-scatter")]
    assert [(e["axis"], e["op"], e["size_bytes"]) for e in spec] == [(a, o, s) for a, o in kinds for s in CURVE_SIZES]
    assert CURVE_SIZES == (1024, 4096, 16384, 65536, 262144, 1048576, 4194304)
    assert {tuple(map(tuple, e["groups"])) for e in spec if e["axis"] == "tp"} == {((0, 1), (2, 3))}
    # measured: a 4 MiB all-gather over tp 2 in 10 ms
    S = 4 * 2**20
    rows = curve_rows(plan4, {"rows": [dict(axis="tp", op="all-gather", size_bytes=S, buffer_bytes=S, n_ranks=2,
                                            time_s=0.010, iters=3)]})
    r = rows[0]
    # nccl-tests: algbw = S / t = 419.4304 MB/s; busbw = algbw x (n-1)/n = 209.7152 MB/s
    assert math.isclose(r["measured_algbw_bytes_per_s"], 419.4304e6)
    assert math.isclose(r["measured_busbw_bytes_per_s"], 209.7152e6)
    # comm model, gloo ring on the testbed loopback (cpu_testbed.toml: 0.5 GB/s x share 2/4, 225 us per step):
    # 1 step x 225 us + (1/2) S / 0.25 GB/s = 225 + 8388.608 = 8613.608 us
    assert math.isclose(r["predicted_time_s"], 8613.608e-6, rel_tol=1e-9)
    assert math.isclose(r["predicted_busbw_bytes_per_s"], 0.5 * S / 8613.608e-6, rel_tol=1e-9)
    assert math.isclose(r["error"], 0.010 / 8613.608e-6 - 1, rel_tol=1e-9)
    # gloo runs a reduce-scatter as an all-reduce of the full buffer: 2 x 225 + 2 x (1/2) S / 0.25 GB/s,
    # while busbw keeps the nccl-tests factor (n-1)/n of the op
    rs = curve_rows(plan4, {"rows": [dict(axis="dp_shard", op="reduce-scatter", size_bytes=S, buffer_bytes=S,
                                          n_ranks=2, time_s=0.020, iters=3)]})[0]
    assert math.isclose(rs["predicted_time_s"], (450 + 16777.216) * 1e-6, rel_tol=1e-9)
    assert math.isclose(rs["measured_busbw_bytes_per_s"], S / 0.020 / 2)


def test_kernel_rows_against_the_gemm_model_by_hand(plan4):
    # 32x256x256 fp32 on the testbed "GPU" (one SM, 88.1 GFLOP/s x share 0.5 = 44.05 GFLOP/s, ceiling 1):
    # one 128x256 tile (or two 128x128 in two waves): 2 x 128 x 256 x 256 / 44.05e9 = 380.87 us, above the
    # memory time 4 x (32x256 + 256x256 + 32x256) B / 9.6 GB/s = 34.1 us
    rows = kernel_rows(plan4, [dict(m=32, n=256, k=256, dtype="fp32", seconds=761.74e-6)])
    want = 2 * 128 * 256 * 256 / 44.05e9
    assert rows[0]["kernel"] == "gemm" and rows[0]["shape"] == "32x256x256"
    assert math.isclose(rows[0]["predicted_s"], want, rel_tol=1e-9)
    assert math.isclose(rows[0]["error"], 761.74e-6 / want - 1, rel_tol=1e-9)
    att = kernel_rows(plan4, [dict(op="attention", batch=1, q_heads=16, kv_heads=4, seq_q=32, seq_kv=32, head_dim=8,
                                   dtype="fp32", forward_s=1e-4, backward_s=3e-4)])
    assert [r["kernel"] for r in att] == ["attention forward", "attention backward"]
    # flash model (compute/attention.flash_ops): 16 query-head blocks of 128 rows on one SM, rate 44.05 GFLOP/s;
    # forward 4 x 16 x 32 x 32 x 8 / 2 = 262144 FLOP (5.95 us) under its memory time, Q, O (16 heads) and
    # K, V (4 heads) read and written: 2 x 4 B x (2 x 32 x 16 + 2 x 32 x 4) x 8 / 9.6 GB/s = 8.533 us;
    # backward 2.5 x 262144 FLOP / 44.05 GFLOP/s = 14.878 us (above the same memory time)
    assert math.isclose(att[0]["predicted_s"], 2 * 4 * (2 * 32 * 16 + 2 * 32 * 4) * 8 / 9.6e9, rel_tol=1e-9)
    assert math.isclose(att[1]["predicted_s"], 2.5 * 262144 / 44.05e9, rel_tol=1e-9)
    assert math.isclose(att[1]["error"], 3e-4 / att[1]["predicted_s"] - 1)


def test_checkpoint_rows_per_rank(plan4):
    share = dcp_write_bytes(plan4.state, plan4.mesh)[0]
    recs = [dict(rank=r, bytes_written=int(share * 1.02), save_s=0.2, load_s=0.3) for r in range(4)]
    recs[1] = dict(rank=1, error="RuntimeError: disk")
    rows = checkpoint_rank_rows(plan4, recs, bytes_per_s=1e8)
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    assert rows[1]["measured_bytes"] is None and rows[1]["note"] == "RuntimeError: disk"
    assert math.isclose(rows[0]["bytes_error"], int(share * 1.02) / share - 1)
    assert math.isclose(rows[0]["predicted_save_s"], share / 1e8)
    assert checkpoint_rank_rows(plan4, recs)[0]["predicted_save_s"] is None
    assert checkpoint_rank_rows(plan4, []) == []


def test_cross_world_table_and_world_sections():
    def st(skew, kerr, ckerr, bus):
        return dict(world=0, skew_summary=skew_summary([dict(axis="tp", skew_s=x, last_rank=1) for x in skew]),
                    skew_prediction="0 s", skew_clock="one host", curve_wall_s=1.5, missing=[],
                    kernels=[dict(kernel="gemm", shape="1x1x1", predicted_s=1e-5, measured_s=1e-5 * (1 + e), error=e)
                             for e in kerr],
                    checkpoint=[dict(rank=r, predicted_bytes=100, measured_bytes=100 * (1 + e), bytes_error=e,
                                     predicted_save_s=None, save_s=0.1, predicted_load_s=None, load_s=0.1)
                                for r, e in enumerate(ckerr)],
                    curves=[dict(axis="tp", op="all-reduce", n_ranks=2, size_bytes=s, predicted_time_s=1e-3,
                                 measured_time_s=2e-3, error=1.0, predicted_busbw_bytes_per_s=p,
                                 measured_busbw_bytes_per_s=m) for s, p, m in bus])

    w2 = st([0.001, 0.003], [0.5, -0.1, 0.2], [0.01, 0.03], [(1024, 1e6, 5e5), (4194304, 4.75e8, 5.48e8)])
    w4 = st([], [], [], [])
    lines = cross_world_lines({4: w4, 2: w2})
    # world 2: median skew (1 + 3) / 2 = 2 ms; busbw of the largest size only; median kernel error of
    # +50%, -10%, +20% = +20%; checkpoint error of the busiest rank (rank 1, +3%)
    assert lines[-2] == "| 2 | 2000 us | tp all-reduce 4194304 B: 0.475 / 0.548 GB/s | +20% | +3% |"
    assert lines[-1] == "| 4 | n/a | n/a | n/a | n/a |"
    text = "\n".join(world_lines(w2, elapsed_s=45.0))
    assert "(1.5 s of the launch's 45 s)" in text
    assert "| tp | all-reduce | 2 | 1024 | 1000 us | 2000 us | +100% |" in text
    assert "| 1 | 100 | 103 | +3% | n/a | 100.0 ms | n/a | 100.0 ms |" in text
    assert "last to arrive most often: rank 1 (2 of 2, 100%)" in text


def test_staged_world_reads_the_files_of_a_world_and_writes_its_csvs(tmp_path, plan4):
    # 4 ranks on two hosts: ranks 2, 3 read a clock 1 s ahead (barrier exits 100.0 vs 101.0)
    for r in range(4):
        host, exit_s = ("a", 100.0) if r < 2 else ("b", 101.0)
        tp = [0, 1] if r < 2 else [2, 3]
        recs = [_call("all-gather", tp, exit_s + 0.010 + 0.002 * (r % 2)),
                _call("reduce-scatter", [r % 2, r % 2 + 2], exit_s + 0.050 + 0.005 * (r // 2))]
        (tmp_path / f"rank{r}").mkdir()
        (tmp_path / f"rank{r}" / "collectives.json").write_text(json.dumps(
            {"rank": r, "clock": {"host": host, "barrier_exit_s": exit_s}, "records": recs}))
        (tmp_path / f"rank{r}" / "checkpoint.json").write_text(json.dumps(
            {"rank": r, "bytes_written": 1000, "save_s": 0.1, "load_s": 0.2}))
    (tmp_path / "rank0" / "curves.json").write_text(json.dumps({"wall_s": 1.25, "rows": [
        dict(axis="tp", op="all-gather", size_bytes=1024, buffer_bytes=1024, n_ranks=2, time_s=1e-3, iters=5)]}))
    (tmp_path / "gemm_table.json").write_text(json.dumps({"rows": [dict(m=32, n=256, k=256, dtype="fp32",
                                                                         seconds=1e-3)]}))
    st = staged_world(plan4, tmp_path, lambda r, g, op: "tp" if g[1] == g[0] + 1 else "dp_shard")
    # after the offsets every tp call is 2 ms apart and every dp_shard call 5 ms: median of 2, 2, 5, 5 = 3.5 ms
    assert sorted(round(r["skew_s"] * 1e3, 6) for r in st["skew"]) == [2.0, 2.0, 5.0, 5.0]
    assert round(st["skew_summary"]["median_s"] * 1e3, 6) == 3.5 and st["skew_clock"].startswith("several hosts")
    assert st["curve_wall_s"] == 1.25 and len(st["curves"]) == 1 and len(st["kernels"]) == 1
    assert [r["measured_bytes"] for r in st["checkpoint"]] == [1000] * 4 and st["missing"] == []
    written = {}
    write_staged(tmp_path, st, lambda p, text: written.setdefault(p.name, text))
    assert sorted(written) == ["arrival_skew.csv", "checkpoint.csv", "kernels.csv", "message_curves.csv",
                               "staged.json"]
    assert written["arrival_skew.csv"].splitlines()[0].startswith("axis,group,phase,op,size_bytes,call,skew_s")
    assert written["arrival_skew.csv"].count("\n") == 5  # header and 4 calls
