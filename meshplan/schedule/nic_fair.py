"""How concurrent network collectives share a NIC (issue 11 item 2): max-min fair sharing of the
NIC's capacity given each one's demand (:func:`max_min_shares`), and the progress of the collectives
that run at once under it (:func:`fluid`), by which
:class:`~meshplan.schedule.nic_fair.NicBook` places each collective and moves the ones it
runs beside (earlier ones slowed by a later one too).

The rule's source: NCCL gives concurrent communicators no priority. Each posts its transfers on its
own queue pairs and the NIC serves them together: two concurrent nccl-tests broadcasts on one link
each ran at half the link's rate and together at its rate (NVIDIA/nccl issue #204); NCCL splits a
transfer over its channels' connections, two per NIC, to keep it near the NIC's rate (issue #438).
A collective's demand is the share of the NIC it holds alone (its bytes through the NIC at the
line rate over its time, :func:`~meshplan.schedule.comm_times.nic_share`): one that leaves the NIC
idle part of its time (latency, NVLink phases) holds less and is slowed less. Work-conserving: the
NIC's capacity not used by a collective whose demand is under the fair level goes to the others,
and while the demands running exceed the NIC it is full.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from typing import Optional

#: A pass of a unit whose network collectives' intervals differ from its forecast's by at most this
#: much (seconds) is settled (:func:`~meshplan.schedule.unit_sim.settle`).
SETTLED_S = 1e-9


def max_min_shares(demands) -> list[float]:
    """The share of a NIC of capacity 1 that each collective of ``demands`` running together gets
    under max-min fairness (water-filling): in ascending order of demand each gets its demand while
    it is under the level ``capacity left / collectives left``, the rest get the level.

    Demands 0.75 and 0.8: the level 1/2 under both, each gets half (the NIC full); 0.2 beside 0.9:
    0.2 gets all it wants, 0.9 the 0.8 left; three at 1.0: a third each; 0.3 and 0.5: room for both.

    >>> max_min_shares([0.75, 0.8]), max_min_shares([0.9, 0.2]), max_min_shares([0.3, 0.5])
    ([0.5, 0.5], [0.8, 0.2], [0.3, 0.5])
    >>> [round(x, 6) for x in max_min_shares([1.0, 1.0, 1.0])]
    [0.333333, 0.333333, 0.333333]
    """
    order = sorted(range(len(demands)), key=demands.__getitem__)
    out, cap = [0.0] * len(demands), 1.0
    for k, i in enumerate(order):
        level = cap / (len(order) - k)
        if demands[i] > level:
            for rest in order[k:]:
                out[rest] = level
            return out
        out[i] = demands[i]
        cap -= demands[i]
    return out


def fluid(parts, t0: float, background=()) -> list[tuple[float, list]]:
    """(end, segments) of each network collective of ``parts`` ((start, seconds of work left at
    ``max(start, t0)``, demand) each) from ``t0``, beside ``background`` ((start, end, demand) each:
    collectives whose intervals are taken as they are): between events (a start, an end, a
    background edge) each running one progresses at ``min(1, share / demand)``, its share of
    :func:`max_min_shares` of the demands running; ``segments``: (t0, t1, rate) of the intervals it
    ran in.

    Two bandwidth-bound collectives (demand 1) of 10 and 5 ms from 0: each at half until the second
    ends at 10 ms, the first alone then: it ends at 15 ms (the NIC's 15 ms of work in 15 ms). An
    all-gather (demand 0.75) with 9 ms of work left at 1 ms beside a cp send (0.8, 5 ms) from 1 ms:
    each at half, the send at 0.625 of its speed ends at 9 ms, the all-gather at 2/3 until then, its
    3.667 ms left alone after: 12.667 ms.

    >>> [round(e * 1e3, 3) for e, _ in fluid([(0.0, 0.010, 1.0), (0.0, 0.005, 1.0)], 0.0)]
    [15.0, 10.0]
    >>> [round(e * 1e3, 3) for e, _ in fluid([(0.0, 0.009, 0.75), (0.001, 0.005, 0.8)], 0.001)]
    [12.667, 9.0]
    """
    start, left, demand = [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts]
    ends: list = [None] * len(parts)
    segs: list[list] = [[] for _ in parts]
    bg = [b for b in background if b[1] > t0 or b[0] > t0]  # the others never run at or after t0
    # the event times after t0 (a start, a background edge), in order: the next one after t is the
    # first past ``k``, as the least of those after t over all parts and backgrounds would be
    times = sorted({a for a in start if a > t0}.union([x for b in bg for x in b[:2] if x > t0]))
    k, t, waiting, seen, running = 0, t0, list(range(len(parts))), -1, []
    while waiting:
        while k < len(times) and times[k] <= t:
            k += 1
        nxt = times[k] if k < len(times) else math.inf
        active = [i for i in waiting if start[i] <= t]
        if not active:
            t = nxt
            continue
        if k != seen:  # the backgrounds running change only at their edges, each one of ``times``
            seen, running = k, [b[2] for b in bg if b[0] <= t < b[1]]
        d = [demand[i] for i in active] + running
        shares = d if sum(d) <= 1.0 - 1e-12 else max_min_shares(d)  # room for all: each its demand
        rates = [min(1.0, f / x) for _, f, x in zip(active, shares, d)]
        done = [left[i] / r for i, r in zip(active, rates)]
        step = min(min(done), nxt - t)
        for i, r, x in zip(active, rates, done):
            if x <= step * (1 + 1e-12):
                ends[i] = t + x
                segs[i].append((t, t + x, r))
            else:
                left[i] -= r * step
                segs[i].append((t, t + step, r))
        waiting = [i for i in waiting if ends[i] is None]
        t += step
    return list(zip(ends, segs))


def done_by(segs, t: float) -> float:
    """Seconds of work the ``segs`` ((t0, t1, rate) each) did before ``t``.

    >>> done_by([(0.0, 1.0, 1.0), (1.0, 3.0, 0.5)], 2.0)
    1.5
    """
    return sum(r * (min(b, t) - a) for a, b, r in segs if a < t)


def residual(got: list, forecast: list) -> float:
    """How far a pass's network collectives ((start, end, ..., queue) each, in issue order) are
    from the ``forecast`` it was run with: the largest difference of a start or an end (seconds);
    inf where the pass issued other collectives (another count, or another queue at some place).
    Two starts both infinite (issued infinitely early) agree.

    >>> residual([(0.0, 2.0, 1.0, "fsdp", "fsdp")], [(0.0, 2.5, 1.0, "fsdp", "fsdp")])
    0.5
    """
    if len(got) != len(forecast) or any(x[4] != y[4] for x, y in zip(got, forecast)):
        return math.inf
    return max((abs(x[i] - y[i]) for x, y in zip(got, forecast) for i in (0, 1) if x[i] != y[i]), default=0.0)


def relax(forecast: Optional[list], got: list) -> list:
    """The next forecast of :func:`~meshplan.schedule.unit_sim.settle`: each collective's start and end
    the mean of the last ``forecast``'s and the last pass's (``got``), where both issued the same
    collectives (:func:`residual` finite); else ``got``. The mean of two schedules a pass apart stops
    a map that jumps between them (under-relaxation, as in Gauss-Seidel/SOR with factor 1/2).

    >>> relax([(0.0, 2.0, 1.0, "fsdp", "fsdp")], [(0.0, 3.0, 1.0, "fsdp", "fsdp")])
    [(0.0, 2.5, 1.0, 'fsdp', 'fsdp')]
    """
    if forecast is None or not math.isfinite(residual(got, forecast)):
        return got
    return [(_mid(x[0], y[0]), _mid(x[1], y[1]), *x[2:]) for x, y in zip(got, forecast)]


def _mid(a: float, b: float) -> float:
    """The mean of ``a`` and ``b``; ``a`` where they are equal (both infinite included)."""
    return a if a == b else (a + b) / 2


#: Two times closer than this (seconds) are the same time.
EPS_S = 1e-12


class NicBook:
    """One unit's network collectives as placed (:class:`~meshplan.schedule.nic_fair.NicBook`):
    each one's start, end, seconds of work alone, demand, shown stream, queue, segments, event and the
    times its consumers read its end (``after``: the consumer's start; ``overlap``: its end). Placing a
    collective runs :func:`fluid` over it and every one still running at its start (or starting later),
    so an earlier one slowed ends later: its event's end moves, and its queue's free time. Where a
    consumer already placed read the old end (it waited too little, or was held by it), the pass is
    ``moved``: :func:`~meshplan.schedule.unit_sim.settle` issues the unit again with this pass's
    intervals as the ``forecast``, each collective then placed beside the later ones' forecast
    intervals from its start (as background, :func:`fluid`)."""

    def __init__(self, free, forecast=None):
        self.free = free  # queue -> free time (StreamSim.free), moved with its last collective
        self.nets: list[list] = []
        self.by_queue: dict[str, list[int]] = {}
        self.starts: dict[str, list[float]] = {}  # queue -> its collectives' starts (sorted: one after another)
        self.of: dict[int, int] = {}  # id(event) -> index
        self.moved = False
        # queue -> (starts, indices, (start, end, demand, index) each), in issue order
        self.ahead: dict[str, tuple[list, list, list]] = {}
        for k, (a, b, f, _, q) in enumerate(forecast or ()):
            starts, idx, held = self.ahead.setdefault(q, ([], [], []))
            starts.append(a)
            idx.append(k)
            held.append((a, b, f, k))
        self.queues = [x[4] for x in forecast or ()]
        self.forecast_start = [x[0] for x in forecast or ()]

    def _running(self, t: float) -> list[int]:
        """Indices of the collectives placed that end after ``t`` (a queue's collectives run one
        after another: the last few of each)."""
        out = []
        for idx in self.by_queue.values():
            for k in reversed(idx):
                if self.nets[k][1] <= t:
                    break
                out.append(k)
        return out

    def _background(self, j: int, start: float, horizon: float) -> list:
        """The forecast intervals of the collectives issued after the ``j``-th that run between
        ``start`` and ``horizon``."""
        if self.ahead and (j >= len(self.queues) or self.queues[j] != self.nets[j][5]):
            self.ahead = {}  # this pass issues other collectives than the last: no forecast past here
        out = []
        for q, (starts, idx, held) in self.ahead.items():
            if q != self.nets[j][5]:  # a later one on j's own queue starts after j ends: never beside it
                later = held[bisect_right(idx, j):bisect_left(starts, horizon)]  # issued after j, starting before
                out += [h[:3] for h in later if h[1] > start]
        return out

    def place(self, queue: str, shown: str, start: float, work: float, demand: float) -> tuple[int, float]:
        """(index, end) of a collective of ``work`` seconds alone and ``demand`` issued on ``queue`` at
        ``start``; the collectives running beside it are moved (:class:`NicBook`). Under a forecast the
        ones beside it run again from the earlier of its start and its forecast start (where it starts
        later than forecast they ran slowed by its forecast interval, which it no longer has), and
        a later collective forecast on its own queue is never beside it (it starts after it ends)."""
        j = len(self.nets)
        self.nets.append([start, start + work, work, demand, shown, queue, [], None, []])
        self.by_queue.setdefault(queue, []).append(j)
        self.starts.setdefault(queue, []).append(start)
        if not math.isfinite(start):  # issued infinitely early (a window UNSHARD hidden: window_unshard)
            return j, start + work
        bg = self._background(j, start, start + work * (len(self.by_queue) + len(self.ahead) + 1))
        # where the forecast had this one start earlier, the ones beside it ran slowed by it since then
        t0 = min(start, self.forecast_start[j]) if self.ahead else start
        others = [k for k in self._running(t0) if k != j]
        if not others and not bg:
            self.nets[j][6] = [(start, start + work, 1.0)]
            return j, start + work
        ids = [*others, j]
        parts = [(max(self.nets[k][0], t0), self.nets[k][2] - done_by(self.nets[k][6], t0), self.nets[k][3])
                 for k in ids]
        for k, (end, segs) in zip(ids, fluid(parts, t0, bg)):
            net = self.nets[k]
            net[6] = [(a, min(b, t0), r) for a, b, r in net[6] if a < t0] + segs
            if k != j and abs(end - net[1]) > EPS_S:
                self._move(k, end)
            net[1] = end
        return j, self.nets[j][1]

    def _move(self, k: int, end: float) -> None:
        """Collective ``k`` ends at ``end`` now: its event and queue follow; a consumer that read
        its old end makes the pass ``moved``."""
        net = self.nets[k]
        old = net[1]
        if net[7] is not None:
            object.__setattr__(net[7], "end_s", end)  # the one event every holder shares
        if self.by_queue[net[5]][-1] == k:
            self.free[net[5]] = end
        if any(end > c + EPS_S or (abs(c - old) <= EPS_S and end < old - EPS_S) for c in net[8]):
            self.moved = True

    def attach(self, j: int, ev) -> None:
        """The event of collective ``j``."""
        self.nets[j][7] = ev
        self.of[id(ev)] = j

    def read(self, ev, at: float) -> None:
        """A consumer placed read ``ev``'s end at time ``at`` (a network collective's: kept)."""
        k = self.of.get(id(ev))
        if k is not None:
            self.nets[k][8].append(at)

    def intervals(self) -> list[tuple]:
        """(start, end, demand, shown stream, queue) of each collective, in issue order."""
        return [(n[0], n[1], n[3], n[4], n[5]) for n in self.nets]

    def waits(self) -> dict:
        """{(stream, other stream): seconds}: each collective's lengthening (its end less its start
        and work) charged to the streams of those it ran beside, by demand x overlap."""
        out: dict = {}
        for j, (a, b, work, _, who, _, _, _, _) in enumerate(self.nets):
            late = b - a - work
            if not late > EPS_S:  # nan: issued infinitely early (place)
                continue
            weights: dict = {}
            for k in self._overlapping(j, a, b):
                o = self.nets[k]
                weights[o[4]] = weights.get(o[4], 0.0) + o[3] * (min(o[1], b) - max(o[0], a))
            total = sum(weights.values())
            for other, w in weights.items():
                if w > 0:
                    out[(who, other)] = out.get((who, other), 0.0) + late * w / total
        return out

    def _overlapping(self, j: int, a: float, b: float) -> list[int]:
        """Indices of the collectives but ``j`` whose intervals meet (a, b)."""
        out = []
        for q, idx in self.by_queue.items():
            for k in reversed(idx[:bisect_left(self.starts[q], b)]):
                if self.nets[k][1] <= a:
                    break
                if k != j:
                    out.append(k)
        return out
