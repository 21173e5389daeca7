"""Dry runs of real torch model code (DTensor TP/SP, FSDP2, HSDP) on the fake process group:
DeviceMesh groups against meshplan's rank lists, and every collective one rank issues in one
step (op, group ranks, bytes, dtype, count) against a derivation by hand.

Conventions of the hand derivations (torch 2.13, see meshplan/runtime/execution/parallelize.py):
- sizes are nccl-tests buffers: all-gather output, reduce-scatter input, all-reduce buffer;
- TP activation buffer = b * s * h * bytes (with SP too: the gathered buffer);
- FSDP units as torchtitan's apply_fsdp wraps them (parallelize.apply_fsdp): the embedding,
  each layer, [final_norm, output], then the root (no parameters left: no collectives). The
  embedding reshards after forward as the layers do (gathered again in backward when
  reshard_after_forward); [final_norm, output] keeps its parameters after forward, so it is
  not gathered again in backward; a unit's buffer is its tp-local parameter count; tied
  embeddings: one unit of the three, kept gathered;
- loss parallel: cross-entropy on vocabulary-sharded logits issues 3 all-reduces of b*s
  fp32 values on tp (max, sum of exp, target logit).
"""

import contextlib
from collections import Counter

import pytest

pytest.importorskip("torch")

from meshplan.errors import ConfigError  # noqa: E402
from meshplan.mesh.resolve import resolve_mesh  # noqa: E402
from meshplan.runtime.validation.compare import tally_records  # noqa: E402
from meshplan.runtime.validation.dryrun import dry_run, fake_process_group  # noqa: E402
from meshplan.runtime.execution.model import Transformer, scale_model  # noqa: E402
from meshplan.runtime.execution.parallelize import check_groups, init_mesh, parallelize  # noqa: E402
from meshplan.spec.mesh import MeshSpec  # noqa: E402
from meshplan.spec.model import ModelSpec  # noqa: E402
from meshplan.spec.training import TrainingSpec  # noqa: E402

pytestmark = pytest.mark.timeout(60)

# h 64, ffn 128 (SwiGLU), 4 q heads, 2 KV heads, head_dim 16, vocab 256, 2 layers
TINY = ModelSpec(name="tiny", layers=2, hidden=64, ffn=128, q_heads=4, kv_heads=2, vocab=256)
FP32 = dict(param_dtype="fp32", compute_dtype="fp32", reduce_dtype="fp32", recompute="none")


def mesh_of(names, shape, sp=False):
    from math import prod
    return resolve_mesh(MeshSpec(names=list(names), shape=list(shape), sequence_parallel=sp), world=prod(shape))


def tally(run, phase=None):
    """(phase, op, group, size_bytes, dtype) -> count."""
    return Counter((r.phase, r.op, r.group, r.size_bytes, r.dtype) for r in run.records
                   if phase is None or r.phase == phase)


def test_tp2_dp_shard4_no_sp():
    # rank 3 of (dp_shard 4, tp 2): tp group [2, 3], dp_shard group [1, 3, 5, 7]
    tr = TrainingSpec(global_batch=8, seq_len=16, micro_batch=1, **FP32)
    run = dry_run(TINY, tr, mesh_of(("dp_shard", "tp"), (4, 2)), rank=3)
    assert run.group_differences == [] and run.notes == []
    tp, dp = (2, 3), (1, 3, 5, 7)
    act = 1 * 16 * 64 * 4  # b*s*h fp32 = 4096
    # per layer on one tp rank: norms 2*64 + wq 64*64/2 + wk, wv 64*32/2 each + wo 64*64/2
    # + w_gate, w_up, w_down 64*128/2 each = 128 + 2048 + 2*1024 + 2048 + 3*4096 = 18560
    layer = 18560 * 4
    emb = 256 * 64 // 2 * 4  # embedding split over vocab: 8192 elements
    head = (256 * 64 // 2 + 64) * 4  # output split over vocab + final_norm: 8256 elements
    assert tally(run) == Counter({
        # embedding all-reduce + 2 per layer (after wo, after w_down)
        ("forward", "all-reduce", tp, act, "fp32"): 1 + 2 * 2,
        ("forward", "all-gather", dp, emb, "fp32"): 1,
        ("forward", "all-gather", dp, head, "fp32"): 1,
        ("forward", "all-gather", dp, layer, "fp32"): 2,
        ("loss", "all-reduce", tp, 1 * 16 * 4, "fp32"): 3,
        # 2 per layer (input grads of wq/wk/wv and w_gate/w_up) + the output layer's input grad
        ("backward", "all-reduce", tp, act, "fp32"): 2 * 2 + 1,
        ("backward", "all-gather", dp, layer, "fp32"): 2,  # layers resharded after forward
        ("backward", "all-gather", dp, emb, "fp32"): 1,  # the embedding too; [norm, output] kept
        ("backward", "reduce-scatter", dp, layer, "fp32"): 2,
        ("backward", "reduce-scatter", dp, emb, "fp32"): 1,
        ("backward", "reduce-scatter", dp, head, "fp32"): 1,
    })
    by_axis = tally_records(run.records, mesh_of(("dp_shard", "tp"), (4, 2)), 3)
    assert by_axis[("tp", "forward", "all-reduce", act, "fp32")] == 5
    assert by_axis[("dp_shard", "backward", "reduce-scatter", layer, "fp32")] == 2


def test_tp4_sp_dp_shard2():
    # rank 5 of (dp_shard 2, tp 4): tp [4..7], dp_shard [1, 5]; vocab padded 256 -> 512
    # (Megatron's divisor 128 * tp 4, set explicitly: framework torch does not pad by default);
    # KV heads copied 2 -> 4 (one per tp rank)
    tr = TrainingSpec(global_batch=8, seq_len=16, micro_batch=1, vocab_pad_divisor=128, **FP32)
    run = dry_run(TINY, tr, mesh_of(("dp_shard", "tp"), (2, 4), sp=True), rank=5)
    assert run.group_differences == []
    assert run.notes == ["vocab 256 -> 512 rows", "KV heads copied 2 -> 4 for tp 4"]
    tp, dp = (4, 5, 6, 7), (1, 5)
    act = 16 * 64 * 4
    # per layer per tp rank: norms 128 + wq 1024 + wk, wv (4 heads * 16) * 64 / 4 = 1024 each
    # + wo 1024 + 3 * 64 * 128 / 4 = 6144 -> 10368
    layer = 10368 * 4
    emb, head = 512 * 64 // 4 * 4, (512 * 64 // 4 + 64) * 4  # 8192 and 8256 elements
    assert tally(run) == Counter({
        ("forward", "reduce-scatter", tp, act, "fp32"): 1 + 2 * 2,  # embedding out + wo, w_down
        ("forward", "all-gather", tp, act, "fp32"): 2 * 2 + 1,  # attention, mlp in + output layer in
        ("forward", "all-gather", dp, emb, "fp32"): 1,
        ("forward", "all-gather", dp, head, "fp32"): 1,
        ("forward", "all-gather", dp, layer, "fp32"): 2,
        ("loss", "all-reduce", tp, 16 * 4, "fp32"): 3,
        ("backward", "all-gather", tp, act, "fp32"): 2 * 2 + 1,  # + the embedding's output grad
        ("backward", "reduce-scatter", tp, act, "fp32"): 2 * 2 + 1,  # + the output layer's input grad
        # SequenceParallel norms: replicated weights, sharded inputs -> weight grad all-reduce
        ("backward", "all-reduce", tp, 64 * 4, "fp32"): 2 * 2 + 1,
        ("backward", "all-gather", dp, layer, "fp32"): 2,
        ("backward", "all-gather", dp, emb, "fp32"): 1,
        ("backward", "reduce-scatter", dp, layer, "fp32"): 2,
        ("backward", "reduce-scatter", dp, emb, "fp32"): 1,
        ("backward", "reduce-scatter", dp, head, "fp32"): 1,
        # KV heads copied 2 -> 4: per layer the wk and wv gradients (1024 elements each on a tp
        # rank), this rank's dp_shard half, summed over tp ranks 4, 5 (the copies of KV head 0)
        # once per step before the optimizer (handed case C6)
        ("step", "all-reduce", (4, 5), 2 * 1024 * 4 // 2, "fp32"): 2,
    })


def test_hsdp_2x2_tp2_sp():
    # rank 6 = (dp_replicate 1, dp_shard 1, tp 0): tp [6, 7], dp_shard [4, 6], dp_replicate [2, 6]
    tr = TrainingSpec(global_batch=8, seq_len=16, micro_batch=2, sharding="hsdp", **FP32)
    mesh = mesh_of(("dp_replicate", "dp_shard", "tp"), (2, 2, 2), sp=True)
    run = dry_run(TINY, tr, mesh, rank=6)
    assert run.group_differences == []
    tp, shard, rep = (6, 7), (4, 6), (2, 6)
    act = 2 * 16 * 64 * 4
    layer, emb, head = 18560, 8192, 8256  # tp-local elements, as in test_tp2_dp_shard4_no_sp
    t = tally(run)
    assert t[("backward", "all-reduce", rep, layer // 2 * 4, "fp32")] == 2  # shard of each layer
    assert t[("backward", "all-reduce", rep, emb // 2 * 4, "fp32")] == 1
    assert t[("backward", "all-reduce", rep, head // 2 * 4, "fp32")] == 1
    assert t[("forward", "all-gather", shard, emb * 4, "fp32")] == 1
    assert t[("backward", "all-gather", shard, emb * 4, "fp32")] == 1  # resharded after forward
    assert t[("forward", "all-gather", shard, head * 4, "fp32")] == 1
    assert t[("backward", "all-gather", shard, head * 4, "fp32")] == 0  # kept gathered
    assert t[("backward", "reduce-scatter", shard, layer * 4, "fp32")] == 2
    assert t[("forward", "all-gather", shard, layer * 4, "fp32")] == 2
    assert t[("backward", "all-gather", shard, layer * 4, "fp32")] == 2
    assert t[("forward", "all-gather", tp, act, "fp32")] == 5
    assert t[("backward", "all-reduce", tp, 64 * 4, "fp32")] == 5
    assert t[("loss", "all-reduce", tp, 2 * 16 * 4, "fp32")] == 3
    # 39 with one root unit (AG, RS, AR); apart: +1 AG (head) +1 AG (embedding in backward)
    # +1 RS +1 AR (a second unit)
    assert sum(t.values()) == 43


def test_hsdp_every_rank_groups_and_counts():
    # all 8 ranks: DeviceMesh groups equal meshplan's, and every rank issues the same sequence
    # of ops and sizes on its own groups
    tr = TrainingSpec(global_batch=8, seq_len=16, micro_batch=2, sharding="hsdp", **FP32)
    mesh = mesh_of(("dp_replicate", "dp_shard", "tp"), (2, 2, 2), sp=True)
    shapes = set()
    for rank in range(8):
        run = dry_run(TINY, tr, mesh, rank=rank, optimizer_step=False)
        assert run.group_differences == []
        for r in run.records:
            assert rank in r.group
            assert list(r.group) in [mesh.group_of(rank, a) for a in ("tp", "dp_shard", "dp_replicate")]
        shapes.add(tuple((r.phase, r.op, r.size_bytes, len(r.group)) for r in run.records))
    assert len(shapes) == 1


def test_64_ranks_h8192_bf16():
    # seed mesh (dp_shard 8, tp 8) with SP at hidden 8192 (Llama-3-70B widths), one layer,
    # FSDP2 MixedPrecisionPolicy(param bf16, reduce fp32); rank 29 = (3, 5)
    model = ModelSpec(layers=1, hidden=8192, ffn=28672, q_heads=64, kv_heads=8, head_dim=128, vocab=1024)
    tr = TrainingSpec(global_batch=64, seq_len=64, micro_batch=1, param_dtype="fp32", compute_dtype="bf16")
    run = dry_run(model, tr, mesh_of(("dp_shard", "tp"), (8, 8), sp=True), rank=29, mixed_precision=True)
    assert run.group_differences == []
    tp, dp = tuple(range(24, 32)), (5, 13, 21, 29, 37, 45, 53, 61)
    act = 64 * 8192 * 2
    # per tp rank: wq, wo 8192*8192/8; wk, wv 8192*1024/8; 3 MLP 8192*28672/8; norms 2*8192
    layer = 2 * 8388608 + 2 * 1048576 + 3 * 29360128 + 16384  # 106971136
    emb, head = 1024 * 8192 // 8, 1024 * 8192 // 8 + 8192  # 1048576, 1056768
    assert tally(run) == Counter({
        ("forward", "all-gather", dp, emb * 2, "bf16"): 1,
        ("forward", "all-gather", dp, head * 2, "bf16"): 1,
        ("forward", "all-gather", dp, layer * 2, "bf16"): 1,
        ("forward", "reduce-scatter", tp, act, "bf16"): 3,
        ("forward", "all-gather", tp, act, "bf16"): 3,
        ("loss", "all-reduce", tp, 64 * 4, "fp32"): 3,
        ("backward", "all-gather", dp, layer * 2, "bf16"): 1,
        ("backward", "all-gather", dp, emb * 2, "bf16"): 1,
        ("backward", "all-gather", tp, act, "bf16"): 3,
        ("backward", "reduce-scatter", tp, act, "bf16"): 3,
        ("backward", "all-reduce", tp, 8192 * 2, "bf16"): 3,  # norm weight grads, in param dtype
        ("backward", "reduce-scatter", dp, layer * 4, "fp32"): 1,
        ("backward", "reduce-scatter", dp, emb * 4, "fp32"): 1,
        ("backward", "reduce-scatter", dp, head * 4, "fp32"): 1,
    })


def test_fsdp_only_no_reshard_layernorm():
    # dp_shard 8, non-gated MLP, LayerNorm (weight + bias), reshard_after_forward false
    model = TINY.model_copy(update=dict(gated_mlp=False, norm="layernorm", kv_heads=4))
    tr = TrainingSpec(global_batch=16, seq_len=16, micro_batch=2, reshard_after_forward=False, **FP32)
    run = dry_run(model, tr, mesh_of(("dp_shard",), (8,)), rank=1)
    dp = tuple(range(8))
    layer = 2 * 128 + 4 * 64 * 64 + 2 * 64 * 128  # 33024
    emb, head = 256 * 64, 256 * 64 + 128  # final LayerNorm weight + bias with the output
    assert tally(run) == Counter({
        ("forward", "all-gather", dp, emb * 4, "fp32"): 1,
        ("forward", "all-gather", dp, head * 4, "fp32"): 1,
        ("forward", "all-gather", dp, layer * 4, "fp32"): 2,
        ("backward", "reduce-scatter", dp, layer * 4, "fp32"): 2,
        ("backward", "reduce-scatter", dp, emb * 4, "fp32"): 1,
        ("backward", "reduce-scatter", dp, head * 4, "fp32"): 1,
    })


def test_full_recompute_replays_every_collective_of_a_layer():
    # torchtitan wraps each block in non-reentrant checkpoint with early_stop=False (238fa99
    # activation_checkpoint.py 45/135/154, b5bcd76 180/285), as the runtime model does
    # (runtime/execution/model.py): the replay runs the whole block, so the layer's closing
    # reduce-scatter (after w_down) is replayed too (with early_stop it stopped once the saved
    # tensors were rebuilt, one short): +2 all-gathers, +2 reduce-scatters per layer, 2 layers
    tr = TrainingSpec(global_batch=8, seq_len=16, micro_batch=1, **dict(FP32, recompute="full"))
    run = dry_run(TINY, tr, mesh_of(("dp_shard", "tp"), (4, 2), sp=True), rank=3)
    t = tally(run, "backward")
    act = 16 * 64 * 4
    assert t[("backward", "all-gather", (2, 3), act, "fp32")] == 5 + 2 * 2
    assert t[("backward", "reduce-scatter", (2, 3), act, "fp32")] == 5 + 2 * 2
    assert t[("backward", "all-gather", (1, 3, 5, 7), 18560 * 4, "fp32")] == 2  # no extra FSDP gather


def test_loss_not_parallel_gathers_logits():
    tr = TrainingSpec(global_batch=8, seq_len=16, micro_batch=1, **FP32)
    run = dry_run(TINY, tr, mesh_of(("dp_shard", "tp"), (4, 2)), rank=0, loss_parallel=False)
    t = tally(run)
    assert t[("forward", "all-gather", (0, 1), 16 * 256 * 4, "fp32")] == 1  # b*s*V logits
    assert not [k for k in t if k[0] == "loss"]


@pytest.mark.filterwarnings("ignore:Slicing a flattened dim")
def test_large_mesh_groups_and_a_wrong_order_is_caught():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = mesh_of(("pp", "dp_replicate", "dp_shard", "cp", "tp"), (2, 2, 4, 4, 16))
    with fake_process_group(1024, rank=777):
        dm = init_mesh(mesh)
        assert check_groups(dm, mesh) == []
        assert dist.get_process_group_ranks(dm["fsdp"].get_group()) == mesh.group_of(777, "fsdp")
    small = mesh_of(("dp_shard", "tp"), (4, 2))
    with fake_process_group(8, rank=3):
        swapped = init_device_mesh("cpu", (2, 4), mesh_dim_names=("tp", "dp_shard"))
        diffs = check_groups(swapped, small)
    # rank 3 sits at (tp 0, dp_shard 3) of the swapped mesh
    assert diffs == ["dp_shard: DeviceMesh group of rank 3 is [0, 1, 2, 3], meshplan says [1, 3, 5, 7]",
                     "tp: DeviceMesh group of rank 3 is [3, 7], meshplan says [2, 3]"]


def test_refusals_are_config_errors():
    import torch

    tr = TrainingSpec(global_batch=8, seq_len=16, **FP32)
    with fake_process_group(8):
        with torch.device("meta"):
            model = Transformer(TINY.model_copy(update=dict(q_heads=6, kv_heads=2, head_dim=16)), tp=8)
        mesh = mesh_of(("dp_shard", "tp"), (1, 8))
        with pytest.raises(ConfigError, match="q_heads 6 is not divisible by tp 8"):
            parallelize(model, init_mesh(mesh), mesh, tr)
        mesh = mesh_of(("dp_shard", "cp"), (4, 2))  # cp is built for dense models (runtime.cp), not MoE
        moe = TINY.model_copy(update=dict(experts=4, top_k=2, expert_ffn=32))
        with torch.device("meta"):
            model = Transformer(moe)
        with pytest.raises(ConfigError, match="cp > 1 with MoE layers"):
            parallelize(model, init_mesh(mesh), mesh, tr)
    with pytest.raises(ConfigError, match="sharding 'zero1'"):
        dry_run(TINY, tr.model_copy(update=dict(sharding="zero1")), mesh_of(("dp_shard",), (8,)))


def test_scaled_model_matches_param_count():
    from meshplan import catalog

    s = scale_model(catalog.model("llama3-8b"), layers=2, hidden_div=16, vocab=512)
    m = Transformer(s.spec)
    assert sum(p.numel() for p in m.parameters()) == s.spec.param_count()
    assert "layers 32 -> 2" in s.note and "vocab" in s.note


def test_tied_embeddings_gathered_once():
    # tied output layer: one (vocab/tp, h) weight in one unit of embedding, final_norm and
    # output -> 256*64/2 + final_norm 64
    tr = TrainingSpec(global_batch=8, seq_len=16, micro_batch=1, **FP32)
    tied = TINY.model_copy(update=dict(tied_embeddings=True))
    run = dry_run(tied, tr, mesh_of(("dp_shard", "tp"), (4, 2), sp=True), rank=3)
    t = tally(run)
    assert t[("forward", "all-gather", (1, 3, 5, 7), (256 * 64 // 2 + 64) * 4, "fp32")] == 1
    assert t[("backward", "all-gather", (1, 3, 5, 7), (256 * 64 // 2 + 64) * 4, "fp32")] == 0  # kept gathered
    assert t[("backward", "reduce-scatter", (1, 3, 5, 7), (256 * 64 // 2 + 64) * 4, "fp32")] == 1


@contextlib.contextmanager
def _tiny_fsdp_tp_runner():
    """TINY at dp_shard 2 x tp 2 with SP, rank 3 of a fake process group, fp32, loss parallel: yields
    ``(model, Runner, hooks)``, ``hooks()`` the forward pre-hook and hook counts of the root, the
    embedding, layer 0, the final norm and the output (the memory-step tests' before/after check)."""
    import torch

    from meshplan.runtime.execution.trainstep import Runner

    class Status:
        def set(self, *a, **k):
            pass

    tr = TrainingSpec(global_batch=4, seq_len=16, micro_batch=1, **FP32)
    mesh = mesh_of(("dp_shard", "tp"), (2, 2), sp=True)
    with fake_process_group(4, rank=3):
        dm = init_mesh(mesh)
        with torch.device("meta"):
            model = Transformer(TINY, vocab=256, tp=2)
        parallelize(model, dm, mesh, tr, loss_parallel=True)
        model.to_empty(device="cpu")
        model.init_weights(seed=0)
        named = dict(model.named_modules())
        yield model, Runner(model, tr, mesh, 3, 256, 0, Status(), "cpu"), lambda: {
            n: (len(named[n]._forward_pre_hooks), len(named[n]._forward_hooks))
            for n in ("", "embedding", "layers.0", "final_norm", "output")}


def test_memory_step_leaves_grouped_units_as_fully_shard_made_them():
    # [final_norm, output] is one FSDP unit of two modules. torch 2.13's FSDPMemTracker
    # instruments module by module, keeps one hook handle per unit, leaves its hook on
    # final_norm after exit and the next forward raises ("multiple iterative calls");
    # meshplan's UnitMemTracker instruments the unit once. The forward hooks on each module
    # (FSDP's, and TP's on the embedding, final_norm and output) are the same after two
    # tracked steps, the unit's backward methods are FSDP's own, and the steps after run.
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from meshplan.runtime.execution.memtracker import fsdp_units
    from meshplan.runtime.execution.trainstep import memory_step

    with _tiny_fsdp_tp_runner() as (model, runner, hooks):
        before = hooks()
        assert before == {"": (1, 1), "embedding": (2, 2), "layers.0": (1, 1), "final_norm": (2, 2), "output": (2, 2)}
        assert [len(s._modules) for _, s in fsdp_units(model)] == [1, 1, 1, 2]  # embedding, 2 layers, head
        runner.step(0)
        for index in (1, 3):
            _, mem = memory_step(runner, index)
            assert mem["method"].startswith("FSDPMemTracker"), mem["method"]
            assert hooks() == before
            runner.step(index + 1)
        for _, state in fsdp_units(model):
            assert state._fsdp_param_group.pre_backward.__func__ is FSDPParamGroup.pre_backward


@pytest.mark.parametrize("failing", ["_instrument_optimizer", "_track_resize"])
def test_a_tracker_failing_on_entry_leaves_the_model_to_the_resident_set_fallback(monkeypatch, failing):
    # torch 2.13's FSDPMemTracker.__enter__ (fsdp2_mem_tracker.py 503-518) installs the units'
    # hooks (_instrument_fsdp_module), then the optimizer's (_instrument_optimizer), then patches
    # UntypedStorage.resize_ (_track_resize); a raise in either of the last two leaves what came
    # before installed, and no __exit__ runs to remove it. The memory step falls back to the
    # resident set: its method names the error, and the model's forward hooks, the units' backward
    # methods and resize_ are as before the step (the same counts as the test above), so the
    # fallback's step and the steps after run.
    import torch
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from meshplan.runtime.execution.memtracker import UnitMemTracker, fsdp_units
    from meshplan.runtime.execution.trainstep import memory_step

    def boom(self):
        raise RuntimeError("boom")

    resize = torch.UntypedStorage.resize_
    with _tiny_fsdp_tp_runner() as (model, runner, hooks):
        before = hooks()
        runner.step(0)
        monkeypatch.setattr(UnitMemTracker, failing, boom)
        _, mem = memory_step(runner, 1)
        assert mem["method"].startswith("resident-set growth") and mem["method"].endswith("RuntimeError: boom")
        assert hooks() == before and torch.UntypedStorage.resize_ is resize
        assert not runner.opt._optimizer_step_pre_hooks and not runner.opt._optimizer_step_post_hooks
        for _, state in fsdp_units(model):
            assert state._fsdp_param_group.pre_backward.__func__ is FSDPParamGroup.pre_backward
        runner.step(2)
