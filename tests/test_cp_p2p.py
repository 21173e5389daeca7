"""Transformer Engine's p2p ring as Megatron-LM runs context parallelism by default
(``--cp-comm-type p2p``; ``training.cp_attention`` unset or "p2p" under framework megatron,
meshplan.spec.axes.cp.p2p_rows), by hand from TE's ``AttnFuncWithCPAndKVP2P``
(NVIDIA/TransformerEngine d0067d0, transformer_engine/pytorch/attention/dot_product_attention/
context_parallel.py): forward lines 1690-1715 (``p2p_comm_buffers[0] = torch.cat((k.view(-1),
v.view(-1)))``; at step ``i < cp - 1`` ``flash_attn_p2p_communicate`` of buffer ``i`` before the
step's attention, waited for at step ``i + 1``), backward lines 2397-2401 (buffers of ``(2,
*kv.shape)`` in ``kv.dtype``) and 2459-2495 (step 0 sends ``send_tensor[0]``, K and V; the last
step ``send_tensor[1]``, dK and dV; the others both), waited for after the step's attention
backward (line 2717)."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.schedule.comm_times import CommTimes
from meshplan.schedule.backward_pass import backward_unit
from meshplan.schedule.rank_timeline import forward_unit
from meshplan.schedule.steptime import step_time
from meshplan.search.driver import search
from meshplan.search.space import candidate_config
from meshplan.schedule.unit_sim import Overlap
from meshplan.schedule.workload import chunk_costs, workload_of
from meshplan.spec.training import TrainingSpec
from tests.test_cp_ring import GQA, _cp_rows, _per_layer, _plan


def _megatron(cp: int, **training):
    return _plan(GQA, {"names": ["cp", "dp_shard"], "shape": [cp, 8 // cp]}, framework="megatron", **training)


def test_p2p_rows_by_hand_cp2_and_cp4():
    """GQA (2 layers, 4 q heads and 2 KV heads of d 16), b 1, s 32, tp 1, bf16. K and V at the
    KV heads (Megatron-LM passes num_query_groups; TE's flash and fused backends take GQA as is),
    the rank's s / cp tokens: KV = 1 x (32 / cp) x 2 x (16 + 16) elements x 2 B.
    cp 2: KV = 16 x 64 x 2 = 2,048 B; forward cp - 1 = 1 send per layer; backward step 0 sends K/V
    (2,048 B), step 1 = cp - 1 the dK/dV alone (2,048 B): 2 per layer, 2 (cp - 1) KV = 4,096 B.
    cp 4: KV = 8 x 64 x 2 = 1,024 B; forward 3 per layer; backward K/V (1,024 B), cp - 2 = 2 of
    K, V, dK and dV in one (2, *kv.shape) buffer (2,048 B), dK/dV (1,024 B): 2 (cp - 1) KV = 6,144 B."""
    assert _per_layer(_cp_rows(_megatron(2, recompute="none")), 2) == [
        ("backward", "send/recv", 2048.0, "bf16", 1.0), ("backward", "send/recv", 2048.0, "bf16", 1.0),
        ("forward", "send/recv", 2048.0, "bf16", 1.0)]
    rows = _cp_rows(_megatron(4, recompute="none"))
    assert _per_layer(rows, 2) == [
        ("backward", "send/recv", 1024.0, "bf16", 1.0), ("backward", "send/recv", 1024.0, "bf16", 1.0),
        ("backward", "send/recv", 2048.0, "bf16", 2.0), ("forward", "send/recv", 1024.0, "bf16", 3.0)]
    assert sum(r.size_bytes * r.per_microbatch for r in rows if r.phase == "backward") / 2 == 2 * (4 - 1) * 1024
    # Megatron-LM's selective recompute checkpoints core_attention (attention.py
    # _checkpointed_attention_forward): the replay sends K/V cp - 1 = 3 more times per layer; full too
    for rc in ("selective", "full"):
        replay = [r for r in _cp_rows(_megatron(4, recompute=rc)) if "recomputed" in r.cadence]
        assert [(r.phase, r.size_bytes, r.per_microbatch / 2) for r in replay] == [("backward", 1024.0, 3.0)]
    # --cp-comm-type all_gather: all-gather CP's rows, the 2 KV heads' whole sequence: 32 x 64 x 2 = 4,096 B
    gather = _megatron(4, recompute="none", cp_attention="allgather")
    assert _per_layer(_cp_rows(gather), 2) == [("backward", "all-gather", 4096.0, "bf16", 1.0),
                                               ("backward", "reduce-scatter", 4096.0, "bf16", 1.0),
                                               ("forward", "all-gather", 4096.0, "bf16", 1.0)]
    assert _per_layer(_cp_rows(_megatron(4, recompute="none", cp_attention="p2p")), 2) == _per_layer(rows, 2)
    # TE's AttnFuncWithCPAndKVAllGather saves the local K/V and its backward gathers them again
    # (gather_along_first_dim of k and v): one 4,096 B backward all-gather per layer; under selective
    # recompute its forward's gather, inside the checkpointed core_attention, runs once more;
    # meshplan's own all-gather CP (framework torch) gathers before the core, outside the replay: none
    for rc, again in (("none", 1.0), ("selective", 2.0)):
        sel = _per_layer(_cp_rows(_megatron(4, recompute=rc, cp_attention="allgather")), 2)
        gathers = [x for x in sel if x[:2] == ("backward", "all-gather")]
        assert sum(x[4] for x in gathers) == again and {x[2] for x in gathers} == {4096.0}
        assert [x for x in sel if x[:2] != ("backward", "all-gather")] == [
            ("backward", "reduce-scatter", 4096.0, "bf16", 1.0), ("forward", "all-gather", 4096.0, "bf16", 1.0)]
    torch_sel = _plan(GQA, {"names": ["cp", "dp_shard"], "shape": [4, 2]}, recompute="selective", cp_attention="allgather")
    assert [r.phase for r in _cp_rows(torch_sel) if r.op == "all-gather"] == ["forward"]


def test_p2p_is_megatrons_alone():
    with pytest.raises(ValueError, match="cp_attention \"p2p\" is Transformer Engine's p2p ring"):
        TrainingSpec(global_batch=8, seq_len=16, cp_attention="p2p")
    assert TrainingSpec(global_batch=8, seq_len=16, framework="megatron").cp_kind == "p2p"


def _one_layer(cp: int, **training):
    """Llama-3-8B over two DGX H100 nodes, cp x dp_shard 16 / cp, s 8192, b 1, framework megatron:
    one layer's cost and cp rows (as tests/test_cp_ring.py's torch ring case)."""
    plan = _plan({"catalog": "llama3-8b"}, {"names": ["cp", "dp_shard"], "shape": [cp, 16 // cp]}, nodes=2,
                 **{"global_batch": 16, "seq_len": 8192, "framework": "megatron", **training})
    w = workload_of(plan)
    ch = chunk_costs(plan, w)[0][0]
    return w, type(ch)(ch.layers[:1], ch.moe[:1]), ch.layers[0], _cp_rows(plan)


def test_p2p_exposed_time_by_hand():
    """cp 2, one layer, selective recompute (Megatron-LM's default here). KV = 8192 / 2 tokens x
    8 KV heads x (128 + 128) x 2 B = 16,777,216 B per send (X = 0.36553 ms: cp's two ranks are 8 GPUs
    apart, on two nodes: one NIC). Each send runs beside its own step's work and is waited for
    after it (compute.te_ring, ring_timeline.p2p_steps). Llama-3-8B, L = 4,096, 32 q heads, d 128,
    H100 FA3 rows: every call is pair = 2 x 4096^2 x 32 x 128 = 1.3744e11 FLOP forward. Rank 0
    (the slowest: its calls 1.7728 ms against rank 1's 1.7248, more than rank 1's extra correction
    bytes, 3 n_o + 3 n_dq - n_kv = 92.3 MB at Triad 2.97 TB/s, 31 us): forward step 0 the causal
    diagonal at 579 TFLOP/s (S7c, S 4096): 0.23737 ms; step 1 the upper triangle over 4,096 keys at
    638: 0.21542 ms. Backward step 0 the upper triangle looping over 2,048 queries at 501 (S8):
    0.68582 ms, step 1 the diagonal at 542: 0.63394 ms. Forward: 1 send beside step 0 (nothing of
    TE's kernels beside it): X - 0.23737 = 0.12816 ms exposed (0.13913 before, beside an equal half
    of both calls, 0.22640). Backward: the replayed forward's send beside its step 0 (0.12816 again),
    the backward's two sends beside steps of at least 0.634 ms: none. Each pass lasts its ops plus
    what it exposes."""
    w, one, cost, rows = _one_layer(2, recompute="selective")
    assert {r.size_bytes for r in rows} == {8192 // 2 * 8 * 256 * 2}
    x = rows[0].time_s
    assert round(x * 1e3, 5) == 0.36553
    pair = 2 * 4096 ** 2 * 32 * 128
    calls = {o.phase + str(o.recompute): [a for a, _ in o.steps] for o in cost.ops if o.name.startswith("attention")}
    assert calls["forwardFalse"] == calls["backward_inputTrue"] == pytest.approx([pair / 579e12, pair / 638e12], rel=1e-12)
    assert calls["backward_inputFalse"] == pytest.approx([2.5 * pair / 501e12, 2.5 * pair / 542e12], rel=1e-12)
    step0 = pair / 579e12
    assert round(step0 * 1e3, 5) == 0.23737 and round((x - step0) * 1e3, 5) == 0.12816
    comm = CommTimes.from_rows(rows, layers=1)
    f = forward_unit(one, comm, w, Overlap())
    assert f.exposed_s["cp"] == pytest.approx(x - step0)
    assert f.duration_s == pytest.approx(cost.forward_s + x - step0)
    b = backward_unit("B", one, comm, w, Overlap())
    assert b.exposed_s.get("cp", 0.0) == pytest.approx(x - step0)
    assert b.duration_s == pytest.approx(cost.backward_s + x - step0)


def test_p2p_timeline_order_cp4():
    """cp 4, full recompute: forward 3 K/V sends, each before an attention step and waited for
    after it; backward the replayed forward's 3, then K/V, 2 of K/V with dK/dV, dK/dV, each
    issued after the step before it ended (TE's ring never has two sends in flight)."""
    w, one, _, rows = _one_layer(4, recompute="full")
    comm = CommTimes.from_rows(rows, layers=1)
    f = forward_unit(one, comm, w, Overlap())
    assert [e.name for e in f.events if e.stream == "cp"] == ["cp K/V send/recv"] * 3
    b = backward_unit("B", one, comm, w, Overlap())
    sends = [e for e in b.events if e.stream == "cp"]
    assert [e.name for e in sends] == ["cp K/V send/recv"] * 4 + ["cp K/V+dK/dV send/recv"] * 2 + ["cp dK/dV send/recv"]
    calls = [e for e in b.events if e.stream == "compute" and "ring call" in e.name]
    assert len(calls) == 8  # 4 replayed forward steps, 4 backward steps
    # each send starts with a step's call (the first three replay sends with calls 0-2, the backward's with 4-7)
    assert [round(e.start_s, 12) for e in sends] == [round(c.start_s, 12) for c in calls[:3] + calls[4:]]
    assert all(a.end_s <= b_.start_s + 1e-12 for a, b_ in zip(sends, sends[1:]))


def test_search_bound_holds_under_p2p():
    """The search's step lower bound (search/layer_bounds.chains: per send max(send - step, 0), as
    the timeline's p2p_steps) stays at or below the exact step of every sampled Megatron-LM cp
    candidate (Llama-3-8B, 2 DGX H100 nodes, s 16,384), with each candidate's cp rows the p2p ring's."""
    cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 2},
                            "training": {"global_batch": 16, "seq_len": 16384, "framework": "megatron"},
                            "search": {"cp": [2, 4], "pp": [1], "tp": [1, 2], "dp_replicate": [1], "micro_batch": [1],
                                       "recompute": ["selective", "full"], "vpp": [1]}}, require_mesh=False)
    r = search(cfg, workers=1)
    valid = np.flatnonzero(np.isfinite(r.est.step_lo))
    ratios = []
    for i in valid[np.linspace(0, len(valid) - 1, min(6, len(valid))).astype(int)]:
        plan = build_plan(candidate_config(cfg, r.candidates, int(i)))
        assert {x.op for x in _cp_rows(plan)} == {"send/recv"}
        if plan.feasible:
            ratios.append(r.est.step_lo[i] / step_time(plan).step_s)
    assert len(ratios) >= 3 and max(ratios) <= 1 + 1e-9, ratios


def test_megatron_allgather_cp_is_exposed_by_hand():
    """--cp-comm-type all_gather under Megatron-LM (fused linear_qkv, TE's blocking gather and
    reduce-scatter): cp 2, one layer, no recompute. K/V of the whole sequence at the 8 KV heads,
    8192 x 8 x (128 + 128) x 2 B = 33,554,432 B per gather and per reduce-scatter. No Q
    projection runs apart (the fused GEMM is one kernel), so the forward gather (G) is wholly
    exposed; backward TE's own gather (G) before the attention backward and the dK/dV
    reduce-scatter (R) before the QKV input gradient, both wholly exposed: forward G,
    backward G + R. (Under framework torch the gather runs beside the Q projection.)"""
    w, one, cost, rows = _one_layer(2, recompute="none", cp_attention="allgather")
    assert {(r.phase, r.op, r.size_bytes, r.per_microbatch) for r in rows} == {
        ("forward", "all-gather", 33_554_432.0, 32), ("backward", "all-gather", 33_554_432.0, 32),
        ("backward", "reduce-scatter", 33_554_432.0, 32)}  # one of each per layer, 32 layers
    g = next(r.time_s for r in rows if r.op == "all-gather")
    rs = next(r.time_s for r in rows if r.op == "reduce-scatter")
    comm = CommTimes.from_rows(rows, layers=1)
    f = forward_unit(one, comm, w, Overlap())
    assert f.exposed_s["cp"] == pytest.approx(g)
    b = backward_unit("B", one, comm, w, Overlap())
    assert b.exposed_s.get("cp", 0.0) == pytest.approx(g + rs)


def test_distributed_optimizer_words_count_cp():
    """Megatron-LM's distributed optimizer shards over the data-parallel-with-cp group (dp x cp),
    as the memory model shards the state over the fsdp axis (meshplan.memory.state): cp 4 x
    dp_shard 2 steps on its own 1/8 (newcomer 31 #7: `memory` printed the dp axis alone, 1/1 at dp 1 x cp 8)."""
    from meshplan.report.memory import kind_notes

    plan = _megatron(4, recompute="none", sharding="zero1")
    assert kind_notes(plan)["grads"].endswith("the distributed optimizer steps on its own 1/8")


def test_compare_weighs_p2p_against_all_gather():
    """--cp-comm-type is how Megatron-LM runs CP's attention, not the workload: compare takes a p2p
    plan and an all_gather one and lists the knob as it acts (unset under megatron: p2p), where it
    refused "training.cp_attention differs" (newcomer 31 #3); unset against an explicit "p2p" is
    no difference."""
    from meshplan.compare.sides import check_workload

    p2p, gather = _megatron(4, recompute="none"), _megatron(4, recompute="none", cp_attention="allgather")
    d = check_workload(p2p, gather)
    assert d.workload == () and ("training.cp_attention", "p2p", "allgather") in d.knobs
    assert not any(k[0] == "training.cp_attention"
                   for k in check_workload(p2p, _megatron(4, recompute="none", cp_attention="p2p")).knobs)


def test_te_backward_gathers_read_as_blocking():
    """step's readiness list for Megatron-LM's all-gather CP under selective recompute: the first
    backward all-gather is the replayed core's, which the replayed attention waits for right after
    it: slack 0 (newcomer 31 #5: it read 28.5 ms of slack, before the fused QKV had no Q projection apart, the deadline of the reduce-scatter's
    Q projection at the block's end)."""
    from meshplan.schedule.readiness import timings

    plan = _plan({"catalog": "llama3-8b"}, {"names": ["cp", "dp_shard"], "shape": [2, 8]}, nodes=2,
                 **{"global_batch": 16, "seq_len": 8192, "framework": "megatron", "recompute": "selective",
                    "cp_attention": "allgather"})
    (t,) = [x for x in timings(step_time(plan)) if (x.stream, x.phase, x.op) == ("cp", "backward", "all-gather")]
    assert t.slack_s == pytest.approx(0.0, abs=1e-12)


def test_megatron_cp_needs_te_flash_or_fused_attention():
    """Megatron-LM runs CP only in Transformer Engine's attention with the flash or fused backend:
    Megatron-Core's local DotProductAttention asserts context_parallel_size == 1
    (megatron/core/transformer/dot_product_attention.py:57-59 at d98e8a6) and TE's
    get_attention_backend disables UnfusedDotProductAttention under CP (dot_product_attention/utils.py:1169-1173
    at d0067d0). flash_attention false at cp 2 is an infeasible mesh with the fix, under either
    --cp-comm-type; at cp 1, or with flash attention, the mesh plans (was: planned with p2p rows it
    cannot run). The search rejects such candidates by the same rule."""
    from types import SimpleNamespace

    from meshplan.spec.axes.registry import rules

    for kind in ("p2p", "allgather"):
        plan = _megatron(2, recompute="none", cp_attention=kind, flash_attention=False)
        assert not plan.feasible
        assert any(r.startswith("framework megatron: cp 2 runs only in Transformer Engine's flash or fused attention")
                   and r.endswith("fix: set training.flash_attention = true (--attention-backend flash, fused or auto)"
                                  " or cp 1") for r in plan.reasons), plan.reasons
        assert _megatron(2, recompute="none", cp_attention=kind).feasible
    assert _megatron(1, recompute="none", flash_attention=False).feasible
    torch_ag = _plan(GQA, {"names": ["cp", "dp_shard"], "shape": [2, 4]}, flash_attention=False)
    assert torch_ag.feasible  # torch's all-gather CP runs meshplan's own SDPA call: not this rule
    # the search's vectorised form over a cp column: cp 1 passes, cp 2 and 4 are refused
    (rule,) = [r for r in rules() if r.key == "megatron_cp_attention"]
    slow = TrainingSpec(global_batch=8, seq_len=16, framework="megatron", flash_attention=False)
    assert rule.bad(None, slow, SimpleNamespace(cp=np.array([1, 2, 4]))).tolist() == [False, True, True]
    assert not rule.bad(None, slow.model_copy(update={"flash_attention": True}), SimpleNamespace(cp=np.array([2]))).any()


def test_export_to_megatron_refuses_cp_without_flash_attention():
    """A torch plan at cp 2 with flash_attention false runs meshplan's all-gather CP (torch's ring
    needs the fused SDPA kernels), which Megatron-LM cannot run (rule megatron_cp_attention): the
    export to megatron is refused with the rule's reason (it wrote --attention-backend unfused with
    --cp-comm-type p2p); with flash attention, or to torchtitan, nothing is refused."""
    from meshplan.plan_runtime import export_refusals

    d = {"model": GQA, "cluster": {"system": "dgx-h100", "nodes": 1},
         "training": {"global_batch": 8, "seq_len": 32, "micro_batch": 1, "flash_attention": False},
         "mesh": {"names": ["cp", "dp_shard"], "shape": [2, 4]}}
    assert export_refusals(config_from_dict(d), "megatron") == (
        "framework megatron: cp 2 runs only in Transformer Engine's flash or fused attention (Megatron-Core's local "
        "attention asserts cp 1, TE's unfused backend refuses CP); fix: set training.flash_attention = true "
        "(--attention-backend flash, fused or auto) or cp 1: megatron's runtime refuses CP without flash attention",)
    assert export_refusals(config_from_dict(d), "torchtitan") == ()
    assert export_refusals(config_from_dict({**d, "training": {**d["training"], "flash_attention": True}}),
                           "megatron") == ()


def test_search_chain_p2p_terms_by_hand():
    """Tightness of the search's p2p terms (search/layer_bounds.chains), not only bound <= exact:
    one layer whose only seconds are the attention steps and the sends (everything else 0), as the
    timeline's p2p_steps runs them, each send beside one step, exposing max(send - step, 0).
    cp 4, K/V send 1.0 s, packed K/V + dK/dV send 2.0 s; forward step 0.25 s, backward step 0.5 s,
    a selective recompute's replayed step 0.25 s:
    forward 3 x (1.0 - 0.25) = 2.25; backward 2 x (1.0 - 0.5) [K/V, dK/dV] + 2 x (2.0 - 0.5) [cp - 2
    packed] + 3 x (1.0 - 0.25) [the replay's K/V] = 1 + 3 + 2.25 = 6.25. Full recompute: no replay
    in the backward's own steps, the replayed forward's 3 x 0.75 = 2.25 after them: 1 + 3 + 2.25 = 6.25.
    cp 2 (no packed step), selective: forward 0.75, backward 2 x 0.5 + 0.75 = 1.75. (A chain
    without the p2p terms gives 0 everywhere: this fails.)"""
    from meshplan.search.layer_bounds import chains
    from meshplan.search.space import RECOMPUTE
    from meshplan.search.time_tables import OP_FIELDS

    one = lambda v: np.array([float(v)])
    o = {k: one(0) for k in OP_FIELDS}
    o.update(f_cps=one(0.25), bi_cps=one(0.5), bi_cpr=one(0.25), bin_cps=one(0.5), br_cps=one(0.25))
    cm = {k: one(0) for k in ("tp_ar", "cp_ag", "cp_rs", "ep", "tp_sp", "tp_ag", "amax_f", "amax_b")}
    cm.update(cp_kv=one(1.0), cp_kv2=one(2.0))

    def chain(cp: int, rc: str) -> list[float]:
        c = type("C", (), {"ov": np.array([0]), "rc": np.array([RECOMPUTE.index(rc)]), "cp": np.array([cp])})()
        f, b = chains(c, o, cm, False, np.array([False]))
        return [float(f[0]), float(b[0])]

    assert chain(4, "selective") == pytest.approx([3 * 0.75, 2 * 0.5 + 2 * 1.5 + 3 * 0.75])
    assert chain(4, "full") == pytest.approx([3 * 0.75, 2 * 0.5 + 2 * 1.5 + 3 * 0.75])
    assert chain(2, "selective") == pytest.approx([0.75, 2 * 0.5 + 0.75])


def test_p2p_backward_ring_leaves_through_the_other_boundary_ranks_nic():
    """Transformer Engine's p2p backward runs its ring the other way round: send_dst rank - 1, recv_src
    rank + 1 (AttnFuncWithCPAndKVP2P.backward, d0067d0 lines 2229-2230), where the forward sends to
    rank + 1 (lines 1418-1419). Llama-3-8B, framework megatron, cp 4 x tp 4 on 2 DGX H100 (cp ranks 0, 1
    on node 0: GPUs 0-3 and 4-7, each GPU its own NIC), s 32,768, recompute none. KV = 32768 / 4 tokens x
    8 / 4 KV heads x (128 + 128) x 2 B = 8,388,608 B. Node 0's crossing forward sends are cp rank 1's
    (1 -> 2): 32 layers x 3 x KV = 805,306,368 B on each NIC of GPUs 4-7; its crossing backward ones cp
    rank 0's (0 -> 3): 32 x (KV + 2 x 2 KV + KV) = 1,610,612,736 B on each NIC of GPUs 0-3 (before: all on
    GPUs 4-7's NICs, 2,415,919,104 B each, nothing on 0-3)."""
    from meshplan.schedule.netload import network_loads

    d = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 2},
         "training": {"global_batch": 1, "seq_len": 32768, "sharding": "none", "framework": "megatron",
                      "recompute": "none"},
         "mesh": {"names": ["cp", "tp"], "shape": [4, 4], "sequence_parallel": True}}
    plan = build_plan(config_from_dict(d))
    rows = [r for r in plan.collectives["stage 0"] if r.axis == "cp" and r.op == "send/recv"]
    kv = 32768 // 4 * (8 // 4) * (128 + 128) * 2
    assert kv == 8_388_608 and sorted((r.phase, r.size_bytes, r.per_step) for r in rows) == [
        ("backward", kv, 32), ("backward", kv, 32), ("backward", 2 * kv, 64), ("forward", kv, 96)]
    nics, _ = network_loads(plan, rows, 32)
    assert {i: b[0] for i, b in nics.items()} == pytest.approx(
        {**{i: 32 * (kv + 2 * 2 * kv + kv) for i in range(4)}, **{i: 32 * 3 * kv for i in range(4, 8)}}, rel=1e-12)
    assert 32 * 3 * kv == 805_306_368 and 32 * 6 * kv == 1_610_612_736


def test_search_bound_exposes_te_allgather():
    """--cp-comm-type all_gather under Megatron-LM: the search's bound (search/layer_bounds.chains) runs
    Transformer Engine's gathers and reduce-scatter beside nothing, as the timeline does since
    bc4c7788 (test_megatron_allgather_cp_is_exposed_by_hand): per layer forward the whole gather G
    (was max(G - wq's share, 0)), backward the reduce-scatter R, TE's own backward gather G, and under
    selective recompute the replayed core's gather G again (was max(R - wq's input-gradient share, 0)).
    So per candidate the chains grow by min(G, q_f) forward and min(R, q_b) + G (1 + replay) backward
    (q: the Q projection's share the bound let them hide beside), and the bound stays at or below
    the exact step of every sampled candidate (Llama-3-8B, 2 DGX H100 nodes, s 16,384)."""
    from meshplan.search.comm_bounds import comm_times
    from meshplan.search.layer_bounds import chains, layer_ops
    from meshplan.search.memory import Tables
    from meshplan.search.time_tables import TimeTables

    cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 2},
                            "training": {"global_batch": 16, "seq_len": 16384, "framework": "megatron",
                                         "cp_attention": "allgather"},
                            "search": {"cp": [2, 4], "pp": [1], "tp": [1, 2], "dp_replicate": [1], "micro_batch": [1],
                                       "recompute": ["none", "selective"], "vpp": [1]}}, require_mesh=False)
    r = search(cfg, workers=1)
    valid = np.flatnonzero(np.isfinite(r.est.step_lo) & (r.candidates.cp > 1))
    c = r.candidates.take(valid)
    tt = TimeTables(cfg, Tables(cfg))
    o, cm = layer_ops(cfg, tt, c, False), comm_times(cfg, tt, c)
    assert set(cm["cp_te_ag"].tolist()) == {1.0} and (cm["cp_ag"] > 0).all()
    f, b = chains(c, o, cm, False)
    f0, b0 = chains(c, o, {**cm, "cp_te_ag": np.zeros(len(c))}, False)   # the bound before
    g, rs = cm["cp_ag"], cm["cp_rs"]
    replay = (o["bi_cpr"] > 0).astype(float)
    assert set(replay.tolist()) == {0.0, 1.0}   # none and selective among the candidates
    assert (np.minimum(g, o["f_cpq"]) > 0).all()   # the bound grows on every candidate (fails before: f == f0)
    np.testing.assert_allclose(f - f0, np.minimum(g, o["f_cpq"]), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(b - b0, np.minimum(rs, o["bi_cpq"]) + g * (1 + replay), rtol=1e-9, atol=1e-12)
    ratios = []
    for i in valid[np.linspace(0, len(valid) - 1, min(6, len(valid))).astype(int)]:
        plan = build_plan(candidate_config(cfg, r.candidates, int(i)))
        if plan.feasible:
            ratios.append(r.est.step_lo[i] / step_time(plan).step_s)
    assert len(ratios) >= 3 and max(ratios) <= 1 + 1e-9, ratios
