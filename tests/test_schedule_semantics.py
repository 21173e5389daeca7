"""Schedule semantics that match the runtimes (issue 11, item 3): the rank timeline issues the
collectives the collective table counts, the CP K/V all-gather lands before the attention that
uses it, the gradient reduce dtype comes from the config, TP overlap only when configured,
uneven first/last stages with virtual stages."""

from collections import Counter

import pytest

from meshplan.comm.deepspeed_ipg import IPG
from meshplan.comm.fsdp_rows import fsdp_gather_flags
from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.plan import build_plan
from meshplan.schedule.comm_streams import comm_kind
from meshplan.schedule.comm_times import CommTimes
from meshplan.schedule.backward_pass import backward_unit
from meshplan.schedule.rank_timeline import forward_unit
from meshplan.schedule.unit_sim import Overlap
from meshplan.schedule.row_groups import CP_PACKED, shard_group
from meshplan.spec.axes.cp import P2P_PACKED
from meshplan.schedule.steptime import layer_unit_times, step_time
from meshplan.schedule.workload import chunk_costs, workload_of
from meshplan.units import dtype_bytes

# 4 layers, h 64, f 256 (GeLU), 4 heads of 16, vocab 256, untied: small enough for every schedule
TINY = dict(layers=4, hidden=64, ffn=256, gated_mlp=False, q_heads=4, vocab=256)
COUNTED = ("shard", "replica", "cp", "step", "kv")  # data-parallel, CP and KV-replica collectives


def plan_of(mesh: dict, model=TINY, system="dgx-h100", nodes=1, **training):
    t = {"global_batch": 8, "seq_len": 64, "micro_batch": 1, "sharding": "zero3", "param_dtype": "bf16",
         "recompute": "none", **training}
    return build_plan(config_from_dict({"model": model, "cluster": {"system": system, "nodes": nodes},
                                        "training": t, "mesh": mesh}))


def table_counts(plan, s: int, kinds=COUNTED) -> Counter:
    """Per step, (kind, group, phase, op) -> calls, from stage s's collective table; ``kinds``:
    the row kinds counted (:func:`comm_kind`; with ``tp``, the blocking per-layer tp rows)."""
    out = Counter()
    layers = sum(len(c) for c in plan.stage(s).chunks)
    for r in plan.stage(s).collectives:
        kind = comm_kind(r)
        if kind == "shard" and IPG in r.cadence and kind in kinds:  # DeepSpeed ZeRO-3's reduce-scatters per ipg
            # bucket (nc52d): the timeline reduces each layer in one event of their summed seconds
            key = (kind, shard_group(r.cadence), r.phase, r.op)
            out[key] = layers * (r.per_step // max(r.per_microbatch, 1))
            continue
        if kind in kinds:
            group = shard_group(r.cadence) if kind in ("shard", "replica") else \
                CP_PACKED if kind == "cp" and P2P_PACKED in r.cadence else ""
            out[(kind, group, r.phase if kind != "step" else "step", "all-gather" if r.op == "all-gather" else
                 r.op if kind != "step" else "reduce")] += r.per_step
    return out


def timeline_counts(st, s: int, kinds=COUNTED) -> Counter:
    """Per step, the same keys from stage s's rank timeline: every unit's collectives (``tp``:
    not the loss's nor the per-layer norm-gradient all-reduces, the table's kinds ``loss`` and
    ``tp_async``, each one event of their summed seconds); the
    per-step ZeRO-1/2 / DDP reduction counts once per group it runs on (one bucket per stage and
    group, issued in per-layer pieces on each chunk's last gradient unit, or after the last unit
    when not overlapped; ZeRO-2's buckets in every micro-batch that issues pieces; an MoE
    stage's routed experts reduce on their own stream, efsdp, beside dp's), the ZeRO-1/2
    parameter all-gather once per group (a step-end event each)."""
    out, step_reduce, mbs = Counter(), set(), set()
    for e in st.pipeline.events:
        if e.stage != s or e.stream != "compute":
            continue
        for ie in st.units.of_event(e).events:
            a = ie.args
            if a.get("kind") == "dp":
                step_reduce.add(ie.stream)
                mbs.add(e.args["mb"])
            elif a.get("kind") in kinds and not (a["kind"] == "tp" and (a["phase"] == "loss" or "norm-grad" in ie.name)):
                out[(a["kind"], a["group"], a["phase"], a["op"])] += 1
    for e in st.post_events:
        if e.stage == s and e.stream == "kv_replica":  # one step-end event per layer's K/V gradient all-reduce
            out[("kv", "", "step", "all-reduce")] += 1
        elif e.stage == s and "grad reduce" in e.name:
            step_reduce.add(e.stream)
        elif e.stage == s and "param all-gather" in e.name and "step" in kinds:
            out[("step", "", "step", "all-gather")] += 1
    if step_reduce and "step" in kinds:
        buckets = st.units.comms[s].mb_buckets  # ZeRO-2: per micro-batch, every group's
        out[("step", "", "step", "reduce")] += len(mbs) * buckets if buckets else len(step_reduce)
    return out


SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2), ("dualpipev", 2)]
SHARDINGS = ["none", "zero1", "zero2", "zero3", "hsdp"]


def _mesh(sharding: str, schedule: str, vpp: int) -> dict:
    data = ["dp_replicate", "dp_shard"] if sharding == "hsdp" else ["dp" if sharding == "none" else "dp_shard"]
    shape = [2, 2] if sharding == "hsdp" else [2]
    return {"names": ["pp", *data], "shape": [2, *shape], "world": 4 * len(shape), "pp_schedule": schedule,
            "virtual_stages": vpp}


#: interleaved 1F1B beyond torch's window of 3 unsharded local stages (8 layers: one per virtual stage)
EVICTING = [("interleaved_1f1b", 4)]


@pytest.mark.parametrize("schedule,vpp", SCHEDULES + EVICTING)
@pytest.mark.parametrize("sharding", SHARDINGS)
@pytest.mark.parametrize("reshard", [True, False])
def test_timeline_issues_the_collectives_the_table_counts(schedule, vpp, sharding, reshard):
    """pp 2 (x vpp) x the data axes, m 4 per stage: on each stage, the rank timeline's calls
    per (kind, group, phase, op) equal the table's per-step counts. Before this fix a
    reshard_after_forward = false stage re-gathered every layer in every micro-batch (here 4
    layer gathers x m 4 = 16 per stage for the table's 2 + 1 root) and reduce-scattered every
    micro-batch where PipelineStage reduces once per step. The ends are torchtitan's units at
    pp 2 too: the embedding's on stage 0 (gathered again in backward when resharded, as chunk
    0's layers), [norm, output] on the stage holding the last chunk (once per step). At vpp 4
    torch's window of 3 local stages evicts chunks and gathers them again
    (meshplan.pipeline.unshard_window): the table and the timeline count the same re-gathers."""
    # DualPipeV needs m >= 2 pp: 4 micro-batches also with hsdp's dp 4
    batch = {"global_batch": 16} if schedule == "dualpipev" and sharding == "hsdp" else {}
    model = dict(TINY, layers=2 * vpp) if vpp > 2 else TINY
    plan = plan_of(_mesh(sharding, schedule, vpp), model=model, sharding=sharding, reshard_after_forward=reshard,
                   **batch)
    st = step_time(plan)
    for s in range(2):
        assert timeline_counts(st, s) == table_counts(plan, s), (s, table_counts(plan, s))
    if sharding in ("zero3", "hsdp"):  # torchtitan's end units at pp 2, not one root unit per stage
        head = 0 if schedule in ("zbv", "dualpipev") else 1  # a V's stage 0 holds the last chunk
        counts = table_counts(plan, 0) + table_counts(plan, 1)
        assert table_counts(plan, 0)[("shard", "root_embed", "forward", "all-gather")] >= 1
        # [norm, output] is never resharded by FSDP: once per step, or once per window UNSHARD at vpp 4
        again = fsdp_gather_flags(schedule, 2, plan.micro_batches, vpp, head, False, window=3)
        assert table_counts(plan, head)[("shard", "root_head", "forward", "all-gather")] == \
            sum(g for (c, _, _), g in again.items() if c == vpp - 1) >= 1
        assert table_counts(plan, 0)[("shard", "root_embed", "backward", "all-gather")] == \
            sum(g for (c, k, _), g in fsdp_gather_flags(schedule, 2, plan.micro_batches, vpp, 0, reshard,
                                                        window=3).items() if c == 0 and k == "B")
        assert not any(k[1] == "root" for k in counts), counts
    if sharding in ("zero3", "hsdp") and not reshard and vpp == 1:  # once per step: 2 layers + the end unit
        assert table_counts(plan, 0)[("shard", "layer", "forward", "all-gather")] == 2
        assert table_counts(plan, 0)[("shard", "layer", "backward", "all-gather")] == 0


@pytest.mark.parametrize("schedule,vpp", SCHEDULES)
@pytest.mark.parametrize("recompute", ["none", "full", "layer"])
@pytest.mark.parametrize("cp_attention", ["ring", "allgather"])
def test_cp_timeline_issues_the_collectives_the_table_counts(schedule, vpp, recompute, cp_attention):
    """pp 2 (x vpp) x cp 2 x dp_shard 2, m 8 per stage: the rank timeline's cp calls (and the
    FSDP ones) equal the table's per-step counts under torch's ring attention (per layer and
    micro-batch a forward all-gather, the backward's own, a checkpointed layer's replay, cp = 2
    dK/dV shifts) and under all-gather CP (forward all-gather, replay, reduce-scatter)."""
    plan = plan_of({"names": ["pp", "cp", "dp_shard"], "shape": [2, 2, 2], "world": 8, "pp_schedule": schedule,
                    "virtual_stages": vpp}, global_batch=16, recompute=recompute, cp_attention=cp_attention,
                   **({"ac_freq": 2} if recompute == "layer" else {}))
    st = step_time(plan)
    ring = cp_attention == "ring"
    for s in range(2):
        t = table_counts(plan, s)
        assert timeline_counts(st, s) == t, (s, t)
        layers, m = 2, 8  # TINY's 4 layers over pp 2; global batch 16 over dp_shard 2, b 1
        replayed = {"none": 0, "full": layers, "layer": layers // 2}[recompute]
        assert t[("cp", "", "forward", "all-gather")] == layers * m
        assert t[("cp", "", "backward", "all-gather")] == (layers * ring + replayed) * m
        assert t[("cp", "", "backward", "send/recv")] == 2 * layers * m * ring
        assert t[("cp", "", "backward", "reduce-scatter")] == layers * m * (not ring)


@pytest.mark.parametrize("schedule,vpp", [("1f1b", 1), ("interleaved_1f1b", 2)])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("cp_attention", ["p2p", "allgather"])
def test_p2p_timeline_issues_the_collectives_the_table_counts(schedule, vpp, recompute, cp_attention):
    """pp 2 (x vpp) x cp 4 x tp 2 with SP under framework megatron (Transformer Engine's p2p ring,
    Megatron-LM's default; tests/test_cp_p2p.py), m 8 per stage: the rank timeline's cp sends
    and tp collectives equal the table's per-step counts (the tp re-gather of the QKV input for
    its weight gradient too). Per layer and micro-batch: forward cp - 1 = 3 K/V sends;
    backward 2 K/V (or dK/dV) sends and cp - 2 = 2 of K, V, dK and dV, and a replayed core
    attention's (selective: Megatron-LM's checkpointed core_attention; full: the layer) 3 K/V more.
    ``--cp-comm-type all_gather`` (Transformer Engine's AttnFuncWithCPAndKVAllGather, inside the
    core attention): per layer and micro-batch a forward all-gather, the backward's own gather of
    the saved local K/V, a dK/dV reduce-scatter, and the replayed core's all-gather again under
    selective as under full recompute."""
    plan = plan_of({"names": ["pp", "cp", "tp"], "shape": [2, 4, 2], "world": 16, "pp_schedule": schedule,
                    "virtual_stages": vpp, "sequence_parallel": True}, nodes=2, global_batch=8, recompute=recompute,
                   framework="megatron", sharding="none", cp_attention=cp_attention)
    st, kinds = step_time(plan), tuple(k for k in COUNTED if k != "step") + ("tp",)
    # get_batch's broadcasts left out (the timeline keys them by their own group, this table count by ""),
    # tp's counted per op (a replay's tp events carry phase "forward", their rows "backward")
    def calls(counts: Counter) -> Counter:
        out: Counter = Counter()
        for k, n in counts.items():
            if k[3] != "broadcast":
                out[(k[0], k[1], "" if k[0] == "tp" else k[2], k[3])] += n
        return out
    for s in range(2):
        assert calls(timeline_counts(st, s, kinds)) == calls(table_counts(plan, s, kinds)), s
        t = table_counts(plan, s)
        lm = 2 * 8  # TINY's 4 layers over pp 2; global batch 8, b 1, no data axis
        if cp_attention == "allgather":
            assert t[("cp", "", "forward", "all-gather")] == lm
            assert t[("cp", "", "backward", "all-gather")] == (1 + (recompute != "none")) * lm
            assert t[("cp", "", "backward", "reduce-scatter")] == lm
            assert not any(k[0] == "cp" and k[3] == "send/recv" for k in t)
            continue
        replays = 0 if recompute == "none" else 3
        assert t[("cp", "", "forward", "send/recv")] == 3 * lm
        assert t[("cp", "", "backward", "send/recv")] == (2 + replays) * lm
        assert t[("cp", CP_PACKED, "backward", "send/recv")] == 2 * lm
        assert not any(k[0] == "cp" and k[3] != "send/recv" for k in t)


# TINY with 4 routed experts (top 2) in layers 1-3, layer 0 dense
MOE = dict(TINY, experts=4, top_k=2, dense_layers=1)
EXPERT, LAYER = ("shard", "expert"), ("shard", "layer")
FSDP_CALLS = [("forward", "all-gather"), ("backward", "all-gather"), ("backward", "reduce-scatter")]


def _moe_plan(names: list, shape: list, world: int, sharding: str = "zero3", global_batch: int = 16,
              **mesh_training):
    mesh = {k: mesh_training.pop(k) for k in ("pp_schedule", "virtual_stages") if k in mesh_training}
    return plan_of({"names": names, "shape": shape, "world": world, **mesh}, model=MOE, sharding=sharding,
                   global_batch=global_batch, **mesh_training)


@pytest.mark.parametrize("reshard", [True, False])
def test_moe_timeline_issues_the_expert_gathers_the_table_counts(reshard):
    """Newcomer finding 1: the table counted the routed experts' backward all-gathers under
    expert FSDP and the timeline left them out (the Mixtral example: 256 in the table, none on
    the trace, 1.44 s of 7.94 s). pp 1, dp_shard 4 x ep 2: efsdp = 4 / 2 = 2, m = 16 / 4 = 4.
    By hand per step: 3 MoE layers x 4 micro-batches = 12 expert all-gathers in forward, 12 again
    in backward when resharded after forward (torchtitan reshards the experts' unit as the
    block's, ``reshard_after_forward``; 0 without), 12 reduce-scatters; the layers' unit 4 x 4 =
    16 of each. dp_shard 2 x ep 2 (ep without efsdp: efsdp 1) has no expert row and none on the
    timeline."""
    plan = _moe_plan(["dp_shard", "ep"], [4, 2], 4, reshard_after_forward=reshard)
    counts = table_counts(plan, 0)
    assert timeline_counts(step_time(plan), 0) == counts
    assert [counts[(*EXPERT, *k)] for k in FSDP_CALLS] == [12, 12 if reshard else 0, 12]
    assert [counts[(*LAYER, *k)] for k in FSDP_CALLS] == [16, 16 if reshard else 0, 16]
    plan = _moe_plan(["dp_shard", "ep"], [2, 2], 2, global_batch=8, reshard_after_forward=reshard)
    counts = table_counts(plan, 0)
    assert timeline_counts(step_time(plan), 0) == counts
    assert not any(k[1] == "expert" for k in counts) and counts[(*LAYER, "forward", "all-gather")] == 16


@pytest.mark.parametrize("reshard", [True, False])
def test_moe_experts_gather_with_their_layer_under_ep1(reshard):
    """torchtitan (``apply_fsdp_to_decoder`` at b5bcd76) gives the routed experts a mesh of their
    own only under ep > 1; under ep 1 they are sharded with their block over its FSDP mesh, one
    all-gather of the whole layer. dp_shard 4 x ep 1, m 4, bf16, by hand: an MoE layer's dense
    part is attention 4 x 64 x 64 + router 4 x 64 + 2 norms x 64 = 16,768 elements, its experts
    4 x (w_in 256 x 64 + w_out 64 x 256) = 131,072 (4 experts over 4 ranks, dim 0, unpadded):
    (16,768 + 131,072) x 2 B = 295,680 B per all-gather, 3 MoE layers x 4 micro-batches = 12 in
    forward, none over efsdp and none on its stream (the dense layer 0: 98,560 B, the embedding
    32,768 B, [norm, output] 32,896 B, 4 each). Under ep 2 the same layer gathers 33,536 B over
    dp_shard and its 2 experts' 65,536 elements (131,072 B) over efsdp."""
    plan = _moe_plan(["dp_shard", "ep"], [4, 1], 4, reshard_after_forward=reshard)
    rows = [r for r in plan.stage(0).collectives if r.op == "all-gather" and r.phase == "forward"]
    assert sorted((r.axis, r.size_bytes, r.per_step) for r in rows) == [
        ("dp_shard", 32768, 4), ("dp_shard", 32896, 4), ("dp_shard", 98560, 4), ("dp_shard", (16768 + 131072) * 2, 12)]
    counts = table_counts(plan, 0)
    assert timeline_counts(step_time(plan), 0) == counts and not any(k[1] == "expert" for k in counts)
    plan = _moe_plan(["dp_shard", "ep"], [4, 2], 4, reshard_after_forward=reshard)
    assert {(r.axis, r.size_bytes) for r in plan.stage(0).collectives if r.op == "all-gather" and r.per_step == 12} \
        == {("dp_shard", 16768 * 2), ("efsdp", 65536 * 2)}


@pytest.mark.parametrize("schedule,vpp", SCHEDULES)
@pytest.mark.parametrize("sharding", SHARDINGS)
@pytest.mark.parametrize("reshard", [True, False])
def test_moe_timeline_issues_the_collectives_the_table_counts(schedule, vpp, sharding, reshard):
    """The dense test above with MoE layers: pp 2 x dp_shard 4 x ep 2 (efsdp 2; ``none``: dp 4,
    the experts' DDP over efsdp 2) and hsdp's dp_replicate 2 x dp_shard 2 x ep 2 (ep without
    efsdp: 2 / 2 = 1), m 4. The experts' unit reshards as its block's and is gathered by the same
    passes, so under vpp 1 (layers 0-1 on stage 0, 2-3 on stage 1) by hand: stage 1's two MoE
    layers gather and reduce their experts exactly as often as their layers, stage 0's one as
    half of its two layers (layer 0 is dense); with efsdp 1 no expert all-gather or
    reduce-scatter, only HSDP's all-reduce of the experts' gradients over dp_replicate, once per
    step and MoE layer (PipelineStage): 1 on stage 0, 2 on stage 1 (at vpp 2 too: stage 0 holds
    layers 0 and 2, or 0 and 3 in a V). The ZeRO-1/2 and DDP reductions and parameter
    all-gathers run once per group: dp and efsdp."""
    data, shape = {"hsdp": (["dp_replicate", "dp_shard"], [2, 2]), "none": (["dp"], [4])}.get(
        sharding, (["dp_shard"], [4]))
    plan = _moe_plan(["pp", *data, "ep"], [2, *shape, 2], 8, sharding=sharding, pp_schedule=schedule,
                     virtual_stages=vpp, reshard_after_forward=reshard)
    st = step_time(plan)
    for s in range(2):
        counts = table_counts(plan, s)
        assert timeline_counts(st, s) == counts, (s, counts)
        if sharding == "zero3" and vpp == 1:
            assert [counts[(*EXPERT, *k)] * (2 if s == 0 else 1) for k in FSDP_CALLS] == \
                [counts[(*LAYER, *k)] for k in FSDP_CALLS]
            assert (counts[(*EXPERT, "backward", "all-gather")] > 0) == reshard
        if sharding == "hsdp":
            assert [(k, n) for k, n in counts.items() if k[1] == "expert"] == \
                [(("replica", "expert", "backward", "all-reduce"), s + 1)]


TP_KEYS = [("forward", "all-gather"), ("forward", "reduce-scatter"), ("backward", "all-gather"),
           ("backward", "reduce-scatter")]


@pytest.mark.parametrize("schedule,vpp", [("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)])
@pytest.mark.parametrize("shared", [0, 1])
def test_moe_ep1_tp_timeline_issues_the_tp_collectives_the_table_counts(schedule, vpp, shared):
    """torch MoE at ep 1, tp 2 with SP (etp = tp: the routed experts sharded over tp as a dense
    MLP, torchtitan b5bcd76), with and without a shared expert: pp 2 x dp_shard 2 x tp 2, m 8 / 2
    = 4. The timeline's blocking tp collectives per (phase, op) equal the table's. Before this
    fix, with a shared expert, the timeline left out the second forward reduce-scatter of every
    MoE layer (routed and shared outputs reduced apart) and its backward all-gather: 4 calls of
    each per MoE layer and step. By hand at vpp 1 (stage 0: the embedding's reduce-scatter,
    dense layer 0, MoE layer 1; stage 1: MoE layers 2-3, the head's all-gather), per micro-batch:
    a dense layer AG 2 / RS 2 forward, an MoE layer AG 2 / RS 2 + shared, the backward the
    mirror; x 4. Every call moves 1 x 64 x 64 x 2 B = 8192 B, and the timeline spends the
    table's seconds on them (``time_s x per_step``)."""
    mesh = {"names": ["pp", "dp_shard", "tp"], "shape": [2, 2, 2], "world": 8, "sequence_parallel": True,
            "pp_schedule": schedule, "virtual_stages": vpp}
    plan = plan_of(mesh, model=dict(MOE, shared_experts=shared), global_batch=8)
    assert plan.mesh.etp == 2
    # the per-step reductions (kind step) as tests/test_schedule_step_rows.py counts them: by seconds
    st, kinds = step_time(plan), tuple(k for k in COUNTED if k != "step") + ("tp",)
    for s in range(2):
        counts = table_counts(plan, s, kinds)
        assert timeline_counts(st, s, kinds) == counts, (s, counts)
        rows = [r for r in plan.stage(s).collectives if comm_kind(r) == "tp"]
        assert {r.size_bytes for r in rows} == {8192}
        assert tp_seconds(st, s) == pytest.approx(sum(r.time_s * r.per_step for r in rows), rel=1e-9)
    if vpp == 1:
        by_hand = {0: [16, 4 * (1 + 2 + 2 + shared), 4 * (1 + 2 + 2 + shared), 16],
                   1: [20, 4 * (4 + 2 * shared), 4 * (4 + 2 * shared), 20]}
        assert {s: [table_counts(plan, s, kinds)[("tp", "", *k)] for k in TP_KEYS] for s in range(2)} == by_hand


def tp_seconds(st, s: int) -> float:
    """Seconds stage s's rank timeline spends on its blocking tp collectives per step (the
    compute stream's units' events of kind tp, not the loss's nor the norm-gradient all-reduces)."""
    return sum(ie.end_s - ie.start_s for e in st.pipeline.events if e.stage == s and e.stream == "compute"
               for ie in st.units.of_event(e).events if ie.args.get("kind") == "tp"
               and ie.args["phase"] != "loss" and "norm-grad" not in ie.name)


@pytest.mark.parametrize("schedule,vpp", [("1f1b", 1), ("interleaved_1f1b", 2)])  # Megatron-LM's (no zb_h1)
@pytest.mark.parametrize("shared", [0, 1])
@pytest.mark.parametrize("etp", [1, 2])
def test_megatron_moe_ep1_tp_timeline_issues_the_tp_collectives_the_table_counts(schedule, vpp, shared, etp):
    """The torch test above under framework megatron (SP, ZeRO-1), at etp 1 (meshplan's default
    at ep 1) and etp 2 (Megatron-LM's default, arguments.py:587-588 at d98e8a6). Megatron-LM's
    MoE layer gathers nothing over tp: the router and the alltoall dispatcher take the rank's
    sequence shard, the dispatcher moves tokens over ep and etp (its etp rows) and only a shared
    expert (a dense tp MLP) all-gathers and reduce-scatters over tp (meshplan.spec.axes.moe_tp.moe_mlp_tp_ops).
    Before this fix the timeline issued a dense MLP's tp AG/RS around every MoE block without a
    shared expert: forward AG and RS, backward RS and AG, 4 of each per MoE layer and step (the
    table: stage 0 [12, 12, 28, 12], timeline [16, 16, 32, 16]). By hand per micro-batch, s the
    shared experts (vpp 1: stage 0 the embedding, dense layer 0 and MoE layer 1; stage 1 MoE
    layers 2-3 and the head), as (fwd AG, fwd RS, bwd AG, bwd RS): a dense layer (2, 2, 2 + 2
    re-gathers for wgrad, 2); an MoE layer (1 + s, 1 + s, 1 + s + 1 re-gather, 1 + s); the
    embedding a forward all-reduce (its backward AG +1); the head (1, 0, 1 + 1 re-gather, 1).
    Stage 0: (3 + s, 3 + s, 7 + s, 3 + s) x m 4 = [12 + 4s, 12 + 4s, 28 + 4s, 12 + 4s] and 4
    all-reduces; stage 1: (3 + 2s, 2 + 2s, 5 + 2s, 3 + 2s) x 4 = [12 + 8s, 8 + 8s, 20 + 8s, 12 + 8s].
    Every AG/RS and the all-reduce move b 1 x s 64 x h 64 x 2 B = 8192 B. At etp 2 the etp rows:
    per MoE layer and micro-batch one AG and one RS each way of etp 2 x (32 tokens x top-2 = 64
    rows) x 64 x 2 B = 16,384 B, 4 (stage 0) and 8 (stage 1) of each per step, on the timeline
    too. The timeline spends the tp rows' seconds (get_batch's broadcasts included)."""
    mesh = {"names": ["pp", "dp_shard", "tp", "etp"], "shape": [2, 2, 2, etp], "world": 8,
            "sequence_parallel": True, "pp_schedule": schedule, "virtual_stages": vpp}
    plan = plan_of(mesh, model=dict(MOE, shared_experts=shared), global_batch=8, framework="megatron",
                   sharding="zero1")
    st, keys = step_time(plan), TP_KEYS + [("forward", "all-reduce")]
    for s in range(2):
        table, timeline = table_counts(plan, s, ("tp",)), timeline_counts(st, s, ("tp",))
        assert [timeline[("tp", "", *k)] for k in keys] == [table[("tp", "", *k)] for k in keys], s
        etp_rows = [r for r in plan.stage(s).collectives if r.axis == "etp"]
        on_timeline = Counter((ie.args["phase"], ie.args["op"]) for e in st.pipeline.events
                              if e.stage == s and e.stream == "compute" for ie in st.units.of_event(e).events
                              if ie.args.get("group") == "etp")
        assert on_timeline == Counter({(r.phase, r.op): r.per_step for r in etp_rows})
        assert {r.size_bytes for r in etp_rows} == ({16384} if etp == 2 else set())
        assert len(etp_rows) == (4 if etp == 2 else 0) and all(r.per_step == 4 * (s + 1) for r in etp_rows)
        rows = [r for r in plan.stage(s).collectives if comm_kind(r) == "tp"]
        assert {r.size_bytes for r in rows if r.op != "broadcast"} == {8192}
        assert tp_seconds(st, s) == pytest.approx(sum(r.time_s * r.per_step for r in rows), rel=1e-9)
    if vpp == 1:
        by_hand = {0: [12 + 4 * shared, 12 + 4 * shared, 28 + 4 * shared, 12 + 4 * shared, 4],
                   1: [12 + 8 * shared, 8 + 8 * shared, 20 + 8 * shared, 12 + 8 * shared, 0]}
        assert {s: [table_counts(plan, s, ("tp",))[("tp", "", *k)] for k in keys] for s in range(2)} == by_hand


@pytest.mark.parametrize("recompute,replayed", [("full", (32, 44)), ("op", (32, 0))])
def test_moe_ep1_tp_replay_issues_the_tp_collectives_the_table_counts(recompute, replayed):
    """The same MoE at pp 1 (dp_shard 2 x tp 2, SP, a shared expert, m 4), checkpointed: the
    timeline replays a layer's forward with the forward rows, the table counts the replay in
    backward, so the calls per op agree summed over both phases. By hand, the replay's calls of
    (all-gather, reduce-scatter) per step: eager full AC replays every collective of the layer
    (torchtitan's ``early_stop=False``, meshplan.compute.recompute.full_ac_replays_whole), AG 2 x 4
    layers x 4 = 32 and RS 4 x (dense 2 + MoE 3 x 3 layers) = 44 (was 28 = 4 x (1 + 2 x 3) when the
    replay stopped before a layer's closing reduce-scatter); op-level AC the all-gathers only, 32 and 0."""
    mesh = {"names": ["dp_shard", "tp"], "shape": [2, 2], "world": 4, "sequence_parallel": True}
    plan = plan_of(mesh, model=dict(MOE, shared_experts=1), global_batch=8, recompute=recompute)
    table, timeline = table_counts(plan, 0, ("tp",)), timeline_counts(step_time(plan), 0, ("tp",))
    per_op = lambda c, op: sum(n for k, n in c.items() if k[3] == op)
    assert [per_op(timeline, op) for op in ("all-gather", "reduce-scatter")] == \
        [per_op(table, op) for op in ("all-gather", "reduce-scatter")]
    # without the replay: forward AG 9 / RS 12 per micro-batch, backward AG 12 / RS 9 (the head's and embedding's included)
    assert [table[("tp", "", "backward", op)] - n for op, n in zip(("all-gather", "reduce-scatter"), (48, 36))] == \
        list(replayed)


def qkv_counts(plan, st, s: int) -> tuple[Counter, Counter]:
    """Stage s's calls per step of Megatron's QKV sub-sharding collectives by (phase, op): from the
    table's rows of that cadence, and from the rank timeline's events of group ``qkv``."""
    from meshplan.schedule.row_groups import QKV
    from meshplan.spec.axes.tp_kv import QKV_GATHER_CADENCE
    table = Counter()
    for r in plan.stage(s).collectives:
        if r.cadence == QKV_GATHER_CADENCE:
            table[(r.phase, r.op)] += r.per_step
    timeline = Counter()
    for e in st.pipeline.events:
        if e.stage == s and e.stream == "compute":
            for ie in st.units.of_event(e).events:
                if ie.args.get("kind") == "tp" and ie.args.get("group") == QKV:
                    timeline[(ie.args["phase"], ie.args["op"])] += 1
    return table, timeline


@pytest.mark.parametrize("schedule,vpp", [("1f1b", 1), ("interleaved_1f1b", 2)])  # Megatron-LM's schedules
@pytest.mark.parametrize("sharding,recompute", [("zero1", "none"), ("none", "none"), ("zero1", "full")])
def test_timeline_issues_megatrons_qkv_gathers(schedule, vpp, sharding, recompute):
    """Handed case C6 at small size under framework megatron: 4 q / 2 KV heads of 16, h 64, tp 4
    (past the 2 KV heads), pp 2 x dp 2. Megatron-LM (d98e8a6 attention.py:1851-1871) replicates no
    KV head: each layer all-gathers the fused QKV output over tp in forward and reduce-scatters its
    gradient in backward (a recomputed layer gathers again in its backward); no kv_replica row.
    Bytes by hand: b 1 x s 64 x (4 + 2 x 2) heads x 16 x 2 B (bf16) = 16,384 B; per micro-batch one
    of each per layer, 2 layers a stage, m 4 (global 8 / dp 2): 8 per step. The rank timeline
    issues the same calls, each blocking the compute stream."""
    data = "dp" if sharding == "none" else "dp_shard"
    mesh = {"names": ["pp", data, "tp"], "shape": [2, 2, 4], "world": 16, "pp_schedule": schedule,
            "virtual_stages": vpp}
    plan = plan_of(mesh, model=dict(TINY, kv_heads=2), nodes=2, sharding=sharding, global_batch=8,
                   framework="megatron", recompute=recompute)
    st = step_time(plan)
    replays = 8 if recompute == "full" else 0
    for s in range(2):
        assert not [r for r in plan.stage(s).collectives if r.axis == "kv_replica" or comm_kind(r) == "kv"]
        rows = [(r.axis, r.phase, r.op, r.size_bytes, r.dtype, r.per_microbatch, r.per_step, r.group_size)
                for r in plan.stage(s).collectives if "QKV sub-sharding" in r.cadence]
        expect = [("tp", "forward", "all-gather", 16384, "bf16", 2, 8, 4),
                  ("tp", "backward", "reduce-scatter", 16384, "bf16", 2, 8, 4)]
        expect += [("tp", "backward", "all-gather", 16384, "bf16", 2, 8, 4)] if replays else []
        assert rows == expect
        table, timeline = qkv_counts(plan, st, s)
        assert timeline == table == Counter({("forward", "all-gather"): 8, ("backward", "reduce-scatter"): 8,
                                             **({("backward", "all-gather"): replays} if replays else {})})
        assert counts_equal_with_kinds(plan, st, s)
    # blocking: each QKV collective's time is on the compute stream's critical chain (its wait ends
    # when the collective does)
    waits = [e for e in st.pipeline.events if e.stage == 0 and e.stream == "compute"]
    inner = [ie for e in waits for ie in st.units.of_event(e).events if ie.name.startswith("QKV ")]
    assert inner and all(ie.end_s - ie.start_s >= 0 for ie in inner)


def counts_equal_with_kinds(plan, st, s: int) -> bool:
    """The data-parallel, CP and step collectives still match between table and timeline."""
    return timeline_counts(st, s) == table_counts(plan, s)


def test_torch_keeps_its_kv_replica_rows_megatron_has_none():
    """The same tiny C6 model at tp 4 through the collective table alone (framework torch is refused
    by rule torch_kv_heads in a plan, but meshplan's own runtime keeps its replicated copies for its
    dry runs): torch's table has the kv_replica all-reduce and no QKV gather; megatron's the reverse."""
    from meshplan import catalog
    from meshplan.comm.collectives import collective_table
    from meshplan.mesh.resolve import resolve_mesh
    from meshplan.placement.assign import place
    from meshplan.spec.mesh import MeshSpec
    from meshplan.spec.model import ModelSpec
    from meshplan.spec.training import TrainingSpec
    m = ModelSpec(name="c6-tiny", layers=2, hidden=64, ffn=256, q_heads=4, kv_heads=2, vocab=256)
    mesh = resolve_mesh(MeshSpec(names=["tp"], shape=[4]), world=4)
    cluster = catalog.system("dgx-h100", nodes=1)
    kinds = {}
    for fw in ("torch", "megatron"):
        t = TrainingSpec(global_batch=1, seq_len=64, framework=fw, compute_dtype="bf16", recompute="none")
        rows = collective_table(m, t, mesh, cluster, place(cluster, 4), [0, 1], micro_batches=1)
        kinds[fw] = sorted({("kv" if r.axis == "kv_replica" else "qkv") for r in rows
                            if r.axis == "kv_replica" or "QKV sub-sharding" in r.cadence})
    assert kinds == {"torch": ["kv"], "megatron": ["qkv"]}


@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("sharding", ["zero3", "hsdp", "zero1", "none"])
def test_without_pp_every_micro_batch_gathers_and_reduces(sharding, reshard):
    """pp 1, m 4: FSDP2 gathers every unit in every forward (and backward when resharded) and
    reduce-scatters every micro-batch; the table and the timeline agree."""
    names = {"hsdp": ["dp_replicate", "dp_shard"], "none": ["dp"]}.get(sharding, ["dp_shard"])
    plan = plan_of({"names": names, "shape": [2] * len(names), "world": 2 ** len(names)}, sharding=sharding, reshard_after_forward=reshard,
                   global_batch=4 * 2 ** len(names))
    st = step_time(plan)
    assert timeline_counts(st, 0) == table_counts(plan, 0)
    if sharding == "zero3":  # 4 layers + root in each of m = 4 forwards
        assert table_counts(plan, 0)[("shard", "layer", "forward", "all-gather")] == 4 * plan.micro_batches


def test_interleaved_chunks_gather_by_their_own_order():
    """interleaved 1F1B, pp 2, vpp 2, m 4, reshard: stage 0's order is F0.c0 F1.c0 F0.c1 F1.c1
    F2.c0 B0.c1 F3.c0 B1.c1 F2.c1 B0.c0 F3.c1 B1.c0 B2.c1 B3.c1 B2.c0 B3.c0. Chunk 0 passes
    F0 F1 F2 F3 B0 B1 B2 B3: sharded at each F (after an F) and at B0 (after F3): 4 F + 1 B.
    Chunk 1 passes F0 F1 B0 B1 F2 F3 B2 B3: sharded at F0, F1, B0, F3 (F2 follows B1) and B2:
    3 F + 2 B. The table used chunk 0 for every chunk before (4 + 1 for both)."""
    f = fsdp_gather_flags("interleaved_1f1b", 2, 4, 2, 0, reshard=True)
    per = Counter((c, k) for (c, k, _), g in f.items() if g)
    assert (per[(0, "F")], per[(0, "B")], per[(1, "F")], per[(1, "B")]) == (4, 1, 3, 2)


# CP: the K/V all-gather lands before the attention that uses it -----------------------------

def _cp_plan(**training):
    """Llama-3-8B, cp 2 across two DGX H100 nodes (cp outermost) x dp_shard 8, s 8192, b 1;
    all-gather CP unless ``training`` says otherwise (torch's ring: tests/test_cp_ring.py)."""
    return plan_of({"names": ["cp", "dp_shard"], "shape": [2, 8]}, model={"catalog": "llama3-8b"}, nodes=2,
                   **{"global_batch": 16, "seq_len": 8192, "recompute": "selective", "cp_attention": "allgather",
                      **training})


def _one_layer(plan):
    w = workload_of(plan)
    ch = chunk_costs(plan, w)[0][0]
    cp_rows = [r for r in plan.stage(0).collectives if comm_kind(r) == "cp"]
    return w, type(ch)(ch.layers[:1], ch.moe[:1]), ch.layers[0], cp_rows


def _op_s(cost, phase, name):
    return sum(o.seconds for o in cost.ops if o.phase == phase and o.name == name)


def test_cp_kv_all_gather_ends_before_the_core_attention_starts():
    """Every K/V all-gather of the step's trace ends before the core attention of its layer
    starts, and every dK/dV reduce-scatter before the K/V projections' input gradients."""
    st = step_time(_cp_plan())
    ev = sorted(st.trace_events(), key=lambda e: (e.start_s, e.stream != "compute"))
    pending, checked = None, 0
    for e in ev:
        if e.name in ("cp K/V all-gather", "cp dK/dV reduce-scatter"):
            pending = e
        elif e.name in ("attention core", "attention K/V proj B"):
            assert pending is not None and pending.end_s <= e.start_s + 1e-12, (pending, e)
            pending, checked = None, checked + 1
    assert checked == 2 * 32 * st.pipeline.spec.m  # 32 layers, forward and backward, every micro-batch


def test_cp_exposed_time_by_hand():
    """One layer, cp rows only. K/V buffer: 2 (K and V) x b 1 x s 8192 x 8 KV heads x d 128 x
    2 B = 33,554,432 B. The gather is issued after wk, wv and RoPE and overlaps only wq, so the
    core attention waits AG - wq; in backward the dK/dV reduce-scatter (same bytes) overlaps
    only wq's input gradient: exposed RS - wq.dgrad. Both positive here (a cross-node gather
    of 33.5 MB against a 4096 x 4096 x 4096 GEMM). Before, the gather overlapped the whole
    attention block and nothing was exposed."""
    plan = _cp_plan()
    w, one, cost, rows = _one_layer(plan)
    ag = next(r for r in rows if r.phase == "forward")
    rs = next(r for r in rows if r.op == "reduce-scatter")
    assert ag.size_bytes == rs.size_bytes == 2 * 1 * 8192 * 8 * 128 * 2
    comm = CommTimes.from_rows(rows, layers=1)
    wq, wq_d = _op_s(cost, "forward", "wq"), _op_s(cost, "backward_input", "wq.dgrad")
    assert ag.time_s > wq and rs.time_s > wq_d
    f = forward_unit(one, comm, w, Overlap())
    assert f.exposed_s["cp"] == pytest.approx(ag.time_s - wq)
    assert f.duration_s == pytest.approx(cost.forward_s + ag.time_s - wq)
    b = backward_unit("B", one, comm, w, Overlap())
    assert b.exposed_s["cp"] == pytest.approx(rs.time_s - wq_d)
    assert b.duration_s == pytest.approx(cost.backward_s + rs.time_s - wq_d)


def test_cp_full_recompute_replays_the_gather_before_the_replayed_attention():
    """Full recompute: backward replays the forward with its K/V all-gather (the table's
    backward all-gather row), again before the replayed core attention: exposed twice AG - wq
    plus RS - wq.dgrad per layer."""
    plan = _cp_plan(recompute="full")
    w, one, cost, rows = _one_layer(plan)
    comm = CommTimes.from_rows(rows, layers=1)
    ag = next(r for r in rows if r.phase == "backward" and r.op == "all-gather")
    rs = next(r for r in rows if r.op == "reduce-scatter")
    b = backward_unit("B", one, comm, w, Overlap())
    wq_r = sum(o.seconds for o in cost.ops if o.phase == "backward_input" and o.name == "wq (recompute)")
    assert b.exposed_s["cp"] == pytest.approx(ag.time_s - wq_r + rs.time_s - _op_s(cost, "backward_input", "wq.dgrad"))
    names = [e.name for e in b.events if e.stream == "cp"]
    assert names == ["cp K/V all-gather", "cp dK/dV reduce-scatter"]


# Gradient reduce dtype from the config ------------------------------------------------------

# TINY's parameters by hand: per layer wq, wk, wv, wo 4 x 64 x 64 = 16,384, w_up + w_down
# 2 x 64 x 256 = 32,768, two RMSNorm weights 128: 49,280; root: embedding 256 x 64, final norm
# 64, output 256 x 64 = 32,832; total 4 x 49,280 + 32,832 = 229,952.
PARAMS, LAYER_PARAMS, ROOT_PARAMS = 229_952, 49_280, 32_832
EMB_PARAMS, HEAD_PARAMS = 256 * 64, 64 + 256 * 64  # the root's two FSDP2 units (torchtitan): 16,384 + 16,448


def _dp_rows(sharding, **training):
    names = {"hsdp": ["dp_replicate", "dp_shard"], "none": ["dp"]}.get(sharding, ["dp_shard"])
    plan = plan_of({"names": names, "shape": [2] * len(names), "world": 2 ** len(names)}, sharding=sharding,
                   **training)
    return plan, [r for r in plan.collectives["stage 0"] if r.axis != "tp" and r.op != "all-gather"]


@pytest.mark.parametrize("sharding,option,dtype", [
    ("none", None, "bf16"),        # default unchanged: torch DDP reduces the bf16 gradients
    ("none", "fp32", "fp32"),      # Megatron-LM: fp32 main gradients
    ("zero1", None, "fp32"),       # default unchanged: training.reduce_dtype (fp32)
    ("zero1", "bf16", "bf16"),
    ("zero3", None, "fp32"),
    ("zero3", "param", "bf16"),    # the parameter dtype
    ("hsdp", "bf16", "bf16"),
])
def test_gradient_reduce_bytes_follow_the_config(sharding, option, dtype):
    """DDP all-reduces all 229,952 gradients in one bucket; ZeRO-1 reduce-scatters them once
    per step; FSDP/HSDP reduce-scatter each layer's 49,280 and the root's 32,832 as torchtitan's
    two units, the embedding's 16,384 and [norm, output]'s 16,448, HSDP then all-reduces the
    shard (half) over dp_replicate; bytes = elements x the reduce dtype's size."""
    extra = {} if option is None else {"grad_reduce_dtype": option}
    plan, rows = _dp_rows(sharding, **extra)
    b = dtype_bytes(dtype)
    assert {r.dtype for r in rows} == {dtype}
    sizes = sorted(r.size_bytes for r in rows)
    if sharding in ("none", "zero1"):
        assert sizes == [PARAMS * b]
    elif sharding == "zero3":
        assert EMB_PARAMS + HEAD_PARAMS == ROOT_PARAMS
        assert sizes == [EMB_PARAMS * b, HEAD_PARAMS * b, LAYER_PARAMS * b]
    else:  # hsdp: reduce-scatter over dp_shard 2, then all-reduce of the half shard over dp_replicate 2
        assert sizes == sorted(x * b // k for x in (EMB_PARAMS, HEAD_PARAMS, LAYER_PARAMS) for k in (1, 2))


def test_ddp_fp32_reduction_is_what_the_timeline_spends():
    """The timeline's per-step DDP reduction (pieces on the last gradient unit) sums to the
    fp32 row's time, longer than the bf16 one."""
    times, sizes = {}, {}
    for dtype in ("bf16", "fp32"):
        plan, rows = _dp_rows("none", grad_reduce_dtype=dtype)
        st = step_time(plan)
        spent = sum(ie.dur_s for e in st.pipeline.events if e.stream == "compute"
                    for ie in st.units.of_event(e).events if ie.args.get("kind") == "dp")
        assert spent == pytest.approx(rows[0].time_s)
        times[dtype], sizes[dtype] = spent, rows[0].size_bytes
    assert sizes["fp32"] == 2 * sizes["bf16"]
    # 460 KB and 920 KB both lie in the measured NVLink curve's flat part (64 KiB to 1 MiB take
    # about the same time, latency-bound): the fp32 reduction is never faster, here no slower.
    assert times["fp32"] >= times["bf16"]


def test_grad_reduce_dtype_is_checked():
    with pytest.raises(ConfigError, match="grad_reduce_dtype"):  # fp16 is DeepSpeed's communication_data_type
        _dp_rows("none", grad_reduce_dtype="fp8")


# TP overlap only when configured -----------------------------------------------------------

def test_tp_comm_overlap_is_a_training_option():
    """Default: TP collectives block (Overlap.tp False, what step, compare and search use).
    training.tp_comm_overlap = true (under torch with torch_compile: torchtitan's async TP needs
    it, a config without is refused) runs the decomposed GEMMs (meshplan.compute.asynctp): faster
    than blocking, slower than step --overlap-tp's ideal overlap (whole GEMMs, every TP collective
    hidden up to its block's compute)."""
    mesh = {"names": ["dp_shard", "tp"], "shape": [2, 4], "sequence_parallel": True}
    with pytest.raises(ConfigError, match="^training: tp_comm_overlap under framework \"torch\" is torchtitan's "
                                          "async TP, which needs torch.compile"):
        plan_of(mesh, model={"catalog": "llama3-8b"}, global_batch=4, seq_len=4096, tp_comm_overlap=True)
    kw = dict(model={"catalog": "llama3-8b"}, global_batch=4, seq_len=4096, torch_compile=True)
    base = step_time(plan_of(mesh, **kw))
    opt = step_time(plan_of(mesh, tp_comm_overlap=True, **kw))
    flag = step_time(plan_of(mesh, **kw), Overlap(tp=True))
    assert flag.step_s < opt.step_s < base.step_s
    assert opt.exposed_s.get("tp", 0.0) < base.exposed_s["tp"]


# Uneven first and last stages with virtual stages (Llama 3) ---------------------------------

def test_uneven_first_and_last_stage_with_virtual_stages():
    """6 layers, pp 2, vpp 2, pp_layer_split [3, 3]: each stage's 3 layers go to 2 chunks, the
    short ones at the model's ends (Llama 3 removed one layer from the first and the last
    stage): virtual stages 0..3 hold 1, 2, 2, 1 layers: stage 0 [[0], [3, 4]], stage 1
    [[1, 2], [5]]. The plan, its step and its timeline/table agreement follow; the per-
    virtual-stage form [1, 2, 2, 1] gives the same stages. Before: refused ("pp_layer_split
    with virtual stages is not supported")."""
    mesh = {"names": ["pp", "dp_shard"], "shape": [2, 2], "world": 4, "pp_schedule": "interleaved_1f1b",
            "virtual_stages": 2}
    for split in ([3, 3], [1, 2, 2, 1]):
        for reshard in (True, False):
            plan = plan_of({**mesh, "pp_layer_split": split}, model={**TINY, "layers": 6},
                           reshard_after_forward=reshard)
            assert plan.feasible, plan.reasons
            assert plan.stages == [[[0], [3, 4]], [[1, 2], [5]]]
            st = step_time(plan)
            for s in range(2):
                assert timeline_counts(st, s) == table_counts(plan, s)
    # stage 0 with no layer: its last chunk (virtual stage 2, the model's middle) would be empty;
    # only the model's first and last virtual stage may hold the embedding or the output layer alone
    bad = plan_of({**mesh, "pp_layer_split": [0, 6]}, model={**TINY, "layers": 6})
    assert not bad.feasible
    assert "pp_layer_split gives stage 0 a chunk with no layer: each stage needs >= vpp 2 layers, 1 where it " \
        "holds the model's first virtual stage (the embedding alone) or its last (the output layer alone)" \
        in bad.reasons


# Whose backward order: torch (DTensor) or Megatron-LM ---------------------------------------

def _tp_calls(st, phase: str) -> Counter:
    """Stage 0's tp collectives per step by op, from the rank timeline's units."""
    out = Counter()
    for e in st.pipeline.events:
        if e.stage == 0 and e.stream == "compute":
            out.update(ie.args["op"] for ie in st.units.of_event(e).events
                       if ie.args.get("kind") == "tp" and ie.args.get("phase") == phase)
    return out


@pytest.mark.parametrize("framework,schedule", [("torch", "1f1b"), ("megatron", "1f1b"), ("torch", "zb_h1")])
def test_megatron_sp_gathers_the_input_again_for_the_weight_gradient(framework, schedule):
    """tp 4 with SP, pp 2, 4 dense layers (2 a stage), m 4. Per layer backward, torch issues
    the mirror of the forward: 2 all-gathers (before each block) and 2 reduce-scatters; Megatron
    also all-gathers each column-parallel linear's input again (attention and MLP: 2 more), except
    where B and W are separate units (ZB, which Megatron-LM does not run: refused there). The table's per-step count equals the timeline's:
    m 4 x (2 layers x (2 or 4) + 1) all-gathers on stage 0 (the 1: the gradient of the
    embedding output's forward reduce-scatter), 2 x 2 reduce-scatters per micro-batch.
    Megatron-LM 2022's get_batch also broadcasts over tp on every stage, per micro-batch (2755bcb
    mpu/data.py broadcast_data): the key sizes (_MAX_DATA_DIM 5 int64, 40 B) and the batch
    (b 1 x (s 64 + 1) int64, 520 B): 2 x m 4 = 8 per step in the table and on the timeline."""
    mesh = {"names": ["pp", "tp"], "shape": [2, 4], "sequence_parallel": True, "pp_schedule": schedule}
    plan = plan_of(mesh, sharding="zero1", framework=framework, global_batch=4)
    st = step_time(plan)
    regather = framework == "megatron" and schedule == "1f1b"
    per_layer = 4 if regather else 2
    row = Counter()
    for r in plan.stage(0).collectives:
        if r.axis == "tp":
            row[(r.phase, r.op)] += r.per_step
    assert row[("backward", "all-gather")] == 4 * (2 * per_layer + 1)
    assert row[("backward", "reduce-scatter")] == 4 * 2 * 2
    assert _tp_calls(st, "backward") == Counter({"all-gather": 4 * (2 * per_layer + 1), "reduce-scatter": 4 * 2 * 2})
    # forward: 2 all-gathers and 2 reduce-scatters per layer, and the embedding's collective:
    # torch reduce-scatters it, Megatron-LM 2022 all-reduces it (VocabParallelEmbedding) and
    # splits the sequence; the table and the timeline agree on both
    embed = "all-reduce" if framework == "megatron" else "reduce-scatter"
    bcast = Counter({"broadcast": 2 * 4}) if framework == "megatron" else Counter()
    fwd = Counter({"all-gather": 4 * 2 * 2, "reduce-scatter": 4 * 2 * 2}) + Counter({embed: 4}) + bcast
    assert {op: n for (ph, op), n in row.items() if ph == "forward"} == dict(fwd)
    assert _tp_calls(st, "forward") == fwd
    for s in range(2):
        sizes = sorted((r.size_bytes, r.dtype, r.per_step) for r in plan.stage(s).collectives if r.op == "broadcast")
        assert sizes == ([(40, "int64", 4), (520, "int64", 4)] if framework == "megatron" else [])


def test_torch_waits_for_the_input_gradient_collective_megatron_runs_it_beside_the_wgrad(no_host_pace):
    """tp 8 without SP, one layer: torch's backward of each block is B, W, then the all-reduce
    the next block waits for; Megatron's runs the all-reduce during W. So torch's backward
    exposes both all-reduces in full and Megatron's at most the part W does not cover."""
    mesh = {"names": ["tp"], "shape": [8], "sequence_parallel": False}
    kw = dict(model={"catalog": "llama3-8b"}, global_batch=1, seq_len=4096, sharding="zero1")
    plans = [plan_of(mesh, framework=f, **kw) for f in ("torch", "megatron")]
    torch_, mega = (layer_unit_times(p) for p in plans)
    def forward_of(p, names, prefixes=()):
        return sum(o.seconds for o in chunk_costs(p, workload_of(p))[0][0].layers[0].ops
                   if o.phase == "forward" and (o.name in names or o.name.startswith(prefixes)))
    qkv = [forward_of(p, ("wq", "wk", "wv")) for p in plans]
    # the frameworks' own kernels: the QKV GEMMs, the fused attention (torch's SDPA: FA2,
    # Megatron-LM: the catalog's FA3), and the elementwise kernels around them (torch uncompiled:
    # RoPE and SwiGLU kernel by kernel, repeat_kv for SDPA; Megatron: fused); the rest of the
    # forward, collectives included, is the same
    own = [forward_of(p, ("wq", "wk", "wv", "attention", "repeat_kv"), ("rope", "silu")) for p in plans]
    assert torch_[0] - own[0] == pytest.approx(mega[0] - own[1], rel=1e-12)  # forward: blocking in both
    assert qkv[1] < qkv[0]                        # Megatron's one fused QKV GEMM against torch's three
    plan = plan_of(mesh, framework="torch", **kw)
    ar = [r.time_s for r in plan.stage(0).collectives if (r.axis, r.phase, r.op) == ("tp", "backward", "all-reduce")][0]
    assert mega[1] < torch_[1] <= mega[1] + 2 * ar + 1e-12


def test_validate_refuses_a_megatron_plan():
    """validate runs torch.distributed: a plan in Megatron's order (its extra SP all-gathers)
    would not match what the run issues, so the runner names the field and the fix."""
    pytest.importorskip("torch")
    from meshplan.runtime.validation.validate import not_runnable

    mesh = {"names": ["dp_shard", "tp"], "shape": [2, 2], "sequence_parallel": True, "world": 4}
    plan = plan_of(mesh, framework="megatron")
    why = not_runnable(plan.config, plan.mesh)
    assert "training.framework" in why and 'framework = "torch"' in why
    torch_plan = plan_of(mesh)
    assert torch_plan.mesh is not None and not_runnable(torch_plan.config, torch_plan.mesh) is None


def test_search_counts_the_kv_replica_communicator():
    """The search's NCCL communicator count (``comm_axes``, behind its memory bounds) equals
    the distinct axes of the exact plan's collective rows under framework megatron, which at tp >
    kv_heads (8 q / 2 KV heads: at tp 4 and 8, not at tp 1 or 2) adds no kv_replica group (it
    replicates no KV head) but all-gathers the fused QKV output over tp; under torch the search rejects tp 4 and 8 by rule torch_kv_heads (torchtitan
    replicates no KV head), vectorised like the exact plan's rule."""
    import numpy as np

    from meshplan.search.memory import comm_axes
    from meshplan.search.space import CODE, OK, candidate_config, enumerate_candidates, first_reason

    model = {"layers": 2, "hidden": 1024, "ffn": 4096, "q_heads": 8, "kv_heads": 2, "head_dim": 128, "vocab": 32000}
    torch_cfg = config_from_dict({"model": model, "cluster": {"system": "dgx-h100", "nodes": 2},
                                  "training": {"global_batch": 16, "seq_len": 1024}}, require_mesh=False)
    c = enumerate_candidates(torch_cfg)
    why = first_reason(torch_cfg, c)
    assert set(why[c.tp > 2].tolist()) == {CODE["torch_kv_heads"]} and (why[c.tp <= 2] != CODE["torch_kv_heads"]).all()
    cfg = config_from_dict({"model": model, "cluster": {"system": "dgx-h100", "nodes": 2},
                            "training": {"global_batch": 16, "seq_len": 1024, "framework": "megatron"}},
                           require_mesh=False)
    c = enumerate_candidates(cfg)
    ok = np.flatnonzero(first_reason(cfg, c) == OK)
    n = comm_axes(cfg, c)
    seen = set()
    for j in ok.tolist():
        key = (int(c.tp[j]), int(c.pp[j]) > 1)
        if key in seen:
            continue
        seen.add(key)
        plan = build_plan(candidate_config(cfg, c, j))
        axes = {r.axis for rows in plan.collectives.values() for r in rows}
        assert n[j] == len(axes), (c.label(j), sorted(axes))
        assert "kv_replica" not in axes  # Megatron replicates no KV head (spec/axes/tp_kv.py)
        qkv = any("QKV sub-sharding" in r.cadence for rows in plan.collectives.values() for r in rows)
        assert qkv == (c.tp[j] > 2)  # its QKV all-gather on the tp group instead
    assert {t for t, _ in seen} >= {1, 2, 4, 8}


def test_step_rows_are_charged_every_call():
    """torch's SP norm gradients without FSDP: each of the 65 norms of Llama 3 8B (2 a layer and
    the final one) is all-reduced over tp by the default fused AdamW, once (comm/tp_grads.py
    PARTIAL_GRAD_READS): 65 calls a step, all charged at the step's end, beside DDP's bucket
    all-reduces (a new user's review found the row charged once); 3 reads each with the foreach
    AdamW, 195 calls."""
    from meshplan.schedule.comm_streams import comm_kind
    from meshplan.schedule.comm_times import CommTimes
    plan = plan_of({"names": ["dp", "tp"], "shape": [2, 4], "sequence_parallel": True},
                   model={"catalog": "llama3-8b"}, sharding="none", global_batch=2, seq_len=1024)
    rows = plan.stage(0).collectives
    norms = [r for r in rows if r.axis == "tp" and comm_kind(r) == "step"]
    assert [r.per_step for r in norms] == [2 * 32 + 1]
    ddp = [r for r in rows if r.axis == "dp" and comm_kind(r) == "step"]  # one row per DDP bucket size
    c = CommTimes.from_rows(rows, 32)
    assert c.ddp_buckets == sum(r.per_step for r in ddp) == 98  # tests/test_ddp_buckets.py, by hand
    assert c.step_reduce_s == pytest.approx(65 * norms[0].time_s + sum(r.time_s * r.per_step for r in ddp),
                                            rel=1e-12)
    foreach = plan_of({"names": ["dp", "tp"], "shape": [2, 4], "sequence_parallel": True},
                      model={"catalog": "llama3-8b"}, sharding="none", global_batch=2, seq_len=1024,
                      optimizer_impl="foreach")
    assert [r.per_step for r in foreach.stage(0).collectives if r.axis == "tp" and comm_kind(r) == "step"] == [195]
