"""Import a Hugging Face ``config.json`` as a :class:`ModelSpec`.

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
  layers of width ``intermediate_size`` below ``first_k_dense_replace``; a
  ``moe_layer_freq`` other than 1 (dense layers between MoE layers) and ``attention_bias``
  are refused. Named in ``source``, no size: the group-limited routing (``topk_method``,
  ``n_group``, ``topk_group``; planned as top-k routing), and for v3 the multi-token
  prediction module (``num_nextn_predict_layers``: per depth one more MoE layer, its
  2h x h projection and two norms; the model card's 671B excludes it) and the
  ``e_score_correction_bias`` of each MoE router (``n_routed_experts`` elements per layer,
  14,848 in V3), not counted.

Keys that set a size are required; flags missing from the file take their transformers
default (``tie_word_embeddings`` false except gpt2, no biases except gpt2/gpt_neox/qwen2).
Carried without a cost: ``rope_theta``, the norm epsilon and a ``rope_scaling`` of type
"llama3" (Llama 3.1's, :func:`_rope_scaling`); other ``rope_scaling`` types (DeepSeek's yarn)
are not read, with a "not modelled" note that says so and why it costs nothing.

>>> gpt2 = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12,
...         "n_positions": 1024, "vocab_size": 50257}
>>> model_from_hf_config(gpt2).param_count()
124439808
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional, Union

from pydantic import ValidationError

from meshplan.errors import ConfigError, printable
from meshplan.fileread import parse_json, read_text_limited
from meshplan.limits import FILE_BYTES, MAX_LAYERS, MAX_STRING, bound_message, over
from meshplan.spec.model import ModelSpec
from meshplan.spec.names import safe_name


class _Keys:
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
            raise ConfigError(key, f"{value} is too large to be a model size; see the bounds in the README")
        return value

    def req(self, key: str) -> int:
        """A required size."""
        value = self.cfg.get(key)
        if value is None:
            raise ConfigError(key, f"missing from the {self.model_type} config.json; "
                              f"it is required to size the model")
        return self._size(key, value)

    def opt(self, key: str, default: Any) -> Any:
        """An optional size (``default`` when missing or null)."""
        value = self.cfg.get(key)
        return default if value is None else self._size(key, value)

    def flag(self, key: str, default: bool) -> bool:
        """A true/false key (``default`` when missing or null)."""
        value = self.cfg.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ConfigError(key, f"must be true or false in the {self.model_type} config.json "
                                   f"(got {json.dumps(value)[:40]})")
        return value


def _rope_gated(k: _Keys, *, kv_default: bool = False) -> dict[str, Any]:
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


def _all_or_no_bias(k: _Keys, attention: bool, mlp: bool) -> dict[str, Any]:
    """ModelSpec has biases on every linear layer (linear_bias) or on q/k/v only (qkv_bias)."""
    if attention != mlp:
        raise ConfigError("attention_bias", f"{k.model_type}: attention_bias={attention} with "
                          f"mlp_bias={mlp} is not representable (ModelSpec.linear_bias puts biases "
                          f"on attention and MLP together)")
    return {"linear_bias": attention}


def _llama(k: _Keys) -> dict[str, Any]:
    bias = _all_or_no_bias(k, k.flag("attention_bias", False), k.flag("mlp_bias", False))
    return {**_rope_gated(k, kv_default=True), **bias}


def _mistral(k: _Keys) -> dict[str, Any]:
    return _rope_gated(k)


def _mixtral(k: _Keys) -> dict[str, Any]:
    return {**_rope_gated(k), "experts": k.req("num_local_experts"), "top_k": k.req("num_experts_per_tok")}


def _qwen2(k: _Keys) -> dict[str, Any]:
    return {**_rope_gated(k), "qkv_bias": True}


def _qwen3(k: _Keys) -> dict[str, Any]:
    bias = _all_or_no_bias(k, k.flag("attention_bias", False), False)
    return {**_rope_gated(k), **bias, "qk_norm": True}


def _qwen3_moe(k: _Keys) -> dict[str, Any]:
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


def _gpt2(k: _Keys) -> dict[str, Any]:
    hidden = k.req("n_embd")
    return dict(
        layers=k.req("n_layer"), hidden=hidden, ffn=k.opt("n_inner", 4 * hidden), gated_mlp=False,
        q_heads=k.req("n_head"), vocab=k.req("vocab_size"),
        tied_embeddings=k.flag("tie_word_embeddings", True), norm="layernorm",
        linear_bias=True, position_embedding="learned", max_position=k.req("n_positions"),
    )


def _gpt_neox(k: _Keys) -> dict[str, Any]:
    # GPT-NeoX MLP layers always carry biases; attention ones follow attention_bias.
    bias = _all_or_no_bias(k, k.flag("attention_bias", True), True)
    return dict(
        layers=k.req("num_hidden_layers"), hidden=k.req("hidden_size"),
        ffn=k.req("intermediate_size"), gated_mlp=False, q_heads=k.req("num_attention_heads"),
        vocab=k.req("vocab_size"), tied_embeddings=k.flag("tie_word_embeddings", False),
        norm="layernorm", position_embedding="rope",
        max_position=k.opt("max_position_embeddings", 0), **bias,
    )


def _phi3(k: _Keys) -> dict[str, Any]:
    bias = _all_or_no_bias(k, k.flag("attention_bias", False), False)
    notes = [f"sliding_window {k.cfg['sliding_window']} (planned as full causal attention)"] \
        if k.cfg.get("sliding_window") else []
    return {**_rope_gated(k, kv_default=True), **bias, "_notes": notes}


def _gemma_notes(k: _Keys) -> list[str]:
    notes = ["post-attention and post-MLP RMSNorms (2 x hidden parameters per layer) not counted"]
    if k.cfg.get("sliding_window"):
        notes.append(f"sliding_window {k.cfg['sliding_window']} layers planned as full causal attention")
    caps = [c for c in ("attn_logit_softcapping", "final_logit_softcapping") if k.cfg.get(c)]
    return notes + ([f"{', '.join(caps)} (no size)"] if caps else [])


def _gemma2(k: _Keys) -> dict[str, Any]:
    bias = _all_or_no_bias(k, k.flag("attention_bias", False), False)
    return {**_rope_gated(k), **bias, "head_dim": k.req("head_dim"),
            "tied_embeddings": k.flag("tie_word_embeddings", True), "_notes": _gemma_notes(k)}


def _gemma3_text(k: _Keys) -> dict[str, Any]:
    return {**_gemma2(k), "qk_norm": True}


def _gemma3(k: _Keys) -> dict[str, Any]:
    text = k.cfg.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError("text_config", "missing from the gemma3 config.json; it sizes the language model")
    fields = _gemma3_text(_Keys({**text, "model_type": "gemma3"}))
    fields["_notes"] = fields["_notes"] + ["vision tower (vision_config) not counted"]
    return fields


def _deepseek_moe(k: _Keys, layers: int) -> dict[str, Any]:
    """The MoE fields of a DeepSeek config: none when ``n_routed_experts`` is null."""
    experts = k.opt("n_routed_experts", 0)
    if not experts:
        return {}
    if layers > MAX_LAYERS:
        raise ConfigError("num_hidden_layers", over("layers", layers))
    first, freq = k.opt("first_k_dense_replace", 0), k.opt("moe_layer_freq", 1)
    # modeling_deepseek.py: layer i is MoE iff i >= first_k_dense_replace and i % moe_layer_freq == 0
    dense = [i for i in range(layers) if i < first or i % max(freq, 1)]
    if freq < 1 or dense != list(range(len(dense))):
        raise ConfigError("moe_layer_freq", f"moe_layer_freq {freq} with first_k_dense_replace {first} "
                          f"puts dense layers between MoE layers; ModelSpec only has dense_layers "
                          f"(the first N layers dense): moe_layer_freq must be 1")
    shared = k.opt("n_shared_experts", 0)
    width = k.req("moe_intermediate_size")
    return {"experts": experts, "top_k": k.req("num_experts_per_tok"), "expert_ffn": width,
            "shared_experts": shared, "shared_expert_ffn": width if shared else None,
            "dense_layers": min(len(dense), layers)}


def _deepseek_v2(k: _Keys) -> dict[str, Any]:
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
        notes.append(f"topk_method {printable(method)[:40]} (group-limited routing, no size) planned as top-k routing")
    return {**fields, "_notes": notes}


def _deepseek_v3(k: _Keys) -> dict[str, Any]:
    fields = _deepseek_v2(k)
    mtp = k.opt("num_nextn_predict_layers", 0)
    if mtp:
        fields["_notes"].append(f"multi-token prediction module (num_nextn_predict_layers {mtp}) not modelled")
    if fields.get("experts"):
        fields["_notes"].append("MoE routers' e_score_correction_bias (n_routed_experts per MoE layer) not counted")
    return fields


_FAMILIES: dict[str, Callable[[_Keys], dict[str, Any]]] = {
    "deepseek_v2": _deepseek_v2, "deepseek_v3": _deepseek_v3,
    "gemma2": _gemma2, "gemma3": _gemma3, "gemma3_text": _gemma3_text,
    "gpt2": _gpt2, "gpt_neox": _gpt_neox, "llama": _llama, "mistral": _mistral,
    "mixtral": _mixtral, "phi3": _phi3, "qwen2": _qwen2, "qwen3": _qwen3, "qwen3_moe": _qwen3_moe,
}
SUPPORTED_MODEL_TYPES = tuple(sorted(_FAMILIES))


def _read(config: Union[dict, str, Path]) -> tuple[Any, Optional[Path]]:
    """The parsed config and its file (None for a dict); a directory means its config.json.
    Read with :func:`meshplan.fileread.read_text_limited` (a regular file, at most
    ``FILE_BYTES["hf_config"]``); NaN, Infinity, integers past Python's digit limit and
    nesting deeper than the interpreter reads are one-line errors."""
    if isinstance(config, dict):
        return config, None
    path = Path(config)
    if "\0" not in str(path) and path.is_dir():
        path = path / "config.json"
    if "\0" not in str(path) and not path.exists() and not path.is_symlink():
        raise ConfigError("config", f"no such file {path}; give a config.json or its directory")
    hint = "give a config.json or its directory"
    text = read_text_limited(path, "config", FILE_BYTES["hf_config"], hint)
    return parse_json(text, "config", str(path), hint), path


#: The norm epsilon's key: ``rms_norm_eps`` (the RMSNorm families), ``layer_norm_epsilon`` (gpt2),
#: ``layer_norm_eps`` (gpt_neox).
EPS_KEYS = ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps")


def _carried(cfg: dict[str, Any], fields: dict[str, Any]) -> dict[str, float]:
    """``rope_theta`` (a RoPE model's) and ``norm_eps`` (:data:`EPS_KEYS`) of the config, the
    ModelSpec fields an export writes (no size depends on them); absent or null: left out.
    A value that is not a number > 0 is a ConfigError naming the key.

    >>> _carried({"rope_theta": 500000.0, "rms_norm_eps": 1e-05}, {"position_embedding": "rope"})
    {'rope_theta': 500000.0, 'norm_eps': 1e-05}
    """
    out: dict[str, float] = {}
    keys = (("rope_theta", "rope_theta"),) if fields.get("position_embedding") == "rope" else ()
    for key, field in (*keys, *((k, "norm_eps") for k in EPS_KEYS)):
        v = cfg.get(key)
        if v is None or field in out:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ConfigError(key, f"must be a number > 0 in the {cfg.get('model_type')} config.json "
                                   f"(got {json.dumps(v)[:40]})")
        out[field] = float(v)
    return out


#: Llama 3.1's ``rope_scaling`` keys (``rope_type`` "llama3"; transformers'
#: ``_compute_llama3_parameters``) -> :class:`~meshplan.spec.model.RopeScaling` fields.
LLAMA3_SCALING = {"factor": "factor", "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
                  "original_max_position_embeddings": "original_max_position"}


def _rope_scaling(cfg: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """``rope_scaling`` of a RoPE model's config when it is Llama 3.1's (``rope_type``, or the
    older ``type``, "llama3": meta-llama/Llama-3.1-8B's config.json has factor 8.0,
    low_freq_factor 1.0, high_freq_factor 4.0, original_max_position_embeddings 8192), as
    :class:`~meshplan.spec.model.RopeScaling` fields; absent or null: nothing. Another type
    (DeepSeek's "yarn", "linear", "dynamic") is not read, :class:`RopeScaling` holding Llama
    3.1's alone: a one-line note among the model's "not modelled" says so with its fields (the
    plan prints it), and that it costs nothing the plan counts: the scaling changes RoPE's
    inverse frequencies, computed once, and yarn also the attention softmax scale (its
    ``mscale``: transformers' ``_compute_yarn_parameters`` returns an attention factor), one
    scalar, while the per-token rotation and the attention's FLOPs and memory stay the same.
    A key of the llama3 type that is missing or not a number > 0 is a ConfigError naming it.

    >>> _rope_scaling({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    ...     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}, {"position_embedding": "rope"})
    {'rope_scaling': {'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0, 'original_max_position': 8192}}
    >>> print(_rope_scaling({"rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32}},
    ...                     {"position_embedding": "rope", "_notes": []})["_notes"][0])
    rope_scaling yarn (factor 40, beta_fast 32) not read: meshplan's model spec carries Llama 3.1's llama3 scaling only; yarn changes RoPE's frequencies and the attention softmax scale (mscale), not the FLOPs or memory the plan counts
    """
    rs = cfg.get("rope_scaling")
    if not isinstance(rs, dict) or fields.get("position_embedding") != "rope":
        return {}
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):  # transformers' "default": unscaled RoPE
        return {}
    if kind != "llama3":
        given = ", ".join(f"{printable(str(k))[:40]} {json.dumps(v)[:20]}" for k, v in rs.items()
                          if k not in ("type", "rope_type"))
        what = "RoPE's frequencies" + (" and the attention softmax scale (mscale)" if kind == "yarn" else "")
        shown = printable(str(kind))[:40]
        return {"_notes": [*fields.get("_notes", []),
                           f"rope_scaling {shown} ({given}) not read: meshplan's model spec carries Llama 3.1's "
                           f"llama3 scaling only; {shown} changes {what}, not the FLOPs or memory the plan counts"]}
    out: dict[str, Any] = {}
    for key, field in LLAMA3_SCALING.items():
        v = rs.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ConfigError(f"rope_scaling.{key}", f"must be a number > 0 in a llama3 rope_scaling "
                                                     f"(got {json.dumps(v)[:40]}; Llama 3.1: "
                                                     f"{dict(factor=8, low_freq_factor=1, high_freq_factor=4).get(key, 8192)})")
        out[field] = int(v) if field == "original_max_position" and v == int(v) else float(v)
    return {"rope_scaling": out}


def model_from_hf_config(config: Union[dict, str, Path], name: Optional[str] = None) -> ModelSpec:
    """A :class:`ModelSpec` from a Hugging Face config (dict, config.json, or its directory).

    ``name`` defaults to the config's ``_name_or_path``, else the directory name of the file,
    else ``hf-<model_type>``. Raises :class:`ConfigError` for an unsupported ``model_type``
    (listing the supported ones), a missing required key (naming it), or an architecture
    ModelSpec cannot represent.
    """
    cfg, path = _read(config)
    origin = str(path) if path else "a config dict"
    if not isinstance(cfg, dict):
        raise ConfigError("config", f"{origin} holds a JSON {type(cfg).__name__}, not an object")
    model_type = cfg.get("model_type")
    if model_type is None:
        raise ConfigError("model_type", f"missing from {origin}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    family = _FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ConfigError("model_type", f"unsupported model_type {model_type!r:.60}; "
                          f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    fields = family(_Keys(cfg))
    fields |= _carried(cfg, fields) | _rope_scaling(cfg, fields)
    notes = fields.pop("_notes", [])
    explicit = name is not None  # a name the caller chose is checked, one taken from the file made safe
    if name is None:
        given = cfg.get("_name_or_path")
        ok = isinstance(given, str) and len(given) <= MAX_STRING and given.isprintable()
        name = given if ok else (path.parent.name if path else "")
    fields["name"] = safe_name(str(name), f"hf-{model_type}") if not explicit else name
    fields["source"] = printable(f"Hugging Face config.json (model_type {model_type}) from {origin}" + (
        "; not modelled: " + "; ".join(notes) if notes else ""))
    try:
        return ModelSpec(**fields)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "config"
        raise ConfigError(where, f"{bound_message(first) or first['msg']} (imported from {origin})") from None
