"""MoE at ep 1 with tp > 1 under framework torch (etpone): torchtitan at b5bcd76 shards every routed
expert over tp like a dense MLP (w1/w3 ``Shard(1)``, w2 ``Shard(2)``: ``expert_param_placement_dense``,
torchtitan/models/common/moe_sharding.py:50-68, 219-239), every tp rank taking all the tokens, and
FSDP2 shards the experts with the block over the dense fsdp mesh (torchtitan/distributed/fsdp.py:282-316):
meshplan's etp = tp, efsdp = dp_shard x cp (:data:`meshplan.spec.axes.moe_tp.TORCH_ETP`).

A tiny MoE (2 layers, h 64, 4 q / 2 KV heads of 16, 8 experts of width 32, top-2, vocab 256) on
dp_shard 4 x tp 2 (8 ranks), fp32, b 1 x s 16. By hand, per rank and layer:

- routed experts: 3 x 8 x 32 x 64 = 49,152 elements, / etp 2 = 24,576 (w_gate/w_up (8, 16, 64), w_down
  (8, 64, 16)); over efsdp = 4 x 2 / (ep 1 x etp 2) = 4: 6,144 elements, 24,576 B of fp32 parameters.
- the layer's FSDP2 unit: attention wq 64x64 / 2 = 2,048, wk and wv 32x64 with one of the 2 KV heads
  = 1,024 each, wo 2,048 (6,144), norms 2 x 64 = 128, router 8 x 64 = 512 (replicated), experts
  24,576: 31,360 elements, a 125,440 B all-gather (and reduce-scatter) over dp_shard 4, the experts
  in it (8 experts over 4 ranks: dim 0, no padding). At etp 1 they were a 196,608 B unit of their
  own over efsdp 8 (49,152 x 4 B) beside a 27,136 B one.
- tp under SP, activation b x s x h x 4 B = 4,096 B: attention and MoE each an all-gather and a
  reduce-scatter (the MoE's input gathered, the Partial expert output reduce-scattered), so
  forward 2 x 2 layers + 1 (the output layer's input) all-gathers = 5; at etp 1 the MoE had none: 3.
"""

from __future__ import annotations

from collections import Counter

import pytest

from meshplan import catalog
from meshplan.comm.collectives import collective_table
from meshplan.memory.state import state_bytes
from meshplan.mesh.resolve import resolve_mesh
from meshplan.mesh.tpsplit import experts_apart, local_numel
from meshplan.placement.assign import place
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec
from tests.gloo_grads import fork_ranks, grad_errors, join_gloo, split_model, write_errors

MOE = ModelSpec(name="tiny-moe", layers=2, hidden=64, ffn=128, q_heads=4, kv_heads=2, vocab=256,
                experts=8, top_k=2, expert_ffn=32)
FP32 = TrainingSpec(global_batch=4, seq_len=16, param_dtype="fp32", compute_dtype="fp32", reduce_dtype="fp32",
                    recompute="none")


def _mesh(etp: int, sp: bool = True):
    return resolve_mesh(MeshSpec(names=["dp_shard", "tp", "etp"], shape=[4, 2, etp], sequence_parallel=sp), world=8)


def _table(model, mesh, training=FP32) -> Counter:
    cluster = catalog.system("dgx-h100", nodes=1)
    rows = collective_table(model, training, mesh, cluster, place(cluster, 8), [0, 1], micro_batches=1,
                            loss_parallel=True)
    return Counter({(r.axis, r.phase, r.op, int(r.size_bytes)): r.per_microbatch for r in rows})


def test_expert_bytes_per_rank_at_etp_tp():
    mesh = _mesh(2)
    assert (mesh.degree("efsdp"), mesh.degree("fsdp"), experts_apart(mesh)) == (4, 4, False)
    assert sum(local_numel(t, MOE, 2, mesh.ep, mesh.etp) for t in MOE.layer_tensors(0) if t.expert) == 24_576
    state = state_bytes(MOE, mesh, FP32, [[[0, 1]]])[0]
    assert state.bytes_of("params", "expert") == 2 * 24_576 // 4 * 4  # 2 layers, / efsdp 4, fp32


def test_fsdp_gathers_experts_with_the_layer():
    got = _table(MOE, _mesh(2))
    for phase, op in (("forward", "all-gather"), ("backward", "all-gather"), ("backward", "reduce-scatter")):
        assert got["dp_shard", phase, op, 125_440] == 2
    assert not any(k[0] == "efsdp" for k in got)
    old = _table(MOE, _mesh(1))  # the former plan: experts whole, their own unit over efsdp 8
    assert old["efsdp", "forward", "all-gather", 196_608] == 2 and old["dp_shard", "forward", "all-gather", 27_136] == 2


def test_moe_layer_tp_collectives_at_ep1_tp2():
    got = _table(MOE, _mesh(2))
    assert (got["tp", "forward", "all-gather", 4096], got["tp", "forward", "reduce-scatter", 4096]) == (5, 5)
    assert (got["tp", "backward", "all-gather", 4096], got["tp", "backward", "reduce-scatter", 4096]) == (5, 5)
    assert got["tp", "backward", "all-reduce", 8 * 64 * 4] == 2  # each layer's router weight gradient (Partial)
    # shared experts: torchtitan reduce-scatters their Partial output apart from the routed one
    shared = _table(MOE.model_copy(update=dict(shared_experts=1, shared_expert_ffn=48)), _mesh(2))
    assert (shared["tp", "forward", "all-gather", 4096], shared["tp", "forward", "reduce-scatter", 4096]) == (5, 7)
    # no SP: one all-reduce after attention and one after the MoE per layer, + the embedding's
    plain = _table(MOE, _mesh(2, sp=False))
    assert plain["tp", "forward", "all-reduce", 4096] == 5 and not plain["tp", "forward", "all-gather", 4096]



def test_runtime_table_matches_torch_at_etp_tp():
    """The runtime model at ep 1, tp 2 (+SP), etp 2 on a fake process group (dry run of rank 3,
    capacity routing): the collectives torch issues match the collective table row for row
    (the MoE input's all-gather, the experts' reduce-scatter, the router's Partial gradient)."""
    from meshplan.runtime.validation.compare import differences, rank_extra_groups, tally_records, tally_table
    from meshplan.runtime.validation.dryrun import dry_run

    for model in (MOE, MOE.model_copy(update=dict(shared_experts=1, shared_expert_ffn=48))):
        for sp in (True, False):
            training, mesh = FP32.model_copy(update={"moe_capacity_factor": 1.0}), _mesh(2, sp)
            run = dry_run(model, training, mesh, rank=3, optimizer_step=False)
            assert run.group_differences == []
            recorded = tally_records(run.records, mesh, 3, rank_extra_groups(mesh, model, 3))
            cluster = catalog.system("dgx-h100", nodes=1)
            table = collective_table(model, training, mesh, cluster, place(cluster, 8), [0, 1], micro_batches=1,
                                     loss_parallel=True)
            assert differences(recorded, tally_table(table)) == [], (model.shared_experts, sp)


def test_runtime_expert_placements_are_the_plans():
    """After parallelize (rank 3 of dp_shard 4 x tp 2, etp 2): every routed expert weight is a DTensor
    on (dp_shard, tp) with torchtitan's tp placement (w_gate/w_up Shard(1), w_down Shard(2)) and
    FSDP2's Shard(0) over dp_shard (8 experts over 4 ranks: dim 0, :func:`expert_shard_dim`), so
    this rank holds 2 experts x 16 x 64 = 2,048 elements of each, the plan's 24,576 / 3 / efsdp 4."""
    import torch
    from torch.distributed.tensor import Shard

    from meshplan.runtime.execution.model import Transformer
    from meshplan.runtime.execution.parallelize import init_mesh, parallelize
    from meshplan.runtime.validation.dryrun import fake_process_group

    mesh = _mesh(2)
    with fake_process_group(8, 3):
        with torch.device("meta"):
            model = Transformer(MOE, vocab=256, tp=2)
        parallelize(model, init_mesh(mesh, "cpu"), mesh, FP32)
        ex = model.layers["0"].moe.experts
        got = {n: (getattr(ex, n).device_mesh.mesh_dim_names, tuple(getattr(ex, n).placements),
                   tuple(getattr(ex, n).to_local().shape)) for n in ("w_gate", "w_up", "w_down")}
    assert got == {"w_gate": (("dp_shard", "tp"), (Shard(0), Shard(1)), (2, 16, 64)),
                   "w_up": (("dp_shard", "tp"), (Shard(0), Shard(1)), (2, 16, 64)),
                   "w_down": (("dp_shard", "tp"), (Shard(0), Shard(2)), (2, 64, 16))}
    assert 2 * 16 * 64 == 24_576 // 3 // mesh.degree("efsdp")


def _etp_grad_worker(rank: int, store_path: str, out: str, sp: bool) -> None:
    """One gloo rank of tp 2 = etp 2 at ep 1 (no FSDP): one forward and backward of the runtime
    model; writes each gradient's largest difference from the single-process model's (relative)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from meshplan.compute.routing import RoutingOptions
    from meshplan.runtime.execution.model import Transformer
    from meshplan.runtime.execution.moe import set_routing

    join_gloo(rank, store_path)
    spec = ModelSpec(layers=1, hidden=32, ffn=64, q_heads=4, kv_heads=2, vocab=64, experts=4, top_k=2, expert_ffn=16,
                     shared_experts=1, shared_expert_ffn=16)
    training = TrainingSpec(global_batch=1, seq_len=16, recompute="none", moe_capacity_factor=1.0)
    mesh = resolve_mesh(MeshSpec(names=["tp", "etp"], shape=[2, 2], sequence_parallel=sp), world=2)
    tokens = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(1))
    ref = Transformer(spec)
    ref.init_weights(seed=0)
    set_routing(ref, RoutingOptions.of(training))  # every tp rank routes all 16 tokens: the same capacity
    F.cross_entropy(ref(tokens).flatten(0, 1), tokens.flatten()).backward()
    model = split_model(spec, mesh, training)
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    write_errors(out, rank, grad_errors(model, ref))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
def test_etp_tp_gradients_equal_the_single_process_model(tmp_path, sp):
    """gloo, 2 ranks: at ep 1 with the experts sharded over tp 2 every gradient (the experts'
    slices, the router's Partial one summed over tp, the shared experts') equals the unsplit model's."""
    for errors in fork_ranks(_etp_grad_worker, tmp_path, sp):
        assert any("router" in k for k in errors) and any("experts.w_up" in k for k in errors)
        assert any("shared.w_down" in k for k in errors)
        assert max(errors.values()) < 1e-5, errors
