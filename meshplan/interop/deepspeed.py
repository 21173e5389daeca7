"""DeepSpeed JSON config <-> meshplan tables (ZeRO data parallelism, no TP/PP).

Key names from DeepSpeed's configuration reference (deepspeed.ai/docs/config-json:
``train_batch_size``, ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``,
``zero_optimization.stage``, ``bf16.enabled`` (or its old name ``bfloat16.enabled``),
``fp16.enabled``, ``gradient_clipping``). The batch rule is
DeepSpeed's: ``train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps
* dp`` (any two give the third). ``"auto"`` values (the HF Trainer's) are read as the Trainer fills
them (:mod:`meshplan.interop.deepspeed_auto`: the bucket sizes from the model's hidden size, the
batch from ``--micro-batch`` / ``--grad-accum``), and written back on export.
A DeepSpeed config names neither the model nor the sequence length nor the cluster: they
come from ``--model``, ``--seq-len``, ``--cluster``/``--nodes``.

ZeRO stage 0, 1, 2, 3 -> sharding none, zero1, zero2, zero3 over one data axis ``dp`` (every
rank); bf16/fp16 keep fp32 master weights (DeepSpeed's mixed precision), so the parameters
are stored in bf16/fp16 with an fp32 copy (meshplan's ``master_weights``). bf16 at stage 0 (or at
stage 1 with ``data_types.grad_accum_dtype`` fp32) runs DeepSpeed's ``BF16_Optimizer``, which
partitions the master weights and Adam states as ZeRO-1 does: sharding zero1 with fp32 gradients
(:func:`~meshplan.interop.deepspeed_zero.bf16_optimizer_training`, a note says so).
``gradient_clipping`` > 0 clips the gradient norm (meshplan's ``training.grad_clip``), 0
does not; absent, DeepSpeed's default applies: 1.0 since v0.19.3 (PR #8068, June 2026), 0
before (a note says so). The value given is ``training.grad_clip_norm``; export writes it
(1.0 unset) or 0.0, so either version reads it the same. An ``activation_checkpointing``
section configures ``deepspeed.checkpointing``, which model code calls on whole blocks: recompute ``full`` (a note); without one, ``none``
(DeepSpeed checkpoints nothing unless the model code calls ``deepspeed.checkpointing``; a note
says so); export writes an empty section for ``full``. ``bf16`` and ``fp16`` both enabled is
refused, as DeepSpeed refuses it (:func:`model_dtype`).

A DeepSpeed config runs ZeRO over one data axis: its ``[search]`` table (written on import)
keeps ``meshplan search`` to those meshes (:data:`SEARCH`: pp, dp_replicate, cp, tp, ep, etp
1; no HSDP; sharding zero1, zero2 and zero3 from a config of any stage, each row under the
engine DeepSpeed runs at that stage: :func:`search_table`), the rows ``export --to
deepspeed`` can write; a note says so, and widening ``[search]`` in an imported TOML searches
beyond it.

The ZeRO knobs of stages 1, 2 and 3 (buckets, streams, gradient dtypes, ZeRO-3's prefetch) and
ZeRO++ hpZ are read by :mod:`meshplan.interop.deepspeed_zero`, ZeRO-Offload by
:mod:`meshplan.interop.deepspeed_offload`; the writer (``export
--to deepspeed``) is :mod:`meshplan.interop.deepspeed_write`, and what it carries of the user's
own file :mod:`meshplan.interop.deepspeed_carry`.

A key that is not one of DeepSpeed's own (:data:`DEEPSPEED_KEYS`) and is a near miss of one
the reader reads (``zero_optimisation``, ``zero_optimizaton_x``, ``bf_16``, ``fp16x``;
:func:`~meshplan.interop.common.loose_near_miss`) is an error naming the likely key. Inside the
tables DeepSpeed validates with pydantic models that forbid extra keys (:data:`FORBIDS_EXTRA`:
``zero_optimization``, ``bf16``/``bfloat16``, ``fp16``), a key that is a near miss of any field
of DeepSpeed's (``overlap_com``, ``contiguous_gradient``, ``reduce_bucket_sise``) is an error
too, naming the field (newcomer trial 23 #2: DeepSpeed refuses it, meshplan listed it as unused).
Any other key, DeepSpeed's or not, is listed as unused.
"""

from __future__ import annotations

from typing import Any, Optional

from meshplan.errors import ConfigError
from meshplan.interop.common import (
    Imported,
    ImportOptions,
    cluster_table,
    flatten,
    loose_near_miss,
    misspelt,
    model_option,
)
from meshplan.interop.deepspeed_auto import (
    CHECKPOINTING,
    fill_batch,
    fill_dtype,
    fill_hidden,
    hf_recompute,
    hidden_auto,
    hidden_of,
    model_code,
    runs_hf_trainer,
)
from meshplan.interop.deepspeed_offload import offload_training, refuse_offload
from meshplan.interop.deepspeed_zero import (
    ZERO3_USED,
    ZERO12_USED,
    bf16_optimizer_training,
    bucket_elements,
    prefetch_memory,
    runs_bf16_optimizer,
    sub_group_note,
    zero3_training,
    zero12_training,
    zero_section,
    zero_stage,
)
from meshplan.spec.mesh_words import data_axis

STAGES = {0: "none", 1: "zero1", 2: "zero2", 3: "zero3"}
#: What a DeepSpeed config (this reader and writer) expresses: one home for ``export --help``, its refusal
#: and ``search``'s rows refused (DeepSpeed's own TP/PP/Ulysses/MoE groups are not read or written).
DS_SCOPE = "ZeRO over one data axis, without TP/PP/CP/EP or HSDP"
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
    of DeepSpeed's model and is a near miss of one (:func:`~meshplan.interop.common.loose_near_miss`);
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
    (:func:`~meshplan.interop.common.loose_near_miss`), None when none is near."""
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


def _given(d: dict, key: str) -> Optional[int]:
    v = d.get(key)
    if v is None or v == "auto":
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(key, f"must be a whole number >= 1 or \"auto\"; got {v!r}")
    return v


def batch(d: dict, dp: int) -> tuple[int, int]:
    """(global batch, micro-batch) by DeepSpeed's rule (module docstring).

    >>> batch({"train_batch_size": 64, "gradient_accumulation_steps": 2}, 8)
    (64, 4)
    >>> batch({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 8)
    (64, 2)
    """
    g, m, a = (_given(d, k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                      "gradient_accumulation_steps"))
    if g is None and m is None:
        raise ConfigError("train_batch_size", "give train_batch_size or train_micro_batch_size_per_gpu")
    if g is None and m is not None:
        return m * (a or 1) * dp, m
    if g is None:  # unreachable: one of the two is given
        raise ConfigError("train_batch_size", "give train_batch_size or train_micro_batch_size_per_gpu")
    if m is None:
        per = g // ((a or 1) * dp)
        if per * (a or 1) * dp != g:
            unit = (a or 1) * dp
            raise ConfigError("train_batch_size", f"{g} is not gradient_accumulation_steps {a or 1} x dp {dp} x a "
                              f"whole micro-batch; fix: train_batch_size = {max(1, round(g / unit)) * unit} (a "
                              f"multiple of {a or 1} x dp {dp} = {unit})")
        return g, per
    if a is not None and g != m * a * dp:
        raise ConfigError("train_batch_size", f"{g} != train_micro_batch_size_per_gpu {m} x "
                          f"gradient_accumulation_steps {a} x dp {dp} = {m * a * dp}; {_batch_fix(g, m, a, dp)}")
    return g, m


def _batch_fix(g: int, m: int, a: int, dp: int) -> str:
    """The ``fix:`` of a DeepSpeed batch whose three values disagree (DeepSpeed asserts
    ``train_batch_size == micro x accumulation x world``, runtime/config.py
    ``_batch_assertion``): set train_batch_size to the product, or the accumulation steps that
    give ``g`` where they are whole, or leave train_batch_size out (DeepSpeed derives it).

    >>> _batch_fix(1000, 1, 16, 64), _batch_fix(2048, 2, 4, 128)
    ('fix: train_batch_size = 1024 (1 x 16 x dp 64), or leave it out and DeepSpeed derives it', 'fix: train_batch_size = 1024 (2 x 4 x dp 128), or gradient_accumulation_steps = 8 (2048 / (2 x dp 128))')
    """
    steps = g // (m * dp) if g % (m * dp) == 0 and g >= m * dp else None
    other = (f"gradient_accumulation_steps = {steps} ({g} / ({m} x dp {dp}))" if steps
             else "leave it out and DeepSpeed derives it")
    return f"fix: train_batch_size = {m * a * dp} ({m} x {a} x dp {dp}), or {other}"


def read(d: dict, opts: ImportOptions) -> Imported:
    """meshplan tables of a parsed DeepSpeed config (module docstring)."""
    model = _check_config(d, opts)
    hf_auto = runs_hf_trainer(d, None)  # before any "auto" is filled: the HF Trainer's model code
    hf = hf_auto or bool(opts.gradient_checkpointing)  # its recompute: --gradient-checkpointing
    d, auto_line = fill_hidden(d, hidden_of(model)) if hidden_auto(d) else (d, None)  # the HF Trainer's "auto"
    d = fill_dtype(fill_batch(d, opts.micro_batch, opts.grad_accum), opts.dtype)
    cluster, world = cluster_table(opts, "DeepSpeed")
    stage = zero_stage(d)
    global_batch, micro = batch(d, world)
    dtype = model_dtype(d)
    recompute, notes = hf_recompute(d, opts.gradient_checkpointing) if hf else _recompute(d)
    code, code_line = model_code(hf_auto)
    notes += [code_line] + ([auto_line] if auto_line else [])
    training: dict[str, Any] = {"global_batch": global_batch, "seq_len": opts.seq_len, "micro_batch": micro,
                                "sharding": STAGES[stage], "param_dtype": dtype, "compute_dtype": dtype,
                                **_clip(d, notes), "recompute": recompute, **code}
    bf16_opt = runs_bf16_optimizer(d, stage, dtype)
    training |= _engine_training(d, stage, dtype, bf16_opt, notes)
    tables = {"model": model_option(model), "cluster": cluster, "training": training,
              "mesh": {"names": [data_axis(training["sharding"])], "shape": [world]}}  # dp_shard where ZeRO-3 shards
    used = USED | (ZERO12_USED if stage in (1, 2) and not bf16_opt else set()) | (
        {"communication_data_type", "data_types.grad_accum_dtype"} if bf16_opt else set()) | (
        {"data_types.grad_accum_dtype"} if stage in (1, 3) else set()) | (
        ZERO3_USED if stage == 3 else set())  # stage 2 keeps model-dtype grads anyway
    memory = _memory_table(d, stage, bf16_opt)
    tables |= {"memory": memory} if memory else {}
    tables["search"] = search_table(stage)
    notes.append("meshplan search keeps to what a DeepSpeed config runs, ZeRO over one data axis ([search] "
                 + ", ".join(f"{k} = {v!r}" for k, v in tables["search"].items()).replace("'", '"')
                 + "); import it to a TOML and widen [search] to search other meshes")
    unused = tuple(k for k in flatten(d) if k not in used)
    return Imported("deepspeed", tables, unused, tuple(notes))


def _check_config(d: dict, opts: ImportOptions) -> str:
    """The model option (a catalog name or a config.json path); refuse what cannot be planned before reading ``d``: no ``--model`` or ``--seq-len`` (a DeepSpeed
    config holds neither), a misspelt DeepSpeed key or field (a near miss of one meshplan reads),
    an offloaded ZeRO state (:func:`~meshplan.interop.deepspeed_offload.refuse_offload`)."""
    if not opts.model:
        raise ConfigError("--model", "a DeepSpeed config does not name the model; give --model CATALOG_NAME or a "
                          "config.json path")
    if not opts.seq_len:
        raise ConfigError("--seq-len", "a DeepSpeed config does not hold the sequence length; give --seq-len N")
    typo = misspelt_key(d)
    if typo is not None:
        raise typo
    field_typo = misspelt_field(d)
    if field_typo is not None:
        raise field_typo
    refuse_offload(zero_section(d))
    return opts.model


def _engine_training(d: dict, stage: int, dtype: str, bf16_opt: bool, notes: list[str]) -> dict[str, Any]:
    """The ``[training]`` keys of DeepSpeed's engine at ZeRO ``stage``: its BF16_Optimizer
    (``bf16_opt``: ZeRO-1's sharding, fp32 gradients; a note), the engine without ZeRO (stage 0:
    its search's rows run DeepSpeed's ZeRO, :func:`search_table`), ZeRO-1/2's keys, or ZeRO-3's
    as DeepSpeed >= v0.5.5 runs it (a note naming the 2021 engine's setting)."""
    training: dict[str, Any] = {}
    if bf16_opt:  # BF16_Optimizer: ZeRO-1's sharding, fp32 gradients (deepspeed_zero)
        training |= bf16_optimizer_training(d, dtype)
        notes.append("bf16 at ZeRO stage 0 (or stage 1 with grad_accum_dtype fp32) runs DeepSpeed's BF16_Optimizer: "
                     "fp32 master weights and Adam states partitioned over dp as ZeRO-1, fp32 gradients of every "
                     "parameter beside the bf16 ones (planned as sharding \"zero1\", zero12_engine \"deepspeed\", "
                     "grad_dtype \"fp32\")")
    elif stage == 0:  # DeepSpeed's engine without ZeRO: its search's rows run DeepSpeed's ZeRO (search_table)
        training["zero0_engine"] = "deepspeed"
    elif stage in (1, 2):
        training |= zero12_training(d, dtype)
    training |= offload_training(zero_section(d), stage, notes)  # ZeRO-Offload (memory.offload)
    if stage == 3:
        training |= zero3_training(d, dtype) | {"zero3_engine": "deepspeed"}
        notes.append("ZeRO stage 3 planned as DeepSpeed >= v0.5.5 runs it (training.zero3_engine = \"deepspeed\": "
                     "per-layer coalesced gathers, PR #1188); for DeepSpeed v0.3.13-v0.5.4 (2021) set zero3_engine = "
                     "\"deepspeed-2021\" (one all-gather per parameter tensor; its gradient path follows "
                     "zero_optimization.contiguous_gradients, read into training.contiguous_gradients: absent, false, "
                     "v0.3.13's default, bucket all-reduces; true, the default from v0.4.3, a reduce-scatter per "
                     "gradient)")
        notes.append(sub_group_note(d["zero_optimization"]))
    return training


def _memory_table(d: dict, stage: int, bf16_opt: bool) -> dict[str, Any]:
    """The ``[memory]`` keys of ``d``: the gradient bucket's elements under ZeRO-1/2 (not the
    BF16_Optimizer's) and under ZeRO-3 where ``reduce_bucket_size`` is set, and ZeRO-3's parameter
    coordinator's prefetch and live-parameter limits (memory.unit_events); {} where none."""
    memory: dict[str, Any] = {}
    if (stage in (1, 2) and not bf16_opt) or (stage == 3 and d["zero_optimization"].get("reduce_bucket_size", "auto") != "auto"):
        memory = {"grad_bucket_elements": bucket_elements(d["zero_optimization"])}
    if stage == 3 and prefetch_memory(d["zero_optimization"]):  # DeepSpeed's parameter coordinator (memory.unit_events)
        memory = memory | prefetch_memory(d["zero_optimization"])
    return memory


#: The ``[search]`` table of a DeepSpeed config: the meshes :func:`write` exports (one data
#: axis, dp_shard; the search's shardings without HSDP: :func:`search_table` per stage).
SEARCH: dict[str, list[Any]] = {"pp": [1], "dp_replicate": [1], "cp": [1], "tp": [1], "ep": [1], "etp": [1],
                                 "sharding": ["zero1", "zero2", "zero3"]}


def search_table(stage: int) -> dict[str, list[Any]]:
    """The ``[search]`` table of a DeepSpeed config of ZeRO ``stage`` (:data:`SEARCH`). A DeepSpeed
    user changes ``zero_optimization.stage`` freely, and the same runtime runs each: stages 1, 2
    and 3 search ZeRO-1, ZeRO-2 and ZeRO-3 alike, each row under the engine DeepSpeed runs for it
    (zero1 and zero2 rows DeepSpeed's ZeRO-1/2, ``zero12_engine = "deepspeed"``; zero3 rows its
    ZeRO-3, ``zero3_engine = "deepspeed"``: :attr:`~meshplan.spec.training.TrainingSpec.searched_zero12_engine`
    and ``searched_zero3_engine``). Stage 0 (DeepSpeed's engine without ZeRO, ``zero0_engine =
    "deepspeed"``) searches the same three under the same engines; stage 0 itself is no search row
    (the search has no unsharded candidate: ``meshplan plan`` plans it), which the search says.

    >>> search_table(2)["sharding"], search_table(3)["sharding"], search_table(0)["sharding"]
    (['zero1', 'zero2', 'zero3'], ['zero1', 'zero2', 'zero3'], ['zero1', 'zero2', 'zero3'])
    """
    return {k: list(v) for k, v in SEARCH.items()}


def model_dtype(d: dict) -> str:
    """The model's dtype of DeepSpeed config ``d``: ``bf16`` (``bf16.enabled``, or its old name
    ``bfloat16``: DeepSpeed's ``BFLOAT16`` and ``BFLOAT16_OLD``), ``fp16`` (``fp16.enabled``),
    else ``fp32``. Both enabled is a ConfigError: DeepSpeed refuses it (``runtime/config.py:827-828``
    at edaa722, ``assert not (self.float16_config.enabled and self.bfloat16_config.enabled),
    'bfloat16 and fp16 modes cannot be simultaneously enabled'``).

    >>> model_dtype({"bfloat16": {"enabled": True}}), model_dtype({"fp16": {"enabled": True}}), model_dtype({})
    ('bf16', 'fp16', 'fp32')
    >>> model_dtype({"bf16": {"enabled": True}, "fp16": {"enabled": True}})
    Traceback (most recent call last):
    meshplan.errors.ConfigError: bf16.enabled: and fp16.enabled are both true, which DeepSpeed refuses ('bfloat16 and fp16 modes cannot be simultaneously enabled', runtime/config.py); set one of them to false
    """
    key = "bf16" if "bf16" in d else "bfloat16"
    bf16: dict = d[key] if isinstance(d.get(key), dict) else {}
    fp16: dict = d["fp16"] if isinstance(d.get("fp16"), dict) else {}
    for name, table in ((key, bf16), ("fp16", fp16)):  # the HF Trainer's: its --bf16 / --fp16, not in the file
        if table.get("enabled") == "auto":
            raise ConfigError(f"{name}.enabled", f"\"auto\" is filled by the HF Trainer from its --{name[:2]}16 flag "
                              f"(unset: false); pass --dtype {name[:2]}16 (or fp32 for neither flag), or write true or false")
    if bf16.get("enabled") and fp16.get("enabled"):
        raise ConfigError(f"{key}.enabled", "and fp16.enabled are both true, which DeepSpeed refuses ('bfloat16 and "
                          "fp16 modes cannot be simultaneously enabled', runtime/config.py); set one of them to false")
    return "bf16" if bf16.get("enabled") else "fp16" if fp16.get("enabled") else "fp32"


def _recompute(d: dict) -> tuple[str, list[str]]:
    """(``training.recompute``, the import's first notes) of DeepSpeed config ``d``. An
    ``activation_checkpointing`` section configures ``deepspeed.checkpointing.checkpoint``, which
    the model code calls on whole blocks: ``full``. Without one DeepSpeed checkpoints nothing
    unless the model code calls ``deepspeed.checkpointing`` itself, which the JSON cannot say:
    ``none`` (the engine never checkpoints activations on its own: at edaa722 ``runtime/engine.py``
    does not read the section; ``deepspeed.checkpointing.configure``,
    ``runtime/activation_checkpointing/checkpointing.py:1162``, which the model code calls, does),
    with a note saying what was assumed.

    >>> _recompute({"activation_checkpointing": {}})[0], _recompute({})[0]
    ('full', 'none')
    """
    if CHECKPOINTING in d:
        return "full", ["activation_checkpointing configures deepspeed.checkpointing.checkpoint, which the model code "
                        "calls on whole blocks (Megatron-DeepSpeed's --checkpoint-activations): planned with recompute "
                        "= \"full\"; set training.recompute if the model checkpoints otherwise"]
    return "none", ["no activation_checkpointing section: planned without activation checkpointing (recompute = "
                    "\"none\"), as DeepSpeed runs unless the model code calls deepspeed.checkpointing itself; set "
                    "training.recompute if it does"]


def _clip(d: dict, notes: list[str]) -> dict:
    """``training.grad_clip`` (whether DeepSpeed clips the gradient norm: module docstring) and
    ``grad_clip_norm`` (the number given, > 0); ConfigError for a value that is not a number >= 0.

    >>> _clip({"gradient_clipping": 0.3}, []), _clip({"gradient_clipping": 0}, []), _clip({"gradient_clipping": "auto"}, [])
    ({'grad_clip': True, 'grad_clip_norm': 0.3}, {'grad_clip': False}, {'grad_clip': True})
    """
    v = d.get("gradient_clipping")
    if v is None:
        notes.append("gradient_clipping not given: planned with clipping (DeepSpeed >= v0.19.3 clips at 1.0 by "
                     "default; before v0.19.3 it did not: write gradient_clipping 0.0 for that)")
        return {"grad_clip": True}
    if v == "auto":  # the HF Trainer fills it from max_grad_norm (1.0 by default)
        return {"grad_clip": True}
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
        raise ConfigError("gradient_clipping", f"must be a number >= 0 (0: no clipping) or \"auto\"; got {v!r}")
    return {"grad_clip": True, "grad_clip_norm": float(v)} if v > 0 else {"grad_clip": False}

