"""torch's window of unsharded stages under its multi-stage pipeline schedules: which ops of a
rank find their chunk evicted (FSDP ``RESHARD`` by the schedule) and where it is unsharded
(``UNSHARD``: an FSDP all-gather of every unit of the chunk).

Source: torch 2.13 ``torch/distributed/pipelining/schedules.py``, ``_add_unshard_reshard``
(lines 1285-1365), which ``_PipelineScheduleRuntime._load_actions`` applies to every rank's
compute-only order (line 2317; ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
ScheduleZBVZeroBubble, ScheduleDualPipeV) with ``max_active_stages = 3``. Before each compute
action ``i`` it takes the first 3 distinct stages of the actions ``i..`` (``next_stage_indices``),
RESHARDs the active stages not among them and UNSHARDs those among them not active; after the
last action it RESHARDs all. The runtime (lines 2489-2515) runs UNSHARD as ``unshard(async_op=
True)`` of every ``FSDPModule`` of the stage (its all-gathers) and RESHARD as ``reshard()`` (no
communication).

After its actions before op ``k`` the active stages are exactly the first 3 distinct chunks of
ops ``k..`` (:func:`unsharded`, the one rule read by the memory timeline, the step timeline and the
search's memory bound): a chunk is held from its UNSHARD to its RESHARD (:func:`held_spans`).
So between two consecutive ops of chunk ``c`` (positions ``a < b`` in the rank's order) the chunk
is evicted exactly when the ops strictly between hold ``window`` or more distinct other chunks
(the window at ``a + 1`` then misses ``c``, and it can only miss it more later), and it is then
unsharded again before ``b``: one more all-gather of the chunk, counted on op ``b`` (its UNSHARD
is issued earlier, :func:`unshard_positions`, where the timeline issues its all-gathers:
:func:`regather_spans`, :mod:`meshplan.schedule.window_unshard`; where the memory timeline allocates
its all-gather outputs: :func:`unshards_before`). A chunk's first op always finds it sharded (the
step's first UNSHARD). With ``v <= window`` local stages nothing is ever evicted: ZB-V and
DualPipeV hold 2 stages per rank, so only interleaved 1F1B at vpp >= 4 evicts.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from meshplan.pipeline.registry import get

#: torch 2.13 ``_add_unshard_reshard``'s ``max_active_stages`` default, the value
#: ``_PipelineScheduleRuntime`` lowers with (schedules.py:1287, 2317).
TORCH_WINDOW = 3


def pipeline_window(framework: str, pp: int) -> int:
    """Local stages torch's pipeline runtime keeps unsharded (:data:`TORCH_WINDOW`) under
    ``training.framework = "torch"`` with pp > 1; 0 (no window) otherwise: Megatron-LM's
    interleaved schedule and pp 1 evict nothing."""
    return TORCH_WINDOW if framework == "torch" and pp > 1 else 0


def unshards_first(schedule, window: int) -> bool:
    """Whether torch UNSHARDs each chunk before its first pass (:func:`unshard_spans`): a window
    (:func:`pipeline_window`, torch with pp > 1) and a multi-stage schedule, which torch 2.13 runs
    on ``_PipelineScheduleRuntime`` and lowers with ``_add_unshard_reshard`` (interleaved 1F1B,
    ZB-H1, ZB-V, DualPipeV); the single-stage ones (GPipe, 1F1B: ``PipelineScheduleSingle``,
    ``torch_waits``) have no UNSHARD action, their passes gather in FSDP2's hooks.

    >>> unshards_first("interleaved_1f1b", 3), unshards_first("1f1b", 3), unshards_first("interleaved_1f1b", 0)
    (True, False, False)
    """
    return bool(window) and not get(schedule).torch_waits


def evicted(chunk: Sequence[int] | np.ndarray, window: int = TORCH_WINDOW) -> np.ndarray:
    """(n,) bool per op of one rank's order (``chunk``: (n,) local chunk of each compute op, F,
    B, I and W alike, in order): True where the schedule resharded the op's chunk since its
    previous op (module docstring: ``window`` or more distinct other chunks between them); False
    on a chunk's first op; all False for ``window`` 0 (no window). Vectorised: ``nxt[c, j]``, the first position >= j holding chunk c,
    counts for each op the other chunks that occur between its chunk's previous op and it;
    O(v n) memory. Equal to the ops :func:`held_spans` gives as ``b`` past a chunk's first."""
    ch = np.asarray(chunk, dtype=np.int64)
    n = len(ch)
    if n == 0:
        return np.zeros(0, dtype=bool)
    v = int(ch.max()) + 1
    if window <= 0 or v <= window:  # no window (0), or it holds every chunk
        return np.zeros(n, dtype=bool)
    idx = np.arange(n)
    nxt = _next_of(ch, v)
    prev = _previous_same(ch)
    has = prev >= 0
    start = np.where(has, prev + 1, 0)
    occurs = nxt[:, start] < idx[None, :]  # (v, n): chunk c' occurs strictly between prev and the op
    occurs[ch, idx] = False
    return has & (occurs.sum(axis=0) >= window)


def _previous_same(ch: np.ndarray) -> np.ndarray:
    """(n,) position of the previous op of the same chunk, -1 for a chunk's first op."""
    order = np.argsort(ch, kind="stable")
    prev = np.full(len(ch), -1, dtype=np.int64)
    same = ch[order][1:] == ch[order][:-1]
    prev[order[1:][same]] = order[:-1][same]
    return prev


def released_after(chunk: Sequence[int] | np.ndarray, window: int = TORCH_WINDOW) -> np.ndarray:
    """(n,) bool: the ops after which the schedule reshards their chunk (RESHARD before the next
    op: the window from op ``a + 1`` misses the chunk), i.e. the previous op of the chunk of each
    :func:`evicted` op. A chunk so released holds its shard only until it is unsharded again."""
    ch = np.asarray(chunk, dtype=np.int64)
    out = np.zeros(len(ch), dtype=bool)
    ev = evicted(ch, window)
    out[_previous_same(ch)[ev]] = True
    return out


def unshards(chunk: Sequence[int] | np.ndarray, window: int = TORCH_WINDOW) -> np.ndarray:
    """(n,) bool: the ops before which the schedule's window has all-gathered their chunk since
    its previous op: a chunk's first op, and every op that finds it :func:`evicted`. Their sum is
    the rank's UNSHARDs per ``schedule.step`` (each one all-gather per FSDP unit of the chunk)."""
    ch = np.asarray(chunk, dtype=np.int64)
    return (_previous_same(ch) < 0) | evicted(ch, window)


def unshard_positions(chunk: Sequence[int], window: int = TORCH_WINDOW) -> list[tuple[int, int]]:
    """(op index, chunk) of each UNSHARD in the order torch issues them: before op ``i`` when the
    chunk's next op ``b`` (one :func:`unshards` flags) has fewer than ``window`` distinct other
    chunks in ``i..b-1`` (and, after an eviction, ``i`` past the op that evicted it: the
    op after the chunk's previous one). Each the first such ``i``: the UNSHARD is a prefetch up to
    ``window - 1`` distinct chunks ahead of the op that needs it."""
    ch = list(chunk)
    return sorted((i, ch[b]) for i, b in _spans(ch, window, unshards(ch, window)))


def regather_spans(chunk: Sequence[int], window: int = TORCH_WINDOW) -> list[tuple[int, int]]:
    """(i, b) of each re-gather after an eviction (the ops :func:`evicted` flags, ``b``): torch
    issues its UNSHARD before op ``i`` (:func:`unshard_positions`), i.e. right after op ``i - 1``
    (``i >= 2``: the eviction happened at ``prev + 1``); in order of ``b``. The ops ``i..b-1`` run
    while its all-gathers do (:mod:`meshplan.schedule.window_unshard`).

    >>> regather_spans([0, 0, 1, 1, 2, 2, 3, 3, 3, 3, 2, 2, 1, 1, 0, 0])  # p 2, m 2, v 4, rank 0
    [(10, 14)]
    """
    ch = list(chunk)
    return _spans(ch, window, evicted(ch, window))


def unshard_spans(chunk: Sequence[int], window: int = TORCH_WINDOW) -> list[tuple[int, int]]:
    """(i, b) of every UNSHARD (:func:`unshard_positions`): each chunk's first op ``b`` (``i`` 0 for
    the first ``window`` distinct chunks of the order, torch's UNSHARDs before op 0) and each
    :func:`regather_spans` re-gather; in order of ``b``.

    >>> unshard_spans([0, 0, 1, 1, 2, 2, 3, 3, 3, 3, 2, 2, 1, 1, 0, 0])  # chunk 3 fetched once chunk 0 leaves the window
    [(0, 0), (0, 2), (0, 4), (2, 6), (10, 14)]
    """
    ch = list(chunk)
    return _spans(ch, window, unshards(ch, window))


def _spans(ch: list[int], window: int, flags) -> list[tuple[int, int]]:
    """(i, b) per flagged op ``b``: the position of the UNSHARD torch issues for it (where the
    chunk enters :func:`unsharded`'s window), in order of ``b``; ``i = b`` with no window."""
    if window <= 0:
        return [(b, b) for b in np.flatnonzero(flags).tolist()]
    return [(i, b) for i, b, _ in held_spans(ch, window) if flags[b]]


def _next_of(ch: np.ndarray, v: int) -> np.ndarray:
    """(v, n + 1) the first position >= k holding chunk c (n where none: column n is all n)."""
    n = len(ch)
    nxt = np.full((v, n + 1), n, dtype=np.int64)
    hit = np.where(ch[None, :] == np.arange(v)[:, None], np.arange(n)[None, :], n)
    nxt[:, :n] = np.minimum.accumulate(hit[:, ::-1], axis=1)[:, ::-1]
    return nxt


def unsharded(chunk: Sequence[int] | np.ndarray, window: int = TORCH_WINDOW) -> np.ndarray:
    """(v, n + 1) bool: chunk ``c`` unsharded when op ``k`` runs (after the UNSHARDs and
    RESHARDs torch places before it; column ``n``: the step's end, none). torch's
    ``_add_unshard_reshard`` RESHARDs the active stages not among ``next_stage_indices`` (the
    first ``window`` distinct chunks of ops ``k..``) and UNSHARDs those among them not active,
    so after its actions before op ``k`` the active set is exactly those chunks. The one rule the
    memory timeline (:func:`unshards_before`, :func:`held_after`) and the step timeline
    (:func:`unshard_spans`, :mod:`meshplan.schedule.window_unshard`) read. All False for ``window``
    0 (no UNSHARD action: FSDP2's hooks gather).

    >>> unsharded([0, 0, 1, 1, 2, 2, 3, 3, 3, 3, 2, 2, 1, 1, 0, 0]).astype(int)[:, [0, 2, 10, 14]].T.tolist()
    [[1, 1, 1, 0], [0, 1, 1, 1], [1, 1, 1, 0], [1, 0, 0, 0]]
    """
    ch = np.asarray(chunk, dtype=np.int64)
    n = len(ch)
    v = int(ch.max()) + 1 if n else 0
    if window <= 0 or n == 0:
        return np.zeros((v, n + 1), dtype=bool)
    nxt = _next_of(ch, v)
    rank = np.argsort(np.argsort(nxt, axis=0, kind="stable"), axis=0, kind="stable")  # by next op, per column
    return (nxt < n) & (rank < window)


def held_spans(chunk: Sequence[int] | np.ndarray, window: int = TORCH_WINDOW) -> list[tuple[int, int, int]]:
    """(i, b, a) per UNSHARD of :func:`unsharded`: torch UNSHARDs chunk ``chunk[b]`` before op
    ``i``, op ``b >= i`` is the first to use it, and it is RESHARDed after op ``a >= b`` (before op
    ``a + 1``; after the last op, at the step's end): the ops ``i..a`` hold its unsharded
    parameters. In order of ``b``; empty for ``window`` 0.

    >>> held_spans([0, 0, 1, 1, 2, 2, 3, 3, 3, 3, 2, 2, 1, 1, 0, 0])  # p 2, m 2, v 4, rank 0
    [(0, 0, 1), (0, 2, 13), (0, 4, 11), (2, 6, 9), (10, 14, 15)]
    """
    ch = np.asarray(chunk, dtype=np.int64)
    held = unsharded(ch, window)
    if not held.size:
        return []
    nxt = _next_of(ch, held.shape[0])
    start = held & ~np.concatenate([np.zeros((held.shape[0], 1), bool), held[:, :-1]], axis=1)
    stop = held & ~np.concatenate([held[:, 1:], np.zeros((held.shape[0], 1), bool)], axis=1)
    out = []
    for c in range(held.shape[0]):
        for i, a in zip(np.flatnonzero(start[c]).tolist(), np.flatnonzero(stop[c]).tolist()):
            out.append((i, int(nxt[c, i]), a))
    return sorted(out, key=lambda s: s[1])


def unshards_before(chunk: Sequence[int] | np.ndarray, window: int = TORCH_WINDOW) -> dict[int, tuple[int, ...]]:
    """The chunks torch UNSHARDs right before op ``k`` (:func:`held_spans`), in the order it issues
    them (of their next ops'), for each ``k`` that has some: where the memory timeline allocates
    their all-gather outputs.

    >>> unshards_before([0, 0, 1, 1, 2, 2, 3, 3, 3, 3, 2, 2, 1, 1, 0, 0]), unshards_before([0, 1, 0, 1], 0)
    ({0: (0, 1, 2), 2: (3,), 10: (0,)}, {})
    """
    out: dict[int, tuple[int, ...]] = {}
    for i, b, _ in held_spans(chunk, window):
        out[i] = out.get(i, ()) + (int(chunk[b]),)
    return out


def held_after(chunk: Sequence[int] | np.ndarray, i: int, window: int = TORCH_WINDOW) -> int:
    """Distinct chunks the memory timeline holds unsharded right after op ``i`` of one rank's
    order (``chunk``: (n,) local chunk of each op) when no pass reshards after forward. With a
    window: those :func:`unsharded` both at op ``i`` and at op ``i + 1`` (torch's active set at
    op ``i`` less the chunks it RESHARDs before op ``i + 1``; none after the last op), whether used
    since their UNSHARD or prefetched for a later op (their all-gather outputs, the same bytes:
    :class:`meshplan.memory.passes.PassBuilder`). With no window (``window`` 0, FSDP2's hooks
    gather each chunk at its first op): every chunk with ops both at or before ``i`` and after it.
    Only columns ``i`` and ``i + 1`` are built: the first ``window`` distinct chunks of the ops
    from each.

    >>> order = [0, 0, 1, 1, 2, 2, 3, 3, 3, 3, 2, 2, 1, 1, 0, 0]  # p 2, m 2, v 4, rank 0
    >>> held_after(order, 8), held_after(order, 8, window=0)  # chunk 0 released after op 1
    (3, 4)
    >>> held_after(order, 0), held_after([0, 0, 1, 1], 0), held_after([0, 0, 1, 1], 0, window=0)  # 0, 1 and 2 prefetched
    (3, 2, 1)
    """
    ch = np.asarray(chunk, dtype=np.int64)
    if window <= 0:
        return len(set(ch[:i + 1].tolist()) & set(ch[i + 1:].tolist()))
    return len(_window_at(ch, i, window) & _window_at(ch, i + 1, window))


def _window_at(ch: np.ndarray, k: int, window: int) -> set[int]:
    """The first ``window`` distinct chunks of the ops ``k..`` (torch's ``next_stage_indices``):
    :func:`unsharded`'s column ``k``."""
    rest = ch[k:]
    if not len(rest):
        return set()
    vals, first = np.unique(rest, return_index=True)
    return set(vals[np.argsort(first)][:window].tolist())
