"""What the foreign readers share: the options that fill what a foreign file does not say,
the result of a reading (meshplan tables, unused fields, notes), and small helpers.

>>> flatten({"a": {"b": 1, "c": {"d": 2}}, "e": 3})
{'a.b': 1, 'a.c.d': 2, 'e': 3}

A field of a foreign file that meshplan does not read is listed, never refused, unless it is
a near miss of one it reads: :mod:`meshplan.interop.typos` holds that check.
"""

from __future__ import annotations

import json

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from meshplan import catalog
from meshplan.errors import ConfigError
from meshplan.limits import MAX_WORLD
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.hf import model_from_hf_config
from meshplan.spec.model import ModelSpec

FORMATS = ("meshplan", "torchtitan", "megatron", "deepspeed")


@dataclass(frozen=True)
class ImportOptions:
    """What a foreign file may not say. ``cluster``: a catalog node (``dgx-h100``), or a
    resolved cluster the catalog does not hold (a ``[cluster]`` written inline), which the
    reader takes whole, ``nodes`` and ``gpu`` then unused: no command-line option gives one,
    an export's round trip does (:func:`meshplan.interop.export.reimport_options`);
    ``nodes``: how many; ``gpu``: optional catalog GPU replacing the node's; ``model``: a
    catalog model name or a Hugging Face ``config.json`` path (overrides the file's model);
    ``seq_len``: tokens per sequence (DeepSpeed configs do not hold it; for the others it
    replaces the file's, with a note); ``micro_batch``, ``grad_accum``: what the HF Trainer fills a
    DeepSpeed JSON's batch ``"auto"`` with (:func:`meshplan.interop.deepspeed_auto.fill_batch`);
    ``dtype``: the HF Trainer's ``--bf16`` (``bf16``), ``--fp16`` (``fp16``) or neither (``fp32``),
    what it fills ``bf16.enabled`` / ``fp16.enabled`` ``"auto"`` with
    (:func:`meshplan.interop.deepspeed_auto.fill_dtype`); ``gradient_checkpointing``: the HF Trainer's
    ``--gradient_checkpointing`` (True: every decoder layer checkpointed, recompute ``full``;
    None: not given, the Trainer's default off), which no DeepSpeed key says
    (:func:`meshplan.interop.deepspeed.hf_recompute`); ``job_config``: the function of a torchtitan
    ``config_registry.py`` to read, torchtitan's own ``--config`` (None: the file's only one;
    :mod:`meshplan.interop.torchtitan_pyjob`). These numbers are checked here, their one home: a ConfigError naming the option when not a
    whole number >= 1."""

    cluster: Optional[str | ClusterSpec] = None
    nodes: Optional[int] = None
    gpu: Optional[str] = None
    model: Optional[str] = None
    seq_len: Optional[int] = None
    micro_batch: Optional[int] = None
    grad_accum: Optional[int] = None
    dtype: Optional[str] = None
    gradient_checkpointing: Optional[bool] = None
    job_config: Optional[str] = None

    def __post_init__(self) -> None:
        if self.dtype not in (None, "bf16", "fp16", "fp32"):
            raise ConfigError("--dtype", f"{self.dtype!r}: give bf16 (the HF Trainer's --bf16), fp16 (--fp16) or fp32 "
                              "(neither)")
        for name, v in (("--nodes", self.nodes), ("--seq-len", self.seq_len), ("--micro-batch", self.micro_batch),
                        ("--grad-accum", self.grad_accum)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(name, f"{v} must be a whole number >= 1")


@dataclass(frozen=True)
class Imported:
    """One foreign file read: ``tables`` (meshplan's [model], [cluster], [training], [mesh]),
    ``unused``: the file's fields meshplan does not use, by name (dotted for nested keys,
    ``--flag`` for Megatron-LM); ``notes``: decisions the reader made (defaults taken,
    approximations), one line each; ``model_keys``: the file's keys naming a model it reads
    through a Hugging Face config (:attr:`meshplan.config.Config.source_model`); ``said``: the
    file's own words for the settings it leaves for each mesh to resolve
    (:attr:`meshplan.config.Config.source_said`)."""

    fmt: str
    tables: dict[str, Any]
    unused: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)
    model_keys: tuple[tuple[str, str], ...] = ()
    said: tuple[tuple[str, str], ...] = ()

    def all_notes(self) -> tuple[str, ...]:
        """The notes, then one line naming the unused fields (when any)."""
        tail = (f"{self.fmt}: fields meshplan does not use: {', '.join(self.unused)}",) if self.unused else ()
        return tuple(f"{self.fmt}: {n}" for n in self.notes) + tail


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """Nested tables as dotted keys (module docstring)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _json(v: Any) -> str:
    """A value as JSON (``true``, ``"op"``), else its repr."""
    return json.dumps(v) if isinstance(v, (bool, int, float, str, list, type(None))) else repr(v)


def rewritten(user: dict, written: dict, show: Callable[[Any], str] = _json) -> list[str]:
    """``key A -> B`` for every key of the user's file ``user`` (a torchtitan job TOML, a
    DeepSpeed JSON, as parsed) that the export ``written`` (the same format's tables, as
    written) gives another value, ``key A -> dropped`` for one it does not write: what the
    header lists beside the plan's fields (values by ``show``, default JSON: ``true``, ``"op"``).

    >>> rewritten({"a": {"b": True, "c": -1, "d": "x"}}, {"a": {"b": False, "c": -1}})
    ['a.b true -> false', 'a.d "x" -> dropped']
    """
    u, w = flatten(user), flatten(written)
    return [f"{k} {show(v)} -> {show(w[k]) if k in w else 'dropped'}" for k, v in u.items()
            if k not in w or not _same(v, w[k])]


def _same(a: Any, b: Any) -> bool:
    """Equal values of one type; two strings that spell one number (Megatron-LM's ``1e-5`` and
    ``1e-05``) are the same.

    >>> _same("1e-5", "1e-05"), _same(1, True), _same("a", "a")
    (True, False, True)
    """
    if type(a) is type(b) and a == b:
        return True
    if isinstance(a, str) and isinstance(b, str):
        try:
            return float(a) == float(b)
        except ValueError:
            return False
    return False


def strip_keys(d: dict, drop: set[str], prefix: str = "") -> dict:
    """``d`` without the dotted keys in ``drop`` (a table emptied by it left out).

    >>> strip_keys({"a": {"b": 1, "c": 2}, "d": {"e": 3}}, {"a.b", "d.e"})
    {'a': {'c': 2}}
    """
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            sub = strip_keys(v, drop, f"{prefix}{k}.")
            if sub:
                out[k] = sub
        elif f"{prefix}{k}" not in drop:
            out[k] = v
    return out


def merge_tables(base: dict, top: dict) -> dict:
    """``base`` with ``top`` over it, table by table (``top`` wins a key both hold).

    >>> merge_tables({"a": {"b": 1, "c": 2}, "x": 0}, {"a": {"b": 5}})
    {'a': {'b': 5, 'c': 2}, 'x': 0}
    """
    out = dict(base)
    for k, v in top.items():
        out[k] = merge_tables(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def cluster_table(opts: ImportOptions, fmt: str, nodes: Optional[int] = None) -> tuple[dict, int]:
    """([cluster] table, world size) from ``--cluster``/``--nodes`` (``nodes`` from the file,
    e.g. a launch script's ``--nnodes``, when ``--nodes`` is not given). ConfigError naming
    the option (``--cluster``, ``--gpu``) when the node or GPU is not known. A resolved cluster
    (``opts.cluster`` a ClusterSpec: an inline one carried by export) is its every field, its own world."""
    if isinstance(opts.cluster, ClusterSpec):
        return opts.cluster.model_dump(mode="json"), opts.cluster.world
    if opts.cluster is None:
        raise ConfigError("--cluster", f"a {fmt} config does not say the cluster; give --cluster NODE --nodes N "
                          f"(catalog nodes: {', '.join(catalog.names('node'))})")
    n = opts.nodes if opts.nodes is not None else nodes
    if n is None:
        raise ConfigError("--nodes", f"a {fmt} config does not say how many nodes; give --nodes N")
    gpus = _named("--cluster", catalog.node, opts.cluster, "; or give a TOML file whose [cluster] writes the node "
                  "inline (--cluster node.toml)").gpus  # ConfigError naming the known nodes
    if opts.gpu:
        _named("--gpu", catalog.gpu, opts.gpu)
    if n * gpus > MAX_WORLD:
        raise ConfigError("--nodes" if opts.nodes is not None else "nodes", f"{n} nodes x {gpus} GPUs = {n * gpus:,} "
                          f"ranks is over the bound {MAX_WORLD:,} (meshplan's world bound); give fewer nodes")
    table = {"system": opts.cluster, "nodes": n} | ({"gpu": opts.gpu} if opts.gpu else {})
    return table, n * gpus


def _named(option: str, read, name: str, hint: str = ""):
    """``read(name)`` (a catalog reader), its unknown-name error under the ``option`` the user
    typed (``--cluster: unknown node 'dgx-h10'; did you mean 'dgx-h100'? known: ...``), ``hint`` after it."""
    try:
        return read(name)
    except ConfigError as e:
        raise ConfigError(option, e.message + hint) from None


def model_option(value: str) -> dict:
    """[model] table of ``--model``: a catalog name, or a path to a Hugging Face config.json
    (made absolute, so the written TOML works from any folder)."""
    if value in catalog.names("model"):
        return {"catalog": value}
    p = Path(value)
    if p.is_dir() and (p / "config.json").is_file():
        p = p / "config.json"
    if p.is_file():
        return {"hf_config": str(p.resolve())}
    raise ConfigError("--model", f"{value!r} is neither a catalog model ({', '.join(catalog.names('model'))}) nor "
                      f"a Hugging Face config.json path")


def catalog_model_name(model) -> Optional[str]:
    """The catalog name of ``model`` (a ModelSpec) when it is that catalog entry unchanged."""
    if model.name in catalog.names("model") and catalog.model(model.name) == model:
        return model.name
    return None


def seq_len_of(given: Optional[int], in_file: Any, key: str, where: str, notes: list[str],
               default: Optional[tuple[int, str]] = None) -> Any:
    """The sequence length an import plans, with the same notes from every format: ``--seq-len``
    (``given``) replaces the file's ``key`` (``in_file``, None when absent from ``where``), or
    stands where the file has none; without either, the framework's default (``default``: value,
    whose), said in a note, or, where the framework has none, a ConfigError naming ``key`` and
    ``--seq-len``.

    >>> notes = []; seq_len_of(4096, "8192", "--seq-length", "the arguments", notes), notes
    (4096, ['--seq-len 4096 replaces --seq-length 8192'])
    >>> notes = []; seq_len_of(4096, None, "--seq-length", "the arguments", notes), notes
    (4096, ['--seq-len 4096: --seq-length not in the arguments'])
    >>> notes = []; seq_len_of(None, None, "training.seq_len", "the job TOML", notes, (2048, "torchtitan's")), notes
    (2048, ["training.seq_len not in the job TOML: torchtitan's default 2048 planned; give --seq-len N for another"])
    >>> seq_len_of(None, None, "--seq-length", "the arguments", [])
    Traceback (most recent call last):
    meshplan.errors.ConfigError: --seq-length: not in the arguments; add it or give --seq-len
    """
    if given:
        notes.append(f"--seq-len {given} replaces {key} {in_file}" if in_file is not None else
                     f"--seq-len {given}: {key} not in {where}")
        return given
    if in_file is not None:
        return in_file
    if default is None:
        raise ConfigError(key, f"not in {where}; add it or give --seq-len")
    notes.append(f"{key} not in {where}: {default[1]} default {default[0]} planned; give --seq-len N for another")
    return default[0]


def positive_int(value: Any, field: str) -> int:
    """``value`` as an int >= 1, or a ConfigError naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(field, f"must be a whole number >= 1; got {value!r}")
    return value


def model_layers(table: dict) -> int:
    """Transformer layers of a [model] table (catalog name, HF config path or fields)."""
    if table.get("catalog"):
        return catalog.model(table["catalog"]).layers
    if table.get("hf_config"):
        return model_from_hf_config(Path(table["hf_config"])).layers
    return positive_int(table.get("layers"), "model.layers")


def table_model(table: dict) -> Optional[ModelSpec]:
    """The model of a [model] table naming a catalog entry or an HF config (None for a table
    of fields, which the reader does not build here)."""
    if table.get("catalog"):
        return catalog.model(table["catalog"])
    if table.get("hf_config"):
        return model_from_hf_config(Path(table["hf_config"]))
    return None


def model_is_mla(table: dict) -> bool:
    """Whether a [model] table (catalog name, HF config path or fields) has multi-head latent
    attention (a table of fields: its ``kv_lora_rank`` given)."""
    if table.get("catalog"):
        return catalog.model(table["catalog"]).is_mla
    if table.get("hf_config"):
        return model_from_hf_config(Path(table["hf_config"])).is_mla
    return table.get("kv_lora_rank") is not None


def model_is_moe(table: dict) -> bool:
    """Whether a [model] table (catalog name, HF config path or fields) has routed experts."""
    if table.get("catalog"):
        return catalog.model(table["catalog"]).is_moe
    if table.get("hf_config"):
        return model_from_hf_config(Path(table["hf_config"])).is_moe
    return bool(table.get("experts"))
