"""Where the timeline runs the all-gathers of torch's UNSHARD actions (``training.framework =
"torch"``, pp > 1, a multi-stage schedule: interleaved 1F1B, ZB-H1, ZB-V, DualPipeV, which torch 2.13
runs on ``_PipelineScheduleRuntime``; :mod:`meshplan.pipeline.unshard_window`): each chunk's first
all-gathers of the step and, at vpp > 3, the window's re-gathers of an evicted chunk, issued at the
UNSHARD torch's lowering places and waited for by the pass that needs the chunk.

torch 2.13 ``torch/distributed/pipelining/schedules.py``: ``_add_unshard_reshard`` (lines
1285-1365) inserts ``UNSHARD`` of a chunk not active before compute op ``i`` of the rank's order,
up to ``window - 1`` distinct chunks ahead of the op ``b`` that needs it: before op 0 the first
``window`` distinct chunks of the order (every chunk at vpp <= 3), and for an evicted chunk
:func:`~meshplan.pipeline.unshard_window.regather_spans`
(:func:`~meshplan.pipeline.unshard_window.unshard_spans`: both); ``_step_microbatches`` runs it as
``submodule.unshard(async_op=True)`` of every ``FSDPModule`` of the stage (lines 2489-2500) and
waits for every handle before the chunk's next compute (``_assert_unsharded``, lines 2394-2405,
called by F / B / I / W at 2517, 2548, 2576, 2598). FSDP2 (``_fully_shard/_fsdp_param_group.py``
``get_all_gather_streams``, lines 116-126) issues an ``async_op`` all-gather from the current
stream, so NCCL starts it once the compute issued before it (op ``i - 1``; at ``i = 0`` the step's
start) is done; the handle's ``wait`` (``wait_for_unshard``) makes the compute stream wait for it
and copies out. The pass's own FSDP pre-forward hooks then find every unit gathered: the chunk's
first pass has no per-layer prefetch.

So the chunk's all-gathers (every layer's unit, the root units this pass finds sharded; the
routed experts' on the efsdp stream) run back to back on the FSDP stream from the end of op
``i - 1`` (the step's start at ``i = 0``), while ops ``i..b-1`` compute (and, at ``b = 0`` on a
later stage, while it waits for its input), and op ``b`` starts with their copy-outs once all
are done. In the unit timeline of op ``b`` (times from its start) they are issued at ``-lead_s``,
``lead_s`` the time from the end of op ``i - 1`` to the start op ``b`` has without them (ops
``i..b-1``, any wait between them and for op ``b``'s input, less the gathers queued ahead of
them: :func:`simulate_unshards`), so the exposed FSDP time is ``max(0, gathers - lead_s)``: on
stage 0 the first chunk's gathers are all exposed before its first forward (``lead_s`` 0). The
UNSHARDs issued before one op queue on the FSDP group's NCCL stream (torch issues them one after
another: before op 0 the first three chunks'), each chunk's gathers after those ahead of it (the
efsdp stream's counted with them, as one queue). A pass's later gathers (a chunk resharded after
forward) stay in the pass, as FSDP2's per-layer prefetch (:mod:`~meshplan.schedule.rank_timeline`).
FSDP stream contention with other units' collectives is ignored, as between units everywhere.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache
from typing import Callable, Optional

import numpy as np

from meshplan.pipeline.fast import ArrayResult, Flat, simulate_arrays
from meshplan.pipeline.simulate import Event, PipelineSpec, stage_order
from meshplan.pipeline.unshard_window import unshard_spans, unshards_first
from meshplan.schedule.comm_times import root_groups
from meshplan.schedule.unit_sim import ChunkCosts, StreamSim, UnitSim


@lru_cache(maxsize=256)
def unshard_leads(schedule, p: int, m: int, v: int, stage: int, window: int) -> tuple[tuple[tuple, int, int], ...]:
    """((chunk, kind, micro-batch), i, b) of each UNSHARD of ``stage``'s order (a chunk's first
    op, and a window re-gather at vpp > ``window``) whose op ``b`` is an F or B pass (those
    :func:`meshplan.comm.fsdp_rows.fsdp_gather_flags` counts the gather on; a W op that finds its
    chunk evicted leaves the gather to the chunk's next pass, as there): torch's UNSHARD is issued
    after op ``i - 1`` (``i = 0``: at the step's start). Empty without a window (``window`` 0) and
    for the single-stage schedules (GPipe, 1F1B: ``PipelineScheduleSingle``, no UNSHARD action,
    ``torch_waits``), whose passes gather as FSDP2's hooks do.

    >>> unshard_leads("interleaved_1f1b", 2, 2, 4, 0, 3)  # F0.c0-F0.c2 UNSHARDed before op 0; B0.c0 before op 10
    (((0, 'F', 0), 0, 0), ((1, 'F', 0), 0, 2), ((2, 'F', 0), 0, 4), ((3, 'F', 0), 2, 6), ((0, 'B', 0), 10, 14))
    >>> unshard_leads("1f1b", 2, 2, 1, 0, 3)
    ()
    """
    if not unshards_first(schedule, window):
        return ()
    order = stage_order(schedule, p, m, v, stage)
    spans = unshard_spans([u.chunk for u in order], window)
    return tuple(((order[b].chunk, order[b].kind, order[b].mb), i, b) for i, b in spans if order[b].kind in ("F", "B"))


def simulate_unshards(spec: PipelineSpec, units, durations: Callable[[Flat], np.ndarray]) -> ArrayResult:
    """The step's pipeline simulation (:func:`~meshplan.pipeline.fast.simulate_arrays` of ``spec``
    and ``durations``, which reads ``units``' keys) with each UNSHARD's pass waiting for its
    gathers (``units``: a :class:`~meshplan.schedule.unit_times.UnitTimes`). The gathers of the
    UNSHARDs torch issues before one op (chunks 0-2 before op 0) run one after another, in torch's
    order (the chunks' next ops'), on the FSDP group's one NCCL stream: each starts ``before_s``,
    the seconds of those issued ahead of it, after op ``i - 1`` ends (the step's start at ``i = 0``).
    First run: each such pass timed with its gathers hidden (lead infinite) and started no earlier
    than that plus its own gathers' seconds (``after``); there its lead is its start without that
    wait (after the op before it, none for a stage's first op, and its input) less the start of its
    gathers, rounded to the picosecond (so the passes of a steady state share their timelines), and
    ``units.leads`` take it. Second run, returned: every pass as its timeline, with the leads (the
    same times within a picosecond per UNSHARD; the gathers and their wait in the pass's timeline,
    where the exposure, the trace and the link loads read them; on the first run's flat units and
    blocking calls, ``like``: a run with ``after`` logs no rounds to replay). One run without UNSHARDs."""
    if not units.unshards:
        return simulate_arrays(spec, durations)
    queued = _queued(units)
    first = simulate_arrays(spec, durations, after=lambda f: _after(queued, f))
    f, end, n = first.flat, first.end, len(first.end)
    for s, key, i, b, before_s, _ in queued:
        x, d = s * f.length + b, int(f.dep[s * f.length + b])
        ready = float(end[x - 1]) if b else 0.0  # a stage's first op: after nothing on its stage
        if d < n:
            ready = max(ready, end[d] + (spec.transfer_s(d // f.length, s) if f.cross[x] else 0.0))
        issued = float(end[s * f.length + i - 1]) if i else 0.0
        units.leads[s][key] = round(float(ready - issued - before_s), 12)
    return simulate_arrays(spec, durations, like=first)  # first's flat units and blocking calls, built once


def _queued(units) -> list[tuple[int, tuple, int, int, float, float]]:
    """(stage, pass key, i, b, ``before_s``, own seconds) of each UNSHARD of ``units``: its gathers'
    seconds (the pass's timeline with no lead less its timeline with them hidden) and those of the
    UNSHARDs its stage issues before the same op ``i`` ahead of it (in order of ``b``, torch's)."""
    out = []
    for s, got in units.unshards.items():
        ahead: dict = {}
        for (chunk, kind, mb), i, b in got:
            k = units.key(s, chunk, kind, mb)
            own = units.by_key(k[:6] + (0.0,) + k[7:]).duration_s - units.by_key(k).duration_s
            out.append((s, (chunk, kind, mb), i, b, ahead.get(i, 0.0), own))
            ahead[i] = ahead.get(i, 0.0) + own
    return out


def _after(queued, f: Flat) -> tuple[np.ndarray, np.ndarray]:
    """Per flat unit (``after`` of :func:`~meshplan.pipeline.fast.simulate_arrays`): op ``i - 1``
    of each UNSHARD's pass (-1 at ``i = 0``: the step's start) and the seconds until its gathers
    are done (:func:`_queued`: those ahead of it and its own); -1 and 0 for every other unit."""
    idx, sec = np.full(len(f.kind), -1, dtype=np.int64), np.zeros(len(f.kind))
    for s, _, i, b, before_s, own in queued:
        idx[s * f.length + b] = s * f.length + i - 1 if i else -1
        sec[s * f.length + b] = before_s + own
    return idx, sec


def unshard_chunk(s: StreamSim, chunk: ChunkCosts, phase: str, lead_s: float, root: bool) -> None:
    """Torch's UNSHARD of ``chunk`` for a pass of ``phase`` ("forward" / "backward") issued
    ``lead_s`` seconds before the pass starts (module docstring): every layer's all-gather (and
    its routed experts', efsdp), then the embedding's and head's units where ``root`` (the pass
    finds them sharded; ``phase``'s rows of the table, none where it has no such row), from
    ``-lead_s`` on their streams; then the compute stream waits for all of them and runs their
    copy-outs (FSDP2's ``wait_for_unshard``), so the pass's own layers gather nothing more."""
    c = s.c
    s.queues_from(("fsdp", "efsdp"), -lead_s)
    waits = [s.comm("shard", phase, "all-gather", f"fsdp AG L{i} {_ahead(lead_s)}", "layer")
             for i in range(len(chunk.layers))]
    copy_s = len(chunk.layers) * c.copies.get(("layer", "all-gather"), 0.0)
    for i, moe in enumerate(chunk.moe):
        if moe:
            waits.append(s.comm("shard", phase, "all-gather", f"efsdp AG L{i} (UNSHARD)", "expert"))
            copy_s += c.copies.get(("expert", "all-gather"), 0.0)
    emb_g, head_g = root_groups(c)
    groups = [g for g, part in ((emb_g, chunk.embed), (head_g, chunk.head)) if part is not None and root]
    for g in dict.fromkeys(groups):  # one root unit: gathered once
        ev = s.comm("shard", phase, "all-gather", f"fsdp AG {g} (UNSHARD)", g)
        waits.append(ev)
        copy_s += c.copies.get((g, "all-gather"), 0.0) if ev is not None else 0.0
    s.compute("UNSHARD wait and copy-out", copy_s, [w for w in waits if w is not None])


def _ahead(lead_s: float) -> str:
    """The lead in an UNSHARD gather's name (its milliseconds; "inf" at lead inf)."""
    return f"(UNSHARD, {lead_s * 1e3:.3f} ms ahead)"


def hidden_lead(base: UnitSim, lead_s: float) -> Optional[UnitSim]:
    """The pass of ``base`` (its timeline at lead inf, :attr:`~meshplan.schedule.unit_sim.UnitSim.early`
    its gathers) with its UNSHARD issued ``lead_s`` seconds ahead, where the gathers all end before
    the pass starts: they run alone and back to back from ``-lead_s`` (each at its seconds alone, a
    network one at its full NIC share: nothing else runs before the pass's start), so from 0 on
    the unit plays as at lead inf (the copy-out finds them done; nothing they hold, NIC or SMs, is
    left at 0; they lengthen no other collective, :func:`~meshplan.schedule.nic_fair.nic_waits`):
    ``base`` with the gathers' events at their times and names. The same timeline, to the bit, as
    simulating the pass at ``lead_s`` (tests/test_window_unshard.py), without playing its ~10^2
    tasks again: 98% of the 405B search's UNSHARD passes with a finite lead (13,222 of 13,491
    measured) hide their gathers, 75% of its unit simulations. None where they do not all end
    before 0 (or ``base`` has none of that shape): the pass is simulated."""
    if not base.early or not lead_s < math.inf:
        return None
    t, times = -lead_s, {}
    for k, work in base.early:
        times[k] = (t, t + work)
        t += work
    if not t < 0.0:
        return None
    events, old, new = list(base.events), _ahead(math.inf), _ahead(lead_s)
    for k, (a, b) in times.items():
        e = events[k]
        events[k] = Event(e.stage, e.stream, e.name.replace(old, new), a, b, dict(e.args))
    return replace(base, events=tuple(events), exposed_s=dict(base.exposed_s), nic_wait=dict(base.nic_wait),
                   early=None)
