"""Context parallelism's buffers in one layer's attention core, bytes on one rank of one
micro-batch (:func:`cp_buffers`): what the K/V exchange over cp holds beside the layer's
activations, in the forward and in the attention core's backward step. Read by
:func:`meshplan.memory.workingset.layer_act_sizes` (the forward's working set and the
``attention core`` step of :func:`~meshplan.memory.workingset.backward_steps`), so ``memory``,
``plan`` and the search's memory verdict see the same bytes. The collectives that move them:
:func:`meshplan.spec.axes.cp.cp_rows` (same sizes: :func:`~meshplan.spec.axes.cp.kv_elements`).

Notation: ``a`` the compute dtype's bytes, ``b`` micro-batch, ``s`` sequence, ``L = s / cp``
local tokens, ``q``/``g`` local q/KV heads (:func:`meshplan.spec.axes.tp.local_heads`), ``d``
and ``d_v`` the key and value head dims. ``G = a b s g (d + d_v)``: the whole sequence's K and V
at the KV heads; ``R = a b s q (d + d_v)``: the same at the q heads.

All-gather CP (``training.cp_ring`` false: Llama 3's, as meshplan's runtime runs it,
:meth:`meshplan.runtime.execution.cp.ContextParallel.gather_kv` and
:class:`meshplan.runtime.execution.model.Attention`): ``all_gather_single_autograd`` of the
stacked local K/V returns ``G`` (gather dim 0: ``(cp, 2, b, L, g, d)``), whose ``permute``
and ``reshape`` into ``(2, b, s, g, d)`` copy it (the merged dims are not adjacent): ``2G``
for a moment, then the copy alone; ``repeat_interleave`` to the q heads (GQA) makes the K and
V the SDPA reads and saves for backward (the copy freed), so autograd keeps the whole
sequence's K and V, at the q heads with ``[memory] kv_expanded`` (the repeat) else at the
KV heads (:func:`saves_gathered_kv`: the layer's ``k`` and ``v`` terms hold ``s`` tokens,
:mod:`meshplan.memory.activations`). Forward: ``G`` beside the saved activations (the
all-gather output beside its copy; with GQA the copy beside the repeated K/V); a layer that
saves nothing (full recompute's checkpointed forward) holds the K/V the SDPA reads too:
``G + E``, ``E`` the whole-sequence K/V at the SDPA's heads. Backward (the attention core step):
the SDPA's whole-sequence dK and dV (``E``, in the step's working set in place of the local
ones) and ``G`` more, the dK/dV at the KV heads that the reduce-scatter reads (the repeat's
sum, then ``all_gather_into_tensor_backward``'s ``grad_output.contiguous()`` copy of the
permuted gradient; torch 2.13 ``distributed/_functional_collectives.py``). A replayed layer's
gather (recompute) runs while its activations are recomputed, below this step's set: not
counted apart.

Megatron-LM (``framework = "megatron"``, whose rows are all-gather CP's,
:func:`meshplan.spec.axes.cp.cp_rows`) runs Transformer Engine's p2p ring, which keeps the local
K/V for backward and exchanges chunks: its buffers are not modelled, none counted here (all-gather
CP's whole-sequence K/V would overstate it by ``layers x G (1 - 1/cp)``, 28 GiB for Llama-3-8B at
256k and cp 8).

torch's ring attention (``training.cp_ring``; torch 2.13
``distributed/tensor/experimental/_context_parallel/_attention.py``, ``_cp_options``'
defaults: ``convert_to_f32`` True, ``rotate_method`` ALL_GATHER, load balance on; K and V at
the q heads after torchtitan's ``repeat_kv``). The SDPA saves only the local q, k, v, output
and log-sum-exp (the layer's terms as they are). Forward (``_templated_ring_attention``):
``_AllGatherRotater.exchange_buffers`` allocates the gathered ``R``, kept to the loop's end;
its input, the local K and V concatenated (``torch.cat``, ``R / cp``), is held by the
collective until ``next_buffer`` waits at step 1; ``_SDPAMerger`` keeps the merged output in
fp32 (``4 b L q d_v``): ``R + R / cp + 4 b L q d_v`` (the merge's elementwise temporaries
and the fp32 log-sum-exp, ``1 / d_v`` of the output, are not counted). Backward
(``_templated_ring_attention_backward``), at the dK/dV shift of a step ``1 <= i <= rank``
(cp rank ``cp - 1`` takes this branch every step): ``kv_rotater``'s own gathered ``R``; that
step's ``torch.cat`` of K and V (``R / cp``, held by ``next_kv``; none at the last step, so
only at cp > 2); the fp32 dQ accumulator (``zeros_like(query, dtype=float32)``, ``4 b L q
d``); and four fp32 dK/dV buffers of ``4 R / (a cp)`` bytes each: the received buffer
(``dkv_rotater._buffer`` until replaced), the halves ``_partial_update`` re-concatenates
(``grad_key``, ``grad_value``), the concatenation sent (``next_grad_kv``) and the next
receive buffer ``_AllToAllRotater.exchange_buffers``' ``permute_tensor`` allocates. The
SDPA call's own dQ, dK, dV are the step's working set already.

>>> from meshplan.spec.model import ModelSpec
>>> from meshplan.spec.training import TrainingSpec
>>> m = ModelSpec(layers=1, hidden=64, ffn=128, q_heads=4, kv_heads=2, vocab=100)
>>> t = TrainingSpec(global_batch=8, seq_len=64, compute_dtype="bf16", cp_attention="allgather")
>>> cp_buffers(m, t, cp=2, tp=1, kv_expanded=False, checkpointed=False)
CpBuffers(forward=8192, backward=8192, what='cp all-gathered K and V')
>>> cp_buffers(m, t.model_copy(update={"cp_attention": "ring"}), cp=2, tp=1, kv_expanded=False, checkpointed=False)
CpBuffers(forward=32768, backward=90112, what='cp ring: gathered K and V, fp32 merged output')
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.spec.axes.cp import kv_elements
from meshplan.spec.axes.tp import local_heads
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec
from meshplan.units import dtype_bytes


@dataclass(frozen=True)
class CpBuffers:
    """Bytes one layer's cp exchange holds on one rank (module docstring): ``forward`` beside
    the layer's saved activations while its attention runs, ``backward`` beside the attention
    core step's own gradients; ``what``: the forward's label in the memory timeline."""

    forward: int = 0
    backward: int = 0
    what: str = ""


def saves_gathered_kv(training: TrainingSpec, cp: int) -> bool:
    """Whether autograd keeps the whole sequence's K and V for the backward: all-gather CP as
    meshplan's runtime runs it (cp > 1, framework torch, not ``training.cp_ring``; module
    docstring); the ring keeps the local ones, and so does Megatron-LM's (not modelled).

    >>> t = TrainingSpec(global_batch=8, seq_len=64, cp_attention="allgather")
    >>> saves_gathered_kv(t, 2), saves_gathered_kv(t, 1), saves_gathered_kv(t.model_copy(update={"cp_attention": "ring"}), 2)
    (True, False, False)
    >>> saves_gathered_kv(TrainingSpec(global_batch=8, seq_len=64, framework="megatron"), 2)
    False
    """
    return cp > 1 and not training.cp_ring and training.framework == "torch"


def cp_buffers(model: ModelSpec, training: TrainingSpec, *, cp: int, tp: int, kv_expanded: bool,
               checkpointed: bool) -> CpBuffers:
    """:class:`CpBuffers` of one layer at cp degree ``cp`` and tp degree ``tp`` (module
    docstring); ``kv_expanded``: ``[memory] kv_expanded`` (the SDPA reads K and V at the q
    heads); ``checkpointed``: the layer's forward saves nothing (full recompute). None at cp 1
    and under Megatron-LM (module docstring)."""
    if cp <= 1 or not (training.cp_ring or saves_gathered_kv(training, cp)):
        return CpBuffers()
    a, b, s = dtype_bytes(training.compute_dtype), training.micro_batch, training.seq_len
    q, g, _ = local_heads(model, tp)
    if not training.cp_ring:
        gathered = a * kv_elements(model, b, s, g)
        sdpa = a * kv_elements(model, b, s, q if kv_expanded else g)
        return CpBuffers(forward=gathered + (sdpa if checkpointed else 0), backward=gathered,
                         what="cp all-gathered K and V")
    elems = kv_elements(model, b, s, q)
    ring, local = a * elems, a * elems // cp
    rows = b * (s // cp) * q  # local query rows x heads
    shift = 4 * (elems // cp)  # one fp32 dK/dV buffer (the cp send/recv row's size)
    return CpBuffers(forward=ring + local + 4 * rows * model.d_v,
                     backward=ring + (local if cp > 2 else 0) + 4 * rows * model.d_head + 4 * shift,
                     what="cp ring: gathered K and V, fp32 merged output")
