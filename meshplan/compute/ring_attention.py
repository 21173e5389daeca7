"""The attention calls of a context-parallel ring on one rank, each rated at its own shape
(:func:`ring_calls`, :func:`slowest_rank`), torch's ring attention and Transformer Engine's p2p
ring alike, and the memory-bound kernels torch's ring adds around them (:func:`ring_bytes`,
:func:`ring_ops`).

Source: pytorch/pytorch ``torch/distributed/tensor/experimental/_attention.py`` (read at
0123248a; the Dec 2024 commit torchtitan's Table 2 ran, 1963fc8, not checked):
``_ContextParallelOptions`` defaults ``convert_to_f32 = True``, ``enable_load_balance = True``
(round-robin chunks), ``rotate_method`` all-gather (torchtitan 9dec370
``--experimental.context_parallel_rotate_method`` default ``"allgather"``).
``_templated_ring_attention`` calls SDPA ``cp`` times per layer, one call per K/V chunk, and
merges each call's output into an fp32 running output (``_SDPAMerger``: ``out.to(float32)``,
then ``out - sigmoid(block_lse - lse) * (out - block_out)``); it concatenates K and V
(``torch.cat``) before every exchange but the last and casts the merged output back at the end.
``_templated_ring_attention_backward`` accumulates dQ, dK and dV in fp32
(``zeros_like(..., dtype=float32)``, ``+=``), concatenates dK and dV in fp32 for their rotation
every step (an all-to-all ring), ``_partial_update`` re-concatenates the dK and dV halves of the
load-balanced steps, and casts all three back at the end.

The SDPA calls (:func:`ring_calls`, same source): the rank's local Q, K and V are its two
load-balanced chunks of ``L / 2`` (``L = s / cp``) side by side. Step 0 (``_is_causal_behavior``:
``IS_CAUSAL``) is one causal ``L x L`` call; every later step is unmasked (``NOT_IS_CAUSAL``
with load balance): at step ``i <= rank`` the whole Q against the first half of the received
K/V (``key.chunk(2, dim=2)[0]``: ``L x L/2``), at ``i > rank`` the second half of Q against the
whole K/V (``query.chunk(2, dim=2)[1]``: ``L/2 x L``); ``_templated_ring_attention_backward``
issues the same calls' gradients (the same branches). Every call is ``L^2 / 2`` query-key pairs,
together the causal ``(L, s)`` of :func:`meshplan.compute.shapes.attention_shape`. Each is rated
at its own loop length (:func:`rate_lengths`): FlashAttention-2 (torch's SDPA flash backend)
runs a forward block per 128 queries looping over the keys (``flash_fwd_launch_template.h``,
``grid(num_m_block, b, h)``) and a backward block per 128 keys looping over the queries
(``flash_bwd_launch_template.h`` ``run_flash_bwd_seqk_parallel``: ``grid_n(num_n_block, b, h)``,
Dao-AILab/flash-attention), while the catalog's rows are square calls at a constant 16k tokens
(the benchmark's batch x length), so a square row at a call's loop length has its work per block.
FlashAttention-3 (Hopper) splits the work the same way: ``hopper/flash_bwd_launch_template.h``
schedules one backward tile per ``kBlockN`` keys (``num_blocks_n = ceil_div(seqlen_k, kBlockN)``)
and loops over the queries (Dao-AILab/flash-attention 000786d). A length outside the rows' range
takes the nearest row's rate (:func:`meshplan.compute.measured.attention_seconds`: clamped at the
ends): above 16,384 the rates have flattened (FA3 causal d128 602 at 8,192, 616 at 16,384); below
512 no published rate exists, so the 512 rate there is an upper bound on the rate.

Transformer Engine's p2p ring (Megatron-LM's ``--cp-comm-type p2p``, :func:`te_ring`) issues the
same calls (``AttnFuncWithCPAndKVP2P.forward``, NVIDIA/TransformerEngine d0067d0
``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py``: with the
load-balanced chunks and a causal mask, step ``i == 0`` the "diagonal" section, ``i <= rank`` the
"lower-triangle" (``cp_p2p_fwd_prepare_qkv``: the whole Q against ``k_part[:, 0]``, the first half
of the received K/V), ``i > rank`` the "upper-triangle" (``q_part[:, 1]`` against the whole K/V);
the backward the same sections, ``cp_p2p_bwd_*``, in reverse order), rated the same way; TE's own
output, log-sum-exp and gradient corrections around them (not :func:`ring_bytes`' kernels), the
rank chosen with them and the steps timed one by one: :mod:`meshplan.compute.te_ring`.

Sizes: ``n_q`` elements of the output (``d_v``), ``n_dq`` of Q and of dQ (``d``, the same but
for MLA's ``d_qk``) and ``n_kv`` of K and V together on the rank at the heads the SDPA reads
(:func:`~meshplan.spec.axes.tp.sdpa_kv_heads` of ``Workload.kv_expanded``, ``[memory] kv_expanded``):
the KV heads by default (torchtitan ff0829c and later: ``enable_gqa=True``, no ``repeat_kv``; the
ring's K/V concatenations and its fp32 dK/dV accumulators are the SDPA's K/V's size), the q heads after
torchtitan's ``repeat_kv`` (9dec370 ``models/llama/model.py``, ``kv_expanded`` true);
the log-sum-exp rows (``1/d`` of the output) are left out. The work differs by rank: at a step
``i <= rank`` the whole Q is merged and the dK/dV half added and re-concatenated, at ``i > rank``
half of Q is merged and re-concatenated (``partial``), its dQ half added and re-concatenated, the
whole dK/dV added (:func:`ring_bytes`). The block counted is one rank's, the slowest of all cp
ranks by its SDPA calls plus its ring kernels (:func:`slowest_rank`): every layer's K/V all-gather
holds the ranks together.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from meshplan.compute.kernel_fragment import kernel_data
from meshplan.compute.kernel_time import issue_floor, memory_op, memory_op_seconds
from meshplan.compute.measured import KernelData, attention_seconds, memory_seconds
from meshplan.compute.ops import Op, Workload
from meshplan.compute.shapes import Attention
from meshplan.spec.axes.tp import sdpa_kv_heads
from meshplan.spec.cluster import GPUSpec

#: The forward op's name (op-level SAC saves SDPA's merged output and does not replay it:
#: :data:`meshplan.compute.recompute.OP_SAC_NOT_REPLAYED`).
MERGE = "cp ring merge"
#: The backward op's name.
GRAD_ACCUMULATION = "cp ring gradient accumulation"


def ring_bytes(n_q: int, n_kv: int, cp: int, eager: bool, rank: int, n_dq: Optional[int] = None,
               alltoall: bool = False) -> tuple[int, int]:
    """(forward, backward) bytes read + written per layer per micro-batch by the ring's own
    kernels (module docstring) on cp rank ``rank``, bf16 inputs; ``r = rank`` later steps take the
    whole Q (``i <= rank``), ``p = cp - 1 - rank`` half of it (``i > rank``). ``n_q``: the
    output's elements, which the forward merges; ``n_dq``: Q's, which dQ accumulates (default
    ``n_q``; MLA's Q at ``d_qk`` 192 against its output at ``d_v`` 128: ``grad_query`` is
    ``zeros_like(query, dtype=float32)``).

    Eager, one kernel per op: forward, the first call's output cast to fp32 (2 + 4 B) and the
    merged output cast back (4 + 2 B); a whole-Q merge the cast (6 B), ``out - block_out`` (12 B),
    the product with the broadcast sigmoid (8 B) and the subtraction (12 B): 38 B; a half-Q merge
    the same on half the rows (19 B) and ``_partial_update``'s ``torch.cat`` of the fp32 output
    (8 B): 27 B; ``n_q (12 + 38 r + 27 p)``; K and V made contiguous once and concatenated before
    cp - 1 exchanges (2 + 2 B each): ``n_kv 4 cp``. Backward: dQ zeroed (4 B), the first call's
    and each whole-Q call's added (4 + 2 + 4 B), each half-Q call's added to its half (5 B) and
    re-concatenated (8 B), cast back (6 B): ``n_q (20 + 10 r + 13 p)``; dK and dV zeroed, K and V
    made contiguous (4 B each), the first call's gradients added (10 B), at ``i <= rank`` the
    half added in place (5 B) and the halves re-concatenated (8 B), at ``i > rank`` the whole
    added (10 B), K and V concatenated before cp - 1 exchanges (4 B), the fp32 gradients
    concatenated for the rotation every call (8 B) and cast back (6 B):
    ``n_kv (24 + 13 r + 10 p + 4 (cp - 1) + 8 cp)``.

    Compiled (inductor fuses each step's elementwise ops into one pass, the all-gather
    rotater's unused later concatenations dropped): forward, the first cast (6 B), a whole-Q merge
    reading the fp32 output and the bf16 call output and writing fp32 (10 B), a half-Q merge
    copying the kept fp32 half (4 B over the whole) and merging the other (5 B): 9 B, the cast
    back (6 B): ``n_q (12 + 10 r + 9 p)``, K and V concatenated once (4 B); backward, dQ the same
    ``n_q (12 + 10 r + 9 p)``, dK and dV first written (6 B), each later step's received fp32
    gradients read and written with the call's bf16 gradients added, whole (10 B, ``i > rank``)
    or half (9 B, ``i <= rank``), cast back (6 B), K and V concatenated once (4 B):
    ``n_kv (16 + 9 r + 10 p)``. Each backward ``n_q`` term is ``n_dq``'s. With ``alltoall``
    (``training.cp_rotate``: each step sends its own concatenation, torch 2.13
    ``_templated_ring_attention`` lines 436-439, ``_templated_ring_attention_backward`` 531-534)
    no concatenation is dropped: ``cp - 1`` of them (4 B each) in either pass, where the
    all-gather rotation's compiled graph keeps one.

    >>> ring_bytes(100, 200, 2, eager=True, rank=1)   # 100 (12 + 38), 200 * 8; 100 * 30, 200 (24 + 13 + 4 + 16)
    (6600, 14400)
    >>> ring_bytes(100, 200, 2, eager=True, rank=0)   # 100 (12 + 27), 200 * 8; 100 * 33, 200 (24 + 10 + 4 + 16)
    (5500, 14100)
    >>> ring_bytes(100, 200, 2, eager=False, rank=1)  # 100 * 22 + 200 * 4; 100 * 22 + 200 * 25
    (3000, 7200)
    >>> ring_bytes(100, 200, 1, eager=True, rank=0)   # no ring at cp 1
    (0, 0)
    >>> ring_bytes(100, 200, 2, eager=True, rank=1, n_dq=150)   # dQ of 150 elements: 150 * 30 + 200 * 57
    (6600, 15900)
    >>> ring_bytes(100, 200, 4, eager=False, rank=1, alltoall=True)   # 100 (12 + 10 + 18) + 200 * 4 * 3; 100 * 40 + 200 (16 + 9 + 20 + 8)
    (6400, 14600)
    """
    if cp <= 1:
        return (0, 0)
    r, p = rank, cp - 1 - rank
    dq = n_q if n_dq is None else n_dq
    if eager:
        return (n_q * (12 + 38 * r + 27 * p) + n_kv * 4 * cp,
                dq * (20 + 10 * r + 13 * p) + n_kv * (24 + 13 * r + 10 * p + 4 * (cp - 1) + 8 * cp))
    cats = 4 * (cp - 1 if alltoall else 1)
    return (n_q * (12 + 10 * r + 9 * p) + n_kv * cats,
            dq * (12 + 10 * r + 9 * p) + n_kv * (12 + cats + 9 * r + 10 * p))


@dataclass(frozen=True)
class RingRank:
    """One cp rank's share of a layer's attention block on torch's ring: ``rank``; ``sdpa``, its
    SDPA calls' (forward s, backward s, how) (:func:`ring_seconds`), None where the calls are not
    rated per rank (a measured call, the GEMM ceiling: the whole causal shape); its ring kernels'
    ``forward_bytes`` and ``backward_bytes`` (:func:`ring_bytes`)."""

    rank: int
    sdpa: Optional[tuple[float, float, str]]
    forward_bytes: int
    backward_bytes: int


def slowest_rank(gpu: GPUSpec, att: Attention, w: Workload, data: Optional[KernelData] = None) -> RingRank:
    """The cp rank whose attention block is longest, every rank of ``w.cp`` considered: its SDPA
    calls (each :func:`~meshplan.compute.kernel_time.issue_floor`-ed, as the attention ops are;
    rated from ``data``'s published rates, or rank-independent where ``data`` is None) plus, on
    torch's ring (:func:`applies`), its two ring kernels
    (:func:`~meshplan.compute.kernel_time.memory_op_seconds` of :func:`ring_bytes`; none on
    Transformer Engine's, :func:`te_ring`, whose attention ops take their rank from
    :func:`meshplan.compute.te_ring.te_rank`, calls and TE's kernels together); the lowest such
    rank on a tie. ``att``: the rank's causal ``(s / cp, s)`` shape.

    >>> from meshplan import catalog
    >>> from meshplan.compute.measured import kernel_data
    >>> h100 = catalog.gpu("h100-sxm5-80gb")
    >>> a = Attention(1, 32, 8, 8192, 32768, 128)          # cp 4 at 32k: L 8,192
    >>> w = Workload(seq_len=32768, cp=4, torch_ring_attention=True, attention_kernels=("FA2",))
    >>> slowest_rank(h100, a, w, kernel_data("h100-sxm5-80gb")).rank   # its backward calls loop over L/2 queries
    0
    >>> slowest_rank(h100, a, replace(w, torch_eager=True)).rank   # SDPA the same on every rank: the most ring bytes
    3
    >>> te = slowest_rank(h100, a, replace(w, torch_ring_attention=False, te_ring_attention=True,
    ...                                    attention_kernels=()), kernel_data("h100-sxm5-80gb"))
    >>> te.rank, te.forward_bytes, te.backward_bytes   # FA3's calls alone: rank 0's 3 bwd calls loop over L/2
    (0, 0, 0)
    """
    n_q, n_kv, n_dq = _elements(att, w.kv_expanded)
    rated = rated_calls(data, att, w.cp, w.attention_kernels) if data is not None else None
    best: Optional[tuple[float, int]] = None
    for rank, t in enumerate(_rank_times(gpu, rated, w, n_q, n_kv, n_dq, att.seq_q)):
        if best is None or t > best[0] * (1 + 1e-9):  # a tie within rounding keeps the lower rank
            best = (t, rank)
    rank = 0 if best is None else best[1]
    fwd, bwd = _kernel_bytes(w, n_q, n_kv, n_dq, rank)
    return RingRank(rank, rank_seconds(rated, w.cp, att.seq_q, rank) if rated is not None else None, fwd, bwd)


def _kernel_bytes(w: Workload, n_q: int, n_kv: int, n_dq: int, rank):
    """:func:`ring_bytes` of cp rank ``rank`` (an int, or an int64 array of ranks) on torch's ring
    (:func:`applies`); Transformer Engine's ring: (0, 0), none counted (its kernels are :mod:`~meshplan.compute.te_ring`'s)."""
    return ring_bytes(n_q, n_kv, w.cp, w.torch_eager, rank, n_dq, w.cp_alltoall) if applies(w) else (0, 0)


def _rank_times(gpu: GPUSpec, rated: Optional[dict], w: Workload, n_q: int, n_kv: int, n_dq: int,
                seq_local: int) -> list[float]:
    """Seconds of every cp rank's attention block as :func:`slowest_rank` compares them (rank order): its two
    ring kernels, :func:`~meshplan.compute.kernel_time.memory_op_seconds` of :func:`ring_bytes`, plus, where
    ``rated`` (:func:`rated_calls`), its SDPA calls' forward and backward sums (:func:`_rank_sums`), each
    :func:`~meshplan.compute.kernel_time.issue_floor`-ed. All ranks at once in numpy, with the scalar functions'
    float operations in their order (int64 bytes, exact below 2^63; a count times a rate; the sums term by term,
    a zero count adding nothing), so each value is theirs to the bit: the 405B search asks cp up to 1,024
    (about 1,000 ranks a call), where the loop of scalar calls took a quarter of its vectorised estimate.

    >>> from meshplan import catalog
    >>> from meshplan.compute.measured import kernel_data
    >>> h100, d = catalog.gpu("h100-sxm5-80gb"), kernel_data("h100-sxm5-80gb")
    >>> a, w = Attention(1, 32, 8, 8192, 32768, 128), Workload(seq_len=32768, cp=4, torch_ring_attention=True)
    >>> n, rated = _elements(a, False), rated_calls(d, a, 4, ())
    >>> def one(r):   # the scalar loop's value of rank r, as slowest_rank summed it before
    ...     fwd, bwd = _kernel_bytes(w, *n, r)
    ...     f, b = _rank_sums(rated, 4, 8192, r)
    ...     t = memory_op_seconds(h100, fwd) + memory_op_seconds(h100, bwd)
    ...     return t + (issue_floor(h100, f) + issue_floor(h100, b))
    >>> _rank_times(h100, rated, w, *n, 8192) == [one(r) for r in range(4)]
    True
    """
    cp, data = w.cp, kernel_data(gpu)
    r = np.arange(cp, dtype=np.int64)
    fwd, bwd = (np.broadcast_to(np.asarray(x, dtype=np.int64), r.shape) for x in _kernel_bytes(w, n_q, n_kv, n_dq, r))
    # memory_kernel_seconds' "elementwise" kind: at Triad, floored; the datasheet bandwidth without catalog data
    mem = (lambda x: x / gpu.hbm_bandwidth_bytes_per_s) if data is None else (
        lambda x: np.maximum(memory_seconds(data, x), data.kernel_issue_s))
    t = mem(fwd) + mem(bwd)
    if rated is not None:
        floor = (lambda x: x) if data is None else (lambda x: np.maximum(x, data.kernel_issue_s))
        half, p = seq_local // 2, cp - 1 - r
        sums = []
        for k in (0, 1):  # forward, backward: _rank_sums' three terms in its order
            s = np.full(cp, 0.0 + rated[(seq_local, seq_local, True)][k])
            for n, call in ((r, (seq_local, half, False)), (p, (half, seq_local, False))):
                if call in rated:
                    s = np.where(n > 0, s + n * rated[call][k], s)
            sums.append(s)
        t = t + (floor(sums[0]) + floor(sums[1]))
    return t.tolist()


def _elements(att: Attention, kv_expanded: bool) -> tuple[int, int, int]:
    """(n_q, n_kv, n_dq) of ``att`` (module docstring): the output's elements (``d_v``), K's and
    V's together at the heads the SDPA reads (:func:`~meshplan.spec.axes.tp.sdpa_kv_heads`: the q
    heads after ``repeat_kv``, ``kv_expanded``, else the KV heads), Q's (``head_dim``: MLA's ``d_qk``).

    >>> _elements(Attention(1, 8, 1, 8192, 131072, 128), False), _elements(Attention(1, 8, 1, 8192, 131072, 128), True)
    ((8388608, 2097152, 8388608), (8388608, 16777216, 8388608))
    """
    rows = att.batch * att.q_heads * att.seq_q
    kv_rows = att.batch * sdpa_kv_heads(att.q_heads, att.kv_heads, kv_expanded) * att.seq_q
    return rows * att.d_v, kv_rows * (att.head_dim + att.d_v), rows * att.head_dim


def applies(w: Workload) -> bool:
    """Whether ``w`` runs torch's ring attention: cp > 1, the fused attention, and torch's
    context parallelism (``w.torch_ring_attention``: ``training.cp_ring``, the rule the CP rows of
    :func:`meshplan.spec.axes.cp.cp_rows` follow; not Megatron-LM, whose Transformer Engine rings
    K/V in its own kernels, :func:`te_ring`, nor all-gather CP): the ring's merge and gradient
    accumulation kernels (:func:`ring_bytes`) run."""
    return w.cp > 1 and w.flash and w.torch_ring_attention


def te_ring(w: Workload) -> bool:
    """Whether ``w`` runs Transformer Engine's p2p ring (cp > 1, the fused attention,
    ``w.te_ring_attention``: Megatron-LM's ``--cp-comm-type p2p``,
    :attr:`~meshplan.spec.training.TrainingSpec.cp_p2p`, the rule of
    :func:`meshplan.spec.axes.cp.p2p_rows`): its calls are :func:`ring_calls`, TE's own kernels
    :mod:`meshplan.compute.te_ring`'s."""
    return w.cp > 1 and w.flash and w.te_ring_attention


def rated_per_call(w: Workload) -> bool:
    """Whether ``w``'s attention runs as a ring's ``cp`` calls per layer, each rated at its own
    shape (:func:`slowest_rank`): torch's ring (:func:`applies`) or Transformer Engine's (:func:`te_ring`)."""
    return applies(w) or te_ring(w)


def ring_ops(gpu: GPUSpec, chosen: RingRank) -> list[Op]:
    """The ring's forward merge and backward gradient accumulation as two memory-bound ops of
    the attention block: ``chosen``'s :func:`ring_bytes` (:func:`slowest_rank`), its rank named."""
    out = []
    for name, phase, nbytes in ((MERGE, "forward", chosen.forward_bytes),
                                (GRAD_ACCUMULATION, "backward_input", chosen.backward_bytes)):
        op = memory_op(gpu, name, "attn", phase, nbytes)
        out.append(replace(op, note=f"cp rank {chosen.rank}: {op.note}"))
    return out


def ring_calls(cp: int, seq_local: int, rank: int) -> list[tuple[int, int, bool]]:
    """(seq_q, seq_kv, causal) of each SDPA call cp rank ``rank`` issues per layer in torch's
    load-balanced ring (module docstring), ``seq_local`` = ``L``, its own tokens (even).

    >>> ring_calls(4, 8, 1)   # cp 4, L 8: step 0 causal, step 1 <= rank, steps 2, 3 > rank
    [(8, 8, True), (8, 4, False), (4, 8, False), (4, 8, False)]
    >>> ring_calls(1, 8, 0)
    [(8, 8, True)]
    """
    half = seq_local // 2
    return ([(seq_local, seq_local, True)] + [(seq_local, half, False)] * rank
            + [(half, seq_local, False)] * (cp - 1 - rank))


def rate_lengths(seq_q: int, seq_kv: int) -> tuple[int, int]:
    """(forward, backward) lengths at which a call's square rows are read: the forward's loop
    over the keys, the backward's over the queries (module docstring).

    >>> rate_lengths(8192, 4096)
    (4096, 8192)
    """
    return (seq_kv, seq_q)


def ring_seconds(data: KernelData, att: Attention, cp: int, rank: int,
                 prefer: tuple[str, ...] = ()) -> tuple[float, float, str]:
    """(forward s, backward s, how) of cp rank ``rank``'s SDPA calls on one layer (``att``: the
    rank's causal ``(s / cp, s)`` shape, :func:`ring_calls`), each rated by
    :func:`~meshplan.compute.measured.attention_seconds` at its :func:`rate_lengths`.

    >>> from meshplan.compute.measured import kernel_data
    >>> d = kernel_data("h100-sxm5-80gb")
    >>> a = Attention(1, 32, 8, 8192, 32768, 128)          # cp 4 at 32k: L 8,192
    >>> f, b, how = ring_seconds(d, a, 4, 0, ("FA2",))
    >>> how.split(" (cp ")[1]
    'rank 0: 1 causal 8192x8192, 3 of 4096x8192)'
    >>> round(f * 1e3, 3), round(b * 1e3, 3)   # FA2 fwd 333 causal + 3 x 370; bwd 318 + 3 x 310 (S 4096)
    (6.108, 17.623)
    """
    return rank_seconds(rated_calls(data, att, cp, prefer), cp, att.seq_q, rank)


def rated_calls(data: KernelData, att: Attention, cp: int, prefer: tuple[str, ...]) -> dict:
    """(forward s, backward s, how) of each distinct call any cp rank issues (:func:`ring_calls`
    of ranks 0 and cp - 1 hold all three), by (seq_q, seq_kv, causal): rated once, the search
    rates every cp candidate's ring on every rank."""
    calls = dict.fromkeys(ring_calls(cp, att.seq_q, 0) + ring_calls(cp, att.seq_q, cp - 1))
    return {(sq, sk, causal): attention_seconds(data, replace(att, seq_q=sq, seq_kv=sk), causal, prefer,
                                                lengths=rate_lengths(sq, sk)) for sq, sk, causal in calls}


def _rank_sums(rated: dict, cp: int, seq_local: int, rank: int) -> tuple[float, float]:
    """(forward s, backward s) of cp rank ``rank``'s calls from ``rated`` (:func:`rated_calls`):
    the causal call, ``rank`` of ``L x L/2``, ``cp - 1 - rank`` of ``L/2 x L``, as :func:`ring_calls`."""
    half = seq_local // 2
    f = b = 0.0
    for call, n in (((seq_local, seq_local, True), 1), ((seq_local, half, False), rank),
                    ((half, seq_local, False), cp - 1 - rank)):
        if n:
            f, b = f + n * rated[call][0], b + n * rated[call][1]
    return f, b


def rank_seconds(rated: dict, cp: int, seq_local: int, rank: int) -> tuple[float, float, str]:
    """(forward s, backward s, how) of cp rank ``rank``'s calls from ``rated`` (:func:`rated_calls`)."""
    f = b = 0.0
    hows = []
    calls = ring_calls(cp, seq_local, rank)
    for call in calls:
        cf, cb, how = rated[call]
        f, b = f + cf, b + cb
        hows.append(how)
    last = f"; the last: {hows[-1]}" if len(hows) > 1 else ""
    return f, b, f"{hows[0]}{last} (cp rank {rank}: {_call_counts(calls)})"


def _call_counts(calls: list[tuple[int, int, bool]]) -> str:
    """``calls`` as one phrase: "1 causal LxL, k of LxL/2, m of L/2xL"."""
    seen: dict = {}
    for c in calls:
        seen[c] = seen.get(c, 0) + 1
    return ", ".join(f"{n}{' causal' if c[2] else ' of'} {c[0]}x{c[1]}" for c, n in seen.items())
