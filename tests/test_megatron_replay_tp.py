"""Megatron-LM's full recompute re-runs the whole layer (``tensor_parallel.checkpoint``'s reentrant
``CheckpointFunction``: its backward calls the layer's forward again, to its output; NVIDIA/Megatron-LM
d98e8a6 megatron/core/tensor_parallel/random.py, megatron/core/transformer/transformer_block.py
``_checkpointed_forward``), its closing tp collective too, as compute.recompute.full_ac_not_replayed
and the rank timeline (schedule.layer_timeline.replay_scatters) have it: the collective table counts
the same replay (comm.tp_rows._tp_layer_ops)."""

from __future__ import annotations

from test_schedule_semantics import MOE, TINY, plan_of, table_counts, timeline_counts

from meshplan.schedule.steptime import step_time

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
