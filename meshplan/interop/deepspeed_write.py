"""meshplan config -> DeepSpeed JSON config (``export --to deepspeed``): the inverse of
:func:`meshplan.interop.deepspeed.read`, for ZeRO over one data axis
(:data:`~meshplan.interop.deepspeed.DS_SCOPE`). The ZeRO knobs are written back as
:mod:`meshplan.interop.deepspeed_zero` reads them; DeepSpeed's ``BF16_Optimizer``
(:attr:`~meshplan.spec.training.TrainingSpec.bf16_optimizer`) as ZeRO stage 0 with bf16, with
``communication_data_type`` when the reduce dtype is not bf16. No ``activation_checkpointing``
section is written: no DeepSpeed key turns activation checkpointing on (the HF Trainer's
``--gradient_checkpointing`` does, or model code calling ``deepspeed.checkpointing``; the
section only configures those calls), so ``recompute = "full"`` is said in the export's header
(:func:`meshplan.interop.deepspeed_carry.checkpointing_line`) and read back with
``--gradient-checkpointing`` (newcomer trial nc52 #8: an empty section, which the HF Trainer
ignores, stood for it). A user's own section is carried (:func:`~meshplan.interop.deepspeed_carry.with_section`).
"""

from __future__ import annotations

from typing import Any

from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.interop.deepspeed import DS_SCOPE, STAGES
from meshplan.interop.deepspeed_zero import PREFETCH_KEYS
from meshplan.spec.training_checks import zeropp_keys_set
from meshplan.interop.tomlout import resolved


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
    stage = 0 if t.bf16_optimizer else {v: k for k, v in STAGES.items()}[t.sharding]
    zero: dict[str, Any] = {"stage": stage}
    comm: dict[str, Any] = {}
    if t.bf16_optimizer:  # BF16_Optimizer: ZeRO stage 0 with bf16 (deepspeed_zero.bf16_optimizer_training)
        if t.gradient_reduce_dtype != t.param_dtype:
            comm["communication_data_type"] = t.gradient_reduce_dtype  # unset: bf16
    elif t.zero12_engine == "deepspeed":  # the plan's bucket and stream (meshplan.comm.deepspeed_zero12)
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
        zero |= {k: getattr(t, k) for k in zeropp_keys_set(t)}  # ZeRO++, as read (deepspeed_zeropp.zeropp_training)
    if t.offload_optimizer == "cpu":  # ZeRO-Offload, as deepspeed_offload.offload_training reads it
        zero["offload_optimizer"] = {"device": "cpu"}  # pin_memory: DeepSpeed's default true, or the user's, carried
    if (stage in (1, 2) and t.grad_reduce_dtype is not None) or (stage in (1, 2, 3)
                                                               and t.gradient_reduce_dtype != t.param_dtype):
        comm["communication_data_type"] = t.gradient_reduce_dtype  # DeepSpeed's unset is the model's dtype
    if (stage == 1 and t.grad_dtype != t.param_dtype) or (stage == 3 and t.grad_dtype != t.param_dtype):
        # ZeRO-1's param.grad_accum, ZeRO-3's gradient partition (deepspeed_zero's docstring)
        comm["data_types"] = {"grad_accum_dtype": t.grad_dtype}
    return {"train_batch_size": t.global_batch, "train_micro_batch_size_per_gpu": t.micro_batch,
            "gradient_accumulation_steps": accumulate, "zero_optimization": zero} | comm | {
            "bf16": {"enabled": t.compute_dtype == "bf16"}, "fp16": {"enabled": t.compute_dtype == "fp16"},
            "gradient_clipping": (t.grad_clip_norm or 1.0) if t.grad_clip else 0.0}
