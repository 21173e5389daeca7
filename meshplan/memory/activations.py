"""Activation bytes kept for the backward pass, per layer and per micro-batch, on one rank.

Source: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv 2205.05198), section 4, Table 2: 16-bit activations, 1-byte dropout masks.
For the GPT layer (multi-head attention, 4h GeLU MLP, dropout) with s tokens, micro-batch
b, hidden h, a heads, tensor degree t:

=========================== ===================================
no parallelism              ``s b h (34 + 5 a s / h)``
tensor parallel             ``s b h (10 + 24/t + 5 a s / (h t))``
tensor + sequence parallel  ``s b h / t (34 + 5 a s / h)``
+ selective recompute       the ``5 a s / h`` term removed
full recompute              ``2 s b h`` (``/ t`` with sequence parallel)
=========================== ===================================

The formula gives bytes (dtype sizes are inside the coefficients). :func:`table2_bytes`
is the closed form; :func:`layer_terms` derives it tensor by tensor, generalised to GQA and
gated MLPs, and reduces exactly to Table 2 for the GPT layer.

Derivation per tensor (g KV heads, d head dim, f MLP width per gate; GPT: a d = h, g = a,
f = 4h). [r] = held whole by every tp rank, divided by t only with sequence parallel
(Megatron stores the sequence-sharded norm output and all-gathers it again in backward,
Korthikanti 4.2.2); [sc] = score terms; [do] = only with dropout.

Attention (Table 2: ``11 s b h + 5 a s^2 b``):
  attention-norm input 2sbh [r]; QKV-projection input (norm output) 2sbh [r];
  Q 2sb(ad)/t and K 2sb(gd)/t (kept by QK^T); softmax output 2as^2b/t [sc];
  softmax-dropout mask as^2b/t [sc][do]; dropout output 2as^2b/t [sc][do] (without dropout
  attention-over-V reuses the softmax output); V 2sb(gd)/t; context (output-projection
  input) 2sb(ad)/t; residual-dropout mask sbh [r][do].
  GPT: 2+2+1 = 5 sbh [r] + 8 sbh/t + 5 a s^2 b / t (the two norm inputs are Table 2's
  ``4 s b h`` LayerNorm term, split between attention and MLP here).
MLP (Table 2: ``19 s b h``):
  MLP-norm input 2sbh [r]; w_in input 2sbh [r]; residual-dropout mask sbh [r][do];
  non-gated: activation input 2sbf/t + activation output (w_out input) 2sbf/t = 4sbf/t
  (16 sbh/t at f = 4h); gated, each op keeping its inputs: gate (SiLU input) 2sbf/t,
  SiLU output 2sbf/t, up 2sbf/t, product (w_out input) 2sbf/t = 8sbf/t; gated with
  ``fused_glu`` (Megatron-Core's fused bias-SwiGLU, its default: ``BiasSwiGLUFunction`` saves
  only its input, the 2f-wide fc1 output, and recomputes SiLU in backward; the product is
  fc2's saved input; megatron/core/fusions/fused_bias_swiglu.py at d98e8a6;
  :attr:`~meshplan.spec.memory.MemoryOptions.fused_glu`): 6sbf/t.
Sum for GPT: [r] 10 sbh, split 24 sbh / t, scores 5 a s^2 b / t: Table 2.

Multi-head latent attention (DeepSeek-V2/V3; c_q = q_lora_rank, c_kv = kv_lora_rank, r the
RoPE head dim, d = qk_nope + r the q/k head dim, d_v the value head dim), derived from each
module's saved inputs: the attention norm's input and output as above [r]; the query latent
(``wq_a`` output, kept as the input of ``q_a_layernorm``) 2sb c_q and its normalised copy
(``wq_b`` input) 2sb c_q; the ``wkv_a`` output, whose first c_kv columns are the input of
``kv_a_layernorm`` (a view, so the whole ``c_kv + r`` wide tensor stays) 2sb(c_kv + r), and the
normalised latent (``wkv_b`` input) 2sb c_kv; the latents are computed by replicated down
projections on all the rank's tokens, so they are divided neither by t nor by sequence
parallelism; then as above Q 2sb(ad)/t and K 2sb(ad)/t (the no-RoPE part from ``wkv_b``
and the shared RoPE key concatenated per head), V 2sb(a d_v)/t and the context 2sb(a d_v)/t.
Without query compression (V2-Lite) the query latent terms are absent. Sum (no dropout,
flash, no recompute): ``[r] 2 s b h x 2 + 2 s b (2 c_q + 2 c_kv + r) + 2 s b a (2 d + 2 d_v) / t``
plus the flash statistics ``4 a s b / t``. Under ``framework = "torch"`` v is a view of the
``wkv_b`` output, ``2 s b a (d_nope + d_v) / t`` kept in its place (under all-gather CP of the
gathered K/V buffer), and ``unfused_norm`` adds the latent norms' ``x * rstd``:
:mod:`meshplan.memory.mla_terms`, where each is measured.

Further conventions:
- KV heads: per-rank K and V hold ``g/t`` heads, or one head when t > g (KV heads
  replicated, as :func:`meshplan.mesh.tpsplit.local_heads`).
- Selective recompute (Korthikanti 5) removes the [sc] terms. Flash attention also removes
  them: it keeps Q, K, V, the output and the fp32 softmax statistics (log-sum-exp, 4 bytes
  per query row per head: ``4 a s b / t``, small) and regenerates dropout from the RNG
  state; the statistics are counted. Full recompute keeps the layer input only.
- Context parallel: every per-token tensor holds ``s / cp`` tokens, but for all-gather CP's K
  and V, kept for the whole sequence (``cp_kv``; :mod:`meshplan.memory.cp_buffers`). The score terms hold
  ``(s / cp)`` query rows against all ``s`` keys (a non-fused ring keeps every step's
  scores); Megatron-Core and torchtitan context parallel need a fused/flash kernel, where
  the terms vanish.
- Local sizes round up: ``ceil(s / cp)`` tokens, ``ceil(tokens / t)`` with sequence
  parallel, ``ceil(f / t)`` MLP columns; heads must divide exactly.
- Embedding, final norm, output layer and loss: :func:`embedding_terms`, :func:`head_terms`
  (Korthikanti 4.3 and Megatron's vocab-parallel cross entropy).
- Activation dtype: ``LayerDims.act_bytes`` bytes per element replaces Table 2's 2 (16-bit)
  in every term but the 1-byte dropout masks and the fp32 softmax statistics; 4 for an
  fp32 model.

Implementation variants (keyword options of :func:`layer_terms`, all off for Megatron-Core
and Table 2; ``[memory]`` fields of :class:`~meshplan.spec.memory.MemoryOptions`), seen in
torch's own accounting of a DTensor/FSDP2 Llama (:mod:`meshplan.runtime.validation.memcheck`):

- ``sp_gathered_input``: with sequence parallel, the QKV and MLP-in GEMMs (and the output
  layer) keep their all-gathered input ``a s b h`` for backward instead of the
  sequence-sharded norm output (DTensor ``SequenceParallel`` + ``ColwiseParallel``: the
  all-gather output is the saved GEMM input; Megatron re-gathers in backward).
- ``unfused_norm``: the norm runs as elementwise ops, so each norm also keeps its normalised
  input ``x * rstd`` for the weight gradient, ``a s b h`` ([r]): torch's ``rms_norm`` on CPU
  decomposes into ``x * rsqrt(mean(x^2) + eps)`` then ``* weight`` (CUDA runs
  ``_fused_rms_norm``, which keeps the input and the fp32 statistics only). Its backward
  working set is in :mod:`meshplan.memory.workingset`.
- ``kv_expanded``: K and V reach the attention kernel repeated to the query heads (``repeat_kv``
  / ``repeat_interleave`` before SDPA, torchtitan's Llama), so the kept K and V hold ``a/t``
  heads instead of ``g/t``.
- ``float8_tp`` (not a ``[memory]`` field: torchao's float8 TP styles, set from the training
  contract by :func:`meshplan.memory.workingset.layer_act_sizes`): the QKV, MLP-in and w_out
  GEMMs keep only the float8 copies of their inputs (1 B, gathered:
  :func:`meshplan.memory.workingset.float8_copies`), so their compute-dtype input terms are left
  out. ``PrepareFloat8ModuleInput`` casts the norm's output before the Shard(1) -> Replicate
  all-gather and ``Float8RowwiseParallel`` casts w_out's input (pytorch/ao 36027d8
  ``torchao/float8/float8_tensor_parallel.py``:114-132, 170-239); ``matmul_with_hp_or_float8_args``
  saves that already-cast input (``float8_linear.py``:45, 51-52); the amax of the cast runs under
  ``no_grad`` (``float8_utils.py``:56-69): the bf16 norm output and the bf16 product ``silu(gate) *
  up`` are kept by no one. The SDPA output stays (the kernel saves it) beside wo's fp8 copy.
- Not counted: the fp32 norm statistics ``4 s b`` per norm (1/h of its input) and the RoPE
  tables (``s d`` elements, shared by every layer).

>>> gpt = LayerDims.gpt(s=2048, b=1, h=4096, a=32)
>>> layer_bytes(gpt), layer_bytes(gpt, tp=8), layer_bytes(gpt, tp=8, sp=True)
(956301312, 192937984, 119537664)
>>> layer_bytes(gpt, tp=8, sp=True, recompute="selective"), layer_bytes(gpt, recompute="full")
(35651584, 16777216)
"""

from __future__ import annotations

from fractions import Fraction
from math import ceil

from meshplan.compute.shapes import local_split
from meshplan.errors import ConfigError
from meshplan.memory.cp_buffers import saves_gathered_kv
from meshplan.memory.layer_dims import LayerDims, LocalSizes, Term
from meshplan.memory.mla_terms import MLA_KV_TERMS, MLA_LATENT_TERMS, mla_kv_terms, mla_latent_terms
from meshplan.memory.op_sac import op_sac_terms
from meshplan.mesh.resolve import Mesh
from meshplan.spec.axes.base import Dim
from meshplan.spec.axes.tp_kv import qkv_gathered
from meshplan.spec.training import TrainingSpec
from meshplan.units import dtype_bytes

RECOMPUTE = ("none", "selective", "full", "op")  # torchtitan's "layer" is "full" or "none" per layer


def _local(dims: LayerDims, tp: int, sp: bool, cp: int) -> LocalSizes:
    if dims.a % tp:
        raise ConfigError("tp", f"q heads {dims.a} are not divisible by tp {tp}")
    if dims.g % tp and tp % dims.g:
        raise ConfigError("tp", f"kv heads {dims.g} vs tp {tp}: need g % tp == 0 or tp % g == 0")
    tok = ceil(dims.s / cp)
    return LocalSizes(tok=tok, rtok=ceil(tok / tp) if sp else tok, aq=dims.a // tp,
                      akv=dims.kv_local(tp), f=ceil(dims.f / tp),
                      seq="(s/cp)" if cp > 1 else "s", r="/t" if sp and tp > 1 else "")


def _check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE:
        raise ConfigError("training.recompute", f"{recompute!r} is not one of {RECOMPUTE}")


def _norm_and_gemm_input(dims: LayerDims, lc: LocalSizes, norm: str, gemm: str, v: dict) -> list[Term]:
    """A norm's kept input (+ its normalised input with ``unfused_norm``) and the input of
    the GEMMs after it (the all-gathered one with ``sp_gathered_input``)."""
    e, b, h, S, r = dims.act_bytes, dims.b, dims.h, lc.seq, lc.r
    out = [Term(f"{norm} input", e * lc.rtok * b * h, f"{e}*{S}*b*h{r}")]
    if v.get("unfused_norm"):
        out.append(Term(f"{norm} normalised input (x*rstd)", e * lc.rtok * b * h, f"{e}*{S}*b*h{r}"))
    if v.get("float8_tp"):  # the GEMMs keep the fp8 copy cast before the gather (float8_copies)
        return out
    if v.get("sp_gathered_input") and r:
        return out + [Term(f"{gemm} input (all-gathered)", e * lc.tok * b * h, f"{e}*{S}*b*h")]
    return out + [Term(f"{gemm} input", e * lc.rtok * b * h, f"{e}*{S}*b*h{r}")]


def _attention_terms(dims: LayerDims, lc: LocalSizes, core: bool, flash: bool, v: dict,
                     gathered: bool = False, cp_kv: bool = False, mla_views: bool = False) -> list[Term]:
    """The attention block's kept tensors; ``gathered``: Megatron-LM's QKV sub-sharding at tp >
    kv_heads (:mod:`meshplan.spec.axes.tp_kv`): v is a view of the all-gathered fused QKV output
    (attention.py:1864-1905 at d98e8a6: slice, view and split, no copy), which the core attention
    keeps for its backward, so the whole gathered tensor, ``s b (a + 2 g) d``, is held in v's place
    (q and k are RoPE's new tensors). ``cp_kv``: all-gather CP, whose SDPA keeps the whole
    sequence's K and V, ``s`` tokens (:func:`meshplan.memory.cp_buffers.saves_gathered_kv`), in
    place of the local ones (and of the fused QKV output, which then is not what it reads).
    ``mla_views``: MLA under torch, whose v is a view of a wider tensor
    (:func:`~meshplan.memory.mla_terms.mla_kv_terms`). ``core``: the attention core is
    recomputed (selective recompute with core_attn), so its scores or flash statistics are not kept."""
    e, b, d, S = dims.act_bytes, dims.b, dims.d, lc.seq
    rows = lc.tok * b
    kv_rows, KS = (dims.s * b, "s") if cp_kv else (rows, S)
    kv, g = (lc.aq, "a") if v.get("kv_expanded") else (lc.akv, "g")
    dv, dvs = dims.d_v, ("d_v" if dims.d_v != d else "d")
    value = (Term("fused QKV output (all-gathered over tp; v is a view of it)", e * rows * (dims.a + 2 * dims.g) * d,
                  f"{e}*{S}*b*(a+2g)*d") if gathered and not cp_kv
             else Term("v", e * kv_rows * kv * dv, f"{e}*{KS}*b*{g}*{dvs}/t"))
    k = Term("k", e * kv_rows * kv * d, f"{e}*{KS}*b*{g}*d/t")
    kv_terms = mla_kv_terms(dims, lc, k, kv, flash, cp_kv) if mla_views else [k, value]
    out = _norm_and_gemm_input(dims, lc, "attn norm", "qkv", v) + mla_latent_terms(dims, lc, bool(v.get("unfused_norm"))) + [
        Term("q", e * rows * lc.aq * d, f"{e}*{S}*b*a*d/t")] + kv_terms
    if not core and not flash:
        n = lc.aq * rows * dims.s
        out.append(Term("softmax output", e * n, f"{e}*a*{S}*s*b/t"))
        if dims.dropout:
            out.append(Term("softmax dropout mask", n, f"a*{S}*s*b/t"))
            out.append(Term("softmax dropout output", e * n, f"{e}*a*{S}*s*b/t"))
    elif not core:
        out.append(Term("flash softmax statistics (fp32)", 4 * lc.aq * rows, f"4*a*{S}*b/t"))
    out.append(Term("context (out-proj input)", e * rows * lc.aq * dv, f"{e}*{S}*b*a*{dvs}/t"))
    if dims.dropout:
        out.append(Term("attn residual dropout mask", lc.rtok * b * dims.h, f"{S}*b*h{lc.r}"))
    return out


def _mlp_terms(dims: LayerDims, lc: LocalSizes, fused_glu: bool, v: dict) -> list[Term]:
    e, b, h, S, r = dims.act_bytes, dims.b, dims.h, lc.seq, lc.r
    rows = lc.tok * b
    out = _norm_and_gemm_input(dims, lc, "mlp norm", "w_in", v)
    if not dims.gated:
        out += [Term("activation input", e * rows * lc.f, f"{e}*{S}*b*f/t"),
                Term("w_out input", e * rows * lc.f, f"{e}*{S}*b*f/t")]
    elif fused_glu:
        out += [Term("fc1 output (gate, up)", 2 * e * rows * lc.f, f"{2 * e}*{S}*b*f/t"),
                Term("w_out input", e * rows * lc.f, f"{e}*{S}*b*f/t")]
    else:
        out += [Term(n, e * rows * lc.f, f"{e}*{S}*b*f/t")
                for n in ("gate", "silu output", "up", "w_out input")]
    if v.get("float8_tp"):  # w_down keeps its Float8RowwiseParallel fp8 copy only (float8_copies)
        out = [t for t in out if t.name != "w_out input"]
    if dims.dropout:
        out.append(Term("mlp residual dropout mask", lc.rtok * b * h, f"{S}*b*h{r}"))
    return out


#: Keyword options of :func:`layer_terms` that select an implementation variant (module docstring).
VARIANTS = ("sp_gathered_input", "unfused_norm", "kv_expanded")


def layer_terms(dims: LayerDims, *, tp: int = 1, sp: bool = False, cp: int = 1,
                recompute: str = "none", flash: bool = False, fused_glu: bool = False, framework: str = "torch",
                cp_kv: bool = False, parts: frozenset = frozenset({"core_attn"}), op_sac_policy: str = "238fa99",
                **variants: bool) -> list[Term]:
    """Stored tensors of one layer for one micro-batch on one rank (bytes), per the module
    derivation. ``sp``: sequence parallel; ``recompute``: none, selective or full;
    ``framework``: megatron at tp > kv_heads keeps the all-gathered fused QKV output
    (:func:`_attention_terms`); ``cp_kv``: K and V kept for the whole sequence (all-gather CP,
    :func:`_attention_terms`); ``parts``: under ``selective``, what Megatron-LM's recompute modules
    recompute in this layer (:func:`meshplan.spec.recompute_modules.layer_parts`; default: the
    attention core), whose terms are not kept (:data:`DISCARDED`); ``op_sac_policy``:
    under ``op``, the torchtitan commit whose policy saves (:func:`~meshplan.memory.op_sac.op_sac_terms`); ``variants``: :data:`VARIANTS`
    (module docstring).

    4 q / 2 KV heads of 16 (h 64), s 64, b 1, tp 4, bf16: v (64 x 1 x 16 x 2 = 2,048 B) becomes the
    gathered 64 x (4 + 4) x 16 x 2 = 16,384 B under Megatron:

    >>> dims = LayerDims(s=64, b=1, h=64, a=4, g=2, d=16, f=256, gated=False, dropout=False)
    >>> [t.size_bytes for f in ("torch", "megatron") for t in layer_terms(dims, tp=4, framework=f)
    ...  if t.name.startswith(("v", "fused"))]
    [2048, 16384]
    """
    _check_recompute(recompute)
    if set(variants) - set(VARIANTS) - {"float8_tp"}:
        raise TypeError(f"unknown layer_terms options {sorted(set(variants) - set(VARIANTS))}")
    lc = _local(dims, tp, sp, cp)
    if recompute == "full":
        e = dims.act_bytes
        return [Term("layer input (checkpoint)", e * lc.rtok * dims.b * dims.h, f"{e}*{lc.seq}*b*h{lc.r}")]
    if recompute == "op":
        return op_sac_terms(dims, lc, flash, op_sac_policy)
    gathered = qkv_gathered(framework, tp, dims.g) and not dims.kv_lora
    views = bool(dims.kv_lora) and framework == "torch"
    parts = parts if recompute == "selective" else frozenset()
    terms = (_attention_terms(dims, lc, "core_attn" in parts, flash, variants, gathered, cp_kv and cp > 1, views)
             + _mlp_terms(dims, lc, fused_glu, variants))
    dropped = {n for p in parts for n in DISCARDED.get(p, ())}
    return [t for t in terms if t.name not in dropped]


_MLP_INSIDE = ("activation input", "fc1 output (gate, up)", "gate", "silu output", "up", "w_out input")
#: Terms a selective recompute part (:func:`meshplan.spec.recompute_modules.layer_parts`) does not
#: keep, beyond the attention core's scores (``core_attn``): the outputs an output-discarding
#: checkpoint frees (``attn_norm``, ``mlp_norm``: the norm's output, its GEMMs' saved input;
#: ``mla_up_proj``: Q, K, V and the normalised latents inside the fused up-projections), and what a
#: normal checkpoint's module saves inside it (``mlp``: all but its input, the norm's input;
#: ``moe`` and ``shared_experts``: the shared experts' own tensors, their input kept; the routed
#: experts' in :func:`meshplan.memory.workingset.layer_act_sizes`). Megatron-LM d98e8a6, cited in
#: :mod:`meshplan.spec.recompute_modules`.
DISCARDED = {"attn_norm": ("qkv input", "qkv input (all-gathered)"),
             "mlp_norm": ("w_in input", "w_in input (all-gathered)"),
             "mla_up_proj": ("q", "k", "v", *MLA_KV_TERMS, *(MLA_LATENT_TERMS[i] for i in (1, 3, 4, 5))),
             "mlp": ("w_in input", "w_in input (all-gathered)", *_MLP_INSIDE),
             "moe": _MLP_INSIDE, "shared_experts": _MLP_INSIDE}


def layer_bytes(dims: LayerDims, **options) -> int:
    """Sum of :func:`layer_terms` (bytes per layer per micro-batch on one rank)."""
    return sum(t.size_bytes for t in layer_terms(dims, **options))


def table2_bytes(s: int, b: int, h: int, a: int, t: int = 1, *, sp: bool = False,
                 recompute: str = "none") -> float:
    """Korthikanti et al. 2022 Table 2, closed form, bytes per layer (GPT layer).

    >>> table2_bytes(2048, 1, 4096, 32, 8), table2_bytes(2048, 1, 4096, 32, 8, sp=True)
    (192937984.0, 119537664.0)
    """
    _check_recompute(recompute)
    sbh = Fraction(s * b * h)
    if recompute == "full":
        return float(2 * sbh / (t if sp else 1))
    scores = 0 if recompute == "selective" else Fraction(5 * a * s, h)
    if sp:
        return float(sbh / t * (34 + scores))
    return float(sbh * (10 + Fraction(24, t) + scores / t))


def embedding_terms(dims: LayerDims, *, tp: int = 1, sp: bool = False, cp: int = 1) -> list[Term]:
    """Stored by the input embedding (first stage), per micro-batch, bytes.

    Token ids, int64, on every tp rank (the vocab-parallel lookup needs them):
    ``8 s b`` (Megatron ``report_theoretical_memory`` counts the same ``8 s b``);
    embedding-dropout mask ``s b h`` (/t with sequence parallel) when ``dims.dropout``
    (Korthikanti 4.3). The embedding output is the first layer's input, counted there.
    """
    lc = _local(dims, tp, sp, cp)
    out = [Term("token ids (int64)", 8 * lc.tok * dims.b, f"8*{lc.seq}*b")]
    if dims.dropout:
        out.append(Term("embedding dropout mask", lc.rtok * dims.b * dims.h, f"{lc.seq}*b*h{lc.r}"))
    return out


def head_terms(dims: LayerDims, padded_vocab: int, *, tp: int = 1, sp: bool = False, cp: int = 1,
               logits_dtype: str = "fp32", **variants: bool) -> list[Term]:
    """Stored by the final norm, output layer and loss (last stage), per micro-batch, bytes.

    Korthikanti 4.3: final-norm input ``2 s b h`` and output-layer input ``2 s b h`` (/t
    with sequence parallel), logits ``4 s b V / t`` (Megatron's vocab-parallel cross
    entropy keeps the fp32 softmax of its vocabulary shard for backward; ``logits_dtype``
    "bf16" for a loss that keeps compute-dtype logits). The compute-dtype logits produced by
    the output layer are transient once the loss holds its fp32 copy (timeline, not here).
    Loss: target mask (bool, 1 B) and masked target index (int64, 8 B) saved for backward,
    plus the fp32 per-token loss (4 B): ``13 s b`` on every tp rank. V is the padded vocab.
    ``variants``: ``sp_gathered_input`` and ``unfused_norm`` as in :func:`layer_terms`.
    """
    lc = _local(dims, tp, sp, cp)
    rows, S = lc.tok * dims.b, lc.seq
    return _norm_and_gemm_input(dims, lc, "final norm", "output layer", variants) + [
            Term(f"logits ({logits_dtype})", dtype_bytes(logits_dtype) * rows * ceil(padded_vocab / tp),
                 f"{dtype_bytes(logits_dtype)}*{S}*b*V/t"),
            Term("loss (mask, target, per-token loss)", 13 * rows, f"13*{S}*b")]


def layer_options(mesh: Mesh, training: TrainingSpec, checkpointed: bool = False) -> dict:
    """Keyword options of :func:`layer_terms` for a mesh and training contract; under
    torchtitan's per-layer AC (``recompute = "layer"``) and Megatron-LM's block recompute
    (``recompute_num_layers``) ``checkpointed`` says whether this layer is (``full``) or not
    (``none``) (:meth:`~meshplan.spec.training.TrainingSpec.layer_policy`). ``cp``: the ways the registered axes split the
    sequence, ``tp`` the heads (and the MLP with them) (:func:`meshplan.compute.shapes.local_split`)."""
    rc = training.layer_policy(checkpointed)
    split = local_split(mesh)
    return dict(tp=split[Dim.HEADS], sp=mesh.sequence_parallel, cp=split[Dim.SEQUENCE],
                recompute=rc, flash=training.flash_attention, framework=training.framework,
                cp_kv=saves_gathered_kv(training, split[Dim.SEQUENCE]), op_sac_policy=training.op_sac)
