"""The tp rows of the collective table (:func:`meshplan.comm.collectives.collective_table`):
the activations' collectives of tensor and sequence parallelism, layer by layer, and the loss's.
Matched op by op against what torch 2.13 issues for DTensor TP/SP
(``meshplan.runtime.validation.dryrun``; torchtitan's Llama plan). The gradients of weights
replicated over tp are :mod:`meshplan.comm.tp_grads`'.

- TP without SP: forward all-reduce after the vocab-parallel embedding (first stage) and after
  wo and w_down of every layer; backward all-reduce of the input gradient of wq/wk/wv and
  w_gate/w_up of every layer and of the output layer (last stage) (Megatron-LM, Shoeybi et al.
  2019, Fig. 3). With SP each becomes an all-gather (before column-parallel GEMMs) and a
  reduce-scatter (after row-parallel GEMMs), in forward and mirrored in backward (Korthikanti
  et al. 2022, 4.2.2).
- Float8 Linears with tensorwise scaling under torch (``TrainingSpec.float8_tp_gathers``:
  torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` / ``PrepareFloat8ModuleInput``,
  torchao eab345c ``float8/float8_tensor_parallel.py``), with SP: a dense layer's all-gathers,
  forward (inputs), backward (output gradients) and replayed, move float8, 1 byte a value
  (:func:`meshplan.compute.dtensor_sp.float8_tp`; rows of dtype fp8, :data:`FLOAT8_TP_CADENCE`);
  its reduce-scatters, the embedding's and the output layer's collectives stay in the compute dtype. Llama 3 8B at b 12, s 8192, tp 8:
  an all-gather of 12 x 8192 x 4096 values is 402,653,184 B instead of 805,306,368 B. Each cast of
  a tp shard all-reduces its amax over tp first (:func:`_float8_amax_rows`, one fp64 scalar: per
  Llama layer 4 forward, 7 backward, and the forward's again where the layer is recomputed).
- Megatron-LM with ``--fp8-format`` (:func:`meshplan.compute.asynctp.te_fp8_gathers`): the same all-gathers
  move fp8, Transformer Engine quantizing before the gather, through NCCL or (``--tp-comm-overlap``) its uint8
  userbuffers (:data:`TE_FP8_TP_CADENCE`; no amax all-reduce per cast: TE's delayed scaling reduces its
  amaxes once per step, not modelled).
- Float8 Linears with rowwise scales under plain TP (torchtitan's TP plan; :func:`_rowwise_scale_rows`):
  each cast along tp-sharded rows all-reduces its amaxes over tp, fp64 vectors (one a token, or one a
  hidden unit): per Llama layer 2 forward and 5 backward of each, the forward's again where recomputed.
- Float8 Linears with tensorwise scales under plain TP (``training.fp8_tp`` false: torchtitan v0.2.x,
  whose parallelize does not see its converter's name): every all-gather in the compute dtype, and
  each cast of a tp-sharded DTensor all-reduces its amax, one fp64 scalar: per Llama layer 9 forward
  (wo's and w_down's inputs, 7 weights) and 5 backward (:func:`_float8_amax_rows`).
- TP with MoE layers at ep 1 under framework torch (etp = tp,
  :func:`meshplan.spec.axes.moe_tp.experts_over_tp_ops`): the routed experts sharded over tp as a dense
  MLP, so the layer's collectives are a dense layer's (with SP and shared experts, one more
  reduce-scatter forward and all-gather backward: torchtitan reduces the two outputs apart).
- TP with MoE layers otherwise (etp 1, and framework megatron at any etp, :func:`_tp_layer_ops`; the rule:
  :func:`meshplan.spec.axes.moe_tp.moe_mlp_tp_ops`): attention and shared experts as above;
  the tp ranks split the tokens for the routed experts (:mod:`meshplan.runtime.execution.moe`), so
  the routed path has no tp collective under SP (a rank routes its own sequence shard) and
  without SP one all-gather of the b*s*h routed outputs (the replicated activation rebuilt
  after combine) in forward and one of the input gradient in backward; no MLP collectives
  without shared experts. Measured with torch 2.13 (fake process group and gloo,
  ``tests/test_validate_moe.py``).
- Framework megatron: ``get_batch``'s two tp broadcasts per chunk and micro-batch (2022), or under
  Megatron Core one per batch tensor on the first and last stages (:func:`get_batch_rows`).
- Loss parallel (last stage, tp > 1): three all-reduces of b*s fp32 values (max, sum of
  exponentials, target logit); without it, one all-gather of the b*s*V logits.
- Full recompute: torch's non-reentrant checkpoint replays each layer's forward up to its last
  saved tensor, so it repeats every forward TP collective except the last one of the layer;
  torchtitan's per-layer AC (``recompute = "layer"``) does so in its checkpointed layers
  (``TrainingSpec.layer_recomputed``); its op-level AC (cp = 1; with tp > 1
  under SP) replays the forward's tp all-gathers only (it saves the reduce-scatters' outputs).
- Megatron-LM's selective recompute modules: ``mlp`` replays a dense MLP's forward collectives
  (SP: its input's all-gather and output's reduce-scatter; else its all-reduce), ``moe`` an MoE
  layer's MLP block's (the shared experts'), ``shared_experts`` the shared experts' (again inside
  a ``moe`` replay): :func:`meshplan.spec.recompute_modules.replayed_tp_ops`.
"""

from __future__ import annotations

from collections import Counter

from meshplan.comm.stage_context import StageContext
from meshplan.comm.tp_grads import sp_norm_grad_rows, tp_grad_rows
from meshplan.compute import float8, float8_tp_reduces
from meshplan.compute.batch_input import (BROADCAST_GROUPS, CORE_CADENCES, CORE_KEY_BYTES, GET_BATCH_CADENCES,
                                          core_broadcast_keys, core_key_bytes, megatron_broadcast_bytes)
from meshplan.compute.asynctp import te_fp8_gathers
from meshplan.compute.dtensor_sp import float8_tp, fp8_tp_gathers
from meshplan.compute.megatron_core import embedding_reduce_scatter
from meshplan.compute.ops import Workload
from meshplan.compute.kernel_choices import float8_gemms, framework_kernels
from meshplan.compute.recompute import full_ac_replays_whole
from meshplan.mesh.tpsplit import padded_vocab
from meshplan.pipeline.registry import get as get_schedule
from meshplan.spec.axes.moe_tp import experts_over_tp, moe_mlp_tp_ops
from meshplan.spec.recompute_modules import layer_parts, mla_up_gathers, replayed_tp_ops
from meshplan.spec.axes.tp_kv import QKV_GATHER_CADENCE, qkv_gather_numel, qkv_gathered
from meshplan.units import dtype_bytes


def tp_rows(add, c: StageContext) -> None:
    """The stage's tp rows (the table's builder for tp): every layer's activation collectives
    (:func:`_tp_layer_ops`, counted by :func:`_layer_counts`; with SP :func:`_sp_rows`, else
    :func:`_plain_rows`), the gradients of weights replicated over tp
    (:func:`meshplan.comm.tp_grads.tp_grad_rows`) and, on the last stage, the loss's
    (:func:`_loss_rows`), in that order; framework megatron at tp > kv_heads the fused QKV
    output's all-gather and reduce-scatter (:func:`qkv_gather_rows`) after the layers', and
    under framework megatron ``get_batch``'s broadcasts (:func:`get_batch_rows`) after those."""
    counts = _layer_counts(c)
    if c.mesh.sequence_parallel:
        _sp_rows(add, c, counts)
    else:
        _plain_rows(add, c, counts)
    if _rowwise_tp(c):
        _rowwise_scale_rows(add, c)
    elif float8.tensorwise_plain_tp(c.model, _workload(c)):
        _float8_amax_rows(add, c, float8_tp_reduces.plain_tp_amax_per_layer)
    qkv_gather_rows(add, c)
    mla_up_rows(add, c)
    get_batch_rows(add, c)
    tp_grad_rows(add, c)
    if c.last:
        _loss_rows(add, c)


def _replays_whole(c: StageContext) -> bool:
    """Whether a fully checkpointed layer's replay re-runs its closing TP collective
    (:func:`meshplan.compute.recompute.full_ac_replays_whole`: Megatron-LM, and eager torch with
    torchtitan's ``early_stop=False``)."""
    kinds = framework_kernels(c.training)  # the workload's own megatron_ops and torch_eager
    return c.training.framework == "megatron" or full_ac_replays_whole(kinds["megatron_ops"], kinds["torch_eager"])


def _tp_layer_ops(c: StageContext, layer: int) -> tuple[list[str], list[str]]:
    """(forward, backward) tp collectives of one layer, forward in issue order (backward: the
    forward's mirror, then Megatron's re-gathers with SP); ``+``: the
    routed outputs' all-gather (no SP). Compiled torch's full recompute replays the forward up to the
    layer's last saved tensor: all but its last collective, or all when the layer ends in the routed
    experts (SP, no shared experts: the gate multiply saves the combine's output); Megatron-LM's
    ``CheckpointFunction`` and eager torch (torchtitan's ``early_stop=False``) re-run the whole layer: all
    (:func:`meshplan.compute.recompute.full_ac_not_replayed`, the timeline's
    :func:`meshplan.schedule.layer_timeline.replay_scatters`). torchtitan's
    op-level AC (``recompute = "op"``, planned with SP) saves the reduce-scatters' outputs but not
    the all-gathers' (``_save_list`` of torchtitan's llama3 ``parallelize``), so its recompute
    replays the forward's all-gathers (the inputs of the recomputed wk and w3 and of every
    column-parallel weight gradient). Megatron-LM's selective ``--recompute-modules`` ``mlp``,
    ``moe`` and ``shared_experts`` replay their modules' forward collectives
    (:func:`meshplan.spec.recompute_modules.replayed_tp_ops`; the timeline's
    :func:`meshplan.schedule.layer_timeline.module_replay`)."""
    sp, m = c.mesh.sequence_parallel, c.model
    part = ["all-gather", "reduce-scatter"] if sp else ["all-reduce"]
    moe, fw, etp, tp = m.is_moe_layer(layer), c.training.framework, c.mesh.etp, c.mesh.degree("tp")
    mlp = moe_mlp_tp_ops(fw, etp, tp, sp, bool(m.shared_experts)) if moe else part
    if moe and experts_over_tp(fw, etp, tp):
        fwd = part + mlp  # torchtitan at ep 1: like a dense MLP
        bwd = [_MIRROR[o] for o in fwd]
        if c.layer_recomputed(c.layers.index(layer)):
            bwd += fwd if _replays_whole(c) else fwd[:-1]
        elif c.training.recompute == "op" and sp:
            bwd += [o for o in fwd if o == "all-gather"]
        return fwd, bwd
    fwd = part + (["all-gather+"] + mlp[1:] if moe and not sp else mlp)  # +: the routed outputs' (etp 1, no SP)
    bwd = [_MIRROR[o] for o in fwd]
    if sp and c.training.framework == "megatron" and not get_schedule(c.schedule).splits_backward:
        # Megatron-LM saves only the sequence shard of a column-parallel linear's input and
        # all-gathers it again for the weight gradient: the attention's and a dense MLP's
        # (schedule/layer_timeline._block_backward; not where B and W are separate units)
        bwd += ["all-gather"] * (1 if moe else 2)
    if c.layer_recomputed(c.layers.index(layer)):
        bwd += fwd if (moe and sp and not m.shared_experts) or _replays_whole(c) else fwd[:-1]
    elif c.training.recompute == "op" and sp:
        bwd += [o for o in fwd if o == "all-gather"]
    elif c.training.recompute == "selective":  # Megatron-LM's mlp, moe, shared_experts modules
        shared = (["all-gather", "reduce-scatter"] if sp else ["all-reduce"]) if m.shared_experts else []
        bwd += replayed_tp_ops(layer_parts(tuple(c.training.recompute_modules), moe, m.is_mla), mlp, shared)
    return [o.rstrip("+") for o in fwd], [o.rstrip("+") for o in bwd]


#: The backward collective of each forward one (``+``: the routed outputs' all-gather, etp 1 without SP).
_MIRROR = {"all-gather": "reduce-scatter", "reduce-scatter": "all-gather", "all-reduce": "all-reduce",
           "all-gather+": "all-gather"}

#: Cadence of the tp all-gathers that move float8 (:func:`meshplan.compute.dtensor_sp.float8_tp`).
FLOAT8_TP_CADENCE = "every layer (SP, float8 tensorwise: torchao casts before the all-gather)"
#: Cadence of the tp all-gathers that move fp8 through Transformer Engine's userbuffers
#: (:func:`meshplan.compute.asynctp.te_fp8_gathers`).
TE_FP8_TP_CADENCE = "every layer (SP, fp8: Transformer Engine quantizes before the all-gather)"
#: Cadence of the tp all-reduces of float8 amaxes (:func:`_float8_amax_rows`).
FLOAT8_AMAX_CADENCE = "every float8 cast of a tp shard (torchao tensorwise: the amax, all-reduced max)"
#: Bytes of one amax all-reduce: torchao's ``amax_to_scale`` upcasts the Partial amax to float64
#: before the ``clamp`` at which DTensor redistributes it (eab345c ``float8_utils.py``; size not
#: checked in a trace: latency-bound either way).
FLOAT8_AMAX_BYTES = 8
#: Cadences of the tp all-reduces of rowwise float8 scales under plain TP (:func:`_rowwise_scale_rows`).
FLOAT8_TOKEN_SCALES_CADENCE = "every rowwise float8 cast of tp-sharded rows (torchao rowwise: one scale a token)"
FLOAT8_WEIGHT_SCALES_CADENCE = "every rowwise float8 cast of a tp-sharded weight (torchao rowwise: one scale a unit)"


def _float8_amax_rows(add, c: StageContext, per_layer=float8_tp_reduces.tp_amax_per_layer) -> None:
    """The tp all-reduces of the amaxes of the float8 casts of tp shards under torchao's float8
    TP (:func:`meshplan.compute.float8_tp_reduces.tp_amax_per_layer`: 4 forward, 7 backward per Llama layer,
    weights gathered in float8), or tensorwise under plain TP (``per_layer``
    :func:`~meshplan.compute.float8_tp_reduces.plain_tp_amax_per_layer`: 9 and 5, 2 and 5 with the float8 all-gather): ``tensor_to_amax``'s ``torch.max(torch.abs(x))`` of a Shard
    DTensor is a Partial max, all-reduced before the scale; the cast waits for it (eab345c
    ``float8_scaling_utils.hp_tensor_to_float8_dynamic``). A recomputed layer (full, per-layer or
    op-level AC) replays its forward casts' all-reduces (op-level AC saves ``aten.max``'s output,
    not the collective's). One scalar each (:data:`FLOAT8_AMAX_BYTES`)."""
    fwd = bwd = 0
    for k, i in enumerate(c.layers):
        if c.model.is_moe_layer(i):
            continue
        names = frozenset(x.name for x in c.model.layer_tensors(i) if c.training.float8_linear(x))
        f, b = per_layer(names, c.training.fp8_all_gather)
        replay = c.layer_recomputed(k) or c.training.recompute == "op"
        fwd, bwd = fwd + f, bwd + b + (f if replay else 0)
    for phase, n in (("forward", fwd), ("backward", bwd)):
        add("tp", phase, "all-reduce", FLOAT8_AMAX_BYTES, "fp64", n, FLOAT8_AMAX_CADENCE, "the float8 cast")


def _rowwise_scale_rows(add, c: StageContext) -> None:
    """The tp all-reduces of rowwise float8 scales under plain TP (:func:`meshplan.compute.float8.rowwise_tp`):
    per dense layer :func:`~meshplan.compute.float8_tp_reduces.rowwise_tp_per_layer` of each kind (Llama 2
    forward, 5 backward), the forward's again where the layer is recomputed (as
    :func:`_float8_amax_rows`), fp64 as the tensorwise amax: one scale a token of the rank's
    micro-batch (b x s/cp, gathered), or one a hidden unit (h: the K of the column-parallel
    weights, the N of the row-parallel ones). Llama 3 8B at b 12, s 8192: 786,432 B and 32,768 B."""
    fwd = bwd = 0
    for k, i in enumerate(c.layers):
        if c.model.is_moe_layer(i):
            continue
        names = frozenset(x.name for x in c.model.layer_tensors(i) if c.training.float8_linear(x))
        f, b = float8_tp_reduces.rowwise_tp_per_layer(names)
        replay = c.layer_recomputed(k) or c.training.recompute == "op"
        fwd, bwd = fwd + f, bwd + b + (f if replay else 0)
    tokens = c.training.micro_batch * c.seq_local
    for cadence, n_values in ((FLOAT8_TOKEN_SCALES_CADENCE, tokens), (FLOAT8_WEIGHT_SCALES_CADENCE, c.model.hidden)):
        for phase, n in (("forward", fwd), ("backward", bwd)):
            add("tp", phase, "all-reduce", n_values * FLOAT8_AMAX_BYTES, "fp64", n, cadence, "the float8 cast")


def _rowwise_tp(c: StageContext) -> bool:
    """:func:`meshplan.compute.float8.rowwise_tp` (the rule's one home) of the stage (:func:`_workload`)."""
    return float8.rowwise_tp(c.model, _workload(c))


def _workload(c: StageContext) -> Workload:
    """The stage's float8 Linears (:func:`meshplan.compute.kernel_choices.float8_gemms`), tp degree and
    framework as a Workload, for :mod:`meshplan.compute.float8`'s rules."""
    t = c.training
    return Workload(seq_len=t.seq_len, tp=c.mesh.degree("tp"), megatron_ops=t.framework == "megatron",
                    **float8_gemms(c.model, t))


def _layer_counts(c: StageContext) -> Counter[tuple]:
    """Calls per micro-batch of the stage's layers' tp collectives by (phase, op, "fp8" for the
    all-gathers that move 1 byte a value under :func:`meshplan.compute.dtensor_sp.fp8_tp_gathers`, else "")."""
    counts: Counter[tuple] = Counter()
    sp = c.mesh.sequence_parallel
    f8 = "fp8" if fp8_tp_gathers(c.model, c.training, sp) else ""  # apart
    for i in c.layers:
        fwd, bwd = _tp_layer_ops(c, i)
        counts.update(("forward", o, f8 if o == "all-gather" else "") for o in fwd)
        counts.update(("backward", o, f8 if o == "all-gather" else "") for o in bwd)
    return counts


def _sp_rows(add, c: StageContext, counts: Counter[tuple]) -> None:
    """Sequence parallelism's all-gathers and reduce-scatters (float8 ones apart), the float8
    casts' amax all-reduces and the SP norms' gradients (:func:`~meshplan.comm.tp_grads.sp_norm_grad_rows`)."""
    first, last, dt = int(c.first), int(c.last), c.training.compute_dtype
    act = c.act_bytes
    act8 = act // dtype_bytes(dt)  # the same values in float8
    f8_cadence = TE_FP8_TP_CADENCE if te_fp8_gathers(c.model, c.training, c.mesh.sequence_parallel) \
        else FLOAT8_TP_CADENCE
    # Megatron-LM 2022 (2755bcb megatron/mpu/layers.py VocabParallelEmbedding.forward:
    # reduce_from_tensor_model_parallel_region, then language_model.py Embedding.forward:
    # scatter_to_sequence_parallel_region, a split) all-reduces the embedding's output and
    # keeps its shard; torch's SequenceParallel embedding reduce-scatters it
    # Megatron Core reduce-scatters it where no learned position embedding is added
    # (compute.megatron_core.embedding_reduce_scatter, d98e8a6 language_model_embedding.py:51-56)
    core_rs = embedding_reduce_scatter(c.training.megatron_core, True, c.model.position_embedding == "learned")
    embed_ar = first if c.training.framework == "megatron" and not core_rs else 0
    add("tp", "forward", "all-gather", act, dt, counts["forward", "all-gather", ""] + last, "every layer (SP)",
        "next column-parallel GEMM")
    add("tp", "forward", "all-gather", act8, "fp8", counts["forward", "all-gather", "fp8"], f8_cadence,
        "next column-parallel GEMM")
    add("tp", "forward", "reduce-scatter", act, dt, counts["forward", "reduce-scatter", ""] + first - embed_ar,
        "every layer (SP)", "residual add")
    add("tp", "forward", "all-reduce", act, dt, embed_ar, "every micro-batch (Megatron embedding, SP)",
        "embedding's sequence split")
    # Megatron-LM also gathers the output layer's input again in its backward (mpu/layers.py
    # LinearWithGradAccumulationAndAsyncCommunication, parallel_lm_logits), for its wgrad
    regather_head = last if c.training.framework == "megatron" else 0
    add("tp", "backward", "all-gather", act, dt, counts["backward", "all-gather", ""] + first + regather_head,
        "every layer (SP)", "next weight-gradient GEMM")
    add("tp", "backward", "all-gather", act8, "fp8", counts["backward", "all-gather", "fp8"], f8_cadence,
        "next weight-gradient GEMM")
    add("tp", "backward", "reduce-scatter", act, dt, counts["backward", "reduce-scatter", ""] + last,
        "every layer (SP)", "previous layer's backward")
    if float8_tp(c.model, c.training, c.mesh.sequence_parallel):
        _float8_amax_rows(add, c)
    sp_norm_grad_rows(add, c)


def _plain_rows(add, c: StageContext, counts: Counter[tuple]) -> None:
    """TP without SP: the all-reduces of every layer (and of the embedding's output, first
    stage, and the output layer's input gradient, last stage) and an MoE layer's all-gathers of
    the routed outputs and their gradients."""
    first, last, dt = int(c.first), int(c.last), c.training.compute_dtype
    act = c.act_bytes
    add("tp", "forward", "all-reduce", act, dt, counts["forward", "all-reduce", ""] + first, "every layer",
        "next layer's GEMMs")
    add("tp", "backward", "all-reduce", act, dt, counts["backward", "all-reduce", ""] + last, "every layer",
        "previous layer's backward")
    add("tp", "forward", "all-gather", act, dt, counts["forward", "all-gather", ""], "every MoE layer (routed "
        "outputs of each rank's tokens)", "residual add")
    add("tp", "backward", "all-gather", act, dt, counts["backward", "all-gather", ""], "every MoE layer (input "
        "gradients of each rank's tokens)", "previous layer's backward")


def qkv_gather_rows(add, c: StageContext) -> None:
    """Megatron-LM's QKV sub-sharding at tp > kv_heads (:mod:`meshplan.spec.axes.tp_kv`): per
    layer and micro-batch one all-gather over tp of the fused QKV output, ``b x s/cp x (q + 2 kv)
    d`` values in the compute dtype (:func:`~meshplan.spec.axes.tp_kv.qkv_gather_numel`), forward,
    and the reduce-scatter of its gradient, backward; a recomputed layer (full recompute) all-gathers
    again in its backward. 4 q / 2 KV heads of 16 at tp 4, b 1, s 64, bf16: 64 x 128 x 2 =
    16,384 B each."""
    m, t = c.model, c.training
    if m.is_mla or not qkv_gathered(t.framework, c.mesh.degree("tp"), m.n_kv_heads):
        return
    dt = t.compute_dtype
    size = qkv_gather_numel(m, t.micro_batch, t.seq_len, c.mesh.degree("cp")) * dtype_bytes(dt)
    n = len(c.layers)
    replays = sum(bool(c.layer_recomputed(k)) for k in range(n))
    add("tp", "forward", "all-gather", size, dt, n, QKV_GATHER_CADENCE, "core attention")
    add("tp", "backward", "reduce-scatter", size, dt, n, QKV_GATHER_CADENCE, "previous block's backward")
    add("tp", "backward", "all-gather", size, dt, replays, QKV_GATHER_CADENCE, "core attention (recomputed)")


#: Cadence of each latent's all-gather in Megatron-LM's ``mla_up_proj`` replay (:func:`mla_up_rows`), by its
#: name in :func:`meshplan.spec.recompute_modules.mla_up_gathers`: also the group of its row and event.
MLA_UP_CADENCES = {"q latent": "every MLA layer (mla_up_proj recompute: the query latent)",
                   "q (hidden states)": "every MLA layer (mla_up_proj recompute: linear_q_proj's input)",
                   "kv latent": "every MLA layer (mla_up_proj recompute: the key/value latent)"}


def mla_up_rows(add, c: StageContext) -> None:
    """Megatron-LM's ``mla_up_proj`` recompute (:func:`meshplan.spec.recompute_modules.mla_up_gathers`):
    per MLA layer and micro-batch, in backward, one tp all-gather of each latent its replayed
    up-projections gather again under SP, ``b x s/cp x r`` values in the compute dtype.
    DeepSeek-V3 at b 1, s 4096, bf16: the query latent's 1536 x 4096 x 2 = 12,582,912 B, the key/value
    latent's 512 x 4096 x 2 = 4,194,304 B."""
    t, tokens = c.training, c.training.micro_batch * c.seq_local
    for which, width in mla_up_gathers(c.model, t, c.mesh.degree("tp"), c.mesh.sequence_parallel):
        add("tp", "backward", "all-gather", tokens * width * dtype_bytes(t.compute_dtype), t.compute_dtype,
            len(c.layers), MLA_UP_CADENCES[which], "the replayed up-projection")


def get_batch_rows(add, c: StageContext) -> None:
    """Megatron-LM 2022's ``get_batch`` (2755bcb ``pretrain_gpt.py`` -> ``mpu/data.py``
    ``broadcast_data``; :mod:`meshplan.compute.batch_input`) on every stage, once per chunk and
    micro-batch: two int64 broadcasts over tp from its rank 0, the key sizes and then the
    flattened batch (:func:`~meshplan.compute.batch_input.megatron_broadcast_bytes`), the
    embedding's input waiting on them. b 1, s 64: 40 B and 8 x 65 = 520 B."""
    t = c.training
    if t.framework != "megatron":
        return
    if t.megatron_core:
        _core_batch_rows(add, c)
        return
    for group, size in zip(BROADCAST_GROUPS, megatron_broadcast_bytes(t.micro_batch, t.seq_len)):
        add("tp", "forward", "broadcast", size, "int64", c.vpp, GET_BATCH_CADENCES[group], "the embedding (get_batch)")


#: dtype of each of Megatron Core's batch tensors (:data:`~meshplan.compute.batch_input.CORE_KEY_BYTES`).
_CORE_DTYPES = {"tokens": "int64", "labels": "int64", "loss_mask": "fp32", "position_ids": "int64",
                "attention_mask": "bool"}


def _core_batch_rows(add, c: StageContext) -> None:
    """Megatron Core's ``get_batch`` broadcasts (:mod:`meshplan.compute.batch_input`): per micro-batch
    one broadcast over tp of each tensor the stage's ``get_batch`` uses
    (:func:`~meshplan.compute.batch_input.core_broadcast_keys`: at pp 1 tokens, labels, loss mask,
    position ids; the first stage tokens and position ids, the last labels and loss mask; with the
    data loader's mask, it too), none on a middle stage. b 1, s 64 at pp 1 with the mask: 512, 512,
    256, 512 and 4,096 B."""
    t, pp = c.training, c.mesh.degree("pp")
    ends = [(True, True)] if pp == 1 else [(True, False)] * c.first + [(False, True)] * c.last
    counts = Counter(k for f, la in ends for k in core_broadcast_keys(pp, f, la, t.core_attention_mask))
    for key in (k for k in CORE_KEY_BYTES if counts[k]):
        add("tp", "forward", "broadcast", core_key_bytes(key, t.micro_batch, t.seq_len), _CORE_DTYPES[key],
            counts[key], CORE_CADENCES[key], "the embedding (get_batch)" if key in ("tokens", "position_ids")
            else "the loss (get_batch)" if key in ("labels", "loss_mask") else "the attention (get_batch)")


def _loss_rows(add, c: StageContext) -> None:
    """The last stage's loss: vocab-parallel (``loss_parallel``) three all-reduces of b*s fp32
    values, else one all-gather of the b*s*V logits."""
    dt = c.training.compute_dtype
    b, s = c.training.micro_batch, c.training.seq_len // c.mesh.degree("cp")
    if c.loss_parallel:
        add("tp", "loss", "all-reduce", b * s * 4, "fp32", 3, "every micro-batch (vocab-parallel loss)", "loss")
    else:
        v = padded_vocab(c.model.vocab, c.training.vocab_pad_divisor, c.mesh.degree("tp"))
        add("tp", "forward", "all-gather", b * s * v * dtype_bytes(dt), dt, 1, "every micro-batch (logits)", "loss")
