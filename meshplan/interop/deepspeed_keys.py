"""The keys of a DeepSpeed JSON config: those meshplan reads at every ZeRO stage (:data:`USED`;
each stage's others: :mod:`meshplan.interop.deepspeed_zero`), DeepSpeed's own (:data:`DEEPSPEED_KEYS`),
and a misspelt one refused by name (:func:`misspelt_key`, :func:`misspelt_field`), for the reader
:mod:`meshplan.interop.deepspeed`.

A key that is not one of DeepSpeed's own (:data:`DEEPSPEED_KEYS`) and is a near miss of one
the reader reads (``zero_optimisation``, ``zero_optimizaton_x``, ``bf_16``, ``fp16x``;
:func:`~meshplan.interop.typos.loose_near_miss`) is an error naming the likely key. Inside the
tables DeepSpeed validates with pydantic models that forbid extra keys (:data:`FORBIDS_EXTRA`:
``zero_optimization``, ``bf16``/``bfloat16``, ``fp16``), a key that is a near miss of any field
of DeepSpeed's (``overlap_com``, ``contiguous_gradient``, ``reduce_bucket_sise``) is an error
too, naming the field (newcomer trial 23 #2: DeepSpeed refuses it, meshplan listed it as unused).
Any other key, DeepSpeed's or not, is listed as unused.
"""

from __future__ import annotations

from typing import Optional

from meshplan.errors import ConfigError
from meshplan.interop.common import flatten
from meshplan.interop.typos import loose_near_miss, misspelt
from meshplan.interop.deepspeed_zero import ZERO3_USED, ZERO12_USED


USED = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
        "zero_optimization.stage", "bf16.enabled", "bfloat16.enabled", "fp16.enabled", "gradient_clipping"}


#: Every key meshplan reads at some ZeRO stage (for the words of :func:`misspelt_field`).
READS = frozenset(USED) | ZERO12_USED | ZERO3_USED


#: DeepSpeed's own keys (deepspeedai/DeepSpeed at edaa722): the top-level ones its
#: ``DeepSpeedConfig._initialize_params`` reads (runtime/config.py with the names of
#: runtime/constants.py, the monitor, comm, profiling, autotuning, elasticity, nebula, datastates,
#: compression, data-pipeline, tensor-parallel and pipeline configs), and within the tables
#: meshplan reads, every field and alias of ``DeepSpeedZeroConfig`` (zero/config.py) and of
#: ``DeepSpeedFP16Config`` / ``DeepSpeedBF16Config`` (precision_config.py). Never a misspelling:
#: listed as unused when meshplan does not read them.
DEEPSPEED_KEYS = frozenset(
    "train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps managed_gradient_accumulation "
    "steps_per_print dump_state wall_clock_breakdown memory_breakdown optimizer scheduler "
    "zero_allow_untested_optimizer zero_force_ds_cpu_optimizer sparse_gradients bf16 bfloat16 fp16 amp "
    "torch_autocast communication_data_type seq_parallel_communication_data_type prescale_gradients "
    "gradient_predivide_factor gradient_allreduce_op disable_allgather gradient_clipping graph_harvesting eigenvalue "
    "progressive_layer_drop checkpoint data_types dataloader_drop_last use_data_before_expert_parallelism log_level "
    "sparse_attention vocabulary_size elasticity zero_optimization activation_checkpointing flops_profiler "
    "autotuning nebula datastates_ckpt comms_logger aio compression_training data_efficiency curriculum_learning "
    "tensorboard wandb csv_monitor comet timers hybrid_engine quantize_training weight_quantization compile "
    "tensor_parallel expert_parallel pipeline".split()) | {f"zero_optimization.{k}" for k in (
        "stage contiguous_gradients reduce_scatter reduce_bucket_size use_multi_rank_bucket_allreduce "
        "allgather_partitions allgather_bucket_size overlap_comm load_from_fp32_weights elastic_checkpoint "
        "offload_param offload_optimizer zenflow sub_group_size cpu_offload_param cpu_offload_use_pin_memory "
        "cpu_offload prefetch_bucket_size stage3_prefetch_bucket_size param_persistence_threshold "
        "stage3_param_persistence_threshold model_persistence_threshold stage3_model_persistence_threshold "
        "max_live_parameters stage3_max_live_parameters max_reuse_distance stage3_max_reuse_distance "
        "gather_16bit_weights_on_model_save stage3_gather_16bit_weights_on_model_save module_granularity_threshold "
        "stage3_module_granularity_threshold use_all_reduce_for_fetch_params stage3_use_all_reduce_for_fetch_params "
        "allgather_sequential stage3_allgather_sequential stage3_gather_fp16_weights_on_model_save "
        "ignore_unused_parameters legacy_stage1 round_robin_gradients zero_hpz_partition_size zero_quantized_weights "
        "zero_quantized_nontrainable_weights zero_quantized_gradients zeropp_loco_param mics_shard_size "
        "mics_hierarchical_params_gather memory_efficient_linear pipeline_loading_checkpoint override_module_apply "
        "log_trace_cache_warnings enable_sanity_checks save_muon_momentum_buffer_in_memory leaf_module").split()} | {
    f"fp16.{k}" for k in ("enabled auto_cast loss_scale initial_scale_power loss_scale_window hysteresis "
                          "consecutive_hysteresis min_loss_scale fp16_master_weights_and_grads").split()} | {
    f"{t}.{k}" for t in ("bf16", "bfloat16") for k in ("enabled immediate_grad_update check_grad_overflow "
                                                      "bf16_master_weights_and_grads bf16_optimizer_states").split()}


#: The tables DeepSpeed parses with a ``DeepSpeedConfigModel`` (deepspeedai/DeepSpeed at edaa722,
#: runtime/config_utils.py: pydantic ``model_config = ConfigDict(..., extra="forbid")``), so that a key
#: not among the model's fields (:data:`DEEPSPEED_KEYS`) fails DeepSpeed's start-up, by the model's
#: name: ``DeepSpeedZeroConfig`` (runtime/zero/config.py), ``DeepSpeedBF16Config`` and
#: ``DeepSpeedFP16Config`` (runtime/precision_config.py). ``optimizer`` (a plain dict, its params
#: passed to the optimizer) and ``activation_checkpointing`` (a ``DeepSpeedConfigObject`` reading
#: the keys it knows) take any key, so their keys are never checked here.
FORBIDS_EXTRA = {"zero_optimization": "DeepSpeedZeroConfig", "bf16": "DeepSpeedBF16Config",
                 "bfloat16": "DeepSpeedBF16Config", "fp16": "DeepSpeedFP16Config"}


def misspelt_field(d: dict) -> Optional[ConfigError]:
    """The error for the first key of a :data:`FORBIDS_EXTRA` table of ``d`` that is not a field
    of DeepSpeed's model and is a near miss of one (:func:`~meshplan.interop.typos.loose_near_miss`);
    None when there is none (a key far from every field stays in the unused list).

    >>> misspelt_field({"zero_optimization": {"stage": 2, "overlap_com": True}}).message
    "not a field of DeepSpeed's DeepSpeedZeroConfig, which refuses other keys; did you mean zero_optimization.overlap_comm? (a DeepSpeed key meshplan reads)"
    >>> misspelt_field({"zero_optimization": {"reduce_bucket_size": 5e8, "my_note": 1}, "fp16": {"enabled": False}}) is None
    True
    """
    for table, model in FORBIDS_EXTRA.items():
        sub = d.get(table)
        for key in sub if isinstance(sub, dict) else ():
            if f"{table}.{key}" in DEEPSPEED_KEYS:
                continue
            hit = _field_hit(table, key)
            if hit is not None:
                reads = "meshplan reads" if f"{table}.{hit}" in READS else "meshplan does not use"
                return ConfigError(f"{table}.{key}", f"not a field of DeepSpeed's {model}, which refuses other keys; "
                                   f"did you mean {table}.{hit}? (a DeepSpeed key {reads})")
    return None


def _field_hit(table: str, key: str) -> Optional[str]:
    """The field of DeepSpeed's model for ``table`` (:data:`FORBIDS_EXTRA`) closest to ``key``
    (:func:`~meshplan.interop.typos.loose_near_miss`), None when none is near."""
    return loose_near_miss(key, [k.split(".", 1)[1] for k in DEEPSPEED_KEYS if k.startswith(f"{table}.")])


def misspelt_key(d: dict) -> Optional[ConfigError]:
    """The error for the first key of ``d`` that is a near miss of a key meshplan reads at every
    stage (:data:`USED`), naming the closest DeepSpeed field of its table where that is closer
    than the read key (newcomer trial nc52: ``zero_optimization.stage3_max_live_paramaters`` is
    one edit from ``stage3_max_live_parameters`` and was told "did you mean
    zero_optimization.stage?", which only begins it: :func:`misspelt_field`'s error then).

    >>> misspelt_key({"zero_optimization": {"stage": 3, "stage3_max_live_paramaters": 1e9}}).message[-91:]
    'did you mean zero_optimization.stage3_max_live_parameters? (a DeepSpeed key meshplan reads)'
    >>> misspelt_key({"zero_optimization": {"stage_3": 3}}).message
    'not a DeepSpeed key; did you mean zero_optimization.stage? (meshplan reads that one: misspelt, the setting would stay at its default)'
    """
    typo = misspelt(flatten(d), USED, DEEPSPEED_KEYS, loose_near_miss)
    if typo is None:
        return None
    table, _, key = typo[0].rpartition(".")
    if table in FORBIDS_EXTRA and _field_hit(table, key) not in (None, typo[1].rpartition(".")[2]):
        return misspelt_field({table: {key: None}})
    return ConfigError(typo[0], f"not a DeepSpeed key; did you mean {typo[1]}? (meshplan reads that one: "
                       "misspelt, the setting would stay at its default)")
