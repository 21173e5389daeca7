"""Import a Hugging Face ``config.json`` as a :class:`ModelSpec`.

The supported ``model_type`` families and the keys each reads are
:mod:`meshplan.spec.hf_families`' (:data:`SUPPORTED_MODEL_TYPES`).

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
import re
from pathlib import Path
from typing import Any, Optional, Union

from pydantic import ValidationError

from meshplan.errors import ConfigError, printable
from meshplan.fileread import parse_json, read_text_limited
from meshplan.limits import FILE_BYTES, MAX_STRING, bound_message
from meshplan.spec.hf_families import FAMILIES, SUPPORTED_MODEL_TYPES, Keys
from meshplan.spec.model import ModelSpec
from meshplan.spec.names import safe_name


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
#: ``_compute_llama3_parameters``) -> :class:`~meshplan.spec.rope.RopeScaling` fields.
LLAMA3_SCALING = {"factor": "factor", "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
                  "original_max_position_embeddings": "original_max_position"}


def _rope_scaling(cfg: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """``rope_scaling`` of a RoPE model's config when it is Llama 3.1's (``rope_type``, or the
    older ``type``, "llama3": meta-llama/Llama-3.1-8B's config.json has factor 8.0,
    low_freq_factor 1.0, high_freq_factor 4.0, original_max_position_embeddings 8192), as
    :class:`~meshplan.spec.rope.RopeScaling` fields; absent or null: nothing. Another type
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

    ``name`` defaults to :func:`_default_name`'s (the config's ``_name_or_path``, the folder's
    name when it names a model, ``architectures[0]`` and the size, ``hf-<model_type>``). Raises :class:`ConfigError` for an unsupported ``model_type``
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
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ConfigError("model_type", f"unsupported model_type {model_type!r:.60}; "
                          f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    try:
        fields = family(Keys(cfg))
        fields |= _carried(cfg, fields) | _rope_scaling(cfg, fields)
    except ConfigError as e:  # the key is named; the file too, when there is one
        raise e if path is None else _in_file(e, path, model_type) from None
    notes = fields.pop("_notes", [])
    fields["name"] = name if name is not None else f"hf-{model_type}"  # a name the caller chose is checked
    fields["source"] = printable(f"Hugging Face config.json (model_type {model_type}) from {origin}" + (
        "; not modelled: " + "; ".join(notes) if notes else ""))
    try:
        spec = ModelSpec(**fields)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "config"
        raise ConfigError(where, f"{bound_message(first) or first['msg']} (imported from {origin})") from None
    return spec if name is not None else spec.model_copy(update={"name": _default_name(cfg, path, spec)})


def _in_file(e: ConfigError, path: Path, model_type: str) -> ConfigError:
    """``e`` (naming a key of the config) with the file it is in: ``the llama config.json`` becomes
    the path, else the path follows the message.

    >>> str(_in_file(ConfigError("num_hidden_layers", "missing from the llama config.json; it is required"),
    ...              Path("jobs/config.json"), "llama"))
    'num_hidden_layers: missing from jobs/config.json (model_type llama); it is required'
    """
    phrase = f"the {model_type} config.json"
    if phrase in e.message:
        return ConfigError(e.field, e.message.replace(phrase, f"{path} (model_type {model_type})", 1))
    return ConfigError(e.field, f"{e.message} (in {path})")


#: A size in a model's name: ``8b``, ``0.5b``, ``160m``, ``8x7b`` (the parameters, in billions or millions).
_SIZE = re.compile(r"(?<![a-z0-9.])(\d+x)?\d+(\.\d+)?[bm](?![a-z])")


def _default_name(cfg: dict[str, Any], path: Optional[Path], spec: ModelSpec) -> str:
    """The model's name when the caller gives none, the first of: the config's ``_name_or_path``
    (what transformers' ``save_pretrained`` writes); the folder holding the config.json when it
    names a model (its name holds the ``model_type``, its first ``_`` part, or a size: ``llama-3.1-8b``,
    ``pythia-160m``), not a generic one (``jobs``, ``config``, a hub snapshot's hash); the
    config's ``architectures[0]`` and the size (``LlamaForCausalLM-8.0B``); ``hf-<model_type>``.
    Made safe by :func:`~meshplan.spec.names.safe_name`.

    >>> spec = model_from_hf_config({"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12,
    ...     "n_positions": 1024, "vocab_size": 50257, "architectures": ["GPT2LMHeadModel"]})
    >>> [_default_name(spec_cfg, Path(f"/x/{d}/config.json"), spec) for d, spec_cfg in
    ...  (("jobs", {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}),
    ...   ("gpt2-small", {"model_type": "gpt2"}), ("jobs", {"model_type": "gpt2"}))]
    ['GPT2LMHeadModel-124M', 'gpt2-small', 'hf-gpt2']
    """
    model_type = str(cfg.get("model_type"))
    given = cfg.get("_name_or_path")
    if isinstance(given, str) and given and len(given) <= MAX_STRING and given.isprintable():
        return safe_name(given, f"hf-{model_type}")
    folder = path.parent.name if path else ""
    flat = re.sub(r"[^a-z0-9]", "", folder.lower())
    kinds = {re.sub(r"[^a-z0-9]", "", k) for k in (model_type.lower(), model_type.lower().split("_")[0])}
    if folder and (any(k and k in flat for k in kinds) or _SIZE.search(folder.lower())):
        return safe_name(folder, f"hf-{model_type}")
    arch = cfg.get("architectures")
    if isinstance(arch, list) and arch and isinstance(arch[0], str) and arch[0].isidentifier() and len(arch[0]) <= 64:
        n = spec.param_count()
        return safe_name(f"{arch[0]}-{n / 1e9:.1f}B" if n >= 1e9 else f"{arch[0]}-{n / 1e6:.0f}M", f"hf-{model_type}")
    return f"hf-{model_type}"


def hf_source(source: str) -> tuple[str, str] | None:
    """(model_type, origin) of a model built by :func:`model_from_hf_config` from its
    ``ModelSpec.source`` (the line that function writes: ``Hugging Face config.json (model_type T)
    from ORIGIN``, ORIGIN the file's path or "a config dict"); None for any other model.

    >>> hf_source("Hugging Face config.json (model_type mixtral) from /m/config.json; not modelled: x")
    ('mixtral', '/m/config.json')
    >>> hf_source("catalog") is None
    True
    """
    head = "Hugging Face config.json (model_type "
    if not source.startswith(head) or ") from " not in source:
        return None
    model_type, _, rest = source[len(head):].partition(") from ")
    return model_type, rest.split("; not modelled: ")[0]


def not_a_job(path: Path, cfg: Any) -> Optional[ConfigError]:
    """The error for a Hugging Face model ``config.json`` given where a job config goes (it has
    ``model_type`` or ``architectures``; newcomer trial 21 #5): where it belongs, ``[model]
    hf_config`` in a meshplan TOML or ``--model`` beside a foreign job. None for another JSON.

    The TOML's ``hf_config`` is the file's absolute path (a relative one is read from the TOML's
    folder), ``--model`` the path as given (read from the working directory).

    >>> print(not_a_job(Path("/jobs/dsv3/config.json"), {"model_type": "deepseek_v3"}))
    config: /jobs/dsv3/config.json is a Hugging Face model config.json (model_type deepseek_v3), not a training job: put it in a meshplan TOML as [model] hf_config = "/jobs/dsv3/config.json", or give it as --model /jobs/dsv3/config.json beside a torchtitan, Megatron-LM or DeepSpeed config
    """
    if not isinstance(cfg, dict) or not ({"model_type", "architectures"} & set(cfg)):
        return None
    kind = cfg.get("model_type")
    shown = f" (model_type {printable(kind)[:40]})" if isinstance(kind, str) else ""
    return ConfigError("config", f"{path} is a Hugging Face model config.json{shown}, not a training job: put it "
                       f"in a meshplan TOML as [model] hf_config = \"{path.resolve()}\", or give it as --model {path} beside "
                       f"a torchtitan, Megatron-LM or DeepSpeed config")
