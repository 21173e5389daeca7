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
  and SP splits follow the layer's sharding (not measured). MoE and MLA layers are not counted.

On the head's stage the first weight-bearing node is the output layer's: the loss's nodes above it,
with their saved terms (logits, log-softmax), go with I's ``detach_``, and the logits gradient (its
output gradient, compute dtype) stays for W (:func:`head_lag_bytes`; the final norm's output gradient,
``b s h`` elements, is not counted).

So a lagging W holds the micro-batch's saved activations (the timeline keeps them from F to W,
:mod:`meshplan.memory.schedule`) plus these output gradients (:func:`lag_hold_bytes`, held
during each backward pass of the timeline for the stage's most lagging passes).

>>> weight_grad_output_bytes(s=16, b=1, h=32, a=4, g=2, d=8, f=48, gated=True, act_bytes=4)  # 9 s h x 4 B
18432
"""

from __future__ import annotations

from math import ceil

from meshplan.memory.layer_dims import LayerDims
from meshplan.memory.workingset import dense_dims
from meshplan.memory.activations import layer_options
from meshplan.pipeline.registry import get


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
    tok = ceil(s / cp)
    rtok = ceil(tok / tp) if sp else tok
    g_t = LayerDims(s=s, b=b, h=h, a=a, g=g, d=d, f=f).kv_local(tp)
    elems = 2 * rtok * h + tok * (a // tp * d + 2 * g_t * d) + 2 * tok * h + (2 if gated else 1) * tok * ceil(f / tp)
    return act_bytes * b * elems


def layer_weight_grad_bytes(model, training, mesh) -> int:
    """:func:`weight_grad_output_bytes` of one dense layer of ``model`` on a rank of ``mesh``
    (0 for MLA, not counted)."""
    if model.is_mla:
        return 0
    dims = dense_dims(model, training, False)
    lo = layer_options(mesh, training)
    return weight_grad_output_bytes(dims.s, dims.b, dims.h, dims.a, dims.g, dims.d, dims.f, dims.gated,
                                    dims.act_bytes, tp=lo["tp"], sp=lo["sp"], cp=lo["cp"])


def lag_hold_bytes(model, training, mesh, schedule, stage: int, pp: int, m: int, vpp: int, layers) -> int:
    """Output gradients held by the lagging W passes of ``stage`` (``layers``: its layer indices):
    :meth:`~meshplan.pipeline.base.PipelineSchedule.lagging_weights` of the schedule walked at
    ``vpp`` times the dense layers' :func:`layer_weight_grad_bytes`; 0 where W is folded into B."""
    sched = get(get(schedule).for_chunks(vpp))
    if not sched.frees_at_weight or pp <= 1:
        return 0
    dense = sum(1 for i in layers if not model.is_moe_layer(i))
    return int(sched.lagging_weights(pp, m, vpp, stage)) * dense * layer_weight_grad_bytes(model, training, mesh)


def head_lag_bytes(schedule, pp: int, vpp: int, logits_grad_bytes: int, loss_saved_bytes: int) -> int:
    """On the head's stage under a ``frees_at_weight`` schedule, what a lagging W holds beyond the
    timeline's saved activations: the logits gradient (``logits_grad_bytes``, compute dtype) less the
    loss terms torch's I frees (``loss_saved_bytes``); 0 elsewhere.

    >>> head_lag_bytes("zb_h1", 4, 1, 100, 300), head_lag_bytes("1f1b", 4, 1, 100, 300)
    (-200, 0)
    """
    sched = get(get(schedule).for_chunks(vpp))
    return logits_grad_bytes - loss_saved_bytes if sched.frees_at_weight and pp > 1 else 0
