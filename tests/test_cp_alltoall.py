"""torch's ring attention with the all-to-all K/V rotation (``training.cp_rotate = "alltoall"``,
torchtitan's ``parallelism.context_parallel_rotate_method = "alltoall"``; newcomer trial 53
finding 2, whose import refused it): the rows (checked against torch 2.13's own ring on the fake
process group and by hand on the trial's 70B cp 16 x tp 8 at 128k), the exposed time of the
shifts beside each SDPA step, the buffers in flight, import and export."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any
from meshplan.interop.torchtitan_write import write
from meshplan.memory.cp_buffers import cp_buffers
from meshplan.plan import build_plan
from meshplan.schedule.backward_pass import backward_unit
from meshplan.schedule.comm_times import CommTimes
from meshplan.schedule.rank_timeline import forward_unit
from meshplan.schedule.unit_sim import Overlap
from meshplan.spec.training import TrainingSpec
from tests.nccl_published import ndr_ring_s
from tests.test_cp_ring import EXPANDED, GQA, _cp_rows, _one_layer, _per_layer, _plan, _ring_s

DATA = Path(__file__).parent / "data" / "nc53b"
H200 = ImportOptions(cluster="dgx-h200", nodes=16)
MIB = 2**20


def test_alltoall_rows_by_hand():
    """GQA, cp 4, b 1, s 32, tp 1 (tests/test_cp_ring.py's case): K and V at the 2 KV heads the SDPA
    reads (``[memory] kv_expanded`` false), d 16 each; the rank's 8 tokens: 8 x 2 x 32 x 2 B = 1,024 B a
    K/V shift, cp - 1 = 3 per layer in the forward and 3 in the backward (bf16), beside the same 4 fp32
    dK/dV shifts of 2,048 B; no all-gather (the all-gather rotation's 4,096 B rows gone). With
    kv_expanded (the 4 q heads) each is twice that: 2,048 and 4,096 B."""
    expanded = _plan(GQA, {"names": ["cp", "dp_shard"], "shape": [4, 2]}, memory=EXPANDED, cp_rotate="alltoall")
    assert _per_layer(_cp_rows(expanded), 2) == [("backward", "send/recv", 2048.0, "bf16", 3.0),
                                                 ("backward", "send/recv", 4096.0, "fp32", 1.0),
                                                 ("backward", "send/recv", 4096.0, "fp32", 3.0),
                                                 ("forward", "send/recv", 2048.0, "bf16", 3.0)]
    plan = _plan(GQA, {"names": ["cp", "dp_shard"], "shape": [4, 2]}, cp_rotate="alltoall")
    assert _per_layer(_cp_rows(plan), 2) == [("backward", "send/recv", 1024.0, "bf16", 3.0),
                                             ("backward", "send/recv", 2048.0, "fp32", 1.0),
                                             ("backward", "send/recv", 2048.0, "fp32", 3.0),
                                             ("forward", "send/recv", 1024.0, "bf16", 3.0)]
    full = _plan(GQA, {"names": ["cp", "dp_shard"], "shape": [4, 2]}, cp_rotate="alltoall", recompute="full")
    kv = [r for r in _cp_rows(full) if r.phase == "backward" and r.dtype == "bf16"]  # the replay shifts again
    assert sum(r.per_microbatch for r in kv) == 2 * (3 + 3)  # 2 layers: 3 own shifts + 3 of the replay


@pytest.mark.parametrize("kv_expanded", [False, True])
def test_alltoall_rows_match_torchs_own_ring_attention(kv_expanded):
    """torch 2.13's ``_templated_ring_attention`` and its backward after ``set_rotate_method("alltoall")``
    (what torchtitan's ``context_parallel_rotate_method = "alltoall"`` calls), one rank of a fake
    process group of cp 4, CPU flash SDPA: the forward issues 3 all_to_all_single of the local K
    and V (bf16, 2 KV heads x 8 tokens x 32 x 2 B = 1,024 B; with ``[memory] kv_expanded`` 4 heads,
    2,048 B) and no all-gather; the backward 3 more of them and 4 of the fp32 dK/dV (2,048 B; 4,096 B):
    the table's rows, one for one."""
    torch = pytest.importorskip("torch")
    from torch_ring_calls import ring_calls
    f_calls, g_calls = ring_calls("alltoall", kv_heads=4 if kv_expanded else 2)
    cp = 4  # torch_ring_calls runs cp 4
    assert {op for op, _ in f_calls + g_calls} == {"all_to_all_single"}
    rows = _cp_rows(_plan(GQA, {"names": ["cp", "dp_shard"], "shape": [4, 2]}, cp_rotate="alltoall",
                          memory=EXPANDED if kv_expanded else None))
    torch_rows = sorted([("forward", "send/recv", float(x)) for _, x in f_calls]
                        + [("backward", "send/recv", float(x)) for _, x in g_calls])
    table = sorted((r.phase, r.op, r.size_bytes) for r in rows for _ in range(int(r.per_microbatch / 2)))
    assert torch_rows == table and len(f_calls) == cp - 1 and len(g_calls) == 2 * cp - 1


def test_alltoall_exposed_time_by_hand():
    """One layer of Llama-3-8B, cp 2 across two dgx-h100 (test_cp_ring._one_layer): the K/V shift
    K (the rank's 4,096 tokens x 8 KV heads x 256 x 2 B = 16,777,216 B, the heads the SDPA reads:
    ``[memory] kv_expanded`` false; through one NIC: 6.6 + 2.7 us + S / 47.10 GB/s = 0.366 ms; 4x that
    at the 32 q heads), the fp32 dK/dV shift X (33,554,432 B). Forward: K beside the first of 2 SDPA calls (c_f each),
    waited for before the second: max(K - c_f, 0). Backward, eager: K beside call 0, then after
    it the dK/dV shift on the same cp stream; call 1 waits for K, the last shift X after call 1
    and the first shift: max(K - c_b, 0) + max(X - c_b, 0) + X. Compiled (each functional
    collective waited at once, ring_timeline.compiled_ring_backward): K + 2 X. At cp 2 the
    all-gather rotation moves the same bytes (its ring gather sends (2 - 1) / 2 of the whole
    33,554,432 B sequence, one shift's 16,777,216 B) at the same place: the same exposure."""
    for compiled in (False, True):
        w, one, cost, rows = _one_layer(cp_rotate="alltoall", torch_compile=compiled)
        kv = next(r for r in rows if r.phase == "forward")
        x = next(r for r in rows if r.dtype == "fp32")
        assert (kv.op, kv.size_bytes, x.size_bytes) == ("send/recv", 4096 * 8 * 256 * 2, 4096 * 8 * 256 * 4)
        assert kv.time_s == pytest.approx(ndr_ring_s(2, 1, 2 * 16_777_216), rel=1e-9)
        assert round(kv.time_s * 1e3, 3) == 0.366
        comm = CommTimes.from_rows(rows, layers=1)
        c_f, c_b = _ring_s(cost, "forward") / 2, _ring_s(cost, "backward_input") / 2
        f = forward_unit(one, comm, w, Overlap())
        assert f.exposed_s.get("cp", 0.0) == pytest.approx(max(kv.time_s - c_f, 0.0))  # no key when none
        b = backward_unit("B", one, comm, w, Overlap())
        want = kv.time_s + 2 * x.time_s if compiled else \
            max(kv.time_s - c_b, 0.0) + max(x.time_s - c_b, 0.0) + x.time_s
        assert b.exposed_s["cp"] == pytest.approx(want)
        w_ag, one_ag, _, rows_ag = _one_layer(torch_compile=compiled)
        comm_ag = CommTimes.from_rows(rows_ag, layers=1)
        assert backward_unit("B", one_ag, comm_ag, w_ag, Overlap()).exposed_s["cp"] == pytest.approx(b.exposed_s["cp"])
        assert forward_unit(one_ag, comm_ag, w_ag, Overlap()).exposed_s.get("cp", 0.0) == pytest.approx(
            f.exposed_s.get("cp", 0.0))


def test_trial_70b_cp16_tp8_alltoall_rows_and_buffers():
    """newcomer trial 53's job (tests/data/nc53b/tt_70b_128k_a2a.toml: Llama 3.1 70B, seq 131,072,
    cp 16 x tp 8 on 16 dgx-h200, full AC, compiled, float8): torchtitan v0.2.2 passes enable_gqa to
    SDPA, so the ring moves the 8 / tp 8 = 1 local KV head (``[memory] kv_expanded`` false, what the
    import plans), d 128, the rank's 131,072 / 16 = 8,192 tokens: a K/V shift is 8,192 x 1 x 256 x 2 B =
    4,194,304 B (4 MiB; the all-gather rotation gathers 16 of them, 64 MiB), one per NIC (cp stride 8,
    one rank a node): 6.6 + 2.7 us + 4,194,304 B / 47.10 GB/s = 98.4 us. Per layer 15 in the forward, 15
    in the backward, 15 in the full AC's replay; the fp32 dK/dV shifts 16 of 8 MiB (187.4 us). At the 8
    q heads (kv_expanded, torchtitan before ff0829c) 8x each: 32 MiB shifts, 721.8 us.
    Buffers (memory.cp_buffers, R = the gathered 64 MiB): forward 3 x 4 MiB in flight (received, sent,
    the next receive) + the fp32 merged output 8,192 x 8 q heads x 128 x 4 B = 32 MiB: 44 MiB, against
    the all-gather rotation's 64 + 4 + 32 = 100 MiB; backward 4 + 2 x 4 MiB of K/V, the fp32 dQ (32 MiB)
    and four 8 MiB dK/dV buffers: 76 MiB, against 64 + 4 + 32 + 32 = 132 MiB. At the q heads (R 512 MiB):
    128 and 384 MiB against 576 and 832 MiB."""
    cfg = load_any(DATA / "tt_70b_128k_a2a.toml", opts=H200)
    assert cfg.training.cp_rotate == "alltoall" and not cfg.memory.kv_expanded
    plan = build_plan(cfg)
    rows = _cp_rows(plan)
    kv = [r for r in rows if r.dtype == "bf16"]
    assert {r.size_bytes for r in kv} == {4_194_304.0} and all(r.op == "send/recv" for r in rows)
    assert {r.size_bytes for r in rows if r.dtype == "fp32"} == {8_388_608.0}
    assert sorted(r.per_microbatch / 80 for r in kv) == [15.0, 15.0, 15.0]
    assert sorted(r.per_microbatch / 80 for r in rows if r.dtype == "fp32") == [1.0, 15.0]
    assert kv[0].time_s == pytest.approx(ndr_ring_s(2, 1, 2 * 4_194_304), rel=1e-9)
    assert round(kv[0].time_s * 1e6, 1) == 98.4
    expanded = build_plan(replace(cfg, memory=cfg.memory.model_copy(update=EXPANDED)), memory=False)
    kv = [r for r in expanded.collectives["stage 0"] if r.axis == "cp" and r.dtype == "bf16"]
    assert {r.size_bytes for r in kv} == {33_554_432.0} and round(kv[0].time_s * 1e6, 1) == 721.8
    ag_training = cfg.training.model_copy(update={"cp_rotate": "allgather"})
    for kv_expanded, want_a2a, want_ag in ((False, (44, 76), (100, 132)), (True, (128, 384), (576, 832))):
        a2a = cp_buffers(cfg.model, cfg.training, cp=16, tp=8, kv_expanded=kv_expanded, checkpointed=False)
        ag = cp_buffers(cfg.model, ag_training, cp=16, tp=8, kv_expanded=kv_expanded, checkpointed=False)
        assert (a2a.forward, a2a.backward) == (want_a2a[0] * MIB, want_a2a[1] * MIB)
        assert (ag.forward, ag.backward) == (want_ag[0] * MIB, want_ag[1] * MIB)


def test_import_export_and_refusals(tmp_path):
    """The import sets cp_rotate from the key (a note says so), export writes it back; a value
    torch does not know is a one-line error naming the key; cp_rotate off torch's ring is refused."""
    cfg = load_any(DATA / "tt_70b_128k_a2a.toml", opts=H200)
    assert any("'alltoall' read: planned as torch's ring attention at cp 16 with the all-to-all rotation" in n
               for n in cfg.notes)
    assert write(cfg)["parallelism"]["context_parallel_rotate_method"] == "alltoall"
    same = load_any(DATA / "tt_70b_128k.toml", opts=H200)
    assert same.training.cp_rotate == "allgather" and "context_parallel_rotate_method" not in write(same)["parallelism"]
    bad = tmp_path / "bad.toml"
    bad.write_text((DATA / "tt_70b_128k_a2a.toml").read_text().replace('"alltoall"', '"ring"'))
    with pytest.raises(ConfigError, match=r"^parallelism.context_parallel_rotate_method: 'ring' is not \"allgather\" "
                                          r"or \"alltoall\""):
        load_any(bad, opts=H200)
    with pytest.raises(ValueError, match="cp_rotate 'alltoall' is torch's ring attention's K/V rotation"):
        TrainingSpec(global_batch=8, seq_len=16, framework="megatron", cp_rotate="alltoall")
    with pytest.raises(ValueError, match="cp_rotate 'alltoall' is torch's ring attention's K/V rotation"):
        TrainingSpec(global_batch=8, seq_len=16, cp_attention="allgather", cp_rotate="alltoall")


def _trial_layer(path: Path, kv_expanded: bool = False):
    """The trial's one layer (its cost, cp rows and workload) from the job file at ``path``, with
    ``[memory] kv_expanded`` set as told (the import plans v0.2.2's false)."""
    from meshplan.schedule.workload import chunk_costs, workload_of
    cfg = load_any(path, opts=H200)
    plan = build_plan(replace(cfg, memory=cfg.memory.model_copy(update={"kv_expanded": kv_expanded})))
    w = workload_of(plan)
    ch = chunk_costs(plan, w)[0][0]
    return w, type(ch)(ch.layers[:1], ch.moe[:1]), ch.layers[0], _cp_rows(plan)


def test_trial_70b_exposed_cp_against_the_allgather_rotation():
    """The trial's layer (compiled, full AC; streams alone, no NIC sharing), K and V at the 8 q heads
    (``[memory] kv_expanded``, torchtitan before ff0829c: the sizes where a shift outlasts a step):
    K = 721.8 us a K/V shift, X = 1.434 ms an fp32 dK/dV shift, A the all-gather rotation's 512 MiB gather over 16
    ranks, 6.6 + 15 x 2.7 us + 15/16 x 536,870,912 B / 47.10 GB/s = 10.73 ms; c the seconds of one
    of the 16 SDPA steps (sdpa / 16, 8,192 local tokens). Forward: 15 shifts each beside one step,
    each waited for before the next (the sender sends what it received): 15 max(K - c, 0), against
    max(A - c, 0). Compiled backward: every collective waited at once, 15 K + 16 X = 33.77 ms
    against A + 16 X = 33.68 ms: at cp 16 the shifts move 15/16 of what the gather moves, but
    each pays NCCL's latency and none overlaps; the full AC's replayed forward (its steps as
    long as the forward's) exposes its 15 max(K - c, 0) before them. The all-to-all rotation gains
    in the forward and the replayed forward only.
    At the job's own 1 KV head (v0.2.2: enable_gqa; kv_expanded false) every size is 8x smaller: K = 98.4 us,
    below a step (c), so the forward and the replay expose nothing, X = 187.4 us, A = 6.6 + 15 x 2.7 us +
    15/16 x 67,108,864 B / 47.10 GB/s = 1.38 ms; compiled backward 15 K + 16 X = 4.47 ms against
    A + 16 X = 4.38 ms."""
    w, one, cost, rows = _trial_layer(DATA / "tt_70b_128k_a2a.toml", kv_expanded=True)
    k = next(r for r in rows if r.phase == "forward").time_s
    x = next(r for r in rows if r.dtype == "fp32").time_s
    comm = CommTimes.from_rows(rows, layers=1)
    c_f = _ring_s(cost, "forward") / 16
    assert not w.torch_eager and k > c_f
    f = forward_unit(one, comm, w, Overlap())
    assert f.exposed_s["cp"] == pytest.approx(15 * (k - c_f))
    b = backward_unit("B", one, comm, w, Overlap())
    assert b.exposed_s["cp"] == pytest.approx(15 * (k - c_f) + 15 * k + 16 * x)  # the replayed forward's, then its own
    w_ag, one_ag, cost_ag, rows_ag = _trial_layer(DATA / "tt_70b_128k.toml", kv_expanded=True)
    a = next(r for r in rows_ag if r.phase == "forward").time_s
    assert a == pytest.approx(ndr_ring_s(16, 1, 536_870_912), rel=1e-9) and round(a * 1e3, 2) == 10.73
    comm_ag = CommTimes.from_rows(rows_ag, layers=1)
    c_ag = _ring_s(cost_ag, "forward") / 16  # its compiled steps keep one K/V concatenation, not 15
    assert c_ag < c_f and forward_unit(one_ag, comm_ag, w_ag, Overlap()).exposed_s["cp"] == pytest.approx(a - c_ag)
    assert round((15 * k + 16 * x) * 1e3, 2) == 33.77 and round((a + 16 * x) * 1e3, 2) == 33.68
    assert f.exposed_s["cp"] < a - c_ag
    # the job's own KV heads
    w, one, cost, rows = _trial_layer(DATA / "tt_70b_128k_a2a.toml")
    k = next(r for r in rows if r.phase == "forward").time_s
    x = next(r for r in rows if r.dtype == "fp32").time_s
    comm = CommTimes.from_rows(rows, layers=1)
    assert (round(k * 1e6, 1), round(x * 1e6, 1)) == (98.4, 187.4) and k < _ring_s(cost, "forward") / 16
    assert forward_unit(one, comm, w, Overlap()).exposed_s.get("cp", 0.0) == 0.0
    assert backward_unit("B", one, comm, w, Overlap()).exposed_s["cp"] == pytest.approx(15 * k + 16 * x)
    w_ag, one_ag, cost_ag, rows_ag = _trial_layer(DATA / "tt_70b_128k.toml")
    a = next(r for r in rows_ag if r.phase == "forward").time_s
    assert a == pytest.approx(ndr_ring_s(16, 1, 67_108_864), rel=1e-9) and round(a * 1e3, 2) == 1.38
    assert round((15 * k + 16 * x) * 1e3, 2) == 4.47 and round((a + 16 * x) * 1e3, 2) == 4.38
