"""DDP (``sharding = "none"``): one all-reduce per gradient bucket, placed in the backward as
the buckets fill, the bucket cap from ``[memory] grad_bucket_elements`` (torch 2.13's reducer:
25 MiB, the first bucket 1 MiB). Values by hand.

Llama-3-8B, dp 2 x tp 4, bf16 gradients. A rank's tensors (elements), registration order:
embedding 32064 x 4096 = 131,334,144 (vocab 128256 / tp 4, unpadded under framework torch), per layer
attn_norm 4096, wq 4,194,304, wk 1,048,576, wv 1,048,576, wo 4,194,304, mlp_norm 4096, w_gate,
w_up, w_down 14,680,064 each; final_norm 4096, output 131,334,144. Gradient-ready order is the
reverse. In bytes (x 2): output 262,668,288 fills the first bucket (cap 1 MiB); final_norm
8,192 + layer 31's w_down 29,360,128 = 29,368,320 (cap 26,214,400); each layer's w_up and w_gate,
29,360,128 alone (64); each layer's mlp_norm + wo + wv + wk + wq + attn_norm = 20,987,904 with
the next layer's w_down: 50,348,032 (31); layer 0's 20,987,904 with the embedding's 262,668,288:
283,656,192. 98 buckets, 4,015,529,984 B in all (the rank's 2,007,764,992 parameters x 2).
"""

from __future__ import annotations

from collections import Counter

import pytest

from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.schedule.comm_times import CommTimes
from meshplan.schedule.steptime import step_time

BUCKETS = {262_668_288: 1, 29_368_320: 1, 29_360_128: 64, 50_348_032: 31, 283_656_192: 1}


def _plan(sharding="none", **memory):
    d = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
         "training": {"global_batch": 8, "seq_len": 1024, "micro_batch": 1, "sharding": sharding,
                      "param_dtype": "bf16", "recompute": "full"},
         "mesh": {"names": ["dp", "tp"], "shape": [2, 4]}}
    if memory:
        d["memory"] = memory
    return build_plan(config_from_dict(d))


def _dp(plan):
    return [r for r in plan.stage(0).collectives if r.axis == "dp"]


def test_default_buckets_are_torchs_25_mib_the_first_1_mib():
    rows = _dp(_plan())
    assert {int(r.size_bytes): r.per_step for r in rows} == BUCKETS
    assert {(r.op, r.dtype, r.phase) for r in rows} == {("all-reduce", "bf16", "backward")}
    assert sum(r.size_bytes * r.per_step for r in rows) == 4_015_529_984 == 2 * 2_007_764_992
    assert all(r.cadence.endswith("of 98 buckets (DDP, bucket cap torch's 25 MiB, the first 1 MiB)") for r in rows)


def test_grad_bucket_elements_sets_the_bucket():
    # one bucket of every gradient (what torch's first step sends): one row of all the bytes
    [row] = _dp(_plan(grad_bucket_elements=10 ** 10))
    assert (row.size_bytes, row.per_step) == (4_015_529_984, 1)
    # 200,000,000 elements = 400 MB a bucket (the first too): output 262,668,288 + final norm
    # 8,192 + layer 31's w_down, w_up, w_gate (3 x 29,360,128) + its 20,987,904 = 371,744,768,
    # + layer 30's w_down: 401,104,896 >= 400 MB; each later bucket gathers whole tensors likewise
    rows = _dp(_plan(grad_bucket_elements=200_000_000))
    sizes = Counter({int(r.size_bytes): r.per_step for r in rows})
    assert sizes[401_104_896] == 1 and sum(k * n for k, n in sizes.items()) == 4_015_529_984
    assert sum(sizes.values()) == 10  # 4.02 GB in buckets of at least 400 MB, the last the rest


def test_the_reduction_is_placed_as_the_buckets_fill():
    """98 buckets over 32 layers: every layer's backward issues a piece (1/32 of the step's
    reduction); one bucket: the whole reduction after the last layer's backward (layer 0),
    exposed but for the embedding's gradient."""
    many, one = _plan(), _plan(grad_bucket_elements=10 ** 10)
    c_many, c_one = (CommTimes.from_rows(p.stage(0).collectives, 32) for p in (many, one))
    assert (c_many.ddp_buckets, c_one.ddp_buckets) == (98, 1)
    st_many, st_one = step_time(many), step_time(one)
    pieces = {}
    for name, st in (("many", st_many), ("one", st_one)):
        last = [e for e in st.pipeline.events if e.stream == "compute"][-1]  # the last backward unit
        pieces[name] = [ie.dur_s for ie in st.units.of_event(last).events if ie.args.get("kind") == "dp"]
    assert pieces["many"] == pytest.approx([c_many.step_reduce_s / 32] * 32, rel=1e-12)
    assert pieces["one"] == pytest.approx([c_one.step_reduce_s], rel=1e-12)
    # one 4 GB all-reduce after the backward is mostly exposed; 98 buckets spread over it hide
    assert st_one.exposed_s["dp"] > 0.9 * c_one.step_reduce_s - 1e-3
    assert st_many.exposed_s["dp"] < 0.1 * c_many.step_reduce_s
