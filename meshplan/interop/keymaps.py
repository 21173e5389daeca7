"""Each foreign format's :class:`~meshplan.keymap.KeyMap`, its one home: the keys a torchtitan job
TOML, Megatron-LM arguments and a DeepSpeed JSON have for meshplan's fields, settings and mesh
degrees (the readers' own mapping read backwards: the torchtitan module's table in
:mod:`meshplan.interop.torchtitan`, Megatron-LM's flags in :mod:`meshplan.interop.megatron`,
DeepSpeed's keys in :mod:`meshplan.interop.deepspeed`; the degrees' keys are
:data:`meshplan.interop.world_words.KEYS`). :func:`keymap_of` gives a config's map, which the
builders of ``fix:`` lines take (:func:`meshplan.plan_fix.memory_fix`,
:func:`meshplan.plan_fix_rules.split_fix`, ``vpp_fix`` and ``heads_fix``) and which
:func:`meshplan.interop.file_words.file_words` applies to the lines not yet built with one.

>>> from dataclasses import replace
>>> from meshplan.config import config_from_dict
>>> cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
...     "training": {"global_batch": 64, "seq_len": 4096}, "mesh": {"names": ["pp", "dp_shard"], "shape": [2, -1]}})
>>> k = keymap_of(replace(cfg, origin="torchtitan"))
>>> k.bare("micro_batch"), k.axis("tp"), k.setting("recompute full")
('parallelism.pipeline_parallel_microbatch_size', 'tensor_parallel_degree', 'activation_checkpoint.mode = "full"')
>>> keymap_of(replace(cfg, origin="megatron")).axis("tp"), keymap_of(cfg).axis("tp")
('--tensor-model-parallel-size', 'tp')
>>> tok = keymap_of(replace(cfg, origin="torchtitan", training=cfg.training.model_copy(
...     update={"op_sac_policy": "b5bcd76"})))
>>> tok.amount("micro_batch", 1), tok.field("training.global_batch")
('training.num_tokens_per_microbatch_per_dp_rank 4096 (1 x 4096)', 'training.num_tokens_per_train_step')
"""

from __future__ import annotations

from dataclasses import replace

from meshplan.config import Config
from meshplan.interop.deepspeed_zeropp import ZEROPP_KEYS
from meshplan.interop.megatron_write import sharding_flags
from meshplan.interop.torchtitan_split import split_setting
from meshplan.interop.torchtitan_tables import V_SCHEDULES
from meshplan.interop.torchtitan_tables import SCHEDULE_NAMES
from meshplan.interop.world_words import KEYS
from meshplan.keymap import OWN, KeyMap

#: DeepSpeed ZeRO++'s ``[training]`` fields -> their key in a DeepSpeed JSON, which a DeepSpeed config
#: and Megatron-DeepSpeed's ``--deepspeed_config`` both hold (:mod:`meshplan.interop.deepspeed_zeropp`
#: reads them under the same names).
ZEROPP_FIELDS = {f"training.{k}": f"zero_optimization.{k}" for k in ZEROPP_KEYS}
#: meshplan field -> the format's key (absent: the format has none; the line keeps meshplan's name).
#: ``training.micro_batch`` of torchtitan depends on pp (:func:`keymap_of`).
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
                 "mesh.sequence_parallel": "--sequence-parallel", "cluster.nodes": "--nodes", **ZEROPP_FIELDS},
    "deepspeed": {"training.global_batch": "train_batch_size", "training.micro_batch": "train_micro_batch_size_per_gpu",
                  "training.overlap_comm": "zero_optimization.overlap_comm", **ZEROPP_FIELDS,
                  "training.seq_len": "--seq-len", "cluster.nodes": "--nodes"},
}
#: The largest ac_freq a torchtitan fix line names in the file's keys (more than any catalog
#: model's layers: Llama-3-405B has 126); a larger one keeps meshplan's words.
MAX_AC_FREQ = 256
#: A fix's setting (meshplan's words) -> the format's, per format: what to write for it.
SETTINGS: dict[str, dict[str, str]] = {
    "torchtitan": {"recompute full": "activation_checkpoint.mode = \"full\"",
                   "recompute none": "activation_checkpoint.mode = \"none\"",
                   "reshard_after_forward true": "parallelism.fsdp_reshard_after_forward = \"always\"",
                   "training.reshard_after_forward = true": "parallelism.fsdp_reshard_after_forward = \"always\"",
                   "training.reshard_after_forward = false": "parallelism.fsdp_reshard_after_forward = \"never\""}
    | {f"mesh.pp_schedule = \"{ours}\"": f"parallelism.pipeline_parallel_schedule = \"{theirs}\""
       for ours, theirs in SCHEDULE_NAMES.items()}
    # the fix's per-layer AC (plan_fix._layer_variant) at each ac_freq a stage's layers allow
    | {f"recompute layer ac_freq {k}": f"activation_checkpoint.mode = \"selective\", "
       f"activation_checkpoint.selective_ac_option = \"{k}\"" for k in range(2, MAX_AC_FREQ + 1)},
    "megatron": {"recompute full": "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
                 # what ``export --to megatron`` writes for zero3: Megatron FSDP's flags (megatron_write)
                 "sharding zero3": " ".join(sharding_flags("zero3")),
                 "[mesh] sequence_parallel = true (--sequence-parallel)": "--sequence-parallel",
                 # the fix without Megatron Core's data-loader mask (plan_fix_mask.SETTING)
                 "training.dataloader_attention_mask = false": "--no-create-attention-mask-in-dataloader"},
    "deepspeed": {"recompute full": "the HF Trainer's --gradient_checkpointing (import --gradient-checkpointing), or "
                                    "deepspeed.checkpointing on every block in other model code"},
}
#: The axes a fix names beside their degree (``tp 4``, ``tp x2``): each format's degree key for them,
#: torchtitan's without its ``parallelism.`` table (``tensor_parallel_degree 4``).
FIX_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "etp")


def _degrees(fmt: str) -> dict[str, str]:
    return {a: k.removeprefix("parallelism.") for a, k in KEYS[fmt].items() if a in FIX_AXES}


#: Each format's map; torchtitan's micro-batch key is set by :func:`keymap_of` (it depends on pp).
KEYMAPS: dict[str, KeyMap] = {fmt: KeyMap(FIELDS[fmt], SETTINGS[fmt], _degrees(fmt), KEYS[fmt],
                                           " " if fmt == "megatron" else " = ") for fmt in FIELDS}


def keymap_of(cfg: Config) -> KeyMap:
    """The key map of the format ``cfg`` was read from (``cfg.origin``; :data:`~meshplan.keymap.OWN`
    for a meshplan TOML): torchtitan's micro-batch key by its pp (the reader's mapping:
    ``training.local_batch_size`` at pp 1, ``parallelism.pipeline_parallel_microbatch_size`` with pp);
    torchtitan's pipeline split as it sets one (:func:`~meshplan.interop.torchtitan_split.split_setting`);
    a b5bcd76 config registry's batch keys in tokens (``training.num_tokens_per_train_step``,
    ``training.num_tokens_per_microbatch_per_dp_rank``, ``seq_len`` tokens a sequence: :meth:`KeyMap.amount`)."""
    own = KEYMAPS.get(cfg.origin or "")
    if own is None:
        return OWN
    if cfg.origin != "torchtitan":
        return own
    pp = dict(zip(cfg.mesh.names or [], cfg.mesh.shape or [])).get("pp", 1) if cfg.mesh is not None else 1
    micro = "parallelism.pipeline_parallel_microbatch_size" if pp > 1 else "training.local_batch_size"
    new = cfg.training.op_sac_policy == "b5bcd76"
    cut = cfg.mesh is None or cfg.mesh.pp_schedule != "zb_h1"  # InterleavedZeroBubble: the names only
    vee = cfg.mesh is not None and cfg.mesh.pp_schedule in V_SCHEDULES  # ZB-V, DualPipeV: the parts as a V
    own = replace(own, splits=lambda split, chunks: split_setting(cfg.model.layers, split, chunks, new, cut, vee))
    if not new:
        return replace(own, fields={**own.fields, "training.micro_batch": micro})
    # a config registry in b5bcd76's names (planned as b5bcd76: op_sac_policy) sets async TP on CompileConfig
    # (torchtitan_pyjob.NEW) and counts the batch in tokens of max_context_length, the seq_len it was
    # planned at (torchtitan_batch.fold_tokens; the micro-batch's key the same with pp: nc57 #4b)
    tokens = {"training.global_batch": "training.num_tokens_per_train_step", "training.seq_len":
              "training.max_context_length", "training.micro_batch": "training.num_tokens_per_microbatch_per_dp_rank",
              "training.tp_comm_overlap": "compile.enable_async_tensor_parallel"}
    seq = cfg.training.seq_len
    return replace(own, fields={**own.fields, **tokens},
                   units={"training.global_batch": seq, "training.micro_batch": seq})
