"""The memory-bound ops of a transformer layer on one rank (:mod:`meshplan.compute.ops`'
conventions): norms (fused, Megatron-LM's persistent layer norm, or torchtitan's decomposed
RMSNorm), residual adds and their gradients' accumulation, the activation, RoPE, MLA's latent
norms, torchtitan's ``repeat_kv`` (with ``[memory] kv_expanded`` alone: since pytorch/torchtitan ff0829c
its SDPA takes ``enable_gqa=True`` and nothing is copied), the MoE permutation (:func:`elementwise_ops`), and the linear
biases as Megatron-LM's GPT applies them (:func:`bias_ops`).
"""

from __future__ import annotations

from meshplan.compute.kernel_time import memory_op
from meshplan.compute.megatron import norm_backward_partial_bytes, norm_backward_passes, persistent_layer_norm
from meshplan.compute.ops import Op, Workload
from meshplan.compute.routing import routed_tokens, routing
from meshplan.compute.shapes import Gemm, qkv_local_features
from meshplan.compute.torch_eager import RMSNORM_ROW_KERNELS, repeat_kv_bytes, rmsnorm_bytes, rope_bytes, \
    swiglu_bytes
from meshplan.mesh.tpsplit import local_heads
from meshplan.spec.axes.tp import sdpa_kv_heads
from meshplan.spec.cluster import GPUSpec
from meshplan.spec.model import ModelSpec
from meshplan.units import dtype_bytes


def elementwise_ops(model: ModelSpec, gpu: GPUSpec, w: Workload, gemms: list[Gemm]) -> list[Op]:
    """Norms, residual adds (+ dropout), RoPE, activation, MoE permutation: forward and backward."""
    b, h, r, t = dtype_bytes(w.dtype), model.hidden, w.row_tokens, w.tokens
    q_l, kv_l, _ = local_heads(model, w.tp)
    act = sum(activation_elements(model, gemms).values())
    res_f = (3 * b + (1 if w.dropout else 0)) * r * h
    res_b = (3 * b if not w.dropout else 2 * b + 1) * r * h
    spec: list[tuple[str, str, float, float]] = [*norm_spec(model, gpu, w, "attn norm", "attn_pre", r),
            ("residual add" + (" + dropout" if w.dropout else ""), "attn_post", res_f, res_b),
            *norm_spec(model, gpu, w, "mlp norm", "mlp_pre", r),
            ("residual add" + (" + dropout" if w.dropout else ""), "mlp_post", res_f, res_b)]
    if model.gated_mlp:  # torch_eager: silu and the multiply apart (compute.torch_eager)
        fwd, bwd = swiglu_bytes(b, w.torch_eager)
        spec += [(name, "mlp", nb * act, 0.0) for name, nb in fwd] + [(name, "mlp", 0.0, nb * act) for name, nb in bwd]
    else:
        spec.append(("gelu", "mlp", 2 * b * act, 3 * b * act))
    # backward: the residual stream's gradient is the sum of two branches (the skip path and the
    # norm's input gradient); autograd accumulates them with one add per fork (torch
    # autograd InputBuffer::accumulate: read both, write one), before each norm's backward
    spec += [("residual grad accumulate", "attn_pre", 0.0, 3 * b * r * h),
             ("residual grad accumulate", "mlp_pre", 0.0, 3 * b * r * h)]
    # RoPE: one fused kernel over q and k, or eagerly three kernels on each (compute.torch_eager);
    # MLA: on each local head's q_pe and on the one shared k_pe (DeepSeek-V2 eq. 13-14)
    roped = ((q_l, 1), model.qk_rope_head_dim or 0) if model.is_mla else \
        ((q_l, kv_l), model.d_head if model.position_embedding == "rope" else 0)
    if roped[1]:
        parts = roped[0] if w.torch_eager else (sum(roped[0]),)
        spec += [(name, "attn", nb * t * heads * roped[1], nb * t * heads * roped[1])
                 for heads in parts for name, nb in rope_bytes(b, w.torch_eager)]
    if model.is_mla:
        spec += _latent_norms(model, b, t)
    if not w.megatron_ops and not model.is_mla:  # torchtitan's repeat_kv before SDPA, where the SDPA reads the q heads
        rep_f, rep_b = repeat_kv_bytes(b, sdpa_kv_heads(q_l, kv_l, w.kv_expanded), kv_l, t, model.d_head)
        if rep_f:
            spec.append(("repeat_kv", "attn", rep_f, rep_b))
    if any(g.name.startswith("expert_") for g in gemms):  # the dispatch buffer's rows (compute.routing)
        # the rows the rank's all-to-all carries (Megatron-LM permutes its own tokens before the etp gather)
        rows = routing(w.routing, routed_tokens(t, w.tp, w.etp, w.framework)[0], model.top_k, model.experts,
                       w.ep).recv_rows
        nb = 2 * b * rows * h
        spec += [("moe permute", "mlp", nb, nb), ("moe unpermute", "mlp", nb, nb)]
    out = []
    for name, block, f, bw in spec:
        kind = "norm" if name.endswith("norm") else "elementwise"
        out += [memory_op(gpu, name, block, phase, nb, kind=kind)
                for phase, nb in (("forward", f), ("backward_input", bw)) if nb > 0]
    return out + norm_finalize_ops(model, gpu, w, (("attn norm", "attn_pre"), ("mlp norm", "mlp_pre")))


def activation_elements(model: ModelSpec, gemms: list[Gemm]) -> dict[str, float]:
    """Elements the MLP activation writes, by the GEMM that feeds it (``w_up``, ``expert_w_up``,
    ``shared_w_up``): its output columns x rows x count, as :func:`elementwise_ops` times the
    activation (the routed and shared experts' shares of it: :func:`meshplan.compute.recompute.module_replays`).

    >>> from meshplan import catalog
    >>> from meshplan.compute.shapes import layer_gemms
    >>> activation_elements(catalog.model("mixtral-8x7b"), layer_gemms(catalog.model("mixtral-8x7b"), 1, 4096))
    {'expert_w_up': 117440512}

    DeepSeek-V3's shared expert (one of width 2,048) runs gate and up as one GEMM of 4,096 columns,
    whose activation writes 4,096 tokens x 2,048 (before, the ``w_up`` suffix matched it first and
    counted all 4,096 columns, twice its activation's bytes):

    >>> activation_elements(catalog.model("deepseek-v3"), layer_gemms(catalog.model("deepseek-v3"), 1, 4096))
    {'expert_w_up': 67108864, 'shared_w_up': 8388608.0}
    """
    out: dict[str, float] = {}
    for g in gemms:
        if g.name == "shared_w_up":  # gate and up in one GEMM when gated (shapes.layer_gemms)
            out[g.name] = g.m * g.n / (2 if model.gated_mlp else 1)
        elif g.name.endswith("w_up"):
            out[g.name] = g.m * g.n * g.count
    return out


def norm_spec(model: ModelSpec, gpu: GPUSpec, w: Workload, name: str, block: str,
              rows: int) -> list[tuple[str, str, float, float]]:
    """One norm over ``rows`` rows of ``model.hidden`` as (name, block, forward bytes, backward
    bytes) kernels: one fused kernel each way (``name``: read and write ``rows x h``; backward
    :func:`norm_backward_bytes`), or under ``w.decomposed_norm`` torchtitan's pre-2025 RMSNorm
    kernel by kernel (:func:`~meshplan.compute.torch_eager.rmsnorm_bytes`, named ``name`` + the
    kernel; per-row kernels of ``rows`` values).

    Llama 3 8B, 16,384 rows of 4,096 in bf16: 67,108,864 elements, forward 36 B each and 16 B
    a row (8 kernels), backward 92 B each and 28 B a row (16 kernels), against 4 B and 6 B fused:

    >>> from meshplan import catalog
    >>> m, g = catalog.model("llama3-8b"), catalog.gpu("h100-sxm5-80gb")
    >>> w = Workload(seq_len=8192, micro_batch=2, decomposed_norm=True)
    >>> k = norm_spec(m, g, w, "mlp norm", "mlp_pre", 16384)
    >>> len(k), sum(f for *_, f, _ in k) - 36 * 67108864, sum(b for *_, b in k) - 92 * 67108864
    (24, 262144.0, 458752.0)
    >>> norm_spec(m, g, Workload(seq_len=8192, micro_batch=2), "mlp norm", "mlp_pre", 16384)
    [('mlp norm', 'mlp_pre', 268435456, 402653184)]
    """
    b, n = dtype_bytes(w.dtype), rows * model.hidden
    if not w.decomposed_norm:
        return [(name, block, 2 * b * n, norm_backward_bytes(model, gpu, w, rows))]
    fwd, bwd = rmsnorm_bytes(b)
    row_f, row_b = RMSNORM_ROW_KERNELS
    out: list[tuple[str, str, float, float]] = []
    for kernels, count, forward in ((fwd, n, True), (row_f, rows, True), (bwd, n, False), (row_b, rows, False)):
        out += [(f"{name} {k}", block, float(nb * count) if forward else 0.0, 0.0 if forward else float(nb * count))
                for k, nb in kernels]
    return out


def norm_backward_bytes(model: ModelSpec, gpu: GPUSpec, w: Workload, rows: int) -> float:
    """HBM bytes of one norm's backward kernel over ``rows`` rows of ``model.hidden``:
    :func:`~meshplan.compute.megatron.norm_backward_passes` passes of ``rows x h`` (5 for Megatron-LM's
    own layer norm, 3 for one fused kernel) and, for apex's persistent layer norm that Megatron-LM
    2022 runs at its hidden sizes (:func:`~meshplan.compute.megatron.persistent_layer_norm`), the
    partial weight and bias gradients it writes (:func:`~meshplan.compute.megatron.norm_backward_partial_bytes`).

    22B (h 6144) under SP at tp 8, micro-batch 4: 1,024 rows, 3 x 2 B x 1024 x 6144 + 108 x 6144 x 8 B
    of partials on an A100:

    >>> from meshplan import catalog
    >>> w = Workload(seq_len=2048, micro_batch=4, tp=8, sp=True, megatron_ops=True)
    >>> norm_backward_bytes(catalog.model("megatron-22b"), catalog.gpu("a100-sxm-80gb"), w, 1024)
    43057152
    """
    b, h = dtype_bytes(w.dtype), model.hidden
    persistent = w.megatron_ops and persistent_layer_norm(model.norm, h)
    partial = norm_backward_partial_bytes(h, gpu.sms) if persistent else 0
    return norm_backward_passes(w.megatron_ops, persistent) * b * rows * h + partial


def norm_finalize_ops(model: ModelSpec, gpu: GPUSpec, w: Workload, norms) -> list[Op]:
    """The second kernel of apex's persistent layer norm backward (``ln_bwd_finalize_kernel``) for
    each ``(name, block)`` of ``norms``, under Megatron-LM 2022 at a persistent hidden size
    (:func:`norm_backward_bytes`): it reads the partial weight and bias gradients and writes the two
    gradients (``2 h`` elements of the compute dtype), a memory-bound kernel never below the issue
    floor. Empty otherwise (one kernel, or Megatron's own)."""
    if not (w.megatron_ops and persistent_layer_norm(model.norm, model.hidden)):
        return []
    nb = norm_backward_partial_bytes(model.hidden, gpu.sms) + 2 * dtype_bytes(w.dtype) * model.hidden
    return [memory_op(gpu, f"{name} backward finalize", block, "backward_input", nb) for name, block in norms]


def _latent_norms(model: ModelSpec, b: int, t: int) -> list[tuple[str, str, float, float]]:
    """MLA's latent RMSNorms (``q_a_layernorm`` over q_lora_rank, ``kv_a_layernorm`` over
    kv_lora_rank) as memory ops on all ``t`` tokens of the rank (they follow the replicated
    down projections, so sequence parallelism does not shorten them): forward reads the
    latent and writes its normalised copy (2 b t r), backward reads the input and the
    incoming gradient and writes the input gradient (3 b t r), as the layer norms above."""
    out: list[tuple[str, str, float, float]] = []
    for name, r in (("q_a norm", model.q_lora_rank), ("kv_a norm", model.kv_lora_rank)):
        if r:
            out.append((name, "attn", 2 * b * t * r, 3 * b * t * r))
    return out


def bias_ops(model: ModelSpec, gpu: GPUSpec, w: Workload, moe: bool) -> list[Op]:
    """Linear biases as Megatron-LM's GPT applies them: the QKV bias is a separate add after
    the column-parallel GEMM (read and write ``tokens x local qkv width``,
    :func:`~meshplan.compute.shapes.qkv_local_features`); the MLP-up bias is
    fused into the bias-GeLU kernel and the row-parallel (wo, MLP-down) biases into
    bias-dropout-add (no extra forward kernel). Backward: each bias gradient is a sum over
    tokens of its output gradient, a memory-bound read: ``tokens x width`` for the column-parallel
    ones, ``row tokens x h`` (sequence shard with SP) for the row-parallel ones."""
    b, h, t, r = dtype_bytes(w.dtype), model.hidden, w.tokens, w.row_tokens
    q_n, kv_n = qkv_local_features(model, w.tp, w.framework)  # Megatron-LM past the KV heads: its 1/tp
    qkv = t * (q_n + 2 * kv_n)
    out = []
    if model.qkv_bias or model.linear_bias:
        out += [memory_op(gpu, "qkv bias add", "attn", "forward", 2 * b * qkv),
                memory_op(gpu, "qkv bias grad", "attn", "backward_weight", b * qkv)]
    if model.linear_bias:
        out.append(memory_op(gpu, "wo bias grad", "attn", "backward_weight", b * r * h))
        if not moe:
            f = model.ffn // w.tp * (2 if model.gated_mlp else 1)
            out += [memory_op(gpu, "mlp up bias grad", "mlp", "backward_weight", b * t * f),
                    memory_op(gpu, "mlp down bias grad", "mlp", "backward_weight", b * r * h)]
    return out
