"""Sizes the memory timeline moves around, bytes on one rank of one pipeline stage.

Activations per layer come from :func:`~meshplan.memory.activations.layer_terms`
(Korthikanti et al. 2022 Table 2, generalised); embedding and head from
:func:`embedding_terms` and :func:`head_terms`. Working sets (stated here, not in Table 2;
a is the activation dtype size; per rank H = ``a s b h`` with the full local sequence,
Hr = H / t with SP, F = ``a s b f / t`` per gate, Q = ``a s b (a_q/t) d``, KV likewise):

- forward, with sequence parallel and tp > 1: the all-gathered layer input H while the
  QKV and MLP-in GEMMs run (none when ``sp_gathered_input``: then it is kept; ``s b h`` bytes,
  float8, under torchao's float8 TP, :func:`meshplan.compute.dtensor_sp.float8_tp`, as the
  all-gathered dY below); with full
  recompute the checkpointed forward keeps nothing, and its MLP holds H (+ Hr
  ``unfused_norm``) + 3F (gated; 2F GeLU) at once;
- backward of a dense layer, in autograd's order (:func:`backward_steps`; the incoming dY
  ``Hr`` is held by the pass): mlp w_out (SP: the all-gathered dY H, + its dX F; writes
  w_down's gradient, frees its input), activation (3F gated: d(w_out input), d(silu), d(up);
  2F GeLU), w_in (max(2F + H, 3H): the two GEMMs' dX and their sum; w_gate, w_up), mlp norm
  (:func:`norm_work`), attention w_o (SP H + Q), core (2Q + 2KV: d(context), dq, dk, dv;
  q, k, v, statistics freed; MLA: d(context) + dq + dk + dv with the value head dim), w_qkv
  (max(Q + 2KV + H, 3H); MLA adds the latents' gradients ``a s b (2 c_q + 2 c_kv + r)``),
  attn norm. Each step writes its weights' unsharded gradients as it runs and frees the saved tensors it consumed, so the
  layer's peak is at its first step, not with all its gradients and all its activations
  at once. Measured against torch's FSDPMemTracker (:mod:`meshplan.runtime.validation.memcheck`);
  flash-attention and RoPE backward buffers are not counted; MoE layers keep one step
  (dX Hr + the widest intermediate gradient + SP's re-gathered input);
- recompute: the layer's activations without recompute minus those kept, at the start of
  its backward (full recompute: the whole layer's working set; selective without flash:
  the attention scores; otherwise 0), freed by the steps with the rest;
- float8 Linears under torch (torchao): the float8 copies of their inputs the backward's
  weight-gradient GEMMs read, 1 B an element (:func:`float8_copies`), saved unless full or
  op-level recompute replays their casts, each freed by the step that reads it;
- the loss (``cross_entropy``), the final norm (:func:`norm_work`) and, with
  ``embedding_grad_full_vocab``, the whole-vocabulary embedding gradient: :func:`head_sizes`.

MoE layers (an estimate): attention and shared experts as a dense layer
of width ``shared_experts x shared_expert_ffn``; routed experts keep, per row the busiest
rank's local experts compute (:func:`meshplan.compute.routing.routing` of the ``tokens *
etp / tp`` each rank routes: ``experts x C`` padded rows with a capacity, the hottest
expert's rank's share when dropless), the expert MLP terms at width
``expert_ffn / etp`` (gated: 4 columns, 3 with ``fused_glu``; GeLU: 2) plus the dispatched input and the expert output (``2 a h`` each) and
the fp32 router logits ``4 experts`` per token.

FSDP units: every layer, plus the stage's embedding (stage 0) and head (final norm and
output on the last stage, the output counted as in :mod:`meshplan.memory.state`); on a
stage that holds both in one chunk (pp 1) they are one unit, FSDP2's root (``root``;
:mod:`meshplan.memory.passes`), except under torchtitan's units
(:attr:`~meshplan.spec.training.TrainingSpec.torchtitan_units`, untied): the embedding and the
head apart, the embedding resharded after forward as the layers are (``embedding_reshards``,
at every pp; tied under pp the first stage's embedding stays gathered, as torchtitan's tied
branch wraps it).
Gathered bytes are the tp-local unsharded elements in the compute dtype (FSDP2
``MixedPrecisionPolicy(param_dtype)``); the reduce-scatter input is in the reduce dtype.
The sharded gradients of :func:`~meshplan.memory.state.state_bytes` are split over the
units in proportion to their elements (exact total).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Optional
from math import ceil

from meshplan.compute import float8
from meshplan.compute.dtensor_sp import float8_tp
from meshplan.compute.ops import Workload, float8_gemms, framework_kernels
from meshplan.compute.shapes import layer_gemms
from meshplan.compute.routing import RoutingOptions, routing
from meshplan.compute.shapes import local_split
from meshplan.mesh.layers import last_stage
from meshplan.mesh.resolve import Mesh
from meshplan.spec.axes.base import Dim
from meshplan.spec.memory import MemoryOptions
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec
from meshplan.spec.wording import state_how
from meshplan.mesh.tpsplit import local_numel, padded_vocab
from meshplan.units import dtype_bytes, human_bytes
from meshplan.memory.activations import (MLA_LATENT_TERMS, LayerDims, embedding_terms, head_terms, layer_bytes,
                                         layer_options, layer_terms, mla_dims)
from meshplan.memory.passes import ActSizes, BackStep, StageSizes, Unit
from meshplan.memory.state import StateBytes


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
    Under torchtitan's per-layer AC (``recompute = "layer"``) ``checkpointed`` picks a
    layer checkpointed in full or one that keeps everything."""
    if training.recompute == "layer":
        training = training.model_copy(update={"recompute": "full" if checkpointed else "none"})
    fused = opts.fused_glu_for(training) and model.gated_mlp
    lo = {**layer_options(mesh, training), **opts.variants, "fused_glu": fused}
    tp, a = lo["tp"], dtype_bytes(training.compute_dtype)
    tok, rtok = _tokens(training, mesh)
    h, gate = model.hidden, 2 if model.gated_mlp else 1
    dims = dense_dims(model, training, opts.dropout)
    routed = routed_full = widest = 0
    if moe:
        dims = replace(dims, f=(model.shared_expert_ffn or model.moe_ffn) * model.shared_experts)
        routed_tok = ceil(tok * mesh.etp / tp)  # tp ranks split the tokens (runtime.moe), with or without SP
        r = routing(RoutingOptions.of(training), routed_tok, model.top_k, model.experts, mesh.ep)
        copies, width = r.recv_rows, ceil(model.moe_ffn / mesh.etp)  # rows the busiest rank computes
        kept = 3 if fused else 4 if model.gated_mlp else 2  # f-wide columns per row (activations module)
        routed_full = copies * (a * width * kept + 2 * a * h) + 4 * routed_tok * model.experts
        routed = routed_full if training.recompute != "full" else 0
        widest = a * copies * width * gate
    f8 = {} if moe else float8_copies(model, training, mesh)
    kept8 = 0 if training.recompute in ("full", "op") else sum(f8.values())  # replayed with the casts
    saved = layer_bytes(dims, **lo) + routed + kept8
    full = layer_bytes(dims, **{**lo, "recompute": "none"}) + routed_full + sum(f8.values())
    sp = mesh.sequence_parallel and tp > 1
    # the all-gathered input, 1 byte a value under torchao's float8 TP (compute.dtensor_sp.float8_tp)
    ga = 1 if float8_tp(model, training, sp) else a
    gathered = ga * tok * h if sp and not opts.sp_gathered_input else 0  # else a saved activation
    if moe:
        widest = max(widest, a * tok * ceil(dims.f / tp) * gate)
        return ActSizes(saved=saved, rework=full - saved, fwd_temp=gathered, bwd_temp=a * rtok * h + widest + gathered,
                        sp_input=gathered > 0)
    steps = backward_steps(model, training, mesh, opts, dims, lo, f8)
    fwd = gathered
    if training.recompute in ("full", "op"):  # the checkpointed forward keeps nothing: its MLP's working set
        fwd = max(fwd, a * tok * h + (a * rtok * h if opts.unfused_norm else 0)
                  + (3 if model.gated_mlp else 2) * a * tok * ceil(dims.f / tp))
    return ActSizes(saved=saved, rework=full - saved, fwd_temp=fwd, bwd_temp=max(st.work for st in steps),
                    steps=steps, sp_input=fwd == gathered > 0)


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
                                 "softmax dropout output", "flash softmax statistics (fp32)"),
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
    return float8.saved_copies(model, w, layer_gemms(model, tp, tok))


def backward_steps(model: ModelSpec, training: TrainingSpec, mesh: Mesh, opts: MemoryOptions,
                   dims, lo: dict, f8: Optional[dict[str, int]] = None) -> tuple:
    """:class:`BackStep` of a dense layer (see the module docstring: working sets); ``f8``: the
    float8 input copies (:func:`float8_copies`), each freed by the step that reads it."""
    a, tp = dims.act_bytes, lo["tp"]
    tok, rtok = _tokens(training, mesh)
    sp = lo["sp"] and tp > 1
    H, Hr, F = a * tok * dims.h, a * rtok * dims.h, a * tok * ceil(dims.f / tp)
    aq = dims.a // tp
    kv = aq if opts.kv_expanded else (dims.g // tp if tp <= dims.g else 1)
    Q, K = a * tok * aq * dims.d, a * tok * kv * dims.d
    V, C = a * tok * kv * dims.d_v, a * tok * aq * dims.d_v  # value and context (MLA: v_head_dim)
    lat = a * tok * (2 * dims.q_lora + 2 * dims.kv_lora + dims.rope)  # MLA: latent gradients (up, then norm)
    # the all-gathered output gradient of a row-parallel GEMM (SP; float8 under torchao's float8 TP)
    g = (tok * dims.h if float8_tp(model, training, sp) else H) if sp else 0
    work = {"mlp w_out": g + F, "mlp activation": (3 if dims.gated else 2) * F,
            "mlp w_in": max(2 * F + H, 3 * H) if dims.gated else F + H,
            "mlp norm": norm_work(H, Hr, sp, opts), "attention w_o": g + C, "attention core": C + Q + K + V,
            "attention w_qkv": max(Q + K + V + lat + H, 3 * H), "attn norm": norm_work(H, Hr, sp, opts)}
    full = {t.name: t.size_bytes for t in layer_terms(dims, **{**lo, "recompute": "none"})}
    kept = {t.name: t.size_bytes for t in layer_terms(dims, **lo)}
    comp = dtype_bytes(training.compute_dtype) if fsdp_active(training, mesh)["dense"] else 0
    grads = {k: n * comp for k, n in step_numels(model, tp, mesh.ep, mesh.etp)}
    frees = {k: sum(full.get(n, 0) for n in names) for k, names in STEP_TERMS.items()}
    frees["attn norm"] += sum(full.values()) - sum(frees.values())  # anything unlisted: freed last
    for what, nb in (f8 or {}).items():
        frees[FLOAT8_STEP[what]] += nb
    if "layer input (checkpoint)" in kept:
        frees["attn norm"] += kept["layer input (checkpoint)"] - full.get("attn norm input", 0)
    return tuple(BackStep(k, work[k], grads[k], frees[k]) for k in STEP_WEIGHTS)


@lru_cache(maxsize=1024)
def step_numels(model: ModelSpec, tp: int, ep: int, etp: int) -> tuple[tuple[str, int], ...]:
    """(step, local elements) of the weights whose gradients each backward step of a dense
    layer writes (:data:`STEP_WEIGHTS`; a weight no step names: ``attn norm``), in step order;
    every step 0 for a model without a dense layer. Memoised (a pure function of the model
    and the degrees; the search asks it for every micro-batch and recompute policy)."""
    grads = dict.fromkeys(STEP_WEIGHTS, 0)
    dense = next((i for i in range(model.layers) if not model.is_moe_layer(i)), None)
    for t in model.layer_tensors(dense) if dense is not None else ():
        step = next((k for k, ps in STEP_WEIGHTS.items() if any(t.name.startswith(p) for p in ps)), "attn norm")
        grads[step] += local_numel(t, model, tp, ep, etp)
    return tuple(grads.items())


def _numel(tensors, model: ModelSpec, mesh: Mesh, training: TrainingSpec) -> dict[str, int]:
    """Elements per group (dense, expert) and, under ``{group}_gather``, their bytes in the
    dtype FSDP2 all-gathers each weight in (``training.gather_dtype``: float8 Linear weights)."""
    out = {"dense": 0, "expert": 0, "dense_gather": 0, "expert_gather": 0}
    for t in tensors:
        g, n = "expert" if t.expert else "dense", local_numel(t, model, mesh.degree("tp"), mesh.ep, mesh.etp)
        out[g] += n
        out[g + "_gather"] += n * dtype_bytes(training.gather_dtype(t))
    return out


def _unit_numels(model: ModelSpec, training: TrainingSpec, mesh: Mesh, stages, k: int) -> dict:
    """Elements per unit and group (dense, expert) on one rank of stage ``k``."""
    pv = padded_vocab(model.vocab, training.vocab_pad_divisor, mesh.degree("tp"))
    pp = len(stages)
    cache: dict[bool, dict] = {}
    out: dict = {}
    if k == 0:
        out["embedding"] = _numel(model.embedding_tensors(pv), model, mesh, training)
    for layer in (i for chunk in stages[k] for i in chunk):
        moe = model.is_moe_layer(layer)
        if moe not in cache:
            cache[moe] = _numel(model.layer_tensors(layer), model, mesh, training)
        out[layer] = cache[moe]
    if k == last_stage(stages):  # the output layer's stage (0 under a V)
        head = [t for t in model.head_tensors(pv) if not t.tied or pp > 1 or t.name.endswith("norm")]
        out["head"] = _numel(head, model, mesh, training)
    return out


def bucket_buffer_bytes(contiguous: bool, cap: int, largest_bucket: int, grad_bytes: int) -> int:
    """Bytes of the gradient buffers DeepSpeed ZeRO-3 of 2021 holds during a backward beyond the
    gradients themselves (microsoft/DeepSpeed v0.3.13, 12a53b43833b7bea279a205e313f2bd3f0cdfd99,
    ``deepspeed/runtime/zero/stage3.py``); ``cap``: ``reduce_bucket_size`` (elements),
    ``largest_bucket``: the stage's largest gradient bucket (elements), ``grad_bytes``: the
    gradients' dtype bytes (``param.grad``, the parameter dtype).

    - ``contiguous_gradients`` true: ``backward`` (lines 2534-2547) allocates the ipg buffer,
      ``torch.empty(reduce_bucket_size, dtype=torch.half)``, and with ``overlap_comm`` (stage 3's
      default true, ``ZERO3_OPTIMIZATION_OVERLAP_COMM_DEFAULT``, zero/constants.py; meshplan's
      ZeRO-3 of 2021 always overlaps) a second one ("double buffers"), at every backward (each
      micro-batch); the hooks copy each gradient into it (``new_grad_tensor.copy_``, the gradient
      then a view of it) and ``_release_ipg_buffers`` drops both at the backward's end (the ipg
      epilogue, line 1313): ``2 x cap x 2 B`` whatever the dtypes (fp16 buffers).
    - ``contiguous_gradients`` false: no buffer kept; each flush's ``allreduce_bucket`` (line
      1796) flattens the bucket's gradients into a new tensor (``flatten(bucket)``) of their
      dtype, freed once ``allreduce_and_copy`` has copied it back; ``reduce_ipg_grads`` waits for
      the reduction stream before each flush, so one is alive at a time: the largest bucket,
      ``largest_bucket x grad_bytes``.

    GPT-3 175B in fp16, the default 5e8: 2 x 5e8 x 2 B = 2 GB with contiguous gradients; without,
    its largest bucket, the word embedding's 51,200 x 12,288 = 629,145,600 gradients alone (past the
    bucket: a bucket of its own), 1.258 GB:

    >>> bucket_buffer_bytes(True, 500_000_000, 629_145_600, 2), bucket_buffer_bytes(False, 500_000_000, 629_145_600, 2)
    (2000000000, 1258291200)
    """
    return 2 * cap * 2 if contiguous else largest_bucket * grad_bytes


def deepspeed3_bucket_bytes(model: ModelSpec, training: TrainingSpec, mesh: Mesh, stages, k: int,
                            opts: MemoryOptions, total: int) -> int:
    """Bytes of DeepSpeed ZeRO-3 of 2021's gradient buffers during each backward of stage ``k``
    (:func:`bucket_buffer_bytes`; ``total``: the stage's parameter
    elements on one rank), 0 under another engine. The largest bucket (``contiguous_gradients``
    false) is taken as ``min(max(reduce_bucket_size, the largest tensor), total)``: a tensor past
    the bucket is a bucket of its own, the others fill at most ``reduce_bucket_size``."""
    if training.sharding != "zero3" or training.zero3_engine != "deepspeed-2021":
        return 0
    pv = padded_vocab(model.vocab, training.vocab_pad_divisor, mesh.degree("tp"))
    kinds = {model.is_moe_layer(j): j for c in stages[k] for j in c}  # one layer of each kind
    ts = [*(model.embedding_tensors(pv) if k == 0 else ()), *(model.head_tensors(pv) if k == last_stage(stages) else ()),
          *(t for i in kinds.values() for t in model.layer_tensors(i))]
    largest = max((local_numel(t, model, mesh.degree("tp"), mesh.ep, mesh.etp) for t in ts), default=0)
    cap = opts.deepspeed_bucket_elements()
    return bucket_buffer_bytes(training.contiguous_grads, cap, min(max(cap, largest), total),
                                         dtype_bytes(training.param_dtype))


def deepspeed3_ipg_bytes(training: TrainingSpec, opts: MemoryOptions) -> int:
    """Bytes of DeepSpeed ZeRO-3's ipg buffer under ``training.zero3_engine = "deepspeed"``
    (deepspeedai/DeepSpeed edaa722 ``runtime/zero/stage3.py:731-735``): with
    ``contiguous_gradients`` (:attr:`~meshplan.spec.training.TrainingSpec.contiguous_grads`,
    DeepSpeed's default true) the optimizer's init allocates ``torch.empty(reduce_bucket_size)``
    in ``communication_data_type`` (one buffer per communication dtype, ``ipg_buckets``, 455-464;
    one here) and keeps it for the whole run (the backward hooks copy each gradient into it,
    ``__add_grad_to_ipg_bucket``, 1543-1568; nothing frees it): ``reduce_bucket_size x reduce
    bytes``, ``[memory] grad_bucket_elements`` or DeepSpeed's default 5e8 (``zero/config.py:113``),
    whatever the model's size and whether ``overlap_comm`` is on (stage 3 keeps one buffer, not
    ZeRO-1/2's two). 0 without ``contiguous_gradients`` or under another engine.

    bf16, the default 5e8: 5e8 x 2 B = 1 GB; fp32 reduce (``communication_data_type`` fp32): 2 GB.

    >>> t = TrainingSpec(global_batch=8, seq_len=16, zero3_engine="deepspeed")
    >>> deepspeed3_ipg_bytes(t, MemoryOptions()), deepspeed3_ipg_bytes(t.model_copy(update={"grad_reduce_dtype": "fp32"}),
    ...     MemoryOptions()), deepspeed3_ipg_bytes(t.model_copy(update={"contiguous_gradients": False}), MemoryOptions())
    (1000000000, 2000000000, 0)
    """
    if training.sharding != "zero3" or training.zero3_engine != "deepspeed" or not training.contiguous_grads:
        return 0
    return opts.deepspeed_bucket_elements() * dtype_bytes(training.gradient_reduce_dtype)


ROOT_NAME = "root (embedding, final norm, output)"


def fsdp_active(training: TrainingSpec, mesh: Mesh) -> dict[str, bool]:
    """Whether each group's parameters are FSDP-sharded (gathered before use)."""
    on = training.sharding in ("zero3", "hsdp")
    return {"dense": on and mesh.degree("fsdp") > 1, "expert": on and mesh.degree("efsdp") > 1}


def units(model: ModelSpec, training: TrainingSpec, mesh: Mesh, stages, state: StateBytes) -> dict:
    """:class:`Unit` per unit key of stage ``state.stage`` (see the module docstring)."""
    numels = _unit_numels(model, training, mesh, stages, state.stage)
    active = fsdp_active(training, mesh)
    head = {}
    if "embedding" in numels and "head" in numels and len(stages[state.stage]) == 1 \
            and (model.tied_embeddings or not training.torchtitan_units):  # one FSDP2 root (torchtitan: two units)
        emb, head = numels.pop("embedding"), numels.pop("head")
        numels = {"root": {g: emb[g] + head[g] for g in emb}, **numels}
    comp, red = dtype_bytes(training.compute_dtype), dtype_bytes(training.fsdp_reduce_dtype)  # the table's
    shares = {g: _split(state.bytes_of("grads", g), [n[g] for n in numels.values()]) for g in ("dense", "expert")}
    out = {}
    for i, (key, n) in enumerate(numels.items()):
        gathered = sum(n[g] for g in active if active[g])
        name = f"layer {key}" if isinstance(key, int) else ROOT_NAME if key == "root" else key
        early = sum(head[g] for g in active if active[g]) * comp if key == "root" else 0
        gbytes = sum(n[g + "_gather"] for g in active if active[g])  # float8 Linear weights: 1 byte each
        out[key] = Unit(name=name, layer=key if isinstance(key, int) else None, gathered=gbytes,
                        grad_unsharded=gathered * comp, reduce_input=gathered * red,
                        grads=sum(shares[g][i] for g in shares), early=early)
    return out


def _split(total: int, weights: list[int]) -> list[int]:
    """``total`` split in proportion to ``weights``, integers summing exactly to it.

    >>> _split(10, [1, 1, 1])
    [3, 3, 4]
    """
    s, out, prev = sum(weights), [], 0
    acc = 0
    for w in weights:
        acc += w
        cur = total * acc // s if s else 0
        out.append(cur - prev)
        prev = cur
    return out


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
    lf = dtype_bytes(opts.logits_dtype) * tok * ceil(pv / lo["tp"])  # one logits-sized tensor of the loss
    torch_ce, parallel = opts.cross_entropy == "torch", lo["tp"] > 1
    head = {t.name: t.size_bytes for t in head_terms(dims, pv, logits_dtype=opts.logits_dtype, **kw,
                                                      sp_gathered_input=opts.sp_gathered_input,
                                                      unfused_norm=opts.unfused_norm)}
    return {"embedding_saved": _total(embedding_terms(dims, **kw)),
            "head_saved": sum(head.values()),
            "head_loss_saved": sum(v for n, v in head.items() if n.startswith(("logits", "loss"))),
            "head_output_saved": sum(v for n, v in head.items() if n.startswith("output layer input")),
            "logits_temp": (logits + (lf if parallel else 0) if torch_ce
                            else logits if opts.logits_dtype != training.compute_dtype else 0),
            "logits_extra": lf if torch_ce and parallel else 0,
            "loss_grad_extra": (2 if parallel else 1) * lf if torch_ce else 0,
            "logits_grad_temp": logits, "dy": a * rtok * model.hidden,
            "final_norm_work": norm_work(a * tok * model.hidden, a * rtok * model.hidden,
                                         lo["sp"] and lo["tp"] > 1, opts),
            "embedding_grad_extra": (a * model.hidden * (pv - ceil(pv / lo["tp"]))
                                     if opts.embedding_grad_full_vocab and lo["tp"] > 1 else 0)}


def init_entries(state: StateBytes, fsdp_grads: bool, comm_axes: list[str], opts: MemoryOptions,
                 training: TrainingSpec, origin: str = "") -> tuple:
    """Persistent state (by kind, group and sharding axis, in the runtime's words:
    :func:`meshplan.spec.wording.state_how`; ``origin``: the config's foreign format), NCCL
    buffers and workspace."""
    out = []
    for it in state.items:
        if it.kind == "grads" and fsdp_grads:
            continue
        how = state_how(training, it.axis, it.divisor, origin)
        out.append((None, it.kind, it.size_bytes, f"{it.kind} {it.group}: {it.count:,} x {it.bytes_per_element} B, {how}"))
    for axis in comm_axes:
        out.append((None, "comm_buffers", opts.comm_bytes_per_group,
                    f"NCCL communicator {axis}: NCCL_BUFFSIZE {human_bytes(opts.nccl_buffsize_bytes)} x "
                    f"{opts.nccl_channels} channels x {opts.nccl_peers} peers"))
    out.append((None, "workspace", opts.workspace_bytes, f"cuBLAS workspace {human_bytes(opts.workspace_bytes)}"))
    ipg = deepspeed3_ipg_bytes(training, opts)
    out.append((None, "grad_buffers", ipg, f"DeepSpeed ZeRO-3 ipg buffer: reduce_bucket_size "
                f"{opts.deepspeed_bucket_elements():,} x {dtype_bytes(training.gradient_reduce_dtype)} B "
                f"({training.gradient_reduce_dtype}, contiguous_gradients), allocated at init"))
    return tuple(e for e in out if e[2])


def step_entries(state: StateBytes, training: TrainingSpec, opts: MemoryOptions, fsdp_grads: int) -> tuple:
    """Optimizer step: its temporaries (:meth:`MemoryOptions.optimizer_temp_states_for`: one
    state-sized ``sqrt`` under torch's foreach Adam, none under the fused step), then FSDP's
    sharded grads freed (zero_grad)."""
    temp = opts.optimizer_temp_bytes(training, state.bytes_of("optimizer"))
    n = opts.optimizer_temp_states_for(training)
    out = [(None, "temporaries", temp, f"optimizer step: {n:g} state-sized temporaries"),
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
    dense_checkpointed: Optional[ActSizes] = None  # recompute "layer": the layers checkpointed in full
    moe_checkpointed: Optional[ActSizes] = None

    def layer(self, training: TrainingSpec, moe: bool, position: int) -> ActSizes:
        """The sizes of the layer at ``position`` among the stage's layers."""
        if training.recompute == "layer" and training.layer_recomputed(position):
            return (self.moe_checkpointed if moe else self.dense_checkpointed) or (self.moe if moe else self.dense)
        return self.moe if moe else self.dense


def common_sizes(model: ModelSpec, training: TrainingSpec, mesh: Mesh, opts: MemoryOptions) -> CommonSizes:
    """:class:`CommonSizes` of ``model`` on ``mesh`` (computed once for all stages)."""
    dense = layer_act_sizes(model, training, mesh, opts)
    moe = layer_act_sizes(model, training, mesh, opts, moe=True) if model.is_moe else dense
    ck = ck_moe = None
    if training.recompute == "layer":
        ck = layer_act_sizes(model, training, mesh, opts, checkpointed=True)
        ck_moe = layer_act_sizes(model, training, mesh, opts, moe=True, checkpointed=True) if model.is_moe else ck
    return CommonSizes(dense, moe, head_sizes(model, training, mesh, opts), ck, ck_moe)


def stage_sizes(model: ModelSpec, training: TrainingSpec, mesh: Mesh, stages, state: StateBytes,
                opts: MemoryOptions, comm_axes: list[str], common: Optional[CommonSizes] = None,
                origin: str = "") -> StageSizes:
    """All sizes of stage ``state.stage`` (``stages``: ``pipeline.stage_layers`` output);
    ``common``: :func:`common_sizes` of the same arguments when already computed; ``origin``:
    the config's foreign format (:attr:`meshplan.config.Config.origin`), for the words of the
    state's notes."""
    k = state.stage
    us = units(model, training, mesh, stages, state)
    fsdp = any(u.gathered for u in us.values())
    layers = [i for chunk in stages[k] for i in chunk]
    common = common or common_sizes(model, training, mesh, opts)
    acts = {i: common.layer(training, model.is_moe_layer(i), pos) for pos, i in enumerate(layers)}
    hs = common.head
    bucket = deepspeed3_bucket_bytes(model, training, mesh, stages, k, opts, state.params.total) if fsdp \
        else opts.grad_bucket_bytes(training, mesh.degree("fsdp"), state.params.total)
    fsdp_grads = sum(u.grads for u in us.values()) if fsdp else 0
    return StageSizes(
        stage=k, chunks=tuple(tuple(c) for c in stages[k]), acts=acts, units=us,
        embedding_saved=hs["embedding_saved"] if k == 0 else 0, head_saved=hs["head_saved"],
        head_loss_saved=hs["head_loss_saved"], head_output_saved=hs["head_output_saved"],
        logits_temp=hs["logits_temp"], logits_extra=hs["logits_extra"], loss_grad_extra=hs["loss_grad_extra"],
        logits_grad_temp=hs["logits_grad_temp"], dy=hs["dy"], final_norm_work=hs["final_norm_work"],
        embedding_grad_extra=hs["embedding_grad_extra"] if k == 0 and fsdp else 0, fsdp=fsdp,
        reshard_after_forward=training.reshard_after_forward,
        fsdp_reduce=opts.fsdp_reduce_for(training, mesh.degree("pp")),
        embedding_reshards=training.torchtitan_units and training.reshard_after_forward and (
            not model.tied_embeddings or training.reshard_head_after_forward),
        head_reshards=training.reshard_head_after_forward,
        reshard_after_backward=training.grad_accumulation == "no_sync",
        reduce_deferred=mesh.degree("pp") > 1,
        prefetch=opts.prefetch_layers, forward_prefetch=opts.forward_prefetch_layers, bucket=bucket,
        # DeepSpeed ZeRO-1/2 allocates its bucket buffers at every backward's first gradient hook
        bucket_every_backward=training.sharding == "zero2" or training.zero12_engine == "deepspeed" or fsdp,
        bucket_what=_bucket_what(training),
        recompute=training.recompute, init=init_entries(state, fsdp, comm_axes, opts, training, origin),
        step=step_entries(state, training, opts, fsdp_grads))


def _bucket_what(training: TrainingSpec) -> str:
    """The gradient bucket's label in the memory timeline, in its engine's words."""
    if training.sharding == "zero3" and training.zero3_engine == "deepspeed-2021":
        return ("DeepSpeed ZeRO-3 ipg buffers (2 x reduce_bucket_size, fp16; contiguous_gradients)"
                if training.contiguous_grads else
                "DeepSpeed ZeRO-3 flattened gradient bucket being all-reduced (largest bucket)")
    return ("DeepSpeed bucket buffer(s) (model dtype) and the bucket being reduced"
            if training.zero12_engine == "deepspeed" else "gradient bucket (reduce dtype)")

