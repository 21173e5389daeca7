"""Gradients that the tp ranks must sum because the weight behind them is replicated over tp:
the norms under sequence parallelism, an MoE router, multi-head latent attention's down
projections and latent norms, and the copies of a KV head past ``kv_heads``; rows of the
collective table (:func:`meshplan.comm.collectives.collective_table`).

- SP norms (Korthikanti et al. 2022, 4.2.2): the replicated norm weights get their gradients
  all-reduced over tp in backward (one per norm parameter, h elements in compute dtype; FSDP2
  issues it in its gradient reduction, so with pp > 1, where ``PipelineStage`` turns gradient
  sync off for every backward but the last, once per step: measured, torch 2.13 gloo). Without
  FSDP to reduce them in backward, those gradients stay Partial DTensors and the optimizer
  step all-reduces each at every op that reads it: once with the fused AdamW, 3 times with
  the foreach one (:data:`PARTIAL_GRAD_READS`, by ``training.optimizer_impl``). Megatron-LM
  2022 coalesces them into one all-reduce per step (:func:`sp_norm_grad_rows`).
- TP with MoE layers: the router weight, replicated over tp, gets a Partial gradient: one
  all-reduce of experts*h elements per MoE layer, issued with the SP norms'. Measured with
  torch 2.13 (fake process group and gloo, ``tests/test_validate_moe.py``).
- TP with multi-head latent attention (:func:`_mla_grad_rows`, torchtitan's DeepSeek-V3 plan,
  framework torch): the replicated down projections and latent norms get Partial gradients,
  one all-reduce over tp per weight and layer, issued with the SP norms'.
- TP past the KV heads (tp > kv_heads, handed case C6; :func:`_kv_replica_rows`): each KV
  head is copied on ``r = tp / kv_heads`` tp ranks; once per step, before the optimizer, one
  all-reduce (sum) per layer of the copies' wk/wv gradients over those ``r`` ranks (axis
  ``kv_replica``), so the copies stay equal: meshplan's own runtime's copies (framework torch,
  whose plans refuse tp past the KV heads: rule ``torch_kv_heads``); framework megatron copies no
  KV head (:mod:`meshplan.spec.axes.tp_kv`) and has no such row.
"""

from __future__ import annotations

import numpy as np

from meshplan.comm.stage_context import StageContext
from meshplan.compute.megatron import stage_param_tensors
from meshplan.mesh.resolve import Mesh
from meshplan.mesh.tpsplit import KV_REPLICA, kv_replica_groups, local_heads, local_numel, local_rows, padded_numel
from meshplan.spec.axes.tp_kv import qkv_gathered
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec
from meshplan.units import dtype_bytes


#: Cadence of Megatron-LM 2022's coalesced all-reduce of the SP norm gradients (one per step):
#: ``allreduce_layernorm_grads`` (NVIDIA/Megatron-LM 2755bcb megatron/optimizer/optimizer.py 270-290),
#: the first of ``reduce_model_grads`` (293-310; distrib_optimizer.py 522-541 under ZeRO-1), before
#: the data-parallel reduction; today ``_allreduce_non_tensor_model_parallel_grads`` (d98e8a6
#: megatron/core/distributed/finalize_model_grads.py 416-474). Step's readiness table prints it.
SP_NORM_COALESCED_CADENCE = ("once per step (Megatron-LM's allreduce_layernorm_grads: the sequence-parallel norm "
                             "and row-parallel bias weight gradients over tp, coalesced)")


#: All-reduces over tp of one Partial (sum) DTensor gradient in one Adam/AdamW step without FSDP,
#: by ``training.optimizer_impl``: DTensor redistributes a Partial input to Replicate at each op
#: that reads it (a sum, issued as an all-reduce) and keeps nothing. torch 2.13.0 (pytorch/pytorch
#: cf30153): ``"fused"`` 1, ``_fused_adam`` (torch/optim/adam.py 877-881) passes every gradient
#: once to ``torch._fused_adamw_``, which DTensor runs as one pointwise op
#: (torch/distributed/tensor/_ops/_pointwise_ops.py 545-552); ``"foreach"`` 3,
#: ``_multi_tensor_adam`` reads them in ``_foreach_lerp_`` (704-706) and twice in
#: ``_foreach_addcmul_`` (721-723); the single-tensor loop, ``lerp_`` (456) and ``addcmul_(grad,
#: grad)`` (475), also 3. Measured on 2 gloo ranks, Replicate parameters of 8 and 4 fp32 elements
#: with Partial gradients, each ``AdamW`` step recorded (runtime.execution.recorder): fused 2
#: all-reduces (32 B, 16 B), foreach and foreach=False 6 (3 of each).
PARTIAL_GRAD_READS = {"fused": 1, "foreach": 3}


def replicated_grad_rows(add, c: StageContext, size: int, count: int, cadence: str) -> None:
    """All-reduce over tp of ``count`` Partial gradients of weights replicated over tp (SP
    norms, an MoE router): in FSDP2's gradient reduction (once per step under a pipeline
    schedule), else in the optimizer step, :data:`PARTIAL_GRAD_READS` per gradient (1 with
    the fused AdamW, 3 with the foreach one)."""
    dt = c.training.compute_dtype
    if c.training.sharding in ("zero3", "hsdp") and c.mesh.degree("fsdp") > 1:
        pipelined = c.mesh.degree("pp") > 1
        add("tp", "backward", "all-reduce", size, dt, 0 if pipelined else count, cadence, "optimizer step", depth=0,
            per_step=count if pipelined else None)
    else:
        reads = PARTIAL_GRAD_READS[c.training.optimizer_impl]
        add("tp", "step", "all-reduce", size, dt, 0,
            f"{cadence}, {reads} per optimizer step ({c.training.optimizer_impl} AdamW, no FSDP)",
            "optimizer step", depth=0, per_step=reads * count)


def _mla_grad_rows(add, c: StageContext) -> None:
    """Multi-head latent attention under tp > 1, torchtitan's DeepSeek-V3 plan
    (``models/deepseek_v3/infra/parallelize.py``): the down projections ``wq_a`` and ``wkv_a``
    and the latent norms ``q_a_norm`` and ``kv_a_norm`` are replicated (``NoParallel``) and
    the attention's intermediates stay DTensors, so the gradients reaching them are Partial
    over tp and stay Partial: no activation collective beyond dense attention's, but each
    of those weights gets a Partial gradient, all-reduced over tp as the SP norms' are
    (:func:`replicated_grad_rows`), one all-reduce per weight per layer, its numel in
    compute dtype, with or without SP. DeepSeek-V2-Lite (no query compression) at tp 2,
    bf16: ``wkv_a`` 2048 x (512 + 64) x 2 B = 2,359,296 B and ``kv_a_norm`` 512 x 2 B =
    1,024 B per layer. Measured with torch 2.13 on the fake process group
    (:mod:`meshplan.runtime.execution.mla`, ``tests/test_mla_tp.py``). ``training.framework =
    "megatron"``: Megatron-Core's MLA splits its own way (not modelled here, no rows)."""
    if not c.model.is_mla or c.mesh.degree("tp") == 1 or c.training.framework != "torch":
        return
    for t in c.model.mla_tensors():
        if t.split == "replicated":
            replicated_grad_rows(add, c, t.numel * dtype_bytes(c.training.compute_dtype), len(c.layers),
                                  f"every layer (MLA {t.name} weight gradient)")


#: Cadence of the all-reduce that keeps the copies of a replicated KV head equal.
KV_REPLICA_CADENCE = "once per step, every layer (replicated KV heads: wk/wv gradients summed over their copies)"


def kv_replica_grad_numel(model: ModelSpec, training: TrainingSpec, mesh: Mesh) -> int:
    """Elements of one layer's K/V gradient buffer that a rank all-reduces over its KV
    replica group when tp > kv_heads (:func:`_kv_replica_rows`): the rank's local gradient of
    every ``kv_column`` tensor (wk, wv and their biases; one KV head, ``head_dim`` rows each),
    flattened into one buffer; under FSDP2 (zero3, hsdp) the local shard of each, the
    largest (rank 0's: ``ceil(rows / fsdp)`` rows, :func:`~meshplan.mesh.tpsplit.padded_numel`).
    0 when no KV head is replicated.

    Handed case C6 (h 4096, 32 q / 4 KV heads of 128, tp 8): wk and wv of 128 x 4096 each,
    2 x 524,288 = 1,048,576 elements; with dp_shard 2 under FSDP2, half of it:

    >>> m = ModelSpec(layers=1, hidden=4096, ffn=1, q_heads=32, kv_heads=4, head_dim=128, vocab=1)
    >>> from meshplan.mesh.resolve import resolve_mesh
    >>> from meshplan.spec.mesh import MeshSpec
    >>> mesh = resolve_mesh(MeshSpec(names=["dp_shard", "tp"], shape=[2, 8]), world=16)
    >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="none")
    >>> kv_replica_grad_numel(m, t, mesh), kv_replica_grad_numel(m, t.model_copy(update={"sharding": "zero3"}), mesh)
    (1048576, 524288)
    """
    tp = mesh.degree("tp")
    if local_heads(model, tp)[2] == 1:
        return 0
    fsdp = mesh.degree("fsdp") if training.sharding in ("zero3", "hsdp") else 1
    kv = [t for t in model.layer_tensors(0) if t.split == "kv_column"]
    return sum(padded_numel(local_rows(t, model, tp), local_numel(t, model, tp), fsdp) // fsdp for t in kv)


def _kv_replica_rows(add, c: StageContext) -> None:
    """KV heads replicated past ``kv_heads`` (tp > kv_heads, handed case C6): the ``r = tp /
    kv_heads`` tp ranks holding copies of one KV head (:func:`~meshplan.mesh.tpsplit.kv_replica_groups`)
    each get the gradient of their own q heads only, so the copies drift apart unless their
    gradients are summed: once per step, after the gradient reduction over the data axes and
    before the optimizer, one all-reduce (sum) per layer of the layer's flattened wk/wv (and
    bias) gradients (:func:`kv_replica_grad_numel`) over the replica group, in the gradient
    dtype ``training.grad_dtype`` (the buffer is the reduced gradient the optimizer reads, as
    the tied-embedding all-reduce's). Once per step, not per micro-batch: the sum is linear,
    so summing the accumulated gradient equals summing each micro-batch's. As bigcode's
    Megatron-LM does for multi-query attention (PR 39, ``reduce_model_grads``: without it
    the loss was 3.74 against 2.64) and HF transformers' KV replication group (PR 47811);
    the runtime: :class:`meshplan.runtime.execution.kvsync.KVReplicaSync`. Not under framework
    megatron, which replicates no KV head (:mod:`meshplan.spec.axes.tp_kv`: its fused QKV
    output's all-gather instead, :func:`meshplan.comm.tp_rows.qkv_gather_rows`)."""
    if qkv_gathered(c.training.framework, c.mesh.degree("tp"), c.model.n_kv_heads):
        return
    numel = kv_replica_grad_numel(c.model, c.training, c.mesh)
    if not numel:
        return
    groups = kv_replica_groups(c.mesh, c.model)
    g = c.training.grad_dtype
    rank0 = tuple(int(x) for x in groups[np.flatnonzero((groups == 0).any(axis=1))[0]])
    add(KV_REPLICA, "step", "all-reduce", numel * dtype_bytes(g), g, 0, KV_REPLICA_CADENCE, "optimizer step",
        depth=0, per_step=len(c.layers), ranks=rank0, groups=groups)


def sp_norm_grad_rows(add, c: StageContext) -> None:
    """The SP norms' gradient all-reduces over tp (see the module docstring): one per norm
    parameter (two per norm with layernorm's bias) of the stage's layers and, on the last
    stage, of the final norm, each h elements in compute dtype (:func:`replicated_grad_rows`);
    under Megatron-LM one coalesced all-reduce per step."""
    last, dt = int(c.last), c.training.compute_dtype
    per_norm = 2 if c.model.norm == "layernorm" else 1
    norms = per_norm * (2 * len(c.layers) + last)
    if c.training.framework == "megatron":
        # Megatron-LM 2755bcb optimizer.py allreduce_layernorm_grads: the main gradients of
        # every sequence_parallel parameter (the norms' weights and biases and, set by
        # mpu/layers.py RowParallelLinear, its bias: compute.megatron.stage_param_tensors)
        # flattened into one buffer, one all-reduce over tp per step, copied back (the
        # flatten and copies: compute.megatron_cost.megatron_step_cost in the optimizer step)
        g = c.training.grad_dtype
        shared = sum(n for _, n, sp in stage_param_tensors(c.model, c.mesh.degree("tp"), 0, list(c.layers), False,
                                                           bool(last), 1) if sp)
        add("tp", "step", "all-reduce", shared * dtype_bytes(g), g, 0,
            SP_NORM_COALESCED_CADENCE, "optimizer step", depth=0, per_step=1)
    else:
        replicated_grad_rows(add, c, c.model.hidden * dtype_bytes(dt), norms, "every norm (SP weight gradients)")


def tp_grad_rows(add, c: StageContext) -> None:
    """The stage's tp gradient rows besides the SP norms' (:func:`sp_norm_grad_rows`, listed with
    the SP activations' rows): the MoE router's (each tp rank routes its own tokens through the
    replicated router), multi-head latent attention's (:func:`_mla_grad_rows`) and the replicated
    KV heads' (:func:`_kv_replica_rows`), in that order."""
    moe = sum(c.model.is_moe_layer(i) for i in c.layers)
    if moe and c.mesh.degree("tp") > 1:
        replicated_grad_rows(add, c, c.model.experts * c.model.hidden * dtype_bytes(c.training.compute_dtype), moe,
                             "every MoE layer (router weight gradient)")
    _mla_grad_rows(add, c)
    _kv_replica_rows(add, c)
