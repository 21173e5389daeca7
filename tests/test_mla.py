"""Multi-head latent attention (DeepSeek-V2, -V2-Lite, -V3): parameter counts, the Hugging Face
reader, GEMM shapes, attention FLOP and activation bytes, each derived by hand here.

Fixtures: tests/data/hf/deepseek-v2{,-lite}/config.json and tests/data/hf/deepseek-v3/config.json
hold the config.json files of https://huggingface.co/deepseek-ai/DeepSeek-V2,
https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite and https://huggingface.co/deepseek-ai/DeepSeek-V3
(key for key). Published totals: DeepSeek-V2 (arXiv 2405.04434) 236B total; the V2-Lite model card
15.7B; the DeepSeek-V3 model card 671B for the main model (the 14B multi-token prediction module
on top makes the 685B of the Hugging Face checkpoint).

What the counts hold, per layer: the attention RMSNorm and MLP RMSNorm (h each); MLA's
q_a (h x c_q), q_a_layernorm (c_q), q_b (c_q x a(nope + rope)) or one q_proj (h x a(nope + rope))
without query compression, kv_a_proj_with_mqa (h x (c_kv + rope)), kv_a_layernorm (c_kv),
kv_b (c_kv x a(nope + v)), o_proj (a v x h); a dense layer's SwiGLU MLP 3 h f; an MoE layer's
router (E x h), E routed experts 3 h f_e each and n_s shared experts 3 h f_e each. Plus the
embedding and the untied output layer (V x h each) and the final norm (h). Not counted: V3's
e_score_correction_bias (E per MoE layer) and its MTP module.
"""

import json
from pathlib import Path

import pytest

from meshplan import catalog
from meshplan.compute.flops import sequence_model_flops
from meshplan.compute.layer import layer_cost
from meshplan.compute.ops import Workload
from meshplan.compute.shapes import Attention, attention_shape, layer_gemms
from meshplan.config import config_from_dict, load_config
from meshplan.errors import ConfigError
from meshplan.memory.activations import layer_terms
from meshplan.memory.layer_dims import LayerDims
from meshplan.plan import Plan, build_plan
from meshplan.spec.hf import model_from_hf_config

DATA = Path(__file__).parent / "data" / "hf"
EXAMPLE = Path(__file__).parent.parent / "examples" / "deepseek-v3_2048xh100_pp16-ep64-dp128.toml"


def mla_attention(h, a, cq, ckv, nope, rope, v):
    """MLA weights and latent norms of one layer (module docstring)."""
    q = h * cq + cq + cq * a * (nope + rope) if cq else h * a * (nope + rope)
    return q + h * (ckv + rope) + ckv + ckv * a * (nope + v) + a * v * h


def total(h, layers, dense, ffn, a, cq, ckv, nope, rope, v, experts, shared, fe, vocab):
    attn = mla_attention(h, a, cq, ckv, nope, rope, v)
    dense_layer = attn + 3 * h * ffn + 2 * h
    moe_layer = attn + experts * h + experts * 3 * h * fe + shared * 3 * h * fe + 2 * h
    return dense * dense_layer + (layers - dense) * moe_layer + 2 * vocab * h + h


HAND = {  # (h, layers, dense layers, ffn, heads, c_q, c_kv, nope, rope, v, experts, shared, f_e, vocab)
    "deepseek-v2-lite": (2048, 27, 1, 10944, 16, 0, 512, 128, 64, 128, 64, 2, 1408, 102400),
    "deepseek-v2": (5120, 60, 1, 12288, 128, 1536, 512, 128, 64, 128, 160, 2, 1536, 102400),
    "deepseek-v3": (7168, 61, 3, 18432, 128, 1536, 512, 128, 64, 128, 256, 1, 2048, 129280),
}
PUBLISHED = {"deepseek-v2-lite": 15.7e9, "deepseek-v2": 236e9, "deepseek-v3": 671e9}


@pytest.mark.parametrize("name", sorted(HAND))
def test_parameter_counts_by_hand_match_the_published_totals(name):
    n = catalog.model(name).param_count()
    assert n == total(*HAND[name])
    assert abs(n - PUBLISHED[name]) / PUBLISHED[name] < 0.005  # 15.71B, 235.74B, 671.03B


def test_v3_attention_and_layer_counts_by_hand():
    m = catalog.model("deepseek-v3")
    attn = sum(t.numel for t in m.mla_tensors())
    # q_a 7168*1536 + 1536 + q_b 1536*128*192 + kv_a 7168*576 + 512 + kv_b 512*128*256 + o 128*128*7168
    assert attn == 11_010_048 + 1536 + 37_748_736 + 4_128_768 + 512 + 16_777_216 + 117_440_512
    assert sum(t.numel for t in m.layer_tensors(0)) == attn + 3 * 7168 * 18432 + 2 * 7168
    # active: 3 of a layer's 256 experts' weights are the 8 routed per token (model card: 37B activated)
    assert m.active_param_count() == m.param_count() - 58 * 248 * 3 * 7168 * 2048
    assert abs(m.active_param_count() - 37e9) / 37e9 < 0.02  # 37.55B


@pytest.mark.parametrize("repo", sorted(HAND))
def test_hf_config_reads_as_the_catalog_entry(repo):
    spec = model_from_hf_config(DATA / repo)
    ref = catalog.model(repo)
    assert spec.model_dump(exclude={"source", "name"}) == ref.model_dump(exclude={"source", "name"})
    assert spec.is_mla and spec.d_head == 192 and spec.d_v == 128


def test_hf_notes_name_what_is_not_modelled():
    v3 = model_from_hf_config(DATA / "deepseek-v3")
    assert "multi-token prediction module (num_nextn_predict_layers 1) not modelled" in v3.source
    assert "e_score_correction_bias" in v3.source and "noaux_tc" in v3.source
    lite = model_from_hf_config(DATA / "deepseek-v2-lite")
    # greedy top-k: nothing to say but its yarn rope_scaling (not read, no cost: test_rope_scaling.py)
    assert lite.q_lora_rank is None and lite.source.split("; not modelled: ")[1].startswith("rope_scaling yarn (")
    assert "topk_method" not in lite.source


def _v3_cfg(**changes):
    cfg = json.loads((DATA / "deepseek-v3" / "config.json").read_text())
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not ...}


@pytest.mark.parametrize("changes, field, words", [
    ({"attention_bias": True}, "attention_bias", "not modelled with multi-head latent attention"),
    ({"moe_layer_freq": 2}, "moe_layer_freq", "moe_layer_freq must be 1"),
    ({"kv_lora_rank": ...}, "kv_lora_rank", "missing from the deepseek_v3 config.json"),
    ({"v_head_dim": 0}, "v_head_dim", "greater than 0"),
    ({"qk_rope_head_dim": 1.5}, "qk_rope_head_dim", "whole number"),
    ({"num_experts_per_tok": ...}, "num_experts_per_tok", "missing"),
])
def test_hf_errors_name_the_key(changes, field, words):
    with pytest.raises(ConfigError) as err:
        model_from_hf_config(_v3_cfg(**changes))
    assert err.value.field == field and words in str(err.value)


def test_a_dense_deepseek_config_has_no_experts():
    spec = model_from_hf_config(_v3_cfg(n_routed_experts=None))
    assert not spec.is_moe and spec.layers == 61


BASE = {"model": {"layers": 2, "hidden": 256, "ffn": 512, "q_heads": 4, "vocab": 1000, "kv_lora_rank": 64,
                  "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32},
        "cluster": {"system": "dgx-h100", "nodes": 1}, "training": {"global_batch": 8, "seq_len": 1024},
        "mesh": {"names": ["dp_shard"], "shape": [8]}}


@pytest.mark.parametrize("changes, field, words", [
    ({"v_head_dim": None}, "model", "missing v_head_dim"),
    ({"head_dim": 48}, "model", "leave head_dim out"),
    ({"kv_heads": 2}, "model", "kv_heads 2 != q_heads 4"),
    ({"qkv_bias": True}, "model", "qkv_bias is not modelled"),
    ({"v_head_dim": 0}, "model.v_head_dim", "greater than 0"),
    ({"q_lora_rank": 1 << 20}, "model.q_lora_rank", "over the bound"),
    ({"kv_lora_rank": None, "q_lora_rank": 32}, "model", "missing kv_lora_rank"),
])
def test_bad_mla_fields_are_one_line_errors(changes, field, words):
    model = {k: v for k, v in {**BASE["model"], **changes}.items() if v is not None}
    with pytest.raises(ConfigError) as err:
        config_from_dict({**BASE, "model": model})
    assert err.value.field == field and words in str(err.value) and "\n" not in str(err.value)


def test_v3_gemm_shapes_at_tp_1_and_4():
    m, T = catalog.model("deepseek-v3"), 4096
    shapes = lambda tp: [(g.name, g.m, g.n, g.k) for g in layer_gemms(m, tp, T, layer=0)][:5]
    # a = 128 heads, d_qk = 128 + 64, d_v = 128; the down projections are never split
    assert shapes(1) == [("wq_a", T, 1536, 7168), ("wq_b", T, 128 * 192, 1536), ("wkv_a", T, 512 + 64, 7168),
                         ("wkv_b", T, 128 * (128 + 128), 512), ("wo", T, 7168, 128 * 128)]
    assert shapes(4) == [("wq_a", T, 1536, 7168), ("wq_b", T, 32 * 192, 1536), ("wkv_a", T, 576, 7168),
                         ("wkv_b", T, 32 * 256, 512), ("wo", T, 7168, 32 * 128)]
    lite = [(g.name, g.n, g.k) for g in layer_gemms(catalog.model("deepseek-v2-lite"), 4, T, layer=0)][:4]
    assert lite == [("wq", 4 * 192, 2048), ("wkv_a", 576, 2048), ("wkv_b", 4 * 256, 512), ("wo", 2048, 4 * 128)]


def test_attention_flops_use_both_head_dims():
    att = attention_shape(catalog.model("deepseek-v3"), tp=4, cp=2, micro_batch=1, seq_len=4096)
    assert att == Attention(1, 32, 32, 2048, 4096, 192, 128)
    # QK^T 2 b a s_q s_kv d_qk + PV 2 b a s_q s_kv d_v, causal half
    assert att.flops() == (2 * 32 * 2048 * 4096 * 192 + 2 * 32 * 2048 * 4096 * 128) / 2
    assert att.flops(causal_half=False) == 2 * att.flops()
    dense = Attention(1, 8, 8, 1024, 1024, 128)  # equal head dims: the former 4 b a s s d
    assert dense.flops(causal_half=False) == 4 * 8 * 1024 * 1024 * 128


def test_model_flops_count_the_replicated_down_projections_once():
    m, gpu = catalog.model("deepseek-v3"), catalog.gpu("h100-sxm5-80gb")
    one = layer_cost(m, gpu, Workload(seq_len=4096, tp=1), layer=0).flops("model")
    four = layer_cost(m, gpu, Workload(seq_len=4096, tp=4, sp=True), layer=0).flops("model")
    assert four * 4 == pytest.approx(one, rel=1e-12)
    hw4 = layer_cost(m, gpu, Workload(seq_len=4096, tp=4, sp=True), layer=0).flops("hardware", "forward")
    down = 2 * 4096 * 7168 * (1536 + 576)  # wq_a and wkv_a, run whole on each of the 4 ranks
    assert hw4 * 4 - one / 3 == pytest.approx(3 * down, rel=1e-9)
    moe = layer_cost(m, gpu, Workload(seq_len=4096, tp=1), layer=3).flops("model")
    assert sequence_model_flops(m, 4096) == pytest.approx(3 * one + 58 * moe + 3 * 2 * 4096 * 7168 * 129280,
                                                          rel=1e-12)


def test_latent_norms_and_rope_are_memory_ops():
    m, gpu = catalog.model("deepseek-v3"), catalog.gpu("h100-sxm5-80gb")
    ops = {(o.name, o.phase): o.size_bytes for o in layer_cost(m, gpu, Workload(seq_len=4096, tp=4, sp=True),
                                                                  layer=0).ops if o.kind == "memory"}
    T = 4096  # all tokens: the latents follow the replicated down projections
    assert ops[("q_a norm", "forward")] == 2 * 2 * T * 1536 and ops[("q_a norm", "backward_input")] == 3 * 2 * T * 1536
    assert ops[("kv_a norm", "forward")] == 2 * 2 * T * 512
    assert ops[("rope", "forward")] == 2 * 2 * T * (32 + 1) * 64  # 32 local q_pe heads and the one shared k_pe


def test_one_layer_activation_bytes_by_hand():
    """DeepSeek-V3's first layer, tp 4 + SP, 4,096 tokens, bf16, flash. Under Megatron-LM v is its
    own ``value.contiguous()`` (multi_latent_attention.py at 003b4ce), 2 s a/t d_v; under torch
    (meshplan's runtime and torchtitan: ``k_nope, v = torch.split(kv, ...)``) v is a view of the
    wkv_b output, so the attention keeps all of it, 2 s a/t (d_nope 128 + d_v 128): 2 x 4,096 x 32
    x 256 = 67,108,864 B in place of 33,554,432 (measured on the runtime's CPU run:
    meshplan.memory.mla_terms), the layer 412,090,368 + 33,554,432 = 445,644,800 B."""
    m = catalog.model("deepseek-v3")
    dims = LayerDims.from_model(m, seq_len=4096, micro_batch=1, layer=0)
    s, h, t, a = 4096, 7168, 4, 128
    hand = {
        "attn norm input": 2 * s * h // t, "qkv input": 2 * s * h // t,  # [r]: sequence-sharded
        "q latent (q_a output)": 2 * s * 1536, "q_b input (q_a norm output)": 2 * s * 1536,
        "kv latent and rope key (kv_a output)": 2 * s * (512 + 64), "kv_b input (kv_a norm output)": 2 * s * 512,
        "q": 2 * s * a // t * 192, "k": 2 * s * a // t * 192, "v": 2 * s * a // t * 128,
        "flash softmax statistics (fp32)": 4 * s * a // t, "context (out-proj input)": 2 * s * a // t * 128,
        "mlp norm input": 2 * s * h // t, "w_in input": 2 * s * h // t,
        "gate": 2 * s * 18432 // t, "silu output": 2 * s * 18432 // t, "up": 2 * s * 18432 // t,
        "w_out input": 2 * s * 18432 // t,
    }
    megatron = {x.name: x.size_bytes for x in layer_terms(dims, tp=4, sp=True, flash=True, framework="megatron")}
    assert megatron == hand
    assert sum(megatron.values()) == 412_090_368
    terms = {x.name: x.size_bytes for x in layer_terms(dims, tp=4, sp=True, flash=True)}
    torch_hand = {**{k: v for k, v in hand.items() if k != "v"}, "v (a view of the wkv_b output)": 2 * s * a // t * 256}
    assert terms == torch_hand
    assert sum(terms.values()) == 412_090_368 + 33_554_432 == 445_644_800
    full = layer_terms(dims, tp=4, sp=True, flash=True, recompute="full")
    assert [x.size_bytes for x in full] == [2 * s * h // t]


def test_the_validate_run_of_mla_with_cp_keeps_what_the_plan_counts():
    """The CPU run of ``tests/data/validate_dense_mla_cp2_tp2sp.toml`` at world 4 (cp 2 x tp 2 + SP,
    hidden 256, 8 heads, c_q 96, c_kv 64, d 16 + 8, d_v 16, ffn 704, 32 tokens, fp32), term by term
    against the tensors autograd saved on one rank (FSDPMemTracker and the graph's saved tensors,
    issue 11): 16 local tokens, 8 after SP, 4 local heads. Torch's CPU flash kernel needs d_qk ==
    d_v, so the run's SDPA is the math path (validate plans it with flash_attention false): q * scale
    (16 x 4 x 24 x 4 B), k * scale of the whole sequence (32 x 4 x 24 x 4), the softmax output
    (4 x 16 x 32 x 4) and v, a view of the gathered buffer (32 x 4 x (24 + 16) x 4), are kept; the
    latent norms keep x * rstd (16 x 96 x 4, 16 x 64 x 4) as the other decomposed norms do."""
    from meshplan.memory.activations import layer_options
    from meshplan.memory.workingset import dense_dims
    from meshplan.runtime.validation.options import Options
    from meshplan.runtime.validation.scaling import scale_config

    cfg, notes = scale_config(load_config(Path(__file__).parent / "data" / "validate_dense_mla_cp2_tp2sp.toml"), 4,
                              Options(worlds=(4,), layers=2, seq_len=32, vocab=512))
    assert cfg.training.flash_attention is False and any("math SDPA" in n for n in notes)
    plan = build_plan(cfg)
    lo = {**layer_options(plan.mesh, cfg.training), **cfg.memory.variants}
    terms = {t.name: t.size_bytes for t in layer_terms(dense_dims(cfg.model, cfg.training, False), **lo)}
    hand = {"attn norm input": 4 * 8 * 256, "attn norm normalised input (x*rstd)": 4 * 8 * 256,
            "qkv input (all-gathered)": 4 * 16 * 256,
            "q latent (q_a output)": 4 * 16 * 96, "q_b input (q_a norm output)": 4 * 16 * 96,
            "q_a norm normalised input (x*rstd)": 4 * 16 * 96, "kv latent and rope key (kv_a output)": 4 * 16 * (64 + 8),
            "kv_b input (kv_a norm output)": 4 * 16 * 64, "kv_a norm normalised input (x*rstd)": 4 * 16 * 64,
            "q": 4 * 16 * 4 * 24, "k": 4 * 32 * 4 * 24, "v (a view of the gathered K/V buffer)": 4 * 32 * 4 * (24 + 16),
            "softmax output": 4 * 4 * 16 * 32, "context (out-proj input)": 4 * 16 * 4 * 16,
            "mlp norm input": 4 * 8 * 256, "mlp norm normalised input (x*rstd)": 4 * 8 * 256,
            "w_in input (all-gathered)": 4 * 16 * 256, "gate": 4 * 16 * 352, "silu output": 4 * 16 * 352,
            "up": 4 * 16 * 352, "w_out input": 4 * 16 * 352}
    assert terms == hand and sum(terms.values()) == 238_080
    # 2 layers + token ids 8 x 16 + the head (final norm 2 x 8,192, output-layer input 16,384, fp32
    # logits 16 x 256 x 4, loss 13 x 16): 476,160 + 128 + 49,360 = 525,648 B; FSDPMemTracker measured
    # 526,508 (+0.16%: the norms' rstd and the RoPE tables, not counted). Before, 464,720 (-11.7%).
    assert plan.timelines[0].max_by_kind["activations"] == 2 * 238_080 + 128 + 49_360 == 525_648
    # with a fused kernel (a GPU's) k is a view of the same buffer: one term of 20,480 B in k's and v's place
    fused = {t.name: t.size_bytes for t in layer_terms(dense_dims(cfg.model, cfg.training, False),
                                                        **{**lo, "flash": True})}
    assert fused["k and v (views of the gathered K/V buffer)"] == 4 * 32 * 4 * (24 + 16) and "k" not in fused
    # cp 1 (dp_shard 2 x tp 2, measured the same way on the fake process group: 979,276 B): v keeps the
    # whole wkv_b output, 32 tokens x 4 heads x (16 + 16) x 4 B = 16,384
    cp1 = {t.name: t.size_bytes for t in layer_terms(dense_dims(cfg.model, cfg.training, False),
                                                      **{**lo, "cp": 1, "cp_kv": False})}
    assert cp1["v (a view of the wkv_b output)"] == 4 * 32 * 4 * (16 + 16) and cp1["k"] == 4 * 32 * 4 * 24


def test_op_recompute_is_planned_for_mla():
    """Refused before newcomer trial 48 ("which of its mms the policy saves"); now torchtitan's order
    (compute.recompute.op_sac_mms): wq, wkv_a, wkv_b, wo, w1, w3, w2, the odd ones saved. BASE's
    dense layer, bf16, T 1024 tokens, a 4 heads of d 32 + 16, d_v 32, ffn 512: input 2 x 1024 x 256 =
    524,288; wq 2 x 1024 x 4 x 48 = 393,216; wkv_b 2 x 1024 x 4 x (32 + 32) = 524,288; attention
    2 x 1024 x 4 x 32 = 262,144 and its fp32 log-sum-exp 4 x 1024 x 4 = 16,384; w1 2 x 1024 x 512 =
    1,048,576; w2 524,288: 3,293,184 B."""
    from meshplan.memory.workingset import layer_act_sizes
    cfg = config_from_dict({**BASE, "training": {**BASE["training"], "recompute": "op"}})
    plan = build_plan(cfg)
    assert layer_act_sizes(cfg.model, cfg.training, plan.mesh, cfg.memory).saved == 3_293_184


def test_the_deepseek_v3_example_plans():
    plan = build_plan(load_config(EXAMPLE))
    assert isinstance(plan, Plan) and not plan.reasons
    assert plan.world == 2048 and plan.mesh.ep == 64 and plan.mesh.degree("pp") == 16
    names = [g.name for g in plan.gemms]
    assert names[:5] == ["wq_a", "wq_b", "wkv_a", "wkv_b", "wo"]
    assert sum(len(c) for chunks in plan.stages for c in chunks) == 61


def test_cp_parts_put_the_latent_projections_with_q_and_kv():
    from meshplan.schedule.ring_timeline import cp_parts as _cp_parts
    m, gpu = catalog.model("deepseek-v3"), catalog.gpu("h100-sxm5-80gb")
    c = layer_cost(m, gpu, Workload(seq_len=4096, tp=4, sp=True, cp=2), layer=0)
    sec = {o.name: o.seconds for o in c.ops if o.phase == "forward" and o.block == "attn"}
    p = _cp_parts(c, "forward", None)
    assert p["q"] == pytest.approx(sec["wq_a"] + sec["wq_b"])
    assert p["kv"] == pytest.approx(sec["wkv_a"] + sec["wkv_b"] + sec["rope"])
    assert p["out"] == pytest.approx(sec["wo"])
    assert p["core"] == pytest.approx(sec["attention"] + sec["q_a norm"] + sec["kv_a norm"])


def test_a_small_mla_mesh_with_tp_and_cp_steps():
    """DeepSeek-V2-Lite on one DGX H100, tp 2 x cp 2 x dp_shard 2: the cp all-gather carries the
    up-projected K (d_qk 192) and V (d_v 128) of the rank's 8 heads for the whole sequence."""
    from meshplan.schedule.steptime import step_time
    cfg = config_from_dict({"model": {"catalog": "deepseek-v2-lite"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                            "training": {"global_batch": 8, "seq_len": 4096, "recompute": "full"},
                            "mesh": {"names": ["dp_shard", "cp", "tp"], "shape": [2, 2, 2], "sequence_parallel": True}})
    plan = build_plan(cfg)
    assert isinstance(plan, Plan) and not plan.reasons
    cp = [r for rows in plan.collectives.values() for r in rows if r.axis == "cp" and r.op == "all-gather" and r.phase == "forward"]
    assert cp and cp[0].size_bytes == 1 * 4096 * 8 * (192 + 128) * 2
    assert 0 < step_time(plan).step_s < 60


def test_megatron_export_round_trips_mla(tmp_path):
    """Megatron-LM's --multi-latent-attention, --q-lora-rank, --kv-lora-rank, --qk-head-dim (the
    no-RoPE part), --qk-pos-emb-head-dim and --v-head-dim carry the MLA fields both ways."""
    from meshplan.interop.export import export, reimport_options
    from meshplan.interop.foreign import load_any
    from meshplan.interop.roundtrip import differences
    model = {**BASE["model"], "q_lora_rank": 96, "vocab": 1024}
    cfg = config_from_dict({**BASE, "model": model, "training": {**BASE["training"], "framework": "megatron"},
                            "mesh": {"names": ["dp", "tp"], "shape": [4, 2], "sequence_parallel": True}})
    text, header = export(cfg, "megatron", "mla")
    assert "--multi-latent-attention" in text.split() and "--kv-channels" not in text
    assert "--q-lora-rank 96" in text and "--qk-head-dim 32" in text and "--qk-pos-emb-head-dim 16" in text
    assert not [h for h in header if h.startswith("not expressed")], header
    out = tmp_path / "mla.args"
    out.write_text(text)
    again = load_any(out, "megatron", reimport_options(cfg, "megatron"))
    assert differences(cfg, again) == [] and again.model.is_mla and again.model.d_v == 32


def test_validate_runs_mla_with_tp_and_cp():
    """The runtime builds MLA (meshplan.runtime.execution.mla; tests/test_mla_tp.py), with tp
    and with cp (all-gather CP, the runtime's: cp_attention = "allgather"); what it still refuses is
    refused for the mesh, not for MLA."""
    from meshplan.runtime.validation.validate import not_runnable
    for mesh in ({"names": ["dp_shard"], "shape": [8]}, {"names": ["dp_shard", "cp", "tp"], "shape": [2, 2, 2]}):
        cfg = config_from_dict({**BASE, "training": {**BASE["training"], "cp_attention": "allgather"}, "mesh": mesh})
        assert not_runnable(cfg, build_plan(cfg).mesh) is None
    op = config_from_dict({**BASE, "training": {**BASE["training"], "recompute": "layer", "ac_freq": 1},
                           "mesh": {"names": ["pp", "dp_shard"], "shape": [2, 4]}})
    assert "under pp" in (not_runnable(op, build_plan(op).mesh) or "")


def test_plan_of_an_hf_deepseek_config_prints_what_is_not_modelled(tmp_path):
    from typer.testing import CliRunner
    from meshplan.cli import app
    cfg = tmp_path / "v3.toml"
    cfg.write_text(EXAMPLE.read_text().replace('catalog = "deepseek-v3"',
                                               f'hf_config = "{DATA / "deepseek-v3" / "config.json"}"'))
    r = CliRunner().invoke(app, ["plan", str(cfg)], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    assert "multi-head latent attention (q latent 1536, kv latent 512 + rope key 64)" in r.output
    assert "not modelled: topk_method noaux_tc" in r.output
    assert "multi-token prediction module (num_nextn_predict_layers 1) not modelled" in r.output


def test_megatron_round_trip_of_the_v3_example_keeps_its_dense_layers(tmp_path):
    """--moe-layer-freq '[0]*3+[1]*58' carries DeepSeek-V3's three leading dense layers."""
    from dataclasses import replace
    from meshplan.interop.export import export, reimport_options
    from meshplan.interop.foreign import load_any
    from meshplan.interop.roundtrip import differences
    cfg = load_config(EXAMPLE)
    cfg = replace(cfg, training=cfg.training.model_copy(update={"framework": "megatron"}))
    text, header = export(cfg, "megatron", "v3")
    assert "--moe-layer-freq '[0]*3+[1]*58'" in text.splitlines()
    assert not [h for h in header if h.startswith("not expressed")], header
    out = tmp_path / "v3.args"
    out.write_text(text)
    again = load_any(out, "megatron", reimport_options(cfg, "megatron"))
    assert differences(cfg, again) == [] and again.model.dense_layers == 3
    bad = text.replace("'[0]*3+[1]*58'", "'([1]*3+[0]*1)*15+[1]'")
    out.write_text(bad)
    with pytest.raises(ConfigError) as err:
        load_any(out, "megatron", reimport_options(cfg, "megatron"))
    assert err.value.field == "--moe-layer-freq" and "K + M = --num-layers (61)" in str(err.value)
    # a 5,000-digit K (int() of it raises ValueError past Python's 4,300 digits): the same error
    out.write_text(text.replace("'[0]*3+[1]*58'", "'[0]*" + "9" * 5000 + "+[1]*58'"))
    with pytest.raises(ConfigError) as err:
        load_any(out, "megatron", reimport_options(cfg, "megatron"))
    assert err.value.field == "--moe-layer-freq"
