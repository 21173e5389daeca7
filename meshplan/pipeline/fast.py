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
cost is the numpy calls per round: the loops (:mod:`~meshplan.pipeline.rounds`) mark
a unit not done by a NaN end instead of a done table (about 12 calls a round; 1F1B at pp 128 x
4,096 micro-batches, 8,448 rounds: 0.42 s -> 0.13 s; Megatron's blocking interleaved 1F1B at pp
64 x 2 chunks, 16,512 rounds: 2.7 s -> 0.5-0.75 s; cProfile on 2 loaded cores), and the orders of
all stages are built at once (:func:`~meshplan.pipeline.orders.stage_orders`). The blocking loop
reads, per stage, the slot before and the peers of the call before its unit from one table
(one gather, one maximum a round), built without a sort (one row per send delay and per
receive lead), and the peer that bound each call is found only for the units asked for (the
critical path, a stage's exposure): the whole simulation of GPT-1T under Megatron-LM's blocking
sends, 1F1B at pp 128 x 4,096 micro-batches 0.43 s -> 0.31 s, interleaved at pp 64 x 2 chunks
0.83 s -> 0.41 s (CPU seconds, best of 4, 2 loaded cores).
Durations depend only on (stage, chunk, kind, last gradient unit), the step model's unit
key, given as a table. Events are built only when asked for (trace, evidence). The orders and
dependencies are :mod:`meshplan.pipeline.orders` (re-exported here), the round loops
:mod:`meshplan.pipeline.rounds`, the blocking calls :mod:`meshplan.pipeline.calls` (re-exported here).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Callable, Optional

import numpy as np

from meshplan.pipeline.orders import KINDS, Flat, flat_units, order_arrays, stage_orders
from meshplan.pipeline.calls import Transfers, call_table, input_seconds, rendezvous
from meshplan.pipeline.rounds import Rounds, run_rounds
from meshplan.pipeline.simulate import BubbleStats, Event, PipelineSpec, Unit

__all__ = ["KINDS", "order_arrays", "stage_orders", "Flat", "flat_units", "ArrayResult", "simulate_arrays",
           "rendezvous", "Transfers", "spec_durations", "input_seconds"]


#: Units before a unit of the critical path whose predecessors :attr:`ArrayResult.critical_units`
#: asks for at once: the path runs backwards along a stage (pred = the unit before) until a
#: transfer takes it to another one (GPT-1T pp 128, blocking: 8,446 units, 254 changes of stage;
#: asynchronous sends likewise: no predecessor table of all 10^6 units for one path).
WALK_WINDOW = 256


@dataclass(frozen=True, eq=False)
class ArrayResult(BubbleStats):
    """:class:`~meshplan.pipeline.simulate.PipelineResult`'s interface on arrays (flat,
    stage-major): ``start``, ``end``, ``wait`` (start - stream free); ``links(idx)``: for the flat
    units ``idx`` (None: all), whether each waited on a p2p transfer and its critical predecessor
    (flat index, -1 none), every unit's as :attr:`via_p2p` and :attr:`pred` (built on first use; both
    simulations find them per unit asked for, the blocking one by :class:`~meshplan.pipeline.rounds.Binding`);
    ``hold`` (seconds, the blocking call after each unit holds its stream: 0 with asynchronous
    sends); ``transfers`` (blocking only: :class:`Transfers`, whence :attr:`xfer`); ``rounds``
    (asynchronous sends: the simulation's rounds, :class:`~meshplan.pipeline.rounds.Rounds`, replayed
    by :func:`simulate_arrays` ``like`` this result); ``events`` and ``critical_path`` are built on demand."""

    spec: PipelineSpec
    flat: Flat
    start: np.ndarray
    end: np.ndarray
    wait: np.ndarray
    links: Callable[[Optional[np.ndarray]], tuple[np.ndarray, np.ndarray]]
    step_s: float
    busy_s: tuple[float, ...]
    hold: Optional[np.ndarray] = None
    transfers: Optional["Transfers"] = None
    rounds: Optional[Rounds] = None

    @cached_property
    def _all_links(self) -> tuple[np.ndarray, np.ndarray]:
        return self.links(None)

    @property
    def via_p2p(self) -> np.ndarray:
        """Per flat unit: it waited on a p2p transfer (its start set by the transfer)."""
        return self._all_links[0]

    @property
    def pred(self) -> np.ndarray:
        """Per flat unit: the flat index of its critical predecessor, -1 none."""
        return self._all_links[1]

    def via_at(self, idx) -> np.ndarray:
        """:attr:`via_p2p` of the flat units ``idx``, without every unit's."""
        idx = np.asarray(idx, dtype=np.int64)
        return self.via_p2p[idx] if "_all_links" in self.__dict__ else self.links(idx)[0]

    def pred_at(self, idx) -> np.ndarray:
        """:attr:`pred` of the flat units ``idx``, without every unit's."""
        idx = np.asarray(idx, dtype=np.int64)
        return self.pred[idx] if "_all_links" in self.__dict__ else self.links(idx)[1]

    @cached_property
    def xfer(self) -> Optional[np.ndarray]:
        """Blocking only (None otherwise): when the transfer feeding each unit starts, both its
        calls posted; NaN for a unit with no cross-stage input. Built on first use (the trace,
        the events); :meth:`xfer_at` gives some units' without it."""
        if self.transfers is None:
            return None
        out = np.full(len(self.end), np.nan)
        out[self.transfers.cons] = self._xfer_of(self.transfers, np.arange(len(self.transfers.cons)))
        return out

    def xfer_at(self, idx: np.ndarray) -> Optional[np.ndarray]:
        """:attr:`xfer` of the flat units ``idx`` (None with asynchronous sends)."""
        t = self.transfers
        if t is None:
            return None
        idx = np.asarray(idx, dtype=np.int64)
        if not len(t.cons):
            return np.full(len(idx), np.nan)
        k = np.minimum(np.searchsorted(t.cons, idx), len(t.cons) - 1)  # t.cons ascending
        return np.where(t.cons[k] == idx, self._xfer_of(t, k), np.nan)

    def _xfer_of(self, t: "Transfers", k: np.ndarray) -> np.ndarray:
        """When transfers ``k`` (entries of ``t``) start: the later post of their two calls."""
        return np.maximum(_posted(self.end, t.send[k], self.flat.length), _posted(self.end, t.recv[k], self.flat.length))

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
        cols = (f.kind[idx], f.mb[idx], f.chunk[idx], self.start[idx], self.end[idx], self.via_at(idx),
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

    def _send(self, d: Event, xfer: Optional[float], link_s: float) -> Event:
        """The "pp" event of the transfer of producer ``d``'s output, ``link_s`` long (its
        boundary's, :attr:`input_s`): from the producer's end (asynchronous: ``xfer`` None) or from
        the rendezvous of both calls (blocking: ``xfer``, the consumer's :attr:`xfer`)."""
        t0 = d.end_s if xfer is None else xfer
        return Event(d.stage, "pp", f"send {d.name}", t0, t0 + link_s)

    @cached_property
    def input_s(self) -> np.ndarray:
        """Per flat unit, seconds of the transfer bringing its input from another stage (its
        boundary's, :meth:`~meshplan.pipeline.sim_types.PipelineSpec.transfer_s`); 0 for a unit
        whose input is local. Read-only."""
        out = input_seconds(self.spec, self.flat)
        out.flags.writeable = False
        return out

    @cached_property
    def events(self) -> tuple[Event, ...]:
        """Every unit (and each p2p send before the unit that waits on it), stage by stage;
        ``args['pred']`` links the critical predecessor as the reference does."""
        n, f = len(self.end), self.flat
        units = self._events(np.arange(n))
        link = self.input_s.tolist()
        send = (f.cross & (self.input_s > 0)).tolist()
        xfer = [None] * n if self.xfer is None else self.xfer.tolist()
        out = []
        for i, (ev, pred, dep) in enumerate(zip(units, self.pred.tolist(), f.dep.tolist())):
            ev.args["pred"] = units[pred] if pred >= 0 else None
            if send[i]:
                out.append(self._send(units[dep], xfer[i], link[i]))
            out.append(ev)
        return tuple(out)

    def stage_events(self, s: int) -> list[Event]:
        """The events of :attr:`events` on stage ``s`` (its units, and the p2p sends it
        makes, each before the unit that waits on it), built for that stage alone."""
        f, n = self.flat, len(self.end)
        sl = self.stage_slice(s)
        if self.spec.max_p2p_s > 0:
            waiting = np.flatnonzero(f.cross & (np.minimum(f.dep, n - 1) // f.length == s) & (f.dep < n)
                                     & (self.input_s > 0))
        else:
            waiting = np.zeros(0, dtype=np.int64)
        units = self._events(np.arange(sl.start, sl.stop))
        for ev in units:
            ev.args["pred"] = None
        producers = dict(zip(waiting.tolist(), self._events(f.dep[waiting])))
        xfer = self.xfer_at(waiting)
        at = dict(zip(waiting.tolist(), xfer.tolist())) if xfer is not None else {}
        link = self.input_s
        items = sorted([(i, 1) for i in range(sl.start, sl.stop)] + [(i, 0) for i in producers])
        return [units[i - sl.start] if unit else self._send(producers[i], at.get(i), float(link[i]))
                for i, unit in items]

    @cached_property
    def critical_units(self) -> np.ndarray:
        """Flat indices of the units of :attr:`critical_path`, first to last."""
        last = [self.stage_slice(s).stop - 1 for s in range(self.flat.p)]
        i = last[max(range(self.flat.p), key=lambda s: self.end[last[s]])]
        length, path, lo, hi = self.flat.length, [], 0, 0
        block: list[int] = []
        windows: dict[int, tuple[int, list[int]]] = {}  # per stage, the last window asked for
        while i >= 0:
            path.append(i)
            if not lo <= i < hi:  # another window: this stage's last one, or the units before i on it
                lo, block = windows.get(i // length, (0, []))
                if not lo <= i < lo + len(block):
                    lo = max(i - WALK_WINDOW + 1, i - i % length)
                    block = self.pred_at(np.arange(lo, i + 1)).tolist()
                    windows[i // length] = (lo, block)
                hi = lo + len(block)
            i = block[i - lo]
        return np.array(path[::-1], dtype=np.int64)

    @cached_property
    def critical_path(self) -> tuple[Event, ...]:
        """From the first unit to the last unit of the stage that ends last."""
        evs = self._events(self.critical_units)
        for a, b in zip(evs[1:], evs):
            a.args["pred"] = b
        evs[0].args["pred"] = None
        return tuple(evs)


def simulate_arrays(spec: PipelineSpec, durations: Optional[Callable[[Flat], np.ndarray]] = None,
                    like: Optional[ArrayResult] = None,
                    after: Optional[Callable[[Flat], tuple[np.ndarray, np.ndarray]]] = None) -> ArrayResult:
    """:func:`~meshplan.pipeline.simulate.simulate` of ``spec`` on arrays. ``durations(flat)``:
    seconds of every flat unit (default: the spec's own
    :meth:`~meshplan.pipeline.simulate.PipelineSpec.unit_s`, :func:`spec_durations`). Start,
    end, wait, critical path and busy time equal the reference's (module docstring).
    ``blocking_p2p``: Megatron-LM 2022's rendezvous calls (:func:`rendezvous`, kept as
    ``transfers``); ``hold`` is then the seconds each unit's call holds its stream after it
    (``free - end``). ``like``: a result of the same spec (schedule, p, m, v, blocking sends),
    whose flat units and calls are reused instead of built again (the pipeline simulated again
    with other durations, :func:`~meshplan.schedule.pipeline_exposure.pipeline_without`: at pp 128
    x 4,096 micro-batches under ZB-H1, 1.5 million units, ``flat_units`` is 0.08 s), and with
    asynchronous sends its rounds replayed (:func:`~meshplan.pipeline.rounds.replay`): bitwise the
    times of a new simulation. ``after(flat)`` (asynchronous sends): per flat unit an earlier
    unit of its stage (-1: none) and seconds; the unit starts no earlier than that one's end plus
    them (:func:`~meshplan.pipeline.rounds.run_rounds`; not replayed later).

    >>> r = simulate_arrays(PipelineSpec("1f1b", p=4, m=8))
    >>> r.step_s, round(r.bubble, 4), [e.name for e in r.critical_path][:5]
    (33.0, 0.375, ['F0', 'F0', 'F0', 'F0', 'B0'])
    """
    same = like is not None and (like.spec.schedule, like.spec.p, like.spec.m, like.spec.v, like.spec.blocking_p2p,
                                 like.spec.overlap_p2p, like.spec.torch_p2p, like.spec.p2p_s, like.spec.p2p_link,
                                 like.spec.serial_p2p, like.spec.p2p_pair_s) == \
        (spec.schedule, spec.p, spec.m, spec.v, spec.blocking_p2p, spec.overlap_p2p, spec.torch_p2p, spec.p2p_s,
         spec.p2p_link, spec.serial_p2p, spec.p2p_pair_s)
    p, f = spec.p, like.flat if like is not None and same else flat_units(spec.schedule, spec.p, spec.m, spec.v)
    n, length = p * f.length, f.length
    dur = np.asarray(durations(f) if durations is not None else spec_durations(spec, f), dtype=float)
    pairs = (like.transfers if like is not None and same else rendezvous(spec, f)) if spec.blocking_p2p else None
    if pairs is not None and pairs.calls is None:  # kept in the result: a run ``like`` it reads it again
        pairs = pairs._replace(calls=call_table(pairs, p, length))
    add = input_seconds(spec, f) if pairs is None else np.zeros(n)  # each input's boundary's transfer
    dep = f.dep if pairs is None else np.where(f.cross, n, f.dep)  # blocking: the input comes in a call
    log: list = []
    again = like.rounds if like is not None and same else None
    start, end, free, lead_free, bind = run_rounds(replace(f, dep=dep), dur, add, pairs, spec.max_p2p_s, log=log, again=again,
                                                   after=after(f) if after is not None else None)
    wait = np.empty(n)  # stream free at start: after the previous unit's call, then start - that
    wait[1:] = free[:-1]
    wait[:1] = 0.0
    if length:
        wait[::length] = lead_free  # (a stage's first unit: after the call before it)
    np.subtract(start, wait, out=wait)  # (in place: 10^6 units)
    if pairs is None:
        def links(idx: Optional[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:  # for the units asked for only
            idx = np.arange(n) if idx is None else idx
            d = f.dep[idx]
            ready = np.where(d < n, end[np.minimum(d, n - 1)] + add[idx], 0.0)
            prev = np.where(idx % length > 0, free[idx - 1], lead_free[idx // length])  # as ``wait`` reads it
            via = (d < n) & (ready > prev)
            return via, np.where(via, d, np.where(idx % length > 0, idx - 1, -1))
    else:
        by_input = _async_preds(pairs, end, length, n)

        def links(idx: Optional[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:  # the peer that bound the call before
            idx = np.arange(n) if idx is None else idx
            b = bind.at(idx)
            via, pred = b >= 0, np.where(b >= 0, b, np.where(idx % length > 0, idx - 1, -1))
            if by_input is None:
                return via, pred
            late = wait[idx] > 0  # waited beyond the call for its asynchronous input
            return via | late, np.where(late, by_input[idx], pred)
    # each stage's busy time, its units' durations added one after another (Python's sum of
    # floats before 3.12, the reference's: a running sum along each row)
    took = (end - start).reshape(p, length)
    busy = tuple(np.cumsum(took, axis=1, out=took)[:, -1].tolist()) if length else (0.0,) * p  # (in place)
    last = free[length - 1::length] if length else lead_free
    same_free = pairs is None and bool(np.isfinite(end).all())  # asynchronous: free is end, x - x = 0.0
    hold = np.zeros(n) if same_free else free - end
    return ArrayResult(spec, f, start, end, wait, links, float(last.max()), busy, hold, pairs,
                       log[0] if log else again)


def _async_preds(pairs: "Transfers", end: np.ndarray, length: int, n: int) -> Optional[np.ndarray]:
    """Per flat unit, the unit whose post started the transfer of its asynchronously received
    input (``Transfers.recv_async``): the sender's, or its own stage's receiving one when that
    posted later (the reference's critical predecessor); -1 elsewhere; None without any."""
    if pairs.recv_async is None or not pairs.recv_async.any():
        return None
    k = pairs.recv_async
    width = length + 2
    snd, rcv = (x - 2 * (x // width) - 1 for x in (pairs.send[k], pairs.recv[k]))
    out = np.full(n, -1)
    out[pairs.cons[k]] = np.where(end[snd] >= end[rcv], snd, rcv)
    return out


def _posted(end: np.ndarray, slot: np.ndarray, length: int) -> np.ndarray:
    """When each call at ``slot`` (:class:`Transfers`) is posted: the end of the unit it follows
    (``end``: per flat unit), 0 before a stage's first unit."""
    width = length + 2
    pos = slot % width  # position + 1
    return np.where(pos > 0, end[np.maximum(slot - 2 * (slot // width) - 1, 0)], 0.0)


def spec_durations(spec: PipelineSpec, f: Flat) -> np.ndarray:
    """Seconds of every flat unit by ``spec.unit_s`` (one call per distinct stage and unit)."""
    seen: dict = {}
    out = np.empty(len(f.kind))
    for i in range(len(f.kind)):
        s, u = i // f.length, Unit(KINDS[f.kind[i]], int(f.mb[i]), int(f.chunk[i]))
        out[i] = seen[(s, u)] if (s, u) in seen else seen.setdefault((s, u), spec.unit_s(s, u))
    return out
