"""Sizes the memory timeline moves around, bytes on one rank of one pipeline stage.

Activations per layer come from :func:`~meshplan.memory.activations.layer_terms`
(Korthikanti et al. 2022 Table 2, generalised); embedding and head from
:func:`embedding_terms` and :func:`head_terms`. Working sets (stated here, not in Table 2;
a is the activation dtype size, 2 bytes):

- forward, with sequence parallel and tp > 1: the all-gathered layer input ``a s b h``
  (full local sequence) while the QKV and MLP-in GEMMs run;
- backward: dX ``a s' b h`` (s' = s / tp with SP) beside the incoming dY (held by the pass),
  the widest intermediate gradient (MLP: ``a s b f / t``, twice for a gated MLP), and with
  SP the re-gathered input ``a s b h``. Flash-attention backward buffers are not counted;
- recompute: the layer's activations without recompute minus those kept, at the start of
  its backward (full recompute: the whole layer's working set; selective without flash:
  the attention scores; otherwise 0).

MoE layers (an estimate, balanced routing): attention and shared experts as a dense layer
of width ``shared_experts x shared_expert_ffn``; routed experts keep, per token copy
(top_k per token, tokens counted after SP), the expert MLP terms at width
``expert_ffn / etp`` plus the dispatched input and the expert output (``2 a h`` each) and
the fp32 router logits ``4 experts`` per token.

FSDP units: every layer, plus the stage's embedding (stage 0) and head (final norm and
output on the last stage, the output counted as in :mod:`meshplan.memory.state`).
Gathered bytes are the tp-local unsharded elements in the compute dtype (FSDP2
``MixedPrecisionPolicy(param_dtype)``); the reduce-scatter input is in the reduce dtype.
The sharded gradients of :func:`~meshplan.memory.state.state_bytes` are split over the
units in proportion to their elements (exact total).
"""

from __future__ import annotations

from dataclasses import replace
from math import ceil

from ..mesh import Mesh
from ..spec.memory import MemoryOptions
from ..spec.model import ModelSpec
from ..spec.training import TrainingSpec
from ..tpsplit import local_numel, padded_vocab
from ..units import dtype_bytes, human_bytes
from .activations import LayerDims, embedding_terms, head_terms, layer_bytes, layer_options
from .passes import ActSizes, StageSizes, Unit
from .state import StateBytes


def _total(terms) -> int:
    return sum(t.size_bytes for t in terms)


def _tokens(training: TrainingSpec, mesh: Mesh) -> tuple[int, int]:
    """(tokens per rank, tokens of a sequence-sharded tensor) for one micro-batch."""
    tok = ceil(training.seq_len / mesh.degree("cp")) * training.micro_batch
    tp = mesh.degree("tp")
    return tok, ceil(tok / tp) if mesh.sequence_parallel else tok


def dense_dims(model: ModelSpec, training: TrainingSpec, dropout: bool) -> LayerDims:
    """Dims of a dense layer of ``model`` (``layer_terms`` input)."""
    return LayerDims(s=training.seq_len, b=training.micro_batch, h=model.hidden, a=model.q_heads,
                     g=model.n_kv_heads, d=model.d_head, f=model.ffn, gated=model.gated_mlp, dropout=dropout)


def layer_act_sizes(model: ModelSpec, training: TrainingSpec, mesh: Mesh, opts: MemoryOptions,
                    moe: bool = False) -> ActSizes:
    """:class:`ActSizes` of a dense (or, ``moe``, an MoE) layer; see the module docstring."""
    lo = layer_options(mesh, training)
    tp, a = lo["tp"], dtype_bytes(training.compute_dtype)
    tok, rtok = _tokens(training, mesh)
    h, gate = model.hidden, 2 if model.gated_mlp else 1
    dims = dense_dims(model, training, opts.dropout)
    routed = routed_full = widest = 0
    if moe:
        dims = replace(dims, f=(model.shared_expert_ffn or model.moe_ffn) * model.shared_experts)
        copies, width = rtok * model.top_k, ceil(model.moe_ffn / mesh.etp)
        routed_full = copies * (a * width * (4 if model.gated_mlp else 2) + 2 * a * h) + 4 * rtok * model.experts
        routed = routed_full if training.recompute != "full" else 0
        widest = a * copies * width * gate
    saved = layer_bytes(dims, **lo) + routed
    full = layer_bytes(dims, **{**lo, "recompute": "none"}) + routed_full
    sp = mesh.sequence_parallel and tp > 1
    widest = max(widest, a * tok * ceil(dims.f / tp) * gate)
    bwd = a * rtok * h + widest + (a * tok * h if sp else 0)
    return ActSizes(saved=saved, rework=full - saved, fwd_temp=a * tok * h if sp else 0, bwd_temp=bwd)


def _numel(tensors, model: ModelSpec, mesh: Mesh) -> dict[str, int]:
    out = {"dense": 0, "expert": 0}
    for t in tensors:
        out["expert" if t.expert else "dense"] += local_numel(t, model, mesh.degree("tp"), mesh.ep, mesh.etp)
    return out


def _unit_numels(model: ModelSpec, training: TrainingSpec, mesh: Mesh, stages, k: int) -> dict:
    """Elements per unit and group (dense, expert) on one rank of stage ``k``."""
    pv = padded_vocab(model.vocab, training.vocab_pad_divisor, mesh.degree("tp"))
    pp = len(stages)
    cache: dict[bool, dict] = {}
    out: dict = {}
    if k == 0:
        out["embedding"] = _numel(model.embedding_tensors(pv), model, mesh)
    for layer in (i for chunk in stages[k] for i in chunk):
        moe = model.is_moe_layer(layer)
        if moe not in cache:
            cache[moe] = _numel(model.layer_tensors(layer), model, mesh)
        out[layer] = cache[moe]
    if k == pp - 1:
        head = [t for t in model.head_tensors(pv) if not t.tied or pp > 1 or t.name.endswith("norm")]
        out["head"] = _numel(head, model, mesh)
    return out


def fsdp_active(training: TrainingSpec, mesh: Mesh) -> dict[str, bool]:
    """Whether each group's parameters are FSDP-sharded (gathered before use)."""
    on = training.sharding in ("zero3", "hsdp")
    return {"dense": on and mesh.degree("fsdp") > 1, "expert": on and mesh.degree("efsdp") > 1}


def units(model: ModelSpec, training: TrainingSpec, mesh: Mesh, stages, state: StateBytes) -> dict:
    """:class:`Unit` per unit key of stage ``state.stage`` (see the module docstring)."""
    numels = _unit_numels(model, training, mesh, stages, state.stage)
    active = fsdp_active(training, mesh)
    comp, red = dtype_bytes(training.compute_dtype), dtype_bytes(training.reduce_dtype)
    shares = {g: _split(state.bytes_of("grads", g), [n[g] for n in numels.values()]) for g in ("dense", "expert")}
    out = {}
    for i, (key, n) in enumerate(numels.items()):
        gathered = sum(n[g] for g in n if active[g])
        name = f"layer {key}" if isinstance(key, int) else key
        out[key] = Unit(name=name, layer=key if isinstance(key, int) else None, gathered=gathered * comp,
                        grad_unsharded=gathered * comp, reduce_input=gathered * red,
                        grads=sum(shares[g][i] for g in shares))
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
    """Saved bytes of the embedding and the head, the logits transients and dY."""
    lo = layer_options(mesh, training)
    kw = dict(tp=lo["tp"], sp=lo["sp"], cp=lo["cp"])
    dims = dense_dims(model, training, opts.dropout)
    pv = padded_vocab(model.vocab, training.vocab_pad_divisor, lo["tp"])
    tok, rtok = _tokens(training, mesh)
    a = dtype_bytes(training.compute_dtype)
    logits = a * tok * ceil(pv / lo["tp"])
    return {"embedding_saved": _total(embedding_terms(dims, **kw)),
            "head_saved": _total(head_terms(dims, pv, logits_dtype=opts.logits_dtype, **kw)),
            "logits_temp": logits if opts.logits_dtype != training.compute_dtype else 0,
            "logits_grad_temp": logits, "dy": a * rtok * model.hidden}


def init_entries(state: StateBytes, fsdp_grads: bool, comm_axes: list[str], opts: MemoryOptions) -> tuple:
    """Persistent state (by kind, group and sharding axis), NCCL buffers and workspace."""
    out = []
    for it in state.items:
        if it.kind == "grads" and fsdp_grads:
            continue
        how = f"sharded over {it.axis} ({it.divisor})" if it.axis else "not sharded"
        out.append((None, it.kind, it.size_bytes, f"{it.kind} {it.group}: {it.count:,} x {it.bytes_per_element} B, {how}"))
    for axis in comm_axes:
        out.append((None, "comm_buffers", opts.comm_bytes_per_group,
                    f"NCCL communicator {axis}: NCCL_BUFFSIZE {human_bytes(opts.nccl_buffsize_bytes)} x "
                    f"{opts.nccl_channels} channels x {opts.nccl_peers} peers"))
    out.append((None, "workspace", opts.workspace_bytes, f"cuBLAS workspace {human_bytes(opts.workspace_bytes)}"))
    return tuple(e for e in out if e[2])


def step_entries(state: StateBytes, training: TrainingSpec, opts: MemoryOptions, fsdp_grads: int) -> tuple:
    """Optimizer step: foreach temporaries, then FSDP's sharded grads freed (zero_grad)."""
    states = training.optimizer_states
    temp = int(opts.optimizer_temp_states * state.bytes_of("optimizer") / states) if states else 0
    out = [(None, "temporaries", temp, f"optimizer step: {opts.optimizer_temp_states:g} state-sized temporaries"),
           (None, "temporaries", -temp, "optimizer step: temporaries freed"),
           (None, "grads", -fsdp_grads, "zero_grad(set_to_none): sharded gradients freed")]
    return tuple(e for e in out if e[2])


def stage_sizes(model: ModelSpec, training: TrainingSpec, mesh: Mesh, stages, state: StateBytes,
                opts: MemoryOptions, comm_axes: list[str]) -> StageSizes:
    """All sizes of stage ``state.stage`` (``stages``: ``pipeline.stage_layers`` output)."""
    k = state.stage
    us = units(model, training, mesh, stages, state)
    fsdp = any(u.gathered for u in us.values())
    layers = [i for chunk in stages[k] for i in chunk]
    dense = layer_act_sizes(model, training, mesh, opts)
    moe = layer_act_sizes(model, training, mesh, opts, moe=True) if model.is_moe else dense
    acts = {i: moe if model.is_moe_layer(i) else dense for i in layers}
    hs = head_sizes(model, training, mesh, opts)
    bucket = 0
    if not fsdp and (training.sharding == "zero2" or training.grad_dtype != training.reduce_dtype):
        dp_size = mesh.degree("fsdp")
        bucket = min(opts.bucket_elements(dp_size), state.params.total) * dtype_bytes(training.reduce_dtype)
    fsdp_grads = sum(u.grads for u in us.values()) if fsdp else 0
    return StageSizes(
        stage=k, chunks=tuple(tuple(c) for c in stages[k]), acts=acts, units=us,
        embedding_saved=hs["embedding_saved"] if k == 0 else 0, head_saved=hs["head_saved"],
        logits_temp=hs["logits_temp"], logits_grad_temp=hs["logits_grad_temp"], dy=hs["dy"], fsdp=fsdp,
        reshard_after_forward=training.reshard_after_forward, fsdp_reduce=opts.fsdp_reduce,
        prefetch=opts.prefetch_layers, bucket=bucket, bucket_every_backward=training.sharding == "zero2",
        recompute=training.recompute, init=init_entries(state, fsdp, comm_axes, opts),
        step=step_entries(state, training, opts, fsdp_grads))
