"""The pipeline event simulation of :func:`meshplan.pipeline.simulate.simulate` on arrays: the same
list scheduling with the same orders, dependencies and arithmetic, without a Python object
per unit (issue 11 item 4: ``meshplan step`` of pp 128 x 4,096 micro-batches in under 1 s).

:func:`simulate` (the reference) walks every unit of every stage in Python and keeps an
:class:`~meshplan.pipeline.simulate.Event` per unit, then sums busy time over all events once
per stage (p x units): measured 35 s of ``step_time``'s 39 s for the 393,216 units of GPT-1T at
pp 64 x 3,072 micro-batches (benchmarks/configs, 2 loaded cores; 0.85 s on arrays). Here each
stage's order is an integer array (:func:`order_arrays`, equal to
:func:`~meshplan.pipeline.simulate.stage_order`), dependencies are flat indices, and the
list scheduling runs in rounds: in each round every stage whose next unit's dependency is
done starts it, all stages at once in numpy. A unit's start and end are computed exactly as
the reference computes them (``ready = dep end + p2p`` across stages, ``start = max(stream
free, ready)``, ``end = start + duration``), so every time is bitwise equal; rounds number
about the longest chain of units (``L + 2p`` for 1F1B with ``L = 2m`` units per stage), so the
cost is the numpy calls per round: the loops (:func:`_rounds_async`, :func:`_rounds_blocking`) mark
a unit not done by a NaN end instead of a done table (about 12 calls a round; 1F1B at pp 128 x
4,096 micro-batches, 8,448 rounds: 0.42 s -> 0.13 s; Megatron's blocking interleaved 1F1B at pp
64 x 2 chunks, 16,512 rounds: 2.7 s -> 0.5-0.75 s; cProfile on 2 loaded cores), and the orders of
all stages are built at once (:func:`stage_orders`).
Durations depend only on (stage, chunk, kind, last gradient unit), the step model's unit
key, given as a table. Events are built only when asked for (trace, evidence).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from typing import Callable, Optional

import numpy as np

from meshplan.pipeline.registry import get
from meshplan.pipeline.simulate import BubbleStats, Event, PipelineSpec, Unit

KINDS = ("F", "B", "W")


def _pairs(w: np.ndarray, total: int) -> tuple[np.ndarray, np.ndarray]:
    """(kind, unit index) of ``w`` warm-up forwards, then forward/backward pairs, then the
    remaining backwards over ``total`` forward and ``total`` backward units, one row per entry
    of ``w`` (shape (rows, 1)): position c holds forward c while c < w, backward
    ``c - total`` from ``2 total - w`` on, and between them, from ``j = c - w``, forward
    ``w + j / 2`` (j even) or backward ``(j - 1) / 2`` (j odd): the list of
    :func:`~meshplan.pipeline.one_f_one_b.warmup_pairs_drain`, closed form on a (rows, 2 total) grid.

    >>> k, i = _pairs(np.array([[2]]), 4)
    >>> " ".join(f"{KINDS[a]}{b}" for a, b in zip(k[0], i[0]))
    'F0 F1 F2 B0 F3 B1 B2 B3'
    """
    c = np.arange(2 * total)[None, :]
    j = c - w
    odd = j & 1
    warm, drain = c < w, c >= 2 * total - w
    kind = np.where(warm, 0, np.where(drain, 1, odd))
    idx = np.where(warm, c, np.where(drain, c - total, np.where(odd == 1, j >> 1, w + (j >> 1))))
    return kind.astype(np.int64), idx.astype(np.int64)


def _zb_h1(p: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(kind, micro-batch) of ZB-H1 on every stage, (p, 3 m): per stage a grid of ``w``
    warm-up forwards, then per nb ``F(w + nb)`` while any is left, ``B(nb)``, ``W(nb - s)`` once
    ``nb >= s``, then the remaining W (:class:`~meshplan.pipeline.zb_h1.ZBH1`), kept by a mask
    that leaves exactly 3 m units on every row."""
    s = np.arange(p)[:, None]
    w = np.minimum(p - s - 1, m)
    i = np.arange(m)[None, :]
    nb = np.broadcast_to(i, (p, m))
    mid_mb = np.stack([w + nb, nb, nb - s], axis=2).reshape(p, 3 * m)
    mid_keep = np.stack([w + nb < m, np.ones((p, m), dtype=bool), nb >= s], axis=2).reshape(p, 3 * m)
    mb = np.concatenate([np.broadcast_to(i, (p, m)), mid_mb, np.broadcast_to(i, (p, m))], axis=1)
    keep = np.concatenate([i < w, mid_keep, i >= np.maximum(0, m - s)], axis=1)
    kind = np.concatenate([np.zeros(m, np.int64), np.tile(np.arange(3), m), np.full(m, 2)])
    return np.broadcast_to(kind, mb.shape)[keep].reshape(p, 3 * m), mb[keep].reshape(p, 3 * m)


@lru_cache(maxsize=4)
def stage_orders(schedule: str, p: int, m: int, v: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kind index into :data:`KINDS`, micro-batch, chunk) of every unit of every stage, each
    (p, units per stage), row s equal to :func:`~meshplan.pipeline.simulate.stage_order` of
    stage s; built for all stages at once on arrays (the orders of 1F1B, GPipe and
    interleaved 1F1B are :func:`_pairs` with the stage's warm-up; ZB-H1 :func:`_zb_h1`; the
    V-shaped ones from their unit lists), kept for the last few (schedule, p, m, v) and read-only
    (``meshplan step`` reads them for the memory timelines and again for the simulation).

    >>> k, mb, c = stage_orders("1f1b", 2, 3, 1)
    >>> [" ".join(f"{KINDS[a]}{b}" for a, b in zip(k[s], mb[s])) for s in range(2)]
    ['F0 F1 B0 F2 B1 B2', 'F0 B0 F1 B1 F2 B2']
    """
    z, s = np.zeros, np.arange(p)[:, None]
    if schedule in ("gpipe", "1f1b"):
        kind, mb = _pairs(np.full((p, 1), m) if schedule == "gpipe" else np.minimum(p - s - 1, m), m)
        out = kind, mb, z(kind.shape, dtype=np.int64)
    elif schedule == "zb_h1":
        kind, mb = _zb_h1(p, m)
        out = kind, mb, z(kind.shape, dtype=np.int64)
    elif schedule == "interleaved_1f1b":
        total = m * v
        kind, fk = _pairs(np.minimum(total, 2 * (p - s - 1) + (v - 1) * p), total)
        chunk = (fk % (p * v)) // p
        out = kind, (fk // (p * v)) * p + fk % p, np.where(kind == 0, chunk, v - 1 - chunk)
    else:  # the others (ZB-V, DualPipeV): from the unit lists (as many units on every stage)
        rows = [_listed(schedule, p, m, v, st) for st in range(p)]
        out = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows]), np.stack([r[2] for r in rows])
    for col in out:
        col.flags.writeable = False
    return out


def order_arrays(schedule: str, p: int, m: int, v: int, s: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kind index into :data:`KINDS`, micro-batch, chunk) of every unit of
    :func:`~meshplan.pipeline.simulate.stage_order` on stage ``s``, in order: row s of
    :func:`stage_orders` (read-only views).

    >>> k, mb, c = order_arrays("1f1b", 4, 5, 1, 1)
    >>> " ".join(f"{KINDS[a]}{b}" for a, b in zip(k, mb))
    'F0 F1 F2 B0 F3 B1 F4 B2 B3 B4'
    """
    if str(schedule) not in CLOSED_FORM:
        return _listed(schedule, p, m, v, s)
    kind, mb, chunk = stage_orders(str(schedule), int(p), int(m), int(v))
    return kind[s], mb[s], chunk[s]


#: Schedules whose orders :func:`stage_orders` builds in closed form for all stages at once.
CLOSED_FORM = ("gpipe", "1f1b", "zb_h1", "interleaved_1f1b")


def _listed(schedule: str, p: int, m: int, v: int, s: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The order of stage ``s`` from the schedule's unit list, as (kind, micro-batch, chunk)."""
    rows = [(KINDS.index(u.kind), u.mb, u.chunk) for u in get(schedule).order(p, m, v, s)]
    if not rows:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    kinds, mbs, chunks = (np.array(col, dtype=np.int64) for col in zip(*rows))
    return kinds, mbs, chunks


@dataclass(frozen=True)
class Flat:
    """All units, stage-major (unit ``s * L + i`` is position i of stage s): ``kind``,
    ``mb``, ``chunk``; ``dep``: flat index of the unit it waits for (``N`` = none);
    ``cross``: the dependency is on another stage."""

    p: int
    length: int
    kind: np.ndarray
    mb: np.ndarray
    chunk: np.ndarray
    dep: np.ndarray
    cross: np.ndarray

    @property
    def stage(self) -> np.ndarray:
        return np.arange(len(self.kind)) // self.length


def flat_units(schedule: str, p: int, m: int, v: int) -> Flat:
    """Orders of every stage and the dependency of each unit, as the reference's ``_dep``:
    F of virtual stage j waits for F of j-1, B of j for B of j+1 (the last virtual stage for
    its own F), W for its B."""
    kind, mb, chunk = (a.reshape(-1) for a in stage_orders(str(schedule), int(p), int(m), int(v)))
    length = len(kind) // p
    stage = np.repeat(np.arange(p), length)
    n, pv = p * length, p * v
    j = np.asarray(get(schedule).virtual_stage(chunk, stage, p, v), dtype=np.int64)
    where = np.full(3 * m * pv, n, dtype=np.int64)  # flat unit of (kind, mb, virtual stage), flattened
    where[(kind * m + mb) * pv + j] = np.arange(n)
    last_b = (kind == 1) & (j == pv - 1)  # B of the last virtual stage waits for its own F
    dj = np.minimum(j + np.array([-1, 1, 0])[kind], pv - 1)  # F: j - 1, B: j + 1, W: j
    dkind = np.where(last_b, 0, np.array([0, 1, 1])[kind])  # F: F, B: B, W: its B
    dep = where[(dkind * m + mb) * pv + np.maximum(dj, 0)]
    dep[(kind == 0) & (j == 0)] = n
    cross = (dep < n) & ((np.minimum(dep, n - 1) // length) != stage)
    return Flat(p, length, kind, mb, chunk, dep, cross)


@dataclass(frozen=True, eq=False)
class ArrayResult(BubbleStats):
    """:class:`~meshplan.pipeline.simulate.PipelineResult`'s interface on arrays (flat,
    stage-major): ``start``, ``end``, ``wait`` (start - stream free), ``via_p2p``, ``pred``
    (flat index of the critical predecessor, -1 none); ``hold`` (seconds, the blocking call after
    each unit holds its stream: 0 with asynchronous sends); ``xfer`` (blocking only: when the
    transfer feeding each unit starts, both calls posted; NaN for a unit with no cross-stage
    input); ``events`` and ``critical_path`` are built on demand."""

    spec: PipelineSpec
    flat: Flat
    start: np.ndarray
    end: np.ndarray
    wait: np.ndarray
    via_p2p: np.ndarray
    pred: np.ndarray
    step_s: float
    busy_s: tuple[float, ...]
    hold: Optional[np.ndarray] = None
    xfer: Optional[np.ndarray] = None

    def stage_slice(self, s: int) -> slice:
        return slice(s * self.flat.length, (s + 1) * self.flat.length)

    def _event(self, i: int) -> Event:
        return self._events([i])[0]

    def _events(self, idx) -> list[Event]:
        """The compute event of each flat unit in ``idx`` (indices, in that order), its fields
        read from the arrays once for all (``tolist``: the same Python ints and floats as
        ``int()``/``float()`` of each element)."""
        f, v = self.flat, self.spec.v
        idx = np.asarray(idx, dtype=np.int64)
        cols = (f.kind[idx], f.mb[idx], f.chunk[idx], self.start[idx], self.end[idx], self.via_p2p[idx],
                self.wait[idx], idx // f.length)
        out = []
        for kind, mb, chunk, t0, t1, via, wait, stage in zip(*(c.tolist() for c in cols)):
            kind = KINDS[kind]
            name = f"{kind}{mb}.c{chunk}" if v > 1 else f"{kind}{mb}"
            out.append(Event(stage, "compute", name, t0, t1, {"kind": kind, "mb": mb, "chunk": chunk,
                                                             "via": "p2p" if via else "stream", "wait_s": wait}))
        return out

    def unit_names(self, idx) -> list[str]:
        """The event name of each flat unit in ``idx`` (``F3``, ``B0.c1``): :meth:`_events`'s,
        without the events."""
        f, idx = self.flat, np.asarray(idx, dtype=np.int64)
        if self.spec.v > 1:
            return [f"{KINDS[k]}{mb}.c{c}" for k, mb, c in zip(f.kind[idx].tolist(), f.mb[idx].tolist(),
                                                               f.chunk[idx].tolist())]
        return [f"{KINDS[k]}{mb}" for k, mb in zip(f.kind[idx].tolist(), f.mb[idx].tolist())]

    def _send(self, i: int, d: Event) -> Event:
        """The "pp" event of the transfer of producer ``d``'s output to unit ``i``: from the
        producer's end (asynchronous) or from the rendezvous of both calls (blocking)."""
        t0 = d.end_s if self.xfer is None else float(self.xfer[i])
        return Event(d.stage, "pp", f"send {d.name}", t0, t0 + self.spec.p2p_s)

    @cached_property
    def events(self) -> tuple[Event, ...]:
        """Every unit (and each p2p send before the unit that waits on it), stage by stage;
        ``args['pred']`` links the critical predecessor as the reference does."""
        n, f = len(self.end), self.flat
        units = self._events(np.arange(n))
        send = (f.cross & (self.spec.p2p_s > 0)).tolist()
        out = []
        for i, (ev, pred, dep) in enumerate(zip(units, self.pred.tolist(), f.dep.tolist())):
            ev.args["pred"] = units[pred] if pred >= 0 else None
            if send[i]:
                out.append(self._send(i, units[dep]))
            out.append(ev)
        return tuple(out)

    def stage_events(self, s: int) -> list[Event]:
        """The events of :attr:`events` on stage ``s`` (its units, and the p2p sends it
        makes, each before the unit that waits on it), built for that stage alone."""
        f, n = self.flat, len(self.end)
        sl = self.stage_slice(s)
        if self.spec.p2p_s > 0:
            waiting = np.flatnonzero(f.cross & (np.minimum(f.dep, n - 1) // f.length == s) & (f.dep < n))
        else:
            waiting = np.zeros(0, dtype=np.int64)
        units = self._events(np.arange(sl.start, sl.stop))
        for ev in units:
            ev.args["pred"] = None
        producers = dict(zip(waiting.tolist(), self._events(f.dep[waiting])))
        items = sorted([(i, 1) for i in range(sl.start, sl.stop)] + [(i, 0) for i in producers])
        return [units[i - sl.start] if unit else self._send(i, producers[i]) for i, unit in items]

    @cached_property
    def critical_units(self) -> np.ndarray:
        """Flat indices of the units of :attr:`critical_path`, first to last."""
        last = [self.stage_slice(s).stop - 1 for s in range(self.flat.p)]
        i = last[max(range(self.flat.p), key=lambda s: self.end[last[s]])]
        path, pred = [], self.pred
        while i >= 0:
            path.append(i)
            i = int(pred[i])
        return np.array(path[::-1], dtype=np.int64)

    @cached_property
    def critical_path(self) -> tuple[Event, ...]:
        """From the first unit to the last unit of the stage that ends last."""
        evs = self._events(self.critical_units)
        for a, b in zip(evs[1:], evs):
            a.args["pred"] = b
        evs[0].args["pred"] = None
        return tuple(evs)


def simulate_arrays(spec: PipelineSpec, durations: Optional[Callable[[Flat], np.ndarray]] = None) -> ArrayResult:
    """:func:`~meshplan.pipeline.simulate.simulate` of ``spec`` on arrays. ``durations(flat)``:
    seconds of every flat unit (default: the spec's own
    :meth:`~meshplan.pipeline.simulate.PipelineSpec.unit_s`, :func:`spec_durations`). Start,
    end, wait, critical path and busy time equal the reference's (module docstring).
    ``blocking_p2p``: Megatron-LM 2022's rendezvous calls (:func:`rendezvous`); ``hold`` is then
    the seconds each unit's call holds its stream after it (``free - end``).

    >>> r = simulate_arrays(PipelineSpec("1f1b", p=4, m=8))
    >>> r.step_s, round(r.bubble, 4), [e.name for e in r.critical_path][:5]
    (33.0, 0.375, ['F0', 'F0', 'F0', 'F0', 'B0'])
    """
    p, f = spec.p, flat_units(spec.schedule, spec.p, spec.m, spec.v)
    n, length = p * f.length, f.length
    dur = np.asarray(durations(f) if durations is not None else spec_durations(spec, f), dtype=float)
    pairs = rendezvous(spec, f) if spec.blocking_p2p else None
    add = np.where(f.cross, spec.p2p_s, 0.0) if pairs is None else np.zeros(n)
    dep = f.dep if pairs is None else np.where(f.cross, n, f.dep)  # blocking: the input comes in a call
    start, end, free, lead_free, bind = _rounds(replace(f, dep=dep), dur, add, pairs, spec.p2p_s)
    prev = np.concatenate([[0.0], free[:-1]])  # stream free at start: after the previous unit's call
    before = np.arange(-1, n - 1)  # the previous unit of the stage, -1 for a stage's first
    if length:
        prev[::length] = lead_free  # (a stage's first unit: after the call before it)
        before[::length] = -1
    if pairs is None:
        ready = np.where(f.dep < n, np.concatenate([end, [0.0]])[f.dep] + add, 0.0)
        via = (f.dep < n) & (ready > prev)
        pred = np.where(via, f.dep, before)
        xfer = None
    else:
        via = bind >= 0
        pred = np.where(via, bind, before)
        send, recv, cons = pairs
        at = lambda packed: np.concatenate([[0.0], end])[np.where(packed % (length + 1) > 0,  # noqa: E731
                                                                  (packed // (length + 1)) * length + packed % (length + 1), 0)]
        xfer = np.full(n, np.nan)
        xfer[cons] = np.maximum(at(send), at(recv))
    busy = tuple(sum((end[s * length:(s + 1) * length] - start[s * length:(s + 1) * length]).tolist())
                 for s in range(p))
    last = free[length - 1::length] if length else lead_free
    return ArrayResult(spec, f, start, end, start - prev, via, pred, float(last.max()), busy, free - end, xfer)


def rendezvous(spec: PipelineSpec, f: Flat) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Megatron-LM 2022's rendezvous p2p (:mod:`meshplan.pipeline.simulate` docstring,
    :func:`~meshplan.pipeline.simulate.calls`) on the flat units: per cross-stage input (one
    entry per unit with ``f.cross``, in flat order) the call that sends it and the call that
    receives it, each as (stage, position) packed ``stage * (L + 1) + position + 1`` (position
    -1: before the first unit), and the flat indices of those consumers.

    >>> f = flat_units("1f1b", 2, 2, 1)  # stage 0: F0 F1 B0 B1; stage 1: F0 B0 F1 B1
    >>> send, recv, cons = rendezvous(PipelineSpec("1f1b", p=2, m=2, blocking_p2p=True), f)
    >>> cons.tolist()  # stage 0's B0, B1; stage 1's F0, F1
    [2, 3, 4, 6]
    >>> [(int(x) // 5, int(x) % 5 - 1) for x in send], [(int(x) // 5, int(x) % 5 - 1) for x in recv]
    ([(1, 1), (1, 3), (0, 0), (0, 1)], [(0, 1), (0, 2), (1, -1), (1, 1)])
    """
    n, length, p = len(f.kind), f.length, spec.p
    delay = np.concatenate([spec.sched.send_delay(p, spec.m, spec.v, s, length) for s in range(p)])
    lead = np.concatenate([spec.sched.recv_lead(p, spec.m, spec.v, s, length) for s in range(p)])
    cons = np.flatnonzero(f.cross)
    prod = f.dep[cons]

    def pack(flat: np.ndarray) -> np.ndarray:
        return (flat // length) * (length + 1) + flat % length + 1

    return pack(prod + delay[prod]), (cons // length) * (length + 1) + cons % length - lead[cons] + 1, cons


def _call_table(pairs, length: int, width: int, pad: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per slot of :func:`_rounds`, the call issued after it: (the slots of its peers, shape
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
    """:func:`_rounds` with asynchronous sends and finite times, in fewer array operations per
    round (one round per unit position: ~10^4 rounds at pp 128 x 4,096 micro-batches, so the
    per-round overhead is the cost): a unit not done has end NaN, so ``max(stream free, dep end +
    add)`` is NaN exactly when the dependency is not done (``np.maximum`` propagates NaN) and the
    stage keeps its unit; the same additions and maxima as :func:`_rounds` in the same order, so
    every time is bitwise equal. ``dep``, ``d_add``, ``d_dur``: per slot; ``cur``: each stage's
    first unit slot (its leading slot, end 0, just before). Returns (start, end) per slot."""
    end = np.full(len(dep), np.nan)
    end[cur - 1] = 0.0
    start = np.zeros(len(dep))
    free = np.zeros(len(cur))  # end of each stage's previous unit
    cur, stop = cur.copy(), cur + length
    while True:
        before = cur.copy()
        for _ in range(ROUNDS_PER_CHECK):
            ready = end[dep[cur]]
            ready += d_add[cur]
            st = np.maximum(free, ready)
            e = st + d_dur[cur]
            end[cur], start[cur] = e, st
            ok = e == e  # not NaN: the dependency was done
            np.copyto(free, e, where=ok)
            cur += ok
        if (cur == stop).all():
            return start, end
        if (cur == before).all():
            raise RuntimeError(f"schedule deadlocks at slots {cur.tolist()}")


def _rounds_blocking(d_dur: np.ndarray, cur: np.ndarray, length: int, peers: np.ndarray, p2p: np.ndarray):
    """:func:`_rounds` with blocking calls (``pairs``), finite times and every dependency an
    earlier unit of the same stage (the blocking path's: cross-stage inputs come in the calls),
    as :func:`_rounds_async` does it: ends NaN until done and the padding peer posted at -inf, so
    the end of the call before each stage's next unit, ``max(previous end, peer posts) + p2p``,
    is NaN while a peer has not posted, and so is the unit's start. That call's end is the
    unit's start: :func:`_rounds`' ``max(free, dep end)`` is ``free``, a same-stage dependency
    having ended before the previous unit did. ``peers`` (peers, slots) and ``p2p`` (0 for a
    call without peers: ``e + 0 = e``) are those of the call before each slot; ``d_dur`` NaN on
    the trailing slots (never run). Returns (start, end) per slot."""
    end = np.full(len(d_dur), np.nan)
    end[cur - 1], end[-1] = 0.0, -np.inf
    start = np.zeros(len(d_dur))
    prev_end = np.zeros(len(cur))
    cur, stop = cur.copy(), cur + length
    while True:
        before = cur.copy()
        for _ in range(ROUNDS_PER_CHECK):
            posts = end[peers.take(cur, axis=1)]  # (peers, stages)
            st = np.maximum(prev_end, posts[0])
            for row in posts[1:]:  # max(e, posts) + p2p, NaN while one has not posted
                np.maximum(st, row, out=st)
            st += p2p[cur]
            e = st + d_dur[cur]
            end[cur], start[cur] = e, st
            ok = e == e  # not NaN: the peers had posted
            np.copyto(prev_end, e, where=ok)
            cur += ok
        if (cur == stop).all():
            return start, end
        if (cur == before).all():
            raise RuntimeError(f"schedule deadlocks at slots {cur.tolist()}")


def _rounds(f: Flat, dur: np.ndarray, add: np.ndarray, pairs, p2p_s: float):
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
    :func:`_rounds_general`."""
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
        return _rounds_general(f, dur, add, None, p2p_s)
    peers, loads, has = _call_table(pairs, length, width, pad)
    p2p = p2p_s * loads  # per call: k p2p_s (simulate.call_loads)
    local = (f.dep >= n) | ((f.dep // max(length, 1) == pos // max(length, 1)) & (f.dep < pos))
    if not (finite and local.all() and np.isfinite(p2p).all() and not np.signbit(p2p).any()):
        return _rounds_general(f, dur, add, pairs, p2p_s)
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


def _rounds_general(f: Flat, dur: np.ndarray, add: np.ndarray, pairs, p2p_s: float):
    """:func:`_rounds` for any times (a ``done`` table, one round at a time)."""
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


def spec_durations(spec: PipelineSpec, f: Flat) -> np.ndarray:
    """Seconds of every flat unit by ``spec.unit_s`` (one call per distinct stage and unit)."""
    seen: dict = {}
    out = np.empty(len(f.kind))
    for i in range(len(f.kind)):
        s, u = i // f.length, Unit(KINDS[f.kind[i]], int(f.mb[i]), int(f.chunk[i]))
        out[i] = seen[(s, u)] if (s, u) in seen else seen.setdefault((s, u), spec.unit_s(s, u))
    return out
