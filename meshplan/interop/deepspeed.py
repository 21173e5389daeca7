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
are stored in bf16/fp16 with an fp32 copy (meshplan's ``master_weights``).
``gradient_clipping`` > 0 clips the gradient norm (meshplan's ``training.grad_clip``), 0
does not; absent, DeepSpeed's default applies: 1.0 since v0.19.3 (PR #8068, June 2026), 0
before (a note says so). Export writes the value, 1.0 or 0.0, so either version reads it
the same. An ``activation_checkpointing`` section configures ``deepspeed.checkpointing``,
which model code calls on whole blocks: recompute ``full`` (a note); without one, ``none``
(DeepSpeed checkpoints nothing unless the model code calls ``deepspeed.checkpointing``; a note
says so); export writes an empty section for ``full``. ``bf16`` and ``fp16`` both enabled is
refused, as DeepSpeed refuses it (:func:`model_dtype`).

ZeRO stages 1 and 2 run DeepSpeed's own engine (``training.zero12_engine = "deepspeed"``,
:mod:`meshplan.comm.deepspeed_zero12`: one all-reduce per bucket of whole parameters, stage 2
every micro-batch, stage 1 once per step): ``zero_optimization.reduce_bucket_size`` (DeepSpeed's
default 5e8) is read into ``[memory] grad_bucket_elements``, ``zero_optimization.overlap_comm``
(when given; default false for these stages) into ``training.overlap_comm``, ``communication_data_type``
(fp32, bf16, fp16, any case) into ``training.grad_reduce_dtype`` (unset: the model's dtype, as
DeepSpeed reduces), ``zero_optimization.contiguous_gradients`` (when given; default true) into
``training.contiguous_gradients``: false, no ipg buffer (:meth:`~meshplan.spec.memory.MemoryOptions.deepspeed_bucket_bytes`). ``use_multi_rank_bucket_allreduce: false`` (the per-rank ``dist.reduce``
path before PR #4695) and ``data_types.grad_accum_dtype = "fp32"`` with bf16 at stage 1 (the
engine then runs ``BF16_Optimizer``, not ZeRO's, ``engine.py`` ``_do_optimizer_sanity_check``)
are refused by name. Export writes them back: the plan's bucket, ``overlap_comm``, and
``communication_data_type`` when ``grad_reduce_dtype`` is set or the reduce dtype is not the
model's (``overlap_comm`` when set). Other stages list these keys as unused.

The gradients these stages keep (``training.grad_dtype``) are in the model's dtype, not fp32
(``stage_1_and_2.py`` at edaa722): stage 2 copies each reduced gradient into its partition,
``grads_in_partition``, allocated in ``self.dtype`` (the parameters' dtype) whatever
``data_types.grad_accum_dtype`` says; stage 1 keeps ``param.grad`` (the model's dtype) until the
step, or, when ``grad_accum_dtype`` differs from the model's dtype, accumulates each micro-batch's
``param.grad`` into ``param.grad_accum`` in that dtype (``_fill_param_grad_accum_attribute``) and
frees ``param.grad``: ``grad_dtype`` is then ``grad_accum_dtype`` (fp32 with fp16, the one mix its
ZeRO-1 runs). Both convert the rank's partition to fp32 only inside ``step``, one parameter group
at a time (``single_grad_partition``). The rule is :func:`meshplan.spec.training_fields.deepspeed_grad_dtype`,
which a meshplan TOML under ``zero12_engine = "deepspeed"`` takes as its ``grad_dtype`` default too,
so a TOML and its DeepSpeed JSON plan the same. Export writes ``data_types.grad_accum_dtype`` at stage 1
when ``grad_dtype`` is not the model's (fp32 with bf16 has no key: that is ``BF16_Optimizer``).

ZeRO stage 3 keeps each rank's gradient partition in ``data_types.grad_accum_dtype``, unset the
model's dtype, and reduce-scatters in ``communication_data_type``, unset the model's dtype
(DeepSpeed at edaa722: ``runtime/zero/stage3.py:742-744`` allocates ``grad_partitions_flat_buffer``
in ``gradient_accumulation_dtype``, which ``runtime/engine.py:1485-1496`` ``get_data_types`` sets
to ``grad_accum_dtype`` or the model's dtype; ``stage3.py:1798-1799`` casts the gradients to
``communication_data_type`` before ``reduce_scatter_coalesced``, whose unset value
``engine.py:1405-1417`` makes fp16 / bf16 when enabled, else fp32): read into
``training.grad_dtype`` and ``training.grad_reduce_dtype`` (not FSDP2's fp32 defaults) and written
back when they differ from the model's dtype. Each rank converts its partition to fp32 only inside
``step``, one ``sub_group_size`` group at a time (``_prepare_fp32_grad_for_sub_group``): a transient
meshplan's memory timeline does not hold.
At stage 3, ``zero_optimization.contiguous_gradients`` is read into ``training.contiguous_gradients``
and ``reduce_bucket_size`` into ``[memory] grad_bucket_elements`` when given: they choose the
gradient path and bucket of ``training.zero3_engine = "deepspeed-2021"``
(:mod:`meshplan.comm.deepspeed`; absent, v0.3.13's false and DeepSpeed's 5e8), and change
nothing under ``deepspeed``, the engine an import plans (DeepSpeed >= v0.5.5: FSDP2's per-layer
calls without FSDP2's copies on the compute stream, :func:`meshplan.comm.fsdp2.compute_stream_copies`).
Export writes both as a ``deepspeed-2021`` plan models them (``contiguous_gradients`` always:
DeepSpeed's default turned true in v0.4.3), and under ``deepspeed`` or ``fsdp2`` what an import read.
Under ``deepspeed`` ``contiguous_gradients`` (unset: true, DeepSpeed's default at edaa722,
``zero/config.py:102``) keeps the ipg buffer of ``reduce_bucket_size`` elements in
``communication_data_type`` from init (:func:`meshplan.memory.buffers.deepspeed3_ipg_bytes`, in
the memory timeline). ``zero_optimization.overlap_comm`` is read at stage 3 too, when given, into
``training.overlap_comm`` (absent: DeepSpeed's stage-3 default, true, ``zero/config.py:382-386``
``overlap_comm_valid`` at edaa722): on, the parameter all-gathers and the gradient reduce-scatters
run on side streams and overlap the compute; off, both run on the default stream and block it
(``runtime/zero/parameter_offload.py:189-190``, ``runtime/zero/stage3.py:335-336``;
:func:`meshplan.schedule.overlap_policy.config_overlap`). Export writes it when the plan gives it
(unset, DeepSpeed's default for the stage applies, as it did on import).
``stage3_prefetch_bucket_size`` and ``stage3_max_live_parameters`` (or their names without
``stage3_``) are read at stage 3 into ``[memory] deepspeed_prefetch_elements`` and
``deepspeed_max_live_elements``: how many parameters the memory timeline gathers ahead of the one
computed (:meth:`meshplan.memory.passes.PassBuilder._deepspeed_prefetch`), and written back when set;
``stage3_max_reuse_distance`` (parameters kept gathered when used again soon) is not modelled.

A DeepSpeed config runs ZeRO over one data axis: its ``[search]`` table (written on import)
keeps ``meshplan search`` to those meshes (:data:`SEARCH`: pp, dp_replicate, cp, tp, ep, etp
1; no HSDP; sharding zero1, zero2 and zero3 from a config of any stage, each row under the
engine DeepSpeed runs at that stage: :func:`search_table`), the rows ``export --to
deepspeed`` can write; a note says so, and widening ``[search]`` in an imported TOML searches
beyond it.

Offload is refused: ``zero_optimization.offload_optimizer`` / ``offload_param`` with a
``device`` other than ``"none"`` (DeepSpeed's default when the table has no ``device``), and
their deprecated booleans ``cpu_offload`` / ``cpu_offload_param`` when true (zero/config.py maps
them to device ``cpu``). meshplan models neither the CPU optimizer step nor the PCIe/NVMe traffic,
and planning the state as GPU-resident would report a fitting config infeasible: the error names
the key; removing it plans the GPU-resident equivalent.

A key that is not one of DeepSpeed's own (:data:`DEEPSPEED_KEYS`) and is a near miss of one
the reader reads (``zero_optimisation``, ``zero_optimizaton_x``, ``bf_16``, ``fp16x``;
:func:`~meshplan.interop.common.loose_near_miss`) is an error naming the likely key; any other
key, DeepSpeed's or not, is listed as unused.
"""

from __future__ import annotations

from typing import Any, Optional

from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.interop.common import (
    Imported,
    ImportOptions,
    cluster_table,
    flatten,
    loose_near_miss,
    merge_tables,
    misspelt,
    model_option,
    strip_keys,
)
from meshplan.interop.deepspeed_auto import fill_batch, fill_hidden, hidden_auto, hidden_of
from meshplan.interop.tomlout import resolved
from meshplan.spec.memory import DEEPSPEED_REDUCE_BUCKET_ELEMENTS
from meshplan.spec.training_fields import deepspeed_grad_dtype
from meshplan.spec.wording import data_axis

STAGES = {0: "none", 1: "zero1", 2: "zero2", 3: "zero3"}
#: What a DeepSpeed config (this reader and writer) expresses: one home for ``export --help``, its refusal
#: and ``search``'s rows refused (DeepSpeed's own TP/PP/Ulysses/MoE groups are not read or written).
DS_SCOPE = "ZeRO over one data axis, without TP/PP/CP/EP or HSDP"
USED = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
        "zero_optimization.stage", "bf16.enabled", "bfloat16.enabled", "fp16.enabled", "gradient_clipping"}
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
            raise ConfigError("train_batch_size", f"{g} is not gradient_accumulation_steps {a or 1} x dp {dp} x a "
                              f"whole micro-batch")
        return g, per
    if a is not None and g != m * a * dp:
        raise ConfigError("train_batch_size", f"{g} != train_micro_batch_size_per_gpu {m} x "
                          f"gradient_accumulation_steps {a} x dp {dp} = {m * a * dp}")
    return g, m


def read(d: dict, opts: ImportOptions) -> Imported:
    """meshplan tables of a parsed DeepSpeed config (module docstring)."""
    if not opts.model:
        raise ConfigError("--model", "a DeepSpeed config does not name the model; give --model CATALOG_NAME or a "
                          "config.json path")
    if not opts.seq_len:
        raise ConfigError("--seq-len", "a DeepSpeed config does not hold the sequence length; give --seq-len N")
    typo = misspelt(flatten(d), USED, DEEPSPEED_KEYS, loose_near_miss)
    if typo:
        raise ConfigError(typo[0], f"not a DeepSpeed key; did you mean {typo[1]}? (meshplan reads that one: "
                          f"misspelt, the setting would stay at its default)")
    _refuse_offload(d.get("zero_optimization", {}))
    d, auto_line = fill_hidden(d, hidden_of(opts.model)) if hidden_auto(d) else (d, None)  # the HF Trainer's "auto"
    d = fill_batch(d, opts.micro_batch, opts.grad_accum)
    cluster, world = cluster_table(opts, "DeepSpeed")
    stage = d.get("zero_optimization", {}).get("stage", 0)
    if stage not in STAGES:
        raise ConfigError("zero_optimization.stage", f"{stage!r}; use 0, 1, 2 or 3")
    global_batch, micro = batch(d, world)
    dtype = model_dtype(d)
    recompute, notes = _recompute(d)
    notes += [auto_line] if auto_line else []
    training: dict[str, Any] = {"global_batch": global_batch, "seq_len": opts.seq_len, "micro_batch": micro,
                                "sharding": STAGES[stage], "param_dtype": dtype, "compute_dtype": dtype,
                                "grad_clip": _clip(d, notes), "recompute": recompute}
    if stage == 0:  # DeepSpeed's engine without ZeRO: its search's rows run DeepSpeed's ZeRO (search_table)
        training["zero0_engine"] = "deepspeed"
    if stage in (1, 2):
        training |= _zero12(d, dtype)
    if stage == 3:
        training |= _zero3(d, dtype) | {"zero3_engine": "deepspeed"}
        notes.append("ZeRO stage 3 planned as DeepSpeed >= v0.5.5 runs it (training.zero3_engine = \"deepspeed\": "
                     "per-layer coalesced gathers, PR #1188); for DeepSpeed v0.3.13-v0.5.4 (2021) set zero3_engine = "
                     "\"deepspeed-2021\" (one all-gather per parameter tensor; its gradient path follows "
                     "zero_optimization.contiguous_gradients, read into training.contiguous_gradients: absent, false, "
                     "v0.3.13's default, bucket all-reduces; true, the default from v0.4.3, a reduce-scatter per "
                     "gradient)")
    tables = {"model": model_option(opts.model), "cluster": cluster, "training": training,
              "mesh": {"names": [data_axis(STAGES[stage])], "shape": [world]}}  # dp_shard where ZeRO-3 shards
    used = USED | (ZERO12_USED if stage in (1, 2) else set()) | (
        {"data_types.grad_accum_dtype"} if stage in (1, 3) else set()) | (
        ZERO3_USED if stage == 3 else set())  # stage 2 keeps model-dtype grads anyway
    if stage in (1, 2) or (stage == 3 and d["zero_optimization"].get("reduce_bucket_size", "auto") != "auto"):
        tables["memory"] = {"grad_bucket_elements": _bucket(d["zero_optimization"])}
    if stage == 3 and _prefetch(d["zero_optimization"]):  # DeepSpeed's parameter coordinator (memory.passes)
        tables["memory"] = tables.get("memory", {}) | _prefetch(d["zero_optimization"])
    tables["search"] = search_table(stage)
    notes.append("meshplan search keeps to what a DeepSpeed config runs, ZeRO over one data axis ([search] "
                 + ", ".join(f"{k} = {v!r}" for k, v in tables["search"].items()).replace("'", '"')
                 + "); import it to a TOML and widen [search] to search other meshes")
    unused = tuple(k for k in flatten(d) if k not in used)
    return Imported("deepspeed", tables, unused, tuple(notes))


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

#: The keys ZeRO stages 1 and 2 read besides :data:`USED` (module docstring).
ZERO12_USED = frozenset({"zero_optimization.reduce_bucket_size", "zero_optimization.overlap_comm",
                         "zero_optimization.use_multi_rank_bucket_allreduce", "communication_data_type",
                         "zero_optimization.contiguous_gradients"})
#: The keys ZeRO stage 3 reads besides :data:`USED` (module docstring).
ZERO3_USED = frozenset({"communication_data_type", "zero_optimization.contiguous_gradients",
                        "zero_optimization.reduce_bucket_size", "zero_optimization.overlap_comm"}) | {
    f"zero_optimization.{k}" for k in ("stage3_prefetch_bucket_size", "prefetch_bucket_size",
                                       "stage3_max_live_parameters", "max_live_parameters")}
#: DeepSpeed's ZeRO-3 coordinator keys (``DeepSpeedZeroConfig`` fields and their ``stage3_`` aliases,
#: zero/config.py:215, 238 at edaa722) -> ``[memory]`` fields.
PREFETCH_KEYS = {"prefetch_bucket_size": "deepspeed_prefetch_elements", "max_live_parameters": "deepspeed_max_live_elements"}
#: The ``zero_optimization`` keys only ZeRO-3 reads: the ``stage3_`` names and the fields they alias
#: (``DeepSpeedZeroConfig``, zero/config.py at edaa722); an export at stage 0-2 carries none of them.
ZERO3_ONLY = frozenset(k for k in DEEPSPEED_KEYS if k.startswith("zero_optimization.") and (
    k.startswith("zero_optimization.stage3_") or k.replace(".", ".stage3_", 1) in DEEPSPEED_KEYS))


def _prefetch(zero: dict) -> dict[str, int]:
    """``[memory]`` fields of ZeRO-3's ``stage3_prefetch_bucket_size`` and ``stage3_max_live_parameters``
    (or their names without ``stage3_``) when given (absent or "auto": DeepSpeed's 5e7 and 1e9);
    ConfigError for a value that is not a whole number >= 0.

    >>> _prefetch({"stage3_prefetch_bucket_size": 2e7, "max_live_parameters": 300000000}), _prefetch({})
    ({'deepspeed_prefetch_elements': 20000000, 'deepspeed_max_live_elements': 300000000}, {})
    """
    out = {}
    for key, field in PREFETCH_KEYS.items():
        name = next((k for k in (f"stage3_{key}", key) if k in zero), None)
        v = zero.get(name) if name else None
        if v is None or v == "auto":
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or v != int(v):
            raise ConfigError(f"zero_optimization.{name}", f"must be a whole number of elements >= 0 or \"auto\"; "
                              f"got {v!r}")
        out[field] = int(v)
    return out
#: ``communication_data_type`` values (runtime/config.py ``get_communication_data_type``, lower-cased).
COMM_DTYPES = ("fp32", "bf16", "fp16")


def _zero12(d: dict, dtype: str) -> dict[str, Any]:
    """The ``[training]`` keys of DeepSpeed's ZeRO-1/2 engine (module docstring); ConfigError
    for what it does not model or a malformed value.

    >>> _zero12({"zero_optimization": {"stage": 2, "overlap_comm": True}, "communication_data_type": "FP32"}, "bf16")
    {'zero12_engine': 'deepspeed', 'grad_dtype': 'bf16', 'overlap_comm': True, 'grad_reduce_dtype': 'fp32'}
    >>> _zero12({"zero_optimization": {"stage": 1, "use_multi_rank_bucket_allreduce": False}}, "bf16")
    Traceback (most recent call last):
    meshplan.errors.ConfigError: zero_optimization.use_multi_rank_bucket_allreduce: false is DeepSpeed's older reduce path (one dist.reduce per destination rank, before PR #4695), which meshplan does not model; remove it (default true: one all-reduce per bucket)
    """
    zero = d.get("zero_optimization", {})
    if zero.get("use_multi_rank_bucket_allreduce", True) is not True:
        raise ConfigError("zero_optimization.use_multi_rank_bucket_allreduce", "false is DeepSpeed's older reduce path "
                          "(one dist.reduce per destination rank, before PR #4695), which meshplan does not model; "
                          "remove it (default true: one all-reduce per bucket)")
    accum = _accum_dtype(d)
    if zero.get("stage") == 1 and dtype == "bf16" and accum == "fp32":
        raise ConfigError("data_types.grad_accum_dtype", "fp32 with bf16 at ZeRO stage 1 runs DeepSpeed's "
                          "BF16_Optimizer, not its ZeRO-1 engine (not modelled); remove it to plan ZeRO-1")
    out: dict[str, Any] = {"zero12_engine": "deepspeed", "grad_dtype": deepspeed_grad_dtype(zero.get("stage", 0),
                                                                                            dtype, accum)}
    out |= _overlap(zero) | _contiguous(zero)
    comm = d.get("communication_data_type")
    if comm is not None:
        if not isinstance(comm, str) or comm.lower() not in COMM_DTYPES:
            raise ConfigError("communication_data_type", f"{comm!r}; use one of {', '.join(COMM_DTYPES)}")
        out["grad_reduce_dtype"] = comm.lower()
    return out


def _zero3(d: dict, dtype: str) -> dict[str, Any]:
    """The gradient dtypes of DeepSpeed's ZeRO stage 3 (module docstring): the partition in
    ``data_types.grad_accum_dtype`` or the model's dtype, the reduce-scatter in
    ``communication_data_type`` or the model's dtype; ``zero_optimization.contiguous_gradients``
    when given (``training.contiguous_gradients``).

    >>> _zero3({}, "bf16"), _zero3({"data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32"}, "bf16")
    ({'grad_dtype': 'bf16', 'grad_reduce_dtype': 'bf16'}, {'grad_dtype': 'fp32', 'grad_reduce_dtype': 'fp32'})
    >>> _zero3({"zero_optimization": {"contiguous_gradients": True}}, "fp16")["contiguous_gradients"]
    True
    """
    comm = d.get("communication_data_type")
    if comm is not None and (not isinstance(comm, str) or comm.lower() not in COMM_DTYPES):
        raise ConfigError("communication_data_type", f"{comm!r}; use one of {', '.join(COMM_DTYPES)}")
    out: dict[str, Any] = {"grad_dtype": deepspeed_grad_dtype(3, dtype, _accum_dtype(d)),
                           "grad_reduce_dtype": comm.lower() if comm else dtype}
    return out | _contiguous(d.get("zero_optimization", {})) | _overlap(d.get("zero_optimization", {}))


def _contiguous(zero: dict) -> dict[str, Any]:
    """``{"contiguous_gradients": value}`` when the ``zero_optimization`` table ``zero`` gives it
    (else empty: the engine's default, :attr:`~meshplan.spec.training.TrainingSpec.contiguous_grads`);
    ConfigError when it is not a boolean.

    >>> _contiguous({"contiguous_gradients": False}), _contiguous({})
    ({'contiguous_gradients': False}, {})
    """
    v = zero.get("contiguous_gradients")
    if v is None:
        return {}
    if not isinstance(v, bool):
        raise ConfigError("zero_optimization.contiguous_gradients", f"must be true or false; got {v!r}")
    return {"contiguous_gradients": v}


def _overlap(zero: dict) -> dict[str, Any]:
    """``{"overlap_comm": value}`` when the ``zero_optimization`` table ``zero`` gives it (else
    empty: the stage's default, :attr:`~meshplan.spec.training.TrainingSpec.overlaps_comm`, false
    at stages 1 and 2, true at 3); ConfigError when it is not a boolean.

    >>> _overlap({"overlap_comm": False}), _overlap({"overlap_comm": "auto"}), _overlap({})
    ({'overlap_comm': False}, {}, {})
    """
    v = zero.get("overlap_comm")
    if v is None or v == "auto":  # "auto": the HF Trainer's placeholder, DeepSpeed's default then
        return {}
    if not isinstance(v, bool):
        raise ConfigError("zero_optimization.overlap_comm", f"must be true or false; got {v!r}")
    return {"overlap_comm": v}


#: ``data_types.grad_accum_dtype`` spellings (DeepSpeed's ``DtypeEnum``, inference/config.py).
ACCUM_DTYPES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32", "bf16": "bf16",
                "bfloat16": "bf16", "bfloat": "bf16", "torch.bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
                "half": "fp16", "torch.float16": "fp16"}


def _accum_dtype(d: dict) -> Optional[str]:
    """meshplan's name of ``data_types.grad_accum_dtype`` (None when absent); ConfigError for
    a value DeepSpeed's ``DtypeEnum`` does not take.

    >>> _accum_dtype({"data_types": {"grad_accum_dtype": "float32"}}), _accum_dtype({})
    ('fp32', None)
    """
    table = d.get("data_types")
    v = table.get("grad_accum_dtype") if isinstance(table, dict) else None
    if v is None:
        return None
    if not isinstance(v, str) or v.lower() not in ACCUM_DTYPES:
        raise ConfigError("data_types.grad_accum_dtype", f"{v!r}; use fp32, bf16 or fp16")
    return ACCUM_DTYPES[v.lower()]


def _bucket(zero: dict) -> int:
    """ZeRO-1/2's gradient bucket, elements: ``reduce_bucket_size`` (a number >= 1; absent or
    "auto": DeepSpeed's default 5e8)."""
    v = zero.get("reduce_bucket_size")
    if v is None or v == "auto":
        return DEEPSPEED_REDUCE_BUCKET_ELEMENTS
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 1 or v != int(v):
        raise ConfigError("zero_optimization.reduce_bucket_size", f"must be a whole number of elements >= 1 or "
                          f"\"auto\"; got {v!r}")
    return int(v)


def _refuse_offload(zero: Any) -> None:
    """ConfigError naming the first offload key of ``zero`` (the ``zero_optimization`` table)
    that moves state off the GPU (module docstring).

    >>> _refuse_offload({"offload_param": {"device": "none"}, "offload_optimizer": {}, "cpu_offload": False})
    >>> _refuse_offload({"cpu_offload": True})
    Traceback (most recent call last):
    meshplan.errors.ConfigError: zero_optimization.cpu_offload: meshplan does not model ZeRO-Offload (CPU optimizer step, host-device traffic); remove it (or set false) to plan the GPU-resident equivalent
    """
    if not isinstance(zero, dict):
        return
    fix = "meshplan does not model ZeRO-Offload (CPU optimizer step, host-device traffic); remove it"
    for key in ("offload_optimizer", "offload_param"):
        table = zero.get(key)
        device = table.get("device", "none") if isinstance(table, dict) else table
        if device is not None and device != "none":
            raise ConfigError(f"zero_optimization.{key}", f"device {device!r}: {fix} (or set its device to "
                              f"\"none\") to plan the GPU-resident equivalent")
    for key in ("cpu_offload", "cpu_offload_param"):  # deprecated booleans: true means device "cpu"
        if zero.get(key):
            raise ConfigError(f"zero_optimization.{key}", f"{fix} (or set false) to plan the GPU-resident equivalent")


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
                              f"(unset: false); write true or false")
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


def _clip(d: dict, notes: list[str]) -> bool:
    """Whether DeepSpeed clips the gradient norm (module docstring); ConfigError for a value
    that is not a number >= 0."""
    v = d.get("gradient_clipping")
    if v is None:
        notes.append("gradient_clipping not given: planned with clipping (DeepSpeed >= v0.19.3 clips at 1.0 by "
                     "default; before v0.19.3 it did not: write gradient_clipping 0.0 for that)")
        return True
    if v == "auto":  # the HF Trainer fills it from max_grad_norm (1.0 by default)
        return True
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
        raise ConfigError("gradient_clipping", f"must be a number >= 0 (0: no clipping) or \"auto\"; got {v!r}")
    return v > 0


CHECKPOINTING = "activation_checkpointing"


def read_keys(doc: dict) -> set[str]:
    """The keys :func:`read` reads in a DeepSpeed config of ``doc``'s ZeRO stage (an
    ``activation_checkpointing`` section is read by its presence: :func:`carried`).

    >>> sorted(read_keys({"zero_optimization": {"stage": 1}}) - read_keys({}))
    ['communication_data_type', 'data_types.grad_accum_dtype', 'zero_optimization.contiguous_gradients', 'zero_optimization.overlap_comm', 'zero_optimization.reduce_bucket_size', 'zero_optimization.use_multi_rank_bucket_allreduce']
    """
    zero = doc.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    return set(USED) | (set(ZERO12_USED) if stage in (1, 2) else set()) | (
        {"data_types.grad_accum_dtype"} if stage == 1 else set()) | (
        {k for k in ZERO3_USED if k.startswith("zero_optimization.")} if stage == 3 else set())


def not_planned(user: dict) -> list[str]:
    """The dotted keys of the user's DeepSpeed config ``user`` that meshplan does not plan:
    every key :func:`read` does not read at its stage (:func:`read_keys`; an
    ``activation_checkpointing`` section's own keys, though the section itself is read as
    recompute ``full``).

    >>> not_planned({"train_batch_size": 8, "steps_per_print": 10, "activation_checkpointing": {},
    ...              "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_max_reuse_distance": 5e7}})
    ['steps_per_print', 'zero_optimization.stage3_max_reuse_distance']
    """
    return list(flatten(strip_keys(user, read_keys(user) | {CHECKPOINTING})))


def carried(user: dict, written: dict) -> tuple[dict, list[str]]:
    """(config, what was carried) of ``written`` (:func:`write`) with the keys of the user's
    DeepSpeed config ``user`` that meshplan does not plan (:func:`not_planned`:
    ``steps_per_print``, ``optimizer``, ``scheduler``, ZeRO-3's persistence sizes,
    ...) carried through unchanged, as a torchtitan export keeps the job's other sections; every
    key :func:`read` reads at the user's stage or the written one is what ``written`` says. The keys of an ``activation_checkpointing``
    section go with it only where ``written`` has one (the plan checkpoints: recompute
    ``full``; another plan's section would read back as ``full``). What was carried: dotted keys,
    the user's order.

    >>> user = {"train_batch_size": 64, "steps_per_print": 10, "zero_optimization": {"stage": 2,
    ...         "overlap_comm": True, "round_robin_gradients": True}, "activation_checkpointing": {"partition_activations": True}}
    >>> doc, names = carried(user, {"train_batch_size": 32, "zero_optimization": {"stage": 1}})
    >>> doc
    {'train_batch_size': 32, 'zero_optimization': {'stage': 1, 'round_robin_gradients': True}, 'steps_per_print': 10}
    >>> names
    ['steps_per_print', 'zero_optimization.round_robin_gradients']
    >>> carried(user, {"activation_checkpointing": {}})[1]
    ['steps_per_print', 'zero_optimization.round_robin_gradients', 'activation_checkpointing.partition_activations']

    ZeRO-3's own keys (:data:`ZERO3_ONLY`) go only into a stage-3 config:

    >>> carried({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto"}},
    ...         {"zero_optimization": {"stage": 2}})
    ({'zero_optimization': {'stage': 2}}, [])
    """
    zero = written.get("zero_optimization")
    drop = read_keys(user) | read_keys(written) | {CHECKPOINTING} | (
        set() if CHECKPOINTING in written else {k for k in flatten(user) if k.startswith(CHECKPOINTING + ".")}) | (
        set() if isinstance(zero, dict) and zero.get("stage") == 3 else ZERO3_ONLY)
    keep = strip_keys(strip_keys(user, drop), set(flatten(written)))
    return merge_tables(written, keep), list(flatten(keep))


def write(cfg: Config) -> dict[str, Any]:
    """DeepSpeed config of ``cfg``: only for ZeRO data parallelism (every axis a data axis
    of degree > 1 at most one, no tp/pp/cp/ep); ConfigError saying why otherwise."""
    mesh = resolved(cfg)
    t = cfg.training
    other = [f"{a} {mesh.layout.degree(a)}" for a in mesh.layout.names
             if a not in ("dp", "dp_shard", "dp_replicate") and mesh.layout.degree(a) > 1]
    if mesh.ep > 1:
        other.append(f"ep {mesh.ep}")
    data = [f"{a} {mesh.layout.degree(a)}" for a in mesh.layout.names
            if a in ("dp", "dp_shard", "dp_replicate") and mesh.layout.degree(a) > 1]
    if other or len(data) > 1 or t.sharding == "hsdp":
        raise ConfigError("--to", f"a DeepSpeed config applies to {DS_SCOPE}; this mesh has "
                          f"{', '.join(other or data)} ({t.sharding})")
    if t.compute_dtype != t.param_dtype or t.param_dtype == "fp8":
        raise ConfigError("--to", f"DeepSpeed stores parameters in the compute dtype (bf16/fp16 with an fp32 master "
                          f"copy); param_dtype {t.param_dtype} with compute_dtype {t.compute_dtype} has no key")
    dp = mesh.degree("dp")
    accumulate = t.global_batch // (t.micro_batch * dp)
    stage = {v: k for k, v in STAGES.items()}[t.sharding]
    zero: dict[str, Any] = {"stage": stage}
    comm: dict[str, Any] = {}
    if t.zero12_engine == "deepspeed":  # the plan's bucket and stream (meshplan.comm.deepspeed_zero12)
        zero |= {"reduce_bucket_size": cfg.memory.deepspeed_bucket_elements()} | (
            {"overlap_comm": t.overlap_comm} if t.overlap_comm is not None else {}) | (  # unset: the stage's default
            {"contiguous_gradients": t.contiguous_gradients} if t.contiguous_gradients is not None else {})
    elif stage == 2:  # the plan's bucket (meshplan.comm.dp_rows._zero2_rows)
        zero["reduce_bucket_size"] = cfg.memory.bucket_elements(mesh.degree("fsdp"))
    elif t.zero3_engine == "deepspeed-2021":  # its gradient path and bucket (meshplan.comm.deepspeed), both
        # written: DeepSpeed's contiguous_gradients default changed in v0.4.3
        zero |= {"contiguous_gradients": t.contiguous_grads,
                 "reduce_bucket_size": cfg.memory.deepspeed_bucket_elements()}
    elif stage == 3:  # deepspeed (or fsdp2): what an import read, back; deepspeed's stream choice
        zero |= {f"stage3_{k}": getattr(cfg.memory, f) for k, f in PREFETCH_KEYS.items()
                 if getattr(cfg.memory, f) is not None}
        zero |= ({"contiguous_gradients": t.contiguous_gradients} if t.contiguous_gradients is not None else {}) | (
            {"reduce_bucket_size": cfg.memory.grad_bucket_elements} if cfg.memory.grad_bucket_elements else {}) | (
            {"overlap_comm": t.overlap_comm} if t.overlap_comm is not None else {})
    if (stage in (1, 2) and t.grad_reduce_dtype is not None) or (stage in (1, 2, 3)
                                                               and t.gradient_reduce_dtype != t.param_dtype):
        comm["communication_data_type"] = t.gradient_reduce_dtype  # DeepSpeed's unset is the model's dtype
    if (stage == 1 and t.grad_dtype != t.param_dtype and not (t.param_dtype == "bf16" and t.grad_dtype == "fp32")) \
            or (stage == 3 and t.grad_dtype != t.param_dtype):
        # ZeRO-1's param.grad_accum, ZeRO-3's gradient partition (module docstring)
        comm["data_types"] = {"grad_accum_dtype": t.grad_dtype}
    return {"train_batch_size": t.global_batch, "train_micro_batch_size_per_gpu": t.micro_batch,
            "gradient_accumulation_steps": accumulate, "zero_optimization": zero} | comm | {
            "bf16": {"enabled": t.compute_dtype == "bf16"}, "fp16": {"enabled": t.compute_dtype == "fp16"},
            "gradient_clipping": 1.0 if t.grad_clip else 0.0} | (
        {"activation_checkpointing": {}} if t.recompute == "full" else {})
