"""ZeRO-1/2 on a mesh with dp_replicate > 1 (nc61 #1): the replicas' gradients are reduced.

Before this fix the collective table of sharding "zero1" or "zero2" had rows over fsdp (dp_shard) only:
on dp_replicate 16 x tp 4 (dp_shard 1) no data-parallel row at all, so 16 model replicas never
exchanged gradients and `step` charged no dp time (3,860.39 ms, exposed tp only). Megatron-LM runs
this mesh as its partial distributed optimizer (--num-distributed-optimizer-instances): the reduce-
scatter within an instance, then each rank's reduced shard all-reduced across the instances
(megatron/core/distributed/param_and_grad_buffer.py, start_grad_sync: "With multiple DistOpt instances,
we need to all-reduce across instances").
"""

from __future__ import annotations

import pytest

from meshplan.comm.dp_rows import REPLICA_CADENCE
from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time

#: Llama-3-8B's parameters per rank at tp 4 (the plan's state table, "params/rank"): hand count
#: (catalog llama3-8b: 32 layers, hidden 4096, ffn 14336, 32/8 heads x 128, vocab 128256, untied):
#: per layer q 4096x4096 + k, v 4096x1024 each + o 4096x4096 + 3 x 4096x14336 = 218,103,808, split
#: over tp 4 = 54,525,952, plus 2 norms of 4096 replicated = 54,534,144; x 32 = 1,745,092,608;
#: embedding and output 128256 x 4096 / 4 each = 131,334,144 x 2 = 262,668,288; final norm 4096.
#: Total 1,745,092,608 + 262,668,288 + 4,096 = 2,007,764,992.
PARAMS_PER_RANK_TP4 = 2_007_764_992


def _plan(sharding: str, names: list[str], shape: list[int], framework: str = "torch"):
    cfg = config_from_dict({
        "model": {"catalog": "llama3-8b"},
        "cluster": {"system": "dgx-a100", "nodes": 8},
        "training": {"global_batch": 128, "seq_len": 4096, "micro_batch": 1, "sharding": sharding,
                     "recompute": "full", "framework": framework},
        "mesh": {"names": names, "shape": shape},
    })
    return build_plan(cfg)


def _replica_rows(plan):
    return [r for r in plan.stage(0).collectives if r.axis == "dp_replicate"]


def test_hand_count_of_params_per_rank():
    per_layer = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336
    assert per_layer == 218_103_808
    total = 32 * (per_layer // 4 + 2 * 4096) + 2 * 128256 * 4096 // 4 + 4096
    assert total == PARAMS_PER_RANK_TP4


@pytest.mark.parametrize("sharding", ["zero1", "zero2"])
def test_replicate_only_mesh_all_reduces_the_whole_gradient(sharding):
    # dp_replicate 16 x tp 4, dp_shard 1: the shard is the whole local gradient, fp32 (grad_reduce
    # default for bf16 parameters with an fp32 master copy: the reduce dtype fp32, 4 B):
    # 2,007,764,992 x 4 = 8,031,059,968 B, all-reduced once per step over the 16 replicas.
    rows = _replica_rows(_plan(sharding, ["dp_replicate", "tp"], [16, 4]))
    assert len(rows) == 1
    (r,) = rows
    assert (r.op, r.group_size, r.size_bytes, r.dtype, r.per_step) == ("all-reduce", 16, PARAMS_PER_RANK_TP4 * 4, "fp32", 1)
    assert r.cadence == REPLICA_CADENCE


def test_replicated_shards_all_reduce_one_eighth():
    # dp_replicate 2 x dp_shard 8 x tp 4: the reduce-scatter over dp_shard 8 leaves each rank
    # 2,007,764,992 / 8 = 250,970,624 elements; x 4 B = 1,003,882,496 B all-reduced over the 2 replicas.
    plan = _plan("zero1", ["dp_replicate", "dp_shard", "tp"], [2, 8, 4])
    (r,) = _replica_rows(plan)
    assert (r.op, r.group_size, r.size_bytes) == ("all-reduce", 2, 1_003_882_496)
    rs = [x for x in plan.stage(0).collectives if x.op == "reduce-scatter" and x.phase == "step"]
    assert [x.size_bytes for x in rs] == [PARAMS_PER_RANK_TP4 * 4]   # the reduce-scatter is unchanged


def test_no_replica_row_without_replicas():
    # dp_shard 16 x tp 4: no dp_replicate axis, no row (add drops degree 1 too).
    assert _replica_rows(_plan("zero1", ["dp_shard", "tp"], [16, 4])) == []


def test_megatron_step_charges_the_replicas_all_reduce():
    # framework megatron: the distributed optimizer's reduction runs after the backward, blocking,
    # so the step grows by the row's whole time (the table's time: 8,031,059,968 B over 16 ranks
    # on 8 dgx-a100, 2 ranks per node on 2 HDR NICs); before the fix exposed dp was 0.
    plan = _plan("zero1", ["dp_replicate", "tp"], [16, 4], framework="megatron")
    (r,) = _replica_rows(plan)
    st = step_time(plan)
    assert st.exposed_s.get("dp", 0.0) == pytest.approx(r.time_s, rel=1e-6)
