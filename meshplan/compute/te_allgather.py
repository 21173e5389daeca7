"""Transformer Engine's all-gather context parallelism (Megatron-LM's ``--cp-comm-type
all_gather``) on one cp rank: its two attention calls per layer, each rated at its own shape,
and how the two run together on the GPU (:func:`te_allgather_rank`).

Source: NVIDIA/TransformerEngine d0067d0,
``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py``,
``AttnFuncWithCPAndKVAllGather``, ``bshd``/``sbhd``, causal, bf16. The rank's ``L = s / cp``
tokens are its two load-balanced chunks of ``L / 2``, ``local_seq_chunk_ids = [rank, 2 cp - rank -
1]`` (line 3254; backward 3845). After the K/V all-gather and its reorder into sequence order
(lines 3214-3233), call ``i`` (lines 3339-3490) takes chunk ``c_i``'s ``L / 2`` queries against
the keys ``[0, (c_i + 1) L / 2)`` (``get_kv_seq_info_after_all_gather``, lines 2976-3010: with
``window_size (-1, 0)`` for causal, ``seq_start_idx = 0``, ``seq_end_idx = (c + 1) x
max_seqlen_kv``, the chunk's length), causal aligned bottom-right (``attn_mask_type +
"_bottom_right"`` for FusedAttention, line 3154; flash-attn's causal mask is bottom-right when
``seqlen_q != seqlen_k``). So call 0 is ``L/2 x (rank + 1) L/2``, call 1 ``L/2 x (2 cp - rank)
L/2``; the backward (lines 3846-3990) the same two calls' gradients.

Work: a bottom-right causal call of ``q <= k`` queries and keys covers ``q k - q^2 / 2``
query-key pairs (:func:`causal_pairs`, the half-square convention of
:meth:`meshplan.compute.shapes.Attention.flops`), the two together ``L s / 2``, the one ``(L,
s)`` causal call this module replaces. Each is rated as the ring's calls are
(:func:`meshplan.compute.ring_attention.rate_lengths`): a catalog row is a causal square, whose
forward blocks (one per 128 queries) loop over ``S / 2`` keys on average and whose backward
blocks (one per 128 keys) over ``S / 2`` queries; a call is read at the square whose average
loop is its own, ``2 pairs / q`` forward (``2 k - q``) and ``2 pairs / k`` backward (``2 q - q^2
/ k``), its own queries and keys the parallel dimension (:func:`call_lengths`), and its seconds
are its pairs at that rate.

Streams (:func:`together`): TE runs call 0 on the current stream and call 1 on ``cp_stream``
(``flash_attn_streams = [torch.cuda.current_stream(), cp_stream]``, line 3252, "to resolve
wave quantization issue of Flash Attn in each step"; ``cp_stream`` waits for the gather and
reorder first, line 3238). With FlashAttention 3 the second call waits for the first
(``flash_attn_streams[i].wait_stream(flash_attn_streams[i - 1])`` when ``use_flash_attn_3``,
lines 3341-3345, backward 3847-3853: "FA3 uses internal per-call workspace"): the two run in
series. Otherwise (FlashAttention 2, FusedAttention) they run at once and share the SMs: the
pair takes its summed SM time over the waves of the two grids together, the shape model's
(:func:`meshplan.compute.attention_points.flash_waves`: the fraction of the SMs a grid's waves
keep busy; each call's own fraction is already in its rated time), never less than the longer
call: ``max(t_0, t_1, (t_0 f_0 + t_1 f_1) / f_01)``. The model takes the two grids' blocks as
equally long (they are not: call 1's loop is longer), so it bounds the gain from the tail of
the first grid's last wave. Which flash kernel runs is the catalog's rated row's (the
framework's preference, then the GPU's: FA3 on H100, FA2 on A100).

The output copies (``out_f16[:, i - 1].copy_``), the per-call ``contiguous`` of Q and of the
K/V ranges and the backward's dK/dV ``add_`` are not counted here (nor were they before).
The rank counted is the one whose calls take longest (fwd + bwd; every layer's K/V all-gather
holds the cp ranks together), the lowest on a tie.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from meshplan.compute.attention_points import flash_waves
from meshplan.compute.kernel_time import issue_floor
from meshplan.compute.measured import KernelData, attention_kernel, attention_seconds
from meshplan.compute.ops import Workload
from meshplan.compute.shapes import Attention
from meshplan.spec.cluster import GPUSpec


def applies(w: Workload) -> bool:
    """Whether ``w`` runs Transformer Engine's all-gather CP: cp > 1, the fused attention,
    Megatron-LM (``w.framework``) without TE's p2p ring (``--cp-comm-type all_gather``,
    ``training.cp_attention = "allgather"``) and without torch's ring."""
    return (w.cp > 1 and w.flash and w.framework == "megatron" and not w.te_ring_attention
            and not w.torch_ring_attention)


def calls(cp: int, seq_local: int, rank: int) -> list[tuple[int, int]]:
    """(queries, keys) of cp rank ``rank``'s two bottom-right causal calls per layer, ``seq_local``
    = ``L`` (even; module docstring).

    >>> calls(4, 8, 1)   # chunks 1 and 6 of 8: keys [0, 8) and [0, 28)
    [(4, 8), (4, 28)]
    >>> sum(q * k - q * q / 2 for q, k in calls(4, 8, 1)) == 8 * 32 / 2   # together the causal (L, s)
    True
    """
    half = seq_local // 2
    return [(half, (rank + 1) * half), (half, (2 * cp - rank) * half)]


def causal_pairs(q: int, k: int) -> float:
    """Query-key pairs of a bottom-right causal call of ``q <= k`` (half the diagonal square's).

    >>> causal_pairs(4, 4), causal_pairs(4, 12)
    (8.0, 40.0)
    """
    return q * k - q * q / 2


def call_lengths(q: int, k: int) -> tuple[int, int]:
    """(forward, backward) lengths at which the catalog's causal square rows are read for a
    bottom-right causal ``q x k`` call: the squares whose average loop is the call's,
    ``2 pairs / q`` and ``2 pairs / k`` (module docstring).

    >>> call_lengths(4096, 4096), call_lengths(4096, 16384)   # the square; 4,096 queries under 16,384 keys
    ((4096, 4096), (28672, 7168))
    """
    p = causal_pairs(q, k)
    return round(2 * p / q), round(2 * p / k)


def rated_call(data: KernelData, att: Attention, q: int, k: int,
               prefer: tuple[str, ...]) -> tuple[float, float, str]:
    """(forward s, backward s, how) of one bottom-right causal ``q x k`` call of ``att``'s heads:
    its pairs at the rate of the square row at :func:`call_lengths`
    (:func:`~meshplan.compute.measured.attention_seconds`, which times ``q k / 2`` pairs)."""
    f, b, how = attention_seconds(data, replace(att, seq_q=q, seq_kv=k), True, prefer, lengths=call_lengths(q, k))
    scale = causal_pairs(q, k) / (q * k / 2)
    return f * scale, b * scale, how


def together(sms: int, heads: int, times: tuple[float, float], pars: tuple[int, int], serial: bool) -> float:
    """Seconds of the two calls of one pass, ``times`` each alone (issue-floored), ``pars`` their
    parallel rows (forward: queries; backward: keys), ``heads`` = batch x q heads: in series
    (``serial``: FA3) or on two streams at once (module docstring).

    >>> together(132, 8, (1.0, 3.0), (4096, 4096), True)
    4.0
    >>> together(132, 8, (1.0, 3.0), (512, 512), False)   # 32 + 32 blocks of 132: the second fills the first's wave
    3.0
    >>> round(together(132, 8, (1.0, 1.0), (512, 512), False), 3)   # (0.242 + 0.242) / 0.485
    1.0
    >>> round(together(132, 8, (1.0, 1.0), (4096, 4096), False), 3)   # 256 + 256 blocks: 2 + 2 waves, no gain
    2.0
    """
    if serial:
        return times[0] + times[1]
    own = [flash_waves(sms, heads, p) for p in pars]
    both = flash_waves(sms, heads, pars[0] + pars[1])  # ceil per call differs by at most a block row
    return max(max(times), (times[0] * own[0] + times[1] * own[1]) / both)


@dataclass(frozen=True)
class AllGatherRank:
    """One cp rank's two TE all-gather calls on one layer: ``rank``; ``calls``: their (queries,
    keys); ``forward``/``backward``: each call's seconds alone (issue-floored); ``serial``: the
    kernel runs them in series (FA3); ``seconds``: (forward, backward) of the pair on the GPU
    (:func:`together`); ``how``: the rates read."""

    rank: int
    calls: tuple[tuple[int, int], tuple[int, int]]
    forward: tuple[float, float]
    backward: tuple[float, float]
    serial: bool
    seconds: tuple[float, float]
    how: str


def te_allgather_rank(gpu: GPUSpec, att: Attention, w: Workload, data: KernelData) -> AllGatherRank:
    """The slowest cp rank of ``w.cp`` (module docstring), its calls rated from ``data``'s
    published rates. ``att``: the rank's causal ``(s / cp, s)`` shape (its heads and head dims).

    >>> from meshplan import catalog
    >>> from meshplan.compute.measured import kernel_data
    >>> h100 = catalog.gpu("h100-sxm5-80gb")
    >>> a = Attention(1, 8, 1, 8192, 65536, 128)             # cp 8 at 64k: L 8,192, chunks of 4,096
    >>> r = te_allgather_rank(h100, a, Workload(seq_len=65536, cp=8, framework="megatron"),
    ...                       kernel_data("h100-sxm5-80gb"))
    >>> r.rank, r.calls, r.serial                            # FA3: in series
    (0, ((4096, 4096), (4096, 65536)), True)
    """
    serial = attention_kernel(data, att.head_dim, w.attention_kernels) == "FA3"
    heads = att.batch * att.q_heads
    rated: dict = {}
    best: Optional[tuple[float, AllGatherRank]] = None
    for r in range(w.cp):
        cs = calls(w.cp, att.seq_q, r)
        for c in cs:
            if c not in rated:
                rated[c] = rated_call(data, att, c[0], c[1], w.attention_kernels)
        fwd = (issue_floor(gpu, rated[cs[0]][0]), issue_floor(gpu, rated[cs[1]][0]))
        bwd = (issue_floor(gpu, rated[cs[0]][1]), issue_floor(gpu, rated[cs[1]][1]))
        secs = (together(gpu.sms, heads, fwd, (cs[0][0], cs[1][0]), serial),
                together(gpu.sms, heads, bwd, (cs[0][1], cs[1][1]), serial))
        how = (f"{rated[cs[0]][2]}; the second: {rated[cs[1]][2]} (TE all-gather CP rank {r}: causal "
               f"{cs[0][0]}x{cs[0][1]} and {cs[1][0]}x{cs[1][1]}, {'in series (FA3)' if serial else 'on two streams at once'})")
        one = AllGatherRank(r, (cs[0], cs[1]), fwd, bwd, serial, secs, how)
        t = sum(secs)
        if best is None or t > best[0] * (1 + 1e-9):  # a tie within rounding keeps the lower rank
            best = (t, one)
    assert best is not None
    return best[1]
