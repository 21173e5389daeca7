"""torch's context-parallel ring attention in the collective table and the rank timeline
(``training.cp_attention = "ring"``, the default under framework torch: what torchtitan runs;
meshplan.spec.axes.cp.ring_rows), checked against torch 2.13's own ``_templated_ring_attention``
on the fake process group, and by hand; validate refuses it, the torchtitan import sets it."""

from __future__ import annotations

import pytest

from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.interop.foreign import load_any
from meshplan.plan import build_plan
from meshplan.schedule.comm_streams import comm_kind
from meshplan.schedule.comm_times import CommTimes
from meshplan.schedule.netload import network_loads
from meshplan.schedule.backward_pass import backward_unit
from meshplan.schedule.rank_timeline import forward_unit
from meshplan.schedule.unit_sim import Overlap
from meshplan.schedule.workload import chunk_costs, workload_of
from meshplan.spec.training import TrainingSpec
from tests.nccl_published import h100_nvlink_s, ndr_ring_s
from tests.test_interop import H100, TT

# 2 layers, h 64, 4 q heads of 16 and 2 KV heads (GQA: torchtitan's repeat_kv, [memory] kv_expanded, doubles K and V)
GQA = dict(layers=2, hidden=64, ffn=256, gated_mlp=False, q_heads=4, kv_heads=2, vocab=256)
#: [memory] kv_expanded true: K and V repeated to the q heads before SDPA (torchtitan before ff0829c)
EXPANDED = {"kv_expanded": True}


def _plan(model, mesh: dict, nodes: int = 1, memory: dict | None = None, **training):
    t = {"global_batch": 8, "seq_len": 32, "micro_batch": 1, "sharding": "zero3", "param_dtype": "bf16",
         "recompute": "none", **training}
    return build_plan(config_from_dict({"model": model, "cluster": {"system": "dgx-h100", "nodes": nodes},
                                        "training": t, "mesh": mesh, **({"memory": memory} if memory else {})}))


def _cp_rows(plan):
    return [r for r in plan.stage(0).collectives if comm_kind(r) == "cp"]


def _per_layer(rows, layers: int) -> list[tuple[str, str, float, str, float]]:
    """(phase, op, size_bytes, dtype, calls per layer and micro-batch) of the cp rows, sorted."""
    return sorted((r.phase, r.op, r.size_bytes, r.dtype, r.per_microbatch / layers) for r in rows)


def test_ring_rows_by_hand():
    """GQA, cp 4, b 1, s 32, tp 1: K and V at the heads the SDPA reads, d 16 each. By default
    (``[memory] kv_expanded`` false: torchtitan ff0829c and later pass enable_gqa, no repeat_kv) the
    2 KV heads: S = 1 x 32 x 2 x (16 + 16) = 2,048 elements. Forward all-gather 2,048 x 2 B = 4,096 B,
    the backward's own the same; cp = 4 shifts of the fp32 dK/dV of the rank's 32 / 4 = 8 tokens:
    2,048 / 4 x 4 B = 2,048 B each. With kv_expanded (repeat_kv before SDPA) the 4 q heads: S = 4,096,
    8,192 B gathered, 4,096 B a shift. All-gather CP gathers the 2 KV heads either way: 4,096 B."""
    plan = _plan(GQA, {"names": ["cp", "dp_shard"], "shape": [4, 2]})
    assert _per_layer(_cp_rows(plan), 2) == [("backward", "all-gather", 4096.0, "bf16", 1.0),
                                             ("backward", "send/recv", 2048.0, "fp32", 1.0),
                                             ("backward", "send/recv", 2048.0, "fp32", 3.0),
                                             ("forward", "all-gather", 4096.0, "bf16", 1.0)]
    expanded = _plan(GQA, {"names": ["cp", "dp_shard"], "shape": [4, 2]}, memory=EXPANDED)
    assert _per_layer(_cp_rows(expanded), 2) == [("backward", "all-gather", 8192.0, "bf16", 1.0),
                                                 ("backward", "send/recv", 4096.0, "fp32", 1.0),
                                                 ("backward", "send/recv", 4096.0, "fp32", 3.0),
                                                 ("forward", "all-gather", 8192.0, "bf16", 1.0)]
    full = _plan(GQA, {"names": ["cp", "dp_shard"], "shape": [4, 2]}, recompute="full")
    assert sum(r.per_microbatch for r in _cp_rows(full) if r.phase == "backward" and r.op == "all-gather") == 2 * 2
    gather = _plan(GQA, {"names": ["cp", "dp_shard"], "shape": [4, 2]}, cp_attention="allgather")
    assert _per_layer(_cp_rows(gather), 2) == [("backward", "reduce-scatter", 4096.0, "bf16", 1.0),
                                               ("forward", "all-gather", 4096.0, "bf16", 1.0)]
    megatron = _plan(GQA, {"names": ["cp", "dp_shard"], "shape": [4, 2]}, framework="megatron", cp_attention="allgather")
    # --cp-comm-type all_gather: the same rows, and Transformer Engine's backward gathers the saved local
    # K/V again (AttnFuncWithCPAndKVAllGather): one more 4,096 B all-gather per layer
    assert _per_layer(_cp_rows(megatron), 2) == sorted(_per_layer(_cp_rows(gather), 2)
                                                       + [("backward", "all-gather", 4096.0, "bf16", 1.0)])
    # Megatron-LM's default, Transformer Engine's p2p ring (tests/test_cp_p2p.py): K/V sends, no gather
    p2p = _plan(GQA, {"names": ["cp", "dp_shard"], "shape": [4, 2]}, framework="megatron")
    assert {(r.op, r.phase) for r in _cp_rows(p2p)} == {("send/recv", "forward"), ("send/recv", "backward")}


@pytest.mark.parametrize("kv_expanded", [False, True])
def test_ring_rows_match_torchs_own_ring_attention(kv_expanded):
    """torch 2.13's ``_templated_ring_attention`` and its backward, run on one rank of a fake
    process group of cp 4 with the CPU flash SDPA, issue per layer: forward one all-gather of the
    local K and V (bf16), backward one more and 4 all_to_all_single of the fp32 dK and dV
    (``permute_tensor``: each rank's whole buffer to the next rank, the table's send/recv rows).
    Shapes: GQA's 4 local q heads x 8 tokens x d 16, K and V at the heads the table's rank moves: its 2
    KV heads (the SDPA takes them as they are, enable_gqa; the CPU flash kernel reads grouped heads),
    or with ``[memory] kv_expanded`` the 4 q heads (repeat_kv before SDPA)."""
    torch = pytest.importorskip("torch")
    from torch_ring_calls import ring_calls
    f_calls, g_calls = ring_calls(kv_heads=4 if kv_expanded else 2)
    cp = 4  # torch_ring_calls runs cp 4
    rows = _cp_rows(_plan(GQA, {"names": ["cp", "dp_shard"], "shape": [4, 2]},
                          memory=EXPANDED if kv_expanded else None))
    # all_gather_into_tensor's input is the rank's part: the table's all-gather size is the whole buffer
    torch_rows = sorted([("forward", "all-gather", float(x * cp)) for _, x in f_calls]
                        + [("backward", "all-gather" if op == "all_gather_into_tensor" else "send/recv",
                            float(x * cp if op == "all_gather_into_tensor" else x)) for op, x in g_calls])
    table = sorted((r.phase, r.op, r.size_bytes) for r in rows for _ in range(int(r.per_microbatch / 2)))
    assert torch_rows == table
    assert len(g_calls) == 1 + cp


def _one_layer(**training):
    """Llama-3-8B, cp 2 across two DGX H100 nodes x dp_shard 8, s 8192, b 1: one layer's cost
    and cp rows, as tests/test_schedule_semantics.py's all-gather CP case."""
    plan = _plan({"catalog": "llama3-8b"}, {"names": ["cp", "dp_shard"], "shape": [2, 8]}, nodes=2,
                 **{"global_batch": 16, "seq_len": 8192, "recompute": "selective", **training})
    w = workload_of(plan)
    ch = chunk_costs(plan, w)[0][0]
    return w, type(ch)(ch.layers[:1], ch.moe[:1]), ch.layers[0], _cp_rows(plan)


def _ring_s(cost, phase: str) -> float:
    """Seconds of the ring's cp steps in ``phase``: the SDPA calls and the ring's own kernels."""
    return sum(o.seconds for o in cost.ops if o.phase == phase and o.block == "attn"
               and o.name in ("attention", "cp ring merge", "cp ring gradient accumulation"))


def test_ring_exposed_time_by_hand():
    """One layer, cp rows only, cp 2. K/V at the 8 KV heads (enable_gqa, ``[memory] kv_expanded``
    false; 4x more at the 32 q heads with it): S = 1 x 8192 x 8 x 256 = 16,777,216 elements; all-gather
    33,554,432 B (bf16), each shift 16,777,216 / 2 x 4 B = 33,554,432 B.
    Forward: the gather (A) is issued after wq, wk, wv and RoPE and waited for before
    the second of 2 SDPA calls: exposed max(A - c_f, 0), c_f half the calls' and merges' seconds.
    Backward: its own gather beside call 0 (c_b each), shift 1 (X) after call 0 on the same
    stream (after the gather), waited for after call 1; shift 2 after that wait, waited for at
    the end. By the streams: call 1 starts at max(A, c_b), shift 1 ends at max(A, c_b) + X, shift 2 ends X later:
    exposed = max(A, c_b) - c_b + max(X - c_b, 0) + X. (recompute "selective": the recomputed
    core's forward runs before the ring's backward steps, not among them.)"""
    w, one, cost, rows = _one_layer()
    ag = next(r for r in rows if r.phase == "forward")
    x = next(r for r in rows if r.op == "send/recv")
    assert ag.size_bytes == 2 * 8192 * 8 * 128 * 2 and x.size_bytes == 8192 // 2 * 8 * 256 * 4
    comm = CommTimes.from_rows(rows, layers=1)
    c_f, c_b = _ring_s(cost, "forward") / 2, _ring_s(cost, "backward_input") / 2
    f = forward_unit(one, comm, w, Overlap())
    assert f.exposed_s.get("cp", 0.0) == pytest.approx(max(ag.time_s - c_f, 0.0))  # no key when none is exposed
    assert f.duration_s == pytest.approx(cost.forward_s + max(ag.time_s - c_f, 0.0))
    b = backward_unit("B", one, comm, w, Overlap())
    want = max(ag.time_s, c_b) - c_b + max(x.time_s - c_b, 0.0) + x.time_s
    assert b.exposed_s["cp"] == pytest.approx(want)
    assert b.duration_s == pytest.approx(cost.backward_s + want)
    names = [e.name for e in b.events if e.stream == "cp"]
    assert names == ["cp K/V all-gather", "cp dK/dV shift", "cp dK/dV last shift"]


def test_compiled_ring_backward_waits_each_collective_at_once():
    """torch.compile (torchtitan compiles each block): traced, every functional collective is
    followed by ``wait_tensor`` and inductor's peak-memory order (torch 2.13's default) runs the
    backward as call 0, the gather, its wait, then per step the shift and its wait before the next
    call (ring_timeline.compiled_ring_backward; the generated code read at d 128, cp 2, 4, 8). One
    layer, cp 2: by hand the backward's cp exposure is A + 2 X, none of it beside a call, with A the
    gather's and X a shift's seconds from the table; the forward is unchanged, the gather beside
    the first call: max(A - c_f, 0). Eager (the test above) exposes max(A, c_b) - c_b +
    max(X - c_b, 0) + X, less by min(A, c_b) + min(X, c_b), c_b one backward call (1.24 ms here;
    the shift of the 8 KV heads' fp32 dK/dV crosses the nodes' NICs: 0.72 ms; 1.35 and 2.86 ms at the
    32 q heads, ``[memory] kv_expanded``)."""
    w, one, cost, rows = _one_layer(torch_compile=True)
    assert not w.torch_eager
    ag = next(r for r in rows if r.phase == "forward")
    x = next(r for r in rows if r.op == "send/recv")
    comm = CommTimes.from_rows(rows, layers=1)
    c_f, c_b = _ring_s(cost, "forward") / 2, _ring_s(cost, "backward_input") / 2
    b = backward_unit("B", one, comm, w, Overlap())
    assert b.exposed_s["cp"] == pytest.approx(ag.time_s + 2 * x.time_s)
    eager = max(ag.time_s, c_b) - c_b + max(x.time_s - c_b, 0.0) + x.time_s
    assert b.exposed_s["cp"] - eager == pytest.approx(min(ag.time_s, c_b) + min(x.time_s, c_b))
    assert b.duration_s == pytest.approx(cost.backward_s + ag.time_s + 2 * x.time_s)
    names = [e.name for e in b.events if e.stream == "cp"]
    assert names == ["cp K/V all-gather (waited at once)", "cp dK/dV shift (waited at once)", "cp dK/dV last shift"]
    f = forward_unit(one, comm, w, Overlap())
    assert f.exposed_s.get("cp", 0.0) == pytest.approx(max(ag.time_s - c_f, 0.0))  # no key when none is exposed


def test_ring_full_recompute_replays_the_forward_gather():
    """Full recompute: the replayed forward gathers again (beside its first SDPA call) before
    the backward's own gather and shifts: 2 all-gathers and 2 shifts on the cp stream."""
    w, one, cost, rows = _one_layer(recompute="full")
    comm = CommTimes.from_rows(rows, layers=1)
    b = backward_unit("B", one, comm, w, Overlap())
    names = [e.name for e in b.events if e.stream == "cp"]
    assert names == ["cp K/V all-gather", "cp K/V all-gather", "cp dK/dV shift", "cp dK/dV last shift"]


def test_megatron_refuses_ring_and_validate_names_the_field():
    with pytest.raises(ValueError, match="cp_attention \"ring\" is torch's context_parallel ring attention"):
        TrainingSpec(global_batch=8, seq_len=16, framework="megatron", cp_attention="ring")
    from meshplan.runtime.validation.refusals import runtime_refusals
    from meshplan.mesh.resolve import resolve_mesh
    def config(**training):
        return config_from_dict({"model": GQA, "cluster": {"system": "dgx-h100", "nodes": 1},
                                 "training": {"global_batch": 8, "seq_len": 32, **training},
                                 "mesh": {"names": ["cp"], "shape": [4]}})
    cfg = config()
    mesh = resolve_mesh(cfg.mesh, 4)
    why = [r for r in runtime_refusals(cfg, mesh) if "cp_attention" in r]
    assert len(why) == 1 and why[0].endswith("set cp_attention = \"allgather\"")
    assert not [r for r in runtime_refusals(config(cp_attention="allgather"), mesh) if "cp_attention" in r]


def test_torchtitan_import_plans_ring_and_reads_the_rotation(tmp_path):
    text = TT.read_text()
    assert "context_parallel_degree = 1" in text
    path = tmp_path / "cp.toml"
    path.write_text(text.replace("context_parallel_degree = 1", "context_parallel_degree = 2"))
    t = load_any(path, opts=H100).training  # torch's ring, the key left unset (framework torch's default)
    assert t.cp_attention is None and t.cp_ring
    path.write_text(text.replace("context_parallel_degree = 1", "context_parallel_degree = 2\n"
                                 "context_parallel_rotate_method = \"allgather\""))
    cfg = load_any(path, opts=H100)  # written and read: a note, not among the unused fields
    assert ("torchtitan: parallelism.context_parallel_rotate_method 'allgather' read: planned as torch's ring "
            "attention with the K/V all-gather rotation at cp 2") in cfg.notes
    assert "context_parallel_rotate_method" not in cfg.notes[-1]
    path.write_text(text.replace("context_parallel_degree = 1", "context_parallel_degree = 2\n"
                                 "context_parallel_rotate_method = \"alltoall\""))
    # planned since nc53 #2 (torch's all-to-all rotater, tests/test_cp_alltoall.py), no longer refused
    assert load_any(path, opts=H100).training.cp_rotate == "alltoall"
    assert load_any(TT, opts=H100).training.cp_attention is None  # cp 1: nothing to say


def test_a_shift_across_nodes_moves_at_one_nics_rate():
    """A dK/dV shift is one message from a rank to the next: it leaves through the sender's one NIC
    whether its cp group has 1 or 2 ranks on a node (newcomer 30: dp_shard 2 x cp 8 x tp 4 on 8
    dgx-h100 timed the shift at 93.9 GB/s, the group's 2 NICs, where one rank a node gave 47.0).
    8 x 8 = 64 GPUs, tp 4, cp 8, s 16,384 (b 1), 8 q and 4 KV heads of 32 (h 256): shift =
    16,384 x (4 / 4 = 1 local KV head, the SDPA's: kv_expanded false) x (32 + 32) x 4 B / 8 = 524,288 B
    (1,048,576 B at the 2 local q heads before the KV heads became the default). Mesh (dp_shard, cp, tp): cp stride 4, ranks 0, 4 on node 0 (2 a node); mesh (cp,
    dp_shard, tp): cp stride 8, one a node. Same bytes, same single-NIC time; at 400 Gb/s (50 GB/s)
    a rank's NIC line, algbw 524,288 B / t stays below it."""
    model = {**GQA, "hidden": 256, "q_heads": 8, "kv_heads": 4}
    kw = dict(seq_len=16384, global_batch=2)
    two = _plan(model, {"names": ["dp_shard", "cp", "tp"], "shape": [2, 8, 4]}, nodes=8, **kw)
    one = _plan(model, {"names": ["cp", "dp_shard", "tp"], "shape": [8, 2, 4]}, nodes=8, **kw)
    shifts = [[r for r in _cp_rows(p) if r.op == "send/recv"] for p in (two, one)]
    assert {r.size_bytes for s in shifts for r in s} == {524_288.0}
    assert {r.path.ranks_per_node for r in shifts[0]} == {2} and {r.path.ranks_per_node for r in shifts[1]} == {1}
    assert shifts[0][0].time_s == pytest.approx(shifts[1][0].time_s, rel=1e-12)
    assert 524_288 / shifts[0][0].time_s < 50e9
    # by hand: LL's 6.6 + 2.7 us, then 524,288 B at one NIC's 47.10 GB/s (ndr_ring_s: a pair's ring moves S
    # of 2 S), 11.1 us: 20.4 us; its 2 NICs would give 14.9 us
    one = ndr_ring_s(2, 1, 2 * 524_288)
    assert (round(one * 1e6, 1), round(ndr_ring_s(2, 2, 2 * 524_288) * 1e6, 1)) == (20.4, 14.9)
    assert [r.time_s for s in shifts for r in s] == pytest.approx([one] * sum(map(len, shifts)), rel=1e-9)


def _cp_times(plan) -> dict:
    """(op, size_bytes) -> seconds of stage 0's cp rows."""
    return {(r.op, r.size_bytes): r.time_s for r in _cp_rows(plan)}


def test_ring_rows_timed_by_hand_on_nvlink_and_the_nics():
    """The ring's row times, by hand from the catalog's curves, with K and V repeated to the q heads
    (``[memory] kv_expanded`` true, torchtitan before ff0829c), the sizes the pinned steps of
    test_newcomer8, test_restart_kind, test_compare and test_search_explain quoted before the KV heads
    became the default (195.7, 384.3, 202.1 us; all-gather CP's 36.3 and 59.1 us) and test_step_tp_hint's
    trial exposed (2.15 and 1.43 ms); then the default's, at the KV heads (enable_gqa): 70B at tp 2 moves
    its 4 local KV heads, 16,777,216 B gathered (36.3 us, all-gather CP's size) and 4096 x 4 x 256 x 4 B =
    16,777,216 B a shift, 7.2 + (42.17 + 15 / 8191 x (40,848.9 - 42.17) - 15.0) / 1.75 = 65.4 us
    (h100_nvlink_s: 15 MiB of the 8191 MiB from the 1 MiB row to the 8 GiB one); at tp 4 (2 KV heads) 8,388,608 B a shift, 42.7 us; at tp 8 over the NICs (1 KV head)
    32768 x 256 x 2 B = 16,777,216 B over 4 ranks, 6.6 + 3 x 2.7 + 3/4 x S / 47.10 GB/s = 0.282 ms, and a
    shift of 8,388,608 B, 6.6 + 2.7 + S / 47.10 GB/s = 0.187 ms.
    NVLink (tests/nccl_published.py h100_nvlink_s, the h100-nvlink4-ring rows; LL 6.6 + 0.6 us a
    step): Llama-3-70B at seq 8192, dp_shard 2 x cp 2 x tp 2 on one dgx-h100 (trial 8's q1top
    layout): K/V at 64 / tp 2 = 32 q heads, 8192 x 32 x 256 x 2 B = 134,217,728 B gathered over 2
    ranks, 7.2 + 1/2 x (674.9 - 15.0) / 1.75 = 195.7 us; each fp32 dK/dV shift of the rank's 4,096
    tokens, 4096 x 32 x 256 x 4 B = 134,217,728 B, 7.2 + 659.9 / 1.75 = 384.3 us; all-gather CP
    gathers the 8 / tp 2 = 4 KV heads, 16,777,216 B: 36.3 us. At tp 4, 16 q heads: a 67,108,864 B
    shift, 202.1 us; Llama-3-8B under all-gather CP (8 KV heads, tp 1): 33,554,432 B, 59.1 us.
    NICs (ndr_ring_s: 47.10 GB/s a NIC): seq 32768, dp_shard 2 x cp 4 x tp 8 on 8 dgx-h100 (cp
    stride 8: one rank a node), 8 q heads, 32768 x 8 x 256 x 2 B = 134,217,728 B over 4 ranks:
    6.6 + 3 x 2.7 us + 3/4 x S / 47.10 GB/s = 2.152 ms; the 8,192-token shift, 67,108,864 B,
    through its sender's one NIC: 6.6 + 2.7 us + S / 47.10 GB/s = 1.434 ms."""
    seq = {"global_batch": 8, "seq_len": 8192, "recompute": "none"}
    seventy = {"catalog": "llama3-70b"}
    q1 = _cp_times(_plan(seventy, {"names": ["dp_shard", "cp", "tp"], "shape": [2, 2, 2]}, memory=EXPANDED, **seq))
    ag, x = h100_nvlink_s("all-gather", 2, 134_217_728), h100_nvlink_s("send/recv", 2, 134_217_728)
    assert (round(ag * 1e6, 1), round(x * 1e6, 1)) == (195.7, 384.3)
    assert q1 == pytest.approx({("all-gather", 134_217_728.0): ag, ("send/recv", 134_217_728.0): x}, rel=1e-9)
    gather = _cp_times(_plan(seventy, {"names": ["dp_shard", "cp", "tp"], "shape": [2, 2, 2]}, cp_attention="allgather",
                             **seq))
    assert gather[("all-gather", 16_777_216.0)] == pytest.approx(h100_nvlink_s("all-gather", 2, 16_777_216), rel=1e-9)
    assert round(h100_nvlink_s("all-gather", 2, 16_777_216) * 1e6, 1) == 36.3
    tp4 = _cp_times(_plan(seventy, {"names": ["cp", "tp"], "shape": [2, 4]}, memory=EXPANDED, **seq))
    assert tp4[("send/recv", 67_108_864.0)] == pytest.approx(h100_nvlink_s("send/recv", 2, 67_108_864), rel=1e-9)
    assert round(h100_nvlink_s("send/recv", 2, 67_108_864) * 1e6, 1) == 202.1
    eight = _cp_times(_plan({"catalog": "llama3-8b"}, {"names": ["cp", "dp_shard"], "shape": [2, 4]},
                            cp_attention="allgather", **seq))
    assert eight[("all-gather", 33_554_432.0)] == pytest.approx(h100_nvlink_s("all-gather", 2, 33_554_432), rel=1e-9)
    assert round(h100_nvlink_s("all-gather", 2, 33_554_432) * 1e6, 1) == 59.1
    nic = _cp_times(_plan(seventy, {"names": ["dp_shard", "cp", "tp"], "shape": [2, 4, 8]}, nodes=8, memory=EXPANDED,
                          **{**seq, "seq_len": 32768}))
    ag, x = ndr_ring_s(4, 1, 134_217_728), ndr_ring_s(2, 1, 2 * 67_108_864)  # a pair's ring: S / 2 of 2 S
    assert (round(ag * 1e3, 3), round(x * 1e3, 3)) == (2.152, 1.434)
    assert nic == pytest.approx({("all-gather", 134_217_728.0): ag, ("send/recv", 67_108_864.0): x}, rel=1e-9)
    # the default, K and V at the KV heads
    q1 = _cp_times(_plan(seventy, {"names": ["dp_shard", "cp", "tp"], "shape": [2, 2, 2]}, **seq))
    ag, x = h100_nvlink_s("all-gather", 2, 16_777_216), h100_nvlink_s("send/recv", 2, 16_777_216)
    assert (round(ag * 1e6, 1), round(x * 1e6, 1)) == (36.3, 65.4)
    assert q1 == pytest.approx({("all-gather", 16_777_216.0): ag, ("send/recv", 16_777_216.0): x}, rel=1e-9)
    tp4 = _cp_times(_plan(seventy, {"names": ["cp", "tp"], "shape": [2, 4]}, **seq))
    assert tp4[("send/recv", 8_388_608.0)] == pytest.approx(h100_nvlink_s("send/recv", 2, 8_388_608), rel=1e-9)
    assert round(h100_nvlink_s("send/recv", 2, 8_388_608) * 1e6, 1) == 42.7
    nic = _cp_times(_plan(seventy, {"names": ["dp_shard", "cp", "tp"], "shape": [2, 4, 8]}, nodes=8,
                          **{**seq, "seq_len": 32768}))
    ag, x = ndr_ring_s(4, 1, 16_777_216), ndr_ring_s(2, 1, 2 * 8_388_608)
    assert (round(ag * 1e3, 3), round(x * 1e3, 3)) == (0.282, 0.187)
    assert nic == pytest.approx({("all-gather", 16_777_216.0): ag, ("send/recv", 8_388_608.0): x}, rel=1e-9)


def test_ring_shifts_cross_nodes_round_a_closed_ring():
    """torch's dK/dV shifts go from cp rank i to i + 1 and from rank cp - 1 back to rank 0
    (``_AllToAllRotater``: ``dsts = list(range(1, size)) + [0]``): a closed ring, not pp's chain.
    cp 4 x dp_shard 2 x tp 2 on 2 dgx-h100: cp stride 4, group 0 = ranks 0, 4 (node 0), 8, 12
    (node 1), g = 2: hops 0->4 in, 4->8 across, 8->12 in, 12->0 across: 2 of 4 hops cross, half a
    rank's bytes on average through a NIC (a chain's 1 of 3 would be a third). GQA at tp 2: 1 local
    KV head (the SDPA's, kv_expanded false), shift = 1 x 32 tokens x 1 head x (16 + 16) x 4 B / 4 =
    1,024 B; 8 / dp 2 = 4 micro-batches, 2 layers x 4 shifts x 4 = 32 a step: 32,768 B per rank. Node 0
    holds 2 members of each of the 4 cp groups, and each group's ring leaves it once (4 -> 8): 4 x 32,768 =
    131,072 B a step over node 0's NICs (a chain's 4 x 2 x 32,768 / 3 = 87,381)."""
    plan = _plan(GQA, {"names": ["cp", "dp_shard", "tp"], "shape": [4, 2, 2]}, nodes=2)
    shifts = [r for r in _cp_rows(plan) if r.op == "send/recv"]
    assert {r.size_bytes for r in shifts} == {1024.0} and sum(r.per_step for r in shifts) == 32
    assert {r.path.ranks_per_node for r in shifts} == {2} and {r.path.nodes for r in shifts} == {2}
    assert [r.link_bytes for r in shifts] == [(512.0, 512.0)] * len(shifts)
    nics, _ = network_loads(plan, shifts, 1)
    assert sum(b[0] for b in nics.values()) == pytest.approx(4 * 32_768)


def test_no_ring_without_the_fused_attention():
    """torch's ring runs the flash, efficient or cuDNN SDPA kernels only (torch 2.13
    ``_sdpa_handler``: "CP only supports flash attention and memory efficient attention now"),
    and meshplan's ring kernels need the fused attention (compute.ring_attention.applies). With
    ``flash_attention = false`` the table's rows are all-gather CP's, as its ops are: GQA, cp 4, s 32,
    tp 1: K and V at the 2 KV heads, 1 x 32 x 2 x (16 + 16) x 2 B = 4,096 B gathered forward and
    reduce-scattered backward, no shift; an explicit "ring" is refused."""
    plan = _plan(GQA, {"names": ["cp", "dp_shard"], "shape": [4, 2]}, flash_attention=False)
    assert _per_layer(_cp_rows(plan), 2) == [("backward", "reduce-scatter", 4096.0, "bf16", 1.0),
                                             ("forward", "all-gather", 4096.0, "bf16", 1.0)]
    with pytest.raises(ValueError, match="cp_attention \"ring\" runs torch's fused SDPA kernels only"):
        TrainingSpec(global_batch=8, seq_len=16, cp_attention="ring", flash_attention=False)
