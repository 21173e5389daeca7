"""The stream simulation under every unit timeline: :class:`StreamSim` records the compute and
collectives a unit issues on their streams (each task after its queue's previous one and its
dependencies) and plays them once in time order (:func:`~meshplan.schedule.unit_events.run`):
compute slowed by the SMs the running collectives hold (:data:`MAX_SM_SHARE`), network
collectives sharing the NIC max-min fairly (:func:`~meshplan.schedule.nic_fair.max_min_shares`),
and counts the time the compute stream waits on each stream (exposed); :class:`UnitSim` is its
result; :class:`Overlap` which communication may overlap compute; :class:`ChunkCosts` the compute
of one chunk per micro-batch.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass, field
from typing import Optional

from meshplan.compute import asynctp
from meshplan.compute.ops import Cost, Workload
from meshplan.pipeline.simulate import Event
from meshplan.schedule.comm_times import CommTimes
from meshplan.schedule.nic_fair import nic_waits
from meshplan.schedule.unit_events import COMM, COMPUTE, FIXED, NET, PINNED, ROOM, Task, run


#: At most this fraction of the SMs is taken from compute by concurrent collectives.
MAX_SM_SHARE = 0.9


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
    #: concurrent network collectives share their NICs (:mod:`~meshplan.schedule.unit_events`); False: each at its
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
    backward ones after them) or None; ``w_replays``: per layer, its parameter groups
    (:func:`meshplan.memory.wlag.weight_groups`), how many times a zero-bubble W replays the layer's
    forward where it is checkpointed (timed under eager full or per-layer AC only:
    :func:`meshplan.schedule.backward_pass._w_replays`)."""

    layers: tuple[Cost, ...]
    moe: tuple[bool, ...]
    embed: Optional[Cost] = None
    # per layer, the forward replays of a checkpointed layer in a split backward's W (one per
    # parameter group: meshplan.memory.wlag.weight_groups); () where not given: none
    w_replays: tuple[int, ...] = ()
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
    #: other's running beside them (:func:`~meshplan.schedule.nic_fair.nic_waits`)
    nic_wait: dict = field(default_factory=dict)
    #: a pass timed with its window UNSHARD issued infinitely early (lead inf): ((position in
    #: ``events``, seconds alone), ...) of the tasks that ran before it started, where they are
    #: one chain of collectives on the "fsdp" queue that a finite lead runs alone, back to back
    #: (:func:`~meshplan.schedule.window_unshard.hidden_lead`); None where they are not; () elsewhere
    early: Optional[tuple] = field(default=(), compare=False, repr=False)


_new = object.__new__


class StreamSim:
    """Streams run tasks in issue order; a task starts when its stream is free and its
    dependencies (``after``) are done. A compute task may ``overlap`` communication: it
    starts no earlier than the first of them starts and ends no earlier than all end. The
    builders issue tasks and get their events back (times not yet known: NaN); :meth:`finish`
    plays the unit (:func:`~meshplan.schedule.unit_events.run`) and sets every event's times, so
    a builder never reads a time while it issues: what it waits for is a dependency."""

    def __init__(self, comm: CommTimes, w: Workload, ov: Overlap):
        self.c, self.w, self.ov = comm, w, ov
        self.tasks: list[Task] = []
        self.task_of: dict[int, Task] = {}  # id(event) -> its task
        self.queue_last: dict[str, Task] = {}  # each queue's last task
        self.pinned: dict[str, list[Task]] = {}  # queue -> transfers shown on it since its last task (fused)
        self.floor: dict[str, float] = {}  # queue -> its free time before its first task (default 0)
        self.last: Optional[Event] = None  # the compute stream's last kernel (or host issue, or wait)
        self.memo: dict = {}  # per-Cost sums of this unit (its layers share Cost objects)
        self.keys: dict = {}  # (kind, phase, op, group, label) -> what comm reads of the tables (_comm_key)
        self.reduced: Optional[Event] = None  # the last piece of the gradient reduction issued
        self.rs_prev: Optional[Event] = None  # the last FSDP reduce-scatter issued (Overlap.fsdp_rs_queue)
        self.host_s = 0.0  # the host's issue clock (host_pace), from the unit's start

    def of(self, fn, c: Cost, *args):
        """``fn(c, *args)`` once per (fn, Cost, args) in this unit: the sums over a layer's ops
        that every layer of the same kind repeats (the chunk's layers share their Cost)."""
        key = (fn, id(c), args)
        if key not in self.memo:
            self.memo[key] = (c, fn(c, *args))  # holds c: its id stays its own
        return self.memo[key][1]

    def queues_from(self, queues, t: float) -> None:
        """The ``queues`` are free from ``t`` (seconds from the unit's start; -inf: issued
        infinitely early) before their first task (torch's window UNSHARD, issued ahead)."""
        for q in queues:
            self.floor[q] = t

    def _task(self, kind: int, queue: str, stream: str, name: str, args=None, work: float = 0.0, deps=(),
              demand: float = 0.0, sm: float = 0.0) -> Task:
        """A task on ``queue`` (its event on ``stream``) after ``deps`` (events) and the queue's last task."""
        # the Event(0, stream, name, nan, nan, args), its fields set as the frozen dataclass's __init__
        # sets them (no __post_init__) without its six object.__setattr__ calls: one per task, ~10^6 per
        # 405B search (issue 11 item 7); ``args``: comm's own new dict, the event's
        ev = _new(Event)
        ev.__dict__.update(stage=0, stream=stream, name=name, start_s=math.nan, end_s=math.nan,
                           args={} if args is None else args)
        task_of = self.task_of
        own = [task_of[id(a)] for a in deps if a is not None]
        pred = self.queue_last.get(queue)
        if pred is not None:  # its queue is free when the task before it ends (before 0: a window UNSHARD's)
            own.append(pred)
            floor = -math.inf
        else:
            floor = self.floor.get(queue, 0.0) if self.floor else 0.0
        if self.pinned and queue in self.pinned:
            own += self.pinned.pop(queue)
        tasks = self.tasks
        t = Task(len(tasks), kind, queue, ev, work, demand, sm, own, pred, floor)
        tasks.append(t)
        task_of[id(ev)] = t
        self.queue_last[queue] = t
        return t

    def compute(self, name: str, dur: float, after=(), overlap=(), cond: bool = False) -> Event:
        """A kernel of ``dur`` seconds after the compute stream's last one and ``after``, overlapping
        ``overlap`` (the class docstring); the compute stream's wait for the first latest of them is
        exposed on its stream, the SM slowdown not inside an overlapped collective's exposure is
        contention. ``cond``: not shown where it did not wait (a wait on a collective already done)."""
        after = [a for a in after if a is not None] if after else []
        last = self.last
        t = self._task(COMPUTE, "compute", "compute", name, work=dur, deps=[last, *after] if after else (last,))
        task_of = self.task_of
        t.last = task_of[id(last)] if last is not None else None
        if after:
            t.after = tuple([task_of[id(a)] for a in after])
        if overlap:
            ov = [task_of[id(o)] for o in overlap if o is not None]
            if ov:
                t.overlap = t.hold = tuple(ov)
        t.cond = cond
        self.last = t.ev
        return t.ev

    def fixed(self, name: str, dur: float, after=(), hold=(), cond: bool = False) -> Event:
        """A span on the compute stream that does not move its last kernel (after the unit's compute:
        its tail): from the stream's free time and ``after``'s ends for ``dur`` seconds, and no
        earlier than ``hold`` end; ``cond``: not shown where it took no time. Nothing exposed."""
        t = self._task(FIXED, "compute", "compute", name, work=dur, deps=after)
        t.hold, t.cond = tuple(self.task_of[id(h)] for h in hold if h is not None), cond
        return t.ev

    def host_pace(self, name: str, issue_s: float) -> Optional[Event]:
        """The host issues ``issue_s`` more seconds of ops (eager DTensor TP: a block's
        :attr:`~meshplan.compute.ops.Workload.dtensor_host_s`; its clock starts with the unit and
        runs ahead of the device, never waiting for it): the compute stream cannot finish the
        ops issued so far before the host has issued them. Where the host is later, the compute
        stream idles until then (an event ``<name> host issue``, on the compute stream: the
        step's compute holds it; not shown where the device is the later one).

        Two blocks of 3 ms of kernels issued at 4.65 ms each: the second ends at 9.3 ms, not 6."""
        if issue_s <= 0:
            return None
        self.host_s += issue_s
        t = self._task(FIXED, "compute", "compute", f"{name} host issue")
        t.end_floor, t.host = self.host_s, True
        self.last = t.ev
        return t.ev

    def comm(self, kind: str, phase: str, op: str, name: str, group: str = "", after=None,
             seconds: Optional[float] = None, label: Optional[str] = None) -> Optional[Event]:
        """A collective on the stream of ``kind`` (its queue: it starts when the stream is free
        and ``after`` is done); ``label``: the stream the event is shown and its exposure counted
        on, when not that one (a per-step reduction's piece over tp or pp, queued as "dp"). A
        network collective (its NIC share, :meth:`~meshplan.schedule.comm_times.CommTimes.nic_share`,
        above 0 and ``Overlap.nic_sharing``) runs at its max-min fair share of the NIC."""
        got = self.keys.get((kind, phase, op, group, label))
        if got is None:
            got = self.keys[(kind, phase, op, group, label)] = self._comm_key(kind, phase, op, group, label)
        t = got[0] if seconds is None else seconds
        if not op or t <= 0:
            return None
        task = self._task(got[1], got[2], got[3], name, {"kind": kind, "group": group, "phase": phase, "op": op},
                          work=t, deps=(self.last,) if after is None else after, demand=got[4], sm=got[5])
        return task.ev

    def _comm_key(self, kind: str, phase: str, op: str, group: str, label: Optional[str]) -> tuple:
        """(table seconds, task kind, queue, shown stream, NIC demand, SM share) of :meth:`comm`'s
        collective of this key: the same for every call of the unit (read once per key)."""
        t = self.c.get(kind, phase, op, group)
        stream = ("efsdp" if group == "expert" else "fsdp") if kind == "shard" else \
            "dp_replicate" if kind == "replica" else kind
        queue = "shard reduce-scatter" if kind == "shard" and op == "reduce-scatter" and self.ov.fsdp_rs_queue \
            else stream
        g = self.c.nic_share(kind, phase, op, group, label or stream) if self.ov.nic_sharing else 0.0
        return (t, NET if g > 0 else COMM, queue, label or stream, g if g > 0 else 0.0,
                self.c.sm_share(kind, phase, op, group))

    def fused(self, name: str, gemm_s: float, collective_s: float, n: int, reduce_scatter: bool) -> Event:
        """A fused all-gather + GEMM (``reduce_scatter`` False) or GEMM + reduce-scatter of ``n``
        pieces (:mod:`meshplan.compute.asynctp`): the compute stream runs it for
        :func:`~meshplan.compute.asynctp.fused_seconds` of its GEMMs (``gemm_s``, the pieces')
        and one piece's transfer (``collective_s``: the whole collective's model time), with the
        workload's ``copy_engine_gemm`` (the GEMMs' slowdown beside the pulls, a call's cost); the time
        beyond the GEMMs is exposed on "tp". The transfers (``collective_s`` in all) are shown on
        the tp stream from the op's start (all-gather: the local piece first) or after its first
        GEMM piece (reduce-scatter); the tp stream's next collective starts no earlier than they end."""
        fw = self.w.async_tp
        c = asynctp.piece_comm_s(fw, collective_s, self.w.tp, reduce_scatter)
        slow, call_s = self.w.copy_engine_gemm  # (0, 0) but for torch's bf16 pieces on a measured GPU
        total = asynctp.fused_seconds(gemm_s, c, n, trail=reduce_scatter and fw == "megatron", slowdown=slow, call_s=call_s)
        ev = self.compute(name, total)
        if total > gemm_s:
            self.task_of[id(ev)].extra = total - gemm_s
        if collective_s > 0:
            ev2 = Event(0, "tp", f"tp {name} ({n} pieces)", math.nan, math.nan,
                        {"kind": "tp", "group": "", "phase": "", "op": "fused"})
            t = Task(len(self.tasks), PINNED, "tp", ev2, collective_s)
            t.owner, t.offset = self.task_of[id(ev)], (gemm_s / n if reduce_scatter else 0.0)
            self.tasks.append(t)
            self.task_of[id(ev2)] = t
            self.pinned.setdefault("tp", []).append(t)
        return ev

    def finish(self) -> UnitSim:
        """The unit played (:func:`~meshplan.schedule.unit_events.run`): its compute stream's end, the
        tail of what ends after it, the exposure and the waits."""
        tot = run(self.tasks, MAX_SM_SHARE)
        exposed = dict(tot.exposed)
        events = tuple([t.ev for t in self.tasks if t.emit])
        end = self.last.end_s if self.last is not None else 0.0
        final = max(events, key=lambda e: e.end_s, default=None)
        tail = max(0.0, final.end_s - end) if final else 0.0
        nets = [(t.start, t.end, t.work, t.demand, t.ev.stream, t.queue) for t in self.tasks if t.kind == NET]
        early = _early(self.tasks) if -math.inf in self.floor.values() else ()
        return UnitSim(end, tail, exposed, events, final.stream if final and tail else "",
                       tot.host_wait, tot.contention, nic_waits(nets), early)


def _early(tasks: list[Task]) -> Optional[tuple]:
    """:attr:`UnitSim.early` of a played unit: the tasks that started at -inf (a window UNSHARD's
    gathers at lead inf), where each is a collective on the "fsdp" queue after the one before it
    and nothing else (a network one with a demand below the NIC: alone it runs at its full speed,
    :func:`~meshplan.schedule.unit_events.run`), shown; else None."""
    out, k, prev = [], -1, None
    for t in tasks:
        k += t.emit
        if t.start != -math.inf:
            continue
        if (not t.emit or t.queue != "fsdp" or t.kind not in (COMM, NET) or t.pred is not prev
                or any(d is not prev for d in t.deps) or (t.kind == NET and t.demand > 1.0 - ROOM)):
            return None
        out.append((k, t.work))
        prev = t
    return tuple(out)


def simulate(build, comm: CommTimes, w: Workload, ov: Overlap) -> UnitSim:
    """The unit ``build(s)`` issues on a :class:`StreamSim` ``s``, played once in time order. The
    cyclic garbage collector is paused meanwhile: a unit's tasks (thousands, alive until it is
    played) make no garbage cycles (:func:`~meshplan.schedule.unit_events.run` clears the successor
    lists), and the collections their allocations set off scanned the rest of the heap for nothing:
    the 405B example's dp_replicate 16 x dp_shard 128 x tp 8 step_time 53 -> 43 CPU ms (its units 49 ->
    39 ms; main's issue-order StreamSim 17 ms)."""
    paused = gc.isenabled()
    gc.disable()
    try:
        s = StreamSim(comm, w, ov)
        build(s)
        return s.finish()
    finally:
        if paused:
            gc.enable()
