"""Working sets and saved activations of a layer, the embedding and the head, bytes on one rank
of one micro-batch (the sizes :func:`meshplan.memory.sizes.stage_sizes` gives the memory timeline).

Activations per layer come from :func:`~meshplan.memory.activations.layer_terms`
(Korthikanti et al. 2022 Table 2, generalised); embedding and head from
:func:`embedding_terms` and :func:`head_terms`. Working sets (stated here, not in Table 2;
a is the activation dtype size; per rank H = ``a s b h`` with the full local sequence,
Hr = H / t with SP, F = ``a s b f / t`` per gate, Q = ``a s b (a_q/t) d``, KV likewise):

- forward, cp > 1: cp's K/V buffers while the attention runs (:mod:`meshplan.memory.cp_buffers`),
  the working set where larger than the others below (they are not alive at once);
- forward, with sequence parallel and tp > 1: the all-gathered layer input H while the
  QKV and MLP-in GEMMs run (none when ``sp_gathered_input``: then it is kept; ``s b h`` bytes,
  1 a value, where the layers' tp all-gathers move fp8, as the all-gathered dY below:
  :func:`meshplan.compute.dtensor_sp.fp8_tp_gathers`, the one rule the collective table reads,
  under torchao's float8 TP or Transformer Engine's fp8 linears under Megatron-LM, which
  quantize the norm's output on the sequence shard and gather the 1-byte data, NVIDIA/
  TransformerEngine d0067d0 ``module/layernorm_linear.py:292-313``, and the output gradient
  before proj's and fc2's dgrad, ``module/base.py:1718-1749``); with full
  recompute the checkpointed forward keeps nothing, and its MLP holds H (+ Hr
  ``unfused_norm``) + 3F (gated; 2F GeLU) at once; an MoE layer's routed experts (full
  recompute) H (+ Hr) + ``a h`` per dispatched copy (the expert-sorted copies the rank sends) and
  2 ``a h`` per received row (the all-to-all's output and its expert-major copy) + 3 ``a f``
  per received row (gated: the two grouped GEMMs' outputs and silu's; GeLU 2) at width
  ``expert_ffn / etp`` (torchtitan's ``GroupedExperts``: ``silu(x w1) * (x w3)``, and
  :mod:`meshplan.runtime.execution.moe`), or the shared experts' MLP where wider. Measured:
  2,146,944 B at world 4 of ``tests/data/validate_mixtral_ep2_fsdp.toml`` under full recompute
  (rank 0: 147 received rows, 15% over the balanced 128 the plan takes: 1,900,544 B there);
  before, the plan counted none (the temporaries' maximum was the backward's, 1,048,576 B);
- backward of a dense layer, in autograd's order (:func:`backward_steps`; the incoming dY
  ``Hr`` is held by the pass): mlp w_out (SP: the all-gathered dY H, + its dX F; writes
  w_down's gradient, frees its input), activation (3F gated: d(w_out input), d(silu), d(up);
  2F GeLU), w_in (max(2F + H, 3H): the two GEMMs' dX and their sum; w_gate, w_up), mlp norm
  (:func:`norm_work`), attention w_o (SP H + Q), core (2Q + 2KV: d(context), dq, dk, dv;
  q, k, v, statistics freed; MLA: d(context) + dq + dk + dv with the value head dim; cp > 1:
  with cp's buffers, :mod:`meshplan.memory.cp_buffers`, all-gather CP's dK and dV of the whole
  sequence; :func:`attention_core_work`), w_qkv
  (max(Q + 2KV + H, 3H); MLA adds the latents' gradients ``a s b (2 c_q + 2 c_kv + r)``),
  attn norm. Each step writes its weights' unsharded gradients as it runs and frees the saved tensors it consumed, so the
  layer's peak is at its first step, not with all its gradients and all its activations
  at once. Measured against torch's FSDPMemTracker (:mod:`meshplan.runtime.validation.memcheck`);
  flash-attention and RoPE backward buffers are not counted; MoE layers keep one step: the
  widest of a dense MLP's activation and w_in steps (:func:`mlp_step_work`) over the routed
  experts' received rows or the shared experts' tokens, + SP's re-gathered input (measured at
  world 4 of ``tests/data/validate_mixtral_ep2_fsdp.toml``: the activation step's 3 gradients of
  161 received rows x 896 fp32 beside dY, 1,797,120 B; the plan 1,441,792 B at the balanced 128
  rows; before, dX + 2 such gradients, 1,048,576 B), + under torch the routing scores' gradient
  (:func:`meshplan.memory.routed_sizes.scores_grad`: the 512 B left there, 256 B at world 2);
- recompute: the layer's activations without recompute minus those kept, at the start of
  its backward (full recompute: the whole layer's working set; selective without flash:
  the attention scores; otherwise 0), freed by the steps with the rest;
- float8 Linears under torch (torchao): the float8 copies of their inputs the backward's
  weight-gradient GEMMs read, 1 B an element (:func:`float8_copies`), saved unless full or
  op-level recompute replays their casts, each freed by the step that reads it;
- the loss (``cross_entropy``), the final norm (:func:`norm_work`) and, with
  ``embedding_grad_full_vocab``, the whole-vocabulary embedding gradient: :func:`head_sizes`.

MoE layers (an estimate): attention and shared experts as a dense layer of width ``shared_experts x
shared_expert_ffn``; the routed experts' kept activations and working sets:
:mod:`meshplan.memory.routed_sizes`.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Optional
from math import ceil

from meshplan.compute import float8
from meshplan.compute.dtensor_sp import float8_tp, fp8_tp_gathers
from meshplan.compute.ops import Workload
from meshplan.compute.kernel_choices import float8_gemms, framework_kernels
from meshplan.compute.recompute import op_replays_ep
from meshplan.compute.shapes import layer_gemms
from meshplan.compute.shapes import local_split
from meshplan.mesh.resolve import Mesh
from meshplan.spec.axes.base import Dim
from meshplan.spec.axes.tp import sdpa_kv_heads
from meshplan.spec.memory import MemoryOptions
from meshplan.spec.model import ModelSpec
from meshplan.spec.recompute_modules import layer_parts
from meshplan.spec.training import TrainingSpec
from meshplan.mesh.tpsplit import local_numel, padded_vocab
from meshplan.units import dtype_bytes
from meshplan.memory.activations import (embedding_terms, head_terms, layer_bytes, layer_options,
                                         layer_terms)
from meshplan.memory.cp_buffers import CpBuffers, cp_buffers
from meshplan.memory.layer_dims import LayerDims, mla_dims
from meshplan.memory.mla_terms import MLA_KV_TERMS, MLA_LATENT_TERMS
from meshplan.memory.pass_sizes import ActSizes, BackStep
from meshplan.memory.buffers import ipg_elements
from meshplan.memory.units import fsdp_active
from meshplan.memory.routed_sizes import mlp_step_work, routed_kept, routed_sizes


def _total(terms) -> int:
    return sum(t.size_bytes for t in terms)


def _tokens(training: TrainingSpec, mesh: Mesh) -> tuple[int, int]:
    """(tokens per rank, tokens of a sequence-sharded tensor) for one micro-batch: the
    sequence split as the registered axes divide it, then the residual stream's split under
    SP (:func:`meshplan.compute.shapes.local_split`)."""
    split = local_split(mesh)
    tok = ceil(training.seq_len / split[Dim.SEQUENCE]) * training.micro_batch
    return tok, ceil(tok / split[Dim.SP_SEQUENCE])


def dense_dims(model: ModelSpec, training: TrainingSpec, dropout: bool) -> LayerDims:
    """Dims of a dense layer of ``model`` (``layer_terms`` input)."""
    return LayerDims(s=training.seq_len, b=training.micro_batch, h=model.hidden, a=model.q_heads,
                     g=model.n_kv_heads, d=model.d_head, f=model.ffn, gated=model.gated_mlp, dropout=dropout,
                     act_bytes=dtype_bytes(training.compute_dtype), **mla_dims(model))


def layer_act_sizes(model: ModelSpec, training: TrainingSpec, mesh: Mesh, opts: MemoryOptions,
                    moe: bool = False, checkpointed: bool = False) -> ActSizes:
    """:class:`ActSizes` of a dense (or, ``moe``, an MoE) layer; see the module docstring.
    Under torchtitan's per-layer AC (``recompute = "layer"``) and Megatron-LM's block recompute
    (``recompute_num_layers``: :attr:`~meshplan.spec.training.TrainingSpec.per_layer_recompute`)
    ``checkpointed`` picks a layer checkpointed in full or one that keeps everything."""
    if training.per_layer_recompute:
        training = training.model_copy(update={"recompute": training.layer_policy(checkpointed),
                                               "recompute_num_layers": None})
    fused = opts.fused_glu_for(training) and model.gated_mlp
    parts = layer_parts(training.recompute_modules, moe, model.is_mla)
    lo = {**layer_options(mesh, training), **opts.variants, "fused_glu": fused, "parts": parts}
    lo["float8_tp"] = lo["tp"] > 1 and not moe and float8_tp(model, training, mesh.sequence_parallel)
    tp, a = lo["tp"], dtype_bytes(training.compute_dtype)
    tok, rtok = _tokens(training, mesh)
    h = model.hidden
    dims = dense_dims(model, training, opts.dropout)
    routed_full, widest, routed_fwd, exchanged = routed_sizes(model, training, mesh, tok, tp, fused) if moe else (0,) * 4
    # op-level SAC keeps the all-to-alls' outputs where its policy saves them (none kept: 238fa99's Qwen3)
    routed = {"full": 0, "op": 0 if op_replays_ep(model, training) else exchanged}.get(training.recompute, routed_full)
    if moe and training.recompute == "selective":
        routed = routed_kept(model, training, mesh, tok, tp, fused, lo["parts"]) if lo["parts"] & {"moe", "moe_act"} \
            else routed
    if moe:
        dims = replace(dims, f=(model.shared_expert_ffn or model.moe_ffn) * model.shared_experts)
    f8 = {} if moe else float8_copies(model, training, mesh)
    kept8 = 0 if training.recompute in ("full", "op") else sum(f8.values())  # replayed with the casts
    saved = layer_bytes(dims, **lo) + routed + kept8
    full = layer_bytes(dims, **{**lo, "recompute": "none"}) + routed_full + sum(f8.values())
    sp = mesh.sequence_parallel and tp > 1
    # the all-gathered input, 1 byte a value where the tp all-gathers move fp8 (compute.dtensor_sp.fp8_tp_gathers)
    ga = 1 if fp8_tp_gathers(model, training, sp) else a
    gathered = ga * tok * h if sp and not opts.sp_gathered_input else 0  # else a saved activation
    # the checkpointed forward keeps nothing: its MLP's working set (module docstring)
    residual = a * tok * h + (a * rtok * h if opts.unfused_norm else 0)
    mlp_fwd = residual + (3 if model.gated_mlp else 2) * a * tok * ceil(dims.f / tp) if dims.f else 0
    cpb = cp_buffers(model, training, cp=lo["cp"], tp=tp, kv_expanded=opts.kv_expanded,
                     checkpointed=training.recompute == "full")
    if moe:
        if dims.f:  # the shared experts' MLP
            widest = max(widest, *mlp_step_work(a * tok * ceil(dims.f / tp), a * tok * h, model.gated_mlp))
        fwd = max(gathered, residual + routed_fwd, mlp_fwd) if training.recompute in ("full", "op") else gathered
        core = attention_core_work(dims, lo, tok, opts.kv_expanded) + cpb.backward if cpb.backward else 0
        return ActSizes(saved=saved, rework=full - saved, fwd_temp=max(fwd, cpb.forward),
                        bwd_temp=max(widest + gathered, core), fwd_what=_fwd_what(fwd, gathered, cpb))
    steps = backward_steps(model, training, mesh, opts, dims, lo, f8, cpb.backward)
    fwd = max(gathered, mlp_fwd) if training.recompute in ("full", "op") else gathered
    return ActSizes(saved=saved, rework=full - saved, fwd_temp=max(fwd, cpb.forward),
                    bwd_temp=max(st.work for st in steps), steps=steps, fwd_what=_fwd_what(fwd, gathered, cpb))


def _fwd_what(fwd: int, gathered: int, cpb: CpBuffers) -> str:
    """The forward working set's label: cp's buffers where they are the larger, SP's all-gathered
    input where that is all of it, else the forward's working set."""
    if cpb.forward > fwd:
        return cpb.what
    return "SP all-gathered input" if fwd == gathered > 0 else "forward working set"


#: Backward steps of a dense layer, autograd's order, and the weights whose gradients each
#: writes (tensor-name prefixes of :meth:`ModelSpec.layer_tensors`).
STEP_WEIGHTS = {"mlp w_out": ("w_down",), "mlp activation": (), "mlp w_in": ("w_gate", "w_up"),
                "mlp norm": ("mlp_norm",), "attention w_o": ("wo",), "attention core": ("q_norm", "k_norm"),
                "attention w_qkv": ("wq", "wk", "wv", "wkv", "q_a_norm", "kv_a_norm"), "attn norm": ("attn_norm",)}
#: Saved terms (:func:`~meshplan.memory.activations.layer_terms` names) each step frees;
#: terms not listed (dropout masks, scores, statistics) go with the step whose input they are.
STEP_TERMS = {"mlp w_out": ("w_out input", "mlp residual dropout mask"),
              "mlp activation": ("silu output", "up", "activation input", "fc1 output (gate, up)"),
              "mlp w_in": ("gate", "w_in input", "w_in input (all-gathered)"),
              "mlp norm": ("mlp norm input", "mlp norm normalised input (x*rstd)"),
              "attention w_o": ("context (out-proj input)", "attn residual dropout mask"),
              "attention core": ("q", "k", "v", "softmax output", "softmax dropout mask",
                                 "softmax dropout output", "flash softmax statistics (fp32)") + MLA_KV_TERMS,
              "attention w_qkv": ("qkv input", "qkv input (all-gathered)") + MLA_LATENT_TERMS,
              "attn norm": ("attn norm input", "attn norm normalised input (x*rstd)", "layer input (checkpoint)")}


def norm_work(H: int, Hr: int, sp: bool, opts: MemoryOptions) -> int:
    """Working set of a norm's backward beyond the incoming gradient: its input gradient
    ``Hr`` (``4 Hr`` with ``unfused_norm``: torch's decomposed rms_norm backward holds the
    gradients of ``x * rstd``, ``mean(x^2)``, ``x^2`` and the partial ``dX`` at once),
    with SP after the reduce-scatter of the full-sequence ``dX`` (``H + Hr`` then)."""
    own = (4 if opts.unfused_norm else 1) * Hr
    return max(own + Hr, H + Hr) if sp else own


#: The backward step whose weight-gradient GEMM reads each float8 input copy (:func:`float8_copies`).
FLOAT8_STEP = {"attn input": "attention w_qkv", "wo input": "attention w_o", "mlp input": "mlp w_in",
               "w_down input": "mlp w_out"}


def float8_copies(model: ModelSpec, training: TrainingSpec, mesh: Mesh) -> dict[str, int]:
    """A dense layer's float8 input copies kept for backward, bytes by input
    (:func:`meshplan.compute.float8.saved_copies`, one micro-batch at the rank's tokens, gathered
    under SP): saved unless full or op-level recompute replays their casts. None for MoE and MLA
    models (their float8 plans are not modelled)."""
    if model.is_moe or model.is_mla:
        return {}
    tok, tp = _tokens(training, mesh)[0], local_split(mesh)[Dim.HEADS]
    w = Workload(seq_len=training.seq_len, micro_batch=training.micro_batch, tp=tp, sp=mesh.sequence_parallel,
                 dtype=training.compute_dtype, **framework_kernels(training), **float8_gemms(model, training))
    return float8.saved_copies(model, w, layer_gemms(model, tp, tok, framework=training.framework))


def attention_core_work(dims, lo: dict, tok: int, kv_expanded: bool) -> int:
    """Bytes of the attention core's backward gradients, ``C + Q + K + V`` (module docstring):
    d(context), dq, dk, dv at the rank's ``tok`` tokens, K and V at the KV heads (the q heads with
    ``kv_expanded``); under all-gather CP (``lo["cp_kv"]``) dK and dV of the whole sequence, ``s b``
    tokens (:mod:`meshplan.memory.cp_buffers`). ``dims``: :class:`LayerDims`; ``lo``:
    :func:`~meshplan.memory.activations.layer_options`.

    4 q and 2 KV heads of 16, bf16, 32 of 64 tokens (cp 2): 2 x 32 x 4 x 32 = 8,192 B of d(context)
    and dq, 2 x 32 x 2 x 32 = 4,096 B of local dK and dV, 8,192 B for the whole sequence's:

    >>> d = LayerDims(s=64, b=1, h=64, a=4, g=2, d=16, f=128)
    >>> attention_core_work(d, {"tp": 1, "cp_kv": False}, 32, False), attention_core_work(d, {"tp": 1, "cp_kv": True}, 32, False)
    (12288, 16384)
    """
    a, tp = dims.act_bytes, lo["tp"]
    aq = dims.a // tp
    kv = sdpa_kv_heads(aq, dims.kv_local(tp), kv_expanded)
    kv_tok = dims.s * dims.b if lo.get("cp_kv") else tok
    return a * tok * aq * (dims.d + dims.d_v) + a * kv_tok * kv * (dims.d + dims.d_v)


def backward_steps(model: ModelSpec, training: TrainingSpec, mesh: Mesh, opts: MemoryOptions,
                   dims, lo: dict, f8: Optional[dict[str, int]] = None, cp_extra: int = 0) -> tuple:
    """:class:`BackStep` of a dense layer (see the module docstring: working sets); ``f8``: the
    float8 input copies (:func:`float8_copies`), each freed by the step that reads it;
    ``cp_extra``: cp's buffers beside the attention core's gradients
    (:attr:`meshplan.memory.cp_buffers.CpBuffers.backward`)."""
    a, tp = dims.act_bytes, lo["tp"]
    tok, rtok = _tokens(training, mesh)
    sp = lo["sp"] and tp > 1
    H, Hr, F = a * tok * dims.h, a * rtok * dims.h, a * tok * ceil(dims.f / tp)
    aq = dims.a // tp
    kv = sdpa_kv_heads(aq, dims.kv_local(tp), opts.kv_expanded)
    Q, K = a * tok * aq * dims.d, a * tok * kv * dims.d
    V, C = a * tok * kv * dims.d_v, a * tok * aq * dims.d_v  # value and context (MLA: v_head_dim)
    core = attention_core_work(dims, lo, tok, opts.kv_expanded) + cp_extra
    lat = a * tok * (2 * dims.q_lora + 2 * dims.kv_lora + dims.rope)  # MLA: latent gradients (up, then norm)
    # the all-gathered output gradient of a row-parallel GEMM (SP; 1 byte a value: dtensor_sp.fp8_tp_gathers)
    g = (tok * dims.h if fp8_tp_gathers(model, training, sp) else H) if sp else 0
    act, w_in = mlp_step_work(F, H, dims.gated)
    work = {"mlp w_out": g + F, "mlp activation": act, "mlp w_in": w_in,
            "mlp norm": norm_work(H, Hr, sp, opts), "attention w_o": g + C, "attention core": core,
            "attention w_qkv": max(Q + K + V + lat + H, 3 * H), "attn norm": norm_work(H, Hr, sp, opts)}
    full = {t.name: t.size_bytes for t in layer_terms(dims, **{**lo, "recompute": "none"})}
    kept = {t.name: t.size_bytes for t in layer_terms(dims, **lo)}
    comp = dtype_bytes(training.compute_dtype) if fsdp_active(training, mesh)["dense"] else 0
    grads = {k: n * comp for k, n in step_numels(model, tp, mesh.ep, mesh.etp, ipg_elements(training, opts))}
    frees = {k: sum(full.get(n, 0) for n in names) for k, names in STEP_TERMS.items()}
    frees["attn norm"] += sum(full.values()) - sum(frees.values())  # anything unlisted: freed last
    for what, nb in (f8 or {}).items():
        frees[FLOAT8_STEP[what]] += nb
    if "layer input (checkpoint)" in kept:
        frees["attn norm"] += kept["layer input (checkpoint)"] - full.get("attn norm input", 0)
    return tuple(BackStep(k, work[k], grads[k], frees[k]) for k in STEP_WEIGHTS)


@lru_cache(maxsize=1024)
def step_numels(model: ModelSpec, tp: int, ep: int, etp: int, ipg: int = 0) -> tuple[tuple[str, int], ...]:
    """(step, local elements) of the weights whose gradients each backward step of a dense
    layer writes (:data:`STEP_WEIGHTS`; a weight no step names: ``attn norm``), in step order;
    every step 0 for a model without a dense layer. ``ipg`` > 0: only the tensors of more than
    ``ipg`` elements, the others moved into DeepSpeed ZeRO-3's ipg buffer
    (:func:`meshplan.memory.buffers.ipg_elements`). Memoised (a pure function of the model
    and the degrees; the search asks it for every micro-batch and recompute policy)."""
    grads = dict.fromkeys(STEP_WEIGHTS, 0)
    dense = next((i for i in range(model.layers) if not model.is_moe_layer(i)), None)
    for t in model.layer_tensors(dense) if dense is not None else ():
        step = next((k for k, ps in STEP_WEIGHTS.items() if any(t.name.startswith(p) for p in ps)), "attn norm")
        n = local_numel(t, model, tp, ep, etp)
        grads[step] += n if not ipg or n > ipg else 0
    return tuple(grads.items())


def embedding_backward_work(model: ModelSpec, training: TrainingSpec, mesh: Mesh, opts: MemoryOptions,
                            padded_vocab_: int) -> int:
    """Bytes of the embedding backward's working set beside its weight gradient
    (``[memory] embedding_backward_work``, :class:`~meshplan.spec.memory.MemoryOptions`):
    fp32 partial sums ``(n // 10 + min(n, V_rows)) h`` for ``n`` token ids (the micro-batch's
    tokens, replicated over tp), plus under SP at tp > 1 the all-gathered output gradient's
    excess over the sequence-sharded dY, ``a (n - n / tp) h``. 0 when the option is off.

    Llama-3-405B, tp 8 with SP, 8,192 tokens, bf16: (819 + 8,192) x 16,384 x 4 B = 590,544,896
    plus 2 x (8,192 - 1,024) x 16,384 = 234,881,024, 825,425,920 B in all."""
    if not opts.embedding_backward_work:
        return 0
    tok, rtok = _tokens(training, mesh)  # the ids are replicated over tp: every rank sees all tok
    partials = 4 * (tok // 10 + min(tok, padded_vocab_)) * model.hidden
    gathered = dtype_bytes(training.compute_dtype) * (tok - rtok) * model.hidden
    return partials + gathered


def head_sizes(model: ModelSpec, training: TrainingSpec, mesh: Mesh, opts: MemoryOptions) -> dict[str, int]:
    """Saved bytes of the embedding and the head (and of the head's loss and output-layer
    parts, freed as the backward passes them), the logits transients of ``cross_entropy``
    (:class:`~meshplan.spec.memory.MemoryOptions`), dY, the final norm's backward working set
    and the whole-vocabulary embedding gradient's excess over the rank's rows."""
    lo = layer_options(mesh, training)
    kw = dict(tp=lo["tp"], sp=lo["sp"], cp=lo["cp"])
    dims = dense_dims(model, training, opts.dropout)
    pv = padded_vocab(model.vocab, training.vocab_pad_divisor, lo["tp"])
    tok, rtok = _tokens(training, mesh)
    a = dtype_bytes(training.compute_dtype)
    logits = a * tok * ceil(pv / lo["tp"])
    kept = opts.loss_logits_dtype(training)
    lf = dtype_bytes(kept) * tok * ceil(pv / lo["tp"])  # one logits-sized tensor of the loss
    f32 = dtype_bytes("fp32") * tok * ceil(pv / lo["tp"])  # torch's pred.float(): always fp32
    torch_ce, parallel = opts.cross_entropy == "torch", lo["tp"] > 1
    head = {t.name: t.size_bytes for t in head_terms(dims, pv, logits_dtype=kept, **kw,
                                                      sp_gathered_input=opts.sp_gathered_input,
                                                      unfused_norm=opts.unfused_norm)}
    return {"embedding_saved": _total(embedding_terms(dims, **kw)),
            "head_saved": sum(head.values()),
            "head_loss_saved": sum(v for n, v in head.items() if n.startswith(("logits", "loss"))),
            "head_output_saved": sum(v for n, v in head.items() if n.startswith("output layer input")),
            # torch's: the GEMM's logits and their .float() copy, fp32 (4 B) whatever logits_dtype says,
            # (tp > 1: + x - max) beside the kept log-softmax; no copy where the logits are fp32 already
            # (Tensor.float() returns self when self is float32)
            "logits_temp": (logits + (f32 if training.compute_dtype != "fp32" else 0) + (lf if parallel else 0) if torch_ce
                            else logits if kept != training.compute_dtype else 0),
            "logits_extra": lf if torch_ce and parallel else 0,
            # torch's backward (module docstring): nll gradient + log-softmax gradient; loss_parallel's
            # fused backward (tp > 1): zeros, exp(x) and their sum, then the product beside the sum
            "loss_grad_extra": (3 if parallel else 2) * lf if torch_ce else 0,
            "loss_grad_kept": lf if torch_ce else 0,
            "logits_grad_temp": logits, "dy": a * rtok * model.hidden,
            "final_norm_work": norm_work(a * tok * model.hidden, a * rtok * model.hidden,
                                         lo["sp"] and lo["tp"] > 1, opts),
            "embedding_backward_work": embedding_backward_work(model, training, mesh, opts, pv),
            "embedding_grad_extra": (a * model.hidden * (pv - ceil(pv / lo["tp"]))
                                     if opts.embedding_grad_full_vocab and lo["tp"] > 1 else 0)}
