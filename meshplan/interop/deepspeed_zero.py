"""DeepSpeed's ZeRO knobs of a DeepSpeed JSON config (:mod:`meshplan.interop.deepspeed` reads
the rest): the keys each ZeRO stage reads into ``[training]`` and ``[memory]``, and the offload
it refuses. Written back by :func:`meshplan.interop.deepspeed_write.write`.

ZeRO stages 1 and 2 run DeepSpeed's own engine (``training.zero12_engine = "deepspeed"``,
:mod:`meshplan.comm.deepspeed_zero12`: one all-reduce per bucket of whole parameters, stage 2
every micro-batch, stage 1 once per step): ``zero_optimization.reduce_bucket_size`` (DeepSpeed's
default 5e8) is read into ``[memory] grad_bucket_elements``, ``zero_optimization.overlap_comm``
(when given; default false for these stages) into ``training.overlap_comm``, ``communication_data_type``
(fp32, bf16, fp16, any case) into ``training.grad_reduce_dtype`` (unset: the model's dtype, as
DeepSpeed reduces), ``zero_optimization.contiguous_gradients`` (when given; default true) into
``training.contiguous_gradients``: false, no ipg buffer (:meth:`~meshplan.spec.memory.MemoryOptions.deepspeed_bucket_bytes`). ``use_multi_rank_bucket_allreduce: false`` (the per-rank ``dist.reduce``
path before PR #4695) is refused by name; ``data_types.grad_accum_dtype = "fp32"`` with bf16 at
stage 1 makes the engine run ``BF16_Optimizer``, not ZeRO's (``engine.py``
``_do_optimizer_sanity_check``), read as such (below). Export writes them back: the plan's bucket, ``overlap_comm``, and
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

DeepSpeed's ``BF16_Optimizer`` (:func:`runs_bf16_optimizer`: bf16 at stage 0, BLOOM-176B's setting, or
at stage 1 with ``grad_accum_dtype`` fp32) keeps the fp32 master weights and Adam states in ``1/dp``
partitions, as ZeRO-1, and fp32 gradients of every parameter: read as sharding ``zero1`` under
``zero12_engine = "deepspeed"`` with ``grad_dtype = "fp32"`` (:func:`bf16_optimizer_training`;
:attr:`meshplan.spec.training.TrainingSpec.bf16_optimizer` says what it holds and runs), and
written back as ZeRO stage 0 with bf16 (:mod:`meshplan.interop.deepspeed_write`).

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
meshplan's memory timeline does not hold, which the import says (:func:`sub_group_note`).
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
``deepspeed_max_live_elements``: how many parameters the memory timeline and the step gather ahead
of the one computed (:func:`meshplan.spec.deepspeed_memory.deepspeed_ahead_bytes`), and written back when set;
``stage3_max_reuse_distance`` (or ``max_reuse_distance``; zero/config.py:244) likewise into
``deepspeed_max_reuse_elements``, written back when set: the parameters kept gathered when used
again within it (:func:`meshplan.spec.deepspeed_reuse.reuse_kept`; the step's backward gathers and
the memory timeline's kept bytes: :func:`meshplan.memory.deepspeed_fetch.deepspeed_reuse`).

ZeRO-Offload's keys (``offload_optimizer``, ``offload_param`` and their booleans) are read, or refused
by name, by :mod:`meshplan.interop.deepspeed_offload`.

ZeRO++'s keys (``zero_hpz_partition_size``, ``zero_quantized_weights``, ``zero_quantized_gradients``)
are read at stage 3 by :mod:`meshplan.interop.deepspeed_zeropp`.
"""

from __future__ import annotations

from typing import Any, Optional

from meshplan.errors import ConfigError
from meshplan.interop.deepspeed_offload import OFFLOAD_USED, offload_training
from meshplan.interop.deepspeed_zeropp import zeropp_training
from meshplan.limits import BOUNDS
from meshplan.spec.deepspeed_memory import DEEPSPEED_REDUCE_BUCKET_ELEMENTS, DEEPSPEED_SUB_GROUP_ELEMENTS
from meshplan.spec.training_fields import deepspeed_grad_dtype

#: The keys ZeRO stages 1 and 2 read besides :data:`meshplan.interop.deepspeed_keys.USED` (module docstring).
ZERO12_USED = OFFLOAD_USED | frozenset({"zero_optimization.reduce_bucket_size", "zero_optimization.overlap_comm",
                         "zero_optimization.use_multi_rank_bucket_allreduce", "communication_data_type",
                         "zero_optimization.contiguous_gradients"})
#: The keys ZeRO stage 3 reads besides :data:`meshplan.interop.deepspeed_keys.USED` (module docstring).
ZERO3_USED = OFFLOAD_USED | frozenset({"communication_data_type", "zero_optimization.contiguous_gradients",
                        "zero_optimization.reduce_bucket_size", "zero_optimization.overlap_comm"}) | {
    f"zero_optimization.{k}" for k in ("stage3_prefetch_bucket_size", "prefetch_bucket_size",
                                       "stage3_max_live_parameters", "max_live_parameters",
                                       "stage3_max_reuse_distance", "max_reuse_distance", "zero_hpz_partition_size",
                                       "zero_quantized_weights", "zero_quantized_gradients")}
#: DeepSpeed's ZeRO-3 coordinator keys (``DeepSpeedZeroConfig`` fields and their ``stage3_`` aliases,
#: zero/config.py:215, 238 at edaa722) -> ``[memory]`` fields.
PREFETCH_KEYS = {"prefetch_bucket_size": "deepspeed_prefetch_elements", "max_live_parameters": "deepspeed_max_live_elements",
                 "max_reuse_distance": "deepspeed_max_reuse_elements"}


def prefetch_memory(zero: dict) -> dict[str, int]:
    """``[memory]`` fields of ZeRO-3's ``stage3_prefetch_bucket_size``, ``stage3_max_live_parameters``
    and ``stage3_max_reuse_distance`` (or their names without ``stage3_``) when given (absent or
    "auto": DeepSpeed's 5e7, 1e9 and 1e9); ConfigError naming the key for a value that is not a
    whole number >= 0 within bounds (:func:`whole_elements`).

    >>> prefetch_memory({"stage3_prefetch_bucket_size": 2e7, "max_live_parameters": 300000000}), prefetch_memory({})
    ({'deepspeed_prefetch_elements': 20000000, 'deepspeed_max_live_elements': 300000000}, {})
    """
    out = {}
    for key, field in PREFETCH_KEYS.items():
        name = next((k for k in (f"stage3_{key}", key) if k in zero), None)
        if name is None or zero[name] is None or zero[name] == "auto":
            continue
        out[field] = whole_elements(zero, name, 0)
    return out


#: ``communication_data_type`` values (runtime/config.py ``get_communication_data_type``, lower-cased).
COMM_DTYPES = ("fp32", "bf16", "fp16")


def zero12_training(d: dict, dtype: str) -> dict[str, Any]:
    """The ``[training]`` keys of DeepSpeed's ZeRO-1/2 engine (module docstring); ConfigError
    for what it does not model or a malformed value.

    >>> zero12_training({"zero_optimization": {"stage": 2, "overlap_comm": True}, "communication_data_type": "FP32"}, "bf16")
    {'zero12_engine': 'deepspeed', 'grad_dtype': 'bf16', 'overlap_comm': True, 'grad_reduce_dtype': 'fp32'}
    >>> zero12_training({"zero_optimization": {"stage": 1, "use_multi_rank_bucket_allreduce": False}}, "bf16")
    Traceback (most recent call last):
    meshplan.errors.ConfigError: zero_optimization.use_multi_rank_bucket_allreduce: false is DeepSpeed's older reduce path (one dist.reduce per destination rank, before PR #4695), which meshplan does not model; remove it (default true: one all-reduce per bucket)
    """
    zero = d.get("zero_optimization", {})
    if zero.get("use_multi_rank_bucket_allreduce", True) is not True:
        raise ConfigError("zero_optimization.use_multi_rank_bucket_allreduce", "false is DeepSpeed's older reduce path "
                          "(one dist.reduce per destination rank, before PR #4695), which meshplan does not model; "
                          "remove it (default true: one all-reduce per bucket)")
    accum = _accum_dtype(d)
    if zero.get("stage") == 1 and dtype == "bf16" and accum == "fp32":  # the engine runs BF16_Optimizer
        return bf16_optimizer_training(d, dtype)
    out: dict[str, Any] = {"zero12_engine": "deepspeed", "grad_dtype": deepspeed_grad_dtype(zero.get("stage", 0),
                                                                                            dtype, accum)}
    out |= _overlap(zero) | _contiguous(zero)
    return out | comm_dtype(d)


def comm_dtype(d: dict) -> dict[str, Any]:
    """``{"grad_reduce_dtype": ...}`` from DeepSpeed's top-level ``communication_data_type`` (the
    dtype its engine reduces gradients in), empty where unset; a one-line ConfigError naming the key
    for a value outside :data:`COMM_DTYPES`.

    >>> comm_dtype({"communication_data_type": "FP32"}), comm_dtype({})
    ({'grad_reduce_dtype': 'fp32'}, {})
    """
    comm = d.get("communication_data_type")
    if comm is None:
        return {}
    if not isinstance(comm, str) or comm.lower() not in COMM_DTYPES:
        raise ConfigError("communication_data_type", f"{comm!r}; use one of {', '.join(COMM_DTYPES)}")
    return {"grad_reduce_dtype": comm.lower()}


def runs_bf16_optimizer(d: dict, stage: int, dtype: str) -> bool:
    """Whether DeepSpeed's engine runs ``BF16_Optimizer`` for config ``d`` at ZeRO ``stage`` with
    the model in ``dtype``: bf16 at stage 0, or at stage 1 with ``data_types.grad_accum_dtype``
    fp32 (microsoft/DeepSpeed 38327e0 ``runtime/engine.py:1316-1348`` ``_do_optimizer_sanity_check``;
    v0.6.5 8164ea9 ``engine.py:1111-1146``: bf16 without ZeRO), not at stage 1 with the optimizer
    offloaded to the CPU (edaa722 ``engine.py:1994-1997``: ``and not self.zero_cpu_offload()``, ZeRO's
    own optimizer then).

    >>> runs_bf16_optimizer({}, 0, "bf16"), runs_bf16_optimizer({}, 1, "bf16"), runs_bf16_optimizer({}, 0, "fp16")
    (True, False, False)
    >>> fp32 = {"data_types": {"grad_accum_dtype": "fp32"}}
    >>> runs_bf16_optimizer(fp32, 1, "bf16"), runs_bf16_optimizer(fp32 | {"zero_optimization": {"cpu_offload": True}}, 1, "bf16")
    (True, False)
    """
    zero = d.get("zero_optimization")
    offload = isinstance(zero, dict) and bool(offload_training(zero, 1, []))
    return dtype == "bf16" and (stage == 0 or stage == 1 and _accum_dtype(d) == "fp32" and not offload)


def bf16_optimizer_training(d: dict, dtype: str) -> dict[str, Any]:
    """The ``[training]`` keys of DeepSpeed's ``BF16_Optimizer`` (:func:`runs_bf16_optimizer`;
    :attr:`meshplan.spec.training.TrainingSpec.bf16_optimizer`): ZeRO-1's sharding of the fp32
    master weights and Adam states under DeepSpeed's engine, fp32 gradients, reduced in
    ``communication_data_type`` when given (unset: bf16, the engine's default for bf16,
    ``engine.py:733-742`` at v0.6.5, 939-950 at 38327e0). ``data_types.grad_accum_dtype`` bf16
    at stage 0 (``BF16_Optimizer`` accumulating in bf16 under the pipeline engine, refused
    without it: "Bfloat16 wrapper must use a gradient accumulation type of fp32") is refused
    by name: meshplan plans the fp32 accumulation only.

    >>> bf16_optimizer_training({"zero_optimization": {"stage": 0}}, "bf16")
    {'sharding': 'zero1', 'zero12_engine': 'deepspeed', 'grad_dtype': 'fp32'}
    >>> bf16_optimizer_training({"data_types": {"grad_accum_dtype": "bf16"}}, "bf16")
    Traceback (most recent call last):
    meshplan.errors.ConfigError: data_types.grad_accum_dtype: bf16 with bf16.enabled at ZeRO stage 0 is BF16_Optimizer accumulating in bf16 (DeepSpeed refuses it without its PipelineEngine; meshplan models the fp32 accumulation only); remove it (fp32, the default without ZeRO)
    """
    if _accum_dtype(d) not in (None, "fp32"):
        raise ConfigError("data_types.grad_accum_dtype", f"{_accum_dtype(d)} with bf16.enabled at ZeRO stage 0 is "
                          f"BF16_Optimizer accumulating in {_accum_dtype(d)} (DeepSpeed refuses it without its "
                          f"PipelineEngine; meshplan models the fp32 accumulation only); remove it (fp32, the default "
                          f"without ZeRO)")
    out: dict[str, Any] = {"sharding": "zero1", "zero12_engine": "deepspeed", "grad_dtype": "fp32"}
    return out | comm_dtype(d)


def zero3_training(d: dict, dtype: str) -> dict[str, Any]:
    """The gradient dtypes of DeepSpeed's ZeRO stage 3 (module docstring): the partition in
    ``data_types.grad_accum_dtype`` or the model's dtype, the reduce-scatter in
    ``communication_data_type`` or the model's dtype; ``zero_optimization.contiguous_gradients``
    when given (``training.contiguous_gradients``).

    >>> zero3_training({}, "bf16"), zero3_training({"data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32"}, "bf16")
    ({'grad_dtype': 'bf16', 'grad_reduce_dtype': 'bf16'}, {'grad_dtype': 'fp32', 'grad_reduce_dtype': 'fp32'})
    >>> zero3_training({"zero_optimization": {"contiguous_gradients": True}}, "fp16")["contiguous_gradients"]
    True
    """
    comm = d.get("communication_data_type")
    if comm is not None and (not isinstance(comm, str) or comm.lower() not in COMM_DTYPES):
        raise ConfigError("communication_data_type", f"{comm!r}; use one of {', '.join(COMM_DTYPES)}")
    out: dict[str, Any] = {"grad_dtype": deepspeed_grad_dtype(3, dtype, _accum_dtype(d)),
                           "grad_reduce_dtype": comm.lower() if comm else dtype}
    zero = d.get("zero_optimization", {})
    return out | _contiguous(zero) | _overlap(zero) | zeropp_training(zero)


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


def whole_elements(zero: dict, key: str, low: int) -> int:
    """``zero[key]``, a count of elements, as an int: a whole number from ``low`` to
    :data:`~meshplan.limits.BOUNDS` ``["bytes"]`` (1 TiB; the ``[memory]`` fields it fills share
    that bound); a ConfigError naming ``zero_optimization.<key>``, the user's key, otherwise.

    >>> whole_elements({"reduce_bucket_size": 2e8}, "reduce_bucket_size", 1)
    200000000
    >>> whole_elements({"reduce_bucket_size": 1e30}, "reduce_bucket_size", 1)
    Traceback (most recent call last):
    meshplan.errors.ConfigError: zero_optimization.reduce_bucket_size: must be a whole number of elements from 1 to 1099511627776 (1 TiB: 7x the HBM of an H200) or "auto"; got 1e+30
    """
    v, top = zero[key], BOUNDS["bytes"]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not low <= v <= top.value or v != int(v):
        raise ConfigError(f"zero_optimization.{key}", f"must be a whole number of elements from {low} to "
                          f"{top.value} ({top.reason}) or \"auto\"; got {v!r}")
    return int(v)


def bucket_elements(zero: dict) -> int:
    """ZeRO-1/2's gradient bucket, elements: ``reduce_bucket_size`` (:func:`whole_elements` >= 1;
    absent or "auto": DeepSpeed's default 5e8)."""
    v = zero.get("reduce_bucket_size")
    if v is None or v == "auto":
        return DEEPSPEED_REDUCE_BUCKET_ELEMENTS
    return whole_elements(zero, "reduce_bucket_size", 1)


def zero_stage(d: dict) -> int:
    """``zero_optimization.stage`` of DeepSpeed config ``d`` (absent: 0); a ConfigError naming it
    for anything but 0, 1, 2 or 3. A JSON boolean is refused: DeepSpeed's
    ``DeepSpeedZeroConfig.stage`` is a ``ZeroStageEnum(int, Enum)`` field of a pydantic model in lax
    mode (deepspeedai/DeepSpeed at edaa722, ``runtime/zero/config.py``, ``runtime/config_utils.py``
    ``DeepSpeedConfigModel``, no ``strict``), which coerces ``true`` to stage 1 and ``false`` to 0
    (checked with pydantic 2.14); meshplan asks for the number rather than guess that ``true``
    meant ZeRO-1.

    >>> zero_stage({"zero_optimization": {"stage": 3}}), zero_stage({})
    (3, 0)
    >>> zero_stage({"zero_optimization": {"stage": True}})
    Traceback (most recent call last):
    meshplan.errors.ConfigError: zero_optimization.stage: true is not a stage (DeepSpeed coerces it to 1); write 0, 1, 2 or 3
    """
    stage = zero_section(d).get("stage", 0)
    if isinstance(stage, bool):
        raise ConfigError("zero_optimization.stage", f"{str(stage).lower()} is not a stage (DeepSpeed coerces it to "
                          f"{int(stage)}); write 0, 1, 2 or 3")
    if stage not in (0, 1, 2, 3):
        raise ConfigError("zero_optimization.stage", f"{stage!r}; use 0, 1, 2 or 3")
    return int(stage)


def zero_section(d: dict) -> dict:
    """The ``zero_optimization`` object of DeepSpeed config ``d`` (``{}`` absent); a ConfigError
    naming it where it is not an object (a string or null: DeepSpeed's own reader fails on it;
    DeepSpeed's deprecated boolean form too, which microsoft/DeepSpeed's
    ``deepspeed/runtime/zero/config.py`` ``get_zero_config`` reads through
    ``read_zero_config_deprecated``, ``true`` as stage 1: meshplan asks for the object).

    >>> zero_section({"zero_optimization": {"stage": 2}}), zero_section({})
    ({'stage': 2}, {})
    >>> zero_section({"zero_optimization": "2"})
    Traceback (most recent call last):
    meshplan.errors.ConfigError: zero_optimization: '2': give a JSON object of ZeRO keys, {"stage": N, ...}
    """
    zero = d.get("zero_optimization", {})
    if not isinstance(zero, dict):
        old = " (DeepSpeed's deprecated boolean form: write {\"stage\": 1} for true)" if isinstance(zero, bool) else ""
        raise ConfigError("zero_optimization", f"{zero!r}: give a JSON object of ZeRO keys, {{\"stage\": N, ...}}{old}")
    return zero


def sub_group_note(zero: dict) -> str:
    """The import's note that ZeRO-3's ``sub_group_size`` is not modelled and what it would add
    (newcomer trial 52 #13: it was only listed as unused). DeepSpeed edaa722 ``runtime/zero/stage3.py``
    ``step`` (:2604-2644) runs the optimizer one sub-group at a time; ``_prepare_fp32_grad_for_sub_group``
    (:2398-2412) flattens the sub-group's gradient partition and casts it to fp32 (``.to(fp32_..._flat
    .dtype)``), held as its ``.grad`` until ``_release_sub_group`` (:2448-2453) sets it to None. So the
    step holds ``min(sub_group_size, the rank's parameter partition) x 4 B`` more, a sub-group closing at
    the parameter that reaches the size (``_create_fp16_sub_groups``, :1160-1183, so up to one
    parameter's partition more); at most ``sub_group_size x 4 B``. Unset or not a number: DeepSpeed's
    1e9 (4 GB).

    >>> sub_group_note({"sub_group_size": 100_000_000}).split(";")[0]
    'zero_optimization.sub_group_size 100,000,000 is not modelled'
    >>> "up to 4.0 GB" in sub_group_note({})
    True
    """
    v = zero.get("sub_group_size")
    n = int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else 0
    given, n = n > 0, n or DEEPSPEED_SUB_GROUP_ELEMENTS
    what = f"zero_optimization.sub_group_size {n:,}" if given else \
        f"zero_optimization.sub_group_size (unset: DeepSpeed's {n:,}, zero/config.py:175)"
    return (f"{what} is not modelled; DeepSpeed's step copies each sub-group's gradient partition to fp32 one "
            "sub-group at a time (stage3.py:2398-2412, freed at :2448-2453 at edaa722), which would add "
            f"min(sub_group_size, the rank's parameter partition) x 4 B at the optimizer step, up to "
            f"{n * 4 / 1e9:.1f} GB; the memory timeline's step leaves it out")
