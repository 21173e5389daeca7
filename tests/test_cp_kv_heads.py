"""torch's ring CP moves K and V at the heads its SDPA reads (``[memory] kv_expanded``,
:func:`meshplan.spec.axes.tp.sdpa_kv_heads`): the KV heads by default (torchtitan ff0829c, v0.2.2, and
later pass ``enable_gqa=True`` to SDPA; e347b1e ``models/llama3/model/model.py``:201, 275, 295), the q
heads with ``kv_expanded`` (torchtitan's ``repeat_kv`` before it). One rule for the table's cp rows, the
ring's kernels, the ``repeat_kv`` copies, the search's cp bounds and the rank timeline."""

from __future__ import annotations

import pytest

from meshplan import catalog
from meshplan.compute.layer import layer_cost
from meshplan.compute.ops import Workload
from meshplan.compute.ring_attention import ring_bytes, slowest_rank
from meshplan.compute.shapes import Attention
from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.schedule.backward_pass import backward_unit
from meshplan.schedule.comm_streams import comm_kind
from meshplan.schedule.comm_times import CommTimes
from meshplan.schedule.rank_timeline import forward_unit
from meshplan.schedule.unit_sim import Overlap
from meshplan.schedule.workload import chunk_costs, workload_of
from meshplan.spec.axes.tp import sdpa_kv_heads


def _config(kv_expanded: bool, **training):
    """Llama-3-70B (64 q / 8 KV heads of 128) at cp 16 x tp 8 on 16 dgx-h100, 131,072 tokens, micro-batch 1,
    bf16, no recompute."""
    t = {"global_batch": 2, "seq_len": 131072, "micro_batch": 1, "sharding": "zero3", "param_dtype": "bf16",
         "compute_dtype": "bf16", "recompute": "none", **training}
    return config_from_dict({"model": {"catalog": "llama3-70b"}, "cluster": {"system": "dgx-h100", "nodes": 16},
                             "training": t, "mesh": {"names": ["cp", "tp"], "shape": [16, 8]},
                             "memory": {"kv_expanded": kv_expanded}})


def _per_layer(plan) -> list[tuple[str, str, float, str, float]]:
    rows = [r for r in plan.collectives["stage 0"] if comm_kind(r) == "cp"]
    return sorted((r.phase, r.op, r.size_bytes, r.dtype, r.per_microbatch / 80) for r in rows)


@pytest.mark.parametrize("kv_expanded, heads", [(False, 1), (True, 8)])
def test_70b_cp16_tp8_rows_by_hand(kv_expanded, heads):
    """Per layer, K and V of the whole sequence at the local heads the SDPA reads: 8 KV / tp 8 = 1 head
    (enable_gqa), or 64 q / tp 8 = 8 heads (repeat_kv): 1 x 131,072 x heads x (128 + 128) x 2 B =
    67,108,864 B or 536,870,912 B all-gathered in the forward and again in the ring backward; cp = 16
    fp32 dK/dV shifts of the rank's 131,072 / 16 = 8,192 tokens, 8,192 x heads x 256 x 4 B = 8,388,608 B
    or 67,108,864 B (15 beside a step, the last exposed). Under the all-to-all rotation the K/V move as
    15 shifts a pass of the local 8,192 tokens: 4,194,304 or 33,554,432 B."""
    assert sdpa_kv_heads(8, 1, kv_expanded) == heads
    kv = 1 * 131072 * heads * (128 + 128) * 2
    assert kv == (536_870_912 if kv_expanded else 67_108_864)
    shift = 8192 * heads * 256 * 4
    plan = build_plan(_config(kv_expanded), memory=False)
    assert _per_layer(plan) == [("backward", "all-gather", kv, "bf16", 1.0),
                                ("backward", "send/recv", shift, "fp32", 1.0),
                                ("backward", "send/recv", shift, "fp32", 15.0),
                                ("forward", "all-gather", kv, "bf16", 1.0)]
    a2a = build_plan(_config(kv_expanded, cp_rotate="alltoall"), memory=False)
    assert {r[2] for r in _per_layer(a2a) if r[3] == "bf16"} == {kv // 16}


@pytest.mark.parametrize("kv_expanded", [False, True])
def test_ring_kernels_and_repeat_kv_follow_the_heads(kv_expanded):
    """The repeat_kv copies run only with kv_expanded (torchtitan before ff0829c): Llama-3-70B at tp 8,
    8,192 local tokens, each of K and V read at 1 head and written at 8 (bf16): 2 x 2 B x 8,192 x 128 x
    (8 + 1) = 37,748,736 B forward, the same backward. The ring's kernels (compute.ring_attention) take
    K/V at the same heads: n_q = 8 x 8,192 x 128 = 8,388,608 (the output), n_kv = 8,192 x heads x 256:
    2,097,152 or 16,777,216. Compiled, rank r of 16 moves (ring_bytes) forward n_q (12 + 10 r + 9 p) +
    4 n_kv, backward n_q (12 + 10 r + 9 p) + n_kv (16 + 9 r + 10 p), p = 15 - r: rank 15 less rank 0 is
    30 n_q - 15 n_kv, so with the SDPA rated the same on every rank (no kernel data) the block is rank 15
    at the KV heads (n_kv = n_q / 4) and a tie, the lower rank 0, at the q heads (n_kv = 2 n_q)."""
    m, h100 = catalog.model("llama3-70b"), catalog.gpu("h100-sxm5-80gb")
    w = Workload(seq_len=131072, micro_batch=1, tp=8, cp=16, sp=True, recompute="none", torch_ring_attention=True,
                 kv_expanded=kv_expanded)
    rep = [o.size_bytes for o in layer_cost(m, h100, w).ops if o.name == "repeat_kv"]
    assert rep == ([37_748_736, 37_748_736] if kv_expanded else [])
    n_q, n_kv = 8 * 8192 * 128, 8192 * (8 if kv_expanded else 1) * 256
    chosen = slowest_rank(h100, Attention(1, 8, 1, 8192, 131072, 128), w)
    assert chosen.rank == (0 if kv_expanded else 15)
    assert (chosen.forward_bytes, chosen.backward_bytes) == ring_bytes(n_q, n_kv, 16, eager=False, rank=chosen.rank)


def _one_layer(kv_expanded: bool, **training):
    """Llama-3-8B (32 q / 8 KV heads), cp 2 across two dgx-h100 x dp_shard 8, 8,192 tokens: one layer's
    cost and cp rows (tests/test_cp_ring.py's case)."""
    cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 2},
                            "training": {"global_batch": 16, "seq_len": 8192, "micro_batch": 1, "sharding": "zero3",
                                         "param_dtype": "bf16", "recompute": "none", **training},
                            "mesh": {"names": ["cp", "dp_shard"], "shape": [2, 8]},
                            "memory": {"kv_expanded": kv_expanded}})
    plan = build_plan(cfg)
    w = workload_of(plan)
    ch = chunk_costs(plan, w)[0][0]
    rows = [r for r in plan.stage(0).collectives if comm_kind(r) == "cp"]
    return w, type(ch)(ch.layers[:1], ch.moe[:1]), rows


@pytest.mark.parametrize("kv_expanded", [False, True])
@pytest.mark.parametrize("rotate", ["allgather", "alltoall"])
def test_timeline_issues_what_the_table_counts(kv_expanded, rotate):
    """The rank timeline's cp events of one layer are the table's rows, one for one, each as long as its
    row: forward the K/V all-gather (or cp - 1 = 1 K/V shift), backward the ring's own gather (or 1 shift)
    and cp = 2 fp32 dK/dV shifts. The sizes differ 4x between the settings (8 KV heads against 32 q heads:
    K/V 8,192 x 8 x 256 x 2 B = 33,554,432 B gathered, or 134,217,728 B), the counts not."""
    w, one, rows = _one_layer(kv_expanded, cp_rotate=rotate)
    assert w.kv_expanded is kv_expanded
    heads = 32 if kv_expanded else 8
    assert {r.size_bytes for r in rows if r.dtype == "bf16"} == {8192 * heads * 256 * 2 // (2 if rotate == "alltoall"
                                                                                           else 1)}
    comm = CommTimes.from_rows(rows, layers=1)
    f = forward_unit(one, comm, w, Overlap())
    b = backward_unit("B", one, comm, w, Overlap())
    for unit, phase in ((f, "forward"), (b, "backward")):
        events = [e for e in unit.events if e.stream == "cp"]
        want = [r for r in rows if r.phase == phase]
        assert len(events) == sum(int(r.per_microbatch / 32) for r in want)
        assert sorted(round(e.dur_s, 12) for e in events) == sorted(
            round(r.time_s, 12) for r in want for _ in range(int(r.per_microbatch / 32)))


@pytest.mark.parametrize("kv_expanded", [False, True])
def test_search_cp_bounds_follow_the_heads(kv_expanded):
    """The search's cp terms (search.comm_bounds: cp_ag one K/V all-gather, cp_x one fp32 dK/dV shift) are
    the table's own row times at the heads the SDPA reads, candidate by candidate (Llama-3-8B, 2 dgx-h100,
    16,384 tokens, cp 2 and 4 x tp 1 and 2: K/V at 8 / tp KV heads or 32 / tp q heads), and the step's
    lower bound stays at or below the exact step of the sampled candidates."""
    import numpy as np
    from meshplan.schedule.steptime import step_time
    from meshplan.search.comm_bounds import comm_times
    from meshplan.search.driver import search
    from meshplan.search.memory import Tables
    from meshplan.search.space import candidate_config
    from meshplan.search.time_tables import TimeTables
    cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 2},
                            "training": {"global_batch": 16, "seq_len": 16384}, "memory": {"kv_expanded": kv_expanded},
                            "search": {"cp": [2, 4], "pp": [1], "tp": [1, 2], "dp_replicate": [1], "micro_batch": [1],
                                       "recompute": ["none", "full"], "vpp": [1]}}, require_mesh=False)
    r = search(cfg, workers=1)
    valid = np.flatnonzero(np.isfinite(r.est.step_lo) & (r.candidates.cp > 1))
    cm = comm_times(cfg, TimeTables(cfg, Tables(cfg)), r.candidates.take(valid))
    ratios = []
    for k in np.linspace(0, len(valid) - 1, min(6, len(valid))).astype(int):
        i = int(valid[k])
        plan = build_plan(candidate_config(cfg, r.candidates, i))
        rows = [x for x in plan.stage(0).collectives if comm_kind(x) == "cp"]
        tp = int(r.candidates.tp[i])
        heads = (32 if kv_expanded else 8) // tp
        ag = next(x for x in rows if x.phase == "forward" and x.op == "all-gather")
        assert ag.size_bytes == 16384 * heads * 256 * 2
        assert cm["cp_ag"][k] == pytest.approx(ag.time_s, rel=1e-9)
        assert cm["cp_x"][k] == pytest.approx(next(x for x in rows if x.op == "send/recv").time_s, rel=1e-9)
        if plan.feasible:
            ratios.append(r.est.step_lo[i] / step_time(plan).step_s)
    assert len(ratios) >= 3 and max(ratios) <= 1 + 1e-9, ratios
