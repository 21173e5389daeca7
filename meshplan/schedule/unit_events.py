"""The event-ordered (discrete-event, fluid) run of one unit's task graph (issue 11 item 2):
:class:`~meshplan.schedule.unit_sim.StreamSim` records the tasks a unit issues (:class:`Task`: its
stream's queue, the tasks it waits for) and :func:`run` plays them once, in time order. Time
advances to the next event: a task's start, allowed by its queue (the task issued before it on
the same queue has ended: CUDA streams run their kernels in order) and its dependencies, or the
earliest end of a running task at the current rates. At each event the rates of the running tasks
are recomputed: every network collective's from the max-min fair shares of the NIC among those
running (:func:`~meshplan.schedule.nic_fair.max_min_shares`; each at ``min(1, share / demand)`` of
its speed alone), and the running kernel's from the SMs the collectives issued before it hold
(``1 - min(MAX_SM_SHARE, sum of their shares)``, the rule of the issue-order ``unit_sim.progress`` it replaces: a
kernel is slowed by the collectives issued before it only, as the issue-order simulation that the
unit timelines were built on took it). Nothing placed is moved afterwards: a later collective
slows an earlier one from its own start on, through the rates, so no fixed point is sought.
Where no two network collectives run at once every task starts and ends where the issue-order
simulation placed it (its start the latest of its queue's and dependencies' ends; its end its start
plus its seconds, stretched by the SM rule only). Each event costs O(running tasks): the whole run
O(events x running tasks), events at most three a task (start, work done, end). Measured
(benchmarks/bench_search.py, 2 workers, this 2-core machine, two runs each back to back): the 405B
search 9.22 / 9.22 CPU s against main's issue-order simulation's 7.37 / 7.84 (1.21x; nicshare4's
pass iteration 2.5x), the seed's 13.13 / 13.05 against 9.85 / 9.17 (1.38x).
"""

from __future__ import annotations

import math
from heapq import heapify, heappop, heappush
from typing import Optional

from meshplan.schedule.nic_fair import max_min_shares

#: Task kinds: a kernel on the compute stream (SM-slowed), a network collective (NIC-shared), a
#: collective off the NIC (its table time), a span of fixed length on a queue (the host's issue, a
#: wait, a copy placed after the unit's compute), a transfer shown at a fixed offset of its owner.
COMPUTE, NET, COMM, FIXED, PINNED = range(5)

#: Demands summing to less than the NIC by more than this all run at full speed (float slack).
ROOM = 1e-12


class Task:
    """One task of a unit: ``kind``, its ``queue``, its event (``ev``: start and end set by
    :func:`run`), ``work`` (seconds alone), ``demand`` (share of the NIC alone, NET), ``sm`` (share
    of the SMs it holds while it runs, collectives). Waits for: ``deps`` (their ends; its queue's
    previous task among them), ``overlap`` (COMPUTE: starts once the first has started, ends no
    earlier than all have ended), ``hold`` (FIXED: ends no earlier than these end), ``owner``
    (PINNED: starts ``offset`` seconds after its owner starts). ``floor``: no start before (a
    queue's first task, from the queue's free time); ``end_floor``: no end before (the host's issue
    clock); ``cond``: shown only where it took time (a wait that found its collective done).
    ``last``/``after``: a kernel's ready times in the order the exposure rule reads them."""

    __slots__ = ("i", "kind", "queue", "ev", "work", "demand", "sm", "deps", "overlap", "hold", "owner",
                 "offset", "floor", "end_floor", "cond", "last", "after", "pred", "host",
                 "need", "ready", "hold_need", "succ", "start_succ", "hold_succ", "start", "end", "done",
                 "left", "anchor", "rate", "finish", "emit", "sms", "extra")
    overlap: tuple["Task", ...]
    hold: tuple["Task", ...]
    after: tuple["Task", ...]
    owner: Optional["Task"]
    last: Optional["Task"]
    succ: Optional[list["Task"]]
    start_succ: Optional[list["Task"]]
    hold_succ: Optional[list["Task"]]
    need: int
    ready: float
    left: float
    anchor: float
    rate: float
    finish: float
    sms: int

    def __init__(self, i: int, kind: int, queue: str, ev, work: float = 0.0, demand: float = 0.0, sm: float = 0.0,
                 deps: Optional[list] = None, pred: Optional["Task"] = None, floor: float = 0.0):
        # what :func:`run` sets before it reads it (``need``, ``ready``; a started task's ``left``,
        # ``anchor``, ``rate``, ``finish``, ``sms``) is left unset: 442,197 tasks per 405B search
        self.i, self.kind, self.queue, self.ev, self.work, self.demand, self.sm = i, kind, queue, ev, work, demand, sm
        self.deps: list[Task] = [] if deps is None else deps
        self.pred: Optional[Task] = pred
        self.floor = floor
        self.overlap = self.hold = self.after = ()
        self.owner = self.last = self.succ = self.start_succ = self.hold_succ = None
        self.offset = self.extra = 0.0
        self.end_floor = -math.inf
        self.cond = self.host = False
        self.start = self.end = self.done = math.nan
        self.emit, self.hold_need = True, 0


class Totals:
    """What a run adds up (seconds): ``exposed`` per stream, the compute stream's ``host_wait`` and
    SM ``contention`` (:meth:`~meshplan.schedule.unit_sim.StreamSim.compute`'s rules)."""

    def __init__(self):
        self.exposed: dict[str, float] = {}
        self.host_wait = 0.0
        self.contention = 0.0

    def expose(self, stream: str, s: float) -> None:
        self.exposed[stream] = self.exposed.get(stream, 0.0) + s


class _Run:
    """The state of :func:`run`: the ready heap ((ready time, index)), the running tasks."""

    def __init__(self, tasks: list, cap: float):
        self.tasks, self.cap, self.tot = tasks, cap, Totals()
        self.heap: list = []
        self.running: list[Task] = []
        self.comp: Optional[Task] = None  # the kernel running (its work not done), if any
        self.net_dirty = False
        self.sm_edges: list[int] = []  # indices of SM-holding collectives that started or ended this event
        push = self.heap.append
        for t in tasks:
            deps = t.deps
            for d in deps:
                if d.succ is None:
                    d.succ = [t]
                else:
                    d.succ.append(t)
            t.need = len(deps)
            if t.overlap:
                t.need += 1
                for o in t.overlap:
                    if o.start_succ is None:
                        o.start_succ = [t]
                    else:
                        o.start_succ.append(t)
            if t.hold:
                t.hold_need = len(t.hold)
                for h in t.hold:
                    if h.hold_succ is None:
                        h.hold_succ = [t]
                    else:
                        h.hold_succ.append(t)
            if t.owner is not None:
                t.need += 1
                if t.owner.start_succ is None:
                    t.owner.start_succ = [t]
                else:
                    t.owner.start_succ.append(t)
            t.ready = t.floor
            if t.need == 0:
                push((t.floor, t.i))
        heapify(self.heap)

    def go(self) -> None:
        now = -math.inf
        heap, running, tasks = self.heap, self.running, self.tasks
        inf, start, work_done, sm_edges = math.inf, self._start, self._work_done, self.sm_edges
        while True:
            t_end = inf
            for t in running:
                if t.finish < t_end:
                    t_end = t.finish
            t_start = heap[0][0] if heap else inf
            if t_end == inf and t_start == inf:
                break
            if t_end <= t_start:
                now = t_end
                if len(running) == 1:  # the one running ends (its finish is t_end)
                    work_done(running.pop(), now)
                else:
                    for t in [t for t in running if t.finish <= now]:
                        running.remove(t)
                        work_done(t, now)
            else:
                now = t_start
                while heap and heap[0][0] <= now:
                    start(tasks[heappop(heap)[1]], now)
            # rates move only where a collective's NIC share changed or the running kernel may be
            # slowed anew (its SM rate not set yet, or an SM-holding collective began or ended)
            comp = self.comp
            if self.net_dirty or (comp is not None and (comp.sms < 0 or sm_edges)):
                self._rates(now)
            elif sm_edges:
                sm_edges.clear()
        if any(math.isnan(t.end) for t in self.tasks):
            raise RuntimeError("unit task graph left tasks unrun (a dependency cycle)")

    # -- starts --------------------------------------------------------------------------------
    def _start(self, t: Task, now: float) -> None:
        ready = t.ready
        t.start = start = ready if ready >= now or now == -math.inf else now
        if t.start_succ:
            for s in t.start_succ:
                self._started(s, t, start)
        kind = t.kind
        if kind == COMPUTE:
            self._expose_start(t)
            if t.work <= 0:
                self._work_done(t, start)
                return
            t.left, t.anchor, t.rate = t.work, start, 1.0
            t.sms = -1  # its SM rate set by _rates
            t.finish = start + t.work
            self.comp = t
            self.running.append(t)
            return
        if t.sm > 0:
            self.sm_edges.append(t.i)
        if kind == NET and start > -math.inf:
            t.left, t.anchor, t.rate, t.finish = t.work, start, 0.0, math.inf  # its rate set by _rates
            self.net_dirty = True
            self.running.append(t)
            return
        if kind == FIXED:
            t.finish = max(start + t.work, t.end_floor)
        else:  # COMM, PINNED, a NET collective issued infinitely early (placed alone)
            t.finish = start + t.work
        if t.finish == start:
            self._work_done(t, start)
        else:
            self.running.append(t)

    def _started(self, s: Task, t: Task, at: float) -> None:
        """``t`` started at ``at``: ``s`` overlaps it (COMPUTE: the first start lets it start) or is
        pinned to it."""
        if s.kind == PINNED:
            s.ready = at + s.offset
        elif s.overlap and any(o is not t and not math.isnan(o.start) for o in s.overlap):
            return  # an earlier overlapped collective already let it start
        else:
            s.ready = max(s.ready, at)
        self._need(s)

    def _need(self, s: Task) -> None:
        s.need -= 1
        if s.need == 0:
            heappush(self.heap, (s.ready, s.i))

    def _expose_start(self, t: Task) -> None:
        """A kernel's start: the compute stream waited from its free time for the first latest of
        its ready times (the last kernel's end, each dependency's end, the first overlapped
        collective's start); that one's stream is charged (not the compute stream's own)."""
        free = t.pred.end if t.pred is not None else t.floor
        if not t.start > free:  # it did not wait: nothing exposed, a conditional wait not shown
            if t.cond:
                t.emit = False
            return
        ready = [(a.end, a) for a in (t.last, *t.after) if a is not None]
        if t.overlap:
            first = min((o for o in t.overlap if not math.isnan(o.start)), key=lambda o: o.start)
            ready.append((first.start, first))
        latest, binding = -math.inf, None
        for x, a in ready:
            if binding is None or x > latest:
                latest, binding = x, a
        if binding is not None and binding.ev.stream != "compute":
            self.tot.expose(binding.ev.stream, t.start - free)

    # -- rates ---------------------------------------------------------------------------------
    def _rates(self, now: float) -> None:
        if self.net_dirty:
            self.net_dirty = False
            nets = [t for t in self.running if t.kind == NET]
            d = [t.demand for t in nets]
            shares = d if sum(d) <= 1.0 - ROOM else max_min_shares(d)
            for t, f, x in zip(nets, shares, d):
                r = min(1.0, f / x)
                if r != t.rate:
                    _reanchor(t, now, r)
        comp = self.comp
        if comp is not None and (comp.sms < 0 or (self.sm_edges and min(self.sm_edges) < comp.i)):
            ci = comp.i
            rate = 1.0 - min(self.cap, sum([t.sm for t in self.running if t.sm > 0 and t.i < ci]))
            comp.sms = 1
            # anchored now at this rate (it started now, not slowed): _reanchor would leave it as it is
            if not (rate == comp.rate and comp.anchor == now and now > -math.inf):
                _reanchor(comp, now, rate)
        self.sm_edges.clear()

    # -- ends ----------------------------------------------------------------------------------
    def _work_done(self, t: Task, now: float) -> None:
        t.done = now
        if t is self.comp:
            self.comp = None
        if t.kind == NET:
            self.net_dirty = True
        if t.sm > 0:
            self.sm_edges.append(t.i)
        if t.hold_need == 0:
            self._end(t, now)

    def _end(self, t: Task, now: float) -> None:
        t.end = now
        kind = t.kind
        if kind == COMPUTE:
            self._expose_end(t)
        elif kind == FIXED and not now > t.start and (t.cond or t.host):
            t.emit = False
        elif kind == FIXED and t.host:
            self.tot.host_wait += now - t.start
        succ = t.succ
        if succ:
            heap = self.heap
            for s in succ:
                if now > s.ready:
                    s.ready = now
                s.need -= 1
                if s.need == 0:
                    heappush(heap, (s.ready, s.i))
        if t.hold_succ:
            for h in t.hold_succ:
                h.hold_need -= 1
                if h.hold_need == 0 and not math.isnan(h.done):
                    self._end(h, now)

    def _expose_end(self, t: Task) -> None:
        """A kernel's end, the latest of its work's and its overlapped collectives' ends: the
        first collective that held it past its own seconds is charged the time beyond them; where
        its work ended it, the SM slowdown is contention."""
        own = t.start + t.work
        for o in t.overlap:
            if o.end > own and o.end == t.end:
                self.tot.expose(o.ev.stream, t.end - own)
                break
        if t.end == t.done:
            self.tot.contention += t.done - own
        if t.extra:
            self.tot.expose("tp", t.extra)


def _reanchor(t: Task, now: float, rate: float) -> None:
    """``t`` runs at ``rate`` from ``now``: its work left counted at the old rate up to now."""
    if t.rate > 0:
        t.left -= (now - t.anchor) * t.rate
    t.anchor, t.rate = now, rate
    t.finish = now + t.left / rate if t.left > 0 else now


def run(tasks: list, cap: float) -> Totals:
    """Plays ``tasks`` (in issue order, indices ``0..n-1``) in time order (module docstring), each
    kernel at most ``cap`` of its SMs taken; every task's ``start``, ``done`` and ``end`` set, its
    event's times with them; returns what the run adds up."""
    r = _Run(tasks, cap)
    r.go()
    for t in tasks:  # a task not shown (``emit`` False) keeps its times too: a builder may hold its event
        d = t.ev.__dict__  # the frozen Event's fields, set as object.__setattr__ sets them
        d["start_s"], d["end_s"] = t.start, t.end
        t.succ = t.start_succ = t.hold_succ = None  # no cycles left: the tasks go with their unit
    return r.tot
