"""The ``[training]``, ``[memory]`` and ``[reliability]`` keys of a Megatron-LM import
(:func:`meshplan.interop.megatron.read`) that the runtime's flags set beside the mesh and the batch:
MoE routing, the collectives' types, the overlap flags, Megatron FSDP's, attention and precision
(:func:`runtime_training`), Megatron-DeepSpeed's engine and ds config (:func:`deepspeed_training`,
:func:`ds_config_keys`), dropout, buckets and the allocator (:func:`memory_keys`), and the
checkpoint interval (:func:`reliability_keys`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from meshplan.errors import printable
from meshplan.interop import megatron_flags as flags
from meshplan.interop import megatron_precision as precision
from meshplan.interop.megatron_attention import read_attention
from meshplan.interop.megatron_ckpt import async_save, ckpt_format
from meshplan.interop.megatron_deepspeed import bf16_optimizer_keys, ds_config, ds_tables, pipe_layer_split


def deepspeed_training(args: dict, training: dict, mesh: dict, deepspeed: dict, ds_training: dict, pp: int,
                    layers: int, notes: list[str]) -> tuple[dict, dict]:
    """(``training``, ``mesh``) under Megatron-DeepSpeed: its engine's keys and its ds config's
    (the engine reduces in the config's ``communication_data_type``: unset, the model's dtype, so
    no ``grad_reduce_dtype``; ``--zero-stage 0`` with ``--bf16``: its BF16_Optimizer) and its
    pipeline partition (:mod:`~meshplan.interop.megatron_deepspeed`)."""
    training = {k: v for k, v in training.items() if k != "grad_reduce_dtype"} | deepspeed | ds_training
    training = bf16_optimizer_keys(training, notes)  # --zero-stage 0 with --bf16: BF16_Optimizer
    return training, mesh | pipe_layer_split(args, deepspeed, pp, layers, mesh, notes)  # DeepSpeed's partition


def runtime_training(args: dict, training: dict, mesh: dict, deepspeed: bool, deg: dict[str, int], moe: bool,
                      sharding: Any, dtype: str, notes: list[str]) -> dict:
    """``training`` with what the runtime's flags set: MoE routing, the collectives' types,
    checkpoint notes, gradient-accumulation fusion, the overlap flags, Megatron FSDP's, the p2p
    overlap (interleaved 1F1B), the runtime's (``deepspeed``: under Megatron-DeepSpeed's engine),
    attention and precision (:mod:`~meshplan.interop.megatron_flags`,
    :mod:`~meshplan.interop.megatron_attention`, :func:`_precision`)."""
    if moe:
        training |= flags.routing(args, notes)
    training |= flags.comm_types(args, deg, moe, notes)
    ckpt_format(args, notes)
    async_save(args, notes)
    flags.accumulation_fusion(args, notes)
    training |= flags.overlap_flags(args, str(training["sharding"]))
    training |= flags.megatron_fsdp(args, sharding)
    training |= flags.p2p_overlap(args, mesh.get("pp_schedule") == "interleaved_1f1b")
    training |= flags.runtime(args, deepspeed)
    training |= read_attention(args, dtype != "fp32", notes, deepspeed)
    return _precision(args, training, dtype, notes, deepspeed, "dp_replicate" in mesh.get("names", ()))


def _precision(args: dict, training: dict, dtype: str, notes: list[str], deepspeed: bool,
               instances: bool = False) -> dict:
    """``training`` with the precision-aware optimizer's dtypes and ``--transformer-impl local``
    (:mod:`~meshplan.interop.megatron_precision`; not under DeepSpeed's engine, whose config
    says its dtypes), and the note on the flags that change memory or communication unplanned
    (``instances``: the distributed optimizer's instances mapped to dp_replicate, not among them)."""
    if not deepspeed:
        training = training | precision.precision_keys(args, dtype, notes) | precision.fp8_param_gather_keys(args, notes)
    training = {k: v for k, v in (training | precision.local_keys(args, notes)).items() if v is not None}
    notes += precision.not_modelled_note(args, instances)
    return training


def memory_keys(args: dict, training: dict, ds_memory: dict, exported: dict[str, str], notes: list[str]) -> dict:
    """The ``[memory]`` keys the arguments set: dropout, the DDP bucket size
    (:func:`~meshplan.interop.megatron_flags.bucket`), a ds config's, the caching allocator's
    configuration, and ``fused_glu`` false under ``--no-bias-swiglu-fusion`` with ``--swiglu``
    (unset: fused, Megatron-LM's default, ``MemoryOptions.fused_glu``)."""
    memory: dict[str, Any] = {"dropout": True} if flags.dropout(args, notes) else {}
    memory |= flags.bucket(args, training, notes) | ds_memory | precision.alloc_conf(exported)
    if args.get("--no-bias-swiglu-fusion") and args.get("--swiglu"):
        memory["fused_glu"] = False  # unset: fused, Megatron-LM's default (MemoryOptions.fused_glu)
    return memory


def reliability_keys(args: dict, notes: list[str]) -> dict:
    """``{"reliability": {"checkpoint_interval_steps": N}}`` from ``--save-interval N`` (only
    ``reliability`` uses it: another value is a note, not an error); {} without it."""
    save = str(args.get("--save-interval", ""))
    if save.isdigit() and int(save) > 0:  # only `reliability` uses it: another value is a note, not an error
        return {"reliability": {"checkpoint_interval_steps": int(save)}}
    if save:
        notes.append(f"--save-interval {printable(save)[:40]!r} is not a whole number >= 1 (a shell variable?): the "
                     f"job's checkpoint interval is not set beside the optimal one")
    return {}


def ds_config_keys(path: Optional[Path], sharding: str, dtype: str, micro: Optional[int],
             notes: list[str]) -> tuple[dict, dict, Optional[int]]:
    """What a Megatron-DeepSpeed script's ds config at ``path`` sets
    (:func:`~meshplan.interop.megatron_deepspeed.ds_tables`); nothing where it did not resolve. A
    micro-batch from the JSON alone gets a note: Megatron-DeepSpeed asserts ``--micro-batch-size``
    is given (``megatron/arguments.py:164`` at f4157be), its data loader's size."""
    if path is None:
        return {}, {}, None
    stage = {"none": 0, "zero1": 1, "zero2": 2, "zero3": 3}[sharding]
    out = ds_tables(ds_config(path, stage), stage, dtype, micro)
    if micro is None and out[2] is not None:
        notes.append(f"micro-batch {out[2]} from {path.name}'s train_micro_batch_size_per_gpu: give the script "
                     f"--micro-batch-size {out[2]} too (Megatron-DeepSpeed asserts it is given; its data loader "
                     f"reads it)")
    return out
