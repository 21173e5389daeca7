"""The fix for a size key missing from a Hugging Face ``config.json`` (newcomer trial 26 #2):
``num_local_experts: missing from ... (model_type mixtral); it is required to size the model``
named no fix. :func:`missing_fix` adds one: the key to add, an example value from the catalog
model of that family (its ``source`` cites the published config.json it was read from:
mistralai/Mixtral-8x7B-v0.1's num_local_experts 8), and that catalog model as the alternative.
"""

from __future__ import annotations

#: The catalog model that stands for each ``model_type`` (read from that family's published
#: config.json, as its catalog ``source`` says). Families without one get no example value.
FAMILY_CATALOG = {"llama": "llama3-8b", "mixtral": "mixtral-8x7b",
                  "deepseek_v2": "deepseek-v2", "deepseek_v3": "deepseek-v3"}

#: config.json key -> the ModelSpec field (catalog key) holding the same number, as the
#: readers of :mod:`meshplan.spec.hf_families` map them.
KEY_FIELD = {
    "num_hidden_layers": "layers", "hidden_size": "hidden", "intermediate_size": "ffn",
    "num_attention_heads": "q_heads", "num_key_value_heads": "kv_heads", "vocab_size": "vocab",
    "head_dim": "head_dim", "num_local_experts": "experts", "num_experts": "experts",
    "n_routed_experts": "experts", "num_experts_per_tok": "top_k", "moe_intermediate_size": "expert_ffn",
    "n_shared_experts": "shared_experts", "first_k_dense_replace": "dense_layers",
    "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim", "n_group": "n_group",
    "topk_group": "topk_group",
}


def missing_fix(model_type: str, key: str) -> str:
    """What to do about ``key`` missing from a ``model_type`` config.json: add it, with the
    catalog model's value as an example, or plan that catalog model instead.

    >>> missing_fix("mixtral", "num_local_experts")
    'add "num_local_experts": N to the config.json, N as in the model\\'s published config.json (mixtral-8x7b: 8), or use the catalog model mixtral-8x7b instead of the file (model.catalog, or --model for a foreign config)'
    >>> missing_fix("gpt2", "n_layer")
    'add "n_layer": N to the config.json, N as in the model\\'s published config.json'
    """
    fix = f'add "{key}": N to the config.json, N as in the model\'s published config.json'
    name = FAMILY_CATALOG.get(model_type)
    if name is None:
        return fix
    from meshplan import catalog  # the catalog builds specs of this package: imported when needed

    value = catalog.entry("model", name).get(KEY_FIELD.get(key, ""))
    example = f" ({name}: {value})" if isinstance(value, int) and not isinstance(value, bool) else ""
    return f"{fix}{example}, or use the catalog model {name} instead of the file (model.catalog, or --model for a " \
           f"foreign config)"
