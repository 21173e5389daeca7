"""Interoperation with the job configs practitioners already have (layer after
:mod:`meshplan.mesh`): torchtitan job TOML (:mod:`~meshplan.interop.torchtitan`, writer in
:mod:`~meshplan.interop.torchtitan_write`, carried user keys in
:mod:`~meshplan.interop.torchtitan_carry`, its degrees and pipeline as [mesh] in
:mod:`~meshplan.interop.torchtitan_mesh`), Megatron-LM arguments (:mod:`~meshplan.interop.megatron`, the keys
its runtime's flags set in :mod:`~meshplan.interop.megatron_tables`, its cluster in
:mod:`~meshplan.interop.megatron_cluster`, its flags in
:mod:`~meshplan.interop.megatron_flags`, its recompute flags in :mod:`~meshplan.interop.megatron_recompute`,
its checkpoint flags in
:mod:`~meshplan.interop.megatron_ckpt`, Megatron-LM's whole flag list (misspellings refused) in
:mod:`~meshplan.interop.megatron_known`, pipeline split in
:mod:`~meshplan.interop.megatron_pipeline`, model flags in
:mod:`~meshplan.interop.megatron_model`, writer in :mod:`~meshplan.interop.megatron_write`,
carried user flags in :mod:`~meshplan.interop.megatron_carry`) and DeepSpeed JSON
(:mod:`~meshplan.interop.deepspeed`, its keys and misspellings in :mod:`~meshplan.interop.deepspeed_keys`, its
batch in :mod:`~meshplan.interop.deepspeed_batch`, its ZeRO knobs in :mod:`~meshplan.interop.deepspeed_zero`,
writer in :mod:`~meshplan.interop.deepspeed_write`, carried user keys in
:mod:`~meshplan.interop.deepspeed_carry`, the HF Trainer's ``"auto"`` values in
:mod:`~meshplan.interop.deepspeed_auto`) read into meshplan's tables and written from a
:class:`~meshplan.config.Config`; a small TOML writer and the meshplan TOML of a config with
its layer split (:mod:`~meshplan.interop.tomlout`); the flags of a launch script or
arguments file, the launcher's apart (:mod:`~meshplan.interop.launch`); format detection
(:mod:`~meshplan.interop.detect`) and the loader that ``plan``/``step``/``search`` use for any of them
(:mod:`~meshplan.interop.foreign`), export to any of them (:mod:`~meshplan.interop.export`, each
format's file: :mod:`~meshplan.interop.export_formats`), what an export gives back (:mod:`~meshplan.interop.roundtrip`) and
which rows ``search --export`` can write (:mod:`~meshplan.interop.search_export`); the check that
refuses a key misspelt near one meshplan reads, which every reader shares (:mod:`~meshplan.interop.typos`).

Every reader lists by name the fields of the foreign file that meshplan does not use (never
dropped silently); what the file does not say (the cluster; the model and sequence length of
a DeepSpeed config) comes from :class:`~meshplan.interop.common.ImportOptions`, with a
one-line error naming the option when it is missing.
"""

__all__ = ["common", "deepspeed", "deepspeed_auto", "deepspeed_batch", "deepspeed_carry", "deepspeed_keys",
           "deepspeed_write", "deepspeed_zero", "detect", "export", "export_formats", "foreign", "launch", "megatron",
           "megatron_carry", "megatron_ckpt", "megatron_cluster", "megatron_flags", "megatron_known", "megatron_model",
           "megatron_pipeline", "megatron_recompute", "megatron_tables", "megatron_write", "roundtrip",
           "search_export", "tomlout", "torchtitan", "torchtitan_carry", "torchtitan_mesh",
           "torchtitan_write", "typos"]
