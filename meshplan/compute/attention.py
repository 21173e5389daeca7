"""The attention core's ops on one rank (:mod:`meshplan.compute.ops`' causal convention): a
fused flash kernel (:func:`flash_ops`: a measured call, the catalog's published FlashAttention
rates, each call of a context-parallel ring (torch's, Transformer Engine's p2p) rated at its own shape
(:func:`meshplan.compute.ring_attention.slowest_rank`, :func:`meshplan.compute.te_ring.te_rank`), or the GEMM ceiling with wave quantization), or the non-flash batched products with the
softmax and dropout over the materialised scores (:func:`score_ops`, Megatron-LM 2022).

Transformer Engine's all-gather CP (Megatron-LM's ``--cp-comm-type all_gather``) runs two calls
a layer, one per load-balanced chunk, each rated at its own shape and run in series (FA3) or on
two streams at once (:mod:`meshplan.compute.te_allgather`). Otherwise (meshplan's runtime,
torchtitan) all-gather CP's one causal call of the rank's ``L = s / cp`` queries against the
gathered ``s`` keys is rated as a ring's calls are (:func:`meshplan.compute.ring_attention.rate_lengths`): the
forward (a block per 128 queries) at its loop over the keys, ``s`` (causal: ``s / 2`` on average
over the rank's two load-balanced chunks, as a causal square row at ``s``), the backward (a block
per 128 keys) at its loop over the queries, ``L`` (``L s / 2`` pairs over ``s`` keys: ``L / 2`` on
average, as a causal square row at ``L``); before, both passes were read at ``s``, held at the
rows' 16,384 end above it.
"""

from __future__ import annotations

from dataclasses import replace
from math import ceil

from meshplan.compute import ring_attention, te_allgather, te_ring
from meshplan.compute.attention_points import FLASH_BLOCK, flash_waves
from meshplan.compute.kernel_time import gemm_ops, issue_floor, memory_op
from meshplan.compute.kernel_fragment import kernel_data
from meshplan.compute.measured import attention_seconds
from meshplan.compute.megatron import attention_copy_bytes, softmax_bytes
from meshplan.compute.ops import Op, Workload
from meshplan.compute.shapes import Attention, Gemm
from meshplan.spec.cluster import GPUSpec
from meshplan.units import dtype_bytes


def flash_ops(gpu: GPUSpec, att: Attention, w: Workload, recompute: bool, table=None) -> list[Op]:
    """The fused attention core's ops (forward, backward, the forward's replay with
    ``recompute``): a measured call (``table``), the catalog's published rates, or the GEMM
    ceiling (module docstring); on a ring (torch's or Transformer Engine's p2p ring,
    :func:`~meshplan.compute.ring_attention.rated_per_call`) the calls of the slowest cp rank
    (:func:`~meshplan.compute.ring_attention.slowest_rank`, :func:`~meshplan.compute.te_ring.te_rank`:
    each call rated at its own shape from the published rates, else its kernels alone decide), on
    torch's then the ring's two kernels; on TE's the calls' seconds by step and TE's correction
    kernels by step (:func:`~meshplan.compute.te_ring.kernel_ops`)."""
    key = (att.batch, att.q_heads, att.kv_heads, att.seq_q, att.seq_kv, att.head_dim, w.dtype)
    measured = getattr(table, "attention", {}).get(key) if table is not None else None
    data = kernel_data(gpu)
    rated = data if measured is None and data is not None and data.attention else None
    ring = ring_attention.slowest_rank(gpu, att, w, rated) if ring_attention.applies(w) else None
    # TE's ring where torch's is off (a comparison's counterfactual may switch both on: torch's then)
    te_on = ring_attention.te_ring(w) and ring is None
    te = te_ring.te_rank(gpu, att, w, rated) if te_on and rated is not None else None
    if te is not None and te.calls is not None:  # TE's calls by step, each rated at its shape
        ring = ring_attention.RingRank(te.rank, (sum(te.calls[0]), sum(te.calls[1]), te.how), 0, 0)
    if measured is not None:  # a measured fused-attention call (GemmTable.attention)
        fwd, note = att.flops(causal_half=True), f"measured ({getattr(table, 'path', '')})"
        timed = lambda phase, t, model, hw, rec=False: Op("attention" + (" (recompute)" if rec else ""), "attn", phase,
                                                          "attention", issue_floor(gpu, t), model, hw, recompute=rec,
                                                          note=note, table_key=key)  # floored like a measured GEMM (gemm_ops)
        out = [timed("forward", measured[0], fwd, fwd), timed("backward_input", measured[1], 2 * fwd, 2.5 * fwd)]
        out += [timed("backward_input", measured[0], 0.0, fwd, True)] if recompute else []
    elif rated is not None:  # published FlashAttention rates (catalog)
        # one call (all-gather CP's (s / cp, s), or cp 1's square): each pass read at its loop length
        if ring is not None and ring.sdpa is not None:
            f_s, b_s, how = ring.sdpa
        elif te_allgather.applies(w):  # TE's all-gather CP: two calls, each at its shape, in series or at once
            ag = te_allgather.te_allgather_rank(gpu, att, w, rated)
            (f_s, b_s), how = ag.seconds, ag.how
        else:
            f_s, b_s, how = attention_seconds(rated, att, causal=True, prefer=w.attention_kernels,
                                              lengths=ring_attention.rate_lengths(att.seq_q, att.seq_kv))
        fwd = att.flops(causal_half=True)
        mk = lambda phase, t, model, hw, rec=False: Op("attention" + (" (recompute)" if rec else ""), "attn",
                                                       phase, "attention", issue_floor(gpu, t), model, hw,
                                                       recompute=rec, note=how, table_key=key)
        out = [mk("forward", f_s, fwd, fwd), mk("backward_input", b_s, 2 * fwd, 2.5 * fwd)]
        out += [mk("backward_input", f_s, 0.0, fwd, True)] if recompute else []
    else:
        out = _ceiling_ops(gpu, att, w, recompute, key)
    if te_on:  # its calls' seconds by step (else the forward call's spread over them), its correction kernels
        te = te or te_ring.te_rank(gpu, att, w, None, next(o.seconds for o in out if o.phase == "forward"))
        return te_ring.with_steps(out, te) + te_ring.kernel_ops(gpu, te)
    return out + (ring_attention.ring_ops(gpu, ring) if ring is not None else [])


def _ceiling_ops(gpu: GPUSpec, att: Attention, w: Workload, recompute: bool, key: tuple) -> list[Op]:
    """Flash attention on a GPU without published rates: the GEMM ceiling with wave quantization
    over one block per 128 queries (:func:`meshplan.compute.attention_points.flash_waves`), never
    below streaming its inputs and output twice."""
    peak = gpu.peak_flops(w.dtype)
    tiles = att.batch * att.q_heads * ceil(att.seq_q / FLASH_BLOCK)
    waves = ceil(tiles / gpu.sms)
    rate = peak * gpu.max_gemm_fraction * flash_waves(gpu.sms, att.batch * att.q_heads, att.seq_q)
    # q and the output (seq_q rows), k and v (seq_kv rows): q, k of head_dim, v and the output of d_v
    io = dtype_bytes(w.dtype) * att.batch * (att.seq_q * att.q_heads + att.seq_kv * att.kv_heads) * (
        att.head_dim + att.d_v)
    fwd = att.flops(causal_half=True)
    note = (f"flash: {tiles} blocks in {waves} waves, {rate / peak:.1%} of peak (GEMM ceiling x wave "
            f"quantization)")
    mk = lambda phase, model, hw, rec=False: Op("attention" + (" (recompute)" if rec else ""), "attn", phase,
                                                "attention", max(hw / rate, 2 * io / gpu.hbm_bandwidth_bytes_per_s),
                                                model, hw, recompute=rec, note=note, table_key=key)
    out = [mk("forward", fwd, fwd), mk("backward_input", 2 * fwd, 2.5 * fwd)]
    if recompute:
        out.append(mk("backward_input", 0.0, fwd, True))
    return out


def score_ops(gpu, att: Attention, w: Workload, table, recompute: bool, alibi: bool = False) -> list[Op]:
    """Non-flash attention: full QK^T and PV batched GEMMs, softmax and dropout on scores;
    with ``w.megatron_ops`` Megatron-LM's causal softmax and copies (:mod:`meshplan.compute.megatron`).
    ``alibi`` (``model.position_embedding``): BigScience's Megatron-DeepSpeed (3d5d151
    ``megatron/model/transformer.py:283-326``) passes its ALiBi tensor, ``[b x heads, 1, s_kv]``, as
    ``baddbmm``'s input with beta 1 (``apply_query_key_layer_scaling`` off; 1 / layer_number on:
    non-zero either way), and torch expands it to the scores' shape and copies it into the result
    before the batched GEMM, which then reads it as C (pytorch/pytorch 002253ce
    ``aten/src/ATen/native/cuda/Blas.cpp`` ``baddbmm_out_cuda``: ``expand_size``; ``baddbmm_out_cuda_impl``:
    ``result.copy_(self)`` when beta != 0, then ``bgemm`` with beta): a copy writing the scores (its
    broadcast source read once) and the scores read again in the GEMM, both memory-bound passes in
    forward (and its recompute); the bias takes no gradient.

    The six batched products per head, (M, N, K), a batch of ``n = batch x heads`` looked up as
    ``(n M, N, K)`` (:mod:`meshplan.compute.measured`): QK^T (s_q, s_kv, d) and its gradients dQ
    (s_q, d, s_kv) and dK (s_kv, d, s_q); PV (s_q, d_v, s_kv) and its gradients dP (s_q, s_kv, d_v)
    and dV = P^T dO (s_kv, d_v, s_q), torch's bmm derivative for the second operand
    (``mat1.transpose(1, 2).bmm(grad)``). dV is taken in that orientation, as dK is: a GEMM and its
    transpose are the same cuBLAS work (column-major, C^T = B^T A^T), and the catalog's A100 rates
    for these products (kernels.toml "D S7a") are one rate for all six, measured together, on the
    (n s, s, d) and (n s, d, s) shapes; the Linear layers' weight-gradient orientation (d_v, s_kv,
    s_q) would put the batch on d_v and read another family of points (210 TFLOP/s against dK's 86.5
    on the 22B layer) for the same work as dK."""
    n = att.batch * att.q_heads
    qk = Gemm("qk^T", att.seq_q, att.seq_kv, att.head_dim, n)
    pv = Gemm("pv", att.seq_q, att.d_v, att.seq_kv, n)
    pv_grads = [Gemm("pv.dgrad", pv.m, pv.k, pv.n, n), Gemm("pv.wgrad", pv.k, pv.n, pv.m, n)]
    scores = n * att.seq_q * att.seq_kv
    b = dtype_bytes(w.dtype)
    sm_f, sm_b = softmax_bytes(att, b, w.megatron_ops)
    fwd_mem = [("softmax", sm_f)] + ([("attention dropout", (2 * b + 1) * scores)] if w.dropout else [])
    if alibi:  # baddbmm's input expanded and copied into the scores, then read as the GEMM's C (docstring)
        fwd_mem += [("alibi bias copy (baddbmm beta 1)", b * (scores + n * att.seq_kv)),
                    ("alibi bias read as C (baddbmm beta 1)", b * scores)]
    bwd_mem = [("softmax backward", sm_b)] + ([("dropout backward", (2 * b + 1) * scores)] if w.dropout else [])
    out = []
    if w.megatron_ops:  # context permute copy; alpha on dQ and dK; the QKV split's backward (compute.megatron)
        f_copies, b_copies = attention_copy_bytes(att, b)
        fwd_mem += f_copies
        bwd_mem += b_copies
    for g, grads in ((qk, None), (pv, pv_grads)):
        ops = gemm_ops(gpu, g, "attn", w, table, model_scale=0.5, weight=False, backward=grads)  # causal half
        out += [replace(o, phase="backward_input") if o.phase == "backward_weight" else o for o in ops]
    out += [memory_op(gpu, name, "attn", "forward", nb) for name, nb in fwd_mem]
    out += [memory_op(gpu, name, "attn", "backward_input", nb) for name, nb in bwd_mem]
    if recompute:
        fwd = [o for o in out if o.phase == "forward"]
        out += [replace(o, name=o.name + " (recompute)", phase="backward_input", model_flops=0.0, recompute=True)
                for o in fwd]
    return out
