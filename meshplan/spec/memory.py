"""Memory-timeline parameters: the optional ``[memory]`` table of a config.

Every transient the timeline adds that is not derived from the model, the mesh and the
training contract is a field here, with its default and the default's source, so no
factor is hidden. Units are bytes (``*_bytes``), elements (``*_elements``) or fractions.

>>> MemoryOptions().comm_bytes_per_group == 4 * 2**20 * 16 * 2
True
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

MiB = 2**20


class MemoryOptions(BaseModel):
    """Stated parameters of :func:`meshplan.memory.timeline.memory_timeline`.

    - ``prefetch_layers``: FSDP units all-gathered ahead of the one being computed, in
      forward and in backward. Default 1: FSDP2's implicit prefetch (the next unit's
      all-gather is issued before the current unit's compute; torch ``fully_shard`` docs,
      ``set_modules_to_forward_prefetch`` for more). 0: no prefetch.
    - ``fsdp_reduce``: when FSDP (zero3/hsdp) reduce-scatters gradients. ``per_microbatch``
      (FSDP2's default, and what :mod:`meshplan.collectives` counts); ``after_last``:
      ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)`` on all
      but the last micro-batch, as ``torch.distributed.pipelining`` does (stage.py,
      ``backward_maybe_with_nosync`` and ``perform_reduce_grad``): unsharded parameters stay
      gathered and unsharded gradients accumulate in the reduce dtype.
    - ``grad_bucket_elements``: gradient bucket of the non-FSDP shardings (none, zero1,
      zero2). None: Megatron-Core's default ``max(40_000_000, 1_000_000 x dp_size)``
      elements (``DistributedDataParallelConfig.bucket_size``; dp_size includes cp). FSDP
      (zero3/hsdp) always reduces one unit (one layer) at a time (FSDP2).
    - ``nccl_buffsize_bytes`` x ``nccl_channels`` x ``nccl_peers`` per communicator (one per
      mesh axis with collectives): ``NCCL_BUFFSIZE`` default 4 MiB (NCCL environment
      variables docs); 16 channels and 2 peers (ring: previous and next rank) are stated
      assumptions: NCCL picks 2-32 channels per communicator by topology (read them from
      ``NCCL_DEBUG=INFO``). Allocated by NCCL outside PyTorch's caching allocator.
    - ``workspace_bytes``: cuBLAS workspace of the compute stream, PyTorch's default on
      sm90 (``CUBLAS_WORKSPACE_CONFIG=:4096:8``, 8 x 4 MiB = 32 MiB;
      aten/src/ATen/cuda/CublasHandlePool.cpp).
    - ``fragmentation_fraction``: allocator allowance as a fraction of the peak of all the
      other kinds. Default 0: not modelled, ``training.memory_reserve`` is the headroom that
      covers it; set e.g. 0.05 to add 5%.
    - ``optimizer_temp_states``: temporaries of the optimizer step, in units of one
      optimizer-state shard (optimizer dtype). Default 1: torch's foreach Adam allocates
      ``exp_avg_sq.sqrt()`` for every parameter (torch/optim/adam.py,
      ``_multi_tensor_adam``); fused Adam (torch ``fused=True``, apex/TE FusedAdam): 0.
    - ``logits_dtype``: logits the loss keeps for backward (Megatron's vocab-parallel cross
      entropy keeps the fp32 softmax); ``dropout``: attention and residual dropout (False
      for Llama-style pretraining, True for GPT as in Korthikanti Table 2).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefetch_layers: int = Field(default=1, ge=0)
    fsdp_reduce: Literal["per_microbatch", "after_last"] = "per_microbatch"
    grad_bucket_elements: Optional[int] = Field(default=None, gt=0)
    nccl_buffsize_bytes: int = Field(default=4 * MiB, ge=0)
    nccl_channels: int = Field(default=16, ge=0)
    nccl_peers: int = Field(default=2, ge=0)
    workspace_bytes: int = Field(default=32 * MiB, ge=0)
    fragmentation_fraction: float = Field(default=0.0, ge=0, lt=1)
    optimizer_temp_states: float = Field(default=1.0, ge=0)
    logits_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    dropout: bool = False

    @property
    def comm_bytes_per_group(self) -> int:
        """NCCL buffer bytes of one communicator: buffsize x channels x peers."""
        return self.nccl_buffsize_bytes * self.nccl_channels * self.nccl_peers

    def bucket_elements(self, dp_size: int) -> int:
        """Gradient bucket of the non-FSDP shardings, elements (see the class docstring).

        >>> MemoryOptions().bucket_elements(8), MemoryOptions().bucket_elements(128)
        (40000000, 128000000)
        """
        if self.grad_bucket_elements is not None:
            return self.grad_bucket_elements
        return max(40_000_000, 1_000_000 * dp_size)
