"""The output gradients a lagging W holds for MoE and MLA layers and the head's final norm
(meshplan.memory.wlag, issue 11 zero-bubble follow-up): by hand from each layer's weight ops, and
against what torch 2.13's own ``stage_backward_input`` keeps for ``stage_backward_weight`` on the
runtime's ``Block`` (the gradient flowing into the first node of every parameter group).

The toy: s 16, b 1, h 32, fp32 (4 B), 4 query heads. MoE: 4 experts, top 2, capacity factor 1
(8 rows an expert: ceil(16 x 2 / 4)), expert width 16 gated, one shared expert of 24, GQA with 2 KV
heads of 8. MLA: query latent 16, KV latent 8, RoPE key 4, d_nope 8, d_v 8, dense gated MLP of 48."""

from __future__ import annotations

import pytest

from meshplan.mesh.resolve import resolved_mesh
from meshplan.memory.wlag import head_norm_grad_bytes, layer_weight_grad_bytes, routed_grad_bytes
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec

BASE = dict(layers=2, hidden=32, ffn=48, q_heads=4, kv_heads=2, vocab=64)
MOE = ModelSpec(**BASE, experts=4, top_k=2, expert_ffn=16, shared_experts=1, shared_expert_ffn=24, dense_layers=0)
MLA = dict(BASE, kv_heads=4, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
TRAIN = TrainingSpec(global_batch=1, seq_len=16, micro_batch=1, compute_dtype="fp32", moe_capacity_factor=1.0)
ONE = resolved_mesh(MeshSpec(names=["dp"], shape=[1]), 1)

#: By hand, elements (s 16, h 32):
#: MoE: attention norm 16 x 32 = 512; wq 16 x 32 = 512; wk, wv 16 x 16 each = 512; wo 512;
#: MLP norm 512; router 16 tokens x 4 experts = 64; experts 32 rows x (16 + 16 + 32) = 2,048;
#: shared w1, w3 16 x 24 each = 768, w2 512: 5,952.
MOE_ELEMS = 512 + 512 + 512 + 512 + 512 + 64 + 2048 + 768 + 512
#: MLA: attention norm 512; wq_a, q_a_norm 16 x 16 each = 512; wq_b 16 x 4 x (8 + 4) = 768;
#: wkv_a 16 x (8 + 4) = 192; kv_a_norm 16 x 8 = 128; wkv_b 16 x 4 x (8 + 8) = 1,024; wo 512;
#: MLP norm 512, w1, w3 16 x 48 each = 1,536, w2 512: 6,208. Without the query latent wq 768 in
#: place of wq_a, q_a_norm, wq_b (1,280): 5,696.
MLA_ELEMS, MLA_NO_Q_ELEMS = 6208, 5696


def test_by_hand():
    assert layer_weight_grad_bytes(MOE, TRAIN, ONE, moe=True) == 4 * MOE_ELEMS
    assert routed_grad_bytes(MOE, TRAIN, ONE) == 4 * (64 + 2048)
    assert layer_weight_grad_bytes(ModelSpec(**MLA, q_lora_rank=16), TRAIN, ONE) == 4 * MLA_ELEMS
    assert layer_weight_grad_bytes(ModelSpec(**MLA), TRAIN, ONE) == 4 * MLA_NO_Q_ELEMS
    # the final norm's output gradient: 16 x 32 x 4 B
    assert head_norm_grad_bytes(MOE, TRAIN, ONE) == 2048


def test_tp_splits_by_hand():
    """tp 2 with SP, MLA with the query latent: the replicated down projections and latent norms keep
    all 16 tokens (16 x (16 + 16 + 12 + 8) = 832), the up projections half the heads (16 x 2 x 12 =
    384, 16 x 2 x 16 = 512), the norms 8 tokens (2 x 8 x 32 = 512), wo and w2 their partial outputs
    (2 x 512), w1, w3 24 columns (2 x 16 x 24 = 768): 4,032 elements."""
    tp2 = resolved_mesh(MeshSpec(names=["tp"], shape=[2], sequence_parallel=True), 2)
    assert layer_weight_grad_bytes(ModelSpec(**MLA, q_lora_rank=16), TRAIN, tp2) == 4 * 4032
    assert head_norm_grad_bytes(MOE, TRAIN, tp2) == 4 * 8 * 32


def _torch_kept(spec: ModelSpec, moe: bool) -> tuple[int, int]:
    """(parameter groups, elements of the distinct gradient storages) ``stage_backward_input`` keeps
    for W on one runtime Block (torch 2.13 CPU)."""
    torch = pytest.importorskip("torch")
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    from meshplan.runtime.execution.model import Block, rope_cos_sin, rope_head_dim
    from meshplan.runtime.execution.moe import moe_layers

    torch.manual_seed(0)
    blk = Block(spec, spec.n_kv_heads, moe=moe)
    for layer in moe_layers(blk):
        layer.capacity_factor, layer.dropless = 1.0, False
    x = torch.randn(1, 16, spec.hidden, requires_grad=True)
    y = blk(x, rope_cos_sin(16, rope_head_dim(spec)))
    _, groups = stage_backward_input([y], [torch.randn_like(y)], [x], blk.parameters())
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() // t.element_size()
            for g in groups for tup in g.get("grads") or [] for t in tup or () if t is not None}
    stage_backward_weight(blk.parameters(), groups)
    assert all(p.grad is not None for p in blk.parameters())
    return len(groups), sum(kept.values())


def test_torch_keeps_what_the_model_counts():
    assert _torch_kept(MOE, True) == (13, MOE_ELEMS)
    assert _torch_kept(ModelSpec(**MLA, q_lora_rank=16), False) == (12, MLA_ELEMS)
    assert _torch_kept(ModelSpec(**MLA), False) == (10, MLA_NO_Q_ELEMS)


def test_torch_keeps_the_final_norm_and_logits_gradients_on_the_head():
    """The head's stage (final RMSNorm, output Linear of vocab 64, cross-entropy), fp32: torch keeps
    two groups, the norm's output gradient 16 x 32 = 512 elements (:func:`head_norm_grad_bytes`, 2,048 B)
    and the logits gradient 16 x 64 = 1,024 (the timeline's head_lag)."""
    torch = pytest.importorskip("torch")
    from torch.distributed.pipelining._backward import stage_backward_input
    from meshplan.runtime.execution.model import _norm

    torch.manual_seed(0)
    head = torch.nn.Sequential(_norm(MOE, 32), torch.nn.Linear(32, 64, bias=False))
    x = torch.randn(1, 16, 32, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(head(x).view(16, 64), torch.randint(0, 64, (16,)))
    _, groups = stage_backward_input([loss], None, [x], head.parameters())
    kept = sorted(t.numel() for g in groups for tup in g["grads"] for t in tup if t is not None)
    assert kept == [head_norm_grad_bytes(MOE, TRAIN, ONE) // 4, 1024]


def test_torchs_w_replays_a_checkpointed_layer_once_per_parameter_group():
    """Two runtime Blocks (Llama-style: 9 weight groups each, weight_groups) under non-reentrant
    checkpointing (torchtitan's early_stop false; true the same): each forward runs once in F, once
    more in I (stage_backward_input), and 9 more times in W (stage_backward_weight: one autograd.grad
    per parameter group, a graph task each, and the checkpoint recomputes its frame per graph task)."""
    torch = pytest.importorskip("torch")
    from torch.utils.checkpoint import checkpoint
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    from meshplan.memory.wlag import weight_groups
    from meshplan.runtime.execution.model import Block, rope_cos_sin, rope_head_dim

    dense = ModelSpec(**BASE)
    assert weight_groups(dense) == 9 and weight_groups(MOE, moe=True) == 13
    assert weight_groups(ModelSpec(**MLA, q_lora_rank=16)) == 12 and weight_groups(ModelSpec(**MLA)) == 10
    for early in (False, True):
        torch.manual_seed(0)
        blocks = torch.nn.ModuleList([Block(dense, 2) for _ in range(2)])
        calls = []
        for b in blocks:
            b.register_forward_pre_hook(lambda *_: calls.append(1))
        x = torch.randn(1, 16, 32, requires_grad=True)
        h = x
        for b in blocks:
            h = checkpoint(b, h, rope_cos_sin(16, rope_head_dim(dense)), use_reentrant=False, early_stop=early)
        params = list(blocks.parameters())
        _, groups = stage_backward_input([h], [torch.ones_like(h)], [x], iter(params))
        after_i = len(calls)
        stage_backward_weight(iter(params), groups)
        assert (after_i, len(calls) - after_i, len(groups)) == (4, 2 * 9, 2 * 9), early


def test_torchs_w_raises_under_op_level_selective_checkpointing():
    """Op-level SAC (torchtitan's ``selective_ac_option = "op"``: save SDPA and every second mm,
    recompute the rest) under the same split backward: I's recompute takes the saved outputs from
    the SAC cache and the first graph task of W finds it spent, and torch 2.13 raises ("Trying to
    backward an extra time ... selective activation checkpoint"), so the step times no W replays
    under recompute "op" (meshplan.pipeline.split_backward_ac.w_replay_words says it raised)."""
    torch = pytest.importorskip("torch")
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    from meshplan.runtime.execution.model import Block, rope_cos_sin, rope_head_dim

    def context():
        seen = {"forward": 0, "recompute": 0}

        def policy(ctx, func, *args, **kwargs):
            mode = "recompute" if ctx.is_recompute else "forward"
            if func == torch.ops.aten.mm.default:
                seen[mode] += 1
            save = "scaled_dot_product" in str(func) or (func == torch.ops.aten.mm.default and seen[mode] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
        return create_selective_checkpoint_contexts(policy)

    dense = ModelSpec(**BASE)
    torch.manual_seed(0)
    block = Block(dense, 2)
    x = torch.randn(1, 16, 32, requires_grad=True)
    h = checkpoint(block, x, rope_cos_sin(16, rope_head_dim(dense)), use_reentrant=False, early_stop=False,
                   context_fn=context)
    params = list(block.parameters())
    _, groups = stage_backward_input([h], [torch.ones_like(h)], [x], iter(params))
    with pytest.raises(RuntimeError, match="backward an extra time"):
        stage_backward_weight(iter(params), groups)
