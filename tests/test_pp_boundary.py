"""Issue 11 (review, open item 3): a pipeline send moves between one pair of ranks, the stage's and its
peer stage's at the same position on the other axes, so each stage boundary takes its own pair's
path (NVLink when both stages share a node, the sender's NIC when not), not the pp group's: the
simulator's ``PipelineSpec.p2p_s`` per boundary (meshplan/pipeline/sim_types.py), both loops
(asynchronous and Megatron-LM's / torch's blocking calls), the step's exposure per boundary
(meshplan/schedule/pipeline_exposure.py) and the search's bound at most the fastest boundary
(meshplan/search/comm_bounds.py ``p2p_bound``).

Times by hand from the catalog curves (tests/nccl_published.py) for a 33,554,432 B message:
- NVLink pair (h100_nvlink_s, the h100-nvlink4-ring curve): LL 6.6 + 0.6 us, then S at the curve's
  rate: t1 = 1.75 x 64 KiB / 2.72 GB/s = 42.17 us (the 1 MiB row's 41.99 us raised to it),
  t8 = 1.75 x 8 GiB / 368 GB/s = 40,848.9 us, spent(S) = t1 + (t8 - t1) (S - 1 MiB) / (8 GiB - 1 MiB)
  - 15.0 us = 181.6 us, 7.2 + 181.6 / 1.75 = 111.0 us.
- A NIC pair (ndr_ring_s: 47.10 GB/s a NIC, LL 6.6 + 2.7 us): a pair's ring moves S of 2 S, so
  9.3 us + 33,554,432 B / 47.10 GB/s = 721.8 us (the sender's one NIC).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.pipeline.fast import simulate_arrays
from meshplan.pipeline.simulate import PipelineSpec, simulate
from meshplan.plan import build_plan
from meshplan.schedule.pipeline_exposure import unit_exposure
from meshplan.schedule.steptime import step_time
from meshplan.search.comm_bounds import p2p_bound
from meshplan.search.memory import Tables
from meshplan.search.time_tables import TimeTables
from tests.nccl_published import h100_nvlink_s, ndr_ring_s

S = 33_554_432
NVLINK = h100_nvlink_s("send/recv", 2, S)
NIC = ndr_ring_s(2, 1, 2 * S)


def test_curve_arithmetic():
    """The two transfer times of the module docstring, from the formulas written out."""
    t1, t8 = max(1.75 * 2**20 / 43.70e9, 1.75 * 2**16 / 2.72e9), 1.75 * 2**33 / 368e9
    spent = t1 + (t8 - t1) * (S - 2**20) / (2**33 - 2**20) - 15.0e-6
    assert round(spent * 1e6, 1) == 181.6 and round(NVLINK * 1e6, 1) == round((7.2e-6 + spent / 1.75) * 1e6, 1) == 111.0
    per_nic = 1.875 * 2**33 / (1.875 * 2**33 / 376e9 - 87.6e-6) / 8
    assert round(per_nic / 1e9, 2) == 47.10 and round((9.3e-6 + S / per_nic) * 1e6, 1) == round(NIC * 1e6, 1) == 721.8


def _llama70b_pp28():
    """Llama-3-70B, seq 8192, pp 28 x cp 2 x tp 2 (SP) on 14 dgx-h100, global batch 512 (dp 1: 512
    micro-batches), torch's 1F1B (tests/test_restart_kind.py's alternative, the issue's case). Each
    send: 1 x 8192 / cp 2 / tp 2 (SP) x 8192 x 2 B = 33,554,432 B = S."""
    split = [2] + [3] * 24 + [2] * 3
    return build_plan(config_from_dict({
        "model": {"catalog": "llama3-70b"}, "cluster": {"system": "dgx-h100", "nodes": 14},
        "training": {"global_batch": 512, "seq_len": 8192, "param_dtype": "fp32", "recompute": "none",
                     "vocab_pad_divisor": 1},
        "mesh": {"names": ["pp", "cp", "tp"], "shape": [28, 2, 2], "sequence_parallel": True, "pp_schedule": "1f1b",
                 "pp_layer_split": split}}))


def test_pp28_cp2_tp2_each_boundary_on_its_pair():
    """Rank = 4 stage + 2 cp + tp: stage s holds ranks 4s .. 4s + 3 on node floor(4s / 8) = floor(s / 2),
    so boundary b (stage b -> b + 1) stays on a node for b even (stage 0 -> 1: ranks 0-3 and 4-7 on
    node 0: the NVLink pair, 111.0 us) and crosses for b odd (stage 1 -> 2: node 0 -> 1: one NIC, 721.8
    us); the wrap (27 -> 0, node 13 -> 0) crosses (unused by 1F1B). Where the pp group's path gave every
    transfer 721.8 us.

    Exposure (torch's 1F1B, blocking calls, pipeline_exposure.unit_exposure: the transfers of every
    call but the stage's last). Stage 0: after each of its 512 forwards one call sends it to stage 1
    and receives its gradient back (boundary 0), nothing after its last backward: 512 x 111.0 us =
    56.82 ms (was 512 x 721.8 = 369.5 ms). A middle stage s: after each forward a call on boundary s
    (send it on, receive its gradient), after each backward one on boundary s - 1 (send the gradient
    back, receive the next input), the first input in its leading call, on boundary s - 1; all
    but the last backward's: 512 calls on each boundary, 512 x (111.0 + 721.8 us) = 426.4 ms on both
    stage 22 (boundaries 21 across, 22 inside) and stage 23 (22 inside, 23 across). The table's rows: stage 0's
    and stage 27's (boundary 26, node 13) on the NVLink pair, the middle stages' (stage 1's table) on a NIC pair."""
    plan = _llama70b_pp28()
    assert [r.size_bytes for r in plan.collectives["stage 1"] if r.axis == "pp" and r.op == "send/recv"] == [S, S]
    # the table: each stage's rows on its slowest boundary's pairs, the pp group kept (28 ranks, 112 / 28 groups)
    rows = {k: {(r.phase, r.path.kind, r.group_size, r.n_groups, round(r.time_s * 1e6, 1)) for r in plan.collectives[k]
                if r.axis == "pp" and r.op == "send/recv"} for k in ("stage 0", "stage 1", "stage 27")}
    nv, nic = round(NVLINK * 1e6, 1), round(NIC * 1e6, 1)
    assert rows["stage 0"] == rows["stage 27"] == {(ph, "nvlink", 28, 4, nv) for ph in ("forward", "backward")}
    assert rows["stage 1"] == {(ph, "network", 28, 4, nic) for ph in ("forward", "backward")}  # boundary 1 across
    st = step_time(plan)
    res = st.pipeline
    expected = [NVLINK if b % 2 == 0 else NIC for b in range(27)] + [NIC]
    assert res.spec.p2p_s == pytest.approx(tuple(expected), rel=1e-12)
    f0 = [s * res.flat.length for s in range(28)]  # every stage's first unit is F0 (1F1B warm-up)
    assert all(res.flat.kind[i] == 0 and res.flat.mb[i] == 0 for i in f0)
    # each stage's F0 starts when the previous stage's F0 ends plus its boundary's transfer
    for b in range(27):
        assert res.start[f0[b + 1]] == pytest.approx(res.end[f0[b]] + expected[b], abs=1e-12)
    assert st.exposed_s["pp"] == pytest.approx(512 * NVLINK, rel=1e-9)
    assert round(st.exposed_s["pp"] * 1e3, 2) == 56.82
    keys, idx = st.unit_index
    for s in (22, 23):
        pp = unit_exposure(res, s, st.units, keys, idx, {})["pp"]
        assert pp == pytest.approx(512 * (NVLINK + NIC), rel=1e-9)


def _small(mesh: dict, nodes: int, layers: int = 4):
    """4 or 8 layers of h 4096 (32 q / 8 KV heads, vocab 256), seq 4096, micro-batch 1, bf16, no tp:
    every send is 1 x 4096 x 4096 x 2 B = S."""
    model = dict(layers=layers, hidden=4096, ffn=8192, gated_mlp=False, q_heads=32, kv_heads=8, vocab=256)
    training = {"global_batch": 64, "seq_len": 4096, "micro_batch": 1, "sharding": "zero3", "param_dtype": "bf16",
                "recompute": "none"}
    return config_from_dict({"model": model, "cluster": {"system": "dgx-h100", "nodes": nodes},
                             "training": training, "mesh": mesh})


def test_two_stages_a_node_every_other_boundary_nvlink():
    """pp 4 x dp_shard 4 on 2 dgx-h100: pp stride 4, stages at ranks 0, 4 (node 0), 8, 12 (node 1):
    boundary 0 (0 -> 1) and 2 (2 -> 3) on NVLink, 1 (node 0 -> 1) and the wrap (3 -> 0) across.
    Interleaved 1F1B with 2 chunks a stage (8 layers; torch's multi-stage runtime: asynchronous sends)
    wraps from stage 3's chunk 0 (virtual stage 3) to stage 0's chunk 1 (virtual stage 4) across the
    nodes: micro-batch 0's forward there starts when stage 3's ends plus 721.8 us at the earliest;
    stage 1's chunk-0 forward of micro-batch 0 (its first unit) starts 111.0 us after stage 0's."""
    for mesh, layers in (({"names": ["pp", "dp_shard"], "shape": [4, 4]}, 4),
                         ({"names": ["pp", "dp_shard"], "shape": [4, 4], "pp_schedule": "interleaved_1f1b",
                           "virtual_stages": 2}, 8)):
        res = step_time(build_plan(_small(mesh, nodes=2, layers=layers))).pipeline
        assert res.spec.p2p_s == pytest.approx((NVLINK, NIC, NVLINK, NIC), rel=1e-12)
    f, length = res.flat, res.flat.length
    at = lambda s, kind, mb, chunk: s * length + int(np.flatnonzero(  # noqa: E731
        (f.kind[s * length:(s + 1) * length] == kind) & (f.mb[s * length:(s + 1) * length] == mb)
        & (f.chunk[s * length:(s + 1) * length] == chunk))[0])
    wrap_in, wrap_out = at(0, 0, 0, 1), at(3, 0, 0, 0)
    assert f.dep[wrap_in] == wrap_out and f.cross[wrap_in]
    assert res.start[wrap_in] >= res.end[wrap_out] + NIC - 1e-12
    assert res.input_s[wrap_in] == pytest.approx(NIC, rel=1e-12)
    assert res.start[at(1, 0, 0, 0)] == pytest.approx(res.end[at(0, 0, 0, 0)] + NVLINK, abs=1e-12)


def test_one_stage_a_node_one_value():
    """pp 4 x dp_shard 8 on 4 dgx-h100: one stage a node, every boundary crosses: one value, 721.8 us,
    as the pp group's path gave (the simulation's one-value path)."""
    res = step_time(build_plan(_small({"names": ["pp", "dp_shard"], "shape": [4, 8]}, nodes=4))).pipeline
    assert isinstance(res.spec.p2p_s, float) and res.spec.p2p_s == pytest.approx(NIC, rel=1e-12)


CASES = [("1f1b", 4, 8, 1, {}), ("gpipe", 3, 4, 1, {}), ("interleaved_1f1b", 4, 8, 2, {}), ("zb_h1", 4, 8, 1, {}),
         ("zbv", 4, 8, 2, {}), ("dualpipev", 4, 8, 2, {}), ("1f1b", 4, 8, 1, {"blocking_p2p": True}),
         ("interleaved_1f1b", 4, 8, 2, {"blocking_p2p": True}),
         ("interleaved_1f1b", 4, 8, 2, {"blocking_p2p": True, "overlap_p2p": True}),
         ("1f1b", 4, 8, 1, {"blocking_p2p": True, "torch_p2p": True}),
         ("gpipe", 4, 8, 1, {"blocking_p2p": True, "torch_p2p": True})]


@pytest.mark.parametrize("sch,p,m,v,kw", CASES)
def test_uniform_boundaries_are_the_single_value(sch, p, m, v, kw):
    """A per-boundary tuple of p equal times runs the per-boundary code (each transfer's time looked
    up, a call's sends added) and reproduces the one-value simulation exactly: every event equal, in
    the reference loops (simulate, rendezvous) and on arrays."""
    one = PipelineSpec(sch, p, m, v, forward_s=1.0, backward_s=2.1, weight_s=0.7, p2p_s=0.3, **kw)
    each = replace(one, p2p_s=(0.3,) * p)
    assert each.per_boundary and not one.per_boundary
    ref, ref_each = simulate(one), simulate(each)
    assert ref_each.events == ref.events and ref_each.step_s == ref.step_s
    arr, arr_each = simulate_arrays(one), simulate_arrays(each)
    assert arr_each.events == arr.events and arr_each.step_s == arr.step_s
    assert arr_each.start.tolist() == arr.start.tolist() and arr_each.end.tolist() == arr.end.tolist()


@pytest.mark.parametrize("sch,p,m,v,kw", CASES)
def test_boundaries_apart_arrays_equal_the_reference(sch, p, m, v, kw):
    """Boundaries of 0.1, 0.3, 0.5, 0.7 s (the last the wrap): the array simulation equals the reference
    to the bit (every compute start, every send event) in both loops."""
    spec = PipelineSpec(sch, p, m, v, forward_s=1.0, backward_s=2.1, weight_s=0.7,
                        p2p_s=tuple(0.1 + 0.2 * b for b in range(p)), **kw)
    ref = arrays_equal_reference(spec)
    assert ref.step_s != simulate(replace(spec, p2p_s=0.1)).step_s  # the boundaries' times matter


def arrays_equal_reference(spec: PipelineSpec):
    """Assert the array simulation of ``spec`` equals the reference to the bit (the step, every
    compute start, every send event); returns the reference's result."""
    ref, arr = simulate(spec), simulate_arrays(spec)
    assert arr.step_s == ref.step_s
    assert arr.start.tolist() == [e.start_s for s in range(spec.p) for e in ref.events if e.stage == s
                                  and e.stream == "compute"]
    key = lambda e: (e.stage, e.stream, e.name, e.start_s, e.end_s)  # noqa: E731
    assert sorted(map(key, arr.events)) == sorted(map(key, ref.events))
    return ref


def test_per_boundary_needs_one_time_per_stage():
    """A per-boundary tuple has one entry per stage (the last, the wrap): else a one-line error."""
    with pytest.raises(ConfigError, match="p2p_s has 2 boundary times"):
        PipelineSpec("1f1b", 3, 3, p2p_s=(0.1, 0.2))


def test_search_bound_at_most_the_fastest_boundary():
    """The search's p2p bound (search.comm_bounds.p2p_bound) on 2 dgx-h100: pp 4 x dp_shard 4 (stride 4
    < 8 GPUs a node: stages 0 and 1 share node 0) the NVLink pair, 111.0 us, the fastest boundary's
    (the step's boundaries 111.0, 721.8, 111.0, 721.8 us: tight); pp 2 x dp_shard 8 (stride 8: every
    boundary across) the NIC pair's 721.8 us, equal to the step's one value; pp 1 none."""
    cfg = _small({"names": ["pp", "dp_shard"], "shape": [4, 4]}, nodes=2)
    tt = TimeTables(cfg, Tables(cfg))
    ones = np.ones(3, dtype=np.int64)
    c = SimpleNamespace(pp=np.array([4, 2, 1]), dpr=ones, dps=np.array([4, 8, 16]), cp=ones, tp=ones)
    got = p2p_bound(tt, c, np.full(3, S, dtype=np.int64))
    assert got.tolist() == pytest.approx([NVLINK, NIC, 0.0], rel=1e-9)
    four = step_time(build_plan(cfg)).pipeline.spec.p2p_s
    assert got[0] == pytest.approx(min(four), rel=1e-12)
    two = step_time(build_plan(_small({"names": ["pp", "dp_shard"], "shape": [2, 8]}, nodes=2))).pipeline.spec
    assert got[1] == pytest.approx(two.p2p_s, rel=1e-12)
