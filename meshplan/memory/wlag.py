"""What a lagging weight-gradient pass (W) holds under a split-backward schedule, torch 2.13.

torch's ``_PipelineScheduleRuntime`` runs a split backward as ``stage_backward_input`` (I, the
schedule's B) then ``stage_backward_weight`` (W) (torch/distributed/pipelining/_backward.py,
torch 2.13.0 as installed):

- I calls ``autograd.grad`` on the stage inputs with ``retain_graph=True``, so no saved tensor of
  the micro-batch's graph is freed; it detaches the stage outputs, which drops only the nodes
  between the outputs and the first weight-bearing ones. Every saved activation stays until W.
  Measured (torch 2.13 CPU, two toy layers of LayerNorm, Linear, GELU, Linear: saved tensors
  tracked with ``saved_tensors_hooks``): 20 of 20 alive after I, 0 after W. Under non-reentrant
  activation checkpointing the recomputed tensors are freed again after I (measured: 4 checkpointed
  layers hold their inputs and the captured gradients below, not the recomputed activations), so
  what stays is what the memory model counts as saved (the checkpointed inputs).
- I also keeps, for every parameter group, the gradient flowing into its first node on the input
  path (a pre-hook stores ``grad_inputs``): the output gradient of every op with a weight. For a
  Llama layer (RMSNorm, wq, wk, wv, wo, RMSNorm, w1, w3, w2), ``e b`` times (e bytes per element,
  b micro-batch, s tokens of the rank's sequence shard, h hidden, a and g query and KV heads on the
  rank, d head dim, f MLP width per gate on the rank):

  ========================= =========================== ==========================================
  tensor                    elements                    note
  ========================= =========================== ==========================================
  attention-norm output dY  s h (s h / t under SP)      the norm's weight group
  q, k, v outputs' dY       s (a d + 2 g d)             column-parallel: a, g per tp rank
  wo output dY              s h                         row-parallel: the local partial output
  MLP-norm output dY        s h (s h / t under SP)
  w1 (and w3) outputs' dY   s f (2 s f gated)           column-parallel: f per tp rank
  w2 output dY              s h                         row-parallel
  ========================= =========================== ==========================================

  Measured at tp 1 (two such layers, h 32, a 4, g 2, d 8, f 48, s 16: 18 groups, distinct storages
  ``9 s h`` elements a layer = 2h + ad + 2gd + 2h + 2f with ad = h, gd = h/2, f = 1.5h); the tp
  and SP splits follow the layer's sharding (not measured).
- MLA (DeepSeek-V2/V3, :class:`meshplan.runtime.execution.mla.LatentAttention`) in place of q, k, v:
  ``wq_a`` and ``q_a_norm`` outputs ``c_q`` a token each (replicated over tp, all ``s`` tokens),
  ``wq_b`` (or ``wq`` without query compression) ``a (d_nope + r)``, ``wkv_a`` ``c_kv + r``,
  ``kv_a_norm`` ``c_kv``, ``wkv_b`` ``a (d_nope + d_v)``; ``wo`` ``h`` as above.
- MoE (:class:`meshplan.runtime.execution.moe.MoE`) in place of the MLP, after the MLP norm's: the
  router's logits, ``E`` a routed token (compute dtype: the ``Linear``'s output; ``.float()`` comes
  after), each expert GEMM's output per row the rank's local experts compute (the rows of
  :func:`meshplan.memory.routed_sizes.routed_sizes`): ``k f_e / etp`` (w1, w3) and ``h`` (w2); the
  shared experts as a dense MLP of width ``shared_experts x shared_expert_ffn``.

  Measured (torch 2.13 CPU, ``stage_backward_input`` on one runtime ``Block``, s 16, h 32, fp32:
  tests/test_wlag_layers.py): MoE (4 experts, top 2, capacity 8 rows each, f_e 16, one shared expert
  of 24, GQA a 4, g 2, d 8) 13 groups, 5,952 elements; MLA (a 4, c_q 16, c_kv 8, r 4, d_nope 8,
  d_v 8, dense MLP f 48) 12 groups, 6,208 elements; without ``c_q`` 10 groups, 5,696.

On the head's stage the first weight-bearing node is the output layer's: the loss's nodes above it,
with their saved terms (logits, log-softmax), go with I's ``detach_``, and the logits gradient (its
output gradient, compute dtype) stays for W (:func:`head_lag_bytes`); the final norm's output
gradient, ``b s h`` elements (``s h / t`` under SP), stays too (:func:`head_norm_grad_bytes`,
counted with the layers' in :func:`lag_hold_bytes`).

So a lagging W holds the micro-batch's saved activations (the timeline keeps them from F to W,
:mod:`meshplan.memory.schedule`) plus these output gradients (:func:`lag_hold_bytes`, held
during each backward pass of the timeline for the stage's most lagging passes).

>>> weight_grad_output_bytes(s=16, b=1, h=32, a=4, g=2, d=8, f=48, gated=True, act_bytes=4)  # 9 s h x 4 B
18432
"""

from __future__ import annotations

from math import ceil

import numpy as np

from meshplan.compute.routing import RoutingOptions, routed_tokens, routing
from meshplan.memory.layer_dims import LayerDims
from meshplan.memory.workingset import dense_dims
from meshplan.memory.activations import layer_options
from meshplan.pipeline.orders import order_arrays
from meshplan.pipeline.registry import get
from meshplan.pipeline.vshape import order_lag
from meshplan.units import dtype_bytes


def _mlp_elems(tok: int, rtok: int, h: int, f: int, gated: bool, tp: int) -> int:
    """Output-gradient elements of an MLP norm and a (column, row)-parallel MLP of width ``f`` per
    gate on ``tok`` tokens (``rtok`` the norm's under SP): ``rtok h + k tok f / t + tok h`` (no
    GEMM terms where ``f`` is 0: an MoE layer without shared experts)."""
    return rtok * h + ((2 if gated else 1) * tok * ceil(f / tp) + tok * h if f else 0)


def _attention_elems(dims: LayerDims, tok: int, rtok: int, tp: int) -> int:
    """Output-gradient elements of the attention norm, the q/k/v (or MLA's down and up) projections
    and ``wo`` on one rank (module docstring): MLA's ``wq_a``, ``q_a_norm``, ``wkv_a``, ``kv_a_norm``
    replicated over tp (all ``tok`` tokens), ``wq_b``/``wq`` and ``wkv_b`` over ``a / t`` heads."""
    h, aq = dims.h, dims.a // tp
    if not dims.kv_lora:
        return rtok * h + tok * (aq * dims.d + 2 * dims.kv_local(tp) * dims.d) + tok * h
    nope = dims.d - dims.rope
    q = tok * (2 * dims.q_lora + aq * dims.d) if dims.q_lora else tok * aq * dims.d
    kv = tok * (2 * dims.kv_lora + dims.rope + aq * (nope + dims.d_v))
    return rtok * h + q + kv + tok * h


def weight_grad_output_bytes(s: int, b: int, h: int, a: int, g: int, d: int, f: int, gated: bool,
                             act_bytes: int, tp: int = 1, sp: bool = False, cp: int = 1) -> int:
    """Bytes of the output gradients one lagging W of one dense layer holds on one rank (the
    module docstring's table): ``e b (2 r h + t_s (a d / t + 2 g_t d) + 2 t_s h + k t_s f / t)``,
    ``t_s = ceil(s / cp)`` tokens, ``r = t_s / t`` under SP (else ``t_s``), ``g_t`` KV heads per
    tp rank (1 where tp exceeds g), ``k`` 2 gated, 1 not.

    Llama-3 70B, tp 8 with SP, s 8192: 2 B x (2 x 1024 x 8192 + 8192 x (8 x 128 + 2 x 1 x 128)
    + 2 x 8192 x 8192 + 2 x 8192 x 3584) = 2 x 220,200,960:

    >>> weight_grad_output_bytes(s=8192, b=1, h=8192, a=64, g=8, d=128, f=28672, gated=True, act_bytes=2, tp=8, sp=True)
    440401920
    """
    dims = LayerDims(s=s, b=b, h=h, a=a, g=g, d=d, f=f, gated=gated, act_bytes=act_bytes)
    return act_bytes * b * _layer_elems(dims, tp, sp, cp, f)


def _layer_elems(dims: LayerDims, tp: int, sp: bool, cp: int, f: int) -> int:
    """Elements (per micro-batch row) of a layer's attention part and an MLP of width ``f``."""
    tok = ceil(dims.s / cp)
    rtok = ceil(tok / tp) if sp else tok
    return _attention_elems(dims, tok, rtok, tp) + _mlp_elems(tok, rtok, dims.h, f, dims.gated, tp)


def routed_grad_bytes(model, training, mesh) -> int:
    """Bytes of the router's and the routed experts' output gradients of one MoE layer on the busiest
    rank (module docstring): ``e (T E + R (k f_e / etp + h))``, ``T`` the tokens the rank routes and
    ``R`` the rows its local experts compute (:func:`meshplan.compute.routing.routed_tokens`,
    :func:`~meshplan.compute.routing.routing`, as :func:`meshplan.memory.routed_sizes.routed_sizes`)."""
    lo = layer_options(mesh, training)
    tok = ceil(training.seq_len / lo["cp"]) * training.micro_batch
    routed_tok, g = routed_tokens(tok, lo["tp"], mesh.etp, training.framework)
    rows = g * routing(RoutingOptions.of(training), routed_tok, model.top_k, model.experts, mesh.ep).recv_rows
    width = (2 if model.gated_mlp else 1) * ceil(model.moe_ffn / mesh.etp)
    return dtype_bytes(training.compute_dtype) * (routed_tok * model.experts + rows * (width + model.hidden))


def layer_weight_grad_bytes(model, training, mesh, moe: bool = False) -> int:
    """Output gradients one lagging W of one layer of ``model`` holds on a rank of ``mesh``: a dense
    (or MLA) layer's, or with ``moe`` the attention, the MLP norm, the shared experts (a dense MLP of
    ``shared_experts x shared_expert_ffn``) and :func:`routed_grad_bytes`."""
    dims = dense_dims(model, training, False)
    lo = layer_options(mesh, training)
    f = (model.shared_expert_ffn or model.moe_ffn) * model.shared_experts if moe else dims.f
    out = dims.act_bytes * dims.b * _layer_elems(dims, lo["tp"], lo["sp"], lo["cp"], f)
    return out + (routed_grad_bytes(model, training, mesh) if moe else 0)



def weight_groups(model, moe: bool = False) -> int:
    """Parameter groups of one layer under torch 2.13's split backward (``get_param_groups``: one per
    op with a weight, a Linear's bias with its weight): 2 norms; q, k, v (MLA: ``wq_a``, ``q_a_norm``,
    ``wq_b``, or ``wq`` alone, and ``wkv_a``, ``kv_a_norm``, ``wkv_b``); ``wo``; the MLP's 3 gated
    (2 not), or the router, the experts' 3 (2) and the shared experts' 3 (2). ``stage_backward_weight``
    runs one ``autograd.grad`` per group, and a non-reentrant checkpoint recomputes its layer's forward
    once per graph task that reaches it: measured (torch 2.13 CPU, two checkpointed runtime Blocks,
    ``early_stop`` false or true) 2 forwards in F, 2 in I, 18 in W for 18 groups
    (tests/test_wlag_layers.py), so W replays a checkpointed layer's forward this many times (one
    cause of torchtitan issue #773's slowdown, :data:`meshplan.pipeline.split_backward_ac.SPLIT_BACKWARD_AC`). The
    step times them under eager full or per-layer AC (:func:`meshplan.schedule.backward_pass._w_replays`);
    op-level AC raised in W in the same run (selective checkpointing serves one recompute).

    >>> from meshplan.spec.model import ModelSpec
    >>> weight_groups(ModelSpec(layers=1, hidden=64, ffn=96, q_heads=4, vocab=8))
    9
    """
    mlp = 3 if model.gated_mlp else 2
    if model.is_mla:
        attn = (3 if model.q_lora_rank else 1) + 3 + 1
    else:
        attn = 4
    ffn = 1 + mlp + (mlp if model.shared_experts else 0) if moe else mlp
    return 2 + attn + ffn

def head_norm_grad_bytes(model, training, mesh) -> int:
    """The final norm's output gradient a lagging W of the head's stage holds: ``e b r h``, ``r`` the
    rank's tokens (``ceil(s / cp)``, ``/ t`` under SP)."""
    lo = layer_options(mesh, training)
    tok = ceil(training.seq_len / lo["cp"])
    rtok = ceil(tok / lo["tp"]) if lo["sp"] else tok
    return dtype_bytes(training.compute_dtype) * training.micro_batch * rtok * model.hidden


def lag_hold_bytes(model, training, mesh, schedule, stage: int, pp: int, m: int, vpp: int, layers) -> int:
    """Output gradients held by the lagging W passes of ``stage`` (``layers``: its layer indices):
    :meth:`~meshplan.pipeline.base.PipelineSchedule.lagging_weights` of the schedule walked at
    ``vpp`` times the layers' :func:`layer_weight_grad_bytes` (and on the head's stage the final
    norm's, :func:`head_norm_grad_bytes`); 0 where W is folded into B."""
    sched = get(get(schedule).for_chunks(vpp))
    if not sched.frees_at_weight or pp <= 1:
        return 0
    moe = sum(1 for i in layers if model.is_moe_layer(i))
    one = (len(layers) - moe) * layer_weight_grad_bytes(model, training, mesh) \
        + (moe and moe * layer_weight_grad_bytes(model, training, mesh, moe=True)) \
        + (stage == sched.last_stage(pp, vpp)) * head_norm_grad_bytes(model, training, mesh)
    return int(sched.lagging_weights(pp, m, vpp, stage)) * one



def _v_chunk_weights(model, training, mesh, sched, stage: int, pp: int, vpp: int, chunks) -> list[int]:
    """Output-gradient bytes one lagging W of each chunk of ``stage`` holds: its layers'
    :func:`layer_weight_grad_bytes` (and the final norm's on the chunk that ends the model); 0 on the
    first virtual stage (rank 0's chunk 0), whose input-gradient pass torch skips (``backward_one_chunk``
    with ``full_backward=False``: ``if not self.is_first``, "Skip the backward for the first stage since
    we will perform the weight update with autograd.backward in backward_weight_one_chunk",
    torch/distributed/pipelining/stage.py, torch 2.13.0 as installed): its W is a full backward, which
    holds no output gradient before it runs."""
    dense, moe = (layer_weight_grad_bytes(model, training, mesh, moe=k) for k in (False, model.is_moe))
    head = head_norm_grad_bytes(model, training, mesh)
    vs = [sched.virtual_stage(c, stage, pp, vpp) for c in range(len(chunks))]
    return [(vs[c] > 0) * (sum(moe if model.is_moe_layer(i) else dense for i in layers) + (vs[c] == pp * vpp - 1) * head)
            for c, layers in enumerate(chunks)]


def _v_schedule(schedule, vpp: int, pp: int):
    """The V-shaped schedule walked at ``vpp``, or None (another schedule, or pp 1)."""
    sched = get(get(schedule).for_chunks(vpp))
    return None if sched.frees_at_weight or not sched.virtual_stages or not sched.splits_backward or pp <= 1 \
        else sched


def cooldown_lag_bytes(model, training, mesh, schedule, stage: int, pp: int, m: int, vpp: int, chunks) -> int:
    """Under a V-shaped schedule (ZB-V, DualPipeV): the most output gradients the cool-down's lagging
    W passes of ``stage`` hold at once, bytes (``chunks``: the stage's layer indices per chunk):
    :func:`~meshplan.pipeline.vshape.order_lag` of the schedule's order, each chunk pass weighted by
    its layers' :func:`layer_weight_grad_bytes` (and the final norm's on the chunk that ends the
    model); 0 for other schedules. The largest of :func:`cooldown_lag_levels`, which the timeline
    counts pass by pass (its note gives this)."""
    sched = _v_schedule(schedule, vpp, pp)
    if sched is None:
        return 0
    per = _v_chunk_weights(model, training, mesh, sched, stage, pp, vpp, chunks)
    return order_lag(sched.order(pp, m, vpp, stage), weight=lambda c: per[c])


def cooldown_lag_levels(model, training, mesh, schedule, stage: int, pp: int, m: int, vpp: int, chunks):
    """Under a V-shaped schedule (ZB-V, DualPipeV): the output-gradient bytes held at each W of
    ``stage``'s order, in order (the timeline's backward passes, :mod:`meshplan.memory.schedule`):
    those of every chunk pass whose B is done and W not, this W's own included (weights as
    :func:`cooldown_lag_bytes`, whose value is their largest), int64 (backward passes,); and the most
    such chunk passes at once (:meth:`~meshplan.pipeline.vshape.VShaped.lagging_weights`), from one
    walk of the order; None for other schedules. torch's B keeps them to the W (module docstring), and
    no forward runs between a B and its W on these orders, so each backward pass holds its level while
    it runs.

    >>> _levels(np.array([1, 1, 2, 2]), np.array([0, 0, 0, 0]), np.array([0, 1, 0, 1]), [10, 11])  # B0 B1 W0 W1
    array([21, 11])
    """
    sched = _v_schedule(schedule, vpp, pp)
    if sched is None:
        return None
    kind, mb, chunk = order_arrays(sched.name, pp, m, vpp, stage)
    levels = _levels(kind, mb, chunk, _v_chunk_weights(model, training, mesh, sched, stage, pp, vpp, chunks))
    return levels, int(_levels(kind, mb, chunk, [1] * len(chunks)).max(initial=0))


def _levels(kind: np.ndarray, mb: np.ndarray, chunk: np.ndarray, per: list[int]) -> np.ndarray:
    """At each W (kind 2) of an order (kind 1 B), the summed ``per[chunk]`` of the (micro-batch,
    chunk) pairs whose B came before it and whose W is this one or later: +weight at each B, -weight
    after its W, a running sum read at the Ws."""
    w = np.asarray(per, np.int64)[chunk]
    pair = mb * (int(chunk.max(initial=0)) + 1) + chunk
    b_at = np.full(int(pair.max(initial=0)) + 1, -1, np.int64)
    b = np.flatnonzero(kind == 1)
    b_at[pair[b]] = b
    ws = np.flatnonzero(kind == 2)
    ws = ws[b_at[pair[ws]] >= 0]  # a W without a B holds nothing of its own
    step = np.zeros(len(kind) + 1, np.int64)
    np.add.at(step, b_at[pair[ws]], w[ws])
    np.add.at(step, ws + 1, -w[ws])
    return np.cumsum(step)[np.flatnonzero(kind == 2)]

def head_lag_bytes(schedule, pp: int, vpp: int, logits_grad_bytes: int, loss_saved_bytes: int) -> int:
    """On the head's stage under a ``frees_at_weight`` schedule, what a lagging W holds beyond the
    timeline's saved activations: the logits gradient (``logits_grad_bytes``, compute dtype) less the
    loss terms torch's I frees (``loss_saved_bytes``); 0 elsewhere.

    >>> head_lag_bytes("zb_h1", 4, 1, 100, 300), head_lag_bytes("1f1b", 4, 1, 100, 300)
    (-200, 0)
    """
    sched = get(get(schedule).for_chunks(vpp))
    return logits_grad_bytes - loss_saved_bytes if sched.frees_at_weight and pp > 1 else 0
