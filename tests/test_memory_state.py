"""Persistent-state memory (handed case C9): exact per-rank counts, sharding rules and the
labelled textbook / Megatron estimates."""

from math import prod

import pytest

from meshplan.errors import ConfigError
from meshplan.memory.state import StateItem, most_loaded, stage_params, stage_state_bytes, state_bytes
from meshplan.memory.state_estimates import (MEGATRON_AS_IF, MEGATRON_LABEL, TEXTBOOK_LABEL, megatron_estimate,
                                             zero_textbook_bytes)
from meshplan.mesh.resolve import resolve_mesh
from meshplan.mesh.layers import stage_layers
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec

TINY = ModelSpec(layers=4, hidden=16, ffn=64, gated_mlp=False, q_heads=4, vocab=32,
                 tied_embeddings=True, norm="layernorm")


def mesh(names, shape):
    world = prod(d for n, d in zip(names, shape) if n not in ("ep", "etp"))
    m = resolve_mesh(MeshSpec(names=names, shape=shape), world=world)
    assert m.feasible, m
    return m


def training(sharding, **kw):
    """bf16 parameters with an fp32 master copy unless ``kw`` says otherwise: the ZeRO paper's
    mixed-precision accounting these tests check (under framework torch with FSDP2 or DDP the
    default is torchtitan's fp32 parameters: test_torch_default_keeps_fp32_params_without_master)."""
    return TrainingSpec(global_batch=64, seq_len=16, sharding=sharding, **({"param_dtype": "bf16"} | kw))


def tiny_states(sharding, dp=4, tp=2, pp=2):
    m = mesh(["pp", "dp", "tp"], [pp, dp, tp])
    t = training(sharding, vocab_pad_divisor=1)
    return m, t, state_bytes(TINY, m, t, stage_layers(TINY.layers, pp))


def test_tiny_gpt_params_per_layer_and_total():
    """C9's counts from the case's sizes (hidden 16, ffn 64, 4 heads, no GQA, vocab 32, non-gated
    MLP, linear layers without bias, LayerNorm weight and bias): QKV 3 x 16 x 16 = 768, output
    16 x 16 = 256, MLP 16 x 64 + 64 x 16 = 2048, two norms 2 x (16 + 16) = 64: 3136 a layer; final
    norm 32, embedding 32 x 16 = 512 (tied, counted once): 4 x 3136 + 32 + 512 = 13088."""
    numel = {t.name: t.numel for t in TINY.layer_tensors(0)}
    assert numel["wq"] + numel["wk"] + numel["wv"] == 768 and numel["wo"] == 256
    assert numel["w_up"] + numel["w_down"] == 2048
    assert sum(n for k, n in numel.items() if "norm" in k) == 64 and sum(numel.values()) == 3136
    assert all(sum(t.numel for t in TINY.layer_tensors(i)) == 3136 for i in range(4))
    assert TINY.param_count() == 13088


def test_tiny_gpt_params_per_stage():
    m, t, _ = tiny_states("zero1")
    s0, s1 = stage_params(TINY, m, t, stage_layers(4, 2))
    assert (s0.total, s1.total) == (3456, 3488)
    # stage 0: 2 layers x (1536 split + 64 norms) + embedding 32*16/2
    assert (s0.layer_params, s0.norm_params, s0.embedding_params, s0.output_params) == (3072, 128, 256, 0)
    # stage 1: 2 layers + final norm 32 (replicated) + its own copy of the tied output weight
    assert (s1.layer_params, s1.norm_params, s1.embedding_params, s1.output_params) == (3072, 160, 0, 256)
    assert s1.tied_copy and not s0.tied_copy
    assert s0.expert_params == s1.expert_params == 0


def test_tiny_gpt_most_loaded_zero1():
    _, _, states = tiny_states("zero1")
    top = most_loaded(states)
    assert top.stage == 1
    assert top.total_bytes == 31392 == 3488 * 9
    assert top.bytes_per_param("dense") == 9.0
    assert states[0].total_bytes == 3456 * 9


def test_tied_output_not_counted_twice_at_pp1():
    m = mesh(["dp", "tp"], [1, 2])
    t = training("none", vocab_pad_divisor=1)
    (s,) = stage_params(TINY, m, t, stage_layers(4, 1))
    assert s.output_params == 0 and not s.tied_copy
    assert s.total == 4 * 1600 + 256 + 32
    untied = TINY.model_copy(update={"tied_embeddings": False})
    (u,) = stage_params(untied, m, t, stage_layers(4, 1))
    assert u.output_params == 256 and u.total == s.total + 256


def test_padded_vocab_is_used():
    m = mesh(["dp", "tp"], [1, 2])
    t = training("none", vocab_pad_divisor=128)  # divisor 128: vocab 32 -> 256
    (s,) = stage_params(TINY, m, t, stage_layers(4, 1))
    assert s.embedding_params == 256 * 16 // 2
    # unset, the framework's: Megatron-LM pads (128), torch does not (32 / tp 2 = 16 rows)
    (mg,) = stage_params(TINY, m, training("none", framework="megatron"), stage_layers(4, 1))
    (tt,) = stage_params(TINY, m, training("none"), stage_layers(4, 1))
    assert (mg.embedding_params, tt.embedding_params) == (256 * 16 // 2, 32 * 16 // 2)


def test_unsharded_mixed_precision_adam_is_18_bytes_per_param():
    _, _, states = tiny_states("none")
    for s in states:
        assert s.bytes_per_param("dense") == 18.0  # bf16 2 + fp32 grad 4 + master 4 + moments 8
        assert {i.kind: i.bytes_per_element for i in s.items} == \
            {"params": 2, "grads": 4, "master": 4, "optimizer": 8}
        assert all(i.divisor == 1 and i.axis == "" for i in s.items)


def test_torch_default_keeps_fp32_params_without_master():
    """Unset param_dtype under framework torch (FSDP2, DDP): torchtitan's fp32 parameters
    (training.dtype "float32"; bf16 only in FSDP2's MixedPrecisionPolicy), so no master copy:
    params 4 + grads 4 + Adam moments 8 = 16 B per parameter, all sharded over dp 4 under zero3
    (stage 1: 3488 parameters, 3488 x 16 / 4 = 13952 B); under Megatron-LM bf16 + fp32 master,
    18 B (15696 B)."""
    m = mesh(["pp", "dp", "tp"], [2, 4, 2])
    for framework, per_param, kinds in (("torch", 16, {"params": 4, "grads": 4, "optimizer": 8}),
                                        ("megatron", 18, {"params": 2, "grads": 4, "master": 4, "optimizer": 8})):
        t = TrainingSpec(global_batch=64, seq_len=16, sharding="zero3", vocab_pad_divisor=1, framework=framework)
        s = state_bytes(TINY, m, t, stage_layers(TINY.layers, 2))[1]
        assert {i.kind: i.bytes_per_element for i in s.items} == kinds
        assert s.total_bytes == 3488 * per_param // 4


@pytest.mark.parametrize("dp", [1, 2, 4, 8, 16])
def test_zero1_is_6_plus_12_over_d(dp):
    _, _, states = tiny_states("zero1", dp=dp)
    assert states[1].bytes_per_param("dense") == 6 + 12 / dp


def test_sharding_levels():
    kinds = {}
    for sharding in ("none", "zero1", "zero2", "zero3"):
        _, _, states = tiny_states(sharding)
        kinds[sharding] = {i.kind for i in states[1].items if i.divisor == 4 and i.axis == "fsdp"}
    assert kinds == {"none": set(), "zero1": {"master", "optimizer"},
                     "zero2": {"master", "optimizer", "grads"},
                     "zero3": {"master", "optimizer", "grads", "params"}}
    _, _, states = tiny_states("zero3")
    assert states[1].total_bytes == 3488 * 18 // 4


def test_hsdp_shards_over_dp_shard_times_cp_only():
    m = mesh(["dp_replicate", "dp_shard", "cp", "tp"], [2, 2, 2, 2])
    t = training("hsdp", vocab_pad_divisor=1)
    (s,) = state_bytes(TINY, m, t, stage_layers(4, 1))
    assert {i.divisor for i in s.items} == {4}
    assert {i.axis for i in s.items} == {"fsdp"}


def test_dense_vs_expert_sharding():
    moe = ModelSpec(layers=2, hidden=64, ffn=128, q_heads=4, vocab=256, experts=8, top_k=2,
                    expert_ffn=32)
    m = mesh(["dp", "cp", "tp", "ep"], [8, 2, 2, 4])
    assert (m.world, m.degree("fsdp"), m.degree("efsdp")) == (32, 16, 8)
    t = training("zero1")
    (s,) = state_bytes(moe, m, t, stage_layers(2, 1))
    assert s.params.expert_params == 2 * (8 * 64 * 32 * 3) // 4
    assert s.bytes_per_param("dense") == 6.75   # sharded over dp*cp = 16
    assert s.bytes_per_param("expert") == 7.5   # over world/(etp*ep*pp) = 8 = efsdp
    axes = {(i.group, i.kind): (i.axis, i.divisor) for i in s.items}
    assert axes[("dense", "optimizer")] == ("fsdp", 16)
    assert axes[("expert", "master")] == ("efsdp", 8)
    assert axes[("expert", "grads")] == ("", 1)


def test_shard_count_rounds_up():
    item = StateItem("master", "dense", 10, "fsdp", 4, 4)
    assert (item.count, item.size_bytes) == (3, 12)


def test_zero_textbook():
    got = [zero_textbook_bytes(7.5e9, 64, 12, stage=s) for s in range(4)]
    assert [g.size_bytes for g in got] == [120e9, 31.40625e9, 16.640625e9, 1.875e9]
    assert round(got[1].size_bytes / 1e9, 1) == 31.4 and round(got[2].size_bytes / 1e9, 1) == 16.6
    assert all(g.label.startswith(TEXTBOOK_LABEL) for g in got)
    assert TEXTBOOK_LABEL == "textbook accounting (ZeRO paper)"
    with pytest.raises(ConfigError):
        zero_textbook_bytes(1, 1, stage=4)


def test_megatron_estimate_is_labelled_beside_exact():
    m, t, states = tiny_states("zero1")
    est = megatron_estimate(TINY, m, t)
    assert (est.params, est.size_bytes) == (3400, 30600)
    assert est.label == MEGATRON_LABEL and "estimate" in est.label
    assert most_loaded(states).total_bytes == 31392 != est.size_bytes
    none = megatron_estimate(TINY, m, training("none", vocab_pad_divisor=1))
    assert none.size_bytes == 3400 * 18


def test_megatron_estimate_is_labelled_as_if_where_the_plan_shards_more():
    """Issue 11 (newcomer trial 4): a zero3 plan printed Megatron's estimate bare beside its
    own peak, but the formula is Megatron's distributed optimizer (6 + 12 / dp B per parameter,
    parameters and gradients whole on every rank). The same number (TINY at tp 2, pp 2, dp 4:
    3400 params x (6 + 12 / 4) B = 30600 B, as under zero1) is labelled as if run with the
    distributed optimizer under zero2, zero3 and hsdp, naming what the plan shards besides;
    none and zero1, which the formula models, keep the plain label."""
    for sharding in ("none", "zero1"):
        est = megatron_estimate(TINY, mesh(["pp", "dp", "tp"], [2, 4, 2]), training(sharding, vocab_pad_divisor=1))
        assert est.label == MEGATRON_LABEL and "does not count" not in est.formula
    for sharding, what in (("zero2", "gradients"), ("zero3", "gradients and parameters"),
                           ("hsdp", "gradients and parameters")):
        est = megatron_estimate(TINY, mesh(["pp", "dp", "tp"], [2, 4, 2]), training(sharding, vocab_pad_divisor=1))
        assert (est.params, est.size_bytes) == (3400, 30600)
        assert est.label == ("Megatron-LM report_theoretical_memory estimate (approximation), as if run with "
                             "Megatron-LM's distributed optimizer") == f"{MEGATRON_LABEL}, {MEGATRON_AS_IF}"
        assert est.formula.endswith(f"x 9 B = 30600 B; this plan's {sharding} also shards the {what} over the "
                                    "data axes, which the formula does not count")


def test_megatron_estimate_formula_adds_up_untied_at_pp1():
    """Megatron adds the untied output layer's embedding_size / tp at pp 1; the printed formula
    must show that term, or its arithmetic does not give the number beside it. TINY untied at
    tp 2, pp 1, dp 4: block 4 x 3136 + final norm 2 x 16 = 12576, embedding 16 x 32 = 512,
    (12576 + 512) / 2 + 512 / 2 = 6800 params x (6 + 12 / 4) B = 61200 B."""
    untied = TINY.model_copy(update={"tied_embeddings": False})
    est = megatron_estimate(untied, mesh(["pp", "dp", "tp"], [1, 4, 2]), training("zero1", vocab_pad_divisor=1))
    assert (est.params, est.size_bytes) == (6800, 61200)
    assert est.formula == ("(12576 / pp 1 + 512) / tp 2 + 512 / tp 2 (untied output layer at pp 1) "
                           "= 6800 params x 9 B = 61200 B")


def test_lines_show_the_derivation():
    _, _, states = tiny_states("zero1")
    text = "\n".join(states[1].lines())
    assert "ceil(3488 / fsdp 4) = 872 x 8 B = 6976 B" in text
    assert "tied copy" in text and "framework accounting" in text


def test_reason_string_is_an_error():
    m, t, _ = tiny_states("zero1")
    with pytest.raises(ConfigError, match="pipeline"):
        stage_params(TINY, m, t, stage_layers(4, 3))


def test_state_bytes_single_stage_matches_all():
    m, t, states = tiny_states("zero2")
    params = stage_params(TINY, m, t, stage_layers(4, 2))
    assert [stage_state_bytes(p, m, t) for p in params] == states
    assert [(s.params.total, len(s.items), s.items[0].size_bytes) for s in states] == \
        [(3456, 4, 3456 * 2), (3488, 4, 3488 * 2)]


def test_megatron_estimate_says_it_ignores_expert_parallelism():
    """Newcomer finding (issue 11 item 8): Mixtral 8x7B at dp_shard 32 x ep 8 printed a 277 GiB
    Megatron estimate beside a 30 GiB peak. Megatron-LM's theoretical_memory_usage.py (NVIDIA/
    Megatron-LM 00caa53a) counts moe_ffn_hidden_size x num_experts per MoE layer, divided by pp and
    tp only: followed as is, the formula now says it ignores ep. By hand: 32 layers x (2 x 4096 x
    (14336 x 8 x 3/2 + 1) + 2 x 4096 x 4096 x (1 + 8/32)) + 4096 = 46,439,600,128 block params,
    + 2 x 4096 x 32000 embedding and output = 46,701,744,128 params x (6 + 12 / 32) B."""
    from meshplan import catalog
    mixtral = catalog.model("mixtral-8x7b")
    m = mesh(["dp_shard", "ep"], [32, 8])
    est = megatron_estimate(mixtral, m, training("zero3"))
    assert est.params == 46_701_744_128 and est.size_bytes == pytest.approx(46_701_744_128 * 6.375)
    assert est.formula.endswith("= 297723618816 B; ignores expert parallelism (ep 8 x etp 1): all 8 experts of "
                                "every MoE layer on every rank, as Megatron-LM's formula counts them; this plan's "
                                "zero3 also shards the gradients and parameters over the data axes, which the formula "
                                "does not count")
    dense = megatron_estimate(TINY, mesh(["dp_shard"], [4]), training("zero3"))
    assert "expert" not in dense.formula
