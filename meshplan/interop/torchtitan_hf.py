"""Which torchtitan model and flavor a Hugging Face config.json is, for ``export --to torchtitan``
of a plan whose model was read from one (:func:`hf_flavor`), and why none is (:func:`hf_refusal`).

torchtitan names a model by ``[model] name`` and ``flavor``; at pytorch/torchtitan b5bcd76 (the
version meshplan follows, :mod:`meshplan.interop.torchtitan_flavors`) a flavor of ``qwen3`` is one
size of the Qwen3 MoE models, told apart by four config.json keys (:data:`HF_FLAVORS`). A
config.json whose ``model_type`` and those four sizes are a flavor's is that flavor, whatever else
it says (RoPE theta, context length: the round trip of the export lists what the flavor runs
differently); its name (``_name_or_path``, the ModelSpec's default name) is only a hint, quoted
when the sizes agree. Sizes that are no flavor's are refused with the nearest flavor and the keys
that differ.

torchtitan v0.2.2 (e347b1e), whose job TOML the export writes, ships no Mixtral and runs no MoE config
through its ``transformers_modeling_backend`` (flavors debugmodel and full, dense: :data:`NO_MODEL`);
nor does b5bcd76 (``torchtitan/models/``: llama3, deepseek_v3, qwen3, qwen3_5,
gpt_oss, kimi_k2_7, flux, muse_glimmer); its ``transformers_modeling_backend`` experiment runs an
MoE config only as flavor ``full_moe`` (``experiments/transformers_modeling_backend/__init__.py``:
142-153), whose sizes are fixed to Qwen3-30B-A3B's and override the config's
(:data:`NO_MODEL`).
"""

from __future__ import annotations

from typing import Optional

from meshplan.spec.model import ModelSpec

#: The config.json keys that tell a torchtitan flavor apart, with the ModelSpec field each is read
#: into (:mod:`meshplan.spec.hf_families` ``qwen3_moe``).
ID_KEYS = (("hidden_size", "hidden"), ("num_hidden_layers", "layers"), ("num_experts", "experts"),
           ("num_experts_per_tok", "top_k"))

#: HF ``model_type`` -> (torchtitan's model name, {flavor: the :data:`ID_KEYS` values}) at b5bcd76,
#: ``torchtitan/models/qwen3/__init__.py``: 30B-A3B (516-554: dim 2048, n_layers 48, num_experts 128,
#: top_k 8), 235B-A22B (557-595: dim 4096, n_layers 94, num_experts 128, top_k 8); the registry
#: ``qwen3_configs`` (598-610) names them so. Its debug flavors are left out.
HF_FLAVORS: dict[str, tuple[str, dict[str, tuple[int, ...]]]] = {
    "qwen3_moe": ("qwen3", {"30B-A3B": (2048, 48, 128, 8), "235B-A22B": (4096, 94, 128, 8)}),
}

#: HF ``model_type`` -> why torchtitan v0.2.2, whose job TOML the export writes, has no model of it: e347b1e's
#: ``torchtitan/models/`` and ``experiments/transformers_modeling_backend/__init__.py``:25-37 (flavors debugmodel
#: and full, dense); b5bcd76 neither (the module docstring).
NO_MODEL = {
    "mixtral": "torchtitan v0.2.2 (e347b1e, the job TOML's) has no Mixtral model (torchtitan/models: llama3, llama4, "
               "deepseek_v3, qwen3, gpt_oss, flux), and its transformers_modeling_backend runs dense configs only "
               "(flavors debugmodel, full); nor has b5bcd76, whose full_moe flavor fixes Qwen3-30B-A3B's sizes "
               "(dim 2048, 48 layers, 128 experts top 8) over the config's",
}


def _sizes(model: ModelSpec) -> tuple[int, ...]:
    return tuple(getattr(model, f) for _, f in ID_KEYS)


def hf_flavor(model_type: str, model: ModelSpec) -> Optional[tuple[str, str]]:
    """torchtitan's (name, flavor) of a config.json of ``model_type`` read as ``model``: the flavor
    whose :data:`ID_KEYS` sizes are the model's; None when none is.

    >>> m = ModelSpec(name="x", layers=94, hidden=4096, ffn=12288, q_heads=64, kv_heads=4, head_dim=128,
    ...               vocab=151936, experts=128, top_k=8, expert_ffn=1536)
    >>> hf_flavor("qwen3_moe", m), hf_flavor("qwen3_moe", m.model_copy(update={"layers": 48})), hf_flavor("x", m)
    (('qwen3', '235B-A22B'), None, None)
    """
    name, flavors = HF_FLAVORS.get(model_type, ("", {}))
    return next(((name, f) for f, s in flavors.items() if s == _sizes(model)), None)


def hf_note(model_type: str, model: ModelSpec, key: tuple[str, str]) -> str:
    """The export's header note saying where ``key`` came from: the sizes that chose it, and the
    model's name where it names the flavor too (a hint, never the reason).

    >>> m = ModelSpec(name="Qwen/Qwen3-235B-A22B", layers=94, hidden=4096, ffn=12288, q_heads=64, kv_heads=4,
    ...               vocab=151936, experts=128, top_k=8, expert_ffn=1536)
    >>> print(hf_note("qwen3_moe", m, ("qwen3", "235B-A22B")))
    model.name "qwen3", model.flavor "235B-A22B": torchtitan's flavor of model_type qwen3_moe with hidden_size 4096, num_hidden_layers 94, num_experts 128, num_experts_per_tok 8 (torchtitan b5bcd76 torchtitan/models/qwen3/__init__.py); the model's name Qwen/Qwen3-235B-A22B names it too
    """
    sizes = ", ".join(f"{k} {v}" for (k, _), v in zip(ID_KEYS, _sizes(model)))
    named = key[1].lower() in model.name.lower()
    return (f"model.name \"{key[0]}\", model.flavor \"{key[1]}\": torchtitan's flavor of model_type {model_type} "
            f"with {sizes} (torchtitan b5bcd76 torchtitan/models/{key[0]}/__init__.py); the model's name "
            f"{model.name} " + ("names it too" if named else "does not name it: the sizes decide"))


def hf_refusal(model_type: str, model: ModelSpec) -> Optional[str]:
    """Why no torchtitan flavor is a config.json of ``model_type`` read as ``model``: for a model_type
    of :data:`HF_FLAVORS`, the nearest flavor (fewest :data:`ID_KEYS` differing; ties: the first) and
    the keys that differ as ``key A (flavor's B)``; for one of :data:`NO_MODEL`, that reason; else None.

    >>> m = ModelSpec(name="x", layers=96, hidden=4096, ffn=12288, q_heads=64, kv_heads=4, head_dim=128,
    ...               vocab=151936, experts=128, top_k=8, expert_ffn=1536)
    >>> print(hf_refusal("qwen3_moe", m))
    model_type qwen3_moe is torchtitan's qwen3, whose flavors are 30B-A3B, 235B-A22B; these sizes are none of them: nearest 235B-A22B, which differs in num_hidden_layers 96 (94)
    """
    if model_type in NO_MODEL:
        return NO_MODEL[model_type]
    if model_type not in HF_FLAVORS:
        return None
    name, flavors = HF_FLAVORS[model_type]
    ours = _sizes(model)
    diff = {f: [f"{k} {a} ({b})" for (k, _), a, b in zip(ID_KEYS, ours, s) if a != b] for f, s in flavors.items()}
    near = min(diff, key=lambda f: len(diff[f]))
    return (f"model_type {model_type} is torchtitan's {name}, whose flavors are {', '.join(flavors)}; these sizes "
            f"are none of them: nearest {near}, which differs in {', '.join(diff[near])}")
