"""List scheduling of the array simulation (:mod:`meshplan.pipeline.fast`) in rounds: each round,
every stage whose next unit's inputs are there runs it, all stages at once in numpy; with
Megatron-LM 2022's blocking sends (:func:`~meshplan.pipeline.calls.rendezvous`) each stage also
waits for the peers of the call before the unit. Times bitwise equal to the reference
simulation (:func:`meshplan.pipeline.simulate.simulate`): the same additions and maxima in the
same order.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import numpy as np

from meshplan.pipeline.calls import call_table
from meshplan.pipeline.orders import Flat


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
    """(end of each call posted at ``e`` with peer slots ``peers`` (columns: shape (peers, calls),
    in any order), binding peer slot or -1): ``max(e, peer posts) + p2p_s`` (seconds: one value,
    or one per call), ``e`` for an empty call (``has``: whether each call has a peer, default
    from ``peers``). ``end[pad]`` is -inf (the padding peer never binds); the binding peer is the
    first latest one in (stage, position) order: the lowest slot among the latest posts."""
    if peers.shape[0] == 0:
        return e, np.full(len(e), -1)
    top, bind = _binding(e, peers, end, pad)
    has = (peers != pad).any(axis=0) if has is None else has
    return np.where(has, np.maximum(e, top) + p2p_s, e), bind


def _binding(e: np.ndarray, peers: np.ndarray, end: np.ndarray, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """(the latest post of each call's peers, the binding peer slot or -1) for :func:`_call_end`
    (``peers``: at least one row)."""
    posts = end[peers]
    top = np.maximum.reduce(posts, axis=0)
    best = peers[0] if len(peers) == 1 else np.where(posts == top, peers, pad).min(axis=0)
    return top, np.where(top > e, best, -1)  # top > e: some peer posted later than e


#: Rounds :func:`_lean_rounds` runs between two checks for the end and for a deadlock.
ROUNDS_PER_CHECK = 64


class Rounds(NamedTuple):
    """The rounds of one asynchronous run of :func:`_rounds_async`, to run the same units again
    with other durations (:func:`replay`): ``order``, the unit slots in the order they were
    computed (round by round; within a round by stage); ``bounds``, where each round starts in
    ``order`` (and ``len(order)``); ``dep`` and ``add``, per slot, the slot each waits for (the
    last slot, which ends at 0, when none) and the seconds added to its end. Which stages run a unit
    in a round depends only on which dependencies are done (NaN ends), never on the times, so
    any finite, non-negative durations run in the same rounds."""

    order: np.ndarray
    bounds: list
    dep: np.ndarray
    add: np.ndarray


def replay(r: Rounds, d_dur: np.ndarray, cur: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) per slot of :func:`_rounds_async` run with durations ``d_dur`` (per slot,
    finite, non-negative) on the units of ``r``, round by round in ``r``'s rounds: each unit
    starts at ``max(end of the slot before, dep end + add)`` (a stage's leading slot ends at 0),
    the same operands in the same order as the round loop, so every time is bitwise its; no
    test of done, no per-stage state, and no array of every unit besides the two returned
    (GPT-1T ZB-H1 at pp 128 x 4,096 micro-batches, 12,416 rounds: the pipeline simulated again
    without the waits of :func:`meshplan.schedule.waits.bubble_wait`). ``cur``: each stage's
    first unit slot."""
    o, b, dep, add = r.order, r.bounds, r.dep, r.add
    end = np.full(len(d_dur), np.nan)
    end[cur - 1], end[-1] = 0.0, 0.0  # as _rounds_async
    start = np.zeros(len(d_dur))
    for a, z in zip(b[:-1], b[1:]):
        at = o[a:z]
        st = np.maximum(end[at - 1], end[dep[at]] + add[at])
        end[at] = st + d_dur[at]
        start[at] = st
    return start, end


def _rounds_async(dep: np.ndarray, d_add: np.ndarray, d_dur: np.ndarray, cur: np.ndarray, length: int,
                  log: Optional[list] = None, after: Optional[tuple[np.ndarray, np.ndarray]] = None):
    """:func:`run_rounds` with asynchronous sends and finite times, in fewer array operations per
    round (one round per unit position: ~10^4 rounds at pp 128 x 4,096 micro-batches, so the
    per-round overhead is the cost): a unit not done has end NaN, so ``max(stream free, dep end +
    add)`` is NaN exactly when the dependency is not done (``np.maximum`` propagates NaN) and the
    stage keeps its unit; the same additions and maxima as :func:`run_rounds` in the same order, so
    every time is bitwise equal. ``dep``, ``d_add``, ``d_dur``: per slot; ``cur``: each stage's
    first unit slot (its leading slot, end 0, just before). Returns (start, end) per slot;
    ``log``, when given, receives the run's :class:`Rounds`. ``after`` (slots, seconds), per slot:
    the unit also starts no earlier than that earlier slot of its stage ends plus those seconds
    (:func:`run_rounds`)."""
    end = np.full(len(dep), np.nan)
    end[cur - 1], end[-1] = 0.0, 0.0  # the leading slots and the last (``dep`` of a unit without one)
    free = np.zeros(len(cur))  # end of each stage's previous unit (kept: cheaper than a gather)

    def starts(at: np.ndarray) -> np.ndarray:
        ready = end[dep[at]]
        ready += d_add[at]
        st = np.maximum(free, ready)
        if after is not None:  # a same-stage earlier slot: done (never NaN) when ``at`` runs
            np.maximum(st, end[after[0][at]] + after[1][at], out=st)
        return st

    done: Optional[list] = None if log is None else []
    out = _lean_rounds(starts, end, d_dur, cur, length, free, done)
    if log is not None and done is not None:
        sizes = np.fromiter(map(len, done), dtype=np.int64, count=len(done))
        log.append(Rounds(np.concatenate(done), [0] + np.cumsum(sizes).tolist(), dep, d_add))
    return out


def _lean_rounds(starts, end: np.ndarray, d_dur: np.ndarray, cur: np.ndarray, length: int,
                 free: Optional[np.ndarray] = None, done: Optional[list] = None):
    """The rounds :func:`_rounds_async` and :func:`_rounds_blocking` share: each round every
    stage's current slot starts at ``starts(cur)`` (NaN while it cannot) and ends ``d_dur`` later
    (``end``, and ``free`` per stage if given, updated in place); the stages whose end is not NaN
    keep it and move on; every :data:`ROUNDS_PER_CHECK` rounds, stop when all are past their
    ``length`` units or raise RuntimeError when none moved (the schedule deadlocks). Returns
    (start, end) per slot; ``done``, when given, gets each round's slots that ran (an array a round)."""
    start = np.zeros(len(end))
    cur, stop = cur.copy(), cur + length
    while True:
        before = cur.copy()
        for _ in range(ROUNDS_PER_CHECK):
            st = starts(cur)
            e = st + d_dur[cur]
            end[cur], start[cur] = e, st
            ok = e == e  # not NaN: the dependency was done / the peers had posted
            if free is not None:
                np.copyto(free, e, where=ok)
            if done is not None:
                done.append(cur[ok])
            cur += ok
        if (cur == stop).all():
            return start, end
        if (cur == before).all():
            raise RuntimeError(f"schedule deadlocks at slots {cur.tolist()}")


def _async_inputs(pairs, length: int, pad: int, p2p_s: float):
    """Per slot of :func:`run_rounds`, the inputs received asynchronously (Megatron-LM's
    ``overlap_p2p_comm``: ``pairs.recv_async``), or None without any: (the slot of the call that
    sends each such input, the slot of the one that receives it, ``p2p_s`` for such a unit (its
    boundary's, ``pairs.xfer_s``, where given) and 0 else); ``pad`` (posted at -inf, done) for every other slot: the unit waits for ``max(both
    posts) + p2p_s``."""
    if pairs.recv_async is None or not pairs.recv_async.any():
        return None
    k = pairs.recv_async
    cons = pairs.cons[k]
    at = cons + 2 * (cons // length) + 1
    a_send, a_recv, a_add = np.full(pad + 1, pad), np.full(pad + 1, pad), np.zeros(pad + 1)
    a_send[at], a_recv[at] = pairs.send[k], pairs.recv[k]
    a_add[at] = p2p_s if getattr(pairs, "xfer_s", None) is None else pairs.xfer_s[k]  # per boundary: its own
    return a_send, a_recv, a_add


def _rounds_blocking(d_dur: np.ndarray, cur: np.ndarray, length: int, waits: np.ndarray, p2p: np.ndarray,
                     asyn=None):
    """:func:`run_rounds` with blocking calls (``pairs``), finite times and every dependency an
    earlier unit of the same stage (the blocking path's: cross-stage inputs come in the calls),
    as :func:`_rounds_async` does it: ends NaN until done and the padding peer posted at -inf, so
    the end of the call before each stage's next unit, ``max(previous end, peer posts) + p2p``,
    is NaN while a peer has not posted, and so is the unit's start. That call's end is the
    unit's start: :func:`run_rounds`' ``max(free, dep end)`` is ``free``, a same-stage dependency
    having ended before the previous unit did. ``waits`` (1 + peers, slots): per slot the slot
    before it (the previous unit, whose end posts the call) and the peers of that call (any
    order: a maximum); ``p2p``: that call's seconds (0 for a call without peers: ``e + 0 = e``);
    ``d_dur`` NaN on the trailing slots (never run). ``asyn``: :func:`_async_inputs` (a unit
    also waits for its asynchronous input, NaN until its sender posted). Returns (start, end) per
    slot."""
    end = np.full(len(d_dur), np.nan)
    end[cur - 1], end[-1] = 0.0, -np.inf
    first, rest = waits[0], [np.ascontiguousarray(w) for w in waits[1:]]
    latest = np.maximum  # one row at a time: maximum.reduce over a (rows, stages) gather costs more per round

    def starts(at: np.ndarray) -> np.ndarray:
        st = end[first[at]]
        for w in rest:  # NaN while one has not posted (maximum propagates NaN, whatever the order)
            latest(st, end[w[at]], out=st)
        st += p2p[at]
        if asyn is not None:
            a_send, a_recv, a_add = asyn
            st = np.maximum(st, np.maximum(end[a_send[at]], end[a_recv[at]]) + a_add[at])
        return st

    return _lean_rounds(starts, end, d_dur, cur, length)


class Binding:
    """Per flat unit, the flat index of the peer whose post bound the call before it (it waited
    for that peer), or -1 (:func:`run_rounds`): for the units asked for (:meth:`at`), from a
    table of every unit or computed on demand (the blocking round loop's: the critical path
    visits a few thousand of 10^6 units)."""

    def __init__(self, n: int, at: "np.ndarray | Callable[[np.ndarray], np.ndarray]"):
        self.n, self._at = n, at

    def at(self, idx: np.ndarray) -> np.ndarray:
        """The binding peer of each flat unit in ``idx`` (-1: none)."""
        idx = np.asarray(idx, dtype=np.int64)
        return self._at[idx] if isinstance(self._at, np.ndarray) else self._at(idx)

    def all(self) -> np.ndarray:
        """:meth:`at` of every unit."""
        return self.at(np.arange(self.n))


def run_rounds(f: Flat, dur: np.ndarray, add: np.ndarray, pairs, p2p_s: float, *,
               log: Optional[list] = None, again: Optional[Rounds] = None,
               after: Optional[tuple[np.ndarray, np.ndarray]] = None):
    """Start and end of every flat unit by list scheduling in rounds: each round, every
    stage whose next unit's dependency is done and whose previous call's peers have all posted
    runs it (``ready = dep end + add``, ``start = max(end of the call after the previous unit,
    ready)``, ``end = start + dur``); a unit not yet ready gets provisional times nobody reads
    (its successors wait for ``done``) and is computed again. Slots: each stage's units between a
    leading slot (end 0, done: the step's start, where the receives of the first unit are
    posted) and a trailing one that never runs. ``pairs``: the blocking calls
    (:class:`~meshplan.pipeline.calls.Transfers`, in these slots), None for asynchronous sends
    (cross-stage inputs then wait ``add``). Returns (start, end, stream free after each
    unit's call, free after each stage's leading call, the peer that bound the call before each
    unit: :class:`Binding`). Finite, non-negative times run the leaner loops
    :func:`_rounds_async` and :func:`_rounds_blocking` (bitwise the same times); others
    :func:`run_rounds_general`. Asynchronous sends: ``log``, when given, receives the lean
    run's :class:`Rounds`; ``again``, the :class:`Rounds` of a run of the same units and ``add``,
    is replayed with ``dur`` (:func:`replay`) instead of running the rounds. ``after`` (flat unit
    or -1, seconds) per flat unit, asynchronous sends only: it also starts no earlier than that
    earlier unit of its stage ends plus the seconds (torch's window UNSHARD issued after it,
    :mod:`meshplan.schedule.window_unshard`); a run with it is neither logged nor replayed."""
    p, length = f.p, f.length
    n, width = p * length, length + 2
    pad = p * width + 1  # the padding peer of a call (p * width: a slot that never runs)
    cur = np.arange(p) * width + 1

    def slots(x: np.ndarray, fill) -> np.ndarray:  # per flat unit -> per slot (slices, no scatter)
        out = np.full(pad + 1, fill, dtype=x.dtype)
        out[:pad - 1].reshape(p, width)[:, 1:length + 1] = x.reshape(p, length)
        return out

    def units(x: np.ndarray) -> np.ndarray:  # per slot -> per flat unit
        return x[:pad - 1].reshape(p, width)[:, 1:length + 1].reshape(n)

    finite = bool(n) and np.isfinite(dur).all() and not np.signbit(dur).any()
    if after is not None:
        if pairs is not None:
            raise ValueError("run_rounds: 'after' needs asynchronous sends (pairs None)")
        x = after[0] + 2 * (after[0] // max(length, 1)) + 1  # its slot; none (-1): the last slot, end 0
        log, again = None, None
        after = (slots(np.where(after[0] >= 0, x, pad), pad), slots(np.asarray(after[1], dtype=float), 0.0))
    if pairs is None and finite and again is not None:
        start, end = replay(again, slots(dur, 0.0), cur)
        end = units(end)
        return units(start), end, end, np.zeros(p), Binding(n, np.full(n, -1))
    if pairs is None and finite and np.isfinite(add).all():
        d = f.dep // length  # its slot d + 2 (d // L) + 1; none (d = n): pad, an end of 0 (in place: 10^6 units)
        d *= 2
        d += f.dep
        d += 1
        start, end = _rounds_async(slots(d, pad - 1), slots(add, 0.0), slots(dur, 0.0), cur, length, log, after)
        end = units(end)
        return units(start), end, end, np.zeros(p), Binding(n, np.full(n, -1))
    if pairs is None:
        return run_rounds_general(f, dur, add, None, p2p_s, after)
    waits, loads, has, secs = call_table(pairs, p, length)
    p2p = p2p_s * loads if secs is None else secs  # per call: k p2p_s (rendezvous.call_seconds), 0 without transfers
    pos = np.arange(n)
    local = (f.dep >= n) | ((f.dep // max(length, 1) == pos // max(length, 1)) & (f.dep < pos))
    if not (finite and local.all() and np.isfinite(p2p).all() and not np.signbit(p2p).any()):
        return run_rounds_general(f, dur, add, pairs, p2p_s)
    asyn = _async_inputs(pairs, length, pad, p2p_s)
    start, end = _rounds_blocking(slots(dur, np.nan), cur, length, waits, p2p, asyn)  # NaN: never runs
    free = np.zeros(pad + 1)  # after each slot's call: its next unit's start (the call ends it waited for)
    if asyn is None:
        free[:-1] = start[1:]
    else:  # a unit may wait beyond the call for its asynchronous input: each call's end
        free[:-1] = _call_end(end[:-1], waits[1:, 1:], end, pad, p2p[1:], has[1:])[0]
    last = cur + length  # each stage's trailing slot: the call after its last unit
    free[last - 1] = _call_end(end[last - 1], waits[1:, last], end, pad, p2p[last], has[last])[0]
    peers = waits[1:]

    def bound(idx: np.ndarray) -> np.ndarray:  # the call before each unit: posted when the slot before ends
        t = idx + 2 * (idx // length) + 1
        b = _binding(end[t - 1], peers.take(t, axis=1), end, pad)[1] if len(peers) else np.full(len(t), -1)
        return np.where((b >= 0) & (b % width > 0), b - 2 * (b // width) - 1, -1)  # (a leading slot posts at 0)

    return units(start), units(end), units(free), free[cur - 1], Binding(n, bound)


def run_rounds_general(f: Flat, dur: np.ndarray, add: np.ndarray, pairs, p2p_s: float,
                       after: Optional[tuple[np.ndarray, np.ndarray]] = None):
    """:func:`run_rounds` for any times (a ``done`` table, one round at a time); ``after`` per
    slot as :func:`_rounds_async`'s (asynchronous sends)."""
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
            if after is not None:
                st = np.maximum(st, end[after[0][cur]] + after[1][cur])
            left -= _commit(cur, st, ok, start, end, done, d_dur)
        return start[slot], end[slot], end[slot], np.zeros(p), Binding(n, np.full(n, -1))
    table, loads, has, secs = call_table(pairs, p, length)
    peers = table[1:].T  # a row per slot: the peers of the call before it
    p2p = p2p_s * loads if secs is None else secs  # per call: k p2p_s (rendezvous.call_seconds)
    end[pad], done[pad] = -np.inf, True  # the padding peer: posted, never the latest
    free = np.zeros(pad + 1)
    asyn = _async_inputs(pairs, length, pad, p2p_s)
    while left:  # as above, and the previous call's peers must all have posted
        dc, pc, prev = dep[cur], peers[cur], cur - 1
        ok = done[dc] & done[pc].all(axis=1)
        e = end[prev]
        free[prev] = np.where(has[cur], np.maximum(e, end[pc].max(axis=1, initial=-np.inf)) + p2p[cur], e)
        st = np.maximum(free[prev], end[dc] + d_add[cur])
        if asyn is not None:  # and its asynchronous input (overlap_p2p_comm), once its sender posted
            a_send, a_recv, a_add = (x[cur] for x in asyn)
            ok &= done[a_send] & done[a_recv]
            st = np.maximum(st, np.maximum(end[a_send], end[a_recv]) + a_add)
        left -= _commit(cur, st, ok, start, end, done, d_dur)
    last = cur - 1  # each stage's last slot (its leading one when it has no unit)
    free[last] = _call_end(end[last], peers[cur].T, end, pad, p2p[cur], has[cur])[0]
    bind = np.full(pad + 1, -1)
    bind[slot] = _call_end(end[slot - 1], peers[slot].T, end, pad, p2p[slot])[1]
    flat_of = np.full(pad + 1, -1)
    flat_of[slot] = np.arange(n)
    return start[slot], end[slot], free[slot], free[np.arange(p) * width], Binding(n, flat_of[bind[slot]])
