"""torchtitan's shipped model flavors as meshplan models: what ``import torchtitan`` reads a
``[model] name`` + ``flavor`` as (:func:`flavor_table`), and what ``export --to torchtitan``
writes for a plan's model (:func:`flavor_of`; :func:`flavor_refusal` where none is that model).

Each flavor is the torchtitan registry at pytorch/torchtitan b5bcd76 (2026-08-21, the version
meshplan follows: :data:`~meshplan.spec.axes.moe_tp.TORCH_ETP`), ``torchtitan/models/<name>/__init__.py``:

=================== =============================================== ========================
torchtitan          its args at b5bcd76 (file:line of the flavor)    meshplan model
=================== =============================================== ========================
llama3 8B/70B/405B  llama3/__init__.py:236, 277, 318                catalog llama3-8b/-70b/-405b
                                                                    (llama3.1-8b/-70b past 8192)
deepseek_v3 16B     deepseek_v3/__init__.py:389-456: dim 2048, 27   catalog deepseek-v2-lite
                    layers, 16 heads, q_lora_rank 0, kv_lora_rank
                    512, qk 128+64, v 128, dense_hidden_dim 10944,
                    1 dense layer, 64 experts top 6, moe_hidden_dim
                    1408, 2 shared, vocab 102400
deepseek_v3 236B    deepseek_v3/__init__.py:459-530: dim 5120, 60   catalog deepseek-v2
                    layers, 128 heads, q_lora_rank 1536, 12288, 1
                    dense, 160 experts top 6, 1536, 2 shared
deepseek_v3 671B    deepseek_v3/__init__.py:533-605: dim 7168, 61   catalog deepseek-v3
                    layers, 128 heads, q_lora_rank 1536, 18432, 3
                    dense, 256 experts top 8, 2048, 1 shared,
                    vocab 129280 (num_mtp_layers 0: no MTP)
qwen3 30B-A3B       qwen3/__init__.py:516-554: dim 2048, 48 layers,  fields of Qwen/Qwen3-30B-A3B's
                    32 heads, 4 KV heads, head_dim 128, 128 experts  config.json
                    top 8, moe_hidden_dim 768, every layer MoE,      (:data:`FIELD_FLAVORS`)
                    theta 1e6, vocab 151936, q/k norms
qwen3 235B-A22B     qwen3/__init__.py:557-595: dim 4096, 94 layers,  fields of Qwen/Qwen3-235B-A22B's
                    64 heads, 4 KV heads, head_dim 128, 128 experts  config.json but RoPE theta
                    top 8, moe_hidden_dim 1536, every layer MoE,     (:data:`FIELD_FLAVORS`)
                    theta 5e6 (the config.json: 1e6), 40,960
                    positions, vocab 151936, q/k norms
=================== =============================================== ========================

Each is the Hugging Face model the flavor reproduces (the catalog entries' config.json values,
``meshplan catalog model``); what the flavor sets apart from it costs nothing in a plan: RoPE's
context length and YaRN scaling (``ComplexRoPE.Config``: 16,384 positions, factor 40; no
position table), deepseek_v3's RMSNorm eps (``RMSNorm.Config``'s default 1e-5,
``torchtitan/models/common/nn_modules.py``:140, against 1e-6), the routers' group limits (planned
as top-k, as the catalog says). qwen3 235B-A22B is what torchtitan runs, RoPE theta 5e6
(qwen3/__init__.py:591; Qwen/Qwen3-235B-A22B's config.json says 1e6, its 2507 releases 5e6 with
262,144 positions): a plan of that config.json exports as this flavor by its sizes
(:mod:`meshplan.interop.torchtitan_hf`), the round trip listing the theta. Not mapped: gpt_oss 20b/120b (attention sinks and sliding windows, which ModelSpec has no field for),
kimi_k2_7's flavors and every debugmodel; b5bcd76 ships no llama4 (v0.2.2 does: not mapped either).

The job TOML an export writes is for torchtitan v0.2.2 (e347b1e); its flavors of the table have the same
sizes (e347b1e ``torchtitan/models/<name>/__init__.py``: llama3's dim, n_layers, n_heads, n_kv_heads,
ffn_dim_multiplier, multiple_of and rope_theta, deepseek_v3's and qwen3's every field named above), so
the mapping holds for both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from meshplan import catalog
from meshplan.config_errors import build
from meshplan.errors import ConfigError, did_you_mean
from meshplan.interop.common import ImportOptions, model_option
from meshplan.limits import BOUNDS
from meshplan.spec.model import ModelSpec

#: (model.name, model.flavor) -> meshplan catalog model (module docstring's table).
FLAVORS = {("llama3", "8B"): "llama3-8b", ("llama3", "70B"): "llama3-70b", ("llama3", "405B"): "llama3-405b",
           ("deepseek_v3", "16B"): "deepseek-v2-lite", ("deepseek_v3", "236B"): "deepseek-v2",
           ("deepseek_v3", "671B"): "deepseek-v3"}

#: (model.name, model.flavor) -> the [model] fields of a flavor the catalog has no entry for:
#: Qwen/Qwen3-30B-A3B's config.json (``tests/data/hf/qwen3-30b-a3b/config.json``, read by
#: :mod:`meshplan.spec.hf_families` ``qwen3_moe``), whose dims torchtitan's 30B-A3B flavor has
#: (qwen3/__init__.py:516-554 at b5bcd76). Its ``intermediate_size`` 6144 is no layer's width
#: (every layer is MoE: decoder_sparse_step 1, mlp_only_layers []); it is kept so that the same
#: config.json and this table are one model (:meth:`~meshplan.spec.model.ModelSpec.architecture`).
FIELD_FLAVORS: dict[tuple[str, str], dict[str, Any]] = {
    ("qwen3", "30B-A3B"): {
        "name": "qwen3-30b-a3b", "layers": 48, "hidden": 2048, "ffn": 6144, "q_heads": 32, "kv_heads": 4,
        "head_dim": 128, "vocab": 151936, "qk_norm": True, "max_position": 40960, "rope_theta": 1000000.0,
        "norm_eps": 1e-06, "experts": 128, "top_k": 8, "expert_ffn": 768,
        "source": "torchtitan b5bcd76 torchtitan/models/qwen3/__init__.py:516-554 (flavor 30B-A3B), the dims "
                  "of Qwen/Qwen3-30B-A3B's config.json (hidden_size 2048, num_hidden_layers 48, "
                  "num_attention_heads 32, num_key_value_heads 4, head_dim 128, intermediate_size 6144, "
                  "moe_intermediate_size 768, num_experts 128, num_experts_per_tok 8, vocab_size 151936, "
                  "rope_theta 1e6, max_position_embeddings 40960, rms_norm_eps 1e-6, tie_word_embeddings false)"},
    ("qwen3", "235B-A22B"): {
        "name": "qwen3-235b-a22b", "layers": 94, "hidden": 4096, "ffn": 12288, "q_heads": 64, "kv_heads": 4,
        "head_dim": 128, "vocab": 151936, "qk_norm": True, "max_position": 40960, "rope_theta": 5000000.0,
        "norm_eps": 1e-06, "experts": 128, "top_k": 8, "expert_ffn": 1536,
        "source": "torchtitan b5bcd76 torchtitan/models/qwen3/__init__.py:557-595 (flavor 235B-A22B: dim 4096, "
                  "n_layers 94, n_heads 64, n_kv_heads 4, head_dim 128, moe_hidden_dim 1536, num_experts 128, "
                  "top_k 8, max_context_length 40960, theta 5e6, vocab 151936; eps 1e-6 at :65); the ffn 12288 "
                  "(no layer's width: every layer MoE) is Qwen/Qwen3-235B-A22B's config.json intermediate_size"},
}


def shipped() -> list[tuple[str, str]]:
    """Every (name, flavor) meshplan maps, in the module docstring's order."""
    return list(FLAVORS) + list(FIELD_FLAVORS)


def flavor_table(name: str, flavor: str) -> Optional[dict]:
    """The meshplan [model] table of torchtitan's ``name`` ``flavor``, None when not mapped.

    >>> flavor_table("deepseek_v3", "16B"), flavor_table("qwen3", "30B-A3B")["experts"]
    ({'catalog': 'deepseek-v2-lite'}, 128)
    >>> flavor_table("gpt_oss", "20b") is None
    True
    """
    if (name, flavor) in FLAVORS:
        return {"catalog": FLAVORS[name, flavor]}
    fields = FIELD_FLAVORS.get((name, flavor))
    return dict(fields) if fields else None


def flavor_model(key: tuple[str, str]) -> ModelSpec:
    """The ModelSpec of a mapped (name, flavor)."""
    return catalog.model(FLAVORS[key]) if key in FLAVORS else ModelSpec(**FIELD_FLAVORS[key])


#: Where torchtitan sets a model's positions: from the job, not the flavor. Its llama3 flavors are
#: Llama 3.1 (RoPE ``scaling="llama"``, ``max_context_length=131072``: b5bcd76
#: ``torchtitan/models/llama3/__init__.py``:267, 308, 349) and the trainer sizes every decoder's
#: RoPE to the job's sequence length (b5bcd76 ``torchtitan/models/common/decoder.py``:218-230;
#: v0.2.2, e347b1e ``torchtitan/models/llama3/model/args.py``:40, 49-55: ``max_seq_len = 131072``,
#: ``update_from_config`` sets it to ``training.seq_len``).
CONTEXT_SOURCE = ("torchtitan sizes RoPE to training.seq_len (b5bcd76 models/common/decoder.py:218-230; e347b1e "
                  "models/llama3/model/args.py:49-55), its llama3 flavors being Llama 3.1 (RoPE scaling \"llama\", "
                  "131072 positions: b5bcd76 models/llama3/__init__.py:267, 308, 349)")


#: The positions torchtitan's llama3 flavors were trained to (Llama 3.1's RoPE scaling
#: ``max_context_length``, :data:`CONTEXT_SOURCE`): a job past them runs positions the model never saw.
LLAMA31_POSITIONS = 131072


def _past_trained(table: dict, seq_len: int) -> str:
    """The words a note adds where a llama3 flavor runs past :data:`LLAMA31_POSITIONS` ("" otherwise).

    >>> _past_trained({"catalog": "llama3-8b"}, 262144)[:48]
    '; 262144 is past the 131072 positions Llama 3.1 '
    >>> _past_trained({"catalog": "llama3-8b"}, 131072), _past_trained({"catalog": "qwen3-8b"}, 262144)
    ('', '')
    """
    if not str(table.get("catalog", "")).startswith(("llama3-", "llama3.1-")) or seq_len <= LLAMA31_POSITIONS:
        return ""
    return (f"; {seq_len} is past the {LLAMA31_POSITIONS} positions Llama 3.1 was trained to (RoPE scaling "
            f"\"llama\" to {LLAMA31_POSITIONS}): the planned cost holds, the positions past it are untrained")


def _flavor_fields(model: ModelSpec) -> dict:
    """:meth:`~ModelSpec.architecture` without ``max_position`` and ``rope_scaling``: torchtitan takes
    a flavor's positions from the job (:data:`CONTEXT_SOURCE`), and its llama3 flavors set Llama 3.1's
    RoPE scaling in code, which no job key reads or writes (:mod:`meshplan.interop.torchtitan`; it
    costs nothing: :class:`~meshplan.spec.rope.RopeScaling`), so a flavor is its sizes whatever the
    context: catalog llama3-8b (Llama 3, 8192 positions) and llama3.1-8b (131072, scaled) are both
    flavor 8B.

    >>> flavor_of(catalog.model("llama3.1-8b")), flavor_of(catalog.model("llama3.1-70b"))
    (('llama3', '8B'), ('llama3', '70B'))
    """
    return {k: v for k, v in model.architecture().items() if k not in ("max_position", "rope_scaling")}


def flavor_of(model: ModelSpec) -> Optional[tuple[str, str]]:
    """The (name, flavor) whose model is ``model`` (equal :meth:`~ModelSpec.architecture`:
    every field but name, source and ``max_position``, :func:`_flavor_fields`), None when none is.

    >>> flavor_of(catalog.model("deepseek-v2-lite")), flavor_of(catalog.model("mixtral-8x7b"))
    (('deepseek_v3', '16B'), None)
    >>> flavor_of(catalog.model("llama3-70b").model_copy(update={"max_position": 131072}))
    ('llama3', '70B')
    """
    arch = _flavor_fields(model)
    return next((k for k in shipped() if _flavor_fields(flavor_model(k)) == arch), None)


def differing(model: ModelSpec, key: tuple[str, str]) -> list[str]:
    """The fields in which ``model`` differs from flavor ``key``'s model, as ``field A (flavor B)``."""
    a, b = _flavor_fields(model), _flavor_fields(flavor_model(key))
    return [f"{k} {a[k]} ({b[k]})" for k in a if a[k] != b[k]]


def flavor_context(table: dict, used: set[str], seq_len: int, notes: list[str]) -> dict:
    """The [model] ``table`` read from a flavor (``used`` holds ``model.flavor``, not
    ``model.hf_assets_path``) with ``max_position = seq_len`` where the job's ``seq_len`` is more
    than the positions the table's model states: torchtitan runs the flavor at that context
    (:data:`CONTEXT_SOURCE`), with a note; ``table`` itself otherwise. Newcomer trial 29: flavor
    70B at 131,072 tokens, catalog llama3-70b stating Meta-Llama-3-70B's 8,192. Flavors 8B and 70B
    past 8192 read as catalog llama3.1-8b / -70b (:data:`meshplan.catalog.LONG_CONTEXT`: what the
    flavor is, 131072 positions, RoPE scaled), with ``max_position`` only past 131072 (nc59 #4):

    >>> notes = []
    >>> flavor_context({"catalog": "llama3-70b"}, {"model.flavor"}, 131072, notes)
    {'catalog': 'llama3.1-70b'}
    >>> flavor_context({"catalog": "llama3-70b"}, {"model.flavor"}, 262144, notes)
    {'catalog': 'llama3.1-70b', 'max_position': 262144}
    >>> flavor_context({"catalog": "llama3-70b"}, {"model.flavor"}, 8192, notes)
    {'catalog': 'llama3-70b'}

    A ``seq_len`` that is no whole number, or above ``max_position``'s bound (:data:`~meshplan.limits.BOUNDS`),
    is left to the config's check, which names ``training.seq_len`` (no traceback; no error on a
    ``model.max_position`` the user never wrote):

    >>> flavor_context({"catalog": "llama3-70b"}, {"model.flavor"}, "long", notes)
    {'catalog': 'llama3-70b'}
    >>> flavor_context({"catalog": "llama3-70b"}, {"model.flavor"}, 10**8, notes)
    {'catalog': 'llama3-70b'}
    """
    if "model.flavor" not in used or "model.hf_assets_path" in used:
        return table
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len > BOUNDS["max_position"].value:
        return table
    rows = catalog.model(table["catalog"]).max_position if "catalog" in table else table.get("max_position", 0)
    if not rows or seq_len <= rows:
        return table
    if table.get("catalog") in catalog.LONG_CONTEXT:  # the flavor is Llama 3.1: its catalog entry (nc59 #4)
        table = {"catalog": catalog.LONG_CONTEXT[table["catalog"]]}
        rows = catalog.model(table["catalog"]).max_position
        notes.append(f"model.catalog = {table['catalog']!r} (Llama 3.1: {rows} positions, RoPE scaled): training."
                     f"seq_len {seq_len} is past Llama 3's 8192, and torchtitan's llama3 flavors are Llama 3.1")
        if seq_len <= rows:
            return table
    notes.append(f"model.max_position = {seq_len} (training.seq_len; the model states {rows}): {CONTEXT_SOURCE}"
                 f"{_past_trained(table, seq_len)}")
    return table | {"max_position": seq_len}


def nearest(model: ModelSpec) -> tuple[tuple[str, str], list[str]]:
    """The mapped flavor with the fewest fields differing from ``model``, and those fields
    (ties: the first in :func:`shipped`'s order).

    >>> nearest(catalog.model("deepseek-v2-lite").model_copy(update={"layers": 26}))
    (('deepseek_v3', '16B'), ['layers 26 (27)'])
    """
    key = min(shipped(), key=lambda k: len(differing(model, k)))
    return key, differing(model, key)


def flavor_refusal(model: ModelSpec) -> str:
    """Why a torchtitan file cannot name ``model`` (a model of no mapped flavor): the flavors
    it knows, the nearest with the fields that differ, and the fix.

    >>> print(flavor_refusal(catalog.model("deepseek-v2-lite").model_copy(update={"layers": 26, "name": "x"})))
    torchtitan knows models by flavor (llama3 8B, 70B, 405B; deepseek_v3 16B, 236B, 671B; qwen3 30B-A3B, 235B-A22B); model 'x' is none of them: nearest deepseek_v3 16B, which differs in layers 26 (27)
    """
    names: dict[str, list[str]] = {}
    for n, f in shipped():
        names.setdefault(n, []).append(f)
    known = "; ".join(f"{n} {', '.join(fs)}" for n, fs in names.items())
    (n, f), diff = nearest(model)
    shown = ", ".join(diff[:6]) + (f" and {len(diff) - 6} more" if len(diff) > 6 else "")
    return (f"torchtitan knows models by flavor ({known}); model {model.name!r} is none of them: nearest {n} {f}, "
            f"which differs in {shown}")


def read_model(d: dict, base: Path, opts: ImportOptions, notes: list[str],
               custom: Mapping[tuple[str, str], dict] = {}) -> tuple[dict, set[str]]:
    """[model] table of a torchtitan job's ``d`` and the model keys it consumed: ``--model`` first,
    then a mapped flavor (:func:`flavor_table`), then a flavor of ``custom`` ((name, flavor) -> [model]
    table: the llama3 flavors the ``.py`` beside the job file registers,
    :func:`~meshplan.interop.torchtitan_custom.sibling_flavors`), then ``model.hf_assets_path``'s
    config.json (``base``: the job file's folder); else a ConfigError naming model.name or model.flavor."""
    m = d.get("model", {})
    if opts.model:
        return model_option(opts.model), set()
    name, flavor = m.get("name", "llama3"), m.get("flavor", "debugmodel")
    table = flavor_table(name, flavor)
    if table is None and (name, flavor) in custom:
        table = custom_table(flavor, custom[name, flavor])
        notes.append(f"model {name} flavor {flavor!r} read from {table['source']}")
    if table is not None:
        return table, {"model.name", "model.flavor"}
    hf = m.get("hf_assets_path")
    if isinstance(hf, str):
        p = Path(hf) if Path(hf).is_absolute() else base / hf
        if (p / "config.json").is_file():
            notes.append(f"model {name} flavor {flavor!r} is not in the catalog: read {p / 'config.json'}")
            return {"hf_config": str((p / "config.json").resolve())}, {"model.name", "model.flavor",
                                                                       "model.hf_assets_path"}
    names = list(dict.fromkeys(n for n, _ in shipped()))
    if name not in names:
        raise ConfigError("model.name", f"torchtitan model {name!r} is not one meshplan knows by name (supported: "
                          f"{', '.join(names)}) and model.hf_assets_path has no config.json; give one of those "
                          f"names with its flavor, model.hf_assets_path with the model's config.json, --model "
                          f"CATALOG_NAME or --model path/config.json")
    flavors = [f for n, f in shipped() if n == name]
    raise ConfigError("model.flavor", f"torchtitan model {name!r} flavor {flavor!r} is not one meshplan maps "
                      f"({name} {', '.join(flavors)}) and model.hf_assets_path has no config.json; "
                      f"{did_you_mean(flavor, flavors) and did_you_mean(flavor, flavors) + 'else '}give --model CATALOG_NAME or "
                      f"--model path/config.json")


def custom_table(flavor: str, table: dict) -> dict:
    """The [model] table of a llama3 flavor read from the ``.py`` beside a job TOML
    (:func:`~meshplan.interop.torchtitan_custom.sibling_flavors`; its ``source`` names that file),
    checked as a model now: sizes no model has (``dim`` 64 over ``n_heads`` 128: head size 0) are a
    ConfigError naming ``model.flavor`` and that file, not a [model] field the user never wrote."""
    try:
        build(ModelSpec, dict(table), "model")
    except ConfigError as e:
        where = str(table.get("source", "")).split(": ", 1)[0]
        raise ConfigError("model.flavor", f"{flavor!r}, registered by {where}, is no model meshplan plans "
                          f"({e}): fix its TransformerModelArgs there") from None
    return dict(table)

