"""Transformer Engine's p2p ring attention (Megatron-LM's ``--cp-comm-type p2p``,
:func:`meshplan.compute.ring_attention.te_ring`) on one cp rank, step by step: each step's
attention call at its own shape and the correction kernels TE runs around it, as (beside, after)
seconds per step (:class:`TeRank`), which the rank timeline runs beside the step's send and after
its wait (:func:`meshplan.schedule.ring_timeline.p2p_steps`).

Source: NVIDIA/TransformerEngine d0067d0,
``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py``,
``AttnFuncWithCPAndKVP2P``, bf16 (fp8 off), causal, ``bshd``/``sbhd``, load-balanced halves.
Sizes on the rank (``L = s / cp`` tokens): ``rows = b x q heads x L`` (the fp32 ``softmax_lse``
rows), ``n_o = rows x d_v`` (the output), ``n_dq = rows x d_qk`` (dQ), ``n_k``, ``n_v``: K and V at
the KV heads (TE takes them as they are, no GQA repeat).

Forward (lines 1698-2030): step ``i`` issues the K/V send, then its call: ``i == 0`` the causal
``L x L`` diagonal, ``i <= rank`` ``L x L/2``, else ``L/2 x L``
(:func:`meshplan.compute.ring_attention.ring_calls`). At iteration ``i >= 1`` the softmax_lse
correction of step ``i - 1`` runs on the other flash stream (lines 1913-1968): ``i = 1`` a clone
(8 B a row), later ``flash_attn_fwd_softmax_lse_correction`` (read both, write one: 12 B a row) at
``i - 1 <= rank``, its second-half form on half the rows (6 B a row) above; the last one (step
``cp - 1``) after the loop's last call. After the loop (lines 1980-2025), the output corrections:
``flash_attn_fwd_out_correction_init`` (read step 0's bf16 output, write ``out``, read two lse rows:
``4 n_o + 8 rows``), ``flash_attn_fwd_out_correction`` at ``i <= rank`` (read ``out`` and the step's
output, write ``out``: ``6 n_o + 8 rows``), the second-half form above (``3 n_o + 4 rows``);
``out`` is bf16 (``.to(out_init_step.dtype)``), so ``out.to(fwd_nominal_dtype)`` copies nothing.
Each function is ``@jit_fuser`` (``transformer_engine/pytorch/jit.py`` lines 40-42: ``torch.compile``
on torch 2): one kernel. Before step 0 ``torch.cat((k.view(-1), v.view(-1)))`` (line 1690): ``4 (n_k + n_v)``.

Backward (lines 2460-2811): the steps reversed, ``j = cp - 1 - rank``: step ``i < j`` the ``L/2 x
L`` call, ``j <= i < cp - 1`` ``L x L/2``, ``i = cp - 1`` the diagonal; at each the send is issued
before the call, dQ accumulated after it, then the receive waited for and the received dK/dV
(bf16, ``kv.dtype``) accumulated with the step's (eager ``copy_``/``add_``, one kernel each; an
add reads two and writes one: 6 B an element, a copy 4 B). dQ (lines 2643-2690): ``i > j`` the
whole added (``6 n_dq``); ``i == j`` copied whole at rank ``cp - 1`` (``4 n_dq``), else half
copied and half added (``2 n_dq`` + ``3 n_dq``, two kernels); ``0 < i < j`` the second half added
(``3 n_dq``), ``i = 0`` copied (``2 n_dq``). dK and dV each (lines 2721-2811): ``i = cp - 1`` added
(``6 n``), at rank 0 half added and half copied (``3 n`` + ``2 n``); ``j <= i < cp - 1`` the first
half added (``3 n``), copied at ``i = 0`` (rank ``cp - 1``: ``2 n``); ``0 < i < j`` added
(``6 n``); ``i = 0`` copied (``4 n``). Before the loop ``p2p_comm_buffers[0][0].copy_(kv)`` (line
2401): ``4 (n_k + n_v)``.

Streams (forward only; the backward, lines 2460-2811, runs on the current stream alone). TE's
forward alternates two flash streams, ``flash_attn_streams = [torch.cuda.current_stream(),
cp_stream]`` (line 1678; ``cp_stream`` Megatron-LM's ``TEDotProductAttention.cp_stream``, one
``torch.cuda.Stream()``, NVIDIA/Megatron-LM d98e8a6 ``megatron/core/extensions/transformer_engine.py``
lines 2133-2139): iteration ``i`` enters ``flash_attn_streams[i % 2]`` (line 1700), makes it wait
for the previous K/V receive (``req.wait()``, lines 1702-1703), issues the next send/recv from it
(lines 1705-1715) and runs call ``i`` on it; then the softmax_lse correction of step ``i - 1`` runs
on ``flash_attn_streams[(i - 1) % 2]`` (line 1919), the stream of call ``i - 1``, after the
previous correction (``wait_event(fwd_results_correction_done)``, lines 1916-1917, recorded at
1968): beside call ``i``, on the other stream (:func:`side_stream`). The last one (``i = cp``)
follows the last call on its own stream and the current stream waits for ``cp_stream`` (line
1970) before the output corrections: those run in series after the loop. A send issued at
iteration ``i`` waits, by stream order (pytorch/pytorch
``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp``, commit not pinned: ``collective`` and
``pointToPoint`` make the NCCL stream wait for the issuing stream, ``syncStream``;
``WorkNCCL::wait`` blocks the calling stream on the work's end event, ``synchronizeStream``), for the
previous send's receive and for call ``i - 2`` and its correction, not for call ``i - 1``
(:func:`meshplan.schedule.ring_timeline.p2p_steps`). Each correction kernel is timed by
:func:`meshplan.compute.kernel_time.memory_op_seconds` (the catalog's Triad bandwidth, never below
the issue floor), each call floored by :func:`~meshplan.compute.kernel_time.issue_floor`; a
forward step's corrections count only what they add to its call (:func:`side_stream`). The rank
counted is the one whose calls and kernels take longest (every layer's ring holds the ranks
together), the lowest on a tie.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Optional

from meshplan.compute.kernel_fragment import kernel_data
from meshplan.compute.kernel_time import issue_floor, memory_op_seconds
from meshplan.compute.measured import KernelData
from meshplan.compute.ops import Op, Workload
from meshplan.compute.ring_attention import rank_seconds, rated_calls, ring_calls
from meshplan.compute.shapes import Attention
from meshplan.spec.cluster import GPUSpec

#: TE's forward softmax_lse and output corrections (one op, its kernels by step).
CORRECTION = "cp p2p out correction"
#: TE's backward dQ, dK and dV accumulation (one op, its kernels by step).
GRAD_CORRECTION = "cp p2p gradient correction"
#: The K/V buffer TE fills before its ring (forward ``torch.cat``, backward ``copy_``).
KV_BUFFER = "cp p2p K/V buffer copy"

Steps = tuple[tuple[float, float], ...]


def backward_calls(cp: int, seq_local: int, rank: int) -> list[tuple[int, int, bool]]:
    """(seq_q, seq_kv, causal) of each backward step's call on cp rank ``rank`` (module docstring).

    >>> backward_calls(4, 8, 1)   # j = 2: steps 0, 1 upper, step 2 lower, step 3 the diagonal
    [(4, 8, False), (4, 8, False), (8, 4, False), (8, 8, True)]
    """
    half = seq_local // 2
    return [(half, seq_local, False)] * (cp - 1 - rank) + [(seq_local, half, False)] * rank + [
        (seq_local, seq_local, True)]


def forward_kernels(n_o: int, rows: int, cp: int, rank: int) -> list[tuple[list[int], list[int]]]:
    """Bytes of each forward correction kernel, per step as (beside the step, after it) (module docstring).

    >>> forward_kernels(10, 1, 2, 0)   # step 1: the clone; after: the half lse, init, the half output
    [([], []), ([8], [6, 48, 34])]
    """
    lse = lambda k: 8 * rows if k == 0 else (12 * rows if k <= rank else 6 * rows)
    outs = [4 * n_o + 8 * rows] + [6 * n_o + 8 * rows if k <= rank else 3 * n_o + 4 * rows for k in range(1, cp)]
    steps: list[tuple[list[int], list[int]]] = [([], [])] + [([lse(i - 1)], []) for i in range(1, cp)]
    steps[-1] = (steps[-1][0], [lse(cp - 1)] + outs)
    return steps


def backward_kernels(n_dq: int, n_k: int, n_v: int, cp: int, rank: int) -> list[tuple[list[int], list[int]]]:
    """Bytes of each backward accumulation kernel, per step as (dQ's, before the wait; dK's and
    dV's, after it) (module docstring).

    >>> backward_kernels(10, 1, 1, 2, 0)   # j = 1: step 0 dQ half copied, dK/dV copied; step 1 (diagonal, rank 0)
    [([20], [4, 4]), ([20, 30], [3, 2, 3, 2])]
    """
    j = cp - 1 - rank
    out = []
    for i in range(cp):
        if i > j:
            dq = [6 * n_dq]
        elif i == j:
            dq = [4 * n_dq] if rank == cp - 1 else [2 * n_dq, 3 * n_dq]
        else:
            dq = [3 * n_dq] if i > 0 else [2 * n_dq]
        if i == cp - 1:
            each = lambda n: [3 * n, 2 * n] if rank == 0 else [6 * n]
        elif i >= j:
            each = lambda n: [2 * n] if i == 0 and rank == cp - 1 else [3 * n]
        else:
            each = lambda n: [6 * n] if i > 0 else [4 * n]
        out.append((dq, each(n_k) + each(n_v)))
    return out


@dataclass(frozen=True)
class TeRank:
    """One cp rank's TE ring on one layer: ``rank``; ``calls``: (forward, backward) seconds of
    each step's call (each floored), None where the calls are not rated per step (no published
    rates: the whole attention op is spread over the steps); ``how``; ``forward``, ``backward``:
    each step's correction kernels as (beside, after) seconds, the forward's beside part what
    they add to the step's call on the other flash stream (:func:`side_stream`); ``bytes``: their (forward,
    backward) bytes; ``kv_buffer``: the K/V buffer copy's bytes (each pass)."""

    rank: int
    calls: Optional[tuple[tuple[float, ...], tuple[float, ...]]]
    how: str
    forward: Steps
    backward: Steps
    bytes: tuple[int, int]
    kv_buffer: int


def _timed(seconds, kernels: list[tuple[list[int], list[int]]]) -> Steps:
    """Each step's (beside, after) seconds of ``kernels``' bytes, ``seconds(bytes)`` a kernel."""
    t = lambda ks: sum(seconds(b) for b in ks)
    return tuple((t(a), t(b)) for a, b in kernels)


def side_stream(gpu: GPUSpec, beside: list[int], call: float) -> float:
    """Seconds the softmax_lse corrections ``beside`` (bytes of each kernel) add to a forward step
    whose call takes ``call`` seconds (issue-floored): TE runs them on the other flash stream, beside
    the call (module docstring), so the step takes the longest of the call, the corrections' own
    seconds (their bytes at the catalog's Triad; the datasheet bandwidth without catalog data) and
    the host's issue of the step's kernels (the call and each correction at the issue floor,
    :func:`~meshplan.compute.kernel_time.issue_floor`), less the call.

    >>> from meshplan import catalog
    >>> h100 = catalog.gpu("h100-sxm5-80gb")
    >>> side_stream(h100, [786432], 54.976e-6)     # 0.79 MB beside a 55 us call: hidden
    0.0
    >>> round(side_stream(h100, [786432], 4.7e-6) * 1e6, 2)   # beside a floored call: the host issues two kernels
    4.7
    >>> side_stream(h100, [], 4.7e-6)
    0.0
    """
    if not beside:
        return 0.0
    data = kernel_data(gpu)
    bw = gpu.hbm_bandwidth_bytes_per_s if data is None else data.stream_bytes_per_s
    host = issue_floor(gpu, 0.0) * (1 + len(beside))  # 0 without catalog data
    return max(call, sum(beside) / bw, host) - call


def te_rank(gpu: GPUSpec, att: Attention, w: Workload, data: Optional[KernelData] = None,
            spread: float = 0.0) -> TeRank:
    """The slowest cp rank of ``w.cp`` (module docstring): its calls rated from ``data``'s
    published rates (:func:`meshplan.compute.ring_attention.rated_calls`), or none without them
    (``spread``: the forward call's seconds then, an equal ``1/cp`` a step beside which the lse
    corrections run, :func:`side_stream`), and its correction kernels. ``att``: the rank's causal
    ``(s / cp, s)`` shape.

    Memoised per shape (:func:`_slowest`) where ``data`` is None or ``gpu``'s own kernel data
    (:func:`meshplan.compute.kernel_fragment.kernel_data`, as :func:`meshplan.compute.attention.flash_ops`
    passes it): the result is a pure function of ``gpu``'s name, laid-over kernel files and HBM
    bandwidth (all that :func:`~meshplan.compute.kernel_time.memory_op_seconds`,
    :func:`~meshplan.compute.kernel_time.issue_floor` and :func:`side_stream` read), ``att``,
    ``w.cp``, ``w.attention_kernels`` and ``spread``; the search rates the same shapes for every
    candidate that shares them. Other ``data`` is rated uncached."""
    if data is not None and data is not kernel_data(gpu):
        return _slowest_rank(gpu, att, w.cp, w.attention_kernels, data, spread)
    return _slowest(_Gpu(gpu), att, w.cp, w.attention_kernels, data is not None, spread)


class _Gpu:
    """``gpu`` keyed by what :func:`_slowest_rank` reads of it (name, laid-over kernel files, HBM
    bandwidth): :class:`~meshplan.spec.cluster.GPUSpec` holds dicts and is not hashable."""

    __slots__ = ("gpu", "key")

    def __init__(self, gpu: GPUSpec) -> None:
        self.gpu, self.key = gpu, (gpu.name, gpu.kernels, gpu.hbm_bandwidth_tb_per_s)

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Gpu) and other.key == self.key


@lru_cache(maxsize=4096)
def _slowest(g: _Gpu, att: Attention, cp: int, prefer: tuple[str, ...], rated: bool,
             spread: float) -> TeRank:
    """:func:`_slowest_rank` with ``g``'s kernel data (``rated``) or none; memoised (a pure
    function of its arguments: a cache, not state)."""
    return _slowest_rank(g.gpu, att, cp, prefer, kernel_data(g.gpu) if rated else None, spread)


#: Relative tie tolerance of the slowest rank (a tie within rounding keeps the lower rank).
TIE = 1e-9
#: Relative gap between the ranks :func:`_slowest_rank` rates exactly and the rest
#: (:func:`_rank_totals`' sums differ from the exact ones by rounding alone, ~cp x 1e-16).
GAP = 1e-7
#: Ranks rated exactly where no gap separates them (every rank below it).
NEAR_MAX = 64


def _slowest_rank(gpu: GPUSpec, att: Attention, cp: int, prefer: tuple[str, ...],
                  data: Optional[KernelData], spread: float = 0.0) -> TeRank:
    """:func:`te_rank` uncached: the longest rank of ``cp``, the lowest on a tie (within
    :data:`TIE`, in rank order).

    Rating one rank builds its ``cp`` steps, so rating every rank costs ``cp^2`` (cp 2,048 at
    4,096 tokens: minutes of CPU a shape, the DeepSeek-V3 example's search). Each rank's total is
    first summed from its few kinds of step times their counts (:func:`_rank_totals`, ``O(1)`` a
    rank); only the ranks within :data:`GAP` of the largest are rated step by step, where every
    other rank lies more than :data:`GAP` below the least of them (a rank that far below can
    neither replace one of them as the running slowest nor be kept over one: the result is the
    same as rating every rank); without such a gap every rank is rated (``tests/test_te_ring_fast.py``
    checks the two against each other)."""
    L = att.seq_q
    rows = att.batch * att.q_heads * L
    kv_rows = att.batch * att.kv_heads * L
    n_o, n_dq, n_k, n_v = rows * att.d_v, rows * att.head_dim, kv_rows * att.head_dim, kv_rows * att.d_v
    rated = rated_calls(data, att, cp, prefer) if data is not None else None
    # the ranks' kernels come in a few sizes (forward_kernels, backward_kernels), their calls in
    # three shapes (rated_calls): each timed and floored once
    seconds = lru_cache(maxsize=None)(lambda nbytes: memory_op_seconds(gpu, nbytes))
    floored = {c: (issue_floor(gpu, f), issue_floor(gpu, b)) for c, (f, b, _) in (rated or {}).items()}
    sizes = (n_o, rows, n_dq, n_k, n_v)
    ranks = _near_slowest(gpu, cp, L, sizes, floored if rated is not None else None, spread, seconds)
    best: Optional[tuple[float, TeRank]] = None
    for r in ranks:
        t, one = _rated_rank(gpu, cp, L, r, sizes, floored if rated is not None else None, spread, seconds)
        if best is None or t > best[0] * (1 + TIE):  # a tie within rounding keeps the lower rank
            best = (t, one)
    assert best is not None
    # the chosen rank's words (rank_seconds) alone
    return replace(best[1], how=rank_seconds(rated, cp, L, best[1].rank)[2]) if rated is not None else best[1]


def _rated_rank(gpu: GPUSpec, cp: int, L: int, r: int, sizes: tuple, floored: Optional[dict], spread: float,
                seconds) -> tuple[float, TeRank]:
    """(total seconds, :class:`TeRank`) of cp rank ``r``, step by step; ``sizes`` = (n_o, rows,
    n_dq, n_k, n_v); ``floored``: each call shape's floored (forward, backward) seconds, None
    unrated (the forward's ``spread`` over the steps)."""
    n_o, rows, n_dq, n_k, n_v = sizes
    fk, bk = forward_kernels(n_o, rows, cp, r), backward_kernels(n_dq, n_k, n_v, cp, r)
    calls = None
    if floored is not None:
        calls = (tuple(floored[c][0] for c in ring_calls(cp, L, r)),
                 tuple(floored[c][1] for c in backward_calls(cp, L, r)))
    fwd_calls = calls[0] if calls is not None else (spread / cp,) * cp
    forward = tuple((side_stream(gpu, a, c), sum(seconds(x) for x in b)) for (a, b), c in zip(fk, fwd_calls))
    one = TeRank(r, calls, "", forward, _timed(seconds, bk),
                 (sum(sum(a) + sum(b) for a, b in fk), sum(sum(a) + sum(b) for a, b in bk)), 4 * (n_k + n_v))
    return sum(map(sum, one.calls or ())) + sum(a + b for a, b in one.forward + one.backward), one


def _near_slowest(gpu: GPUSpec, cp: int, L: int, sizes: tuple, floored: Optional[dict], spread: float,
                  seconds) -> list[int]:
    """The ranks :func:`_slowest_rank` rates step by step (its docstring), in rank order."""
    if cp <= NEAR_MAX:
        return list(range(cp))
    totals = [_rank_totals(gpu, cp, L, r, sizes, floored, spread, seconds) for r in range(cp)]
    top = max(totals)
    near = [r for r, t in enumerate(totals) if t >= top * (1 - GAP)]
    least = min(totals[r] for r in near)
    below = max((t for r, t in enumerate(totals) if t < top * (1 - GAP)), default=0.0)
    if len(near) > NEAR_MAX or below >= least * (1 - GAP):
        return list(range(cp))
    return near


def _rank_totals(gpu: GPUSpec, cp: int, L: int, r: int, sizes: tuple, floored: Optional[dict], spread: float,
                 seconds) -> float:
    """What :func:`_rated_rank` sums for rank ``r`` (``cp`` >= 2), from its kinds of step times their
    counts (:func:`forward_kernels`, :func:`backward_kernels`, :func:`~meshplan.compute.ring_attention.ring_calls`,
    :func:`backward_calls`): equal to it up to rounding."""
    n_o, rows, n_dq, n_k, n_v = sizes
    half, j = L // 2, cp - 1 - r
    diag, low, up = (L, L, True), (L, half, False), (half, L, False)
    f = (lambda c: floored[c][0]) if floored is not None else (lambda c: spread / cp)
    b = (lambda c: floored[c][1]) if floored is not None else (lambda c: 0.0)
    calls = 0.0 if floored is None else f(diag) + r * f(low) + j * f(up) + j * b(up) + r * b(low) + b(diag)
    side = lambda lse, c: side_stream(gpu, [lse], f(c))
    # forward: step 1 the clone (8 B a row) beside its call; steps 2..r 12 B beside L x L/2; step r + 1
    # (r >= 1) 12 B beside L/2 x L; steps r + 2..cp - 1 6 B beside L/2 x L
    fwd = side(8 * rows, low if r >= 1 else up) + max(0, r - 1) * side(12 * rows, low)
    fwd += (side(12 * rows, up) if 1 <= r <= cp - 2 else 0.0) + max(0, cp - 2 - r) * side(6 * rows, up)
    last = 12 * rows if r == cp - 1 else 6 * rows
    fwd += seconds(last) + seconds(4 * n_o + 8 * rows) + r * seconds(6 * n_o + 8 * rows) + j * seconds(3 * n_o + 4 * rows)
    # backward, by step i against j: dQ, then dK and dV
    dq = r * seconds(6 * n_dq) + (seconds(4 * n_dq) if r == cp - 1 else seconds(2 * n_dq) + seconds(3 * n_dq))
    dq += (max(0, j - 1) * seconds(3 * n_dq) + seconds(2 * n_dq)) if j >= 1 else 0.0
    kv = 0.0
    for n in (n_k, n_v):
        kv += seconds(3 * n) + seconds(2 * n) if r == 0 else seconds(6 * n)   # i = cp - 1
        mid = cp - 1 - j   # j <= i < cp - 1
        if mid:
            kv += (seconds(2 * n) + (mid - 1) * seconds(3 * n)) if (j == 0 and r == cp - 1) else mid * seconds(3 * n)
        if j >= 1:   # i < j
            kv += seconds(4 * n) + (j - 1) * seconds(6 * n)
    return calls + fwd + dq + kv


def with_steps(ops: list[Op], te: TeRank) -> list[Op]:
    """``ops`` (the attention's, :func:`meshplan.compute.attention.flash_ops`) with the attention
    calls' per-step seconds attached (the forward's to its replay too), where ``te`` rates them."""
    if te.calls is None:
        return ops
    fwd, bwd = (tuple((c, 0.0) for c in calls) for calls in te.calls)
    return [replace(o, steps=bwd if o.phase == "backward_input" and not o.recompute else fwd)
            if o.kind == "attention" else o for o in ops]


def kernel_ops(gpu: GPUSpec, te: TeRank) -> list[Op]:
    """TE's correction kernels (forward, backward; by step) and its K/V buffer copies as
    memory-bound ops of the attention block, ``te``'s rank named."""
    out = []
    for name, phase, steps, nbytes in ((CORRECTION, "forward", te.forward, te.bytes[0]),
                                       (GRAD_CORRECTION, "backward_input", te.backward, te.bytes[1])):
        out.append(Op(name, "attn", phase, "memory", sum(a + b for a, b in steps), size_bytes=nbytes, steps=steps,
                      note=f"cp rank {te.rank}: {nbytes / 1e6:.1f} MB over {len(steps)} ring steps (TE's corrections, "
                           f"each kernel at Triad, floored" + (
                               "; the lse corrections beside the next call, on the other flash stream: what they "
                               "add to it)" if phase == "forward" else ")")))
    for phase in ("forward", "backward_input"):
        out.append(Op(KV_BUFFER, "attn", phase, "memory", memory_op_seconds(gpu, te.kv_buffer),
                      size_bytes=te.kv_buffer, note=f"{te.kv_buffer / 1e6:.1f} MB (TE's K/V ring buffer)"))
    return out
