"""Accounting over the simulated pipeline (:mod:`meshplan.pipeline.fast`): what each stage's
compute stream spends idle (:func:`stage_bubble`) and exposed (:func:`unit_exposure`), the
blocking calls of Megatron-LM 2022 split into transfers and waits for the partner
(:func:`pp_hold_split`, :func:`call_loads`, :func:`call_seconds`, :func:`transfer_loads`), where a stage's pipeline run ends
(:func:`ends_of`, :func:`stage_run_end`), the shift between schedule runs (:func:`run_shift`), and
the pipeline simulated again without some waits (:func:`pipeline_without`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from meshplan.pipeline.fast import KINDS, ArrayResult, Transfers, simulate_arrays
from meshplan.pipeline.calls import call_table, stage_calls
from meshplan.pipeline.simulate import Event
from meshplan.schedule.unit_times import UnitTimes


def pipeline_without(res: ArrayResult, waits_s: np.ndarray) -> ArrayResult:
    """``res``'s pipeline simulated again with every flat unit shortened by ``waits_s`` (seconds,
    per flat unit): what the schedule does without those waits (:meth:`~meshplan.schedule.step_summary.StepTime.without_fsdp_waits`).

    Interleaved 1F1B, p 2, m 2, v 2, a chunk's F 0.5 s and B 1 s: stage 0 runs F0.c0 F1.c0 F0.c1
    F1.c1 B0.c1 B1.c1 B0.c0 B1.c0, bubble 1.5 / 6 = (p - 1) / (v m) = 0.25, step 7.5 s. With a
    0.5 s wait after each stage's last backward of chunk 1 (perform_reduce_grad), stage 1's B1.c1
    ends at 5, stage 0's B1.c1 runs 5-6.5, its B0.c0 B1.c0 6.5-8.5: step 8.5 s, bubble (8.5 -
    6.5) / 6.5 = 0.3077; removing the waits gives back the schedule's 0.25:

    >>> from meshplan.pipeline.simulate import PipelineSpec
    >>> spec = PipelineSpec("interleaved_1f1b", 2, 2, v=2, forward_s=1.0, backward_s=2.0)
    >>> f = simulate_arrays(spec).flat
    >>> waits = np.where((f.kind == 1) & (f.chunk == 1) & (f.mb == 1), 0.5, 0.0)
    >>> r = simulate_arrays(spec, lambda flat: np.where(flat.kind == 0, 0.5, 1.0) + waits)
    >>> r.step_s, round(r.bubble, 4), pipeline_without(r, waits).step_s, pipeline_without(r, waits).bubble
    (8.5, 0.3077, 7.5, 0.25)
    """
    dur = res.end - res.start
    np.subtract(dur, waits_s, out=dur)  # (in place: 10^6 units)
    return simulate_arrays(res.spec, lambda f: dur, like=res)  # res's units and calls


def stage_bubble(res: ArrayResult, s: int, tail_s: float = 0.0, later_runs: int = 0, run_s: float = 0.0) -> float:
    """Stage s's compute stream idle in the pipeline ``res``, seconds (the ``bubble`` of
    :meth:`~meshplan.schedule.step_summary.StepTime.parts_s`): before its first unit and between units (a receive's wait beyond
    its transfer; the transfer is exposed "pp"), and each blocking call's wait for its partner
    (:func:`pp_hold_split`; the last call's only where its hold outlasts the last unit's
    communication tail ``tail_s``, :func:`last_tail_s`). ``later_runs`` schedule runs after
    the first, ``run_s`` apart (:func:`run_shift`): each idles ``run_s`` less run 1's busy and
    exposed time.

    1F1B p 2, m 2, F 1 s, B 2 s, p2p 0.5 s: stage 1 runs F0 1.5-2.5, B0 2.5-4.5, F1 4.5-5.5,
    B1 5.5-7.5; stage 0 F0 0-1, F1 1-2, B0 5-7 (stage 1's B0 + 0.5 transfer), B1 8-10: idle 3 + 1
    less the two receives' transfers (exposed "pp") = 3 s; stage 1's: 1.5 - 0.5 = 1 s:

    >>> from meshplan.pipeline.simulate import PipelineSpec
    >>> r = simulate_arrays(PipelineSpec("1f1b", p=2, m=2, p2p_s=0.5))
    >>> stage_bubble(r, 0), stage_bubble(r, 1)
    (3.0, 1.0)
    """
    sl = res.stage_slice(s)
    split = pp_hold_split(res, s)
    wait = res.wait[sl]
    via = res.via_at(np.arange(sl.start, sl.stop)) if wait.any() else np.zeros(len(wait), dtype=bool)
    received = np.where(via, np.minimum(res.input_s[sl], wait), 0.0)  # exposed on "pp" (unit_exposure)
    i = sl.stop - 1
    hold = float(res.hold[i]) if res.hold is not None else 0.0
    last_wait = float(split.wait_s[-1]) if hold and not (tail_s >= hold and tail_s) else 0.0
    bubble = sum([split.lead_wait_s, last_wait] + (wait - received).tolist() + split.wait_s[:-1].tolist())
    if later_runs:  # each later run as run 1, run_s apart: its idle is run_s less run 1's busy and exposed time
        run_end = float(res.end[i]) + max(tail_s, hold)  # run 1 on stage s (stage_run_end)
        bubble += later_runs * (run_s - (run_end - bubble))
    return bubble


def last_tail_s(res: ArrayResult, s: int, units: "UnitTimes") -> float:
    """Seconds of communication tail after stage s's last unit (flat order) in ``res``."""
    i = res.stage_slice(s).stop - 1
    return units.get(s, int(res.flat.chunk[i]), KINDS[int(res.flat.kind[i])], int(res.flat.mb[i])).tail_s


def ends_of(res: ArrayResult) -> list[list[Event]]:
    """Per stage, its last unit (the first to reach the latest end) and its first forward (the
    first to start earliest): the only events :func:`~meshplan.schedule.step_end.stage_end` reads; every stage at once
    (stage-major rows of ``res.flat.length`` units)."""
    p, length = res.flat.p, res.flat.length
    rows = np.arange(p) * length
    last = rows + res.end.reshape(p, length).argmax(axis=1)
    first_f = rows + np.where(res.flat.kind.reshape(p, length) == 0, res.start.reshape(p, length), np.inf).argmin(axis=1)
    evs = res._events(np.stack([last, first_f], axis=1).reshape(-1))
    return [evs[2 * s:2 * s + 2] for s in range(p)]


def call_transfer_s(res: ArrayResult, s: int) -> np.ndarray:
    """Per unit of stage ``s`` (flat order), seconds the blocking call issued after it spends
    on its own transfers: ``k x p2p_s``, ``k`` the larger of the call's sends and receives
    (:func:`meshplan.pipeline.rendezvous.call_loads`: they share the rank's link), or with a time
    per boundary its sends' or its receives' times added (:func:`call_seconds`); 0 for a call
    without transfers and without blocking sends. A call's hold is its partner's lateness plus
    this (:func:`pp_hold_split`).

    >>> from meshplan.pipeline.fast import simulate_arrays
    >>> from meshplan.pipeline.simulate import PipelineSpec
    >>> r = simulate_arrays(PipelineSpec("1f1b", p=2, m=2, p2p_s=0.5, blocking_p2p=True))
    >>> call_transfer_s(r, 0).tolist(), r.hold[r.stage_slice(0)].tolist()  # F0 F1 B0 B1
    ([0.5, 0.5, 0.5, 0.0], [0.5, 2.5, 1.5, 0.0])

    (F 1 s, B 2 s: stage 0's call after F1, posted at 2.5, meets stage 1's after its B0, posted
    at 4.5: free at 4.5 + 0.5, hold 2.5 = 2 waiting for stage 1 + 0.5 transfer.)
    """
    return call_seconds(res)[s, 1:]


def call_seconds(res: ArrayResult) -> np.ndarray:
    """Seconds every stage's calls spend on their own transfers (:func:`call_transfer_s`), shape
    (p, L + 1) as :func:`call_loads`: ``k x p2p_s`` with one ``p2p_s``; per boundary the
    simulation's call table's seconds (:func:`meshplan.pipeline.calls.call_table`, each transfer
    its boundary's: :func:`meshplan.pipeline.rendezvous.call_seconds`).

    >>> from meshplan.pipeline.simulate import PipelineSpec
    >>> r = simulate_arrays(PipelineSpec("1f1b", p=3, m=2, p2p_s=(0.5, 0.25, 0.25), blocking_p2p=True))
    >>> call_seconds(r)[1].tolist()  # stage 1: leading call, then after F0 F1 B0 B1
    [0.5, 0.5, 0.25, 0.5, 0.5]

    (Stage 1 receives F0's input from stage 0 first (0.5); after F0 it sends to stage 2 (0.25)
    and receives F1's input (0.5); after F1 it sends to 2 and receives B0's gradient from 2 (0.25
    each); after B0 it sends to 0 (0.5) and receives B1's from 2; after B1 it sends to 0.)
    """
    if res.transfers is None:
        return call_loads(res)  # zeros: no blocking call
    if not res.spec.per_boundary and res.spec.p2p_pair_s is None:
        return call_loads(res) * res.spec.p2p_s
    return stage_calls(call_table(res.transfers, res.flat.p, res.flat.length)[3], res.flat.p, res.flat.length)


def call_loads(res: ArrayResult) -> np.ndarray:
    """``k`` of every stage's calls (:func:`call_transfer_s`), shape (p, L + 1): per stage its
    leading call (receives posted before its first unit), then the call after each unit;
    zeros without blocking sends. One count over all transfers (pass it to
    :func:`pp_hold_split` when splitting every stage): the simulation's call table's
    (:func:`meshplan.pipeline.calls.call_table`, kept on ``res.transfers``, indexed by the slot
    after each call), else :func:`transfer_loads`. Read-only (a view of that table)."""
    p, length = res.flat.p, res.flat.length
    if res.transfers is None:
        return np.zeros((p, length + 1))
    if res.transfers.calls is not None:  # the simulation's own count: per slot after each call
        return stage_calls(res.transfers.calls[1], p, length)
    return transfer_loads(res.transfers, p, length)


def transfer_loads(transfers: Transfers, p: int, length: int) -> np.ndarray:
    """:func:`call_loads` from the blocking calls alone (:func:`meshplan.pipeline.calls.rendezvous`
    of a spec, no simulation needed), shape (p, L + 1): per stage its leading call, then the call
    after each of its ``length`` units. Each such call holds its stage at least ``k x p2p_s``
    after its post (:func:`meshplan.pipeline.rounds.run_rounds`: ``max(post, peer posts) + k
    p2p_s``), which the search's step-time bound counts (:func:`meshplan.search.pipeline.call_holds`).

    torch 2.13's 1F1B at p 2, m 2 (stage 0: F0 F1 B0 B1; stage 1: F0 B0 F1 B1): stage 0's F0 is
    sent without a wait (the warm-up's first forward), F1 with B0's receive in one waited call,
    B1's receive alone; stage 1 receives F0 in its leading call, sends B0 with F1's receive, and
    waits B1's send at the step's end (its F0 and F1 feed its own backwards: no call after them):

    >>> from meshplan.pipeline.fast import flat_units, rendezvous
    >>> from meshplan.pipeline.simulate import PipelineSpec
    >>> spec = PipelineSpec("1f1b", p=2, m=2, blocking_p2p=True, torch_p2p=True)
    >>> transfer_loads(rendezvous(spec, flat_units("1f1b", 2, 2, 1)), 2, 4).astype(int).tolist()
    [[0, 0, 1, 1, 0], [1, 0, 1, 0, 1]]
    """
    width = p * (length + 2) + 1  # per stage: the leading slot, a slot after each unit, a trailing one
    ws, wr = transfers.sides()  # asynchronous sides (overlap_p2p_comm) hold no call
    sends = np.bincount(transfers.send[ws].astype(np.int64) + 1, minlength=width)  # by the slot after the call
    recvs = np.bincount(transfers.recv[wr].astype(np.int64) + 1, minlength=width)
    return stage_calls(np.maximum(sends, recvs), p, length).astype(float)


class HoldSplit(NamedTuple):
    """Stage s's blocking calls (Megatron-LM 2022's rendezvous, :mod:`meshplan.pipeline.rendezvous`)
    split into their transfers and the wait for their partner, seconds: ``lead_*`` the call
    before its first unit (free at ``lead_transfer_s + lead_wait_s``), ``transfer_s`` and
    ``wait_s`` (arrays, one per unit, flat order) the call after each unit, ``hold = transfer +
    wait``. All zero with asynchronous sends."""

    lead_transfer_s: float
    lead_wait_s: float
    transfer_s: np.ndarray
    wait_s: np.ndarray


def pp_hold_split(res: ArrayResult, s: int, seconds: Optional[np.ndarray] = None) -> HoldSplit:
    """Each blocking call of stage ``s`` as (its transfers on the critical path: ``k x p2p``,
    :func:`call_transfer_s`, each transfer its boundary's; the rest of its hold: waiting for the partner stage to post its
    call, pipeline bubble): a call ends at ``max(own post, partner posts) + k p2p``, so a hold
    is the partner's lateness plus ``k p2p``. The step exposes the transfers on "pp"
    (:func:`unit_exposure`, :func:`~meshplan.schedule.step_end.stage_end`), the waits are bubble (:meth:`~meshplan.schedule.step_summary.StepTime.parts_s`).
    ``seconds``: :func:`call_seconds` (default: counted here).

    >>> from meshplan.pipeline.fast import simulate_arrays
    >>> from meshplan.pipeline.simulate import PipelineSpec
    >>> r = simulate_arrays(PipelineSpec("1f1b", p=2, m=2, p2p_s=0.5, blocking_p2p=True))
    >>> h = pp_hold_split(r, 0)  # stage 0: F0 F1 B0 B1 (F 1 s, B 2 s)
    >>> h.transfer_s.tolist(), h.wait_s.tolist()
    ([0.5, 0.5, 0.5, 0.0], [0.0, 2.0, 1.0, 0.0])
    >>> h = pp_hold_split(r, 1)  # stage 1 receives F0 before its first unit: posted at 0, F0 at 1
    >>> h.lead_transfer_s, h.lead_wait_s
    (0.5, 1.0)
    """
    sl = res.stage_slice(s)
    n = sl.stop - sl.start
    if res.hold is None or not n:
        return HoldSplit(0.0, 0.0, np.zeros(n), np.zeros(n))
    xfer = (call_seconds(res) if seconds is None else seconds)[s]
    lead_free = float(res.start[sl.start] - res.wait[sl.start])  # the leading call's end (0 without)
    lead = min(lead_free, float(xfer[0]))
    hold = res.hold[sl]
    moved = np.minimum(hold, xfer[1:])
    return HoldSplit(lead, lead_free - lead, moved, hold - moved)


def last_transfer_s(res: ArrayResult, s: int, seconds: Optional[np.ndarray] = None) -> float:
    """``pp_hold_split(res, s, seconds).transfer_s[-1]`` (seconds: the transfers of the call after
    stage s's last unit) without splitting the stage's other calls: ``min(hold, k x p2p)`` of
    that one call, the same operands (:func:`~meshplan.schedule.steptime.step_time` asks it of
    every stage: 128 stages x 8,192 units at pp 128).

    >>> from meshplan.pipeline.fast import simulate_arrays
    >>> from meshplan.pipeline.simulate import PipelineSpec
    >>> r = simulate_arrays(PipelineSpec("1f1b", p=2, m=2, p2p_s=0.5, blocking_p2p=True))
    >>> [last_transfer_s(r, s) for s in (0, 1)] == [float(pp_hold_split(r, s).transfer_s[-1]) for s in (0, 1)]
    True
    """
    sl = res.stage_slice(s)
    if res.hold is None or sl.stop == sl.start:
        return 0.0
    xfer = (call_seconds(res) if seconds is None else seconds)[s, -1]
    return float(np.minimum(res.hold[sl.stop - 1], xfer))


def unit_exposure(res: ArrayResult, s: int, units: UnitTimes, keys: list, key_idx: np.ndarray, ex: dict) -> dict:
    """``ex`` plus the exposed time of every unit of stage s by stream and, for each unit
    that waited on a p2p receive, ``min(p2p, wait)`` on "pp" (its boundary's transfer, :attr:`~meshplan.pipeline.fast.ArrayResult.input_s`), and with blocking sends the
    transfers of the stage's calls (its leading call's and every unit's but the last's,
    :func:`pp_hold_split`; the last's: :func:`~meshplan.schedule.step_end.stage_end`); added in unit order, so the
    sums are the per-event loop's to the bit."""
    sl = res.stage_slice(s)
    kidx, via = key_idx[sl], res.via_at(np.arange(sl.start, sl.stop))
    streams = sorted({k for key in set(kidx.tolist()) for k in units.by_key(keys[key]).exposed_s})
    for k in streams:
        vals = np.array([units.by_key(key).exposed_s.get(k, 0.0) for key in keys])[kidx]
        if k == "pp":
            vals = np.stack([vals, np.where(via, np.minimum(res.input_s[sl], res.wait[sl]), 0.0)], 1)
        ex[k] = sum(vals.reshape(-1).tolist(), ex.get(k, 0.0))
    if "pp" not in streams and via.any():
        waits = np.minimum(res.input_s[sl][via], res.wait[sl][via])
        ex["pp"] = sum(waits.tolist(), ex.get("pp", 0.0))
    if res.hold is not None:  # blocking sends: their transfers (the last call's: step_end.stage_end)
        split = pp_hold_split(res, s)
        if split.lead_transfer_s or split.transfer_s[:-1].any():
            ex["pp"] = sum([split.lead_transfer_s] + split.transfer_s[:-1].tolist(), ex.get("pp", 0.0))
    return ex


def last_hold(res: ArrayResult, s: int) -> float:
    """Seconds stage s's last unit holds its stream for a blocking send (0 without)."""
    return 0.0 if res.hold is None else float(res.hold[res.stage_slice(s)][-1])


def stage_run_end(mine, units: "UnitTimes", hold: float = 0.0) -> float:
    """End of a stage's pipeline run: its last unit (``mine``: its compute events) and the
    communication tail or blocking send after it (``hold`` seconds), before the step-end ops."""
    last = max(mine, key=lambda e: e.end_s)
    return last.end_s + max(units.of_event(last).tail_s, hold)


def run_shift(res: ArrayResult, units: "UnitTimes") -> float:
    """Seconds from one pipeline schedule run's start to the next's (``training.pp_schedule_runs``):
    the least uniform shift at which every stage is free when its first unit of the next run
    starts, ``max_s (run end_s - first start_s)`` (stage 0 starts the next run when its own run
    ends; stage s's first unit starts ``first start_s`` after it, on the same inputs). Every run
    starts from sharded parameters (``PipelineStage.perform_reduce_grad`` resharded them), so each
    repeats the first."""
    out = 0.0
    for s, mine in enumerate(ends_of(res)):
        first = float(res.start[res.stage_slice(s)].min())
        out = max(out, stage_run_end(mine, units, last_hold(res, s)) - first)
    return out
