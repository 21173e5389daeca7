"""Where the timeline runs torch's UNSHARD all-gathers (meshplan.schedule.window_unshard), each
chunk's first ones and the window's re-gathers: from the UNSHARD torch 2.13's
``_add_unshard_reshard`` places (read off torch's own lowered program, as
tests/test_unshard_window.py does), waited for by the pass that needs the chunk.

The plan: interleaved 1F1B, pp 2 x dp_shard 2, vpp 4, the 8-layer TINY model (one layer per virtual
stage), zero3 with reshard_after_forward false (FSDP2 then never reshards a chunk itself: every
all-gather after a chunk's first is the window's). Stage 0 (rank 0) at m 2 runs F0.c0 F1.c0 F0.c1
F1.c1 F0.c2 F1.c2 F0.c3 F1.c3 B0.c3 B1.c3 B0.c2 B1.c2 B0.c1 B1.c1 B0.c0 B1.c0: chunk 0 is evicted
before op 2 and unsharded again by the UNSHARD torch puts before op 10 (B0.c2), after op 9 (B1.c3),
4 ops ahead of B0.c0 (op 14) that needs it: layer 0's unit and the embedding's (root_embed).
Before op 0 torch UNSHARDs chunks 0, 1 and 2 (the window's first three), before op 2 chunk 3.
"""

import math

import pytest

from meshplan.schedule.comm_times import CommTimes
from meshplan.schedule.backward_pass import backward_unit
from meshplan.schedule.steptime import step_time
from meshplan.schedule.unit_sim import Overlap
from meshplan.schedule.workload import chunk_costs, workload_of

from tests.test_schedule_semantics import TINY, _mesh, plan_of, table_counts, timeline_counts
from tests.test_unshard_window import torch_unshards

PS = 1e-12  # the leads are rounded to the picosecond (window_unshard.simulate_unshards)


def _plan(m: int):
    return plan_of(_mesh("zero3", "interleaved_1f1b", 4), model=dict(TINY, layers=8), reshard_after_forward=False,
                   global_batch=2 * m)


def _row_s(plan, stage: int, group: str, phase: str = "backward") -> float:
    """Seconds of one ``phase`` all-gather of ``group`` ("layer", "root_embed") in stage's table."""
    return CommTimes.from_rows(plan.stage(stage).collectives).get("shard", phase, "all-gather", group)


def _in_pass_firsts(monkeypatch):
    """The timing before the first UNSHARDs were placed: UnitTimes given only the re-gathers (every
    chunk's first pass is an F; its gathers then run in the pass, FSDP2's per-layer prefetch)."""
    import meshplan.schedule.unit_times as ut

    real = ut.unshard_leads
    monkeypatch.setattr(ut, "unshard_leads", lambda *a: tuple(x for x in real(*a) if x[0][1] != "F"))


def _unshard_events(st, s: int) -> dict[int, float]:
    """Position in stage ``s``'s order -> absolute start of its pass's first UNSHARD all-gather."""
    res, out = st.pipeline, {}
    for j in range(res.flat.length):
        x = s * res.flat.length + j
        u = st.units.get(s, int(res.flat.chunk[x]), "FBW"[int(res.flat.kind[x])], int(res.flat.mb[x]))
        starts = [e.start_s for e in u.events if "(UNSHARD" in e.name]
        if starts:
            out[j] = float(res.start[x]) + min(starts)
    return out


def _stage_fsdp_s(st, s: int) -> float:
    """Exposed FSDP seconds of stage ``s``: its units' waits on the fsdp stream, summed."""
    res = st.pipeline
    return sum(st.units.get(s, int(res.flat.chunk[x]), "FBW"[int(res.flat.kind[x])], int(res.flat.mb[x]))
               .exposed_s.get("fsdp", 0.0) for x in range(s * res.flat.length, (s + 1) * res.flat.length))


def test_hand_derived_regather_starts_where_torch_issues_its_unshard(monkeypatch):
    """m 2, stage 0: torch's lowered program has its fifth UNSHARD (chunk 0) before op 10; in the
    timeline the re-gather of B0.c0 (op 14) starts when op 9 (B1.c3) ends, and, hidden behind ops
    10-13 (the lead is 0.64 ms, the gathers 27.5 us), B0.c0 waits for nothing on the FSDP stream.
    Before, it was all-gathered in the pass: layer 0's all-gather (its backward row, 14.96 us)
    exposed at the pass's start (the embedding's prefetched behind it): stage 0's exposed FSDP time
    drops by exactly that row's seconds (the in-pass timing rebuilt by giving UnitTimes no re-gather
    to lead)."""
    plan = _plan(2)
    assert torch_unshards("interleaved_1f1b", 2, 2, 4, 0)[0][-1] == (10, 0)
    st = step_time(plan)
    res = st.pipeline
    starts = _unshard_events(st, 0)
    assert list(starts) == [0, 2, 4, 6, 14]  # each chunk's first forward, and B0.c0
    assert starts[14] == pytest.approx(float(res.end[9]), abs=PS)
    b = st.units.get(0, 0, "B", 0)
    lay, emb = _row_s(plan, 0, "layer"), _row_s(plan, 0, "root_embed")
    lead = float(res.start[14] - res.end[9])  # B0.c0 starts when B1.c1 ends: no wait added
    assert res.start[14] == res.end[13] and lead > lay + emb
    assert b.exposed_s.get("fsdp", 0.0) == 0.0
    gathers = sorted((e.start_s, e.end_s) for e in b.events if "(UNSHARD" in e.name)
    assert gathers[-1][1] == pytest.approx(gathers[0][0] + lay + emb, rel=1e-12)  # back to back
    import meshplan.schedule.unit_times as ut

    real = ut.unshard_leads  # the first UNSHARDs kept: B0.c0's re-gather alone back in its pass
    monkeypatch.setattr(ut, "unshard_leads", lambda *a: tuple(x for x in real(*a) if x[0][1] == "F"))
    before = step_time(plan)
    assert before.units.get(0, 0, "B", 0).exposed_s["fsdp"] == pytest.approx(lay, rel=1e-12)
    assert _stage_fsdp_s(before, 0) - _stage_fsdp_s(st, 0) == pytest.approx(lay, rel=1e-9)


@pytest.mark.parametrize("m", [2, 8])
def test_every_unshard_starts_at_the_end_of_the_op_before_torchs_unshard(m):
    """Both stages, m 2 and 8: each UNSHARD of torch's lowered program before compute op i, a
    chunk's first (i 0 for chunks 0-2: the step's start) or a re-gather of an evicted chunk, starts
    its all-gathers in the timeline at the end of op i - 1 (0 at i = 0), in the pass of the
    chunk's next op, after the gathers of those torch issued before the same op ahead of it (at
    i 0 chunk 0's: layer 0's forward all-gather, 14.96 us, and on stage 0 the embedding's, 12.56
    us; then chunk 1's, layer 0's again); no other pass gathers so (5 UNSHARDs per stage at m 2, 15 and 13 at m 8: 4 of
    them each chunk's first). Before, only the re-gathers did: the chunks' first gathers ran in their
    first forward."""
    plan = _plan(m)
    st = step_time(plan)
    res = st.pipeline
    for s in range(2):
        pos, ops = torch_unshards("interleaved_1f1b", 2, m, 4, s)
        assert [c for i, c in pos if i == 0] == [0, 1, 2]
        lay = _row_s(plan, s, "layer", "forward")
        ahead = {0: lay + _row_s(plan, 0, "root_embed", "forward"), 1: lay, 2: lay} if s == 0 else {0: lay, 1: lay}
        want = {}
        for i, c in pos:
            b = ops.index(c, i)  # the pass that needs the chunk
            want[b] = float(res.end[s * res.flat.length + i - 1]) if i else sum(ahead[x] for x in range(c))
        starts = _unshard_events(st, s)
        assert len(want) == len(pos) == len(starts) == {(2, 0): 5, (2, 1): 5, (8, 0): 15, (8, 1): 13}[m, s]
        assert list(starts) == sorted(want)
        for b, t in starts.items():
            assert t == pytest.approx(want[b], abs=PS)


def test_first_unshards_start_at_the_step_start(monkeypatch):
    """By hand, m 2. Stage 0's F0.c0 (op 0): torch UNSHARDs chunk 0 before op 0, so layer 0's
    forward all-gather (14.96 us) and the embedding's (12.56 us) run back to back from the step's
    start and the forward waits for both: exposed FSDP = their sum, 27.52 us. Stage 1's F0.c0 waits
    for its input (stage 0's F0.c0 end + one pp transfer), the same 0 to that time is its lead, and
    its one layer gather hides there: exposed 0, the pass shorter by the 14.96 us it had exposed
    in the pass (its first layer's all-gather, nothing before it to hide behind). Chunks 1 and 2,
    UNSHARDed at the step's start too, queue behind chunk 0's gathers (and 2 behind 1's): their
    lead is their first forward's start less those; chunk 3, UNSHARDed before op 2, leads by its
    start less the end of op 1."""
    plan = _plan(2)
    st = step_time(plan)
    res, n = st.pipeline, st.pipeline.flat.length
    lay, emb = _row_s(plan, 0, "layer", "forward"), _row_s(plan, 0, "root_embed", "forward")
    f0 = st.units.get(0, 0, "F", 0)
    gathers = sorted((e.start_s, e.end_s) for e in f0.events if "(UNSHARD" in e.name)
    assert gathers[0][0] == pytest.approx(0.0, abs=PS) and gathers[1][1] == pytest.approx(lay + emb, rel=1e-12)
    assert f0.exposed_s["fsdp"] == pytest.approx(lay + emb, rel=1e-12)
    leads = st.units.leads[0]
    assert leads[(1, "F", 0)] == pytest.approx(float(res.start[2]) - (lay + emb), abs=PS)
    assert leads[(2, "F", 0)] == pytest.approx(float(res.start[4]) - (lay + emb) - lay, abs=PS)
    assert leads[(3, "F", 0)] == pytest.approx(float(res.start[6] - res.end[1]), abs=PS)
    arrival = float(res.end[0]) + res.spec.p2p_s
    assert res.start[n] == pytest.approx(arrival, rel=1e-12)
    assert st.units.leads[1][(0, "F", 0)] == pytest.approx(arrival, abs=PS)
    s1 = st.units.get(1, 0, "F", 0)
    assert s1.exposed_s.get("fsdp", 0.0) == 0.0
    _in_pass_firsts(monkeypatch)
    before = step_time(plan).units.get(1, 0, "F", 0)
    assert before.exposed_s["fsdp"] == pytest.approx(_row_s(plan, 1, "layer", "forward"), rel=1e-12)
    assert before.duration_s - s1.duration_s == pytest.approx(before.exposed_s["fsdp"], rel=1e-9)


def test_collective_counts_of_timeline_and_table_unchanged():
    """The re-gathers moved, not added: on each stage the timeline's calls per (kind, group, phase,
    op) still equal the table's per-step counts, at m 2 and 8."""
    for m in (2, 8):
        plan = _plan(m)
        st = step_time(plan)
        for s in range(2):
            assert timeline_counts(st, s) == table_counts(plan, s)


def test_exposed_fsdp_is_what_the_compute_between_does_not_hide():
    """B0.c0 of stage 0 timed from its own timeline with its UNSHARD ``lead`` seconds ahead:
    layer 0's and the embedding's backward all-gathers run back to back from -lead, the pass
    waits for both, so the exposed FSDP time is max(0, lay + emb - lead) and the pass lasts that
    much longer than with the gathers hidden; at lead 0 (an UNSHARD just before the pass) the
    whole chunk's gathers are exposed, more than the old in-pass timing's first layer alone."""
    plan = _plan(2)
    w = workload_of(plan)
    chunk = chunk_costs(plan, w)[0][0]
    comm = CommTimes.from_rows(plan.stage(0).collectives)
    lay, emb = _row_s(plan, 0, "layer"), _row_s(plan, 0, "root_embed")
    assert lay > 0 and emb > 0

    def unit(lead):
        return backward_unit("B", chunk, comm, w, Overlap(), last_grad_unit=False, gather=True, reduce=False,
                             deferred=True, stage_last=False, gather_root=True, lead_s=lead)

    hidden = unit(math.inf)
    for lead in (0.0, lay / 2, lay + emb / 2, lay + emb, 1e-3):
        u = unit(lead)
        want = max(0.0, lay + emb - lead)
        assert u.exposed_s.get("fsdp", 0.0) == pytest.approx(want, abs=PS)
        assert u.duration_s == pytest.approx(hidden.duration_s + want, abs=PS)
    in_pass = backward_unit("B", chunk, comm, w, Overlap(), gather=True, reduce=False, deferred=True,
                            stage_last=False)
    assert in_pass.exposed_s["fsdp"] == pytest.approx(lay, rel=1e-12)  # the old timing: layer 0's, at the start
    assert unit(0.0).exposed_s["fsdp"] == pytest.approx(lay + emb, rel=1e-12)


def test_pipeline_simulation_waits_for_an_earlier_unit_plus_seconds():
    """``simulate_arrays(after=...)`` (the first run of window_unshard.simulate_unshards): 1F1B at
    p 1, m 2 runs F0 B0 F1 B1, 1 s each, ending at 1, 2, 3, 4 s; B1 also waiting for F0's end
    plus 5 s starts at max(3, 1 + 5) = 6 s and ends at 7 s. The round loop of any times
    (run_rounds_general) gives the same."""
    import numpy as np

    from meshplan.pipeline.fast import flat_units, simulate_arrays
    from meshplan.pipeline.rounds import run_rounds_general
    from meshplan.pipeline.simulate import PipelineSpec

    spec = PipelineSpec("1f1b", p=1, m=2)
    after = (np.array([-1, -1, -1, 0]), np.array([0.0, 0.0, 0.0, 5.0]))
    r = simulate_arrays(spec, lambda f: np.ones(len(f.kind)), after=lambda f: after)
    assert r.end.tolist() == [1.0, 2.0, 3.0, 7.0] and r.start[3] == 6.0
    assert simulate_arrays(spec, lambda f: np.ones(len(f.kind))).end.tolist() == [1.0, 2.0, 3.0, 4.0]
    # per slot (unit k at slot k + 1, between a leading and a trailing slot; 7: the padding slot, end 0)
    slot_unit, slot_s = np.full(8, 7), np.zeros(8)
    slot_unit[4], slot_s[4] = 1, 5.0
    start, end = run_rounds_general(flat_units("1f1b", 1, 2, 1), np.ones(4), np.zeros(4), None, 0.0,
                                    after=(slot_unit, slot_s))[:2]
    assert end.tolist() == [1.0, 2.0, 3.0, 7.0]
