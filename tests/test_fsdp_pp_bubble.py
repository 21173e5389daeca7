"""Interleaved 1F1B with FSDP2 under torch 2.13's pipelining: the compute stream waits for each
chunk's reduce-scatters after the chunk's last backward (``PipelineStage.perform_reduce_grad``),
a real wait, so the step names the FSDP waits as their own term beside the schedule's bubble
(StepTime.without_fsdp_waits), in seconds on one stage and over one denominator so that they add up."""

from __future__ import annotations

import numpy as np
import pytest
from torch.distributed.pipelining import schedules as S

from meshplan.config import config_from_dict
from meshplan.pipeline.fast import simulate_arrays
from meshplan.pipeline.simulate import PipelineSpec
from meshplan.plan import build_plan
from meshplan.schedule.pipeline_exposure import pipeline_without
from meshplan.schedule.steptime import step_time

from tests.test_schedule_registry import FakeStage

P, V, M = 4, 2, 8


def _plan(sharding: str = "zero3"):
    """A Llama-3-8B on 8 H100: pp 4 x dp_shard 2, interleaved 1F1B with 2 chunks per stage (4
    layers each), 16 sequences / dp 2 = 8 micro-batches, zero3 (FSDP2), torch."""
    return build_plan(config_from_dict({
        "model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
        "training": {"global_batch": 16, "seq_len": 4096, "micro_batch": 1, "sharding": sharding,
                     "param_dtype": "bf16", "recompute": "full", "framework": "torch"},
        "mesh": {"names": ["pp", "dp_shard"], "shape": [P, 2], "virtual_stages": V,
                 "pp_schedule": "interleaved_1f1b"}}))


def test_torch_reduces_each_chunk_right_after_its_last_backward():
    """torch 2.13's ScheduleInterleaved1F1B lowers its order with ``_add_reduce_grad``: a
    REDUCE_GRAD of a stage right after its m-th backward. On rank 0 (virtual stages 0 and 4) that
    of stage 4 (chunk 1) comes after B7 of stage 4, before chunk 0's last backwards: its
    ``perform_reduce_grad`` ends in ``_root_post_backward_final_callback``, whose
    ``finalize_backward`` makes the compute stream wait for the reduce-scatters, so chunk 0's
    next backward waits for them. meshplan puts that wait inside the unit (B7 of chunk 1) and
    the stage's last chunk's reduction after its last unit (the tail)."""
    stages = [FakeStage(c * P, P * V, P, 0, []) for c in range(V)]
    order = [(a.computation_type, a.microbatch_index, a.stage_index)
             for a in S.ScheduleInterleaved1F1B(stages, M).pipeline_order_with_comms[0]
             if a is not None and a.computation_type in (S.FULL_BACKWARD, S.REDUCE_GRAD)]
    i = order.index((S.REDUCE_GRAD, None, 4))
    assert order[i - 1] == (S.FULL_BACKWARD, M - 1, 4)
    assert [x for x in order[i + 1:] if x[0] == S.FULL_BACKWARD] == [(S.FULL_BACKWARD, mb, 0) for mb in range(4, M)]
    assert order[-1] == (S.REDUCE_GRAD, None, 0)
    st = step_time(_plan())
    names = [e.name for e in st.units.get(0, 1, "B", M - 1).events]
    assert "perform_reduce_grad wait" in names
    assert "perform_reduce_grad wait" not in [e.name for e in st.units.get(0, 0, "B", M - 1).events]


def test_hand_derived_wait_lengthens_the_pipeline():
    """Interleaved 1F1B p 2, m 2, v 2, a chunk's F 0.5 s, B 1 s (bubble (p - 1) / (v m) = 0.25,
    step 7.5 s); a 0.5 s reduce-scatter wait after each stage's last backward of chunk 1:
    stage 1's B1.c1 runs 3.5-5, stage 0's B1.c1 5-6.5 (it needs stage 1's), B0.c0 6.5-7.5, B1.c0
    7.5-8.5: step 8.5 s; busy 6.5 s on each stage, bubble (8.5 - 6.5) / 6.5 = 4 / 13 = 0.25 +
    3 / 52: the schedule's 0.25 and the waits' 0.0577."""
    spec = PipelineSpec("interleaved_1f1b", 2, 2, v=2, forward_s=1.0, backward_s=2.0)
    f = simulate_arrays(spec).flat
    waits = np.where((f.kind == 1) & (f.chunk == 1) & (f.mb == 1), 0.5, 0.0)
    r = simulate_arrays(spec, lambda flat: np.where(flat.kind == 0, 0.5, 1.0) + waits)
    assert r.step_s == 8.5 and r.busy_s == (6.5, 6.5) and r.bubble == pytest.approx(4 / 13, abs=1e-15)
    s1 = r.stage_slice(1)
    assert (r.start[s1][5], r.end[s1][5]) == (3.5, 5.0)
    bare = pipeline_without(r, waits)
    assert bare.step_s == 7.5 and bare.bubble == 0.25
    assert r.bubble - bare.bubble == pytest.approx(3 / 52, abs=1e-15)
    # the line's split on one denominator (stage 0's compute without the waits, 6 s): idle and wait
    # 8.5 - 6 = 2.5 s = the schedule's 7.5 - 6 = 1.5 s + the waits' 8.5 - 7.5 = 1 s; 5/12 = 1/4 + 1/6
    assert bare.busy_s == (6.0, 6.0) and (bare.step_s - 6.0, r.step_s - bare.step_s) == (1.5, 1.0)


def test_bubble_line_shows_the_fsdp_waits_apart():
    st = step_time(_plan())
    bare = st.without_fsdp_waits()
    p = st.pipeline
    assert bare is not None and bare.step_s < p.step_s and bare.bubble < p.bubble
    lines = st.lines()
    tie = "" if p.busiest_stage == st.critical_stage else \
        f"; the step's parts below are on stage {st.critical_stage}, where the step ends"
    assert f"pipeline only, the units' FSDP waits counted as busy{tie}" in lines[1]
    # one stage, one denominator: its idle and wait time = the schedule's bubble + what the waits add
    s = p.busiest_stage
    c, y, z = float(bare.busy_s[s]), bare.step_s - float(bare.busy_s[s]), p.step_s - bare.step_s
    assert z > 0
    head = f"bubble and FSDP waits on stage {s}: "
    assert lines[2].startswith(head) and "(simulated without the units' FSDP waits) + " in lines[2]
    # the printed terms add up exactly (largest remainder rounding), each within one last digit of its value
    total, rest = lines[2][len(head):].split(" ms = the schedule's bubble ", 1)
    bub, rest = rest.split(" ms (simulated without the units' FSDP waits) + ", 1)
    add = rest.split(" ms the FSDP waits add", 1)[0]
    t_ms, y_ms, z_ms = (round(float(x) * 100) for x in (total, bub, add))
    assert t_ms == y_ms + z_ms
    for got, want in ((t_ms, (y + z) * 1e5), (y_ms, y * 1e5), (z_ms, z * 1e5)):
        assert abs(got - want) < 1
    ratios = lines[2].rsplit(": ", 1)[1].replace("=", "+").split(" + ")
    a, b, d = (round(float(x) * 1e4) for x in ratios)
    assert a == b + d and b >= 0 and d > 0
    for got, want in ((a, (y + z) / c * 1e4), (b, y / c * 1e4), (d, z / c * 1e4)):
        assert abs(got - want) < 1
    zero1 = step_time(_plan("zero1"))  # ZeRO-1: no FSDP collective inside the units
    assert zero1.without_fsdp_waits() is None and "FSDP waits" not in "\n".join(zero1.lines())


def test_headline_bubble_is_read_from_the_waits_line():
    """nc56 #6: the bubble line's idle/ideal counts the busiest stage's own FSDP waits as busy, so it is
    neither the schedule's bubble nor bubble + waits. The line after the waits line says what it is:
    stage s's idle (the waits line's total less its own waits) over its units' time with those waits.
    By hand from the pipelines: idle = step - busy[s]; own waits w = busy[s] - bare busy[s]; idle + w =
    step - bare busy[s], the waits line's total; idle / busy[s] = p.bubble (sim_types.ArrayResult.bubble)."""
    st = step_time(_plan())
    p, bare, lines = st.pipeline, st.without_fsdp_waits(), st.lines()
    s = p.busiest_stage
    idle, busy, w = p.step_s - float(p.busy_s[s]), float(p.busy_s[s]), float(p.busy_s[s] - bare.busy_s[s])
    assert w > 0 and idle / busy == pytest.approx(p.bubble, rel=1e-12)
    line = lines[3]
    assert line.startswith(f"the bubble line's {p.bubble:.4f} idle/ideal = stage {s}'s idle ")
    got_idle = float(line.split("'s idle ", 1)[1].split(" ms", 1)[0])
    got_busy = float(line.split("own FSDP waits ", 1)[1].split(" ms", 1)[0])
    total = float(line.split("its idle is the ", 1)[1].split(" ms", 1)[0])
    got_w = float(line.split("less those waits, ", 1)[1].split(" ms", 1)[0])
    assert abs(got_idle - idle * 1e3) <= 0.01 and abs(got_busy - busy * 1e3) <= 0.005 and abs(got_w - w * 1e3) <= 0.01
    assert round(total * 100) == round(got_idle * 100) + round(got_w * 100)  # printed to add up
    assert abs(total - (p.step_s - float(bare.busy_s[s])) * 1e3) <= 0.005  # the waits line's total
