"""The rank timeline issues every per-step row of the collective table (issue 11, item 3,
extending tests/test_schedule_semantics.py's agreement test to the rows it counts as one
"reduce"): the SP norms' weight-gradient all-reduces over tp and the tied embedding's over pp,
beside the data axes' reductions, for every schedule and sharding at pp 2 x data 2 x tp 2.
On each stage and group (:func:`~meshplan.schedule.comm_streams.step_stream`), the seconds the
timeline spends on the per-step reduction equal the table's ``time_s x per_step`` summed over
the group's rows; where a group's rows share one size, the calls that time makes (seconds /
one call's) and their bytes equal the table's ``per_step`` and ``per_step x size_bytes``.
Two gaps this closed: under pp > 1 with FSDP the norms' ``tp backward all-reduce`` row (once
per step, no micro-batch count) got 0 s; under ZeRO-2 the norms' per-step all-reduces were
never placed (the gradient units' pieces carry the micro-batch reduce-scatters instead)."""

from collections import defaultdict

import pytest

from meshplan.schedule.comm_streams import comm_kind, step_stream
from meshplan.schedule.steptime import step_time
from tests.test_schedule_semantics import SCHEDULES, TINY, plan_of, table_counts, timeline_counts

SHARDINGS = [("none", True), ("zero1", True), ("zero2", True), ("zero3", True), ("zero3", False),
             ("hsdp", True), ("hsdp", False)]
REDUCE = ("step", "", "step", "reduce")  # the key tests/test_schedule_semantics.py counts the reduction under


def _mesh(sharding: str, schedule: str, vpp: int) -> dict:
    data = {"hsdp": ["dp_replicate", "dp_shard"], "none": ["dp"]}.get(sharding, ["dp_shard"])
    return {"names": ["pp", *data, "tp"], "shape": [2] * (len(data) + 2), "world": 2 ** (len(data) + 2),
            "pp_schedule": schedule, "virtual_stages": vpp, "sequence_parallel": True}


def _plan(sharding: str, reshard: bool, schedule: str, vpp: int):
    nodes = 2 if sharding == "hsdp" else 1
    batch = 16 if schedule == "dualpipev" and sharding == "hsdp" else 8  # DualPipeV: m >= 2 pp per stage
    return plan_of(_mesh(sharding, schedule, vpp), model=dict(TINY, tied_embeddings=True), nodes=nodes,
                   sharding=sharding, reshard_after_forward=reshard, global_batch=batch)


def table_step_rows(plan, s: int) -> dict:
    """Stage s's per-step reduction rows (kind ``step``, not the parameter all-gather) by the
    group the timeline shows them on."""
    out = defaultdict(list)
    for r in plan.stage(s).collectives:
        if comm_kind(r) == "step" and r.op != "all-gather":
            out[step_stream(r)].append(r)
    return dict(out)


def timeline_reduce_s(st, s: int) -> dict:
    """Stage s's seconds of per-step reduction in the rank timeline by stream: every
    pipeline unit's reduction pieces (one per unit event) and the step-end events."""
    out = defaultdict(float)
    for e in st.pipeline.events:
        if e.stage == s and e.stream == "compute":
            for ie in st.units.of_event(e).events:
                if ie.args.get("kind") == "dp":
                    out[ie.stream] += ie.end_s - ie.start_s
    for e in st.post_events:
        if e.stage == s and e.name.startswith("grad reduce"):
            out[e.stream] += e.end_s - e.start_s
    return dict(out)


@pytest.mark.parametrize("schedule,vpp", SCHEDULES)
@pytest.mark.parametrize("sharding,reshard", SHARDINGS)
def test_timeline_issues_every_per_step_row(schedule, vpp, sharding, reshard):
    plan = _plan(sharding, reshard, schedule, vpp)
    st = step_time(plan)
    for s in range(2):
        rows = table_step_rows(plan, s)
        assert "tp" in rows, (s, rows)  # the SP norms
        # the tied embedding between the first and last stage; a V's stage 0 holds both ends
        assert ("pp" in rows) == (schedule not in ("zbv", "dualpipev")), (s, rows)
        got = timeline_reduce_s(st, s)
        assert set(got) == set(rows), (s, got)
        for stream, rs in rows.items():
            assert got[stream] == pytest.approx(sum(r.time_s * r.per_step for r in rs), rel=1e-9), (s, stream)
            if len({(r.time_s, r.size_bytes) for r in rs}) == 1:
                calls = got[stream] / rs[0].time_s
                assert calls == pytest.approx(round(calls), abs=1e-6)
                assert round(calls) == sum(r.per_step for r in rs), (s, stream)
                assert round(calls) * rs[0].size_bytes == sum(r.per_step * r.size_bytes for r in rs)
        # the other collectives as tests/test_schedule_semantics.py counts them
        assert {k: n for k, n in timeline_counts(st, s).items() if k != REDUCE} == \
            {k: n for k, n in table_counts(plan, s).items() if k != REDUCE}


@pytest.mark.parametrize("sharding,calls", [("zero3", 4), ("zero2", 4)])
def test_norm_all_reduce_by_hand(sharding, calls):
    """1F1B, stage 0 (layers 0-1: 4 RMSNorms of h 64 in bf16, 128 B each): under FSDP2 at pp 2
    the norms' gradients are all-reduced over tp once per step (4 calls, 512 B); without FSDP
    (ZeRO-2) once in the fused AdamW step (4 calls, 512 B; 3 reads each under foreach: 12), at
    the step's end, before the optimizer. The tied embedding: 256 / tp 2 = 128 rows x 64 x 4 B (fp32 gradients) = 32768 B,
    halved by FSDP2's dp_shard 2."""
    plan = _plan(sharding, True, "1f1b", 1)
    rows = table_step_rows(plan, 0)
    (norm,), (tied,) = rows["tp"], rows["pp"]
    assert (norm.size_bytes, norm.per_step, tied.size_bytes) == (128, calls, 32768 // (2 if sharding == "zero3" else 1))
    st = step_time(plan)
    calls_s = timeline_reduce_s(st, 0)["tp"]
    assert round(calls_s / norm.time_s) * norm.size_bytes == 128 * calls
    if sharding == "zero2":
        ev = [e for e in st.post_events if e.stage == 0 and e.stream == "tp"]
        opt = next(e for e in st.post_events if e.stage == 0 and e.name == "optimizer step")
        assert [e.name for e in ev] == ["grad reduce: all-reduce (per step)"] and ev[0].end_s <= opt.start_s
