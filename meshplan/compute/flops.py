"""Model FLOP, MFU and HFU (:mod:`meshplan.compute.ops`' conventions; Korthikanti et al. 2022,
appendix A): one sequence's model FLOP (:func:`sequence_model_flops`), that paper's closed form
and its published 22B measurements (:func:`korthikanti_model_flops`,
:data:`KORTHIKANTI_22B_MEASURED`), utilization (:func:`utilization`) and why hardware FLOP exceed
model FLOP (:func:`flop_gap`); torchtitan's logged MFU, its FLOP per token and peak
(:func:`torchtitan_flops_per_token`, :func:`torchtitan_peak_flops`, :func:`torchtitan_mfu`); Megatron-LM's
logged throughput per GPU, its FLOP per iteration and their terms (:func:`megatron_flops_per_iteration`,
:func:`megatron_attention_terms`, :func:`megatron_mlp_flops_per_token`, :func:`megatron_throughput`).
"""

from __future__ import annotations

from typing import Optional

from meshplan.compute.shapes import MLA_REPLICATED, attention_shape, layer_gemms
from meshplan.spec.cluster import GPUSpec
from meshplan.spec.model import ModelSpec


def sequence_model_flops(model: ModelSpec, seq_len: int) -> float:
    """Model FLOP of one sequence, forward + backward, per the module convention: every
    layer's GEMMs and causal-half attention (x3), and the output layer on the unpadded
    vocabulary (x3). Independent of the mesh.

    >>> from meshplan import catalog
    >>> m = catalog.model("megatron-22b")
    >>> f = sequence_model_flops(m, 2048)
    >>> s, L, h, V = 2048, 48, 6144, 51200
    >>> f == 3 * L * (24 * s * h * h + 2 * s * s * h) + 3 * 2 * s * h * V
    True
    """
    total = 0.0
    for i in range(model.layers):
        gemms = layer_gemms(model, 1, seq_len, layer=i)
        total += 3 * sum(g.flops for g in gemms)
        total += 3 * attention_shape(model, 1, 1, 1, seq_len).flops(causal_half=True)
    total += 3 * 2.0 * seq_len * model.hidden * model.vocab
    return total


#: Published development reference (Korthikanti et al. 2022, arXiv 2205.05198, Tables 3-5; 22B
#: model, one DGX A100, tp 8, micro-batch 4, seq 2048; ../shared/reference/public-facts.md):
#: (recompute, sequence parallel) -> (layer forward ms, layer backward ms, step s or None).
#: Printed beside predictions; no constant is fitted to it.
KORTHIKANTI_22B_MEASURED = {  # (recompute, sequence parallel): (layer forward ms, layer backward ms, step s)
    ("none", False): (7.7, 11.9, None),
    ("none", True): (7.2, 11.8, None),
    ("full", False): (7.7, 19.5, 1.42),
    ("selective", False): (7.7, 13.2, None),
    ("selective", True): (7.2, 13.1, 1.10),
}


def korthikanti_model_flops(batch: int, seq_len: int, layers: int, hidden: int, vocab: int) -> float:
    """Model FLOP per iteration of a GPT model (4h MLP, multi-head attention) in Korthikanti
    et al. 2022, appendix A: ``72 B s L h^2 (1 + s / (6 h) + V / (12 h L))``; it counts the
    full (not causal-halved) attention, so it exceeds :func:`sequence_model_flops` x B by
    ``6 B s^2 h L``.

    >>> round(korthikanti_model_flops(4, 2048, 48, 6144, 51200) / 1e15, 4)
    1.1436
    """
    b, s, L, h, V = batch, seq_len, layers, hidden, vocab
    return 72.0 * b * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))


def utilization(flops_per_step: float, step_s: float, ranks: int, gpu: GPUSpec, dtype: str = "bf16") -> float:
    """FLOP per step / (step seconds x ranks x dense peak of ``dtype``): MFU with model
    FLOP, HFU with hardware FLOP (Korthikanti et al. 2022, appendix A).

    >>> from meshplan import catalog
    >>> round(utilization(korthikanti_model_flops(4, 2048, 48, 6144, 51200), 1.10, 8,
    ...                   catalog.gpu("a100-sxm-80gb")), 3)
    0.417
    """
    return flops_per_step / (step_s * ranks * gpu.peak_flops(dtype))


#: Why an op's hardware FLOP exceed its model FLOP (:func:`flop_gap`), in printing order. MLA has
#: no KV heads to copy: its gap under tp is the down projections every tp rank runs whole
#: (:data:`meshplan.compute.shapes.MLA_REPLICATED`), named with those the model has.
FLOP_GAP_CAUSES = ("recompute", "flash backward recomputes QK^T", "full attention products (no causal skip)",
                   "padded vocabulary", "replicated KV heads", "replicated MLA down-projections")


def flop_gap(ops) -> dict[str, float]:
    """Hardware minus model FLOP of ``ops`` (iterable of :class:`~meshplan.compute.ops.Op`) by cause, the reasons
    HFU exceeds MFU without any recompute policy: recomputed ops (model FLOP 0); a flash
    kernel's backward, 2.5x its forward against the model's 2x (FlashAttention-2 recomputes
    ``QK^T``); a non-flash kernel's full ``QK^T`` and ``PV`` against the causal half; the
    output layer over the padded vocabulary; wk and wv over replicated KV heads; MLA's
    replicated down projections, named ``replicated MLA down-projections (wq_a, wkv_a)`` with
    those that have a gap (V2-Lite has no wq_a). Causes with no gap are left out.

    Llama-3-8B, tp 2, seq 8192, flash, no recompute: only the flash backward, 0.5 x the
    causal-half forward attention FLOP per layer (``tests/test_mfu_hfu.py``)."""
    out: dict[str, float] = {}
    mla: list[str] = []
    for o in ops:
        d = o.hardware_flops - o.model_flops
        if d <= 0:
            continue
        base = o.name.split(".")[0]
        cause = ("recompute" if o.recompute else FLOP_GAP_CAUSES[1] if o.kind == "attention" else
                 FLOP_GAP_CAUSES[2] if base in ("qk^T", "pv") else FLOP_GAP_CAUSES[3] if o.block == "head"
                 else FLOP_GAP_CAUSES[5] if base in MLA_REPLICATED else FLOP_GAP_CAUSES[4])
        if cause == FLOP_GAP_CAUSES[5] and base not in mla:
            mla.append(base)
        out[cause] = out.get(cause, 0.0) + d
    named = {FLOP_GAP_CAUSES[5]: f"{FLOP_GAP_CAUSES[5]} ({', '.join(n for n in MLA_REPLICATED if n in mla)})"}
    return {named.get(c, c): out[c] for c in FLOP_GAP_CAUSES if c in out}


#: torchtitan's ``get_peak_flops`` (v0.2.2, e347b1e ``torchtitan/tools/utils.py``:76-144): the bf16
#: dense peak by device-name substring, tried in its order, for every dtype (a float8 run's MFU too),
#: FLOP/s. Its first step swaps the CUDA device name for ``lspci``'s NVIDIA line when that line holds
#: "H100" (lines 78-88): Hopper parts list as "GH100", so an H800 counts as an H100 there.
TORCHTITAN_PEAKS = (("A100", 312e12), ("H100 NVL", 835e12), ("H100 PCIE", 756e12), ("H100", 989e12),
                    ("H800", 989e12), ("H200", 989e12), ("H20", 148e12), ("B200", 2.25e15), ("MI355X", 2500e12),
                    ("MI300X", 1300e12), ("MI325X", 1300e12), ("MI250X", 191.5e12), ("L40S", 362e12))

#: What torchtitan falls back to for a device name it does not know: the A100's (utils.py:142-144).
TORCHTITAN_FALLBACK_PEAK = 312e12


def torchtitan_peak_flops(gpu_name: str) -> float:
    """The peak torchtitan's logged MFU divides by for a GPU named ``gpu_name`` (a catalog name),
    FLOP/s: the first :data:`TORCHTITAN_PEAKS` substring it holds (case-insensitive, "-" read as
    " "), else :data:`TORCHTITAN_FALLBACK_PEAK`. A GB200's name holds "B200".

    >>> [torchtitan_peak_flops(n) / 1e12 for n in ("h100-sxm5-80gb", "h200-sxm-141gb", "b200-gb200-186gb")]
    [989.0, 989.0, 2250.0]
    """
    name = gpu_name.upper().replace("-", " ")
    return next((peak for key, peak in TORCHTITAN_PEAKS if key in name), TORCHTITAN_FALLBACK_PEAK)


def torchtitan_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """torchtitan's FLOP per token for MFU (v0.2.2, e347b1e), FLOP. A dense model without MLA:
    ``get_dense_model_nparams_and_flops`` (``torchtitan/models/utils.py``:388-431) with llama3's
    ``head_dims = 2 * (dim // n_heads)`` (``models/llama3/model/args.py``:67-73; qwen3's ``2 * head_dim``,
    ``models/qwen3/model/args.py``:62-63, the same count): ``6 (N - N_emb) + 6 l h (2 q) t`` with N every
    parameter (a tied output once), N_emb the nn.Embedding tables, l layers, h query heads, q the head dim
    (``head_dim``, else hidden // h: :attr:`~meshplan.spec.model.ModelSpec.d_head`), t = training.seq_len;
    attention not halved for causal, recompute not counted. An MoE or MLA model:
    :func:`torchtitan_moe_flops_per_token`.

    Llama-3-8B at t 8192: 6 x (8,030,261,248 - 128,256 x 4,096) + 12 x 32 x 32 x 128 x 8192
    = 6 x 7,504,924,672 + 12,884,901,888 = 57,914,449,920.

    >>> from meshplan import catalog
    >>> torchtitan_flops_per_token(catalog.model("llama3-8b"), 8192)
    57914449920.0
    """
    if model.is_moe or model.is_mla:
        return torchtitan_moe_flops_per_token(model, seq_len)
    n_emb = sum(t.numel for t in model.embedding_tensors(model.vocab))
    q = model.d_head
    return 6.0 * (model.param_count() - n_emb) + 6.0 * model.layers * model.q_heads * (2 * q) * seq_len


def torchtitan_head_dims(model: ModelSpec) -> int:
    """The ``head_dims`` torchtitan's FLOP count multiplies attention by: MLA (its deepseek_v3,
    e347b1e ``models/deepseek_v3/model/args.py``:118-124) ``qk_nope + qk_rope + v_head_dim``; else
    ``2 x head_dim`` (qwen3's and llama3's). DeepSeek-V2-Lite's shape: 128 + 64 + 128 = 320."""
    if model.is_mla:
        return (model.qk_nope_head_dim or 0) + (model.qk_rope_head_dim or 0) + model.d_v
    return 2 * model.d_head


def torchtitan_moe_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """torchtitan's ``get_moe_model_nparams_and_flops`` (v0.2.2, e347b1e ``torchtitan/models/utils.py``:434-498,
    which deepseek_v3's and qwen3's ``get_nparams_and_flops`` call): ``6 (N_dense - N_emb + N_router +
    N_shared + N_experts x top_k // E) + 6 l h head_dims t``, FLOP per token. Its parameters by name
    (lines 461-472): "embedding" (the token table, in N_dense and taken off), "moe.shared_experts",
    "moe.router" (the gate, hidden x E), "moe.experts" (every routed expert of every MoE layer, summed,
    then x top_k // E in integers, line 480) and the rest dense (attention, norms, dense layers' MLPs,
    the output layer); ``head_dims`` :func:`torchtitan_head_dims`, h query heads, l layers, t seq_len;
    attention not halved for causal. meshplan's tensors (:meth:`~meshplan.spec.model.ModelSpec.layer_tensors`)
    are torchtitan's modules, so N_experts is the ``expert`` tensors and the rest follows from the total.

    DeepSeek-V2-Lite's shape (torchtitan's deepseek_v3 16B) at 1 layer dense + 1 MoE, t 4096: see
    ``tests/test_newcomer48b.py`` for the count by hand.
    """
    tensors = [t for i in range(model.layers) for t in model.layer_tensors(i)]
    n_experts = sum(t.numel for t in tensors if t.expert)
    n_emb = sum(t.numel for t in model.embedding_tensors(model.vocab))
    active = model.param_count() - n_emb - n_experts + (n_experts * model.top_k // model.experts if n_experts else 0)
    return 6.0 * active + 6.0 * model.layers * model.q_heads * torchtitan_head_dims(model) * seq_len


def torchtitan_flops_words(model: ModelSpec) -> str:
    """How :func:`torchtitan_flops_per_token` counted ``model``, for the step line."""
    if not (model.is_moe or model.is_mla):
        return "6 x non-embedding params + 12 x layers x heads x head dim x seq, attention not halved"
    experts = f"routed experts x top_k {model.top_k} / {model.experts}, " if model.is_moe else ""
    dims = "(qk_nope + qk_rope + v head dims)" if model.is_mla else "2 x head dim"
    return (f"get_moe_model_nparams_and_flops: 6 x active non-embedding params ({experts}router and shared "
            f"experts whole) + 6 x layers x heads x {dims} x seq, attention not halved")


def torchtitan_mfu(flops_per_token: float, tokens_per_step: int, step_s: float, world: int,
                   peak_flops: float) -> float:
    """torchtitan's logged MFU as a fraction (e347b1e ``torchtitan/components/metrics.py``:421-428:
    ``tps = ntokens / (time x (cp x tp x pp))`` with ntokens a data-parallel rank's tokens,
    so tokens per second per GPU = ``tokens_per_step / (step_s x world)``; ``mfu = flops_per_token
    x tps / peak``).

    >>> round(torchtitan_mfu(57914449920.0, 8 * 8192, 1.0, 8, 989e12), 4)
    0.4797
    """
    return flops_per_token * tokens_per_step / (step_s * world) / peak_flops


#: Where Megatron-LM's logged throughput comes from: NVIDIA/Megatron-LM d98e8a64dd,
#: ``megatron/training/training.py``: ``num_floating_point_operations`` (lines 802-1388; its
#: ``transformer_flops``, 1009-1311) and the ``throughput per GPU (TFLOP/s/GPU)`` it logs with
#: ``--log-throughput`` (3550-3555, 3577-3578).
MEGATRON_FLOPS_SOURCE = "NVIDIA/Megatron-LM d98e8a64dd megatron/training/training.py:802-1388, 3550-3578"


def megatron_attention_terms(model: ModelSpec) -> tuple[float, float]:
    """Megatron-LM's ``transformer_flops`` attention terms for one layer (d98e8a64dd
    ``training.py``:1079-1170, 1305-1309), forward + backward: (FLOP per token of the projections,
    ``standard_self_attn_term``; FLOP per sequence per seq_len^2 of ``QK^T`` and ``PV``,
    ``standard_self_attn_core_term``). Both carry its ``3 x 2`` (fwd + wgrad + dgrad, FMA).

    MHA/GQA (1141-1170): q = kv_channels x heads, k = v = kv_channels x query groups (kv_channels
    is :attr:`~meshplan.spec.model.ModelSpec.d_head`, Megatron's default hidden / heads);
    projections ``6 (h (q + k + v) + q h)``, core ``6 q / 2 x 2`` (causal half, two products) = 6 q.
    MLA (1079-1137; qk_head_dim is qk_nope, qk_pos_emb_head_dim qk_rope): q ``h n (qk + rope)``,
    or with q_lora_rank r ``r (h + n (qk + rope) + 1)``; kv ``kv_lora (h + n (qk + v) + 1) + h rope``;
    out ``n v h``; core ``6 (n (qk + rope) / 2 + n v / 2)``. Megatron's ``--attention-output-gate``
    (a gate projection of q's size) has no meshplan field: not counted.

    Llama-3-70B (h 8192, 64 heads of 128, 8 groups): ``6 (8192 x (8192 + 2048) + 8192^2)`` =
    905,969,664 per token and ``6 x 8192`` = 49,152 per s^2.

    >>> from meshplan import catalog
    >>> megatron_attention_terms(catalog.model("llama3-70b"))
    (905969664.0, 49152.0)
    """
    h, n = model.hidden, model.q_heads
    if model.is_mla:
        qk, rope, v = model.qk_nope_head_dim or 0, model.qk_rope_head_dim or 0, model.d_v
        r = model.q_lora_rank
        q_term = h * n * (qk + rope) if r is None else r * (h + n * (qk + rope) + 1)
        kv_term = (model.kv_lora_rank or 0) * (h + n * (qk + v) + 1) + h * rope
        return 6.0 * (q_term + kv_term + n * v * h), 6.0 * (n * (qk + rope) / 2 + n * v / 2)
    q, kv = model.d_head * n, model.d_head * model.n_kv_heads
    return 6.0 * (h * (q + 2 * kv) + q * h), 6.0 * q


def megatron_mlp_flops_per_token(model: ModelSpec) -> float:
    """Megatron-LM's MLP FLOP per token over all layers, forward + backward (d98e8a64dd
    ``training.py``:1065-1070, 1255-1285): ``6 h (ffn x e x dense layers + (moe_ffn x top_k x e
    + shared width x e) x MoE layers)``, e = 3 with ``--swiglu`` (gated MLP), else 2; the MoE layers
    those ``--moe-layer-freq`` marks (meshplan: all but the first ``dense_layers``, as its
    Megatron export writes ``[0]*K+[1]*(L-K)``), the shared width ``--moe-shared-expert-intermediate-size``
    (shared experts x their width). The router's GEMM is not counted.

    Llama-3-70B: ``6 x 8192 x 28672 x 3 x 80`` = 338,228,674,560.

    >>> from meshplan import catalog
    >>> megatron_mlp_flops_per_token(catalog.model("llama3-70b"))
    338228674560.0
    """
    e = 3 if model.gated_mlp else 2
    if not model.is_moe:
        return 6.0 * model.hidden * model.ffn * e * model.layers
    moe_layers = model.layers - model.dense_layers
    shared = (model.shared_expert_ffn or model.moe_ffn) * model.shared_experts
    width = model.ffn * e * model.dense_layers + (model.moe_ffn * model.top_k * e + shared * e) * moe_layers
    return 6.0 * model.hidden * width


def megatron_flops_per_iteration(model: ModelSpec, global_batch: int, seq_len: int, padded_vocab: int) -> float:
    """``num_floating_point_operations(args, batch_size)`` of Megatron-LM (d98e8a64dd
    ``training.py``:802-1388) for unpacked (BSHD) sequences, FLOP per iteration: tokens ``B s``
    x (:func:`megatron_mlp_flops_per_token` + layers x the attention projections + logits
    ``6 h V_padded``) + ``B s^2`` x layers x the core attention (:func:`megatron_attention_terms`).
    V_padded is ``args.padded_vocab_size`` (the vocabulary padded to ``--make-vocab-size-divisible-by``
    x tp, ``megatron/core/tokenizers/utils/build_tokenizer.py``:138). Every term is x3 for forward +
    backward whatever ``--recompute-granularity``: the formula has no recompute term, so it counts
    model FLOP (causal-half attention) and stays the same when recomputation lengthens the step.
    Multi-token prediction, hybrid (Mamba) and linear-attention layers: no meshplan fields, not counted.

    Llama-3-70B at B 1, s 8192, tp 1 (V_padded 128,256: 1,002 x 128): 8192 x (338,228,674,560 + 80 x 905,969,664
    + 6 x 8192 x 128,256) + 8192^2 x 80 x 49,152 = 3,680,031,058,427,904.

    >>> from meshplan import catalog
    >>> megatron_flops_per_iteration(catalog.model("llama3-70b"), 1, 8192, 128256)
    3680031058427904.0
    """
    proj, core = megatron_attention_terms(model)
    per_token = megatron_mlp_flops_per_token(model) + model.layers * proj + 6.0 * model.hidden * padded_vocab
    return global_batch * seq_len * per_token + global_batch * seq_len * seq_len * model.layers * core


def megatron_throughput(flops_per_iteration: float, step_s: float, world: int) -> float:
    """What Megatron-LM's ``--log-throughput`` logs as ``throughput per GPU (TFLOP/s/GPU)``, in
    FLOP/s per GPU (d98e8a64dd ``training.py``:3550-3555: ``num_floating_point_operations / (elapsed
    time per iteration x 10**12 x world_size)``; it prints that /1e12 value to one decimal, 3578).

    >>> megatron_throughput(3680031058427904.0 * 32, 0.4, 256) / 1e12
    1150.00970575872
    """
    return flops_per_iteration / (step_s * world)
