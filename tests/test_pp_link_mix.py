"""Issue 11 (ppmix): one blocking pp call whose transfers take different links. Megatron-LM 2022's
``_communicate`` (NVIDIA/Megatron-LM 2755bcb ``megatron/p2p_communication.py`` lines 113-137) puts
the call's isend/irecv ops in one ``batch_isend_irecv``, one NCCL group (torch 2.13
``distributed_c10d.batch_isend_irecv``, ``_coalescing_manager``), and NCCL runs a group's p2p ops
to different peers at once, each peer's round on its own channels (NVIDIA/nccl 5067397
``src/enqueue.cc`` ``scheduleP2pTasksToPlan`` lines 1130-1213, ``addP2pToPlan`` 880-886 and
1051-1064; ``docs/userguide/source/usage/p2p.rst`` lines 21-25). So interleaved 1F1B's
steady-state call, which sends the forward output to the next stage and the input gradient to the
previous one, takes the longer of the two where one goes over NVLink and the other through the NIC
(meshplan/pipeline/rendezvous.py ``call_seconds``, calls.py ``_call_seconds``), and their sum
where both share the rank's NIC (or its NVLink).

Transfer times by hand from the catalog curves (tests/nccl_published.py), as tests/test_pp_boundary.py
derives them for S = 33,554,432 B: the NVLink pair 111.0 us, a NIC pair 721.8 us.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from meshplan.config import config_from_dict
from meshplan.pipeline.fast import simulate_arrays
from meshplan.pipeline.simulate import PipelineSpec, simulate
from meshplan.plan import build_plan
from meshplan.schedule.pipeline_exposure import call_loads, call_seconds
from meshplan.schedule.steptime import step_time
from meshplan.search.comm_bounds import p2p_bound, p2p_links_apart
from meshplan.search.memory import Tables
from meshplan.search.pipeline import hold_loads
from meshplan.search.time_tables import TimeTables
from tests.nccl_published import h100_nvlink_s, ndr_ring_s
from tests.test_pp_boundary import CASES, arrays_equal_reference

S = 33_554_432
NVLINK = h100_nvlink_s("send/recv", 2, S)
NIC = ndr_ring_s(2, 1, 2 * S)


def test_call_takes_the_longer_link_by_hand():
    """Interleaved 1F1B, p 3, m 6, v 2, F 1 s, B 2 s (Megatron-LM's blocking calls): stage 1's
    steady-state calls send a forward output to stage 2 (boundary 1, 0.7 s) and an input gradient to
    stage 0 (boundary 0, 0.1 s), and receive from both. Through one link: 0.1 + 0.7 = 0.8 s a call;
    boundary 0 on NVLink and 1 through the NIC: 0.7 s. Both loops agree to the bit, and the step is
    shorter by at least one 0.1 s."""
    one = PipelineSpec("interleaved_1f1b", 3, 6, v=2, forward_s=1.0, backward_s=2.0, p2p_s=(0.1, 0.7, 0.7),
                       blocking_p2p=True)
    two = replace(one, p2p_link=(0, 1, 1))
    a1, a2 = simulate_arrays(one), simulate_arrays(two)
    k, s1, s2 = call_loads(a1)[1], call_seconds(a1)[1], call_seconds(a2)[1]
    assert (k == 2).sum() > 0
    assert s1[k == 2] == pytest.approx(0.8, abs=1e-12) and s2[k == 2] == pytest.approx(0.7, abs=1e-12)
    assert s1[k == 1].tolist() == s2[k == 1].tolist()  # a call of one send and one receive: the longer already
    assert simulate(two).step_s == a2.step_s and a2.step_s <= a1.step_s - 0.1 + 1e-12
    assert call_seconds(simulate_arrays(replace(one, p2p_link=(1, 1, 1))))[1].tolist() == s1.tolist()


@pytest.mark.parametrize("sch,p,m,v,kw", CASES)
def test_links_apart_arrays_equal_the_reference(sch, p, m, v, kw):
    """Boundaries of 0.1, 0.3, 0.5, 0.7 s on links NVLink, NIC, NVLink, NIC (the wrap last): the array
    simulation equals the reference to the bit (every compute start, every send event)."""
    spec = PipelineSpec(sch, p, m, v, forward_s=1.0, backward_s=2.1, weight_s=0.7,
                        p2p_s=tuple(0.1 + 0.2 * b for b in range(p)), p2p_link=tuple(b % 2 for b in range(p)), **kw)
    arrays_equal_reference(spec)


def _megatron(hidden: int = 4096, seq: int = 16384):
    """8 layers, Megatron-LM 2022 interleaved 1F1B (vpp 2, calls waited), pp 4 x tp 4 (SP) on 2
    dgx-h100, global batch 8, micro-batch 1 (m = 8). Stage s on ranks 4s .. 4s + 3: stages 0, 1 on
    node 0, 2, 3 on node 1: boundaries 0 and 2 on NVLink, 1 and the wrap 3 across. Each send:
    1 x seq / tp 4 x hidden x 2 B (S at the default sizes)."""
    model = dict(layers=8, hidden=hidden, ffn=2 * hidden, gated_mlp=False, q_heads=32, kv_heads=8, vocab=256)
    training = {"global_batch": 8, "seq_len": seq, "micro_batch": 1, "sharding": "none", "param_dtype": "bf16",
                "recompute": "none", "framework": "megatron", "pp_p2p_overlap": False}
    return config_from_dict({"model": model, "cluster": {"system": "dgx-h100", "nodes": 2}, "training": training,
                             "mesh": {"names": ["pp", "tp"], "shape": [4, 4], "sequence_parallel": True,
                                      "pp_schedule": "interleaved_1f1b", "virtual_stages": 2}})


def test_megatron_interleaved_steady_calls_on_two_links():
    """Stage 0 (the critical stage) of :func:`_megatron`: its chunk 0 sends to stage 1 (boundary 0,
    NVLink, 111.0 us), its chunk 1 receives from stage 3 (the wrap, a NIC pair, 721.8 us). Its 10
    warm-up forwards' and 10 cool-down backwards' calls carry an NVLink transfer alone (12 calls,
    111.0 us) or a NIC one, alone or beside an NVLink one the other way (8 calls, 721.8 us); its 5
    steady-state calls that send chunk 0's forward output to stage 1 and chunk 1's input gradient
    to stage 3 (and receive from both) took 110.97 + 721.76 = 832.74 us and now 721.76. Exposed pp
    (the transfers of every call but the last, each held at least its transfers): 12 x 110.97 + 13
    x 721.76 = 10,714.6 us, was 5 x 110.97 = 554.9 us more (11,269.5); the pipeline 5 x 110.97 us
    shorter. The rows say which boundary times them."""
    plan = build_plan(_megatron())
    st = step_time(plan)
    res = st.pipeline
    assert res.spec.p2p_s == pytest.approx((NVLINK, NIC, NVLINK, NIC), rel=1e-12) and res.spec.p2p_link == (0, 1, 0, 1)
    k, secs = call_loads(res)[0], call_seconds(res)[0]
    assert ((k == 2).sum(), (secs[k == 2] == NIC).all()) == (5, True)
    assert (np.isclose(secs, NVLINK).sum(), np.isclose(secs, NIC).sum()) == (12, 13)
    assert st.exposed_s["pp"] == pytest.approx(12 * NVLINK + 13 * NIC, rel=1e-9)
    assert round(st.exposed_s["pp"] * 1e6, 1) == 10714.6
    # one link and no pair time (rendezvous.link_load): the two sends added in full
    added = simulate_arrays(replace(res.spec, p2p_link=(), p2p_pair_s=None))
    assert added.step_s - res.step_s == pytest.approx(5 * NVLINK, rel=1e-9)
    cad = {k: {r.cadence for r in plan.collectives[k] if r.axis == "pp" and r.op == "send/recv"}
           for k in ("stage 0", "stage 1", "stage 3")}
    tail = "every micro-batch per chunk boundary; timed on boundary "
    assert cad["stage 0"] == {tail + "3 (stage 3 -> 0, across nodes); its boundary 0 on NVLink takes 111.0 us"}
    assert cad["stage 1"] == {tail + "1 (stage 1 -> 2, across nodes); their boundaries 0, 2 on NVLink take 111.0 us"}
    assert cad["stage 3"] == {tail + "3 (stage 3 -> 0, across nodes); its boundary 2 on NVLink takes 111.0 us"}
    assert {round(r.time_s * 1e6, 1) for k in cad for r in plan.collectives[k] if r.axis == "pp"
            and r.op == "send/recv"} == {round(NIC * 1e6, 1)}  # the rows: the NIC pair's 721.8 us


def test_search_bound_below_every_call_with_links_apart():
    """:func:`_megatron` at hidden 1024, seq 1024: each send 1024 / 4 x 1024 x 2 = 524,288 B. The
    NVLink pair there: the h100-nvlink4-ring curve is flat from its 64 KiB row to its 1 MiB row
    (41.99 us raised to 1.75 x 65,536 / 2.72 GB/s = 42.17 us), less its LL latency 15.0 us: 27.17 us
    of bandwidth term for 1.75 S, so 7.2 + 27.17 / 1.75 = 22.72 us; a NIC pair 9.3 + 524,288 /
    47.10 GB/s = 20.43 us: faster. The search's p2p bound is that fastest boundary, 20.43 us (the
    NVLink pair's 22.72 would exceed the NIC boundaries' transfers). A steady-state call's two sends
    (NVLink and NIC) take max(22.72, 20.43) = 22.72 us, below 2 x 20.43 = 40.86: the bound holds
    such a call ceil(2 / 2) = 1 bound (hold_loads), not 2, and stays below every simulated call.
    The table's rows (timed on the NIC boundary, 20.43 us) say the NVLink ones take 22.72 us."""
    cfg = _megatron(1024, 1024)
    plan = build_plan(cfg)
    res = step_time(plan).pipeline
    size = 524_288
    nic = ndr_ring_s(2, 1, 2 * size)
    assert round(nic * 1e6, 2) == 20.43 and round(max(res.spec.p2p_s) * 1e6, 2) == 22.72
    tt = TimeTables(cfg, Tables(cfg))
    one = np.ones(1, dtype=np.int64)
    c = SimpleNamespace(pp=4 * one, dpr=one, dps=one, cp=one, tp=4 * one)
    bound, apart = p2p_bound(tt, c, np.full(1, size, dtype=np.int64))[0], bool(p2p_links_apart(tt, c)[0])
    assert apart and bound == pytest.approx(nic, rel=1e-9) and bound == min(res.spec.p2p_s)
    k, secs = call_loads(res), call_seconds(res)
    assert (secs >= hold_loads(k, apart) * bound * (1 - 1e-12)).all()
    assert not (secs >= k * bound * (1 - 1e-12)).all()  # k whole bounds would not be a lower bound
    rows = [r for r in plan.collectives["stage 1"] if r.axis == "pp" and r.op == "send/recv"]
    assert {round(r.time_s * 1e6, 2) for r in rows} == {20.43}
    assert {r.cadence.split("; ")[-1] for r in rows} == {"their boundaries 0, 2 on NVLink take 22.7 us"}
