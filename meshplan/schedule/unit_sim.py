"""The event simulation under every unit timeline: :class:`StreamSim` runs compute and collectives
on their streams in issue order, each task after its dependencies, compute slowed by the SMs the
running collectives hold (:data:`MAX_SM_SHARE`), network collectives slowed by the NIC shares
the running ones hold (:class:`~meshplan.schedule.nic_fair.NicBook`), and counts the time the compute stream waits on
each stream (exposed); :class:`UnitSim` is its result; :class:`Overlap` which communication may
overlap compute; :class:`ChunkCosts` the compute of one chunk per micro-batch.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

from meshplan.compute import asynctp
from meshplan.compute.ops import Cost, Workload
from meshplan.pipeline.simulate import Event
from meshplan.schedule.comm_times import CommTimes
from meshplan.schedule.nic_fair import SETTLED_S, NicBook, relax, residual


#: At most this fraction of the SMs is taken from compute by concurrent collectives.
MAX_SM_SHARE = 0.9


def progress(busy, start: float, dur: float, cap: float) -> tuple[float, list]:
    """(end, segments) of ``dur`` seconds of work from ``start`` on a resource that the tasks in
    ``busy`` ((start, end, share, ...) each, issued earlier) hold shares of: in each interval
    between their edges the work progresses at ``1 - min(cap, sum of the shares held)``;
    ``segments``: (t0, t1, rate) of the intervals it ran in. A kernel under SM-holding collectives
    (:meth:`StreamSim._finish`).

    >>> progress([(1.0, 3.0, 0.5)], 0.0, 2.0, 1.0)
    (3.0, [(0.0, 1.0, 1.0), (1.0, 3.0, 0.5)])
    """
    t, left, segs = start, dur, []
    edges = sorted({x for b in busy for x in (b[0], b[1]) if x > start})
    for nxt in edges + [float("inf")]:
        rate = 1.0 - min(cap, sum(b[2] for b in busy if b[0] <= t < b[1]))
        if (nxt - t) * rate >= left:
            segs.append((t, t + left / rate, rate))
            return t + left / rate, segs
        left -= (nxt - t) * rate
        if nxt > t and rate > 0:
            segs.append((t, nxt, rate))
        t = nxt
    return t, segs  # unreachable: the last segment is unbounded


@dataclass(frozen=True)
class Overlap:
    """Which communication overlaps compute (module docstring)."""

    tp: bool = False
    tp_grad: bool = False
    fsdp_prefetch: bool = True
    #: layers of FSDP all-gathers issued past the layer computed when ``fsdp_prefetch``
    #: (:mod:`~meshplan.schedule.layer_prefetch`): FSDP2's 1, DeepSpeed ZeRO-3's bucket (a share of a layer or more)
    fsdp_ahead: float = 1.0
    #: DeepSpeed ZeRO-3's window sliding module by module: the next layer's gather issued during
    #: the layer computed whatever ``fsdp_ahead`` (:class:`~meshplan.schedule.layer_prefetch.LayerPrefetch`)
    fsdp_slide: bool = False
    #: DeepSpeed ZeRO-3: layers its prefetch issues behind the fetch before a pass's first layer,
    #: (forward: the embedding's, backward: the head's), max live less that unit; () for ``fsdp_ahead``
    fsdp_start: tuple = ()
    #: DeepSpeed ZeRO-3's backward all-gathers of each layer (first to last) under
    #: ``stage3_max_reuse_distance``: the shares of its unit gathered, one per call
    #: (:attr:`meshplan.memory.deepspeed_fetch.ReuseBytes.backward`); () for one whole call each
    fsdp_backward: tuple = ()
    grad_reduce: bool = True
    param_gather: bool = False
    #: concurrent network collectives share their NICs (:class:`~meshplan.schedule.nic_fair.NicBook`); False: each at its
    #: table time, as the search's step-time bounds take them (a bound's tightness is checked without it)
    nic_sharing: bool = True
    #: FSDP2's reduce-scatters on their own queue beside its all-gathers' (torch 2.13
    #: ``_fsdp_param_group.py`` ``FSDPCommContext.lazy_init`` lines 89-92: ``all_gather_stream`` and
    #: ``reduce_scatter_stream``, one of each for every unit, experts' included; ``_fsdp_collectives.py`` lines
    #: 362-363 and 607-611 issue each on its own), so a unit's reduce-scatter and the next unit's all-gather run
    #: at once and share the NIC, and one reduce-scatter in flight: the compute stream waits for the previous
    #: before the next copy-in (``reduce_scatter_max_input_buffers`` 1, lines 639-658;
    #: :func:`~meshplan.schedule.grad_reduce.unit_reduce`); False: one queue
    #: (:func:`~meshplan.schedule.overlap_policy.config_overlap` says which runtimes)
    fsdp_rs_queue: bool = False


@dataclass(frozen=True)
class ChunkCosts:
    """Compute of one chunk per micro-batch: a Cost per layer, which are MoE, and the
    embedding (first virtual stage) and head (last virtual stage) Costs or None; ``batch``:
    what the framework runs around every chunk's passes (Megatron-LM 2022's ``get_batch`` and
    timer syncs, :func:`meshplan.compute.megatron_cost.megatron_batch_cost`) or None; ``engine``: what
    DeepSpeed's PipelineEngine and BF16_Optimizer run around the chunk's passes
    (:func:`meshplan.compute.deepspeed_pipe.engine_cost`: its forward ops before the layers, its
    backward ones after them) or None."""

    layers: tuple[Cost, ...]
    moe: tuple[bool, ...]
    embed: Optional[Cost] = None
    head: Optional[Cost] = None
    batch: Optional[Cost] = None
    engine: Optional[Cost] = None


@dataclass(frozen=True)
class UnitSim:
    """One unit's simulated timeline, times from the unit start (seconds)."""

    duration_s: float
    tail_s: float
    exposed_s: dict
    events: tuple[Event, ...]
    tail_stream: str = ""
    host_wait_s: float = 0.0  # the compute stream's waits for the host's issue (StreamSim.host_pace)
    contention_s: float = 0.0  # compute slowed by collectives' SMs, where the compute stream holds it (StreamSim.compute)
    #: {(stream, other stream): seconds} the stream's collectives ran longer sharing their NICs with the
    #: other's running beside them (:meth:`~meshplan.schedule.nic_fair.NicBook.waits`)
    nic_wait: dict = field(default_factory=dict)


class StreamSim:
    """Streams run tasks in issue order; a task starts when its stream is free and its
    dependencies (``after``) are done. A compute task may ``overlap`` communication: it
    starts no earlier than the first of them starts and ends no earlier than all end."""

    def __init__(self, comm: CommTimes, w: Workload, ov: Overlap, forecast: Optional[list] = None):
        self.c, self.w, self.ov = comm, w, ov
        self.free: defaultdict[str, float] = defaultdict(float)
        self.events: list[Event] = []
        self.exposed: defaultdict[str, float] = defaultdict(float)
        self.last: Optional[Event] = None
        self.busy: list[tuple[float, float, float]] = []   # (start, end, SM share) of collectives
        self.memo: dict = {}  # per-Cost sums of this unit (its layers share Cost objects)
        self.reduced: Optional[Event] = None  # the last piece of the gradient reduction issued
        self.rs_prev: Optional[Event] = None  # the last FSDP reduce-scatter issued (Overlap.fsdp_rs_queue)
        self.host_s = 0.0  # the host's issue clock (host_pace), from the unit's start
        self.host_wait_s = 0.0  # the compute stream's idle waiting for it
        self.contention_s = 0.0  # compute time added by collectives' SM shares and not exposed (compute)
        self.book = NicBook(self.free, forecast)  # the network collectives placed (comm, nic_fair.NicBook)
        self.queue_last: dict[str, Event] = {}  # each queue's last collective

    def of(self, fn, c: Cost, *args):
        """``fn(c, *args)`` once per (fn, Cost, args) in this unit: the sums over a layer's ops
        that every layer of the same kind repeats (the chunk's layers share their Cost)."""
        key = (fn, id(c), args)
        if key not in self.memo:
            self.memo[key] = (c, fn(c, *args))  # holds c: its id stays its own
        return self.memo[key][1]

    def _finish(self, start: float, dur: float) -> float:
        """End of ``dur`` seconds of compute from ``start`` while the collectives in ``busy``
        hold their SM shares: the kernel progresses at ``1 - sum of the shares`` (at most
        :data:`MAX_SM_SHARE` taken) while they run, at full rate otherwise (:func:`progress`)."""
        if self.busy:
            self.busy = [b for b in self.busy if b[1] > start]
        if dur <= 0 or not self.busy:
            return start + dur
        return progress(self.busy, start, dur, MAX_SM_SHARE)[0]

    def _add(self, stream, name, start, end, args=None, queue: Optional[str] = None) -> Event:
        ev = Event(0, stream, name, start, end, dict(args) if args else {})
        self.events.append(ev)
        self.free[queue or stream] = end
        return ev

    def compute(self, name: str, dur: float, after=(), overlap=()) -> Event:
        ov = [o for o in overlap if o is not None] if overlap else []
        free = self.free["compute"]
        # ready times: the previous compute's end, each dependency's end, the first overlapped
        # collective's start; the task starts at the latest of them and ``free``, and the first
        # latest of them (``binding``) is what the compute stream waited for
        ready = [(a.end_s, a) for a in (self.last, *after) if a is not None]
        if ov:
            first = min(ov, key=lambda o: o.start_s)
            ready.append((first.start_s, first))
        start, latest, binding = free, None, None
        for t, a in ready:
            if t > start:
                start = t
            if binding is None or t > latest:
                latest, binding = t, a
        if start > free and binding is not None and binding.stream != "compute":
            self.exposed[binding.stream] += start - free
        done = self._finish(start, dur)
        end = done
        for o in ov:
            if o.end_s > end:
                end = o.end_s
        for a in after:
            if a is not None:
                self.book.read(a, start)
        for o in ov:
            self.book.read(o, end)
        for o in ov:
            if o.end_s > start + dur and o.end_s == end:
                self.exposed[o.stream] += end - (start + dur)
                break
        if end == done:  # the slowdown lands on the compute stream, not in an overlapped collective's exposure
            self.contention_s += done - (start + dur)
        self.last = self._add("compute", name, start, end)
        return self.last

    def host_pace(self, name: str, issue_s: float) -> Optional[Event]:
        """The host issues ``issue_s`` more seconds of ops (eager DTensor TP: a block's
        :attr:`~meshplan.compute.ops.Workload.dtensor_host_s`; its clock starts with the unit and
        runs ahead of the device, never waiting for it): the compute stream cannot finish the
        ops issued so far before the host has issued them. Where the host is later, the compute
        stream idles until then (an event ``<name> host issue``, on the compute stream: the
        step's compute holds it); None where the device is the later one.

        Two blocks of 3 ms of kernels issued at 4.65 ms each: the second ends at 9.3 ms, not 6."""
        if issue_s <= 0:
            return None
        self.host_s += issue_s
        free = self.free["compute"]
        if self.host_s <= free:
            return None
        self.host_wait_s += self.host_s - free
        self.last = self._add("compute", f"{name} host issue", free, self.host_s)
        return self.last

    def comm(self, kind: str, phase: str, op: str, name: str, group: str = "", after=None,
             seconds: Optional[float] = None, label: Optional[str] = None) -> Optional[Event]:
        """A collective on the stream of ``kind`` (its queue: it starts when the stream is free
        and ``after`` is done); ``label``: the stream the event is shown and its exposure counted
        on, when not that one (a per-step reduction's piece over tp or pp, queued as "dp")."""
        t = self.c.get(kind, phase, op, group) if seconds is None else seconds
        if not op or t <= 0:
            return None
        stream = ("efsdp" if group == "expert" else "fsdp") if kind == "shard" else \
            "dp_replicate" if kind == "replica" else kind
        queue = "shard reduce-scatter" if kind == "shard" and op == "reduce-scatter" and self.ov.fsdp_rs_queue \
            else stream
        start = self.free[queue]
        deps = [a for a in ((self.last,) if after is None else after) if a is not None]
        for a in deps:
            if a.end_s > start:
                start = a.end_s
        for a in deps + ([self.queue_last[queue]] if queue in self.queue_last else []):
            self.book.read(a, start)
        end, j = start + t, None
        if self.ov.nic_sharing and (g := self.c.nic_share(kind, phase, op, group, label or stream)) > 0:
            j, end = self.book.place(queue, label or stream, start, t, g)
        if (f := self.c.sm_share(kind, phase, op, group)) > 0:
            self.busy.append((start, end, f))
        ev = self._add(label or stream, name, start, end, {"kind": kind, "group": group, "phase": phase,
                                                           "op": op}, queue=queue)
        self.queue_last[queue] = ev
        if j is not None:
            self.book.attach(j, ev)
        return ev

    def fused(self, name: str, gemm_s: float, collective_s: float, n: int, reduce_scatter: bool) -> Event:
        """A fused all-gather + GEMM (``reduce_scatter`` False) or GEMM + reduce-scatter of ``n``
        pieces (:mod:`meshplan.compute.asynctp`): the compute stream runs it for
        :func:`~meshplan.compute.asynctp.fused_seconds` of its GEMMs (``gemm_s``, the pieces')
        and one piece's transfer (``collective_s``: the whole collective's model time); the time
        beyond the GEMMs is exposed on "tp". The transfers (``collective_s`` in all) are shown on
        the tp stream from the op's start (all-gather: the local piece first) or after its first
        GEMM piece (reduce-scatter)."""
        fw = self.w.async_tp
        c = asynctp.piece_comm_s(fw, collective_s, self.w.tp, reduce_scatter)
        total = asynctp.fused_seconds(gemm_s, c, n, trail=reduce_scatter and fw == "megatron")
        ev = self.compute(name, total)
        if total > gemm_s:
            self.exposed["tp"] += total - gemm_s
        if collective_s > 0:
            t0 = ev.start_s + (gemm_s / n if reduce_scatter else 0.0)
            self.events.append(Event(0, "tp", f"tp {name} ({n} pieces)", t0, t0 + collective_s,
                                     {"kind": "tp", "group": "", "phase": "", "op": "fused"}))
            self.free["tp"] = max(self.free["tp"], t0 + collective_s)
        return ev

    def finish(self) -> UnitSim:
        end = self.last.end_s if self.last else 0.0
        final = max(self.events, key=lambda e: e.end_s, default=None)
        tail = max(0.0, final.end_s - end) if final else 0.0
        return UnitSim(end, tail, dict(self.exposed), tuple(self.events), final.stream if final and tail else "",
                       self.host_wait_s, self.contention_s, self.book.waits())


#: At most this many passes of a unit (:func:`settle`): a relaxed pass halves the distance to the
#: forecast, and a unit that settles takes 1 to 3 (the 405B search: 3278 of 3309 units 1 pass).
MAX_PASSES = 10

#: The first pass (:func:`settle`) whose forecast may be the mean of the last forecast and the last
#: pass's intervals (under-relaxation), not the last pass's alone.
DAMP_FROM = 3


def settle(build, comm: CommTimes, w: Workload, ov: Overlap) -> UnitSim:
    """The unit ``build(s)`` issues on a :class:`StreamSim` ``s``, its network collectives each at
    its max-min fair share of the NIC beside the others running (:class:`~meshplan.schedule.nic_fair.NicBook`):
    a later one slows an earlier one, whose event's end moves. Where something already placed had read
    that end (``NicBook.moved``), the unit is issued again with a forecast of the collectives'
    intervals, each placed beside the later ones' forecast intervals; a pass whose intervals are the
    last pass's (:func:`~meshplan.schedule.nic_fair.residual` at most
    :data:`~meshplan.schedule.nic_fair.SETTLED_S`: the fixed point) is taken. The forecast is the last pass's
    intervals while the passes' distance to their forecast falls; from the first pass where it does not
    (at :data:`DAMP_FROM` or later) their mean with the last forecast
    (:func:`~meshplan.schedule.nic_fair.relax`: a map that jumps between two schedules, a
    consumer binding on one collective in one pass and on another in the next, is halved each
    pass, not repeated; a unit that converges unrelaxed is not slowed). At most :data:`MAX_PASSES`; where none settles, the pass nearest its
    forecast (the least residual, the first of equals) is taken: deterministic. Mixtral-8x7B under
    HSDP (test_nic_settle) has backward units that jump
    589/591/675/591/717/590/591/591 ms over 8 unrelaxed passes and 601/727/602/747/602/660/603/693 ms
    (the last, 693 ms, was taken when the limit was 8 unrelaxed passes); relaxed, the passes' distance
    to their forecast halves, 147 -> 10 ms and less. Llama-3-70B under Megatron-LM's --tp-comm-overlap (test_step_tp_hint) settles
    at its 3rd pass (7 before main's compute changes). A long unit whose every layer shares the NIC with the
    next settles about one layer a pass: the 405B search's dp_replicate 128 x dp_shard 8 x cp 2 x tp 8
    backward unit (126 layers, 887 network collectives) has its first collective unlike the last pass's 7
    further on each pass (one layer's), residual 81 -> 4 ms, and takes all :data:`MAX_PASSES`; such
    units held most of that search's CPU (step_time 18.0 of 23.0 s, nicshare4)."""
    s = StreamSim(comm, w, ov)
    build(s)
    best, best_gap, forecast, damp = s, math.inf, None, False
    for k in range(2, MAX_PASSES + 1):
        if not s.book.moved:
            return s.finish()
        last = s.book.intervals()
        forecast = relax(forecast, last) if damp and k >= DAMP_FROM else last
        s = StreamSim(comm, w, ov, forecast=forecast)
        build(s)
        got = s.book.intervals()
        if residual(got, last) <= SETTLED_S:
            return s.finish()
        gap = residual(got, forecast)
        damp = damp or gap >= best_gap
        if gap < best_gap:
            best, best_gap = s, gap
    return (s if not s.book.moved else best).finish()
