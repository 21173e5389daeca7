"""ZeRO-2 reduces every micro-batch's gradients, one reduce-scatter per bucket, as the buckets
fill (DeepSpeed ``engine.py`` ``allreduce_gradients``: "ZeRO stage >= 2 communicates during non
gradient accumulation boundaries as well"; ``stage_1_and_2.py``
``reduce_independent_p_g_buckets_and_remove_grads`` reduces a bucket once ``reduce_bucket_size``
elements are in it): the collective table, the step timeline and the memory timeline count the
same buckets. Values by hand.

Llama-3-8B, dp 2 x tp 4: a rank holds 2,007,764,992 parameters (``tests/test_ddp_buckets.py``; the
vocabulary unpadded, framework torch).
Bucket: Megatron-Core's default ``max(40e6, 1e6 x dp 2)`` = 40,000,000 elements, fp32 (the
reduce dtype): 160,000,000 B. 2,007,764,992 = 50 x 40,000,000 + 7,764,992: 50 full buckets and
one of 31,059,968 B per micro-batch; global batch 8 / (micro-batch 1 x dp 2) = 4 micro-batches.
"""

from __future__ import annotations

import pytest

from meshplan.schedule.comm_times import CommTimes
from meshplan.schedule.steptime import step_time

from tests.test_ddp_buckets import _dp, _plan as ddp_plan


def _plan(sharding="zero2", **memory):
    return ddp_plan(sharding, **memory)  # the same llama3-8b on dp 2 x tp 4 as the DDP bucket tests


def test_table_reduce_scatters_every_micro_batch_per_bucket():
    rows = _dp(_plan())
    rs = {int(r.size_bytes): (r.phase, r.dtype, r.per_microbatch, r.per_step) for r in rows if r.op == "reduce-scatter"}
    assert rs == {160_000_000: ("backward", "fp32", 50, 200), 31_059_968: ("backward", "fp32", 1, 4)}
    assert sum(r.size_bytes * r.per_step for r in rows if r.op == "reduce-scatter") == 4 * 2_007_764_992 * 4
    [ag] = [r for r in rows if r.op == "all-gather"]  # the updated parameters, once per step, bf16
    assert (ag.phase, ag.size_bytes, ag.per_step) == ("step", 2_007_764_992 * 2, 1)
    # ZeRO-1 keeps the gradients whole: one reduce-scatter of them all, once per step
    [rs1] = [r for r in _dp(_plan("zero1")) if r.op == "reduce-scatter"]
    assert (rs1.phase, rs1.size_bytes, rs1.per_step) == ("step", 2_007_764_992 * 4, 1)


def test_timeline_issues_the_buckets_in_every_backward():
    plan = _plan()
    comm = CommTimes.from_rows(plan.stage(0).collectives, 32)
    rows = [r for r in _dp(plan) if r.op == "reduce-scatter"]
    assert comm.mb_buckets == 51 and comm.step_reduce_s == 0.0
    assert comm.mb_reduce_s == pytest.approx(sum(r.time_s * r.per_microbatch for r in rows), rel=1e-12)
    st = step_time(plan)
    backward = [e for e in st.pipeline.events if e.stream == "compute" and e.args["kind"] == "B"]
    assert len(backward) == 4
    for e in backward:  # 51 buckets over 32 layers: a piece after every layer's weight gradients
        pieces = [ie.dur_s for ie in st.units.of_event(e).events if ie.args.get("kind") == "dp"]
        assert pieces == pytest.approx([comm.mb_reduce_s / 32] * 32, rel=1e-12)
    assert not any(e.stream == "dp" and e.name.startswith("grad reduce") for e in st.post_events)


def test_memory_holds_the_bucket_in_every_backward():
    tl = _plan().timeline
    buckets = [e for e in tl.events() if e.kind == "grad_buffers" and e.delta_bytes > 0]
    assert [(e.microbatch, e.delta_bytes) for e in buckets] == [(mb, 160_000_000) for mb in range(4)]
