"""The sizes one pass of the memory timeline reads, bytes per rank: a layer's activations
(:class:`ActSizes`) and its backward's steps (:class:`BackStep`), one FSDP unit
(:class:`Unit`), and everything a pass of one pipeline stage needs (:class:`StageSizes`).
Built by :mod:`meshplan.memory.sizes`, :mod:`meshplan.memory.workingset` and
:mod:`meshplan.memory.units`; read by :class:`meshplan.memory.passes.PassBuilder`, whose
docstring gives the conventions."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Union


UnitKey = Union[int, str]  # a layer index, "embedding" or "head"


@dataclass(frozen=True)
class BackStep:
    """One step of a layer's backward, in autograd's order: while it runs it holds
    ``work`` bytes of gradients of activations (``temporaries``); it writes the unsharded
    gradients of its weights (``grads``, compute dtype, FSDP only); at its end it frees
    ``frees`` bytes of the layer's activations (the saved tensors it consumed)."""

    name: str
    work: int
    grads: int
    frees: int


@dataclass(frozen=True)
class ActSizes:
    """Activation bytes of one layer for one micro-batch on one rank: ``saved`` (kept for
    backward under the recompute policy), ``rework`` (recomputed at the start of the
    layer's backward, freed by its steps), ``fwd_temp`` and ``bwd_temp`` (working sets;
    ``bwd_temp`` the largest step's), ``steps`` the backward (:class:`BackStep`, whose
    ``frees`` sum to ``saved + rework``; empty: one step with everything); ``fwd_what``:
    ``fwd_temp``'s name in the events: sequence parallelism's all-gathered layer input (tp > 1
    with SP), context parallelism's K/V buffers (:mod:`meshplan.memory.cp_buffers`) or the
    forward's working set."""

    saved: int
    rework: int
    fwd_temp: int
    bwd_temp: int
    steps: tuple = ()
    fwd_what: str = "forward working set"


@dataclass(frozen=True)
class Unit:
    """One FSDP unit (a layer, the embedding or the head) of one stage, bytes per rank:
    ``gathered`` unsharded parameters in the compute dtype (0 when not FSDP-sharded),
    ``grad_unsharded`` autograd's weight gradient (compute dtype), ``reduce_input`` the
    reduce-scatter input (reduce dtype), ``grads`` its share of the sharded gradient;
    ``early``: for the root, the part of ``grad_unsharded`` the head's backward writes;
    ``deferred``: the part of its all-gather output FSDP2 keeps past its copy-out in forward,
    its last parameter group's (0: all of it; :func:`meshplan.memory.units.units`)."""

    name: str
    layer: Optional[int]
    gathered: int
    grad_unsharded: int
    reduce_input: int
    grads: int
    early: int = 0
    deferred: int = 0


@dataclass(frozen=True)
class StageSizes:
    """Everything a pass of stage ``stage`` needs (see :func:`meshplan.memory.sizes.stage_sizes`)."""

    stage: int
    chunks: tuple[tuple[int, ...], ...]
    acts: dict
    units: dict
    embedding_saved: int
    head_saved: int
    head_loss_saved: int
    head_output_saved: int
    logits_temp: int
    logits_grad_temp: int
    logits_extra: int
    loss_grad_extra: int
    loss_grad_kept: int
    final_norm_work: int
    embedding_grad_extra: int
    embedding_backward_work: int
    dy: int
    fsdp: bool
    reshard_after_forward: bool
    fsdp_reduce: str
    prefetch: int
    forward_prefetch: int
    bucket: int
    bucket_every_backward: bool
    recompute: str
    init: tuple
    step: tuple
    # per-layer recompute (TrainingSpec.per_layer_recompute): layer -> "full" or "none", its event's word
    layer_recompute: Optional[dict] = None
    reshard_after_backward: bool = False  # without a reduce (fsdp_reduce "after_last"): grad_accumulation no_sync
    embedding_reshards: bool = False  # the embedding's own unit resharded after forward (torchtitan's units)
    head_reshards: bool = False  # the unit holding the output layer too (training.reshard_head_after_forward)
    reduce_deferred: bool = False  # pp > 1: the last backward reduces after the pass (PipelineStage.perform_reduce_grad)
    bucket_what: str = "gradient bucket (reduce dtype)"  # the bucket's label in the timeline
    # DeepSpeed ZeRO-3 (zero3_engine "deepspeed"): (prefetch bytes, live bytes) of its coordinator, else None
    deepspeed_prefetch: Optional[tuple[int, int]] = None
    # of its layer, the parameters' gathered bytes in trace order (its prefetch runs to their boundaries)
    deepspeed_params: tuple[int, ...] = ()
    # bytes of each layer its stage3_max_reuse_distance keeps from its forward to its backward (one stage)
    deepspeed_kept: tuple[int, ...] = ()
    # Megatron Core's data-loader attention mask on this stage: (GPU copy, kept after the cp slice), bytes
    # (meshplan.memory.sizes.batch_mask_bytes): held through the forward of the chunk that runs get_batch
    batch_mask: tuple[int, int] = (0, 0)
    # ZB-H1: output gradients held by the stage's lagging weight-gradient passes during each backward
    # pass (meshplan.memory.wlag.lag_hold_bytes; 0 where W is folded into B)
    w_lag: int = 0
    # ZB-H1 on the head's stage: (the logits gradient W keeps) - (the loss terms torch's input-gradient pass
    # frees), from the end of each head forward to the start of its W (meshplan.memory.wlag.head_lag_bytes)
    head_lag: int = 0

    @cached_property
    def step_events(self) -> dict:
        """The events of each layer's backward steps by (layer, first backward of the chunk),
        filled by :meth:`meshplan.memory.passes.PassBuilder._layer_backward` as its passes
        are built (a frozen dataclass: the sizes they read never change)."""
        return {}

    def chunk_units(self, chunk: int) -> tuple[UnitKey, ...]:
        """FSDP units used by a pass of ``chunk``, in forward order."""
        keys: list[UnitKey] = [k for k in ("root", "embedding") if chunk == 0 and k in self.units]
        keys += list(self.chunks[chunk])
        return tuple(keys + (["head"] if chunk == len(self.chunks) - 1 and "head" in self.units else []))
