"""Training contract: batch, sequence, dtypes, optimizer, sharding, recompute, reserve."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from meshplan.limits import BOUNDS

Dtype = Literal["fp32", "bf16", "fp16", "fp8"]


class TrainingSpec(BaseModel):
    """What one optimizer step must do and how state is kept.

    ``global_batch``: sequences per optimizer step; ``seq_len``: tokens per sequence;
    ``micro_batch``: sequences per data-parallel rank per forward pass.
    ``sharding``: ``none`` (DDP), ``zero1`` (optimizer state and fp32 master sharded),
    ``zero2`` (+ gradients), ``zero3`` (+ parameters: FSDP, ``reshard_after_forward``
    chooses ZeRO-3 (true) or keeps gathered parameters from forward to backward (false)),
    ``hsdp`` (zero3 within dp_shard, replicated over dp_replicate).
    ``memory_reserve``: fraction of HBM kept free (allocator, NCCL, headroom).
    ``vocab_pad_divisor``: Megatron's ``make-vocab-size-divisible-by`` (default 128).
    ``grad_reduce_dtype``: dtype of the gradient reduction over the data axes: ``fp32``
    (Megatron-LM's DDP and distributed optimizer reduce fp32 main gradients,
    ``--accumulate-allreduce-grads-in-fp32``), ``bf16``, or ``param`` (the parameter dtype);
    unset: ``reduce_dtype`` for zero1/zero2/zero3/hsdp (FSDP2's ``MixedPrecisionPolicy``) and
    the parameter dtype for ``none`` (torch DDP reduces the gradients as they are).
    ``tp_comm_overlap``: TP collectives overlap the GEMMs of their block (Megatron-LM
    ``--tp-comm-overlap``, Transformer Engine userbuffers); off: they block (torchtitan's
    default).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    global_batch: int = Field(gt=0, le=BOUNDS["global_batch"].value)
    seq_len: int = Field(gt=0, le=BOUNDS["seq_len"].value)
    micro_batch: int = Field(default=1, gt=0, le=BOUNDS["micro_batch"].value)
    param_dtype: Dtype = "bf16"
    compute_dtype: Dtype = "bf16"
    grad_dtype: Dtype = "fp32"
    optimizer_dtype: Dtype = "fp32"
    reduce_dtype: Dtype = "fp32"
    master_weights: bool = True
    optimizer: Literal["adam", "adamw", "sgd"] = "adam"
    sharding: Literal["none", "zero1", "zero2", "zero3", "hsdp"] = "zero3"
    reshard_after_forward: bool = True
    recompute: Literal["none", "selective", "full"] = "selective"
    flash_attention: bool = True
    memory_reserve: float = Field(default=0.10, ge=0, lt=1)
    vocab_pad_divisor: int = Field(default=128, gt=0, le=BOUNDS["vocab_pad_divisor"].value)
    grad_reduce_dtype: Optional[Literal["fp32", "bf16", "param"]] = None
    tp_comm_overlap: bool = False

    @model_validator(mode="after")
    def _check(self):
        if self.micro_batch > self.global_batch:
            raise ValueError(f"micro_batch {self.micro_batch} > global_batch {self.global_batch}")
        return self

    @property
    def optimizer_states(self) -> int:
        """Optimizer state tensors per parameter: Adam keeps two moments (Kingma & Ba 2015)."""
        return 2 if self.optimizer in ("adam", "adamw") else 0

    @property
    def keeps_master(self) -> bool:
        """An fp32 master copy exists when parameters are stored below fp32."""
        return self.master_weights and self.param_dtype != "fp32"

    @property
    def gradient_reduce_dtype(self) -> Dtype:
        """The dtype gradients are reduced in over the data axes (see ``grad_reduce_dtype``).

        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="none").gradient_reduce_dtype
        'bf16'
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="none", grad_reduce_dtype="fp32").gradient_reduce_dtype
        'fp32'
        >>> TrainingSpec(global_batch=8, seq_len=16, sharding="zero3").gradient_reduce_dtype
        'fp32'
        """
        if self.grad_reduce_dtype is None:
            return self.param_dtype if self.sharding == "none" else self.reduce_dtype
        return self.param_dtype if self.grad_reduce_dtype == "param" else self.grad_reduce_dtype
