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

All-gather CP under ``framework = "torch"`` (``training.cp_kind`` ``allgather``: Llama 3's, as meshplan's runtime runs it,
:meth:`meshplan.runtime.execution.cp.ContextParallel.gather_kv` and
:class:`meshplan.runtime.execution.model.Attention`): ``all_gather_single_autograd`` of the
stacked local K/V returns ``G`` (gather dim 0: ``(cp, 2, b, L, g, d)``), whose ``permute``
and ``reshape`` into ``(2, b, s, g, d)`` copy it (the merged dims are not adjacent): ``2G``
for a moment, then the copy alone; ``repeat_interleave`` to the q heads (GQA) makes the K and
V the SDPA reads and saves for backward (the copy freed), so autograd keeps the whole
sequence's K and V, at the q heads with ``[memory] kv_expanded`` (the repeat) else at the
KV heads (:func:`saves_gathered_kv`: the layer's ``k`` and ``v`` terms hold ``s`` tokens,
:mod:`meshplan.memory.activations`; MLA, not repeated: v is a view of the copy, which the
SDPA keeps whole, ``(b, s, heads, d + d_v)``, :mod:`meshplan.memory.mla_terms`). Forward: ``G`` beside the saved activations (the
all-gather output beside its copy; with GQA the copy beside the repeated K/V); a layer that
saves nothing (full recompute's checkpointed forward) holds the K/V the SDPA reads too:
``G + E``, ``E`` the whole-sequence K/V at the SDPA's heads. Backward (the attention core step):
the SDPA's whole-sequence dK and dV (``E``, in the step's working set in place of the local
ones) and ``G`` more, the dK/dV at the KV heads that the reduce-scatter reads (the repeat's
sum, then ``all_gather_into_tensor_backward``'s ``grad_output.contiguous()`` copy of the
permuted gradient; torch 2.13 ``distributed/_functional_collectives.py``). A replayed layer's
gather (recompute) runs while its activations are recomputed, below this step's set: not
counted apart.

Megatron-LM (``framework = "megatron"``) runs Transformer Engine's CP inside its attention
function, read in NVIDIA/TransformerEngine d0067d0
``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py`` (fp8 attention
off, the fused backend, ``sbhd``, causal; K and V at the local KV heads ``g``, no GQA repeat; every
buffer in the compute dtype, ``fwd_nominal_dtype = q.dtype``). Below ``KV = a b L g (d + d_v)``
the rank's K and V, ``Q = a b L q d`` and ``C = a b L q d_v`` its q and attention output, ``G =
cp KV`` and ``K_s = a b s g max(d, d_v)`` the whole sequence's K (or V). Both save only local
tensors (the layer's terms as they are): the p2p ring q, the last received K/V buffer (``KV``, in
the local k and v's place), the output and the log-sum-exp (lines 2087-2142); all-gather CP q, k,
v, the output and two half log-sum-exps (lines 3613-3623).

``p2p`` (:func:`meshplan.spec.axes.cp.p2p_rows`; ``AttnFuncWithCPAndKVP2P``), at cp rank ``cp - 1``,
whose every step is a full-q tile (the largest). Forward: ``p2p_comm_buffers`` keeps each step's
K/V buffer to the function's end (the local ``torch.cat`` of k and v, then ``cp - 1`` received
ones, ``torch.empty_like``: lines 1685-1706), and ``out_per_step`` every step's output (lines
1672, 1810-1898, ``C`` each); the merged output (``flash_attn_fwd_out_correction_init``, the compute
dtype: lines 139-149 and 1985-2030) is the layer's own: ``cp (KV + C)``. Backward (the attention
core step): ``dq_buffer = torch.empty_like(q)`` (``Q``, the compute dtype, not fp32) and two send/recv
buffers of ``(2, *kv.shape)`` (``4 KV``: lines 2396-2399), beside the step's own dq, dk, dv (the
step's working set already); the dK/dV accumulate in those buffers (lines 2721-2799). A replayed core
(Megatron-LM's selective recompute checkpoints ``core_attention``; full recompute the layer) runs
the forward again in backward: ``cp (KV + C)`` without the step's own dq, dk, dv, counted at the
core step where larger (the replay runs right before it under selective recompute; under full, at
the layer's start); under selective recompute the replay also keeps its last received buffer
beside the checkpoint's local k and v: ``KV`` more.

``allgather`` (:func:`meshplan.spec.axes.cp.cp_rows`; ``AttnFuncWithCPAndKVAllGather``). Forward:
``gather_along_first_dim`` of k and v (``G``), reordered by ``torch.index_select`` (one of the two
twice for a moment: ``G + K_s``; lines 3215-3230); then ``out`` (``torch.zeros``, allocated for
every format, used by ``thd`` only: line 3263), the two half outputs ``out_per_step`` (``C``) and
the step's ``q.select(...).contiguous()`` (``Q / 2``) beside ``G`` (lines 3352-3370, 3419; the K/V
slices are views under ``sbhd``): ``G + max(2C + Q / 2, K_s)``. Backward: the whole-sequence dK and
dV (``torch.zeros``, ``G``), k and v gathered again (``G``; lines 3768-3807), both steps' dq, dk,
dv kept in their lists to the end (``Q`` and ``(2 cp + 1) / (2 cp) G``: the steps see ``rank + 1`` and
``2 cp - rank`` of the ``2 cp`` chunks, ``get_kv_seq_info_after_all_gather``, lines 2976-2990), the last step's
q, output and output-gradient halves and the reorder of dK then dV before their
reduce-scatter (``Q / 2 + C``: lines 3874-3889; ``K_s`` more: lines 4116-4122): beyond the step's own d(context), dq and local dk,
dv, ``3 G - G / (2 cp) + 3 Q / 2 + C + K_s``; a replayed forward's is smaller (``2 Q > C``).

A layer that saves nothing (full recompute's checkpointed forward) holds its local q, k, v and
output beside the buffers too: ``Q + KV + C`` more in the forward, under either kind. The
fp32 log-sum-exps (``1 / d_v`` of an output) and elementwise temporaries are not counted.

torch's ring attention (``training.cp_ring``; torch 2.13
``distributed/tensor/experimental/_context_parallel/_attention.py``, ``_cp_options``'
defaults: ``convert_to_f32`` True, ``rotate_method`` ALL_GATHER, load balance on; K and V at
the heads the SDPA reads, :func:`~meshplan.spec.axes.tp.sdpa_kv_heads`: the q heads after
torchtitan's ``repeat_kv`` with ``kv_expanded``, else the KV heads, ``enable_gqa``). The SDPA saves only the local q, k, v, output
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

Under ``training.cp_rotate = "alltoall"`` (``rotate_method`` ALL_TO_ALL, both passes' K/V through
``_AllToAllRotater``, torch 2.13 lines 253-270, 427-441, 519-534) nothing is gathered: at a step
``1 <= i < cp - 1`` the K/V received at step ``i - 1`` (``R / cp``, the step's key and value are
views of it), their ``torch.cat`` being sent (``R / cp``) and the receive buffer
``permute_tensor`` allocates (``R / cp``): ``3 R / cp`` in flight (cp 2: ``2 R / cp``, the first
step's send and receive buffers), beside the fp32 merged output in the forward. Backward, at the
dK/dV shift of a step ``i >= 1``: the received K/V (``R / cp``), at cp > 2 that step's send and
receive buffers (``2 R / cp``), and the fp32 dQ and four dK/dV buffers as above.

>>> from meshplan.spec.model import ModelSpec
>>> from meshplan.spec.training import TrainingSpec
>>> m = ModelSpec(layers=1, hidden=64, ffn=128, q_heads=4, kv_heads=2, vocab=100)
>>> t = TrainingSpec(global_batch=8, seq_len=64, compute_dtype="bf16", cp_attention="allgather")
>>> cp_buffers(m, t, cp=2, tp=1, kv_expanded=False, checkpointed=False)
CpBuffers(forward=8192, backward=8192, what='cp all-gathered K and V')
>>> ring = t.model_copy(update={"cp_attention": "ring"})   # R = 2 B x 64 x 2 KV heads x 32 = 8,192; 16,384 at 4 q heads
>>> cp_buffers(m, ring, cp=2, tp=1, kv_expanded=False, checkpointed=False)   # R + R/2 + 8,192; R + 8,192 + 4 x 8,192 (fp32: 4 R / (2 cp))
CpBuffers(forward=20480, backward=49152, what='cp ring: gathered K and V, fp32 merged output')
>>> cp_buffers(m, ring, cp=2, tp=1, kv_expanded=True, checkpointed=False)
CpBuffers(forward=32768, backward=90112, what='cp ring: gathered K and V, fp32 merged output')
>>> cp_buffers(m, t.model_copy(update={"cp_attention": "ring", "cp_rotate": "alltoall"}), cp=2, tp=1, kv_expanded=False,
...            checkpointed=False)   # 2 R/2 + 8,192; R/2 + 8,192 + 4 x 8,192
CpBuffers(forward=16384, backward=45056, what='cp ring (all-to-all rotation): K and V in flight, fp32 merged output')
>>> meg = t.model_copy(update={"framework": "megatron", "recompute": "none"})
>>> cp_buffers(m, meg, cp=2, tp=1, kv_expanded=False, checkpointed=False)
CpBuffers(forward=18432, backward=36864, what='cp all-gathered K and V (Transformer Engine)')
>>> cp_buffers(m, meg.model_copy(update={"cp_attention": "p2p"}), cp=2, tp=1, kv_expanded=False, checkpointed=False)
CpBuffers(forward=16384, backward=20480, what='cp p2p ring (Transformer Engine): K/V and output of every step')
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.spec.axes.cp import kv_elements
from meshplan.spec.axes.tp import local_heads, sdpa_kv_heads
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
    meshplan's runtime runs it (cp > 1, framework torch, :attr:`~meshplan.spec.training.TrainingSpec.cp_kind`
    ``allgather``; module docstring); torch's ring keeps the local ones, and so does Transformer
    Engine's CP under Megatron-LM, either kind (module docstring).

    >>> t = TrainingSpec(global_batch=8, seq_len=64, cp_attention="allgather")
    >>> saves_gathered_kv(t, 2), saves_gathered_kv(t, 1), saves_gathered_kv(t.model_copy(update={"cp_attention": "ring"}), 2)
    (True, False, False)
    >>> saves_gathered_kv(TrainingSpec(global_batch=8, seq_len=64, framework="megatron", cp_attention="allgather"), 2)
    False
    """
    return cp > 1 and training.cp_kind == "allgather" and training.framework == "torch"


@dataclass(frozen=True)
class _Sizes:
    """One layer's sizes on one rank, bytes (module docstring's notation): ``a`` the compute
    dtype's bytes, ``b`` micro-batch, ``s`` sequence, ``cp``, ``q``/``g`` local q/KV heads."""

    model: ModelSpec
    a: int
    b: int
    s: int
    cp: int
    q: int
    g: int

    @property
    def L(self) -> int:  # noqa: N802 (the module docstring's name)
        return self.s // self.cp

    def kv(self, tokens: int, heads: int) -> int:
        """K and V of ``tokens`` tokens at ``heads`` heads (:func:`~meshplan.spec.axes.cp.kv_elements`)."""
        return self.a * kv_elements(self.model, self.b, tokens, heads)


def _torch_allgather(z: _Sizes, training: TrainingSpec, kv_expanded: bool, checkpointed: bool) -> CpBuffers:
    gathered, sdpa = z.kv(z.s, z.g), z.kv(z.s, sdpa_kv_heads(z.q, z.g, kv_expanded))
    return CpBuffers(forward=gathered + (sdpa if checkpointed else 0), backward=gathered,
                     what="cp all-gathered K and V")


def _torch_ring(z: _Sizes, training: TrainingSpec, kv_expanded: bool, checkpointed: bool) -> CpBuffers:
    ring = z.kv(z.s, sdpa_kv_heads(z.q, z.g, kv_expanded))
    local = ring // z.cp
    rows = z.b * z.L * z.q  # local query rows x heads
    shift = 4 * (ring // z.a // z.cp)  # one fp32 dK/dV buffer (the cp send/recv row's size)
    if training.cp_rotate == "alltoall":  # no gathered R: the K/V in flight (module docstring)
        moving = (3 if z.cp > 2 else 2) * local
        return CpBuffers(forward=moving + 4 * rows * z.model.d_v,
                         backward=local + (2 * local if z.cp > 2 else 0) + 4 * rows * z.model.d_head + 4 * shift,
                         what="cp ring (all-to-all rotation): K and V in flight, fp32 merged output")
    return CpBuffers(forward=ring + local + 4 * rows * z.model.d_v,
                     backward=ring + (local if z.cp > 2 else 0) + 4 * rows * z.model.d_head + 4 * shift,
                     what="cp ring: gathered K and V, fp32 merged output")


def _te_local(z: _Sizes) -> tuple[int, int, int]:
    """(KV, Q, C): the rank's K and V at the KV heads, its q and its attention output (module docstring)."""
    rows = z.a * z.b * z.L * z.q
    return z.kv(z.L, z.g), rows * z.model.d_head, rows * z.model.d_v


def _te_p2p(z: _Sizes, training: TrainingSpec, kv_expanded: bool, checkpointed: bool) -> CpBuffers:
    KV, Q, C = _te_local(z)
    backward = Q + 4 * KV + (KV if training.recompute == "selective" else 0)
    if training.recompute in ("selective", "full"):  # the core's forward replayed in backward
        backward = max(backward, z.cp * (KV + C) - Q - KV)
    return CpBuffers(forward=z.cp * (KV + C) + (Q + KV + C if checkpointed else 0), backward=backward,
                     what="cp p2p ring (Transformer Engine): K/V and output of every step")


def _te_allgather(z: _Sizes, training: TrainingSpec, kv_expanded: bool, checkpointed: bool) -> CpBuffers:
    KV, Q, C = _te_local(z)
    G, Ks = z.kv(z.s, z.g), z.a * z.b * z.s * z.g * max(z.model.d_head, z.model.d_v)
    return CpBuffers(forward=G + max(2 * C + Q // 2, Ks) + (Q + KV + C if checkpointed else 0),
                     backward=3 * G - G // (2 * z.cp) + 3 * Q // 2 + C + Ks,
                     what="cp all-gathered K and V (Transformer Engine)")


#: Each CP kind's buffers by (:attr:`~meshplan.spec.training.TrainingSpec.cp_kind`, framework);
#: ``ring`` under megatron and ``p2p`` under torch are refused by the config.
_KINDS = {("allgather", "torch"): _torch_allgather, ("ring", "torch"): _torch_ring,
          ("allgather", "megatron"): _te_allgather, ("p2p", "megatron"): _te_p2p}


def cp_buffers(model: ModelSpec, training: TrainingSpec, *, cp: int, tp: int, kv_expanded: bool,
               checkpointed: bool) -> CpBuffers:
    """:class:`CpBuffers` of one layer at cp degree ``cp`` and tp degree ``tp`` (module
    docstring), by :attr:`~meshplan.spec.training.TrainingSpec.cp_kind` and framework;
    ``kv_expanded``: ``[memory] kv_expanded`` (torch's SDPA reads K and V at the q heads);
    ``checkpointed``: the layer's forward saves nothing (full recompute). None at cp 1."""
    kind = _KINDS.get((training.cp_kind, training.framework))
    if cp <= 1 or kind is None:
        return CpBuffers()
    q, g, _ = local_heads(model, tp)
    z = _Sizes(model=model, a=dtype_bytes(training.compute_dtype), b=training.micro_batch, s=training.seq_len,
               cp=cp, q=q, g=g)
    return kind(z, training, kv_expanded, checkpointed)
