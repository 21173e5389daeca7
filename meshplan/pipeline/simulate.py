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
j-1 (plus ``p2p_s`` across stages: the boundary's, :meth:`~.sim_types.PipelineSpec.transfer_s`); B of j needs B of j+1 (the last virtual stage needs its
own F); W needs its B. Each stage runs its order on one compute stream; a unit starts when
the stream is free and its dependency is done (list scheduling with fixed orders: exact
earliest times).

Sends are asynchronous (each takes its boundary's ``p2p_s`` after its unit ends, on the "pp" stream) unless
``blocking_p2p``: then the two stages of every transfer rendezvous in Megatron-LM 2022's
blocking calls, or torch's under ``torch_p2p`` (:mod:`meshplan.pipeline.rendezvous`).

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

from typing import Optional

from meshplan.pipeline.base import Unit
from meshplan.pipeline.registry import SCHEDULES, get
from meshplan.pipeline.rendezvous import simulate_rendezvous
from meshplan.pipeline.sim_types import (BubbleStats, Event, PipelineResult, PipelineSpec, busy_times,
                                         critical_path_of, dependency)
from meshplan.spec.mesh import Schedule

__all__ = ["SCHEDULES", "Unit", "PipelineSpec", "PipelineResult", "BubbleStats", "Event", "simulate", "stage_order",
           "bubble_formula"]


def stage_order(schedule: Schedule | str, p: int, m: int, v: int, s: int) -> list[Unit]:
    """The order of ``schedule`` on stage ``s`` (its registered object's :meth:`order`)."""
    return get(schedule).order(p, m, v, s)


def simulate(spec: PipelineSpec) -> PipelineResult:
    """Run every stage's order (:func:`stage_order`) to completion; see the module docstring."""
    p, v, sched = spec.p, spec.v, spec.sched
    orders = [sched.order(p, spec.m, v, s) for s in range(p)]
    if spec.blocking_p2p:
        return simulate_rendezvous(spec, orders)
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
                key = dependency(sched, u, s, p, v)
                cross = key is not None and sched.stage_of(key[2], p, v) != s
                if key is not None and key not in done:
                    break
                dep = done.get(key) if key is not None else None
                link = spec.transfer_s(dep.stage, s) if dep is not None and cross else 0.0  # its boundary's
                ready = (dep.end_s + link) if dep else 0.0
                start = max(free[s], ready)
                via = "p2p" if dep is not None and ready > free[s] else "stream"
                pred = dep if via == "p2p" else last[s]
                if dep is not None and cross and link > 0:
                    events.append(Event(dep.stage, "pp", f"send {dep.name}", dep.end_s, dep.end_s + link))
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
    busy = busy_times(events, p)
    return PipelineResult(spec, tuple(events), step, busy, critical_path_of(last, free))


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
