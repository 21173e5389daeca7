"""Errors, ``infeasible:`` reasons and ``fix:`` lines of a foreign config in its own keys (ttkeys
finding 2): the planner words them in meshplan's fields (``training.global_batch``, ``mesh.shape
[-1, 8]``, ``recompute full``), which a torchtitan job TOML, Megatron-LM arguments or a DeepSpeed
JSON do not have. A builder that takes the format's :class:`~meshplan.keymap.KeyMap`
(:func:`meshplan.interop.keymaps.keymap_of`) prints the file's keys itself (the memory fix,
:func:`meshplan.plan_fix.memory_fix`, and the split, vpp and heads fixes of
:mod:`meshplan.plan_fix_rules`); :func:`file_words` rewrites the other lines (the plan's reasons,
the errors, the experts fix, whose refusals quote reasons, and the step's ``hint:`` lines, whose
outcomes do) for the format ``Config.origin`` names, from the same map
(:mod:`meshplan.interop.keymaps`, its mesh changes by :meth:`~meshplan.keymap.KeyMap.mesh_change`);
the mesh degrees' keys are :data:`meshplan.interop.world_words.KEYS`, which the world-size error
already speaks (:func:`~meshplan.interop.world_words.foreign_world_error`).

What is rewritten, where the format has a key for it (a field it has none for keeps meshplan's name,
so that the line stays true):

- dotted fields: ``training.global_batch`` -> ``training.global_batch_size`` (torchtitan),
  ``--global-batch-size`` (Megatron-LM), ``train_batch_size`` (DeepSpeed); the micro-batch to
  torchtitan's ``training.local_batch_size`` at pp 1 and ``parallelism.pipeline_parallel_microbatch_size``
  with pp (its reader's mapping), ...;
- the batch's names bare (:data:`BARE`), as the batch rule and the memory fix write them
  (``micro_batch 1 x dp 512``, ``global_batch / micro_batch 2``), to the key
  (``training.local_batch_size 1``); where the file counts the batch in other units (a b5bcd76
  torchtitan registry's tokens, :meth:`~meshplan.keymap.KeyMap.amount`) a count beside the name
  as well (``training.num_tokens_per_microbatch_per_dp_rank 16384 (2 x 8192)``);
- a setting of a fix or a ``hint:`` line (``recompute full``, ``training.reshard_after_forward = false``,
  ``mesh.pp_schedule = "interleaved_1f1b"``) as the key and value to write (``activation_checkpoint.mode
  = "full"``, ``parallelism.fsdp_reshard_after_forward = "never"``, ``"Interleaved1F1B"``;
  ``--recompute-granularity full``; ``sharding zero3`` as the Megatron FSDP flags that
  ``export --to megatron`` writes for it, :func:`~meshplan.interop.megatron_write.sharding_flags`);
- a pipeline split, ``mesh.pp_layer_split [...]`` of layers per stage, as torchtitan sets one: its module
  names per model part, or the first/last-stage counts its own cut takes
  (:func:`~meshplan.interop.torchtitan_split.split_setting`);
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
from meshplan.interop.keymaps import FIX_AXES, KEYMAPS, keymap_of
from meshplan.keymap import KeyMap

#: The fields the batch rule and the memory fix write bare, without their table.
BARE = ("global_batch", "micro_batch")


def _fields(cfg: Config) -> dict[str, str]:
    """:data:`~meshplan.interop.keymaps.FIELDS` of ``cfg.origin``, torchtitan's micro-batch key by
    its pp (:func:`~meshplan.interop.keymaps.keymap_of`)."""
    return dict(keymap_of(cfg).fields)


def _sub(pattern: str, text: str, repl: Callable[[re.Match], str]) -> str:
    return re.sub(pattern, repl, text)


def _put(pattern: str, text: str, words: str) -> str:
    """``text`` with every match of ``pattern`` replaced by ``words`` as they are (no group
    references)."""
    return re.sub(pattern, lambda _: words, text)


def _amount(keymap: KeyMap, bare: str) -> Callable[[re.Match], str]:
    """The rewrite of ``<bare> N`` as the file counts it (:meth:`~meshplan.keymap.KeyMap.amount`)."""
    return lambda m: keymap.amount(bare, int(m.group(1)))


def _shape(cfg: Config, keymap: KeyMap, m: re.Match) -> str:
    """``mesh.shape [...]`` as the format's keys of the degrees that differ from ``cfg``'s mesh
    (:meth:`~meshplan.keymap.KeyMap.mesh_change`)."""
    spec = cfg.mesh
    try:
        shape = [int(x) for x in m.group(1).split(",")]
    except ValueError:
        return m.group(0)
    if spec is None or spec.names is None or spec.shape is None or len(shape) != len(spec.names):
        return m.group(0)
    return keymap.mesh_change(spec.names, spec.shape, shape) or m.group(0)


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
    if cfg.origin not in KEYMAPS:
        return text
    keymap = keymap_of(cfg)
    fields = dict(keymap.fields)
    text = _sub(r"mesh\.shape \[([-\d, ]+)\]", text, lambda m: _shape(cfg, keymap, m))
    text = _splits(cfg, keymap, text) if keymap.splits is not None else text
    for meshplan_words, words in keymap.settings.items():
        text = _put(rf"(?<![\w.\-]){re.escape(meshplan_words)}(?![\w.])", text, words)
    for bare in BARE:  # a count in the file's units (a b5bcd76 registry's tokens): "micro_batch 2" -> its amount
        if f"training.{bare}" in keymap.units:
            text = _sub(rf"(?<![\w.\-])(?:training\.)?{bare} (\d+)(?![\w.])", text, _amount(keymap, bare))
    for field, key in fields.items():  # dotted first, then the bare name
        text = _put(rf"(?<![\w.\-]){re.escape(field)}(?![\w])", text, key)
    for bare in BARE:  # "micro_batch 1 x dp 512", "global_batch / micro_batch 2"
        if f"training.{bare}" in fields:
            text = _put(rf"(?<![\w.\-]){bare}(?![\w'])", text, fields[f"training.{bare}"])
    head, mark, fix = text.partition("fix: ")  # degrees as settings: in the fix only ("tp 3" of a reason stays)
    fix = _sub(rf"(?<![\w.\-])({'|'.join(FIX_AXES)})(?= (?:\d|x\d))", fix,
               lambda m: keymap.axis(m.group(1)))
    return head + mark + _once(fix)


#: A split the fix lines give in meshplan's words, with their torchtitan remark (plan_fix_rules), and bare.
_SPLIT_FIX = (r"mesh\.pp_layer_split = \[([\d, ]+)\] \(torchtitan's module_fqns_per_model_part, which export "
              r"--to torchtitan writes\)")
_SPLIT_VPP = (r"mesh\.pp_layer_split = \[([\d, ]+)\] with vpp (\d+) kept \((chunks of \d+ and \d+ layers); "
              r"torchtitan's module_fqns_per_model_part\)")
_SPLIT = r"mesh\.pp_layer_split(?: =)? \[([\d, ]+)\]"


def _splits(cfg: Config, keymap: KeyMap, text: str) -> str:
    """``mesh.pp_layer_split [..]`` (layers per stage) as the file sets the split
    (:meth:`~meshplan.keymap.KeyMap.split_setting`: torchtitan's module names per model part, or its own
    cut's counts; newcomer trial nc58 #3b), the counts kept in words; the chunks a stage are the line's
    ``mesh.virtual_stages = N``, else the config's."""
    named = re.search(r"mesh\.virtual_stages = (\d+)", text)
    v = int(named.group(1)) if named else (cfg.mesh.virtual_stages if cfg.mesh is not None else 1)
    split = lambda g: [int(x) for x in g.split(",")]
    text = _sub(_SPLIT_FIX, text, lambda m: f"{keymap.split_setting(split(m.group(1)), v)} (layers per stage "
                f"[{m.group(1)}])")
    text = _sub(_SPLIT_VPP, text, lambda m: f"{keymap.split_setting(split(m.group(1)), int(m.group(2)))} with vpp "
                f"{m.group(2)} kept (layers per stage [{m.group(1)}]; {m.group(3)})")
    return _sub(_SPLIT, text, lambda m: f"{keymap.split_setting(split(m.group(1)), v)} (layers per stage "
                f"[{m.group(1)}])")


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
    if cfg.origin not in KEYMAPS:
        return e
    field = _fields(cfg).get(e.field, e.field)
    return ConfigError(field, file_words(cfg, e.message))
