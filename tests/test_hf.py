"""Hugging Face config.json import: each supported family from a real-keyed fixture under
tests/data/hf/<repo>/config.json, checked against hand-derived parameter counts."""

import json
from pathlib import Path

import pytest

from meshplan import catalog
from meshplan.errors import ConfigError
from meshplan.spec.hf import SUPPORTED_MODEL_TYPES, model_from_hf_config

DATA = Path(__file__).parent / "data" / "hf"


def load(repo: str) -> dict:
    return json.loads((DATA / repo / "config.json").read_text())


def test_llama3_8b_config_equals_the_catalog_entry():
    spec = model_from_hf_config(DATA / "meta-llama-3-8b")
    ref = catalog.model("llama3-8b")
    assert spec.name == "meta-llama-3-8b"
    assert spec.param_count() == ref.param_count() == 8_030_261_248
    for field in ("layers", "hidden", "ffn", "q_heads", "n_kv_heads", "d_head", "vocab",
                  "tied_embeddings", "norm", "gated_mlp", "linear_bias", "max_position", "rope_theta", "norm_eps"):
        assert getattr(spec, field) == getattr(ref, field), field


def test_dict_file_and_directory_give_the_same_spec():
    by_dir = model_from_hf_config(DATA / "meta-llama-3-8b")
    by_file = model_from_hf_config(str(DATA / "meta-llama-3-8b" / "config.json"))
    by_dict = model_from_hf_config(load("meta-llama-3-8b"), name="meta-llama-3-8b")
    assert by_dir.model_dump(exclude={"source"}) == by_file.model_dump(exclude={"source"})
    assert by_dir.model_dump(exclude={"source"}) == by_dict.model_dump(exclude={"source"})
    # a dict has no folder: its architectures[0] and size name it (hf-llama before the name rule)
    assert model_from_hf_config(load("meta-llama-3-8b")).name == "LlamaForCausalLM-8.0B"


def test_mistral_7b():
    # embedding + output 2*32000*4096, 32 x (attention 4096*6144 + 4096^2, MLP 3*4096*14336, 2 norms), final norm
    assert model_from_hf_config(DATA / "mistral-7b-v0.1").param_count() == 7_241_732_096


def test_mixtral_config_equals_the_catalog_entry():
    spec = model_from_hf_config(DATA / "mixtral-8x7b-v0.1")
    ref = catalog.model("mixtral-8x7b")
    assert (spec.experts, spec.top_k, spec.moe_ffn, spec.dense_layers) == (8, 2, 14336, 0)
    assert spec.param_count() == ref.param_count() == 46_702_792_704
    assert (spec.rope_theta, spec.norm_eps) == (ref.rope_theta, ref.norm_eps) == (1e6, 1e-5)  # config.json
    assert spec.active_param_count() == ref.active_param_count() == 12_879_925_248


def test_qwen2_qkv_bias_adds_q_plus_2kv_per_layer():
    spec = model_from_hf_config(DATA / "qwen2-0.5b")
    assert spec.qkv_bias and not spec.linear_bias and spec.tied_embeddings
    q, kv = spec.q_heads * spec.d_head, spec.n_kv_heads * spec.d_head
    assert (q, kv) == (896, 128)
    without = spec.model_copy(update={"qkv_bias": False})
    assert spec.param_count() - without.param_count() == spec.layers * (q + 2 * kv) == 24 * 1152
    # 24 x (896*1152 + 1152 bias + 896^2 + 3*896*4864 + 2*896) + 151936*896 tied + 896
    assert spec.param_count() == 494_032_768


def test_qwen3_qk_norm_and_explicit_head_dim():
    spec = model_from_hf_config(DATA / "qwen3-0.6b")
    assert spec.qk_norm and spec.d_head == 128 and spec.q_heads * spec.d_head == 2048 != spec.hidden
    without = spec.model_copy(update={"qk_norm": False})
    assert spec.param_count() - without.param_count() == 28 * 2 * 128
    # 28 x (1024*(2048+2*1024) + 2048*1024 + 256 + 3*1024*3072 + 2*1024) + 151936*1024 tied + 1024
    assert spec.param_count() == 596_049_920
    non_embedding = spec.param_count() - spec.vocab * spec.hidden
    assert non_embedding == pytest.approx(0.44e9, rel=0.01)  # model card: 0.44B non-embedding


def test_qwen3_moe():
    spec = model_from_hf_config(DATA / "qwen3-30b-a3b")
    assert (spec.experts, spec.top_k, spec.expert_ffn, spec.ffn, spec.dense_layers) == (128, 8, 768, 6144, 0)
    assert spec.param_count() == 30_532_122_624  # model card: 30.5B total
    assert spec.active_param_count() == pytest.approx(3.3e9, rel=0.02)  # 3.3B activated


def test_qwen3_moe_leading_dense_layers_and_unsupported_pattern():
    cfg = load("qwen3-30b-a3b")
    assert model_from_hf_config({**cfg, "mlp_only_layers": [1, 0]}).dense_layers == 2
    with pytest.raises(ConfigError) as info:
        model_from_hf_config({**cfg, "mlp_only_layers": [5]})
    assert info.value.field == "mlp_only_layers"
    with pytest.raises(ConfigError, match="decoder_sparse_step 2"):
        model_from_hf_config({**cfg, "decoder_sparse_step": 2})


def test_gpt2_small():
    spec = model_from_hf_config(DATA / "gpt2")
    assert (spec.ffn, spec.gated_mlp, spec.norm, spec.position_embedding, spec.max_position) == (
        3072, False, "layernorm", "learned", 1024)
    assert spec.linear_bias and spec.tied_embeddings
    assert spec.param_count() == 124_439_808  # the well-known GPT-2 small count
    assert model_from_hf_config({**load("gpt2"), "n_inner": 2048}).ffn == 2048


def test_gpt_neox_pythia_160m():
    spec = model_from_hf_config(DATA / "pythia-160m")
    assert spec.linear_bias and not spec.tied_embeddings and spec.position_embedding == "rope"
    # Pythia (EleutherAI/pythia README): 162,322,944 total, 85,056,000 non-embedding parameters
    assert spec.param_count() == 162_322_944
    assert spec.param_count() - 2 * spec.vocab * spec.hidden == 85_056_000
    tied = model_from_hf_config({**load("pythia-160m"), "tie_word_embeddings": True})
    assert spec.param_count() - tied.param_count() == 50304 * 768


def test_bias_flags_that_modelspec_cannot_express_are_errors():
    llama = load("meta-llama-3-8b")
    both = model_from_hf_config({**llama, "attention_bias": True, "mlp_bias": True})
    assert both.linear_bias
    with pytest.raises(ConfigError) as info:
        model_from_hf_config({**llama, "attention_bias": True})
    assert info.value.field == "attention_bias"
    with pytest.raises(ConfigError, match="attention_bias"):
        model_from_hf_config({**load("pythia-160m"), "attention_bias": False})


def test_kv_heads_default_only_where_transformers_means_mha():
    llama = {k: v for k, v in load("meta-llama-3-8b").items() if k != "num_key_value_heads"}
    assert model_from_hf_config(llama).n_kv_heads == 32
    mistral = {k: v for k, v in load("mistral-7b-v0.1").items() if k != "num_key_value_heads"}
    with pytest.raises(ConfigError) as info:
        model_from_hf_config(mistral)
    assert info.value.field == "num_key_value_heads"


def test_unknown_model_type_lists_the_supported_ones():
    with pytest.raises(ConfigError) as info:
        model_from_hf_config(DATA / "bert-base-uncased")
    msg = str(info.value)
    assert info.value.field == "model_type" and "'bert'" in msg and "\n" not in msg
    assert all(t in msg for t in SUPPORTED_MODEL_TYPES)
    with pytest.raises(ConfigError, match="model_type: missing"):
        model_from_hf_config({"hidden_size": 8})


@pytest.mark.parametrize("repo,key", [
    ("meta-llama-3-8b", "hidden_size"), ("meta-llama-3-8b", "num_hidden_layers"),
    ("meta-llama-3-8b", "intermediate_size"), ("meta-llama-3-8b", "vocab_size"),
    ("meta-llama-3-8b", "num_attention_heads"), ("mixtral-8x7b-v0.1", "num_local_experts"),
    ("qwen3-30b-a3b", "moe_intermediate_size"), ("gpt2", "n_embd"), ("gpt2", "n_positions"),
    ("pythia-160m", "intermediate_size"),
])
def test_missing_required_key_is_named(repo, key):
    cfg = {k: v for k, v in load(repo).items() if k != key}
    with pytest.raises(ConfigError) as info:
        model_from_hf_config(cfg)
    assert info.value.field == key and key in str(info.value)


def test_unreadable_inputs(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        model_from_hf_config(tmp_path / "absent.json")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="invalid JSON"):
        model_from_hf_config(tmp_path)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not an object"):
        model_from_hf_config(bad)


def test_invalid_sizes_become_a_config_error():
    with pytest.raises(ConfigError, match="kv_heads"):
        model_from_hf_config({**load("mistral-7b-v0.1"), "num_key_value_heads": 5})


def test_phi3_mini_by_hand():
    """Phi-3-mini-4k: h 3072, 32 layers, 32 heads (MHA), ffn 8192, vocab 32064, untied.
    Per layer: qkv 3072 x 9216 + o 3072^2 + gate/up 3072 x 16384 + down 8192 x 3072 + 2 norms
    = 28,311,552 + 9,437,184 + 50,331,648 + 25,165,824 + 6,144 = 113,252,352; x 32 plus embedding
    and output 2 x 32064 x 3072 plus the final norm = 3,821,079,552 (the published 3.8B)."""
    spec = model_from_hf_config(DATA / "phi-3-mini-4k-instruct")
    assert spec.param_count() == 32 * 113_252_352 + 2 * 32064 * 3072 + 3072 == 3_821_079_552
    assert (spec.n_kv_heads, spec.gated_mlp, spec.tied_embeddings) == (32, True, False)
    assert "sliding_window 2047" in spec.source


def test_gemma2_9b_by_hand_without_the_post_norms():
    """gemma-2-9b: h 3584, 42 layers, 16 q / 8 kv heads of head_dim 256 (not h / heads = 224),
    ffn 14336 gated, vocab 256000 tied. Per layer q 3584 x 4096, k and v 3584 x 2048, o 4096 x
    3584, MLP 3 x 3584 x 14336, 2 norms = 198,188,032; x 42 + embedding 256000 x 3584 + final
    norm = 9,241,404,928: transformers' 9,241,705,984 less the 2 x 3584 x 42 = 301,056 weights of
    the post-norms, which ModelSpec does not hold (named in the source)."""
    spec = model_from_hf_config(DATA / "gemma-2-9b")
    per_layer = 3 * 14_680_064 + 3 * 3584 * 14336 + 2 * 3584
    assert per_layer == 198_188_032
    assert spec.param_count() == 42 * per_layer + 256000 * 3584 + 3584 == 9_241_705_984 - 2 * 3584 * 42
    assert (spec.d_head, spec.n_kv_heads, spec.tied_embeddings) == (256, 8, True)
    assert "post-attention and post-MLP RMSNorms" in spec.source and "sliding_window 4096" in spec.source


def test_gemma3_text_and_multimodal_wrapper():
    """gemma-3-1b: h 1152, 26 layers, 4 q / 1 kv heads of 256, ffn 6912, vocab 262144 tied, q/k
    norms: per layer 2 x 1152 x 1024 + 2 x 1152 x 256 + 3 x 1152 x 6912 + 2 x 1152 + 2 x 256 =
    26,839,808; the same text model inside a gemma3 config's text_config gives the same count."""
    spec = model_from_hf_config(DATA / "gemma-3-1b-pt")
    per_layer = 2 * 1152 * 1024 + 2 * 1152 * 256 + 3 * 1152 * 6912 + 2 * 1152 + 2 * 256
    assert per_layer == 26_839_808 and spec.qk_norm
    assert spec.param_count() == 26 * per_layer + 262144 * 1152 + 1152 == 999_826_048
    wrapped = {"model_type": "gemma3", "text_config": load("gemma-3-1b-pt"), "vision_config": {"hidden_size": 1152}}
    w = model_from_hf_config(wrapped)
    assert w.param_count() == spec.param_count() and "vision tower" in w.source
    with pytest.raises(ConfigError) as info:
        model_from_hf_config({"model_type": "gemma3"})
    assert info.value.field == "text_config"
    with pytest.raises(ConfigError) as info:
        model_from_hf_config({k: v for k, v in load("gemma-2-9b").items() if k != "head_dim"})
    assert info.value.field == "head_dim"


def test_a_config_in_a_generic_folder_is_named_by_its_architecture_and_size(tmp_path):
    """Newcomer finding: a config.json in jobs/ made the model 'jobs'. The name is the config's
    _name_or_path, else the folder when it names a model (llama-3.1-8b, pythia-160m: unchanged),
    else architectures[0] and the size: Llama 3.1 8B's 8,030,261,248 parameters -> 8.0B."""
    cfg = load("llama-3.1-8b")
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "config.json").write_text(json.dumps(cfg))
    spec = model_from_hf_config(tmp_path / "jobs")
    assert spec.param_count() == 8_030_261_248 and spec.name == "LlamaForCausalLM-8.0B"
    (tmp_path / "jobs" / "config.json").write_text(json.dumps({**cfg, "_name_or_path": "meta-llama/Llama-3.1-8B"}))
    assert model_from_hf_config(tmp_path / "jobs").name == "meta-llama/Llama-3.1-8B"
    (tmp_path / "jobs" / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "architectures"}))
    assert model_from_hf_config(tmp_path / "jobs").name == "hf-llama"
    assert [model_from_hf_config(DATA / d).name for d in ("llama-3.1-8b", "pythia-160m", "qwen3-30b-a3b")] == \
        ["llama-3.1-8b", "pythia-160m", "qwen3-30b-a3b"]  # folders that name a model keep naming it
    (tmp_path / "run1").mkdir()  # under a billion parameters: M
    (tmp_path / "run1" / "config.json").write_text((DATA / "pythia-160m" / "config.json").read_text())
    small = model_from_hf_config(tmp_path / "run1")
    assert small.name == f"GPTNeoXForCausalLM-{small.param_count() / 1e6:.0f}M" == "GPTNeoXForCausalLM-162M"


def test_an_error_in_a_config_file_names_the_file(tmp_path):
    """Newcomer finding: a config.json missing a field named the field but not the file. A read
    file is named in the message (a dict, which has none, keeps 'the llama config.json')."""
    cfg = {k: v for k, v in load("llama-3.1-8b").items() if k != "num_hidden_layers"}
    (tmp_path / "jobs").mkdir()
    f = tmp_path / "jobs" / "config.json"
    f.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        model_from_hf_config(tmp_path / "jobs")
    assert str(e.value) == (f"num_hidden_layers: missing from {f} (model_type llama); it is required to size "
                            f"the model; add \"num_hidden_layers\": N to the config.json, N as in the model's "
                            f"published config.json, or use the catalog model llama3-8b instead of "
                            f"the file (model.catalog, or --model for a foreign config)")
    f.write_text(json.dumps({**load("llama-3.1-8b"), "rope_theta": -1}))
    with pytest.raises(ConfigError) as e:
        model_from_hf_config(f)
    assert str(e.value) == f"rope_theta: must be a number > 0 in {f} (model_type llama) (got -1)"
    f.write_text(json.dumps({**load("qwen3-30b-a3b"), "decoder_sparse_step": 0}))  # no 'config.json' words: (in FILE)
    with pytest.raises(ConfigError) as e:
        model_from_hf_config(f)
    assert str(e.value) == f"decoder_sparse_step: must be >= 1 (every step-th layer is sparse; got 0) (in {f})"
    with pytest.raises(ConfigError) as e:
        model_from_hf_config(cfg)
    assert str(e.value).startswith("num_hidden_layers: missing from the llama config.json;")


#: The published config.json each catalog model of a family was read from (its catalog source).
_CATALOG_DATA = {"meta-llama-3-8b": "llama3-8b", "mixtral-8x7b-v0.1": "mixtral-8x7b",
                 "deepseek-v2": "deepseek-v2", "deepseek-v3": "deepseek-v3"}


@pytest.mark.parametrize("folder", sorted(p.name for p in (Path(__file__).parent / "data" / "hf").iterdir()
                                          if p.name != "bert-base-uncased"))  # bert: an unsupported model_type
def test_every_missing_size_key_names_its_fix(folder):
    """n26small #2: a required key left out named no fix. Each top-level key of each stored
    config.json is dropped in turn; every 'missing from' error says which key to add, and for
    the families with a catalog model names that model as the alternative."""
    cfg = load(folder)
    checked = 0
    for key in (k for k in cfg if k != "model_type"):  # model_type's error lists the supported ones
        try:
            model_from_hf_config({k: v for k, v in cfg.items() if k != key})
        except ConfigError as e:
            if e.field != key or "missing from" not in e.message:
                continue
            checked += 1
            assert f'; add "{key}": N to the config.json, N as in the model\'s published config.json' in e.message
            name = _CATALOG_DATA.get(folder)
            if name is not None:
                assert f"published config.json, or use the catalog model {name} instead of the file" in e.message
    assert checked >= (1 if folder == "gemma-3-1b-pt" else 4)  # layers, hidden, heads, vocab at least
