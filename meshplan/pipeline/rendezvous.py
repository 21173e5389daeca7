"""Megatron-LM 2022's blocking pipeline p2p in the event simulation (:func:`calls`,
:func:`call_loads`, :func:`simulate_rendezvous`; :func:`meshplan.pipeline.simulate.simulate` runs
it when ``blocking_p2p``).

Sends are asynchronous (:mod:`~meshplan.pipeline.simulate`) unless ``blocking_p2p``: Megatron-LM
2022 (commit 2755bcb, ``megatron/p2p_communication.py`` ``_communicate``: the call's isend/irecv
ops go to ``torch.distributed.batch_isend_irecv``, calls ``wait`` on every request, then
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
NIC), and ``p2p_s`` is one send/recv pair at the link's rate (catalog ``p2p`` curve); with a time
per boundary the call spends its longest link's: its sends' times added per link, or its
receives' (:func:`call_seconds`: an NVLink transfer beside a NIC one runs at once, NCCL's group of
p2p ops to different peers on their own channels); with a pair time (``p2p_pair_s``) the
transfers sharing a link pay their fixed part once (:func:`link_load`). A send
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
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

from meshplan.pipeline.base import Unit
from meshplan.pipeline.sim_types import Event, PipelineResult, PipelineSpec, busy_times, critical_path_of, dependency

__all__ = ["calls", "call_loads", "call_seconds", "link_load", "simulate_rendezvous"]


def calls(spec: PipelineSpec, orders: list[list[Unit]]) -> tuple[dict, dict]:
    """Megatron-LM's combined p2p calls (module docstring) of ``orders``: (``peers``:
    (stage, position) of a call, position -1 before the first unit -> the sorted (stage,
    position) of the peer call of each of its waited transfers (an asynchronous side, under
    ``overlap_p2p``, is in no call); ``xfer``: (consumer stage, position) -> ((producer stage,
    producer position), send call, receive call, send asynchronous, receive asynchronous)).

    >>> spec = PipelineSpec("1f1b", 2, 2, blocking_p2p=True)
    >>> o = [spec.sched.order(2, 2, 1, s) for s in range(2)]  # stage 0: F0 F1 B0 B1; 1: F0 B0 F1 B1
    >>> peers, _ = calls(spec, o)
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
            key = dependency(sched, u, s, p, v)
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


def call_loads(xfer: dict, serial: bool = False) -> dict:
    """(stage, position) of a call -> ``k``, the larger of its waited sends and receives (at
    least 1), from :func:`calls`' ``xfer``: its transfers one after another on the rank's link;
    with ``serial`` (``PipelineSpec.serial_p2p``, DeepSpeed's one blocking call per transfer) their
    sum: a 1F1B middle stage's steady-state call, a send and a receive, counts 2 (p 3, m 4: 12 of the
    20 calls; stage 0's two steady calls, stage 1's seven after its first unit, stage 2's three).

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
    >>> o = [PipelineSpec("1f1b", 3, 4).sched.order(3, 4, 1, s) for s in range(3)]
    >>> sorted(Counter(call_loads(calls(PipelineSpec("1f1b", 3, 4, blocking_p2p=True), o)[1], serial=True).values()).items())
    [(1, 8), (2, 12)]
    """
    out = Counter(x[1] for x in xfer.values() if not x[3])
    inc = Counter(x[2] for x in xfer.values() if not x[4])
    return {k: out[k] + inc[k] if serial else max(out[k], inc[k]) for k in out.keys() | inc.keys()}


def call_seconds(spec: PipelineSpec, xfer: dict) -> dict:
    """(stage, position) of a call -> seconds it spends on its own transfers: ``k x p2p_s``
    (:func:`call_loads`) with one ``p2p_s``; per boundary, the longest of its links' loads: its
    waited sends' times added per link the rank sends them through, and its waited receives' per
    link it receives them through (each its boundary's time, :meth:`~.sim_types.PipelineSpec.transfer_s`,
    and link, :meth:`~.sim_types.PipelineSpec.link_of`; in flat order, as the array path's
    weighted counts add them). One ``batch_isend_irecv`` is one NCCL group (torch 2.13
    ``distributed_c10d.batch_isend_irecv``: the ops inside ``_coalescing_manager``, NCCL-style
    coalescing), and NCCL runs a group's sends and receives to different peers at once:
    NVIDIA/nccl 5067397 ``src/enqueue.cc`` ``scheduleP2pTasksToPlan`` (lines 1130-1213) puts every
    (send peer, receive peer) round of the group in one kernel plan, each round on its own channels
    (``addP2pToPlan``, lines 880-886 and 1051-1064: the channel base of its round,
    ``ncclP2pChannelBaseForRound`` in ``src/include/channel.h`` lines 21-33), and its user guide
    (``docs/userguide/source/usage/p2p.rst`` lines 21-25): calls within a group "progress
    independently", in order only to the same peer. So a send over NVLink and one through the NIC
    take the longer of the two, while two through the rank's one NIC (or over its NVLink) share it
    and add, as do the sends and receives of one direction; sends and receives, on full-duplex
    links, run beside each other.

    Why two NVLink sends to different peers add while a send and a receive do not (checked Dec
    2026; 1F1B's calls hold one send and one receive, so they never add; interleaved 1F1B's steady
    call sends to both neighbours and receives from both): NCCL gives one NVLink peer channels for
    the GPU's whole NVLink path (nccl 5067397 ``src/graph/paths.cc`` ``ncclTopoGetNchannels``,
    lines 920-940: ``2 x path->bw / nvlBw`` channels, the path through NVSwitch being all 18 of an
    H100's links at ``SM90_NVLINK_BW`` 20.6 GB/s, ``src/graph/topo.h`` line 22: 370.8 GB/s), and
    one pair measures at that ceiling: 371-377 GB/s one way between any two H100s of an HGX
    (p2pBandwidthLatencyTest, NVIDIA/nccl issue #1264), the per-GPU rate of the 8-GPU ring (~370,
    nccl-tests issue #212). A second peer finds no egress left: the GPU's 18 links carry both
    sends. The two directions are separate: the same test's bidirectional matrix gives ~783 GB/s
    per pair (issue #1264's title), twice one way, and nccl-tests' ring busbw is reached with every
    rank sending and receiving at once ("The tests are usually bidirectional, but we don't double
    the BW figure", NCCL maintainer, nccl-tests PR #189). What two transfers on one link share is
    their bytes, not their fixed part: one group is one kernel with each peer on its own channels,
    so with a pair time (:attr:`~.sim_types.PipelineSpec.p2p_pair_s`: the two as one transfer of
    both sizes on the same path, :func:`meshplan.schedule.steptime.boundary_p2p_s`) a link's
    transfers take :func:`link_load`, the fixed part once: two 4 KiB NVLink sends 14.3 us, not
    27.4; two 6 MiB sends through an A100's NIC 9.3 us less than twice one. No catalog node has
    more than one NIC per GPU (dgx-a100: two NICs per two GPUs, every GPU sending at once in a pp
    step), so a NIC's transfers share it as the NVLink's do.

    Interleaved 1F1B's steady-state call on the middle stage of 3 sends a forward output to stage
    2 and an input gradient to stage 0: 0.1 + 0.7 s through one link (boundary 0 0.1 s, 1 0.7 s),
    0.7 s where boundary 0 is NVLink and 1 the NIC:

    >>> spec = PipelineSpec("interleaved_1f1b", 3, 6, v=2, p2p_s=(0.1, 0.7, 0.7), blocking_p2p=True)
    >>> o = [spec.sched.order(3, 6, 2, s) for s in range(3)]
    >>> max(t for (s, _), t in call_seconds(spec, calls(spec, o)[1]).items() if s == 1)
    0.7999999999999999
    >>> spec = PipelineSpec("interleaved_1f1b", 3, 6, v=2, p2p_s=(0.1, 0.7, 0.7), p2p_link=(0, 1, 1), blocking_p2p=True)
    >>> max(t for (s, _), t in call_seconds(spec, calls(spec, o)[1]).items() if s == 1)
    0.7
    """
    if not spec.per_boundary and spec.p2p_pair_s is None:
        return {k: spec.p2p_s * n for k, n in call_loads(xfer, spec.serial_p2p).items()}
    load: dict = {}  # (call, 0 sends / 1 receives, link) -> [(seconds, pair seconds)] of its transfers
    for (s, _), ((a, _), send, recv, send_async, recv_async) in sorted(xfer.items()):
        t, link = (float(spec.transfer_s(a, s)), float(spec.pair_s(a, s))), spec.link_of(a, s)
        if not send_async:
            load.setdefault((send, 0, link), []).append(t)
        if not recv_async:
            load.setdefault((recv, 1, link), []).append(t)
    out: dict = {}
    for (call, _, _), ts in load.items():  # serial_p2p: one blocking call per transfer, so they add
        out[call] = out.get(call, 0.0) + sum(t for t, _ in ts) if spec.serial_p2p else max(out.get(call, 0.0),
                                                                                          link_load(ts))
    return out


def link_load(transfers: list[tuple[float, float]]) -> float:
    """Seconds of a call's transfers that share one link in one direction, each as (seconds
    alone, seconds of two such at once: :attr:`~.sim_types.PipelineSpec.p2p_pair_s`): the largest
    fixed part ``2 t - pair`` once, each transfer's share of the link ``pair - t`` added (one NCCL
    group, :func:`call_seconds`: one kernel, each peer on its own channels, their bytes through the
    one link). Without a pair time (``pair = 2 t``) the transfers' times add.

    >>> link_load([(0.3, 0.6), (0.3, 0.6)]), link_load([(0.3, 0.4)]), link_load([(0.3, 0.4), (0.3, 0.4)])
    (0.6, 0.3, 0.4)
    >>> round(link_load([(0.3, 0.4), (0.5, 0.9)]), 9)   # fixed parts 0.2 and 0.1: 0.2 + 0.1 + 0.4
    0.7
    """
    return max([0.0] + [2 * t - pair for t, pair in transfers]) + sum(pair - t for t, pair in transfers)


def simulate_rendezvous(spec: PipelineSpec, orders: list[list[Unit]]) -> PipelineResult:
    """:func:`~meshplan.pipeline.simulate.simulate` with Megatron-LM 2022's blocking calls (module docstring): a unit
    starts when the call before it ends (its input arrived in that call or an earlier one)."""
    p, v = spec.p, spec.v
    st = _Calls(spec, orders)
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            while len(st.ends[s]) < len(orders[s]) and st.place(s):
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {s: orders[s][len(st.ends[s])].label(v) for s in range(p) if len(st.ends[s]) < len(orders[s])}
            raise RuntimeError(f"schedule {spec.schedule} deadlocks at {stuck}")
    stage_ends = [got[0] for s in range(p) if (got := st.call_end(s, len(orders[s]) - 1)) is not None]
    busy = busy_times(st.events, p)
    last = [st.evs[s][-1] if st.evs[s] else None for s in range(p)]
    return PipelineResult(spec, tuple(st.events), max(stage_ends), busy, critical_path_of(last, stage_ends))


class _Calls:
    """What :func:`simulate_rendezvous` has placed so far: each stage's unit ends (seconds) and
    events, all events in the order placed (transfers included), with the calls' peers and
    transfers (:func:`calls`) and each call's seconds (:func:`call_seconds`)."""

    def __init__(self, spec: PipelineSpec, orders: list[list[Unit]]):
        self.spec, self.orders = spec, orders
        self.peers, self.xfer = calls(spec, orders)
        self.load = call_seconds(spec, self.xfer)
        self.ends: list[list[float]] = [[] for _ in range(spec.p)]
        self.evs: list[list[Event]] = [[] for _ in range(spec.p)]
        self.events: list[Event] = []

    def posted(self, stage: int, pos: int) -> bool:
        return pos < len(self.ends[stage])

    def post(self, stage: int, pos: int) -> float:
        """When ``stage`` issues its call after position ``pos`` (its unit's end; 0 before the first)."""
        return 0.0 if pos < 0 else self.ends[stage][pos]

    def call_end(self, s: int, pos: int) -> Optional[tuple[float, Optional[tuple[int, int]]]]:
        """(end of the call after position pos, the binding peer (stage, position) or None),
        or None while a peer has not posted."""
        mine = self.peers.get((s, pos), [])
        if not all(self.posted(*x) for x in mine):
            return None
        e, best, top = self.post(s, pos), None, 0.0
        for x in mine:  # sorted: the first latest peer binds
            t = self.post(*x)
            if t > e and (best is None or t > top):
                best, top = x, t
        return (max([e] + [self.post(*x) for x in mine]) + self.load[(s, pos)] if mine else e), best

    def place(self, s: int) -> bool:
        """Place stage ``s``'s next unit, and the send that brought its input across its boundary
        (``spec.transfer_s``; from when both sides posted): it starts when the call before it ends,
        or, where its input is waited for at the unit (``recv_async``), once that transfer is done.
        False (nothing placed) while a peer of that call has not posted or that input is not sent yet."""
        spec, v, evs = self.spec, self.spec.v, self.evs
        i = len(self.ends[s])
        got = self.call_end(s, i - 1)
        if got is None:
            return False
        free, best = got
        u = self.orders[s][i]
        (a, ia), send, recv, _, recv_async = self.xfer.get((s, i), ((s, i), (s, i), (s, i), False, False))
        if recv_async and not self.posted(*send):  # its input is waited for at the unit: sent yet?
            return False
        start = free
        link = spec.transfer_s(a, s) if (s, i) in self.xfer else 0.0  # its boundary's
        if link > 0:
            x0 = max(self.post(*send), self.post(*recv))
            self.events.append(Event(a, "pp", f"send {evs[a][ia].name}", x0, x0 + link))
        pred, via = (evs[best[0]][best[1]], "p2p") if best else (evs[s][-1] if i else None, "stream")
        if recv_async and (ready := max(self.post(*send), self.post(*recv)) + link) > free:
            start = ready  # the transfer, started once both sides posted, ends after the call
            pred, via = evs[send[0]][send[1]] if self.post(*send) >= self.post(*recv) else evs[s][recv[1]], "p2p"
        ev = Event(s, "compute", u.label(v), start, start + spec.unit_s(s, u),
                   {"kind": u.kind, "mb": u.mb, "chunk": u.chunk, "via": via, "wait_s": start - free,
                    "pred": pred})
        self.events.append(ev)
        evs[s].append(ev)
        self.ends[s].append(ev.end_s)
        return True
