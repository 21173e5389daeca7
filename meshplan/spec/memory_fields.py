"""The fields of the optional ``[memory]`` table, with their bounds and defaults: the base of
:class:`meshplan.spec.memory.MemoryOptions`, whose docstring gives each field's meaning and the
source of its default.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from meshplan.limits import BOUNDS

MiB = 2**20


class MemoryFields(BaseModel):
    """The ``[memory]`` fields (documented on :class:`meshplan.spec.memory.MemoryOptions`): units
    bytes (``*_bytes``), elements (``*_elements``) or fractions."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    prefetch_layers: int = Field(default=1, ge=0, le=BOUNDS["layers"].value)
    forward_prefetch_layers: int = Field(default=0, ge=0, le=BOUNDS["layers"].value)
    fsdp_reduce: Optional[Literal["per_microbatch", "after_last"]] = None
    grad_bucket_elements: Optional[int] = Field(default=None, gt=0, le=BOUNDS["bytes"].value)
    deepspeed_prefetch_elements: Optional[int] = Field(default=None, ge=0, le=BOUNDS["bytes"].value)
    deepspeed_max_live_elements: Optional[int] = Field(default=None, ge=0, le=BOUNDS["bytes"].value)
    deepspeed_max_reuse_elements: Optional[int] = Field(default=None, ge=0, le=BOUNDS["bytes"].value)
    nccl_buffsize_bytes: int = Field(default=4 * MiB, ge=0, le=BOUNDS["bytes"].value)
    nccl_channels: int = Field(default=16, ge=0, le=BOUNDS["nccl_channels"].value)
    nccl_peers: int = Field(default=2, ge=0, le=BOUNDS["world"].value)
    workspace_bytes: int = Field(default=32 * MiB, ge=0, le=BOUNDS["bytes"].value)
    fragmentation_fraction: float = Field(default=0.0, ge=0, lt=1)
    expandable_segments: bool = False
    reserved_verdict: bool = False
    optimizer_temp_states: Optional[float] = Field(default=None, ge=0, le=BOUNDS["optimizer_temp_states"].value)
    logits_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    dropout: bool = False
    cross_entropy: Literal["megatron", "torch", "compiled"] = "megatron"
    sp_gathered_input: bool = False
    unfused_norm: bool = False
    kv_expanded: bool = False
    embedding_grad_full_vocab: bool = False
    embedding_backward_work: bool = False
    fused_glu: Optional[bool] = None
