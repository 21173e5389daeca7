"""Event simulation of one pipeline step: per-stage orders of forward (F), backward (B) and
weight-gradient (W) units, their dependencies, start and end times, critical path and bubble
(the Chrome/Perfetto trace of its events: :mod:`meshplan.pipeline.trace`).

Schedules (p stages, m micro-batches, v virtual stages per rank) are the registered ones
(:data:`meshplan.pipeline.registry.SCHEDULES`): each module (:mod:`.gpipe`,
:mod:`.one_f_one_b`, :mod:`.interleaved`, :mod:`.zb_h1`, :mod:`.zbv`, :mod:`.dualpipev`) gives its per-stage order, its
chunk-to-virtual-stage map and its closed-form bubble for uniform stages and no p2p time
(:func:`bubble_formula`): ``(p-1)/m`` for GPipe and 1F1B, ``(p-1)/(v m)`` interleaved,
``(p-1)(F+B-W) / (m(F+B+W))`` ZB-H1 (m >= p, W <= min(F, B)), ``(p-1)(F+B-2W) / (m(F+B+W))``
ZB-V; the simulation reproduces them.

``F``, ``B``, ``W`` are a stage's times for one micro-batch over all its layers; a chunk
takes ``1/v`` of them. Unless the schedule splits the backward (``splits_backward``:
ZB-H1) a backward unit is B + W (the input gradient is sent after the whole backward).
ZB-H1 keeps 1F1B's peak over stages, not per stage: every stage holds up to p micro-batches
from F to W (``p-s-1`` warm-up + ``s+1`` lagged W), where 1F1B's stage s holds ``p-s`` (W
keeps the inputs and output gradients, less than all of B's activations).

Dependencies, by virtual stage (the schedule's map of a stage's chunk to its model
position, :meth:`~.base.PipelineSchedule.virtual_stage`): F of virtual stage j needs F of
j-1 (plus ``p2p_s`` across stages); B of j needs B of j+1 (the last virtual stage needs its
own F); W needs its B. Each stage runs its order on one compute stream; a unit starts when
the stream is free and its dependency is done (list scheduling with fixed orders: exact
earliest times).

Sends are asynchronous unless ``blocking_p2p``: Megatron-LM 2022 (commit 2755bcb,
``megatron/p2p_communication.py`` ``_communicate``: the call's isend/irecv ops go to
``torch.distributed.batch_isend_irecv``, calls ``wait`` on every request, then
``torch.cuda.synchronize``; ``megatron/schedules.py`` issues one such call between units), where
the two stages of every transfer rendezvous. After each unit a stage issues one combined call
(:func:`calls`) holding the sends of the outputs it issues there (a unit's output leaves
:meth:`~.base.PipelineSchedule.send_delay` units after it; interleaved: a steady-state forward's
with the next backward's) and the receives it posts there (a unit's input is received
:meth:`~.base.PipelineSchedule.recv_lead` units before it: the call right before it, interleaved
steady-state backwards two); a stage's receives before its first unit are posted at 0. A
transfer starts when both its calls are posted (each at the end of its issuing unit) and takes
``p2p_s``; a call ends when all its transfers do, and the next unit starts then: ``free = max(end,
max over the call's peers of their post time) + k p2p_s`` (``end`` alone for an empty call), where
``k`` (:func:`call_loads`) is the larger of the call's sends and receives: a rank's transfers
share its link (its one NIC across nodes: Megatron's interleaved steady-state call sends the
forward output to the next stage and the input gradient to the previous one through the same
NIC), and ``p2p_s`` is one send/recv pair at the link's rate (catalog ``p2p`` curve). A send
therefore holds its stage until the receiver reaches its receive, and a late receiver also pays
the transfer. Simplification: Megatron's warm-up ``send_forward`` then ``recv_forward`` (and the
cool-down's ``recv_backward`` then ``send_backward``) are two calls one after the other; here they
are one call posted at once.

With ``torch_p2p`` the calls are torch 2.13's GPipe and 1F1B ``_step_microbatches``
(:meth:`~.base.PipelineSchedule.torch_p2p_calls`: 1F1B's fused send + receive one call; some
sends without a wait).

With ``overlap_p2p`` (Megatron-LM's ``overlap_p2p_comm``; interleaved only,
:meth:`~.base.PipelineSchedule.p2p_calls`) the steady state's sides are asynchronous: in no call
(no hold, no load ``k``); a unit whose input is received so starts at ``max(free, max(send post,
receive post) + p2p_s)``, and a waited send to such a receive holds its call until the receive
is posted. Each asynchronous transfer takes ``p2p_s`` alone. Not modelled: the wait for the
previous same-direction send one unit later (``send_next_wait_handle``), binding only when a
transfer outlasts the units between.

Bubble (named): for the busiest stage, ``idle = step - busy``; ``bubble`` = idle / ideal
(ideal = busy), ``bubble_of_total`` = idle / step. Handed case C11, p 4, m 8:

>>> r = simulate(PipelineSpec("1f1b", p=4, m=8))
>>> round(r.bubble, 4), round(r.bubble_of_total, 4)
(0.375, 0.2727)
>>> r = simulate(PipelineSpec("interleaved_1f1b", p=4, m=8, v=2))
>>> round(r.bubble, 4), round(r.bubble_of_total, 4)
(0.1875, 0.1579)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

from meshplan.errors import ConfigError
from meshplan.pipeline.base import PipelineSchedule, Unit
from meshplan.pipeline.registry import SCHEDULES, check_chunks, get
from meshplan.spec.mesh import Schedule

__all__ = ["SCHEDULES", "Unit", "PipelineSpec", "PipelineResult", "Event", "simulate", "stage_order", "bubble_formula"]


def stage_order(schedule: Schedule | str, p: int, m: int, v: int, s: int) -> list[Unit]:
    """The order of ``schedule`` on stage ``s`` (its registered object's :meth:`order`)."""
    return get(schedule).order(p, m, v, s)


@dataclass(frozen=True)
class PipelineSpec:
    """Abstract pipeline input: ``schedule`` (a :class:`Schedule` or its name, stored as the
    enum; :attr:`sched` is its registered object), ``p`` stages, ``m`` micro-batches, ``v``
    virtual stages per rank; per stage and micro-batch ``forward_s`` (F), ``backward_s`` (B, input
    gradient) and ``weight_s`` (W); ``p2p_s`` per stage-to-stage send; ``blocking_p2p``: sends
    block their stage (module docstring); ``overlap_p2p`` (with ``blocking_p2p``): Megatron-LM's
    ``overlap_p2p_comm``, the steady state's transfers asynchronous (module docstring); ``torch_p2p`` (with
    ``blocking_p2p``): the calls are torch 2.13's single-stage ``_step_microbatches``' instead of
    Megatron-LM's (:meth:`p2p_calls`). ``duration`` (optional) overrides:
    ``duration(stage, unit) -> seconds`` for the whole unit."""

    schedule: Schedule
    p: int
    m: int
    v: int = 1
    forward_s: float = 1.0
    backward_s: float = 2.0
    weight_s: float = 0.0
    p2p_s: float = 0.0
    blocking_p2p: bool = False
    overlap_p2p: bool = False
    torch_p2p: bool = False
    duration: Optional[Callable[[int, Unit], float]] = field(default=None, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "schedule", get(self.schedule).name)  # a name parses to the enum
        if self.p < 1 or self.m < 1 or self.v < 1:
            raise ConfigError("pipeline", f"p {self.p}, m {self.m}, v {self.v} must all be >= 1")
        check_chunks(self.schedule, self.v)
        fixed = self.sched.chunks is not None
        bad = self.sched.reasons(self.p, self.m, self.v) if self.sched.virtual_stages and (self.v > 1 or fixed) else []
        if bad:  # the rule its order needs (interleaved: torch's rounds divide m; V-shaped: v 2, DualPipeV m >= 2p)
            raise ConfigError("mesh.pp_schedule", bad[0])
        if self.torch_p2p and not (self.blocking_p2p and not self.overlap_p2p and self.sched.torch_waits):
            raise ConfigError("pipeline", f"torch_p2p needs blocking_p2p, no overlap_p2p and a schedule torch runs "
                              f"single-stage (gpipe, 1f1b), not {self.schedule} with blocking_p2p {self.blocking_p2p}, "
                              f"overlap_p2p {self.overlap_p2p}")

    @property
    def sched(self) -> PipelineSchedule:
        """The registered schedule object."""
        return get(self.schedule)

    def p2p_calls(self, s: int, length: int):
        """Stage ``s``'s blocking calls per unit of its order (``length`` units), for :func:`calls`
        and :func:`meshplan.pipeline.fast.rendezvous`: torch's under ``torch_p2p``
        (:meth:`~.base.PipelineSchedule.torch_p2p_calls`), else Megatron-LM's (``p2p_calls``)."""
        if self.torch_p2p:
            return self.sched.torch_p2p_calls(self.p, self.m, self.v, s, length)
        return self.sched.p2p_calls(self.p, self.m, self.v, s, length, self.overlap_p2p)

    def unit_s(self, stage: int, u: Unit) -> float:
        if self.duration is not None:
            return self.duration(stage, u)
        if u.kind == "F":
            return self.forward_s / self.v
        if u.kind == "W":
            return self.weight_s / self.v
        return (self.backward_s + (0.0 if self.sched.splits_backward else self.weight_s)) / self.v


@dataclass(frozen=True)
class Event:
    """One interval on one stream of one stage (seconds)."""

    stage: int
    stream: str
    name: str
    start_s: float
    end_s: float
    args: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def dur_s(self) -> float:
        return self.end_s - self.start_s


class BubbleStats:
    """Bubble of a simulated step from ``step_s`` and each stage's ``busy_s`` (named: idle /
    ideal and idle / total of the busiest stage). Shared by :class:`PipelineResult` and the
    array result of :mod:`meshplan.pipeline.fast`."""

    step_s: float
    busy_s: tuple[float, ...]

    @property
    def busiest_stage(self) -> int:
        return max(range(len(self.busy_s)), key=lambda s: self.busy_s[s])

    @property
    def idle_s(self) -> float:
        return self.step_s - self.busy_s[self.busiest_stage]

    @property
    def bubble(self) -> float:
        """idle / ideal of the busiest stage."""
        return self.idle_s / self.busy_s[self.busiest_stage]

    @property
    def bubble_of_total(self) -> float:
        """idle / step time of the busiest stage."""
        return self.idle_s / self.step_s


@dataclass(frozen=True)
class PipelineResult(BubbleStats):
    """Simulated step: ``events`` (units on "compute", sends on "pp"), ``step_s``,
    ``busy_s`` per stage, ``critical_path`` (events from first to last, each with
    ``args['via']``: "stream" or "p2p"), and the bubble (module docstring)."""

    spec: PipelineSpec
    events: tuple[Event, ...]
    step_s: float
    busy_s: tuple[float, ...]
    critical_path: tuple[Event, ...]


def _dep(sched: PipelineSchedule, u: Unit, s: int, p: int, v: int) -> Optional[tuple[str, int, int]]:
    """(kind, mb, virtual stage) that ``u`` on stage ``s`` waits for, or None; the virtual
    stage of a chunk is the schedule's (:meth:`~.base.PipelineSchedule.virtual_stage`)."""
    j = sched.virtual_stage(u.chunk, s, p, v)
    if u.kind == "F":
        return ("F", u.mb, j - 1) if j > 0 else None
    if u.kind == "W":
        return ("B", u.mb, j)
    return ("B", u.mb, j + 1) if j < p * v - 1 else ("F", u.mb, j)


def calls(spec: PipelineSpec, orders: list[list[Unit]]) -> tuple[dict, dict]:
    """Megatron-LM's combined p2p calls (module docstring) of ``orders``: (``peers``:
    (stage, position) of a call, position -1 before the first unit -> the sorted (stage,
    position) of the peer call of each of its waited transfers (an asynchronous side, under
    ``overlap_p2p``, is in no call); ``xfer``: (consumer stage, position) -> ((producer stage,
    producer position), send call, receive call, send asynchronous, receive asynchronous)).

    >>> o = [stage_order("1f1b", 2, 2, 1, s) for s in range(2)]  # stage 0: F0 F1 B0 B1; 1: F0 B0 F1 B1
    >>> peers, _ = calls(PipelineSpec("1f1b", 2, 2, blocking_p2p=True), o)
    >>> sorted(peers.items())[:3]
    [((0, 0), [(1, -1)]), ((0, 1), [(1, 1), (1, 1)]), ((0, 2), [(1, 3)])]
    """
    p, m, v, sched = spec.p, spec.m, spec.v, spec.sched
    where = {(u.kind, u.mb, sched.virtual_stage(u.chunk, s, p, v)): (s, i) for s, o in enumerate(orders)
             for i, u in enumerate(o)}
    delay, lead, send_async, recv_async = zip(*[spec.p2p_calls(s, len(o)) for s, o in enumerate(orders)]) \
        if orders else ((),) * 4
    peers: dict = {}
    xfer: dict = {}
    for s, order in enumerate(orders):
        for i, u in enumerate(order):
            key = _dep(sched, u, s, p, v)
            if key is None or sched.stage_of(key[2], p, v) == s:
                continue
            a, ia = where[key]
            send, recv = (a, ia + int(delay[a][ia])), (s, i - int(lead[s][i]))
            if not send_async[a][ia]:  # a waited side holds its call until the other side posts
                peers.setdefault(send, []).append(recv)
            if not recv_async[s][i]:
                peers.setdefault(recv, []).append(send)
            xfer[(s, i)] = ((a, ia), send, recv, bool(send_async[a][ia]), bool(recv_async[s][i]))
    return {k: sorted(x) for k, x in peers.items()}, xfer


def call_loads(xfer: dict) -> dict:
    """(stage, position) of a call -> ``k``, the larger of its waited sends and receives (at
    least 1), from :func:`calls`' ``xfer``: its transfers one after another on the rank's link.

    1F1B's calls carry at most one send and one receive; interleaved 1F1B's steady state (p 2,
    m 4, v 2) sends a forward output and an input gradient in one call, 6 such calls of 22:

    >>> from collections import Counter
    >>> def loads(spec):
    ...     o = [spec.sched.order(spec.p, spec.m, spec.v, s) for s in range(spec.p)]
    ...     return sorted(Counter(call_loads(calls(spec, o)[1]).values()).items())
    >>> loads(PipelineSpec("1f1b", 2, 2, blocking_p2p=True))
    [(1, 6)]
    >>> loads(PipelineSpec("interleaved_1f1b", 2, 4, v=2, blocking_p2p=True))
    [(1, 16), (2, 6)]
    """
    out = Counter(x[1] for x in xfer.values() if not x[3])
    inc = Counter(x[2] for x in xfer.values() if not x[4])
    return {k: max(out[k], inc[k]) for k in out.keys() | inc.keys()}


def simulate(spec: PipelineSpec) -> PipelineResult:
    """Run every stage's order (:func:`stage_order`) to completion; see the module docstring."""
    p, v, sched = spec.p, spec.v, spec.sched
    orders = [sched.order(p, spec.m, v, s) for s in range(p)]
    if spec.blocking_p2p:
        return _simulate_rendezvous(spec, orders)
    done: dict[tuple[str, int, int], Event] = {}
    events: list[Event] = []
    ptr, free = [0] * p, [0.0] * p
    last: list[Optional[Event]] = [None] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            while ptr[s] < len(orders[s]):
                u = orders[s][ptr[s]]
                key = _dep(sched, u, s, p, v)
                cross = key is not None and sched.stage_of(key[2], p, v) != s
                if key is not None and key not in done:
                    break
                dep = done.get(key) if key is not None else None
                ready = (dep.end_s + (spec.p2p_s if cross else 0.0)) if dep else 0.0
                start = max(free[s], ready)
                via = "p2p" if dep is not None and ready > free[s] else "stream"
                pred = dep if via == "p2p" else last[s]
                if dep is not None and cross and spec.p2p_s > 0:
                    events.append(Event(dep.stage, "pp", f"send {dep.name}", dep.end_s, dep.end_s + spec.p2p_s))
                ev = Event(s, "compute", u.label(v), start, start + spec.unit_s(s, u),
                           {"kind": u.kind, "mb": u.mb, "chunk": u.chunk, "via": via, "wait_s": start - free[s],
                            "pred": pred})
                events.append(ev)
                done[(u.kind, u.mb, sched.virtual_stage(u.chunk, s, p, v))] = ev
                free[s], last[s] = ev.end_s, ev
                ptr[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {s: orders[s][ptr[s]].label(v) for s in range(p) if ptr[s] < len(orders[s])}
            raise RuntimeError(f"schedule {spec.schedule} deadlocks at {stuck}")
    step = max(free)
    busy = _busy(events, p)
    return PipelineResult(spec, tuple(events), step, busy, _critical_path(last, free))


def _simulate_rendezvous(spec: PipelineSpec, orders: list[list[Unit]]) -> PipelineResult:
    """:func:`simulate` with Megatron-LM 2022's blocking calls (module docstring): a unit
    starts when the call before it ends (its input arrived in that call or an earlier one)."""
    p, v, sched = spec.p, spec.v, spec.sched
    peers, xfer = calls(spec, orders)
    load = call_loads(xfer)
    ends: list[list[float]] = [[] for _ in range(p)]
    evs: list[list[Event]] = [[] for _ in range(p)]

    def posted(stage: int, pos: int) -> bool:
        return pos < len(ends[stage])

    def post(stage: int, pos: int) -> float:
        """When ``stage`` issues its call after position ``pos`` (its unit's end; 0 before the first)."""
        return 0.0 if pos < 0 else ends[stage][pos]

    def call_end(s: int, pos: int) -> Optional[tuple[float, Optional[tuple[int, int]]]]:
        """(end of the call after position pos, the binding peer (stage, position) or None),
        or None while a peer has not posted."""
        mine = peers.get((s, pos), [])
        if not all(posted(*x) for x in mine):
            return None
        e, best, top = post(s, pos), None, 0.0
        for x in mine:  # sorted: the first latest peer binds
            t = post(*x)
            if t > e and (best is None or t > top):
                best, top = x, t
        return (max([e] + [post(*x) for x in mine]) + spec.p2p_s * load[(s, pos)] if mine else e), best

    events: list[Event] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            while len(ends[s]) < len(orders[s]):
                i = len(ends[s])
                got = call_end(s, i - 1)
                if got is None:
                    break
                free, best = got
                u = orders[s][i]
                (a, ia), send, recv, _, recv_async = xfer.get((s, i), ((s, i), (s, i), (s, i), False, False))
                if recv_async and not posted(*send):  # its input is waited for at the unit: sent yet?
                    break
                start = free
                if (s, i) in xfer and spec.p2p_s > 0:
                    x0 = max(post(*send), post(*recv))
                    events.append(Event(a, "pp", f"send {evs[a][ia].name}", x0, x0 + spec.p2p_s))
                pred, via = (evs[best[0]][best[1]], "p2p") if best else (evs[s][-1] if i else None, "stream")
                if recv_async and (ready := max(post(*send), post(*recv)) + spec.p2p_s) > free:
                    start = ready  # the transfer, started once both sides posted, ends after the call
                    pred, via = evs[send[0]][send[1]] if post(*send) >= post(*recv) else evs[s][recv[1]], "p2p"
                ev = Event(s, "compute", u.label(v), start, start + spec.unit_s(s, u),
                           {"kind": u.kind, "mb": u.mb, "chunk": u.chunk, "via": via, "wait_s": start - free,
                            "pred": pred})
                events.append(ev)
                evs[s].append(ev)
                ends[s].append(ev.end_s)
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {s: orders[s][len(ends[s])].label(v) for s in range(p) if len(ends[s]) < len(orders[s])}
            raise RuntimeError(f"schedule {spec.schedule} deadlocks at {stuck}")
    stage_ends = [got[0] for s in range(p) if (got := call_end(s, len(orders[s]) - 1)) is not None]
    busy = _busy(events, p)
    last = [evs[s][-1] if evs[s] else None for s in range(p)]
    return PipelineResult(spec, tuple(events), max(stage_ends), busy, _critical_path(last, stage_ends))


def _busy(events, p: int) -> tuple[float, ...]:
    """Each stage's compute time: its units' durations added one after another in event order
    (a plain running sum, as Python's ``sum`` of floats before 3.12 and the array path's
    ``cumsum``: the same to the bit on every Python)."""
    busy = [0.0] * p
    for e in events:
        if e.stream == "compute":
            busy[e.stage] += e.dur_s
    return tuple(busy)


def _critical_path(last: list, free: list[float]) -> tuple[Event, ...]:
    ev = last[max(range(len(free)), key=lambda s: free[s])]
    path = []
    while ev is not None:
        path.append(ev)
        ev = ev.args.get("pred")
    return tuple(reversed(path))


def bubble_formula(schedule: Schedule | str, p: int, m: int, v: int = 1, forward_s: float = 1.0,
                   backward_s: float = 2.0, weight_s: float = 0.0) -> float:
    """Closed-form bubble (idle / ideal) of ``schedule`` for uniform stages and no p2p time
    (its registered :meth:`~.base.PipelineSchedule.bubble`); idle / total is ``x / (1 + x)``.
    ZB-H1's form holds for m >= p and W <= min(F, B).

    >>> bubble_formula("1f1b", 4, 8), bubble_formula("interleaved_1f1b", 4, 8, 2)
    (0.375, 0.1875)
    >>> round(bubble_formula("zb_h1", 4, 8, forward_s=1, backward_s=1, weight_s=1), 4)  # (p-1)/(3m)
    0.125
    """
    return get(schedule).bubble(p, m, v, forward_s, backward_s, weight_s)
