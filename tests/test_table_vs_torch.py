"""Issue 4 check: meshplan's collective table against what torch really issues.

Real model code (DTensor TP/SP, FSDP2, HSDP; meshplan.runtime) runs one step on the fake
process group in one process; a TorchDispatchMode records every c10d collective (op, group
ranks, bytes, dtype). The table must match op by op: the same count of each (axis, phase,
op, bytes, dtype), for every mesh below (64-rank meshes with 8192-wide layers included).
"""

from math import ceil, prod

import pytest

pytest.importorskip("torch")

from meshplan import catalog  # noqa: E402
from meshplan.comm.collectives import collective_table  # noqa: E402
from meshplan.mesh.resolve import resolve_mesh  # noqa: E402
from meshplan.placement.assign import place  # noqa: E402
from meshplan.runtime.validation.compare import (differences, rank_extra_groups, tally_records,  # noqa: E402
                                                 tally_table)
from meshplan.runtime.validation.dryrun import dry_run  # noqa: E402
from meshplan.spec.mesh import MeshSpec  # noqa: E402
from meshplan.spec.model import ModelSpec  # noqa: E402
from meshplan.spec.training import TrainingSpec  # noqa: E402

pytestmark = pytest.mark.timeout(120)

TINY = ModelSpec(name="tiny", layers=2, hidden=64, ffn=128, q_heads=4, kv_heads=2, vocab=256)
WIDE = ModelSpec(name="70b-wide", layers=1, hidden=8192, ffn=28672, q_heads=64, kv_heads=8, head_dim=128,
                 vocab=1024)
FP32 = dict(param_dtype="fp32", compute_dtype="fp32", reduce_dtype="fp32", recompute="none")
MP = dict(param_dtype="fp32", compute_dtype="bf16", reduce_dtype="fp32", recompute="none")

CASES = {
    "tp2 x dp_shard4": (TINY, ("dp_shard", "tp"), (4, 2), False, FP32, {}, 3),
    "tp4+SP x dp_shard2": (TINY, ("dp_shard", "tp"), (2, 4), True, FP32, {}, 5),
    "HSDP 2x2 x tp2+SP": (TINY, ("dp_replicate", "dp_shard", "tp"), (2, 2, 2), True, FP32,
                          {"sharding": "hsdp", "micro_batch": 2}, 6),
    "dp_shard8 layernorm no-reshard": (TINY.model_copy(update=dict(gated_mlp=False, norm="layernorm", kv_heads=4)),
                                       ("dp_shard",), (8,), False, FP32,
                                       {"reshard_after_forward": False, "micro_batch": 2}, 1),
    "full recompute tp2+SP": (TINY, ("dp_shard", "tp"), (4, 2), True, dict(FP32, recompute="full"), {}, 3),
    "full recompute tp2": (TINY, ("dp_shard", "tp"), (4, 2), False, dict(FP32, recompute="full"), {}, 2),
    "uneven shards dp_shard3 x tp2": (TINY, ("dp_shard", "tp"), (3, 2), True, FP32, {"global_batch": 6}, 4),
    "tied tp2+SP": (TINY.model_copy(update=dict(tied_embeddings=True)), ("dp_shard", "tp"), (4, 2), True, FP32, {}, 3),
    # learned positions share the embedding's unit: (256 + 64) x 64 x 4 B = 81,920 B gathered, not
    # 65,536 B and a 16,384 B root of their own (as the runtime wrapped them before)
    "learned positions dp_shard4": (TINY.model_copy(update=dict(position_embedding="learned", max_position=64,
                                                                 gated_mlp=False, norm="layernorm", kv_heads=4)),
                                    ("dp_shard",), (4,), False, FP32, {}, 1),
    "64 ranks dp_shard8 x tp8+SP h8192 bf16": (WIDE, ("dp_shard", "tp"), (8, 8), True, MP,
                                               {"global_batch": 64, "seq_len": 64}, 29),
    "64 ranks HSDP 2x4 x tp8 h8192 bf16": (WIDE, ("dp_replicate", "dp_shard", "tp"), (2, 4, 8), False, MP,
                                           {"sharding": "hsdp", "global_batch": 64, "seq_len": 64}, 45),
}


def table_for(model, training, mesh, loss_parallel=True):
    cluster = catalog.system("dgx-h100", nodes=ceil(mesh.world / 8))
    return collective_table(model, training, mesh, cluster, place(cluster, mesh.world),
                            list(range(model.layers)), micro_batches=1, loss_parallel=loss_parallel)


@pytest.mark.parametrize("name", list(CASES))
def test_table_matches_torch(name):
    model, names, shape, sp, dtypes, extra, rank = CASES[name]
    training = TrainingSpec(**{"global_batch": 8, "seq_len": 16, **dtypes, **extra})
    mesh = resolve_mesh(MeshSpec(names=list(names), shape=list(shape), sequence_parallel=sp), world=prod(shape))
    run = dry_run(model, training, mesh, rank=rank, mixed_precision=dtypes is MP, optimizer_step=False)
    assert run.group_differences == []
    recorded = tally_records(run.records, mesh, rank, rank_extra_groups(mesh, model, rank))  # kv_replica: C6
    predicted = tally_table(table_for(model, training, mesh))
    assert differences(recorded, predicted) == []
    assert sum(recorded.values()) > 0


def test_loss_not_parallel_matches():
    training = TrainingSpec(global_batch=8, seq_len=16, **FP32)
    mesh = resolve_mesh(MeshSpec(names=["dp_shard", "tp"], shape=[4, 2]), world=8)
    run = dry_run(TINY, training, mesh, rank=0, loss_parallel=False, optimizer_step=False)
    assert differences(tally_records(run.records, mesh, 0),
                       tally_table(table_for(TINY, training, mesh, loss_parallel=False))) == []


# MoE with expert parallelism (meshplan.runtime.execution.moe): router, capacity dispatch, experts over
# ep with all-to-all, routed experts as their own FSDP2 unit over efsdp. Names and shapes
# (dense axes, ep) are resolved as [mesh] names = [..., "ep"] would be.
#: The dry run's fake process group returns no real token counts, so its MoE cases dispatch a
#: fixed capacity (factor 1; dropless, the torch default, runs under validate on gloo).
CAPACITY = {"moe_capacity_factor": 1.0}
MOE = ModelSpec(name="tiny-moe", layers=2, hidden=64, ffn=128, q_heads=4, kv_heads=2, vocab=256,
                experts=8, top_k=2, expert_ffn=32)
MOE_CASES = {
    # ep 4 inside dp_shard 16: efsdp 4 (experts sharded over ranks 0, 4, 8, 12 for rank 0)
    "16 ranks dp_shard16 ep4 shared expert, 1 dense layer": (
        MOE.model_copy(update=dict(shared_experts=1, shared_expert_ffn=48, dense_layers=1)),
        ("dp_shard",), (16,), 4, FP32, {}, 6),
    # 64 ranks, ep 8: 10 tokens x top_k 3 over 8 experts -> capacity ceil(30/8) = 4, so the
    # dispatch buffer is 8 x 4 = 32 rows, not 30; full recompute replays dispatch and combine
    "64 ranks dp_shard64 ep8 top_k3 uneven capacity full recompute": (
        MOE.model_copy(update=dict(top_k=3)), ("dp_shard",), (64,), 8, dict(FP32, recompute="full"),
        {"seq_len": 10, "global_batch": 64}, 45),
    # ep 8 = dp_shard 8: efsdp 1, experts outside FSDP; the ep group is the dp_shard group
    "8 ranks ep8 = dp_shard8 (efsdp 1)": (MOE, ("dp_shard",), (8,), 8, FP32, {}, 3),
    "32 ranks HSDP 2x16 ep4 bf16 gathers": (MOE, ("dp_replicate", "dp_shard"), (2, 16), 4, MP,
                                            {"sharding": "hsdp", "global_batch": 32}, 21),
    # ep 1: the experts in their layer's unit (torchtitan's ep-1 branch), one all-gather of the
    # whole layer over dp_shard 4 (4 <= 8 experts: dim 0) and no expert row
    "4 ranks dp_shard4 ep1 (experts in the layer's unit)": (MOE, ("dp_shard",), (4,), 1, FP32, {}, 1),
    # efsdp 2 x ep 2 <= 6 experts: dim 0, each rank's 3 experts padded to 4 rows
    "4 ranks dp_shard4 ep2 6 experts (experts on dim 0, padded)": (
        MOE.model_copy(update=dict(experts=6)), ("dp_shard",), (4,), 2, FP32, {}, 1),
}


@pytest.mark.parametrize("name", list(MOE_CASES))
def test_moe_table_matches_torch(name):
    model, names, shape, ep, dtypes, extra, rank = MOE_CASES[name]
    training = TrainingSpec(**{"global_batch": prod(shape), "seq_len": 16, **CAPACITY, **dtypes, **extra})
    mesh = resolve_mesh(MeshSpec(names=list(names) + ["ep"], shape=list(shape) + [ep]), world=prod(shape))
    run = dry_run(model, training, mesh, rank=rank, mixed_precision=dtypes is MP, optimizer_step=False)
    assert run.group_differences == []
    recorded = tally_records(run.records, mesh, rank, rank_extra_groups(mesh, model, rank))  # kv_replica: C6
    predicted = tally_table(table_for(model, training, mesh), mesh, rank)
    assert differences(recorded, predicted) == []
    a2a = [r for r in run.records if r.op == "all-to-all"]
    moe_layers = model.layers - model.dense_layers
    # forward + backward; none under ep 1
    assert len(a2a) == (2 + (4 if training.recompute == "full" else 2)) * moe_layers * (ep > 1)
    if ep == 1:
        return
    assert {r.group for r in a2a} == {tuple(mesh.group_of(rank, "ep"))}
    tokens = training.micro_batch * training.seq_len
    rows = model.experts * -(-tokens * model.top_k // model.experts)
    assert {r.size_bytes for r in a2a} == {rows * model.hidden * (2 if dtypes is MP else 4)}


#: Bytes of one MoE layer's routed-expert all-gather over efsdp, derived by hand (fp32):
#: 8 experts over ep 4 (2 per rank) and efsdp 4: 4 x 4 > 8, so dim 1 (torchtitan), even:
#: (w_gate, w_up 2 x 32 x 64, w_down 2 x 64 x 32) = 12,288 elements x 4 B = 49,152 B (dim 0
#: would pad 2 experts to 4 rows: 98,304 B); 6 experts over ep 2 and efsdp 2: 2 x 2 <= 6, so
#: dim 0, 3 experts padded to 4 rows: 4 x 32 x 64 x 3 weights x 4 B = 98,304 B (dim 1 would
#: be 73,728 B).
EXPERT_GATHER_BYTES = {"16 ranks dp_shard16 ep4 shared expert, 1 dense layer": 49_152,
                       "4 ranks dp_shard4 ep2 6 experts (experts on dim 0, padded)": 98_304}


@pytest.mark.parametrize("name", list(EXPERT_GATHER_BYTES))
def test_expert_gather_bytes_by_hand(name):
    """torch's FSDP2 all-gather of the routed experts and the table's row both have the
    by-hand size of the dim torchtitan's rule shards (efsdp x ep > experts: dim 1)."""
    model, names, shape, ep, dtypes, extra, rank = MOE_CASES[name]
    training = TrainingSpec(**{"global_batch": prod(shape), "seq_len": 16, **CAPACITY, **dtypes, **extra})
    mesh = resolve_mesh(MeshSpec(names=list(names) + ["ep"], shape=list(shape) + [ep]), world=prod(shape))
    run = dry_run(model, training, mesh, rank=rank, optimizer_step=False)
    efsdp = tuple(mesh.group_of(rank, "efsdp"))
    assert {r.size_bytes for r in run.records if r.op == "all-gather" and r.group == efsdp} == {EXPERT_GATHER_BYTES[name]}
    rows = [r for r in table_for(model, training, mesh) if r.axis == "efsdp" and r.op == "all-gather"]
    assert {r.size_bytes for r in rows} == {EXPERT_GATHER_BYTES[name]}


def test_uneven_expert_dim1_is_refused_by_torch_and_by_the_plan():
    """efsdp 4 x ep 4 > 8 experts puts the experts on dim 1, and an expert width of 30 does
    not split 4 ways: torch 2.13's FSDP2 raises NotImplementedError (uneven sharding on a
    nonzero dim), so meshplan's ep rule ``expert_dim1`` rejects the mesh."""
    from meshplan.mesh.validity import check

    model = MOE.model_copy(update=dict(expert_ffn=30))
    training = TrainingSpec(global_batch=16, seq_len=16, **CAPACITY, **FP32)
    spec = MeshSpec(names=["dp_shard", "ep"], shape=[16, 4])
    mesh = resolve_mesh(spec, world=16)
    with pytest.raises(NotImplementedError, match="uneven sharding on dim 1"):
        dry_run(model, training, mesh, rank=5, optimizer_step=False)
    reasons = check(model, training, mesh, spec).reasons
    assert [r for r in reasons if "dim 1" in r] == [
        "routed experts sharded on dim 1 (efsdp 4 x ep 4 > experts 8, torchtitan's shard_placement_fn): expert_ffn 30 "
        "/ etp 1 and hidden 64 must both divide by efsdp 4; FSDP2 refuses uneven sharding on dim 1 (torch "
        "NotImplementedError)"]
    assert check(model, training.model_copy(update={"sharding": "zero1"}), mesh, spec).reasons == ()


# Context parallelism (meshplan.runtime.execution.cp, Llama 3's all-gather CP): each rank holds seq/cp
# tokens as 2 load-balanced chunks, gathers K and V (one stacked buffer) over cp in every
# layer, and its backward reduce-scatters dK and dV; FSDP2 shards over fsdp = dp_shard x cp.
CP_CASES = {
    "16 ranks dp_shard4 x cp2 x tp2+SP": (TINY, ("dp_shard", "cp", "tp"), (4, 2, 2), True, FP32, {}, 11),
    # tp 4 > kv_heads 2: one KV head copy per tp rank is gathered; full recompute replays the gather
    "32 ranks dp_shard2 x cp4 x tp4+SP KV copies full recompute": (
        TINY, ("dp_shard", "cp", "tp"), (2, 4, 4), True, dict(FP32, recompute="full"), {}, 21),
    "64 ranks HSDP 2x4 x cp4 x tp2 h8192 bf16": (WIDE, ("dp_replicate", "dp_shard", "cp", "tp"), (2, 4, 4, 2), False,
                                                MP, {"sharding": "hsdp", "global_batch": 64, "seq_len": 64}, 45),
}


@pytest.mark.parametrize("name", list(CP_CASES))
def test_cp_table_matches_torch(name):
    model, names, shape, sp, dtypes, extra, rank = CP_CASES[name]
    training = TrainingSpec(**{"global_batch": 8, "seq_len": 16, "cp_attention": "allgather", **dtypes, **extra})
    mesh = resolve_mesh(MeshSpec(names=list(names), shape=list(shape), sequence_parallel=sp), world=prod(shape))
    run = dry_run(model, training, mesh, rank=rank, mixed_precision=dtypes is MP, optimizer_step=False)
    assert run.group_differences == []
    assert differences(tally_records(run.records, mesh, rank, rank_extra_groups(mesh, model, rank)),
                       tally_table(table_for(model, training, mesh))) == []
    cp_group = tuple(mesh.group_of(rank, "cp"))
    cp = [(r.phase, r.op) for r in run.records if r.group == cp_group]
    full = training.recompute == "full"
    assert sorted(cp) == sorted(([("forward", "all-gather"), ("backward", "reduce-scatter")]
                                 + [("backward", "all-gather")] * full) * model.layers)
    tp, cpn = mesh.degree("tp"), mesh.degree("cp")
    kv_local = max(1, model.n_kv_heads // tp)
    size = 2 * training.micro_batch * training.seq_len * kv_local * model.d_head * (2 if dtypes is MP else 4)
    assert {r.size_bytes for r in run.records if r.group == cp_group} == {size}
    # FSDP2 shards over dp_shard x cp: the layer unit's all-gather is over the fsdp group
    fsdp = tuple(mesh.group_of(rank, "fsdp"))
    assert len(fsdp) == mesh.degree("dp_shard") * cpn and any(r.group == fsdp for r in run.records)


# Tensor parallelism with MoE layers (meshplan.runtime.execution.moe_parallel.apply_moe_tp, etp 1): attention and
# shared experts by DTensor TP/SP, the router replicated over tp (its gradient all-reduced over
# tp), each tp rank routing its tp-th of the tokens: under SP its own sequence shard (no tp
# collective around the routed experts), without SP a slice of the replicated tokens, the
# routed outputs all-gathered over tp (and the input gradient in backward).
MOE_TP_CASES = {
    # ep 4 inside dp_shard 4 x tp 4: efsdp 4; 4 tokens per rank; shared experts under SP
    "16 ranks dp_shard4 x tp4+SP ep4 shared expert": (
        MOE.model_copy(update=dict(shared_experts=1, shared_expert_ffn=48)), ("dp_shard", "tp"), (4, 4), 4, True,
        FP32, {}, 6),
    # no SP: the routed outputs' all-gather; full recompute replays attention's all-reduce and
    # the all-gather (not the shared experts' all-reduce, the layer's last); uneven capacity
    "32 ranks dp_shard16 x tp2 ep8 shared expert top_k3 full recompute, 1 dense layer": (
        MOE.model_copy(update=dict(shared_experts=1, shared_expert_ffn=48, dense_layers=1, top_k=3)),
        ("dp_shard", "tp"), (16, 2), 8, False, dict(FP32, recompute="full"), {"seq_len": 10}, 21),
    # ep 1: experts whole on every rank, FSDP2 over efsdp = dp_shard x tp = 16 ranks (gradient x tp)
    "16 ranks dp_shard8 x tp2+SP no ep, full recompute": (MOE, ("dp_shard", "tp"), (8, 2), 1, True,
                                                           dict(FP32, recompute="full"), {}, 9),
    "64 ranks HSDP 2x8 x tp4 ep8 bf16": (MOE, ("dp_replicate", "dp_shard", "tp"), (2, 8, 4), 8, False, MP,
                                         {"sharding": "hsdp", "global_batch": 16}, 45),
}


@pytest.mark.parametrize("name", list(MOE_TP_CASES))
def test_moe_tp_table_matches_torch(name):
    model, names, shape, ep, sp, dtypes, extra, rank = MOE_TP_CASES[name]
    training = TrainingSpec(**{"global_batch": prod(shape), "seq_len": 16, **CAPACITY, **dtypes, **extra})
    mesh = resolve_mesh(MeshSpec(names=list(names) + ["ep"], shape=list(shape) + [ep], sequence_parallel=sp),
                        world=prod(shape))
    run = dry_run(model, training, mesh, rank=rank, mixed_precision=dtypes is MP, optimizer_step=False)
    assert run.group_differences == []
    extra = rank_extra_groups(mesh, model, rank)  # kv_replica (tp > kv_heads: handed case C6)
    recorded = tally_records(run.records, mesh, rank, extra)
    assert differences(recorded, tally_table(table_for(model, training, mesh), mesh, rank, extra=extra)) == []
    tp, nbytes = mesh.degree("tp"), 2 if dtypes is MP else 4
    tokens = training.micro_batch * training.seq_len // tp  # routed by each rank
    a2a = {r.size_bytes for r in run.records if r.op == "all-to-all"}
    assert a2a == ({model.experts * -(-tokens * model.top_k // model.experts) * model.hidden * nbytes} if ep > 1
                   else set())
    router = [r for r in run.records if r.op == "all-reduce" and r.group == tuple(mesh.group_of(rank, "tp"))
              and r.size_bytes == model.experts * model.hidden * nbytes]
    assert len(router) == model.layers - model.dense_layers  # one router weight gradient per MoE layer


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
def test_moe_tp_without_fsdp_matches_torch(sp):
    """tp 4 with ep 2 and no data axis: fsdp 1, so the routed experts alone are FSDP2-sharded
    over efsdp = tp / ep = 2, and the router's (and SP norms') Partial gradients are reduced
    at each of AdamW's reads."""
    model = MOE.model_copy(update=dict(kv_heads=4))
    training = TrainingSpec(global_batch=1, seq_len=16, **CAPACITY, **FP32)
    mesh = resolve_mesh(MeshSpec(names=["tp", "ep"], shape=[4, 2], sequence_parallel=sp), world=4)
    run = dry_run(model, training, mesh, rank=1)
    assert run.group_differences == []
    assert differences(tally_records(run.records, mesh, 1), tally_table(table_for(model, training, mesh), mesh, 1)) == []
    assert any(r.phase == "step" and r.size_bytes == model.experts * model.hidden * 4 for r in run.records)
