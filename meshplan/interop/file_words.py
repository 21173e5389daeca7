"""Errors, ``infeasible:`` reasons and ``fix:`` lines of a foreign config in its own keys (ttkeys
finding 2): the planner words them in meshplan's fields (``training.global_batch``, ``mesh.shape
[-1, 8]``, ``recompute full``), which a torchtitan job TOML, Megatron-LM arguments or a DeepSpeed
JSON do not have. :func:`file_words` rewrites a line for the format ``Config.origin`` names, from
each format's map of meshplan's fields to its keys (the readers' own: the torchtitan module's table
in :mod:`meshplan.interop.torchtitan`, Megatron-LM's flags in :mod:`meshplan.interop.megatron`,
DeepSpeed's keys in :mod:`meshplan.interop.deepspeed`); the mesh degrees' keys are
:data:`meshplan.interop.world_words.KEYS`, which the world-size error already speaks
(:func:`~meshplan.interop.world_words.foreign_world_error`).

What is rewritten, where the format has a key for it (a field it has none for keeps meshplan's name,
so that the line stays true):

- dotted fields: ``training.global_batch`` -> ``training.global_batch_size`` (torchtitan),
  ``--global-batch-size`` (Megatron-LM), ``train_batch_size`` (DeepSpeed); the micro-batch to
  torchtitan's ``training.local_batch_size`` at pp 1 and ``parallelism.pipeline_parallel_microbatch_size``
  with pp (its reader's mapping), ...;
- the batch's names bare (:data:`BARE`), as the batch rule and the memory fix write them
  (``micro_batch 1 x dp 512``, ``global_batch / micro_batch 2``), to the key
  (``training.local_batch_size 1``);
- a setting of a fix or a ``hint:`` line (``recompute full``, ``training.reshard_after_forward = false``,
  ``mesh.pp_schedule = "interleaved_1f1b"``) as the key and value to write (``activation_checkpoint.mode
  = "full"``, ``parallelism.fsdp_reshard_after_forward = "never"``, ``"Interleaved1F1B"``;
  ``--recompute-granularity full``; ``sharding zero3`` as the Megatron FSDP flags that
  ``export --to megatron`` writes for it, :func:`~meshplan.interop.megatron_write.sharding_flags`);
- ``mesh.shape [...]`` as the degrees it changes against the config's mesh
  (``parallelism.expert_parallel_degree = 8``, ``--expert-model-parallel-size 8``);
- in the ``fix:`` part of a line, a mesh axis followed by its degree (``tp 4``, ``tp x2``) as the
  format's degree key (``tensor_parallel_degree 4``; Megatron-LM's flag), where it has one (a
  reason's ``tp 3`` stays: the field's term for the axis, not a setting).
"""

from __future__ import annotations

import re
from typing import Callable

from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.interop.megatron_write import sharding_flags
from meshplan.interop.torchtitan_tables import SCHEDULE_NAMES
from meshplan.interop.world_words import KEYS

#: meshplan field -> the format's key (None: the format has none; the line keeps meshplan's name).
#: ``training.micro_batch`` of torchtitan depends on pp (:func:`_fields`).
FIELDS: dict[str, dict[str, str]] = {
    "torchtitan": {"training.global_batch": "training.global_batch_size", "training.seq_len": "training.seq_len",
                   "training.recompute": "activation_checkpoint.mode",
                   "training.reshard_after_forward": "parallelism.fsdp_reshard_after_forward",
                   "training.tp_comm_overlap": "parallelism.enable_async_tensor_parallel",
                   "training.torch_compile": "compile.enable", "training.grad_clip_norm": "training.max_norm",
                   "mesh.pp_schedule": "parallelism.pipeline_parallel_schedule",
                   "mesh.pp_layer_split": "parallelism.module_fqns_per_model_part", "cluster.nodes": "--nodes"},
    "megatron": {"training.global_batch": "--global-batch-size", "training.micro_batch": "--micro-batch-size",
                 "training.seq_len": "--seq-length", "training.recompute": "--recompute-granularity",
                 "mesh.sequence_parallel": "--sequence-parallel", "cluster.nodes": "--nodes"},
    "deepspeed": {"training.global_batch": "train_batch_size", "training.micro_batch": "train_micro_batch_size_per_gpu",
                  "training.seq_len": "--seq-len", "cluster.nodes": "--nodes"},
}
#: A fix's setting (meshplan's words) -> the format's, per format: what to write for it.
SETTINGS: dict[str, dict[str, str]] = {
    "torchtitan": {"recompute full": "activation_checkpoint.mode = \"full\"",
                   "recompute none": "activation_checkpoint.mode = \"none\"",
                   "reshard_after_forward true": "parallelism.fsdp_reshard_after_forward = \"always\"",
                   "training.reshard_after_forward = true": "parallelism.fsdp_reshard_after_forward = \"always\"",
                   "training.reshard_after_forward = false": "parallelism.fsdp_reshard_after_forward = \"never\""}
    | {f"mesh.pp_schedule = \"{ours}\"": f"parallelism.pipeline_parallel_schedule = \"{theirs}\""
       for ours, theirs in SCHEDULE_NAMES.items()},
    "megatron": {"recompute full": "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
                 # what ``export --to megatron`` writes for zero3: Megatron FSDP's flags (megatron_write)
                 "sharding zero3": " ".join(sharding_flags("zero3")),
                 "[mesh] sequence_parallel = true (--sequence-parallel)": "--sequence-parallel"},
    "deepspeed": {"recompute full": "an activation_checkpointing section (deepspeed.checkpointing on every block)"},
}


#: The fields the batch rule and the memory fix write bare, without their table.
BARE = ("global_batch", "micro_batch")


def _fields(cfg: Config) -> dict[str, str]:
    """:data:`FIELDS` of ``cfg.origin``, torchtitan's micro-batch key by its pp (the reader's
    mapping: ``local_batch_size`` at pp 1, ``pipeline_parallel_microbatch_size`` with pp)."""
    out = dict(FIELDS.get(cfg.origin, {}))
    if cfg.origin == "torchtitan":
        pp = dict(zip(cfg.mesh.names or [], cfg.mesh.shape or [])).get("pp", 1) if cfg.mesh is not None else 1
        out["training.micro_batch"] = "parallelism.pipeline_parallel_microbatch_size" if pp > 1 else \
            "training.local_batch_size"
    return out


def _sub(pattern: str, text: str, repl: Callable[[re.Match], str]) -> str:
    return re.sub(pattern, repl, text)


def _put(pattern: str, text: str, words: str) -> str:
    """``text`` with every match of ``pattern`` replaced by ``words`` as they are (no group
    references)."""
    return re.sub(pattern, lambda _: words, text)


def _shape(cfg: Config, m: re.Match) -> str:
    """``mesh.shape [...]`` as the format's keys of the degrees that differ from ``cfg``'s mesh."""
    keys, spec = KEYS.get(cfg.origin, {}), cfg.mesh
    try:
        shape = [int(x) for x in m.group(1).split(",")]
    except ValueError:
        return m.group(0)
    if spec is None or spec.names is None or spec.shape is None or len(shape) != len(spec.names):
        return m.group(0)
    changed = [(n, d) for n, d, old in zip(spec.names, shape, spec.shape) if d != old]
    if not changed or any(n not in keys for n, _ in changed):
        return m.group(0)
    sep = " " if cfg.origin == "megatron" else " = "
    return ", ".join(f"{keys[n]}{sep}{d}" for n, d in changed)


def file_words(cfg: Config, text: str) -> str:
    """``text`` (an error message, an ``infeasible:`` reason, a ``fix:`` line) in the keys of the
    format ``cfg`` was read from (module docstring); unchanged for a meshplan TOML.

    >>> from meshplan.config import config_from_dict
    >>> from dataclasses import replace
    >>> cfg = replace(config_from_dict({"model": {"catalog": "mixtral-8x7b"}, "cluster": {"system": "dgx-h100",
    ...     "nodes": 4}, "training": {"global_batch": 64, "seq_len": 4096}, "mesh": {"names": ["dp_shard", "ep"],
    ...     "shape": [-1, 16]}}), origin="torchtitan")
    >>> print(file_words(cfg, "training.global_batch: 256 is not divisible by micro_batch 1 x dp 512 = 512"))
    training.global_batch_size: 256 is not divisible by training.local_batch_size 1 x dp 512 = 512
    >>> print(file_words(cfg, "fix: ep 8 (mesh.shape [-1, 8]: 1 expert per ep rank); recompute full -> peak 9 GiB"))
    fix: parallelism.expert_parallel_degree = 8 (1 expert per ep rank); activation_checkpoint.mode = "full" -> peak 9 GiB
    >>> print(file_words(replace(cfg, origin="megatron"), "fix: ep 8 (mesh.shape [-1, 8]); recompute full"))
    fix: --expert-model-parallel-size 8; --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
    """
    if cfg.origin not in FIELDS:
        return text
    fields, keys = _fields(cfg), KEYS[cfg.origin]
    text = _sub(r"mesh\.shape \[([-\d, ]+)\]", text, lambda m: _shape(cfg, m))
    for meshplan_words, words in SETTINGS[cfg.origin].items():
        text = _put(rf"(?<![\w.\-]){re.escape(meshplan_words)}(?![\w.])", text, words)
    for field, key in fields.items():  # dotted first, then the bare name
        text = _put(rf"(?<![\w.\-]){re.escape(field)}(?![\w])", text, key)
    for bare in BARE:  # "micro_batch 1 x dp 512", "global_batch / micro_batch 2"
        if f"training.{bare}" in fields:
            text = _put(rf"(?<![\w.\-]){bare}(?![\w'])", text, fields[f"training.{bare}"])
    head, mark, fix = text.partition("fix: ")  # degrees as settings: in the fix only ("tp 3" of a reason stays)
    short = {a: k.removeprefix("parallelism.") for a, k in keys.items()}
    fix = _sub(r"(?<![\w.\-])(pp|dp_replicate|dp_shard|cp|tp|ep|etp)(?= (?:\d|x\d))", fix,
               lambda m: short.get(m.group(1), m.group(1)))
    return head + mark + _once(fix)


def _once(fix: str) -> str:
    """``fix`` with a degree named twice, as the key and then as the setting that opens its
    parenthesis (``ep 2 (mesh.shape [4, 2]: ...)`` rewritten), said once as the setting
    (newcomer trial 21 #2).

    >>> _once("--expert-model-parallel-size 2 (--expert-model-parallel-size 2: 4 experts per ep rank)")
    '--expert-model-parallel-size 2 (4 experts per ep rank)'
    >>> _once("expert_parallel_degree 2 (parallelism.expert_parallel_degree = 2: 4 experts); or tp 2 (tp 2)")
    'parallelism.expert_parallel_degree = 2 (4 experts); or tp 2'
    """
    return _sub(r"(?<![\w.\-])(\S+) (\d+) \(((?:parallelism\.)?\1(?: = | )\2)(: |\))", fix,
                lambda m: m.group(3) + (" (" if m.group(4) == ": " else ""))


def file_error(cfg: Config, e: ConfigError) -> ConfigError:
    """``e`` with its field and message in the keys of the format ``cfg`` was read from
    (:func:`file_words`); ``e`` itself for a meshplan TOML."""
    if cfg.origin not in FIELDS:
        return e
    field = _fields(cfg).get(e.field, e.field)
    return ConfigError(field, file_words(cfg, e.message))
