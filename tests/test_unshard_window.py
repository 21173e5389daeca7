"""torch's window of 3 unsharded local stages (meshplan.pipeline.unshard_window) against torch
2.13's own lowering: ``_add_unshard_reshard`` on the real action lists of the schedule objects
(built on fake stages as tests/test_schedule_registry.py builds them, no process group), and
the gather flags the collective table and the timeline count (comm.fsdp_rows.fsdp_gather_flags
with the window)."""

from collections import Counter

import pytest
from torch.distributed.pipelining import schedules as S

from meshplan.comm.fsdp_rows import fsdp_gather_flags
from meshplan.pipeline.registry import get
from meshplan.pipeline.unshard_window import evicted, released_after, unshard_positions, unshards

from tests.test_schedule_registry import FakeStage

COMPUTE = (S.FORWARD, S.FULL_BACKWARD, S.BACKWARD_INPUT, S.BACKWARD_WEIGHT, S.OVERLAP_F_B)


def torch_unshards(schedule: str, p: int, m: int, v: int, rank: int, kind=S.UNSHARD) -> tuple[list, list]:
    """(UNSHARD (or ``kind``) positions as (compute ops before it, local chunk), compute ops'
    local chunks) of ``rank`` in torch's lowered order (``pipeline_order_with_comms``)."""
    sched = get(schedule)
    stages = [FakeStage(sched.virtual_stage(c, rank, p, v), p * v, p, rank, []) for c in range(v)]
    chunk_of = {st.stage_index: c for c, st in enumerate(stages)}
    run = getattr(S, sched.torch_class)(stages, m)
    pos, ops = [], []
    for a in run.pipeline_order_with_comms[rank]:
        if a.computation_type == kind:
            pos.append((len(ops), chunk_of[a.stage_index]))
        elif a.computation_type in COMPUTE:
            for x in (a.sub_actions if a.computation_type == S.OVERLAP_F_B else (a,)):
                ops.append(chunk_of[x.stage_index])
    return pos, ops


CASES = [("interleaved_1f1b", p, m, v) for p, m, v in
         [(2, 2, 4), (2, 8, 4), (2, 4, 5), (4, 8, 4), (3, 6, 6), (2, 8, 8), (4, 4, 2), (2, 4, 3)]] + \
        [("zbv", 2, 4, 2), ("dualpipev", 2, 4, 2)]


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_unshards_are_torchs(schedule, p, m, v):
    """On every rank, the UNSHARDs torch's ``_add_unshard_reshard`` inserts (where and of which
    chunk) are :func:`unshard_positions` of meshplan's order, and their number per chunk is
    :func:`unshards`' (ZB-V and DualPipeV: 2 stages per rank, one UNSHARD each)."""
    for r in range(p):
        pos, ops = torch_unshards(schedule, p, m, v, r)
        order = get(schedule).order(p, m, v, r)
        if schedule == "interleaved_1f1b":  # ZB-V / DualPipeV: a full B is meshplan's B + W
            assert ops == [u.chunk for u in order]
        assert sorted(pos) == unshard_positions(ops)
        chunks = [u.chunk for u in order]
        assert Counter(c for _, c in pos) == Counter(c for c, f in zip(chunks, unshards(chunks)) if f)
        if v <= 3:
            assert len(pos) == v
        # RESHARDs of a chunk with ops left (not of a chunk done with the step): right after
        # released_after's ops
        resh = [(i, c) for i, c in torch_unshards(schedule, p, m, v, r, S.RESHARD)[0] if c in ops[i:]]
        assert sorted(resh) == sorted((i + 1, ops[i]) for i in range(len(ops)) if released_after(ops)[i])


def test_hand_derived_eviction():
    """Interleaved 1F1B, p 2, m 2, v 4, rank 0: F0.c0 F1.c0 F0.c1 F1.c1 F0.c2 F1.c2 F0.c3 F1.c3
    B0.c3 B1.c3 B0.c2 B1.c2 B0.c1 B1.c1 B0.c0 B1.c0. Before op 0 the window is c0 c1 c2 (three
    UNSHARDs); before op 2 it is c1 c2 c3: c0 is evicted, c3 unsharded; before op 10 (B0.c2) it
    is c2 c1 c0: c3 evicted, c0 unsharded again for B0.c0. Chunk 1 is never evicted (only c2 and
    c3 between F1.c1 and B0.c1). 5 UNSHARDs, where the plan counted 4 before."""
    chunks = [u.chunk for u in get("interleaved_1f1b").order(2, 2, 4, 0)]
    assert chunks == [0, 0, 1, 1, 2, 2, 3, 3, 3, 3, 2, 2, 1, 1, 0, 0]
    assert evicted(chunks).tolist() == [False] * 14 + [True, False]
    assert released_after(chunks).tolist() == [False, True] + [False] * 14  # RESHARD of c0 before op 2
    assert unshard_positions(chunks) == [(0, 0), (0, 1), (0, 2), (2, 3), (10, 0)]
    assert torch_unshards("interleaved_1f1b", 2, 2, 4, 0)[0] == [(0, 0), (0, 1), (0, 2), (2, 3), (10, 0)]


@pytest.mark.parametrize("p,m,v", [(2, 8, 4), (4, 8, 4), (2, 4, 6)])
def test_gather_flags_count_torchs_unshards(p, m, v):
    """With ``reshard_after_forward`` false FSDP2 never reshards a chunk before its last
    backward, so every all-gather of a chunk is a schedule UNSHARD: the passes the collective
    table counts as gathering (window 3) are torch's UNSHARDs, per chunk, on every rank; without
    the window the table counted one per chunk (pp 2, vpp 4, m 8, rank 0: 15 against 4)."""
    for r in range(p):
        pos, _ = torch_unshards("interleaved_1f1b", p, m, v, r)
        flags = fsdp_gather_flags("interleaved_1f1b", p, m, v, r, False, window=3)
        assert Counter(c for (c, _, _), g in flags.items() if g) == Counter(c for _, c in pos)
        assert sum(fsdp_gather_flags("interleaved_1f1b", p, m, v, r, False).values()) == v
    assert len(torch_unshards("interleaved_1f1b", 2, 8, 4, 0)[0]) == 15


@pytest.mark.parametrize("p,m,v", [(2, 2, 4), (2, 8, 4), (4, 8, 5)])
def test_runtime_names_each_unshard_by_the_pass_it_prefetches_for(p, m, v):
    """runtime.execution.unshard_labels: each UNSHARD of a chunk is named by the chunk's next
    compute action in torch's lowered order, which is the pass the plan counts the gather on
    (reshard_after_forward false: the passes fsdp_gather_flags flags, in order). Hand-derived
    for p 2, m 2, v 4, rank 0: chunk 0 is unsharded before F0.c0 and again before B0.c0."""
    from meshplan.runtime.execution.unshard_labels import unshard_phases

    sched = get("interleaved_1f1b")
    for r in range(p):
        stages = [FakeStage(sched.virtual_stage(c, r, p, v), p * v, p, r, []) for c in range(v)]
        actions = S.ScheduleInterleaved1F1B(stages, m).pipeline_order_with_comms[r]
        flags = fsdp_gather_flags("interleaved_1f1b", p, m, v, r, False, window=3)
        for c, st in enumerate(stages):
            want = [{"F": "forward", "B": "backward"}[k] for (ch, k, _), g in flags.items() if g and ch == c]
            assert list(unshard_phases(actions, st.stage_index)) == want
    if (p, m, v) == (2, 2, 4):
        stages = [FakeStage(sched.virtual_stage(c, 0, 2, 4), 8, 2, 0, []) for c in range(4)]
        assert unshard_phases(S.ScheduleInterleaved1F1B(stages, 2).pipeline_order_with_comms[0], 0) == \
            ("forward", "backward")
