"""List scheduling of the array simulation (:mod:`meshplan.pipeline.fast`) in rounds: each round,
every stage whose next unit's inputs are there runs it, all stages at once in numpy; with
Megatron-LM 2022's blocking sends (:func:`~meshplan.pipeline.fast.rendezvous`) each stage also
waits for the peers of the call before the unit. Times bitwise equal to the reference
simulation (:func:`meshplan.pipeline.simulate.simulate`): the same additions and maxima in the
same order.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from meshplan.pipeline.orders import Flat

def _call_table(pairs, length: int, width: int, pad: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per slot of :func:`run_rounds`, the call issued after it: (the slots of its peers, shape
    (peers, slots), each column's peers sorted by slot, ``pad`` padding; the larger of its sends
    and receives, at least 1 (:func:`meshplan.pipeline.simulate.call_loads`); whether it has a
    peer)."""
    send, recv, _ = pairs
    to_slot = lambda packed: (packed // (length + 1)) * width + packed % (length + 1)  # noqa: E731
    s_, r_ = to_slot(send), to_slot(recv)
    ab = np.sort(np.concatenate([s_, r_]) * (pad + 1) + np.concatenate([r_, s_]), kind="stable")
    a, b = np.divmod(ab, pad + 1)  # by slot, then peer slot
    count = np.bincount(a, minlength=pad + 1)
    col = np.arange(len(a)) - (np.cumsum(count) - count)[a]  # rank within its slot
    table = np.full((max(int(count.max()), 1), pad + 1), pad, dtype=np.int64)
    table[col, a] = b
    loads = np.maximum(np.maximum(np.bincount(s_, minlength=pad + 1), np.bincount(r_, minlength=pad + 1)), 1)
    return table, loads.astype(float), count > 0


def _commit(cur: np.ndarray, st: np.ndarray, ok: np.ndarray, start: np.ndarray, end: np.ndarray,
            done: np.ndarray, d_dur: np.ndarray) -> int:
    """One round of the list scheduling: every stage's current slot ``cur`` starts at ``st``
    (seconds) and ends ``d_dur`` later; the stages whose dependencies are done (``ok``) keep
    it and move on (``cur`` advanced in place). Returns how many advanced; RuntimeError when
    none can (the schedule deadlocks)."""
    end[cur], start[cur], done[cur] = st + d_dur[cur], st, ok
    k = int(np.count_nonzero(ok))
    if not k:
        raise RuntimeError(f"schedule deadlocks at slots {cur.tolist()}")
    cur += ok
    return k


def _call_end(e: np.ndarray, peers: np.ndarray, end: np.ndarray, pad: int, p2p_s: "float | np.ndarray",
              has: Optional[np.ndarray] = None):
    """(end of each call posted at ``e`` with peer slots ``peers`` (columns: shape (peers, calls)),
    binding peer slot or -1): ``max(e, peer posts) + p2p_s`` (seconds: one value, or one per
    call), ``e`` for an empty call (``has``: whether each call has a peer, default from
    ``peers``). ``end[pad]`` is -inf (the padding peer never binds); the binding peer is the
    first latest one (``argmax``)."""
    if peers.shape[0] == 0:
        return e, np.full(len(e), -1)
    posts = end[peers]
    top = posts.max(axis=0) if len(posts) > 1 else posts[0]
    best = peers[-1].copy()
    for col, post in zip(peers[::-1], posts[::-1]):  # the first column holding the latest post wins
        np.copyto(best, col, where=post == top)
    bind = np.where(top > e, best, -1)  # top > e: some peer posted later than e
    has = (peers != pad).any(axis=0) if has is None else has
    return np.where(has, np.maximum(e, top) + p2p_s, e), bind


#: Rounds :func:`_rounds_async` runs between two checks for the end and for a deadlock.
ROUNDS_PER_CHECK = 64


def _rounds_async(dep: np.ndarray, d_add: np.ndarray, d_dur: np.ndarray, cur: np.ndarray, length: int):
    """:func:`run_rounds` with asynchronous sends and finite times, in fewer array operations per
    round (one round per unit position: ~10^4 rounds at pp 128 x 4,096 micro-batches, so the
    per-round overhead is the cost): a unit not done has end NaN, so ``max(stream free, dep end +
    add)`` is NaN exactly when the dependency is not done (``np.maximum`` propagates NaN) and the
    stage keeps its unit; the same additions and maxima as :func:`run_rounds` in the same order, so
    every time is bitwise equal. ``dep``, ``d_add``, ``d_dur``: per slot; ``cur``: each stage's
    first unit slot (its leading slot, end 0, just before). Returns (start, end) per slot."""
    end = np.full(len(dep), np.nan)
    end[cur - 1] = 0.0
    free = np.zeros(len(cur))  # end of each stage's previous unit

    def starts(at: np.ndarray) -> np.ndarray:
        ready = end[dep[at]]
        ready += d_add[at]
        return np.maximum(free, ready)

    return _lean_rounds(starts, end, free, d_dur, cur, length)


def _lean_rounds(starts, end: np.ndarray, free: np.ndarray, d_dur: np.ndarray, cur: np.ndarray, length: int):
    """The rounds :func:`_rounds_async` and :func:`_rounds_blocking` share: each round every
    stage's current slot starts at ``starts(cur)`` (NaN while it cannot) and ends ``d_dur`` later;
    the stages whose end is not NaN keep it (``free`` and ``end`` updated in place) and move on;
    every :data:`ROUNDS_PER_CHECK` rounds, stop when all are past their ``length`` units or
    raise RuntimeError when none moved (the schedule deadlocks). Returns (start, end) per slot."""
    start = np.zeros(len(end))
    cur, stop = cur.copy(), cur + length
    while True:
        before = cur.copy()
        for _ in range(ROUNDS_PER_CHECK):
            st = starts(cur)
            e = st + d_dur[cur]
            end[cur], start[cur] = e, st
            ok = e == e  # not NaN: the dependency was done / the peers had posted
            np.copyto(free, e, where=ok)
            cur += ok
        if (cur == stop).all():
            return start, end
        if (cur == before).all():
            raise RuntimeError(f"schedule deadlocks at slots {cur.tolist()}")


def _rounds_blocking(d_dur: np.ndarray, cur: np.ndarray, length: int, peers: np.ndarray, p2p: np.ndarray):
    """:func:`run_rounds` with blocking calls (``pairs``), finite times and every dependency an
    earlier unit of the same stage (the blocking path's: cross-stage inputs come in the calls),
    as :func:`_rounds_async` does it: ends NaN until done and the padding peer posted at -inf, so
    the end of the call before each stage's next unit, ``max(previous end, peer posts) + p2p``,
    is NaN while a peer has not posted, and so is the unit's start. That call's end is the
    unit's start: :func:`run_rounds`' ``max(free, dep end)`` is ``free``, a same-stage dependency
    having ended before the previous unit did. ``peers`` (peers, slots) and ``p2p`` (0 for a
    call without peers: ``e + 0 = e``) are those of the call before each slot; ``d_dur`` NaN on
    the trailing slots (never run). Returns (start, end) per slot."""
    end = np.full(len(d_dur), np.nan)
    end[cur - 1], end[-1] = 0.0, -np.inf
    prev_end = np.zeros(len(cur))

    def starts(at: np.ndarray) -> np.ndarray:
        posts = end[peers.take(at, axis=1)]  # (peers, stages)
        st = np.maximum(prev_end, posts[0])
        for row in posts[1:]:  # max(e, posts) + p2p, NaN while one has not posted
            np.maximum(st, row, out=st)
        st += p2p[at]
        return st

    return _lean_rounds(starts, end, prev_end, d_dur, cur, length)


def run_rounds(f: Flat, dur: np.ndarray, add: np.ndarray, pairs, p2p_s: float):
    """Start and end of every flat unit by list scheduling in rounds: each round, every
    stage whose next unit's dependency is done and whose previous call's peers have all posted
    runs it (``ready = dep end + add``, ``start = max(end of the call after the previous unit,
    ready)``, ``end = start + dur``); a unit not yet ready gets provisional times nobody reads
    (its successors wait for ``done``) and is computed again. Slots: each stage's units between a
    leading slot (end 0, done: the step's start, where the receives of the first unit are
    posted) and a trailing one that never runs. Returns (start, end, stream free after each
    unit's call, free after each stage's leading call, flat index of the peer that bound the
    call before each unit or -1). Finite, non-negative times run the leaner loops
    :func:`_rounds_async` and :func:`_rounds_blocking` (bitwise the same times); others
    :func:`run_rounds_general`."""
    p, length = f.p, f.length
    n, width = p * length, length + 2
    pos = np.arange(n)
    slot = pos + 2 * (pos // max(length, 1)) + 1  # stage s * width + position + 1
    pad = p * width + 1  # the padding peer of a call (p * width: a slot that never runs)
    cur = np.arange(p) * width + 1

    def slots(x: np.ndarray, fill) -> np.ndarray:  # per flat unit -> per slot (slices, no scatter)
        out = np.full(pad + 1, fill, dtype=x.dtype)
        out[:pad - 1].reshape(p, width)[:, 1:length + 1] = x.reshape(p, length)
        return out

    def units(x: np.ndarray, shift: int = 0) -> np.ndarray:  # per slot (last axis) -> per flat unit
        rows = x[..., :pad - 1].reshape(x.shape[:-1] + (p, width))[..., 1 + shift:length + 1 + shift]
        return rows.reshape(x.shape[:-1] + (n,))

    finite = bool(n) and np.isfinite(dur).all() and not np.signbit(dur).any()
    if pairs is None and finite and np.isfinite(add).all():
        d = f.dep  # its slot, or the unit's stage's leading slot when it has none
        dep = slots(np.where(d < n, d + 2 * (d // length) + 1, pos - pos % length + 2 * (pos // length)), pad - 1)
        start, end = _rounds_async(dep, slots(add, 0.0), slots(dur, 0.0), cur, length)
        end = units(end)
        return units(start), end, end, np.zeros(p), np.full(n, -1)
    if pairs is None:
        return run_rounds_general(f, dur, add, None, p2p_s)
    peers, loads, has = _call_table(pairs, length, width, pad)
    p2p = p2p_s * loads  # per call: k p2p_s (simulate.call_loads)
    local = (f.dep >= n) | ((f.dep // max(length, 1) == pos // max(length, 1)) & (f.dep < pos))
    if not (finite and local.all() and np.isfinite(p2p).all() and not np.signbit(p2p).any()):
        return run_rounds_general(f, dur, add, pairs, p2p_s)
    before = np.full(peers.shape, pad)  # the call before each slot
    before[:, 1:] = peers[:, :-1]
    p2p_before = np.zeros(pad + 1)
    p2p_before[1:] = np.where(has, p2p, 0.0)[:-1]
    start, end = _rounds_blocking(slots(dur, np.nan), cur, length, before, p2p_before)  # NaN: never runs
    free = np.zeros(pad + 1)  # after each slot's call: its next unit's start (the call ends it waited for)
    free[:-1] = start[1:]
    last = cur + length - 1
    free[last] = _call_end(end[last], peers[:, last], end, pad, p2p[last], has[last])[0]
    bind = _call_end(units(end, -1), units(before, 0), end, pad, units(p2p_before, 0), units(has, -1))[1]
    return units(start), units(end), units(free), free[cur - 1], slots(pos, -1)[bind]


def run_rounds_general(f: Flat, dur: np.ndarray, add: np.ndarray, pairs, p2p_s: float):
    """:func:`run_rounds` for any times (a ``done`` table, one round at a time)."""
    p, length = f.p, f.length
    n, width = p * length, length + 2
    slot = (np.arange(n) // length) * width + np.arange(n) % length + 1
    never, pad = p * width, p * width + 1  # a slot that never runs; the padding peer of a call
    dep = np.full(pad + 1, never, dtype=np.int64)
    dep[slot] = np.where(f.dep < n, slot[np.minimum(f.dep, n - 1)], np.arange(p).repeat(length) * width)
    done = np.zeros(pad + 1, dtype=bool)
    done[np.arange(p) * width] = True
    end, start = np.zeros(pad + 1), np.zeros(pad + 1)
    d_add, d_dur = np.zeros(pad + 1), np.zeros(pad + 1)
    d_add[slot], d_dur[slot] = add, dur
    cur = np.arange(p) * width + 1
    left = n
    if pairs is None:  # asynchronous sends: the stream is free when the previous unit ends
        while left:  # every stage computes its next unit; only those whose dependency is done keep it
            dc = dep[cur]
            ok = done[dc]
            st = np.maximum(end[cur - 1], end[dc] + d_add[cur])
            left -= _commit(cur, st, ok, start, end, done, d_dur)
        return start[slot], end[slot], end[slot], np.zeros(p), np.full(n, -1)
    peers, loads, _ = _call_table(pairs, length, width, pad)
    peers = peers.T  # a row per slot
    p2p = p2p_s * loads  # per call: k p2p_s (simulate.call_loads)
    end[pad], done[pad] = -np.inf, True  # the padding peer: posted, never the latest
    has = (peers != pad).any(axis=1)
    free = np.zeros(pad + 1)
    while left:  # as above, and the previous call's peers must all have posted
        dc, pc, prev = dep[cur], peers[cur - 1], cur - 1
        ok = done[dc] & done[pc].all(axis=1)
        e = end[prev]
        free[prev] = np.where(has[prev], np.maximum(e, end[pc].max(axis=1)) + p2p[prev], e)
        st = np.maximum(free[prev], end[dc] + d_add[cur])
        left -= _commit(cur, st, ok, start, end, done, d_dur)
    last = cur - 1  # each stage's last slot (its leading one when it has no unit)
    free[last] = _call_end(end[last], peers[last].T, end, pad, p2p[last])[0]
    bind = np.full(pad + 1, -1)
    bind[slot] = _call_end(end[slot - 1], peers[slot - 1].T, end, pad, p2p[slot - 1])[1]
    flat_of = np.full(pad + 1, -1)
    flat_of[slot] = np.arange(n)
    return start[slot], end[slot], free[slot], free[np.arange(p) * width], flat_of[bind[slot]]
