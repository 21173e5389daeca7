"""The compute side of a plan's step: the per-rank :class:`~meshplan.compute.ops.Workload` of its
mesh and training contract (:func:`workload_of`), and each stage's and chunk's op costs per
micro-batch (:func:`chunk_costs`), which the unit timelines (:mod:`meshplan.schedule.rank_timeline`)
lay out.
"""

from __future__ import annotations

from typing import Optional

from meshplan.comm.collectives import axis_path, path_time
from meshplan.compute import asynctp
from meshplan.compute.batch_input import core_batch_chunk, core_broadcast_keys, core_key_bytes, megatron_broadcast_bytes
from meshplan.compute.gemm import GemmTable
from meshplan.compute.embed_head import embedding_cost, head_cost
from meshplan.compute.layer import layer_cost
from meshplan.compute.kernel_fragment import kernel_data
from meshplan.compute.deepspeed_pipe import engine_cost
from meshplan.compute.megatron import stage_param_tensors
from meshplan.compute.megatron_core import embedding_reduce_scatter
from meshplan.compute.megatron_cost import megatron_batch_cost
from meshplan.compute.ops import Cost, Op, Workload
from meshplan.compute.kernel_choices import float8_gemms, framework_kernels
from meshplan.compute.recompute import layer_workload, op_replays_ep
from meshplan.compute.routing import RoutingOptions
from meshplan.compute.shapes import Gemm, local_split, step_gemms
from meshplan.memory.wlag import weight_groups
from meshplan.mesh.layers import last_stage
from meshplan.mesh.tpsplit import padded_vocab
from meshplan.schedule.unit_sim import ChunkCosts
from meshplan.spec.axes.base import Dim
from meshplan.spec.axes.moe_tp import moe_mlp_tp_ops
from meshplan.units import dtype_bytes


def workload_of(plan, dropout: bool = False) -> Workload:
    """The per-rank :class:`~meshplan.compute.ops.Workload` of a plan's mesh and training
    contract. ``dropout``: GPT-style dropout, also on when the config's ``[memory] dropout`` is.
    Megatron-LM (``training.framework``) projects Q, K and V with one GEMM and, with fp32
    gradients, accumulates the weight gradients into them inside the GEMM (its
    ``gradient_accumulation_fusion``, on by default). ``training.tp_comm_overlap`` with sequence
    parallelism and tp > 1: the framework's decomposed TP GEMMs (:mod:`meshplan.compute.asynctp`), slowed
    beside torch's copy-engine pulls where the GPU's kernel data measures it (:func:`~meshplan.compute.asynctp.copy_engine_terms`).
    Megatron Core's embedding reduce-scatter under SP (``embed_reduce_scatter``):
    :func:`meshplan.compute.megatron_core.embedding_reduce_scatter` of the model's positions."""
    t, mesh = plan.config.training, plan.mesh
    dropout = dropout or plan.config.memory.dropout
    split = local_split(mesh)  # the dims each registered axis divides, as the plan's shapes
    async_tp = t.framework if t.tp_comm_overlap and mesh.sequence_parallel and split[Dim.HEADS] > 1 else ""
    f8 = float8_gemms(plan.config.model, t)
    fused_f8 = bool(f8.get("float8_gemms", frozenset()) & {*asynctp.AG_FORWARD, *asynctp.RS_FORWARD})
    ce = asynctp.copy_engine_terms(async_tp, fused_f8, kernel_data(plan.config.cluster.gpu))
    return Workload(seq_len=t.seq_len, micro_batch=t.micro_batch, tp=split[Dim.HEADS], cp=split[Dim.SEQUENCE],
                    sp=mesh.sequence_parallel, ep=split[Dim.EXPERTS], etp=split[Dim.EXPERT_FFN], dtype=t.compute_dtype,
                    recompute=t.recompute, recompute_modules=tuple(t.recompute_modules), flash=t.flash_attention,
                    dropout=dropout,
                    vocab_pad_divisor=t.vocab_pad_divisor, routing=RoutingOptions.of(t), **framework_kernels(t),
                    **f8, async_tp=async_tp, copy_engine_gemm=ce,
                    dtensor_host_s=dtensor_host_s(plan.config, split[Dim.HEADS]),
                    dtensor_host_source=dtensor_host_source(plan.config), moe_tp_ops=moe_tp_ops(plan),
                    embed_reduce_scatter=embedding_reduce_scatter(
                        t.megatron_core, mesh.sequence_parallel and split[Dim.HEADS] > 1,
                        plan.config.model.position_embedding == "learned"),
                    op_replays_ep=op_replays_ep(plan.config.model, t), kv_expanded=plan.config.memory.kv_expanded)



def plan_step_gemms(plan) -> list[Gemm]:
    """The plan's forward GEMMs (:attr:`~meshplan.plan.Plan.gemms`, the last layer's and the head's)
    as its step times them: :func:`~meshplan.compute.shapes.step_gemms` under the plan's workload
    (framework megatron: wq, wk, wv as one fused ``qkv`` of N ``(q + 2 kv) d / tp``). ``compare``'s
    ``(M,N,K) eff`` rows and ``bench gemm``'s shapes."""
    return step_gemms(plan.gemms, workload_of(plan).fused_qkv)


def moe_tp_ops(plan) -> tuple[str, ...]:
    """The forward tp collectives of an MoE layer's MLP block on the rank timeline
    (``Workload.moe_tp_ops``): :func:`~meshplan.spec.axes.moe_tp.moe_mlp_tp_ops`, the rule the
    collective table counts by; none at tp 1."""
    mesh, t, tp = plan.mesh, plan.config.training, plan.mesh.degree("tp")
    if tp <= 1:
        return ()
    return tuple(moe_mlp_tp_ops(t.framework, mesh.etp, tp, mesh.sequence_parallel, bool(plan.config.model.shared_experts)))


def dtensor_host_s(config, tp: int) -> tuple[float, float]:
    """The host's (forward, backward) seconds to issue one transformer block under eager DTensor
    tensor parallelism: torch (``training.framework``) without ``training.torch_compile`` at
    tp > 1 issues every op of a block through DTensor's Python dispatch; measured per block on
    the H200 machine's host (kernels.toml ``[host] dtensor_tp_block_*``, M1), or a ``--kernels``
    file's ``[host]`` (:func:`meshplan.compute.kernel_fragment.with_fragment`). (0, 0) for
    Megatron-LM (plain tensors), compiled blocks, tp 1 or a GPU without catalog kernel data.
    ``config``: the plan's :class:`~meshplan.config.Config`. The one home of the pace: the step
    (:func:`workload_of`), ``bench rank``'s prediction and the search's step-time lower bound
    (:func:`meshplan.search.layer_bounds.host_pace_floor`, per tp degree) all call it through
    this module, so that one override (a kernels file, or a test's patch) reaches them all."""
    t = config.training
    data = kernel_data(config.cluster.gpu)
    if tp <= 1 or t.framework != "torch" or t.torch_compile or data is None:
        return (0.0, 0.0)
    return data.dtensor_tp_block_s


def dtensor_host_source(config) -> str:
    """Where :func:`dtensor_host_s` comes from, as the ``host:`` line names it: the catalog's
    measurement (:data:`meshplan.compute.measured.CATALOG_HOST_PACE`) or ``your kernels file FILE``;
    "" for a GPU without catalog kernel data."""
    data = kernel_data(config.cluster.gpu)
    return "" if data is None else data.dtensor_tp_source


def chunk_costs(plan, w: Workload, table: Optional[GemmTable] = None) -> list[list[ChunkCosts]]:
    """``[stage][chunk]`` compute per micro-batch (one layer_cost per distinct layer kind)."""
    model, gpu, t = plan.config.model, plan.config.cluster.gpu, plan.config.training
    cache: dict[tuple, Cost] = {}

    def cost(i: int, s: int) -> Cost:
        key = (model.is_moe_layer(i), recomputed[s][i])  # per-layer AC: torchtitan's, Megatron-LM's block
        if key not in cache:
            cache[key] = layer_cost(model, gpu, layer_workload(w, key[1]), layer=i, table=table)
        return cache[key]

    recomputed = [dict(zip((i for chunk in chunks for i in chunk), t.stage_recomputed(chunks))) for chunks in plan.stages]
    v, last = plan.vpp, last_stage(plan.stages)  # last: 0 under a V-shaped schedule
    host = plan.config.cluster.node.pcie
    batch = _batch_costs(plan, w, last)
    engine = deepspeed_pipe_costs(plan, w)
    groups = {k: weight_groups(model, k) for k in (False, True)}
    return [[ChunkCosts(layers=tuple(cost(i, s) for i in layers), moe=tuple(model.is_moe_layer(i) for i in layers),
                        w_replays=tuple(groups[model.is_moe_layer(i)] for i in layers),
                        embed=embedding_cost(model, gpu, w, host) if (s, c) == (0, 0) else None,
                        head=head_cost(model, gpu, w, table) if (s, c) == (last, v - 1) else None,
                        batch=batch(s, c), engine=engine[s])
             for c, layers in enumerate(chunks)] for s, chunks in enumerate(plan.stages)]


def _batch_costs(plan, w: Workload, last: int):
    """``(stage, chunk) -> Cost or None``: Megatron-LM's ``get_batch`` per micro-batch in that chunk
    (:func:`meshplan.compute.megatron_cost.megatron_batch_cost`): in 2022 in every chunk's forward on
    every stage (2755bcb); under Megatron Core (``w.megatron_core``) only in the first chunk of the
    first stage and the last chunk of the ``last`` stage
    (:func:`meshplan.compute.batch_input.core_batch_chunk`), broadcasting that stage's tensors
    (:func:`~meshplan.compute.batch_input.core_broadcast_keys`); None for another framework."""
    gpu, host = plan.config.cluster.gpu, plan.config.cluster.node.pcie
    if not w.megatron_ops:
        return lambda s, c: None
    if not w.megatron_core:
        cost = megatron_batch_cost(gpu, w, host, get_batch_broadcast_s(plan, w))
        return lambda s, c: cost
    v, pp = plan.vpp, plan.pp
    memo: dict[tuple[str, ...], Cost] = {}

    def at(s: int, c: int) -> Optional[Cost]:
        if not core_batch_chunk(s, c, 0, last, v):
            return None
        keys = core_broadcast_keys(pp, (s, c) == (0, 0), (s, c) == (last, v - 1), w.core_attention_mask)
        if keys not in memo:
            memo[keys] = megatron_batch_cost(gpu, w, host, get_batch_broadcast_s(plan, w, keys), keys)
        return memo[keys]
    return at


def plan_ops(plan, table: Optional[GemmTable] = None) -> list[Op]:
    """Every compute op of one micro-batch of ``plan`` (each distinct layer kind once, the
    embedding, the head and the framework's per-chunk batch ops), as :func:`step_time` times
    them with ``table``: what :func:`meshplan.compute.table_use.table_use` counts."""
    costs = [c for stage in chunk_costs(plan, workload_of(plan), table) for chunk in stage
             for c in (*chunk.layers, chunk.embed, chunk.head, chunk.batch, chunk.engine) if c is not None]
    return [o for c in costs for o in c.ops]


def get_batch_broadcast_s(plan, w: Workload, keys: tuple[str, ...] = ()) -> float:
    """Seconds of Megatron-LM's ``get_batch`` broadcasts over the tp group, each timed as a
    collective-table row on the tp axis's path (:func:`meshplan.comm.collectives.path_time`): 2022's
    two (:func:`meshplan.compute.batch_input.megatron_broadcast_bytes`: the sizes, then the data), or
    under Megatron Core one per tensor of ``keys`` (:func:`~meshplan.compute.batch_input.core_key_bytes`);
    0 at tp 1 (no broadcast: the group is the rank alone)."""
    if w.tp <= 1:
        return 0.0
    cluster = plan.config.cluster
    path = axis_path(plan.mesh, plan.placement, cluster, "tp")
    sizes = [core_key_bytes(k, w.micro_batch, w.seq_len) for k in keys] if w.megatron_core \
        else megatron_broadcast_bytes(w.micro_batch, w.seq_len)
    return sum(path_time("broadcast", w.tp, nb, path, cluster)[1] for nb in sizes)


def deepspeed_pipe_costs(plan, w: Workload) -> list[Optional[Cost]]:
    """Per stage, :func:`meshplan.compute.deepspeed_pipe.engine_cost` of one micro-batch under
    ``training.pp_engine = "deepspeed"`` (None per stage otherwise; at pp 1 the one stage is first and
    last: ``BF16_Optimizer``'s accumulation alone, as ``_exec_backward_pass`` runs it there): the stage's
    parameters as Megatron-LM's GPT holds them (:func:`~meshplan.compute.megatron.stage_param_tensors`),
    the activation a stage sends (micro-batch x sequence / cp x hidden in the compute dtype), its
    re-gather timed as the tp axis's all-gather row (:func:`~meshplan.comm.collectives.path_time`), and
    ``BF16_Optimizer``'s accumulation where the training runs it
    (:attr:`~meshplan.spec.training.TrainingSpec.bf16_optimizer`)."""
    t, model, p = plan.config.training, plan.config.model, len(plan.stages)
    if t.pp_engine != "deepspeed":
        return [None] * p
    act = w.micro_batch * (t.seq_len // max(w.cp, 1)) * model.hidden * dtype_bytes(t.compute_dtype)
    regather = 0.0
    if w.tp > 1:
        path = axis_path(plan.mesh, plan.placement, plan.config.cluster, "tp")
        regather = path_time("all-gather", w.tp, act, path, plan.config.cluster)[1]
    rows = padded_vocab(model.vocab, w.vocab_pad_divisor, w.tp) // w.tp
    hp = t.bf16_optimizer  # BF16_Optimizer's per-micro-batch fp32 accumulation (its one home: TrainingSpec)
    last = p - 1
    return [engine_cost(plan.config.cluster.gpu,
                        stage_param_tensors(model, w.tp, rows, [i for ch in chunks for i in ch], s == 0, s == last, p),
                        act, w.tp, s == 0, s == last, regather, hp) for s, chunks in enumerate(plan.stages)]
