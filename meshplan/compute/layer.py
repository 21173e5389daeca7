"""Every op of one transformer layer on one rank for one micro-batch (:mod:`meshplan.compute.ops`'
conventions): the GEMMs, the attention core, the memory-bound ops, torch's async-TP and
sequence-parallel layout kernels, torchao's float8 kernels and Megatron-LM's own, each recompute
policy's replay (:func:`layer_costs`, :func:`layer_cost`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from meshplan.compute import asynctp, dtensor_sp, float8, ring_attention, te_ring
from meshplan.compute.attention import flash_ops, score_ops
from meshplan.compute.elementwise import bias_ops, elementwise_ops
from meshplan.compute.gemm import GemmTable
from meshplan.compute.kernel_time import gemm_ops, memory_op, qkv_fused_ops
from meshplan.compute.megatron_cost import comm_delay_ops, main_grad_hooks
from meshplan.compute.ops import BLOCKS, Cost, Op, PHASES, RECOMPUTE, Workload
from meshplan.compute.recompute import (OP_SAC_NOT_REPLAYED, full_ac_not_replayed, module_replays, no_grad_forward,
                                        op_sac_replayed, replay)
from meshplan.compute.shapes import ATTENTION_GEMMS, MLA_REPLICATED, Gemm, attention_shape, fused_qkv_parts, layer_gemms
from meshplan.mesh.tpsplit import local_heads
from meshplan.spec.axes.tp_kv import qkv_gathered
from meshplan.spec.cluster import GPUSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.recompute_modules import layer_parts
from meshplan.units import dtype_bytes


def layer_cost(model: ModelSpec, gpu: GPUSpec, w: Workload, layer: int = -1,
               table: Optional[GemmTable] = None) -> Cost:
    """Every op of transformer layer ``layer`` (-1: the last) on one rank for one micro-batch,
    forward, backward (B and W) and recompute, per the module conventions
    (:func:`layer_costs` under ``w.recompute``)."""
    return layer_costs(model, gpu, w, (w.recompute,), layer, table)[w.recompute]


#: Forward kernels of a ring that a selective recompute's replayed core attention runs again.
REPLAYED_WITH_CORE = (ring_attention.MERGE, te_ring.CORRECTION, te_ring.KV_BUFFER)


def layer_costs(model: ModelSpec, gpu: GPUSpec, w: Workload, recomputes: tuple[str, ...], layer: int = -1,
                table: Optional[GemmTable] = None) -> dict[str, Cost]:
    """:func:`layer_cost` of ``w`` under each recompute policy of ``recomputes`` (``w.recompute``
    is not read), by policy. The ops no policy changes (GEMMs, the attention's own ops,
    memory-bound ops, Megatron-LM's kernels) are built once; each policy adds its recompute
    ops where :func:`layer_cost` has them (``selective``: the attention's replay after the
    attention ops where ``w.recompute_modules`` has core_attn, then the other modules' replays,
    :func:`~meshplan.compute.recompute.module_replays`; ``full``, ``op``: the forward's replay at the end; ``full`` under
    Megatron-LM 2022 runs its first forward under no_grad, :func:`~meshplan.compute.recompute.no_grad_forward`), so
    each Cost lists the same ops in the same order (the search asks every policy of each shape).

    >>> from dataclasses import replace
    >>> from meshplan import catalog
    >>> gpt, a100 = catalog.model("megatron-22b"), catalog.gpu("a100-sxm-80gb")
    >>> w = Workload(seq_len=2048, micro_batch=4, tp=8, flash=False)
    >>> both = layer_costs(gpt, a100, w, ("none", "full"))
    >>> both["full"] == layer_cost(gpt, a100, replace(w, recompute="full"))
    True
    >>> both["full"].seconds("backward_input", "attn", True) == both["none"].seconds("forward", "attn")
    True
    >>> [o.name for o in both["full"].ops if o.recompute and o.block == "mlp"]  # torch: w_down is not replayed
    ['w_up (recompute)', 'gelu (recompute)']
    """
    for rc in recomputes:
        if rc not in RECOMPUTE + ("layer",):
            raise ValueError(f"recompute {rc!r} is not one of {RECOMPUTE}")
    gemms = layer_gemms(model, w.tp, w.tokens, layer=layer, ep=w.ep, etp=w.etp, routing_options=w.routing,
                        framework=w.framework)  # Megatron-LM past the KV heads: 1/tp of wk and wv (tp_kv)
    ops = _gemm_ops(model, gpu, w, gemms, table)
    attn_sel, attn_plain = _attention_ops(model, gpu, w, table)
    moe = model.is_moe_layer(model.layers - 1 if layer < 0 else layer)  # layer -1: the last layer's kind
    rest = _other_ops(model, gpu, w, gemms, layer, moe)
    order = {b: i for i, b in enumerate(BLOCKS)}
    parts = layer_parts(w.recompute_modules, moe, model.is_mla)
    out = {}
    for rc in recomputes:
        every = ops + (attn_sel if rc == "selective" and "core_attn" in parts else attn_plain) + rest
        if rc == "selective" and parts - {"core_attn"}:  # Megatron-LM's other recompute modules
            every += module_replays(gpu, model, gemms, every, parts)
        if rc == "full":
            kept = full_ac_not_replayed(w)
            every = no_grad_forward(gpu, w, every, model.hidden) + [
                replay(o) for o in every if o.phase == "forward" and o.name not in kept]
        elif rc == "op":
            every += op_replays(every, op_sac_replayed(model, moe, w.op_sac_policy))
        out[rc] = Cost(tuple(sorted(every, key=lambda o: (PHASES.index(o.phase), order[o.block]))))
    return out


def _gemm_ops(model: ModelSpec, gpu: GPUSpec, w: Workload, gemms: list[Gemm], table: Optional[GemmTable]) -> list[Op]:
    """The layer's GEMM ops: the fused QKV's parts as one (:func:`~meshplan.compute.shapes.fused_qkv_parts`),
    then every other GEMM. A KV head's projection copied on several ranks, or MLA's replicated down
    projection, counts once in model FLOP (its scale: 1 / the copies of each KV head, none under
    Megatron-LM's sub-sharding, ``qkv_local_features``; 1 / tp for MLA's)."""
    # copies of each KV head's projection: none under Megatron-LM's sub-sharding (qkv_local_features)
    rep = 1 if qkv_gathered(w.framework, w.tp, model.n_kv_heads) else local_heads(model, w.tp)[2]
    ops = []
    qkv = fused_qkv_parts(gemms, w.fused_qkv)  # the parts step_gemms fuses
    if qkv:
        ops += qkv_fused_ops(gpu, qkv, w, table, {"wk": 1.0 / rep, "wv": 1.0 / rep})
    for g in gemms:  # a replicated KV head, or MLA's replicated down projection, counts once in model FLOP
        if g in qkv:
            continue
        scale = 1.0 / rep if g.name in ("wk", "wv") else 1.0 / w.tp if g.name in MLA_REPLICATED else 1.0
        ops += gemm_ops(gpu, g, "attn" if g.name in ATTENTION_GEMMS else "mlp", w, table, scale)
    return ops


def _attention_ops(model: ModelSpec, gpu: GPUSpec, w: Workload, table: Optional[GemmTable]) -> tuple[list[Op], list[Op]]:
    """(the attention core's ops with selective recompute: its own, then their replay, appended last,
    with the forward kernels a ring's replayed core runs again, :data:`REPLAYED_WITH_CORE`; its ops
    without: with torch CP's merges and fp32 gradient sums), flash or score-matrix attention
    (:mod:`meshplan.compute.attention`)."""
    att = attention_shape(model, w.tp, w.cp, w.micro_batch, w.seq_len)
    # the attention's ops with selective recompute: its own ops, then their replay (appended last)
    attn_sel = flash_ops(gpu, att, w, True, table) if w.flash else \
        score_ops(gpu, att, w, table, True, model.position_embedding == "alibi")
    attn_plain = [o for o in attn_sel if not o.recompute]  # with torch CP's merges and fp32 gradient sums
    # the core's replay merges again (torch's ring), corrects and fills TE's K/V buffer again (TE's p2p ring)
    attn_sel = attn_sel + [replay(o) for o in attn_sel if o.phase == "forward" and o.name in REPLAYED_WITH_CORE]
    return attn_sel, attn_plain


def _other_ops(model: ModelSpec, gpu: GPUSpec, w: Workload, gemms: list[Gemm], layer: int, moe: bool) -> list[Op]:
    """The layer's ops no recompute policy changes besides the GEMMs and the attention: the
    memory-bound ops, torch's async-TP and SP layout kernels, the biases, torchao's float8 amax,
    casts and transposed copies, and under Megatron-LM its main-gradient hooks and the delay kernel
    after each async tp collective launch (attention only in an MoE layer)."""
    rest = elementwise_ops(model, gpu, w, gemms) + async_tp_ops(model, gpu, w, gemms) + sp_layout_ops(model, gpu, w, gemms)
    rest += bias_ops(model, gpu, w, moe)
    rest += [memory_op(gpu, name, block, phase, nb) for name, block, phase, nb in float8.layer_kernels(
        model, w, gemms, dtype_bytes(w.dtype))]  # torchao's amax, casts and transposed copies
    if w.megatron_ops:
        rest += main_grad_hooks(model, gpu, w, layer)
        rest += comm_delay_ops(gpu, w, ("attn",) if moe else ("attn", "mlp"))
    return rest


def op_replays(ops: list[Op], shares: dict[str, float]) -> list[Op]:
    """The replay of ``ops``' forward under torchtitan's op-level selective AC: every forward op
    but the attention kernel (its output saved), the kernels of :data:`OP_SAC_NOT_REPLAYED` and
    the saved share of each GEMM (``shares``: :func:`meshplan.compute.recompute.op_sac_replayed`;
    a GEMM half replayed, the fused shared-expert gate and up, at half its time and FLOP)."""
    out = []
    for o in ops:
        share = shares.get(o.name, 1.0)
        if o.phase != "forward" or o.kind == "attention" or o.name.startswith(OP_SAC_NOT_REPLAYED) or not share:
            continue
        r = replay(o)
        out.append(r if share == 1.0 else replace(r, seconds=r.seconds * share, hardware_flops=r.hardware_flops * share,
                                                  size_bytes=r.size_bytes * share))
    return out


def async_tp_ops(model: ModelSpec, gpu: GPUSpec, w: Workload, gemms: list[Gemm]) -> list[Op]:
    """The kernels torch's async TP adds on the compute stream (:func:`meshplan.compute.asynctp.torch_extra_bytes`):
    per block with fused GEMMs, the shard copy before each fused all-gather (forward, and
    backward's gathered output gradient) and the partial sum after each fused reduce-scatter
    (forward); with several sequences a micro-batch, the restride of wo's input before its fused
    reduce-scatter (:func:`meshplan.compute.asynctp.restride_bytes`); none under Megatron-LM (TE's
    norm writes into the userbuffer) or without async TP."""
    if w.async_tp != "torch" or not w.sp or w.tp < 2:
        return []
    size = asynctp.torch_extra_bytes(w.tokens, model.hidden, w.tp, dtype_bytes(w.dtype))
    by = {g.name: g for g in gemms}
    out = []
    fused = lambda name, phase: asynctp.pieces("torch", w.tp, name, phase, _cast_after_gather(w, name)) > 0
    for block, ag, rs in (("attn", "wq", "wo"), ("mlp", "w_up", "w_down")):
        if ag in by and fused(ag, "forward"):
            out.append(memory_op(gpu, f"async-TP shard copy ({block})", block, "forward", size["shard copy"]))
        if rs in by:
            nb = asynctp.restride_bytes(rs, by[rs].m, by[rs].k, dtype_bytes(w.dtype), w.micro_batch,
                                        w.gemm_dtype(rs) == "fp8" or (w.torch_ring_attention and w.cp > 1))
            out += [memory_op(gpu, f"{asynctp.RESTRIDE} ({rs} input)", block, "forward", nb)] if nb else []
            out.append(memory_op(gpu, f"async-TP partial sum ({rs})", block, "forward", size["partial sum"]))
            if fused(rs + ".dgrad", "backward_input"):
                out.append(memory_op(gpu, f"async-TP shard copy ({rs} grad)", block, "backward_input", size["shard copy"]))
    return out


def _cast_after_gather(w: Workload, name: str) -> bool:
    """Whether GEMM ``name`` (a Gemm name or its ``.dgrad``) is a float8 Linear's under plain TP
    (rowwise, or tensorwise without float8 TP: ``Workload.plain_tp_float8``), whose TP gathers
    torch does not fuse (:func:`meshplan.compute.asynctp.pieces`)."""
    return w.plain_tp_float8 and w.gemm_dtype(name) == "fp8"


def sp_layout_ops(model: ModelSpec, gpu: GPUSpec, w: Workload, gemms: list[Gemm]) -> list[Op]:
    """The layout copies torch's sequence-parallel collectives add on the compute stream when a
    micro-batch holds several sequences (:mod:`meshplan.compute.dtensor_sp`): per dense block
    (attention: wq or Megatron's qkv; MLP: w_up), forward the gather's and the scatter's, backward
    the same two (under torch's async TP: in backward the returned gathered input's and output
    gradient's copies for the weight gradients and the unfused input-gradient scatter's), each
    :func:`~meshplan.compute.dtensor_sp.copy_bytes` of the rank's full ``tokens x hidden``."""
    fw = "torch" if w.sp_layout_copies else ""
    if not dtensor_sp.applies(fw, w.sp, w.tp, w.micro_batch):
        return []
    names = {g.name for g in gemms}
    blocks = tuple(b for b, g in (("attn", ("wq", "qkv")), ("mlp", ("w_up",))) if names & set(g))
    gathers = not any(_cast_after_gather(w, g) for g in ("wq", "qkv", "w_up"))
    return [memory_op(gpu, name, block, phase, dtensor_sp.copy_bytes(w.tokens, model.hidden, _sp_copy_dtype_bytes(
        model, w, name, block, phase))) for name, block, phase in dtensor_sp.copies(blocks, w.async_tp == "torch", gathers)]


def _sp_copy_dtype_bytes(model: ModelSpec, w: Workload, name: str, block: str, phase: str) -> int:
    """Bytes an element of the tensor an SP layout copy moves: 1 for a gather of float8
    (:func:`meshplan.compute.float8.sp_gather_in_float8`: the forward's input, the backward's
    output gradient, async TP's returned gathered input), else the compute dtype's."""
    if "gather" in name:
        what = "input" if phase == "forward" or "gathered input" in name else "output grad"
        if float8.sp_gather_in_float8(model, w, block, what):
            return 1
    return dtype_bytes(w.dtype)
