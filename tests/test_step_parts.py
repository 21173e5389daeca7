"""The step split on its critical stage (StepTime.parts_s): compute + bubble + exposed per stream
= the step, where a blocking pp send (Megatron-LM 2022's rendezvous) exposes its transfers
only and its wait for the partner stage is bubble (pipeline_exposure.pp_hold_split)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from meshplan.cli import main
from meshplan.schedule.pipeline_exposure import call_loads, call_seconds, pp_hold_split
from meshplan.schedule.steptime import step_time

from tests.test_pp_schedule_runs import plan_of as runs_plan

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from fidelity import plan_of as fidelity_plan  # noqa: E402

D4 = "megatron-175b_64xa100_tp8-pp8-vpp3_sp-selective.toml"


@pytest.fixture(scope="module")
def d4():
    plan = fidelity_plan(D4)
    return plan, step_time(plan)


def test_d4_parts_by_hand(d4):
    """D4 (Korthikanti et al. 2022, GPT-3 175B, tp 8 x pp 8, interleaved 1F1B v 3, 64
    micro-batches of 1, SP + selective, Megatron-LM 2022: blocking sends), stage 0 critical.

    p2p: one send of 1/tp of the activation with SP, 1 x 2048 x 12288 x 2 B / 8 = 6,291,456 B,
    through one HDR NIC on the S18 pair curve (tests/test_busbw.py): 9.3 us + (0.5 GiB /
    15.48 GB/s - 9.3 us) x 6,291,456 / 0.5 GiB = 415.616 us.

    Transfers of stage 0's calls (each call takes k p2p, k = max(sends, receives): they share
    the NIC). Megatron's order: warm-up (p - 1) 2 + (v - 1) p = 30 forwards, 192 - 30 = 162
    steady F+B pairs, 30 cool-down backwards. Forward k of stage 0 runs chunk (k mod 24) // 8,
    backward k chunk 2 - (k mod 24) // 8. Warm-up: one call after each F, sending its output
    and receiving at most the next F's input (chunk 1, 2: from stage 7; the last warm-up call
    also receives B0's gradient, the next F30 is chunk 0): k = 1, 30 calls. Steady pair j
    (F30+j, Bj): the call after Bj sends F30+j's output and, for Bj of chunk 1 or 2 (j mod 24 <
    16), Bj's input gradient to stage 7; receives Bj+1's gradient and, for F31+j of chunk 1 or 2
    ((31 + j) mod 24 >= 8: j mod 24 not in {0, 17..23}), its input: k = 1 when j mod 24 in
    17..23 (7 of every 24: 6 x 7 over j < 144, plus j = 161: 43), else 2 (119): 43 + 238 =
    281. Cool-down: after B162..B190 one receive (the next B's gradient), sending at most one: k
    = 1, 29 calls; B191 (chunk 0) sends nothing. 30 + 281 + 29 = 340 transfers, exposed pp =
    340 x 415.616 us = 141.31 ms (it was 817.83 ms: every hold). The rest of the holds (817.83 -
    141.31 = 676.52 ms) is stage 0 waiting for its partner stages: bubble (stage 0 never waits
    between units otherwise: its input comes in the calls). compute = stage 0's 384 units (12,474.50
    ms) less the tp exposed inside them (1,394.47 ms) + the optimizer step (97.20 ms) = 11,177.23
    ms. After the last unit, before the optimizer, the per-step reductions (Megatron-LM: not
    overlapped), each exposed on the group it runs on (the plan's table): tp 0.10 ms (the SP
    norms' and row-parallel biases' coalesced all-reduce, 3,538,944 B), pp 16.88 ms (the tied
    embedding's gradient between stages 0 and 7: 51,200 padded vocab x 12,288 / tp 8 x 4 B fp32
    = 314,572,800 B), so exposed pp = 141.31 + 16.88 = 158.19 ms and tp = 1,394.47 + 0.10 =
    1,394.57 ms (both were 16.98 ms of "dp" at dp 1 until the per-step rows took their own
    group's stream). The step itself is
    the one before the split: 13,406.51 ms. (Before dV took dK's orientation, compute/attention.py
    score_ops: 12,411.50, 11,114.23, bubble 673.90, step 13,340.89 ms; each of the 768 layer
    passes gained 86.25 us: dV, 12 heads of (2048, 128, 2048), 66.62 -> 152.86 us at dK's D S7a
    rate, 84.3 TFLOP/s: 66.24 ms. Then apex's persistent layer norm backward at h 12,288, 256 SP
    rows: per norm 2 fewer passes (-12.58 MB) but its partial dgamma and dbeta written, 108 x
    12,288 x 8 B = 10.62 MB, at the norm curve's 1.55 TB/s: -1.27 us, and read back by its
    finalize kernel, 6.27 us at Triad: +5.00 us, two norms per layer pass: 7.68 ms; step
    13,409.54 -> 13,417.83 ms. Then the D S7a points derived with S7a's alpha passes and without an
    output-gradient copy: each of the 8 batched products of a layer pass 152.86 -> 151.08 us (84.3
    -> 85.3 TFLOP/s): -10.92 ms; step 13,406.51 ms.) Megatron-LM's get_batch broadcasts over tp (two
    NCCL broadcasts, 29.85 us in each of the 64 x 3 chunk forwards: 5.73 ms) run on the tp stream,
    blocking, since calib37: exposed tp 1,394.57 + 5.73 = 1,400.30 ms, compute 11,177.65 - 5.73 =
    11,171.92 ms (before, they were compute, which a calibration of the NVLink then moved); the step
    is unchanged. Then the batched attention products read on the "D S7a" plane (compute/measured.py
    _batched_plane): 12 heads of 2048 x 128, M 24,576 against the plane's 262,144, Shepard's 85.28
    TFLOP/s each before; now the point's 93.0 x the shape model's waves: K = d products (QK^T, dP,
    QK^T recomputed: 3 a layer pass) in 128x128 tiles, 3,072 in 29 waves of 108 (3,132) against
    32,768 in 304 (32,832): 91.40 TFLOP/s, 151.08 -> 140.98 us; N = d products (PV, dQ, dK, dV, PV
    recomputed: 5) 192 tiles in 2 waves (216) against 2,048 in 19 (2,052): 82.83, 151.08 -> 155.56
    us. 3 x -10.10 + 5 x 4.48 = -7.92 us a layer pass, x 768 = -6.08 ms: compute 11,171.92 ->
    11,165.84 ms, bubble (the partners' waits) 676.53 -> 676.31 ms, held 817.84 -> 817.62 ms, step
    13,406.94 -> 13,400.64 ms. Then the A100 NVLink curve with all 20 of S15's rows (fid22): the SP
    all-gathers and reduce-scatters of 50,331,648 B (48 MiB) read their all-reduce time between S15's
    32M row (423.97 us) and its 64M row (684.62 us; before, the line to the 128M row): 554.30 us in place
    of 574.61, each 10.8 + (554.30 - 15.0) / 2 = 280.45 us in place of 290.60 (tests/test_comm_curves.py):
    the tp exposed inside the units 1,394.47 -> 1,345.73 ms, exposed tp 1,400.30 -> 1,351.57 ms; the
    overlapped backward ones slow the compute beside them (their NCCL SM share) 10.15 us less each:
    compute 11,165.84 -> 11,158.91 ms; held 817.62 -> 816.22 ms, bubble 676.31 -> 674.91 ms, step
    13,400.64 -> 13,343.57 ms. Then (the 175B audit against 2755bcb) each of stage 0's 222 p2p calls
    (192 + 30 warm-up) pays its timer's 2 syncs and _communicate's own, 666 x 4.7 us = 3.13 ms of
    compute at the stage's end, and stage 7's last-chunk backwards the loss scale's multiply and its
    backward (2 x 4.7 us x 64 = 0.60 ms), which stage 0 waits for in its calls: held 816.22 -> 816.82
    ms, bubble 674.91 -> 675.51 ms, compute 11,158.91 -> 11,162.04 ms, step 13,343.57 -> 13,347.30 ms.
    Then the two transfers of one call through the one NIC pay their fixed part once (one NCCL
    group: pipeline/rendezvous.link_load; the pair time p2p_pair_s is one transfer of 2 x 6 MiB
    on the pair curve, 9.3 us + 12,582,912 B at its rate: 2 p2p - 9.30 us): the 119 calls of k = 2
    take 9.30 us less each, exposed pp 141.31 -> 140.20 ms (340 x 415.616 - 119 x 9.30 us), 158.19
    -> 157.08 ms with the tied all-reduce, held 816.82 -> 815.71 ms, bubble unchanged (675.51 ms),
    step 13,347.30 -> 13,346.19 ms."""
    plan, st = d4
    res, s = st.pipeline, st.critical_stage
    send = [r for r in plan.stage(0).collectives if r.op == "send/recv"][0]
    t1 = 0.5 * 2**30 / 15.48e9
    p2p = 9.3e-6 + (t1 - 9.3e-6) * 6291456 / (0.5 * 2**30)
    assert send.size_bytes == 6291456 and res.spec.p2p_s == pytest.approx(p2p, rel=1e-9) == send.time_s
    assert s == 0 and round(st.step_s * 1e5) == 1334619  # 13,346.19 ms (13,347.30 with the NIC latency twice)
    fixed = 2 * p2p - res.spec.p2p_pair_s  # the pair's fixed part: the pair curve's 9.3 us latency
    assert round(fixed * 1e8) == 930
    sent = 340 * p2p - 119 * fixed  # the 119 calls of k = 2 pay it once
    loads = call_loads(res)[0]  # the leading call (none on stage 0), then one after each unit
    assert loads[0] == 0 and loads.sum() == 340
    assert np.bincount(loads[1:].astype(int)).tolist() == [162 + 1, 30 + 43 + 29, 119]  # + 1: after B191
    tied, norms = (next(r for r in plan.stage(0).collectives if r.phase == "step" and r.axis == a)
                   for a in ("pp", "tp"))
    assert (tied.op, tied.size_bytes, norms.op, norms.size_bytes) == ("all-reduce", 314572800, "all-reduce", 3538944)
    parts = st.parts_s()
    assert parts["exposed pp"] == pytest.approx(sent + tied.time_s, rel=1e-9) == st.exposed_s["pp"]
    assert [round(x * 1e5) for x in (340 * p2p, sent, tied.time_s, parts["exposed pp"])] == [14131, 14020, 1688, 15708]
    bcast = [o.seconds for o in st.units.chunks[0][0].batch.ops if o.name == "get_batch broadcasts"]
    assert len(bcast) == 1 and round(bcast[0] * 1e8) == 2985 and round(192 * bcast[0] * 1e5) == 573
    assert round((parts["exposed tp"] - norms.time_s - 192 * bcast[0]) * 1e5) == 134573
    assert round(norms.time_s * 1e5) == 10
    sl = res.stage_slice(0)
    held = float(res.hold[sl].sum())
    assert round(held * 1e5) == 81571 and not res.wait[sl].any()
    assert parts["bubble"] == pytest.approx(held - sent, rel=1e-12)
    opt = [e.dur_s for e in st.post_events if e.stage == 0 and e.name == "optimizer step"][0]
    syncs = [e.dur_s for e in st.post_events if e.stage == 0 and e.name == "pipeline p2p calls' syncs"][0]
    assert syncs == pytest.approx(3 * 222 * 4.7e-6, rel=1e-9)
    inside = st.exposed_s["tp"] - norms.time_s  # the tp exposed inside the units (the step-end all-reduce's apart)
    assert parts["compute"] == pytest.approx(res.busy_s[0] - inside + syncs + opt, rel=1e-12)
    assert [round(parts[k] * 1e5) for k in ("compute", "bubble", "exposed tp")] == [1116204, 67551, 135157]
    assert set(parts) == {"compute", "bubble", "exposed tp", "exposed pp"}  # no "dp" at dp 1
    assert sum(parts.values()) == pytest.approx(st.step_s, abs=1e-9)
    split = pp_hold_split(res, 0)
    assert np.allclose(split.transfer_s + split.wait_s, res.hold[sl], rtol=0, atol=1e-15)


def _main(argv) -> None:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert not done.value.code


def test_d4_prints_parts_adding_to_the_step(capsys):
    _main(["step", str(ROOT / "benchmarks" / "fidelity" / D4)])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("step on stage"))
    # test_d4_parts_by_hand's parts (since the two-transfer calls pay the NIC latency once: exposed pp
    # 158.19 -> 157.08 ms; compute 11,162.04 printed 11,162.03 by the largest-remainder rounding to the step)
    assert line == ("step on stage 0 = compute 11162.03 + bubble 675.51 + exposed pp 157.08 + exposed tp 1351.57 = "
                    "13346.19 ms")
    assert "exposed communication on stage 0: pp 157.08 ms, tp 1351.57 ms" in out  # largest-remainder rounding, as the line
    assert out.splitlines()[0].startswith("step 13346.19 ms")


def test_printed_parts_add_up_to_the_printed_step():
    """Each part rounded to 0.01 ms alone can miss the rounded step by a few 0.01 ms; the line
    rounds by largest remainder, so its terms add up to its step exactly, each within 0.01 ms."""
    st = step_time(runs_plan(runs=2))
    line = st.parts_line()
    terms, total = line.split(" = ")[1], line.split(" = ")[2]
    cents = [round(float(t.split()[-1]) * 100) for t in terms.split(" + ")]
    assert sum(cents) == round(float(total.split()[0]) * 100) == round(st.step_s * 1e5)
    for t, c in zip(terms.split(" + "), cents):
        assert abs(c - st.parts_s()[t.rsplit(" ", 1)[0]] * 1e5) < 1


def test_later_runs_repeat_run_one():
    """training.pp_schedule_runs 2 (1F1B, p 2, zero3): each run is one run of 2 micro-batches
    (tests/test_pp_schedule_runs.py), so every part but the optimizer step doubles."""
    two, half = step_time(runs_plan(runs=2)), step_time(runs_plan(runs=1, global_batch=4))
    a, b = two.parts_s(), half.parts_s()
    opt = [e.dur_s for e in half.post_events if e.name == "optimizer step" and e.stage == half.critical_stage][0]
    assert a["compute"] - opt == pytest.approx(2 * (b["compute"] - opt), rel=1e-12)
    assert a["bubble"] == pytest.approx(2 * b["bubble"], rel=1e-9) and b["bubble"] > 0
    for parts, st in ((a, two), (b, half)):
        assert sum(parts.values()) == pytest.approx(st.step_s, rel=1e-12)


def test_step_json_holds_the_parts(tmp_path, capsys):
    out = tmp_path / "step.json"
    _main(["step", str(ROOT / "benchmarks" / "fidelity" / D4), "--json", str(out)])
    capsys.readouterr()
    doc = json.loads(out.read_text())
    parts = doc["step_parts_s"]
    assert parts["step"] == doc["step_s"]
    assert sum(v for k, v in parts.items() if k != "step") == pytest.approx(doc["step_s"], abs=1e-9)
    assert parts["exposed pp"] == doc["exposed_s"]["pp"]


@pytest.mark.parametrize("schedule,vpp,framework", [
    ("1f1b", 1, "torch"), ("gpipe", 1, "torch"), ("zb_h1", 1, "torch"), ("interleaved_1f1b", 2, "torch"),
    ("zbv", 2, "torch"), ("dualpipev", 2, "torch"), ("1f1b", 1, "megatron"), ("interleaved_1f1b", 2, "megatron"),
    ("interleaved_1f1b", 2, "megatron-overlap")])
def test_parts_add_up_on_every_schedule(schedule, vpp, framework):
    """Llama-3-8B, pp 4 x dp_shard 2 x tp 4 on 4 DGX H100 (tests/test_fast_pipeline.py's mesh):
    every part >= 0 and compute + bubble + exposed = the step, under torch's asynchronous sends
    and Megatron-LM's blocking ones (whose exposed pp is then exactly the calls' transfers,
    pipeline_exposure.call_seconds: k p2p, or with two on one link the pair's fixed part once,
    ``pp_p2p_overlap = false``); with its overlap_p2p_comm (the default) the waited warm-up and
    cool-down calls' transfers plus, for each unit that waited for an asynchronous receive, that
    wait up to one transfer."""
    from dataclasses import replace
    from meshplan.plan import build_plan
    from tests.test_fast_pipeline import _plan
    plan = _plan(schedule, vpp)
    if framework.startswith("megatron"):
        cfg = plan.config
        plan = build_plan(replace(cfg, training=cfg.training.model_copy(update={
            "framework": "megatron", "sharding": "zero1", "pp_p2p_overlap": framework == "megatron-overlap"})))
    st = step_time(plan)
    parts = st.parts_s()
    assert min(parts.values()) >= 0 and parts["compute"] > 0
    assert sum(parts.values()) == pytest.approx(st.step_s, rel=1e-12)
    if framework.startswith("megatron"):
        res, s = st.pipeline, st.critical_stage
        assert res.spec.overlap_p2p == (framework == "megatron-overlap")
        xfer = call_seconds(res)[s]
        last = 0.0 if not res.hold[res.stage_slice(s)][-1] else float(xfer[-1])
        sl = res.stage_slice(s)
        via = res.via_at(np.arange(sl.start, sl.stop))
        waited = float(np.where(via, np.minimum(res.spec.p2p_s, res.wait[sl]), 0.0).sum())
        assert (waited > 0) == (framework == "megatron-overlap")
        assert parts.get("exposed pp", 0.0) == pytest.approx(float(xfer.sum()) - float(xfer[-1]) + last + waited,
                                                             rel=1e-12)
