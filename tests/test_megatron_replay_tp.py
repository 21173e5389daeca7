"""Megatron-LM's full recompute re-runs the whole layer (``tensor_parallel.checkpoint``'s reentrant
``CheckpointFunction``: its backward calls the layer's forward again, to its output; NVIDIA/Megatron-LM
d98e8a6 megatron/core/tensor_parallel/random.py, megatron/core/transformer/transformer_block.py
``_checkpointed_forward``), its closing tp collective too, as compute.recompute.full_ac_not_replayed
and the rank timeline (schedule.layer_timeline.replay_scatters) have it: the collective table counts
the same replay (comm.tp_rows._tp_layer_ops). Its selective ``--recompute-modules`` mlp, moe and
shared_experts use the same checkpoint on one module: the module's collectives replay too
(spec.recompute_modules.replayed_tp_ops; the timeline's layer_timeline.module_replay)."""

from __future__ import annotations

from collections import Counter

import pytest
from test_schedule_semantics import MOE, TINY, plan_of, table_counts, timeline_counts

from meshplan.compute.layer import layer_cost
from meshplan.schedule.steptime import step_time
from meshplan.schedule.workload import workload_of

MESH = {"names": ["dp_shard", "tp"], "shape": [2, 2], "world": 4, "sequence_parallel": True}


def _calls(counts, op: str) -> int:
    return sum(n for k, n in counts.items() if k[3] == op)


def test_megatron_full_recompute_table_counts_the_replayed_closing_reduce_scatter():
    """TINY (4 dense layers), dp_shard 2 x tp 2 with SP, Megatron-LM, full recompute, global batch 8:
    m = 8 / (1 x 2) = 4 micro-batches. Reduce-scatters per micro-batch: forward 2 a layer x 4 = 8
    (Megatron's embedding all-reduces instead); backward the mirrors of the forward all-gathers,
    2 a layer x 4 + the output layer's 1 = 9; the replay re-runs each layer whole, 2 a layer x 4 =
    8. (8 + 9 + 8) x 4 = 100 a step, where the table counted 84 (the replay's MLP reduce-scatter
    left out: 1 a layer, (8 + 9 + 4) x 4) and the timeline 100."""
    plan = plan_of(MESH, recompute="full", framework="megatron", sharding="zero1", global_batch=8)
    table, timeline = table_counts(plan, 0, ("tp",)), timeline_counts(step_time(plan), 0, ("tp",))
    assert _calls(table, "reduce-scatter") == (8 + 9 + 8) * 4 == _calls(timeline, "reduce-scatter")
    assert _calls(table, "all-gather") == _calls(timeline, "all-gather")


def test_megatron_full_recompute_moe_with_a_shared_expert_replays_its_last_reduce_scatter():
    """MOE (layer 0 dense, layers 1-3 routed with one shared expert), the same mesh and job:
    Megatron-LM's routed experts issue nothing over tp, so a layer's reduce-scatters are the
    attention's and the MLP's (dense) or the shared expert's (MoE), 2 a layer, as in the dense test:
    (8 + 9 + 8) x 4 = 100 (the table counted 84)."""
    plan = plan_of(MESH, model=dict(MOE, shared_experts=1), recompute="full", framework="megatron",
                   sharding="zero1", global_batch=8)
    table, timeline = table_counts(plan, 0, ("tp",)), timeline_counts(step_time(plan), 0, ("tp",))
    assert _calls(table, "reduce-scatter") == (8 + 9 + 8) * 4 == _calls(timeline, "reduce-scatter")


# Megatron-LM's selective --recompute-modules mlp, moe, shared_experts: tensor_parallel.checkpoint
# (CheckpointFunction, d98e8a6 random.py 591-672) keeps only the module's input, the sequence shard
# [s/tp, b, h] under SP, and its backward re-runs the module whole: the fc1 all-gather (TE
# layernorm_linear.py 283-312) and the fc2 reduce-scatter (TE linear.py 568-577) again, and under
# moe the dispatcher's calls (moe_layer.py 658-717). meshplan.spec.recompute_modules.replayed_tp_ops.

SHARED_MOE = dict(MOE, shared_experts=1)  # layer 0 dense, layers 1-3 routed (4 experts, top-2) + 1 shared


def _per_op(counts) -> Counter:
    """(kind, op) -> calls a step: the timeline files a replay under its forward phase, the table
    under backward (as for full recompute), and names the count exchange's group, the table not;
    get_batch's broadcasts left out (their own groups on the timeline)."""
    out: Counter = Counter()
    for k, n in counts.items():
        if k[3] != "broadcast":
            out[(k[0], k[3])] += n
    return out


def _selective(modules, model=TINY, mesh=MESH, **kw):
    return plan_of(mesh, model=model, recompute="selective", recompute_modules=modules, framework="megatron",
                   sharding="zero1", global_batch=8, **kw)


def _row(plan, axis: str, phase: str, op: str):
    (r,) = [r for r in plan.stage(0).collectives if r.axis == axis and r.phase == phase and r.op == op
            and r.dtype == "bf16" and "every" in r.cadence and "embedding" not in r.cadence]
    return r


def test_selective_mlp_replays_the_mlps_all_gather_and_reduce_scatter():
    """TINY (4 dense layers, h 64), dp_shard 2 x tp 2 + SP, Megatron-LM, b 1, s 64, global batch 8:
    m = 4 micro-batches. Per layer and micro-batch, ``--recompute-modules core_attn mlp`` adds one
    all-gather of the MLP's input (b x s x h x 2 B = 1 x 64 x 64 x 2 = 8,192 B, nccl-tests' size:
    the gathered output) and one reduce-scatter of its output (8,192 B) to the backward: 4 layers x
    4 = 16 each a step. With core_attn alone the backward counts per micro-batch 18 all-gathers
    (the mirrors of the layers' 8 forward reduce-scatters, the embedding's 1 and the output layer's
    re-gather 1, Megatron's wgrad re-gathers 2 a layer, 8) and 9 reduce-scatters (the mirrors of
    the 9 forward all-gathers, the output layer's included): 72 and 36 a step; with mlp 88 and 52.
    The timeline issues as many (filed under forward)."""
    base, mlp = _selective(["core_attn"]), _selective(["core_attn", "mlp"])
    for op, before in (("all-gather", 72), ("reduce-scatter", 36)):
        assert _row(base, "tp", "backward", op).per_step == before
        r = _row(mlp, "tp", "backward", op)
        assert r.per_step == before + 4 * 4 and r.size_bytes == 1 * 64 * 64 * 2
    for plan in (base, mlp):
        assert _per_op(table_counts(plan, 0, ("tp",))) == _per_op(timeline_counts(step_time(plan), 0, ("tp",)))


def test_selective_mlp_lengthens_the_step_by_the_replayed_collectives():
    """The same two plans, one stage: Megatron-LM without --tp-comm-overlap waits for every SP
    collective on the compute's path, so ``mlp`` adds per layer and micro-batch (4 x 4 = 16 a step)
    its replayed ops (layer_cost's recompute ops beyond the core: the MLP norm 6.90 us, w_up, w_down
    and GeLU 4.70 us each at b 1, s 64, h 64 = 21.00 us) and the replayed all-gather and
    reduce-scatter, each the 8,192 B row's time (10.75 us, latency-bound on NVLink 4):
    16 x 21.00 + 32 x 10.75 = 336.0 + 344.1 = 680.2 us (5.799 -> 6.479 ms; before this change
    the step grew by the 336.0 us of compute alone, 6.135 ms)."""
    core, mlp = _selective(["core_attn"]), _selective(["core_attn", "mlp"])
    w, m = workload_of(mlp), mlp.config
    cost = layer_cost(m.model, m.cluster.gpu, w, layer=0)
    replayed = sum(o.seconds for o in cost.ops if o.recompute and o.block != "attn")
    assert replayed == pytest.approx(6.90e-6 + 3 * 4.70e-6, rel=1e-3)
    t = _row(mlp, "tp", "forward", "all-gather").time_s
    assert t == _row(mlp, "tp", "forward", "reduce-scatter").time_s == pytest.approx(10.75e-6, rel=1e-3)
    grew = step_time(mlp).step_s - step_time(core).step_s
    assert grew == pytest.approx(16 * replayed + 32 * t, rel=1e-9)
    assert grew == pytest.approx(680.2e-6, rel=1e-3)


EP_MESH = {"names": ["dp", "tp", "ep", "etp"], "shape": [2, 2, 2, 1], "world": 4, "sequence_parallel": True}


@pytest.mark.parametrize("modules,tp_more,ep_more", [
    (["core_attn"], 0, 0), (["core_attn", "moe"], 1, 1), (["core_attn", "shared_experts"], 1, 0),
    (["moe", "shared_experts"], 2, 1), (["core_attn", "mlp"], 0, 0)])
def test_selective_moe_and_shared_experts_replay_their_calls(modules, tp_more, ep_more):
    """SHARED_MOE (layer 0 dense, 3 MoE layers with one shared expert), dp 2 x tp 2 + SP with
    ep 2 (etp 1), Megatron-LM, m 4. Per MoE layer and micro-batch the backward gains: ``moe``
    (the whole layer re-run) the shared expert's all-gather and reduce-scatter, the dispatcher's
    count all-gather (dropless, 4 experts x 8 B x ep 2 = 64 B) and its dispatch and combine
    all-to-alls (the rank's b x s / tp = 32 tokens x top-2 = 64 rows x h 64 x 2 B = 8,192 B);
    ``shared_experts`` the shared expert's pair again, inside ``moe``'s replay and in its own
    (2 pairs with both); ``mlp`` only the dense layer 0's pair (checked in the dense test above).
    So 3 x 4 = 12 per unit a step."""
    base, plan = _selective(["core_attn"], SHARED_MOE, EP_MESH), _selective(modules, SHARED_MOE, EP_MESH)
    for op in ("all-gather", "reduce-scatter"):
        dense = 4 * ("mlp" in modules)
        assert _row(plan, "tp", "backward", op).per_step == _row(base, "tp", "backward", op).per_step + \
            12 * tp_more + dense
    a2a = _row(plan, "ep", "backward", "all-to-all")
    assert a2a.size_bytes == 32 * 2 * 64 * 2
    assert a2a.per_step == _row(base, "ep", "backward", "all-to-all").per_step + 2 * 12 * ep_more == 24 + 24 * ep_more
    counts = [r for r in plan.stage(0).collectives if r.axis == "ep" and r.phase == "backward" and r.dtype == "int64"]
    assert [(r.size_bytes, r.per_step) for r in counts] == ([(4 * 8 * 2, 12)] if ep_more else [])
    assert _per_op(table_counts(plan, 0, ("tp", "ep"))) == _per_op(timeline_counts(step_time(plan), 0, ("tp", "ep")))


@pytest.mark.parametrize("schedule,vpp", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_selective_module_replays_as_the_table_counts_on_every_megatron_schedule(schedule, vpp):
    """Megatron-LM's two schedules (1F1B, interleaved; the only ones it runs), pp 2 x dp 2 x tp 2 +
    SP x ep 2 x etp 2, 8 layers of SHARED_MOE, ``--recompute-modules core_attn mlp moe
    shared_experts``: on each stage the timeline issues every tp, ep and etp call the table counts
    (the replays filed under forward there)."""
    mesh = {"names": ["pp", "dp", "tp", "ep", "etp"], "shape": [2, 2, 2, 2, 2], "world": 8,
            "sequence_parallel": True, "pp_schedule": schedule, "virtual_stages": vpp}
    plan = plan_of(mesh, model=dict(SHARED_MOE, layers=8), recompute="selective", framework="megatron",
                   recompute_modules=["core_attn", "mlp", "moe", "shared_experts"], sharding="none", global_batch=8)
    st = step_time(plan)
    for s in range(2):
        table = _per_op(table_counts(plan, s, ("tp", "ep")))
        assert table == _per_op(timeline_counts(st, s, ("tp", "ep"))), s
        assert table[("ep", "all-to-all")] > 0


# Megatron-LM's mla_up_proj (CheckpointWithoutOutput around qkv_up_proj_and_rope_apply, d98e8a6
# multi_latent_attention.py 855-988): its arguments are the latents after the duplicated
# down-projections, the sequence shard under SP; the replayed linear_q_up_proj and linear_kv_up_proj
# (column-parallel) all-gather them again (TE d0067d0 linear.py 346-349, 407-412).
# meshplan.spec.recompute_modules.mla_up_gathers.
MLA = dict(TINY, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def test_selective_mla_up_proj_replays_the_latents_all_gathers():
    """MLA (TINY's 4 layers with a query latent of 32 and a key/value latent of 16), dp_shard 2 x
    tp 2 + SP, Megatron-LM, b 1, s 64, m = 4. ``--recompute-modules core_attn mla_up_proj`` adds per
    layer and micro-batch one all-gather of each latent in backward: 1 x 64 x 32 x 2 = 4,096 B and
    1 x 64 x 16 x 2 = 2,048 B (nccl-tests' size: the gathered output), 4 layers x 4 = 16 a step each;
    none with core_attn alone, none without SP (the up-projections' inputs whole). The timeline issues
    as many. The step grows by the replayed up-projection ops (layer_cost's, as before this change:
    wq_b, wkv_b, RoPE 4.70 us each and the two latent norms 6.90 us each = 27.90 us) plus both
    all-gathers (10.45 and 10.30 us, latency-bound on NVLink 4), the compute waiting for them:
    16 x (27.90 + 20.76) = 778.6 us (7.245 -> 8.024 ms; before this change 7.692 ms, the compute alone)."""
    core, up = _selective(["core_attn"], MLA), _selective(["core_attn", "mla_up_proj"], MLA)
    rows = [(r.size_bytes, r.per_step) for r in up.stage(0).collectives if "mla_up_proj" in r.cadence]
    assert rows == [(1 * 64 * 32 * 2, 16), (1 * 64 * 16 * 2, 16)]
    assert not [r for r in core.stage(0).collectives if "mla_up_proj" in r.cadence]
    no_sp = _selective(["core_attn", "mla_up_proj"], MLA, dict(MESH, sequence_parallel=False))
    assert not [r for r in no_sp.stage(0).collectives if "mla_up_proj" in r.cadence]
    assert _per_op(table_counts(up, 0, ("tp",))) == _per_op(timeline_counts(step_time(up), 0, ("tp",)))
    t_q, t_kv = [r.time_s for r in up.stage(0).collectives if "mla_up_proj" in r.cadence]
    cost = layer_cost(up.config.model, up.config.cluster.gpu, workload_of(up), layer=0)
    base = layer_cost(core.config.model, core.config.cluster.gpu, workload_of(core), layer=0)
    replayed = sum(o.seconds for o in cost.ops if o.recompute) - sum(o.seconds for o in base.ops if o.recompute)
    assert replayed > 0
    grew = step_time(up).step_s - step_time(core).step_s
    assert grew == pytest.approx(16 * (replayed + t_q + t_kv), rel=1e-9)
    assert grew == pytest.approx(778.6e-6, rel=1e-3)
