"""The memory-bound kernels torch's context-parallel ring attention adds around the fused
attention calls on one rank (:func:`ring_bytes`, :func:`ring_ops`).

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

Sizes: ``n_q`` elements of Q (= of the output, ``d_v = d``) and ``n_kv`` of K and V together on
the rank, torchtitan's K and V after ``repeat_kv`` (q heads; 9dec370 ``models/llama/model.py``);
the log-sum-exp rows (``1/d`` of the output) are left out. The rank counted is cp rank cp - 1,
whose every later step takes the whole local Q (``i <= rank``: no partial merge), the most
merged bytes of the cp ranks (a partial step merges half the rows and re-concatenates the
whole output, 27 B an element of Q against 38).
"""

from __future__ import annotations

from dataclasses import replace

from meshplan.compute.kernel_time import memory_op
from meshplan.compute.measured import KernelData, attention_seconds
from meshplan.compute.ops import Op, Workload
from meshplan.compute.shapes import Attention
from meshplan.spec.cluster import GPUSpec

#: The forward op's name (op-level SAC saves SDPA's merged output and does not replay it:
#: :data:`meshplan.compute.recompute.OP_SAC_NOT_REPLAYED`).
MERGE = "cp ring merge"
#: The backward op's name.
GRAD_ACCUMULATION = "cp ring gradient accumulation"


def ring_bytes(n_q: int, n_kv: int, cp: int, eager: bool) -> tuple[int, int]:
    """(forward, backward) bytes read + written per layer per micro-batch by the ring's own
    kernels (module docstring) on cp rank cp - 1, bf16 inputs.

    Eager, one kernel per op: forward, the first call's output cast to fp32 (2 + 4 B) and the
    merged output cast back (4 + 2 B), and for each of the cp - 1 later calls the cast (6 B),
    ``out - block_out`` (12 B), the product with the broadcast sigmoid (8 B) and the subtraction
    (12 B): ``n_q (12 + 38 (cp - 1))``; K and V made contiguous once and concatenated before
    cp - 1 exchanges (2 + 2 B each): ``n_kv 4 cp``. Backward: dQ zeroed (4 B), accumulated
    every call (4 + 2 + 4 B) and cast back (6 B): ``n_q (10 + 10 cp)``; dK and dV zeroed,
    K and V made contiguous (4 B each), the first call's gradients added (10 B), each later
    call's half added in place (5 B) and the halves re-concatenated (8 B), K and V concatenated
    before cp - 1 exchanges (4 B), the fp32 gradients concatenated for the rotation every call
    (8 B) and cast back (6 B): ``n_kv (24 + 17 (cp - 1) + 8 cp)``.

    Compiled (inductor fuses each step's elementwise ops into one pass, the all-gather
    rotater's unused later concatenations dropped): forward, the first cast (6 B), each later
    merge reading the fp32 output and the bf16 call output and writing fp32 (10 B) and the
    cast back (6 B): ``n_q (2 + 10 cp)``, K and V concatenated once (4 B); backward, dQ the
    same ``n_q (2 + 10 cp)``, dK and dV first written (6 B), each later step's received fp32
    gradients read, added and written (10 B), cast back (6 B), K and V concatenated once (4 B):
    ``n_kv (6 + 10 cp)``.

    >>> ring_bytes(100, 200, 2, eager=True)     # 100 (12 + 38), 200 * 8; 100 * 30, 200 (24 + 17 + 16)
    (6600, 14400)
    >>> ring_bytes(100, 200, 2, eager=False)    # 100 * 22 + 200 * 4; 100 * 22 + 200 * 26
    (3000, 7400)
    >>> ring_bytes(100, 200, 1, eager=True)     # no ring at cp 1
    (0, 0)
    """
    if cp <= 1:
        return (0, 0)
    if eager:
        return (n_q * (12 + 38 * (cp - 1)) + n_kv * 4 * cp,
                n_q * (10 + 10 * cp) + n_kv * (24 + 17 * (cp - 1) + 8 * cp))
    return (n_q * (2 + 10 * cp) + n_kv * 4, n_q * (2 + 10 * cp) + n_kv * (6 + 10 * cp))


def applies(w: Workload) -> bool:
    """Whether ``w`` runs torch's ring attention: cp > 1, the fused attention, and torch's
    context parallelism (``w.torch_ring_attention``: not Megatron-LM, whose Transformer Engine
    rings K/V in its own kernels)."""
    return w.cp > 1 and w.flash and w.torch_ring_attention


def ring_ops(gpu: GPUSpec, att: Attention, w: Workload) -> list[Op]:
    """The ring's forward merge and backward gradient accumulation as two memory-bound ops of
    the attention block (:func:`ring_bytes` of ``att``'s local Q and K/V, the compiled pass count
    unless ``w.torch_eager``); none where it does not apply (:func:`applies`)."""
    if not applies(w):
        return []
    n_q = att.batch * att.q_heads * att.seq_q * att.d_v
    n_kv = att.batch * att.q_heads * att.seq_q * (att.head_dim + att.d_v)  # repeat_kv: q heads
    fwd, bwd = ring_bytes(n_q, n_kv, w.cp, w.torch_eager)
    return [memory_op(gpu, MERGE, "attn", "forward", fwd),
            memory_op(gpu, GRAD_ACCUMULATION, "attn", "backward_input", bwd)]


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


def ring_seconds(data: KernelData, att: Attention, cp: int, prefer: tuple[str, ...] = ()) -> tuple[float, float, str]:
    """(forward s, backward s, how) of the ring's SDPA calls on one layer (``att``: the rank's
    causal ``(s / cp, s)`` shape), each rated by :func:`~meshplan.compute.measured.attention_seconds`
    at its :func:`rate_lengths`, on the slower of cp ranks 0 and cp - 1 (forward plus backward:
    the calls' time is linear in the rank, so one of the two is the slowest; every layer's K/V
    all-gather holds the ranks together).

    >>> from meshplan.compute.measured import kernel_data
    >>> d = kernel_data("h100-sxm5-80gb")
    >>> a = Attention(1, 32, 8, 8192, 32768, 128)          # cp 4 at 32k: L 8,192
    >>> f, b, how = ring_seconds(d, a, 4, ("FA2",))
    >>> how.split(" (cp ")[1]            # rank 0's 3 backward calls loop over 4,096 queries: slower
    'rank 0: 1 causal 8192x8192, 3 of 4096x8192)'
    >>> round(f * 1e3, 3), round(b * 1e3, 3)   # FA2 fwd 333 causal + 3 x 370; bwd 318 + 3 x 310 (S 4096)
    (6.108, 17.623)
    """
    return max((_rank_seconds(data, att, cp, rank, prefer) for rank in sorted({0, cp - 1})),
               key=lambda t: t[0] + t[1])


def _rank_seconds(data: KernelData, att: Attention, cp: int, rank: int,
                  prefer: tuple[str, ...]) -> tuple[float, float, str]:
    """(forward s, backward s, how) of cp rank ``rank``'s calls (:func:`ring_seconds`)."""
    f = b = 0.0
    hows = []
    calls = ring_calls(cp, att.seq_q, rank)
    rated: dict = {}  # each distinct (sq, sk, causal) rated once: the search rates every cp candidate's ring
    for call in calls:
        if call not in rated:
            sq, sk, causal = call
            rated[call] = attention_seconds(data, replace(att, seq_q=sq, seq_kv=sk), causal, prefer,
                                            lengths=rate_lengths(sq, sk))
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
