"""Sizes the memory timeline moves around, bytes on one rank of one pipeline stage
(:func:`stage_sizes`): the layers' and the head's activations and working sets
(:mod:`meshplan.memory.workingset`, computed once for all stages: :func:`common_sizes`), the
stage's FSDP units (:mod:`meshplan.memory.units`), DeepSpeed's gradient buffers
(:mod:`meshplan.memory.buffers`), DeepEP's buffer (:mod:`meshplan.memory.deepep_buffers`), Transformer
Engine's userbuffers (:mod:`meshplan.memory.userbuffers`) and fp8 weight copies
(:mod:`meshplan.memory.te_fp8`), the persistent state at init (:func:`init_entries`) and the
optimizer step's temporaries (:func:`step_entries`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from meshplan.compute.batch_input import core_key_bytes
from meshplan.mesh.resolve import Mesh
from meshplan.spec.memory import MemoryOptions
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec
from meshplan.spec.wording import shard_words, state_how
from meshplan.units import dtype_bytes, human_bytes
from meshplan.memory.buffers import bf16_lp_grad_bytes, bf16_step_bucket_bytes, bucket_what, deepspeed3_bucket_bytes, \
    deepspeed3_ipg_bytes, hpz_secondary_bytes, hpz_secondary_words, ipg_elements
from meshplan.memory.deepep_buffers import BufferBytes, entry as deepep_entry, rank_buffer
from meshplan.memory.deepspeed_fetch import deepspeed_reuse, layer_param_bytes
from meshplan.memory.userbuffers import entry as ub_entry
from meshplan.memory.offload import gpu_staging_entries
from meshplan.memory import te_fp8
from meshplan.memory.pass_sizes import ActSizes, StageSizes
from meshplan.memory.state import StateBytes
from meshplan.memory.units import explicit_forward_prefetch, units
# the working sets' names, importable from here too (their home: workingset)
from meshplan.memory.workingset import float8_copies, head_sizes, layer_act_sizes  # noqa: F401


def init_entries(state: StateBytes, fsdp_grads: bool, comm_axes: list[str], opts: MemoryOptions,
                 training: TrainingSpec, origin: str = "", names: tuple[str, ...] = (),
                 deepep: Optional[BufferBytes] = None) -> tuple:
    """Persistent state (by kind, group and sharding axis, in the runtime's words:
    :func:`meshplan.spec.wording.state_how`, the axis as the mesh ``names`` it:
    :func:`~meshplan.spec.wording.shard_words`; ``origin``: the config's foreign format), NCCL
    buffers, DeepEP's buffer (``deepep``: :func:`meshplan.memory.deepep_buffers.rank_buffer`) and
    workspace."""
    out = []
    for it in state.items:
        if it.kind == "grads" and fsdp_grads:
            continue
        how = state_how(training, shard_words(it.axis, names, training.sharding), it.divisor, origin)
        out.append((None, it.kind, it.size_bytes, f"{it.name}: {it.count:,} x {it.bytes_per_element} B, {how}"))
    for axis in comm_axes:
        out.append((None, "comm_buffers", opts.comm_bytes_per_group,
                    f"NCCL communicator {axis}: NCCL_BUFFSIZE {human_bytes(opts.nccl_buffsize_bytes)} x "
                    f"{opts.nccl_channels} channels x {opts.nccl_peers} peers"))
    out.extend(deepep_entry(deepep))
    out.append((None, "workspace", opts.workspace_bytes, f"cuBLAS workspace {human_bytes(opts.workspace_bytes)}"))
    out.append((None, "params", hpz_secondary_bytes(training, state.params.total),
                hpz_secondary_words(training, state.params.total)))
    out.append((None, "grads", bf16_lp_grad_bytes(training, state.params.total), f"BF16_Optimizer's bf16 gradients "
                f"(param.grad, kept beside the fp32 ones from each backward to the next): {state.params.total:,} x "
                f"{dtype_bytes(training.param_dtype)} B, whole on every rank"))
    ipg = deepspeed3_ipg_bytes(training, opts)
    out.append((None, "grad_buffers", ipg, f"DeepSpeed ZeRO-3 ipg buffer: reduce_bucket_size "
                f"{opts.deepspeed_bucket_elements():,} x {dtype_bytes(training.gradient_reduce_dtype)} B "
                f"({training.gradient_reduce_dtype}, contiguous_gradients), allocated at init"))
    return tuple(e for e in out if e[2])


def step_entries(state: StateBytes, training: TrainingSpec, opts: MemoryOptions, fsdp_grads: int) -> tuple:
    """Optimizer step: ``BF16_Optimizer``'s gradient all-reduce bucket, allocated and freed
    (:func:`~meshplan.memory.buffers.bf16_step_bucket_bytes`), its temporaries
    (:meth:`MemoryOptions.optimizer_temp_states_for`: one state-sized ``sqrt`` under torch's foreach
    Adam, none under the fused step), then FSDP's sharded grads freed (zero_grad)."""
    temp = opts.optimizer_temp_bytes(training, state.bytes_of("optimizer"))
    n = opts.optimizer_temp_states_for(training)
    bucket = bf16_step_bucket_bytes(training, state.params.total)
    out = [(None, "grad_buffers", bucket, f"BF16_Optimizer's all-reduce: one flattened bucket of fp32 gradients, "
            f"cast to {training.gradient_reduce_dtype}"), (None, "grad_buffers", -bucket, "all-reduce bucket freed"),
           (None, "temporaries", temp, f"optimizer step: {n:g} state-sized temporaries"),
           (None, "temporaries", -temp, "optimizer step: temporaries freed"),
           (None, "grads", -fsdp_grads, "zero_grad(set_to_none): sharded gradients freed")]
    return tuple(e for e in out if e[2])


@dataclass(frozen=True)
class CommonSizes:
    """The sizes every stage of a plan shares: a dense and an MoE layer's activations and
    the embedding and head's (:func:`head_sizes`)."""

    dense: ActSizes
    moe: ActSizes
    head: dict
    dense_checkpointed: Optional[ActSizes] = None  # per-layer recompute: the layers checkpointed in full
    moe_checkpointed: Optional[ActSizes] = None

    def layer(self, training: TrainingSpec, moe: bool, checkpointed: bool) -> ActSizes:
        """The sizes of a layer, ``checkpointed`` or not
        (:meth:`~meshplan.spec.training.TrainingSpec.stage_recomputed`)."""
        if training.per_layer_recompute and checkpointed:
            return (self.moe_checkpointed if moe else self.dense_checkpointed) or (self.moe if moe else self.dense)
        return self.moe if moe else self.dense


def common_sizes(model: ModelSpec, training: TrainingSpec, mesh: Mesh, opts: MemoryOptions) -> CommonSizes:
    """:class:`CommonSizes` of ``model`` on ``mesh`` (computed once for all stages)."""
    dense = layer_act_sizes(model, training, mesh, opts)
    moe = layer_act_sizes(model, training, mesh, opts, moe=True) if model.is_moe else dense
    ck = ck_moe = None
    if training.per_layer_recompute:
        ck = layer_act_sizes(model, training, mesh, opts, checkpointed=True)
        ck_moe = layer_act_sizes(model, training, mesh, opts, moe=True, checkpointed=True) if model.is_moe else ck
    return CommonSizes(dense, moe, head_sizes(model, training, mesh, opts), ck, ck_moe)


def batch_mask_bytes(training: TrainingSpec, mesh: Mesh, stage: int) -> tuple[int, int]:
    """(bytes on the GPU after ``get_batch_on_this_tp_rank``, bytes kept after
    ``get_batch_on_this_cp_rank``) of Megatron Core's data-loader attention mask on ``stage``
    (``training.core_attention_mask``; (0, 0) otherwise or on a middle stage). Read at
    NVIDIA/Megatron-LM d98e8a64dd: the loader's ``[b, 1, s, s]`` bool mask (1 B an element,
    :func:`meshplan.compute.batch_input.core_key_bytes`) is pinned host memory
    (``data_samplers.py:115``), not the GPU's; ``get_batch`` (``pretrain_gpt.py:110-160``) runs on
    the first and last stage only, where tp rank 0 copies it to the GPU (``.cuda(non_blocking=True)``,
    136-142) and every other tp rank allocates its broadcast buffer of the same shape
    (``megatron/core/utils.py:2337-2342``, ``torch.empty((b, 1, s, s), dtype=torch.bool)``): ``b x s x s``
    bytes on every rank of the stage. At cp > 1 ``_get_batch_on_this_cp_rank_per_sequence_balancing``
    (``utils.py:2504-2560``) ``index_select``s its two zigzag chunks of rows along dim 2 into a new
    tensor, ``b x (s / cp) x s``, and the full copy is freed as the batch dict's entry is replaced. The
    mask is a local of ``forward_step`` (``pretrain_gpt.py:295-380``), passed to the model and not saved
    for backward: freed when the chunk's forward returns (:meth:`meshplan.memory.passes.PassBuilder._forward`).

    >>> from meshplan.mesh.resolve import resolve_mesh
    >>> from meshplan.spec.mesh import MeshSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=8192, framework="megatron", megatron_runtime="core")
    >>> m = resolve_mesh(MeshSpec(names=["pp", "cp", "tp"], shape=[4, 2, 2]), 16)
    >>> batch_mask_bytes(t, m, 0), batch_mask_bytes(t, m, 1), batch_mask_bytes(t, m, 3)
    ((67108864, 33554432), (0, 0), (67108864, 33554432))
    """
    pp = mesh.degree("pp")
    if not training.core_attention_mask or stage not in (0, pp - 1):
        return 0, 0
    full = core_key_bytes("attention_mask", training.micro_batch, training.seq_len)
    return full, full // mesh.degree("cp")


def stage_sizes(model: ModelSpec, training: TrainingSpec, mesh: Mesh, stages, state: StateBytes,
                opts: MemoryOptions, comm_axes: list[str], common: Optional[CommonSizes] = None,
                origin: str = "", cuda_sm: int = 0) -> StageSizes:
    """All sizes of stage ``state.stage`` (``stages``: ``pipeline.stage_layers`` output);
    ``common``: :func:`common_sizes` of the same arguments when already computed; ``origin``:
    the config's foreign format (:attr:`meshplan.config.Config.origin`), for the words of the
    state's notes; ``cuda_sm``: the GPU's compute capability x 10 (whether Transformer Engine keeps
    fp8 weight transposes, :func:`meshplan.memory.te_fp8.tn_only`; 0 unknown: kept)."""
    k = state.stage
    us = units(model, training, mesh, stages, state, ipg_elements(training, opts))
    fsdp = any(u.gathered for u in us.values())
    layers = [i for chunk in stages[k] for i in chunk]
    common = common or common_sizes(model, training, mesh, opts)
    checkpointed = dict(zip(layers, training.stage_recomputed(stages[k])))
    acts = {i: common.layer(training, model.is_moe_layer(i), checkpointed[i]) for i in layers}
    hs = common.head
    bucket = deepspeed3_bucket_bytes(model, training, mesh, stages, k, opts, state.params.total) if fsdp \
        else opts.grad_bucket_bytes(training, mesh.degree("fsdp"), state.params.total)
    fsdp_grads = sum(u.grads for u in us.values()) if fsdp else 0
    reuse = deepspeed_reuse(model, training, mesh, opts.deepspeed_max_reuse_elements) if fsdp else None
    deepep = rank_buffer(model, training, mesh.ep, mesh.etp, any(model.is_moe_layer(i) for i in layers))
    return StageSizes(
        stage=k, chunks=tuple(tuple(c) for c in stages[k]), acts=acts, units=us,
        embedding_saved=hs["embedding_saved"] if k == 0 else 0, head_saved=hs["head_saved"],
        head_loss_saved=hs["head_loss_saved"], head_output_saved=hs["head_output_saved"],
        logits_temp=hs["logits_temp"], logits_extra=hs["logits_extra"], loss_grad_extra=hs["loss_grad_extra"],
        loss_grad_kept=hs["loss_grad_kept"],
        logits_grad_temp=hs["logits_grad_temp"], dy=hs["dy"], final_norm_work=hs["final_norm_work"],
        embedding_grad_extra=hs["embedding_grad_extra"] if k == 0 and fsdp else 0,
        embedding_backward_work=hs["embedding_backward_work"] if k == 0 and fsdp else 0, fsdp=fsdp,
        reshard_after_forward=training.reshard_after_forward,
        fsdp_reduce=opts.fsdp_reduce_for(training, mesh.degree("pp")),
        embedding_reshards=training.torchtitan_units and training.reshard_after_forward and (
            not model.tied_embeddings or training.reshard_head_after_forward),
        head_reshards=training.reshard_head_after_forward or not getattr(reuse, "head_kept", True),
        reshard_after_backward=training.grad_accumulation == "no_sync",
        reduce_deferred=mesh.degree("pp") > 1,
        prefetch=opts.prefetch_layers, bucket=bucket,
        forward_prefetch=max(opts.forward_prefetch_layers, explicit_forward_prefetch(training, mesh)),
        # DeepSpeed ZeRO-1/2 allocates its bucket buffers at every backward's first gradient hook
        bucket_every_backward=training.sharding == "zero2" or training.zero12_engine == "deepspeed" or fsdp,
        bucket_what=bucket_what(training), deepspeed_prefetch=opts.deepspeed_prefetch_bytes(training),
        deepspeed_params=layer_param_bytes(model, training, mesh) if opts.deepspeed_prefetch_bytes(training) else (),
        deepspeed_kept=reuse.kept if reuse is not None else (),
        recompute=training.recompute,
        layer_recompute={i: training.layer_policy(ck) for i, ck in checkpointed.items()}
        if training.per_layer_recompute else None,
        init=init_entries(state, fsdp, comm_axes, opts, training, origin, mesh.layout.names, deepep)
        + ub_entry(model, training, mesh) + te_fp8.cache_entry(state.params.fp8_params, training, cuda_sm)
        + gpu_staging_entries(model, training, mesh),
        step=step_entries(state, training, opts, fsdp_grads), batch_mask=batch_mask_bytes(training, mesh, k))
