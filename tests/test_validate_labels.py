"""Validate's kernel and calibration rows say what they count (newcomer trial 21).

The trial read ``attention forward 24 us vs 321 us`` (local kernels) beside ``step part:
attention kernels 2.47 vs 1.26 ms``: the first is one call (the kernel-efficiency model against
the timed call), the second one step (calls per step x the timed call's time against the
profiled step's SDPA ops); the notes now give the count. And ``+865%`` calibrated against
``+560%`` plain: one line says why (the probe's collectives are faster than alpha-beta; the
gap is the untimed rest) and what to do.
"""

from pathlib import Path

import pytest

from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.runtime.validation.breakdown import per_step_notes, predicted_parts
from meshplan.runtime.validation.evidence import calibration_line

DATA = Path(__file__).parent / "data"


def test_step_part_notes_count_calls_per_step():
    plan = build_plan(load_config(DATA / "validate_llama8b_tp2sp_fsdp.toml"))
    # global batch 64 / (micro-batch 1 x dp 4) = 16 micro-batches; 32 layers, one attention each
    assert plan.micro_batches == 16
    notes = per_step_notes(plan, None)
    att = notes["attention kernels"]
    assert att.startswith("per step: 512 forward x ") and " + 512 backward x " in att
    # 7 GEMMs a layer (wq, wk, wv, wo, gate, up, down) x 3 (forward, data and weight gradient) x 32 layers
    # + the output layer's 3, per micro-batch
    assert notes["GEMM kernels"].startswith(f"per step: {16 * (32 * 21 + 3)} GEMM calls")
    # the per-call times the note prints make up the predicted part: 512 x (fwd + bwd)
    fwd_us, bwd_us = (float(att.split(" x ")[i].split(" us")[0]) for i in (1, 2))
    assert predicted_parts(plan, None)["attention kernels"] == pytest.approx(512 * (fwd_us + bwd_us) * 1e-6, rel=2e-3)


def _rows(plain_p, cal_p, meas):
    return [dict(quantity="step time", predicted=plain_p, measured=meas, error=meas / plain_p - 1),
            dict(quantity="step time (calibrated)", predicted=cal_p, measured=meas, error=meas / cal_p - 1),
            dict(quantity="collective time (sum)", predicted=0.0487, measured=0.3),
            dict(quantity="collective time (sum) (calibrated)", predicted=0.0181, measured=0.3),
            dict(quantity="step part: the rest", predicted=0.0053, measured=0.3069)]


def test_calibration_line_when_calibrated_is_further_off():
    line = calibration_line(_rows(0.0533, 0.0371, 0.2807))  # the trial's shape: +427% plain, +657% calibrated
    assert line.startswith("calibrated further off than plain (+657% vs +427%)")
    assert "collectives at 18.1 ms per step against the cluster description's 48.7 ms" in line
    assert "`step part: the rest` 306.9 ms measured vs 5.3 ms predicted" in line and "--worlds" in line
    assert calibration_line(_rows(0.0371, 0.0533, 0.0600)) is None  # calibrated closer: nothing to explain


def test_collective_rows_read_each_trace_once_for_the_plain_and_calibrated_rows(tmp_path, monkeypatch):
    """``collective time (sum)`` and its calibrated twin are measured on the same gloo events:
    each rank's trace (megabytes of JSON after a profiled step) is read once for both. Traces by
    hand: rank 0 two gloo events of 1 ms and 3 ms (4 ms), rank 1 one of 5 ms, plus a non-gloo
    op: the slowest is rank 1 at 5 ms, the fastest 4 ms. Calibrated: every table call at the
    probe's 1 ms, so its prediction is the table's calls x 1 ms."""
    import json

    from meshplan.runtime.validation import evidence
    from meshplan.runtime.validation.options import Options
    from meshplan.runtime.validation.probe import calibrated_plan
    from meshplan.runtime.validation.scaling import scale_config

    cfg, _ = scale_config(load_config(DATA / "validate_llama8b_tp2sp_fsdp.toml"), 2, Options(layers=2, seq_len=32))
    plan = build_plan(cfg)
    table = [r for rows in plan.collectives.values() for r in rows]
    cplan, _ = calibrated_plan(plan, {"rows": [dict(axis=r.axis, op=r.op, size_bytes=int(r.size_bytes), time_s=1e-3)
                                               for r in table]})
    events = {0: [("gloo:all_reduce", 1000), ("gloo:all_gather", 3000), ("aten::mm", 9000)],
              1: [("gloo:all_reduce", 5000)]}
    for rank, evs in events.items():
        (tmp_path / f"rank{rank}").mkdir()
        (tmp_path / f"rank{rank}" / "trace.json").write_text(json.dumps(
            {"traceEvents": [dict(ph="X", name=n, ts=0, dur=d) for n, d in evs]}))
    reads = []
    read = evidence.trace_collective_s
    monkeypatch.setattr(evidence, "trace_collective_s", lambda p: reads.append(p) or read(p))
    plain, cal = evidence._collective_rows(tmp_path, plan, cplan)
    assert len(reads) == 2  # world 2: one read per rank
    assert [r["quantity"] for r in (plain, cal)] == ["collective time (sum)", "collective time (sum) (calibrated)"]
    for row in (plain, cal):
        assert (row["measured"], row["measured_min"], row["rank"]) == (pytest.approx(0.005), pytest.approx(0.004), 1)
        assert row["note"].endswith("measured: 1 gloo:* events of the profiled step (profiler on)")
    calls = sum(r.per_step for r in plan.stage(0).collectives)
    assert cal["predicted"] == pytest.approx(calls * 1e-3)
    assert f"predicted: {calls} table calls x the probe's" in cal["note"]
    assert plain["predicted"] == pytest.approx(sum(r.time_s * r.per_step for r in plan.stage(0).collectives))
    assert evidence._collective_rows(tmp_path, plan) == [plain]  # without the probe: the plain row alone
