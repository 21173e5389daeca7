"""The Hugging Face ``config.json`` families :func:`meshplan.spec.hf.model_from_hf_config` reads:
per ``model_type`` (:data:`FAMILIES`), the :class:`~meshplan.spec.model.ModelSpec` fields its
keys give, read through :class:`Keys` (sizes whole numbers, flags true or false, a missing
required key named).

Supported ``model_type`` families and what each maps to (key names as in those families'
config.json files and transformers' config classes):

- ``llama``, ``mistral``, ``mixtral``, ``qwen2``, ``qwen3``, ``qwen3_moe``: RMSNorm, RoPE,
  gated (SwiGLU) MLP of ``intermediate_size``; ``num_key_value_heads`` for GQA; ``head_dim``
  when given. qwen2 adds q/k/v biases; qwen3 adds q/k norms; mixtral and qwen3_moe add routed
  experts (``num_local_experts`` / ``num_experts``, ``num_experts_per_tok``; qwen3_moe experts
  have width ``moe_intermediate_size`` and dense layers from ``mlp_only_layers`` and
  ``decoder_sparse_step``). llama's ``attention_bias`` + ``mlp_bias`` give biases on every
  linear layer.
- ``gpt2``: ``n_layer``, ``n_embd``, ``n_head``, MLP ``n_inner`` (4 * n_embd when null),
  LayerNorm, learned positions (``n_positions``), biases, tied embeddings.
- ``gpt_neox``: LayerNorm, rotary, biases (``attention_bias``, default true), embeddings
  untied unless ``tie_word_embeddings``. The parallel residual changes no parameter.
- ``phi3``: as llama (Phi3Config: fused qkv_proj and gate_up_proj hold the same weights;
  ``num_key_value_heads`` defaults to the heads).
- ``gemma2``, ``gemma3_text`` and ``gemma3`` (its ``text_config``; the vision tower is not
  counted): RMSNorm, RoPE, gated GeLU MLP, explicit ``head_dim``, tied embeddings by default
  (Gemma2Config / Gemma3TextConfig); gemma3 adds q/k norms. Not represented in ModelSpec and
  named in the spec's ``source``: the extra post-attention and post-MLP RMSNorms of every
  layer (2 x hidden parameters per layer, e.g. 301,056 of gemma-2-9b's 9,241,705,984) and the
  sliding-window layers (``sliding_window``), planned as full causal attention (an upper
  bound on their attention time when seq_len > window); logit soft-capping changes no size.
- ``deepseek_v2`` and ``deepseek_v3`` (DeepseekV2Config / DeepseekV3Config and the
  ``modeling_deepseek.py`` of deepseek-ai/DeepSeek-V2 and -V3): multi-head latent attention
  (``q_lora_rank``, null = no query compression as in V2-Lite; ``kv_lora_rank``,
  ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``; ``num_key_value_heads`` is
  not read: MLA up-projects K and V per head), RMSNorm, SwiGLU MLPs, untied embeddings by
  default; MoE from ``n_routed_experts`` (null: dense), ``num_experts_per_tok``,
  ``n_shared_experts`` shared experts of width ``moe_intermediate_size`` each, dense
  layers of width ``intermediate_size`` below ``first_k_dense_replace`` (each of the three
  required, null for none: a missing one is an error naming it, not DeepseekV3Config's
  default, as for every other size); a
  ``moe_layer_freq`` other than 1 (dense layers between MoE layers) and ``attention_bias``
  are refused. Group-limited routing (``topk_method`` other than greedy with ``n_group`` and
  ``topk_group``): carried as ModelSpec ``n_group`` / ``topk_group`` (no size; the deepep
  dispatch's bytes) and named in ``source``. Named in ``source``, no size: for v3 the multi-token
  prediction module (``num_nextn_predict_layers``: per depth one more MoE layer, its
  2h x h projection and two norms; the model card's 671B excludes it) and the
  ``e_score_correction_bias`` of each MoE router (``n_routed_experts`` elements per layer,
  14,848 in V3), not counted.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from meshplan.errors import ConfigError, printable
from meshplan.spec.hf_missing import missing_fix
from meshplan.limits import MAX_LAYERS, over


class Keys:
    """Typed access to one config dict: sizes are whole numbers, flags true or false; a
    missing required key or a value of the wrong type is a ConfigError naming the key."""

    def __init__(self, cfg: dict[str, Any]):
        self.cfg = cfg
        self.model_type = cfg["model_type"]

    def _size(self, key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(key, f"must be a whole number >= 0 in the {self.model_type} config.json "
                                   f"(got {json.dumps(value)[:40]})")
        if value > 2 ** 53:
            raise ConfigError(key, f"{value} is too large to be a model size; see the bounds in docs/input.md")
        return value

    def req(self, key: str) -> int:
        """A required size; missing, the error names the fix (:func:`missing_fix`)."""
        value = self.cfg.get(key)
        if value is None:
            raise ConfigError(key, f"missing from the {self.model_type} config.json; "
                              f"it is required to size the model; {missing_fix(self.model_type, key)}")
        return self._size(key, value)

    def opt(self, key: str, default: Any) -> Any:
        """An optional size (``default`` when missing or null)."""
        value = self.cfg.get(key)
        return default if value is None else self._size(key, value)

    def given(self, key: str, null_means: str) -> int:
        """A size the file must name, where an explicit null means 0 (``null_means`` says what
        that is: DeepSeek's ``n_routed_experts`` null, a dense model). A key left out is a
        ConfigError naming it, as :meth:`req`'s, with what null would mean: a size left out is
        not guessed, even where the config class has a default (DeepseekV3Config's
        n_routed_experts 256), as no other required size is."""
        if key not in self.cfg:
            raise ConfigError(key, f"missing from the {self.model_type} config.json; it is required "
                              f"to size the model (give null for {null_means}); {missing_fix(self.model_type, key)}")
        value = self.cfg[key]
        return 0 if value is None else self._size(key, value)

    def flag(self, key: str, default: bool) -> bool:
        """A true/false key (``default`` when missing or null)."""
        value = self.cfg.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ConfigError(key, f"must be true or false in the {self.model_type} config.json "
                                   f"(got {json.dumps(value)[:40]})")
        return value


def _rope_gated(k: Keys, *, kv_default: bool = False) -> dict[str, Any]:
    """Fields shared by the llama-like families. ``kv_default``: a missing
    ``num_key_value_heads`` means one KV head per query head (LlamaConfig's rule); the
    other families' config classes default it to a fixed size, so there it is required."""
    heads = k.req("num_attention_heads")
    kv = k.opt("num_key_value_heads", heads) if kv_default else k.req("num_key_value_heads")
    return dict(
        layers=k.req("num_hidden_layers"), hidden=k.req("hidden_size"),
        ffn=k.req("intermediate_size"), gated_mlp=True, q_heads=heads, kv_heads=kv,
        head_dim=k.opt("head_dim", None), vocab=k.req("vocab_size"),
        tied_embeddings=k.flag("tie_word_embeddings", False), norm="rmsnorm",
        position_embedding="rope", max_position=k.opt("max_position_embeddings", 0),
    )


def _all_or_no_bias(k: Keys, attention: bool, mlp: bool) -> dict[str, Any]:
    """ModelSpec has biases on every linear layer (linear_bias) or on q/k/v only (qkv_bias)."""
    if attention != mlp:
        raise ConfigError("attention_bias", f"{k.model_type}: attention_bias={attention} with "
                          f"mlp_bias={mlp} is not representable (ModelSpec.linear_bias puts biases "
                          f"on attention and MLP together)")
    return {"linear_bias": attention}


def _llama(k: Keys) -> dict[str, Any]:
    bias = _all_or_no_bias(k, k.flag("attention_bias", False), k.flag("mlp_bias", False))
    return {**_rope_gated(k, kv_default=True), **bias}


def _mistral(k: Keys) -> dict[str, Any]:
    return _rope_gated(k)


def _mixtral(k: Keys) -> dict[str, Any]:
    return {**_rope_gated(k), "experts": k.req("num_local_experts"), "top_k": k.req("num_experts_per_tok")}


def _qwen2(k: Keys) -> dict[str, Any]:
    return {**_rope_gated(k), "qkv_bias": True}


def _qwen3(k: Keys) -> dict[str, Any]:
    bias = _all_or_no_bias(k, k.flag("attention_bias", False), False)
    return {**_rope_gated(k), **bias, "qk_norm": True}


def _qwen3_moe(k: Keys) -> dict[str, Any]:
    fields = _qwen3(k)
    layers = fields["layers"]
    if layers > MAX_LAYERS:
        raise ConfigError("num_hidden_layers", over("layers", layers))
    step = k.opt("decoder_sparse_step", 1)
    if step < 1:
        raise ConfigError("decoder_sparse_step", f"must be >= 1 (every step-th layer is sparse; got {step})")
    only = k.cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ConfigError("mlp_only_layers", f"must be a list of layer indices (got {json.dumps(only)[:40]})")
    mlp_only = set(only)
    # transformers Qwen3MoeDecoderLayer: sparse iff not in mlp_only_layers and (i + 1) % step == 0
    dense = [i for i in range(layers) if i in mlp_only or (i + 1) % step]
    if dense != list(range(len(dense))):
        raise ConfigError("mlp_only_layers", f"dense layers {dense} (from mlp_only_layers and "
                          f"decoder_sparse_step {step}) are not the first layers; ModelSpec only "
                          f"has dense_layers (the first N layers dense)")
    return {**fields, "experts": k.req("num_experts"), "top_k": k.req("num_experts_per_tok"),
            "expert_ffn": k.req("moe_intermediate_size"), "dense_layers": len(dense)}


def _gpt2(k: Keys) -> dict[str, Any]:
    hidden = k.req("n_embd")
    return dict(
        layers=k.req("n_layer"), hidden=hidden, ffn=k.opt("n_inner", 4 * hidden), gated_mlp=False,
        q_heads=k.req("n_head"), vocab=k.req("vocab_size"),
        tied_embeddings=k.flag("tie_word_embeddings", True), norm="layernorm",
        linear_bias=True, position_embedding="learned", max_position=k.req("n_positions"),
    )


def _gpt_neox(k: Keys) -> dict[str, Any]:
    # GPT-NeoX MLP layers always carry biases; attention ones follow attention_bias.
    bias = _all_or_no_bias(k, k.flag("attention_bias", True), True)
    return dict(
        layers=k.req("num_hidden_layers"), hidden=k.req("hidden_size"),
        ffn=k.req("intermediate_size"), gated_mlp=False, q_heads=k.req("num_attention_heads"),
        vocab=k.req("vocab_size"), tied_embeddings=k.flag("tie_word_embeddings", False),
        norm="layernorm", position_embedding="rope",
        max_position=k.opt("max_position_embeddings", 0), **bias,
    )


def _phi3(k: Keys) -> dict[str, Any]:
    bias = _all_or_no_bias(k, k.flag("attention_bias", False), False)
    notes = [f"sliding_window {k.cfg['sliding_window']} (planned as full causal attention)"] \
        if k.cfg.get("sliding_window") else []
    return {**_rope_gated(k, kv_default=True), **bias, "_notes": notes}


def _gemma_notes(k: Keys) -> list[str]:
    notes = ["post-attention and post-MLP RMSNorms (2 x hidden parameters per layer) not counted"]
    if k.cfg.get("sliding_window"):
        notes.append(f"sliding_window {k.cfg['sliding_window']} layers planned as full causal attention")
    caps = [c for c in ("attn_logit_softcapping", "final_logit_softcapping") if k.cfg.get(c)]
    return notes + ([f"{', '.join(caps)} (no size)"] if caps else [])


def _gemma2(k: Keys) -> dict[str, Any]:
    bias = _all_or_no_bias(k, k.flag("attention_bias", False), False)
    return {**_rope_gated(k), **bias, "head_dim": k.req("head_dim"),
            "tied_embeddings": k.flag("tie_word_embeddings", True), "_notes": _gemma_notes(k)}


def _gemma3_text(k: Keys) -> dict[str, Any]:
    return {**_gemma2(k), "qk_norm": True}


def _gemma3(k: Keys) -> dict[str, Any]:
    text = k.cfg.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError("text_config", "missing from the gemma3 config.json; it sizes the language model")
    fields = _gemma3_text(Keys({**text, "model_type": "gemma3"}))
    fields["_notes"] = fields["_notes"] + ["vision tower (vision_config) not counted"]
    return fields


def _deepseek_moe(k: Keys, layers: int) -> dict[str, Any]:
    """The MoE fields of a DeepSeek config: none when ``n_routed_experts`` is null or 0 (the
    remote ``modeling_deepseek.py`` builds dense MLPs then). The expert counts and
    ``first_k_dense_replace`` must be in the file (null: 0); left out, each is a ConfigError
    naming it, as every size is here (:meth:`Keys.given`), not the config class's default."""
    experts = k.given("n_routed_experts", "a dense model")
    if not experts:
        return {}
    if layers > MAX_LAYERS:
        raise ConfigError("num_hidden_layers", over("layers", layers))
    first, freq = k.given("first_k_dense_replace", "no dense layers"), k.opt("moe_layer_freq", 1)
    # modeling_deepseek.py: layer i is MoE iff i >= first_k_dense_replace and i % moe_layer_freq == 0
    dense = [i for i in range(layers) if i < first or i % max(freq, 1)]
    if freq < 1 or dense != list(range(len(dense))):
        raise ConfigError("moe_layer_freq", f"moe_layer_freq {freq} with first_k_dense_replace {first} "
                          f"puts dense layers between MoE layers; ModelSpec only has dense_layers "
                          f"(the first N layers dense): moe_layer_freq must be 1")
    shared = k.given("n_shared_experts", "no shared experts")
    width = k.req("moe_intermediate_size")
    return {"experts": experts, "top_k": k.req("num_experts_per_tok"), "expert_ffn": width,
            "shared_experts": shared, "shared_expert_ffn": width if shared else None,
            "dense_layers": min(len(dense), layers)}


def _deepseek_v2(k: Keys) -> dict[str, Any]:
    if k.flag("attention_bias", False):
        raise ConfigError("attention_bias", f"{k.model_type}: attention biases are not modelled with "
                          f"multi-head latent attention (the published DeepSeek configs have none)")
    layers = k.req("num_hidden_layers")
    fields = dict(
        layers=layers, hidden=k.req("hidden_size"), ffn=k.req("intermediate_size"), gated_mlp=True,
        q_heads=k.req("num_attention_heads"), vocab=k.req("vocab_size"),
        tied_embeddings=k.flag("tie_word_embeddings", False), norm="rmsnorm", position_embedding="rope",
        max_position=k.opt("max_position_embeddings", 0), q_lora_rank=k.opt("q_lora_rank", None),
        kv_lora_rank=k.req("kv_lora_rank"), qk_nope_head_dim=k.req("qk_nope_head_dim"),
        qk_rope_head_dim=k.req("qk_rope_head_dim"), v_head_dim=k.req("v_head_dim"),
        **_deepseek_moe(k, layers))
    notes = []
    method = k.cfg.get("topk_method")
    if fields.get("experts") and isinstance(method, str) and method != "greedy":
        given = all(isinstance(k.cfg.get(x), int) for x in ("n_group", "topk_group"))
        groups = f", n_group {k.cfg['n_group']}, topk_group {k.cfg['topk_group']}" if given else ""
        if given:
            fields |= {"n_group": k.req("n_group"), "topk_group": k.req("topk_group")}
        notes.append(f"topk_method {printable(method)[:40]} (group-limited routing{groups}, no size) "
                     + ("carried as n_group / topk_group: sets the deepep dispatch's bytes" if given
                        else "planned as top-k routing"))
    return {**fields, "_notes": notes}


def _deepseek_v3(k: Keys) -> dict[str, Any]:
    fields = _deepseek_v2(k)
    mtp = k.opt("num_nextn_predict_layers", 0)
    if mtp:
        fields["_notes"].append(f"multi-token prediction module (num_nextn_predict_layers {mtp}) not modelled")
    if fields.get("experts"):
        fields["_notes"].append("MoE routers' e_score_correction_bias (n_routed_experts per MoE layer) not counted")
    return fields


FAMILIES: dict[str, Callable[[Keys], dict[str, Any]]] = {
    "deepseek_v2": _deepseek_v2, "deepseek_v3": _deepseek_v3,
    "gemma2": _gemma2, "gemma3": _gemma3, "gemma3_text": _gemma3_text,
    "gpt2": _gpt2, "gpt_neox": _gpt_neox, "llama": _llama, "mistral": _mistral,
    "mixtral": _mixtral, "phi3": _phi3, "qwen2": _qwen2, "qwen3": _qwen3, "qwen3_moe": _qwen3_moe,
}
SUPPORTED_MODEL_TYPES = tuple(sorted(FAMILIES))
