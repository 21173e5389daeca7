"""Where the timeline runs the all-gathers of torch's window re-gathers (interleaved 1F1B at vpp >
3 under ``training.framework = "torch"``, :mod:`meshplan.pipeline.unshard_window`): issued at
the UNSHARD action torch's lowering places, waited for by the pass that needs the chunk.

torch 2.13 ``torch/distributed/pipelining/schedules.py``: ``_add_unshard_reshard`` (lines
1285-1365) inserts ``UNSHARD`` of an evicted chunk before compute op ``i`` of the rank's order,
up to ``window - 1`` distinct chunks ahead of the op ``b`` that needs it
(:func:`~meshplan.pipeline.unshard_window.regather_spans`); ``_step_microbatches`` runs it as
``submodule.unshard(async_op=True)`` of every ``FSDPModule`` of the stage (lines 2489-2500) and
waits for every handle before the chunk's next compute (``_assert_unsharded``, lines 2394-2405,
called by F / B / I / W at 2517, 2548, 2576, 2598). FSDP2 (``_fully_shard/_fsdp_param_group.py``
``get_all_gather_streams``, lines 116-126) issues an ``async_op`` all-gather from the current
stream, so NCCL starts it once the compute issued before it (op ``i - 1``) is done; the
handle's ``wait`` (``wait_for_unshard``) makes the compute stream wait for it and copies out.

So the chunk's all-gathers (every layer's unit, the root units this pass finds sharded; the
routed experts' on the efsdp stream) run back to back on the FSDP stream from the end of op
``i - 1``, while ops ``i..b-1`` compute, and op ``b`` starts with their copy-outs once all are
done. In the unit timeline of op ``b`` (times from its start) they are issued at ``-lead_s``,
``lead_s`` the time from the end of op ``i - 1`` to the start op ``b`` has without them (ops
``i..b-1`` and any wait between them: :func:`simulate_unshards`), so the exposed FSDP time is
``max(0, gathers - lead_s)``. A chunk's first gathers of the step (its UNSHARD among the first
ops) stay in the pass, as FSDP2's per-layer prefetch (:mod:`~meshplan.schedule.rank_timeline`);
FSDP stream contention with other units' collectives is ignored, as between units everywhere.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

import numpy as np

from meshplan.pipeline.fast import ArrayResult, Flat, simulate_arrays
from meshplan.pipeline.simulate import PipelineSpec, stage_order
from meshplan.pipeline.unshard_window import regather_spans
from meshplan.schedule.comm_times import root_groups
from meshplan.schedule.unit_sim import ChunkCosts, StreamSim


@lru_cache(maxsize=256)
def regather_leads(schedule, p: int, m: int, v: int, stage: int, window: int) -> tuple[tuple[tuple, int, int], ...]:
    """((chunk, kind, micro-batch), i, b) of each window re-gather of ``stage``'s order whose op
    ``b`` is an F or B pass (those :func:`meshplan.comm.fsdp_rows.fsdp_gather_flags` counts the
    gather on; a W op that finds its chunk evicted leaves the gather to the chunk's next pass, as
    there): torch's UNSHARD is issued after op ``i - 1``. Empty at ``v <= window``.

    >>> regather_leads("interleaved_1f1b", 2, 2, 4, 0, 3)  # B0.c0 waits for the UNSHARD before B0.c2
    (((0, 'B', 0), 10, 14),)
    """
    if not window or v <= window:
        return ()
    order = stage_order(schedule, p, m, v, stage)
    spans = regather_spans([u.chunk for u in order], window)
    return tuple(((order[b].chunk, order[b].kind, order[b].mb), i, b) for i, b in spans if order[b].kind in ("F", "B"))


def simulate_unshards(spec: PipelineSpec, units, durations: Callable[[Flat], np.ndarray]) -> ArrayResult:
    """The step's pipeline simulation (:func:`~meshplan.pipeline.fast.simulate_arrays` of ``spec``
    and ``durations``, which reads ``units``' keys) with each window re-gather's pass waiting for
    its UNSHARD (``units``: a :class:`~meshplan.schedule.unit_times.UnitTimes`). First run: each
    re-gather's pass timed with its gathers hidden (lead infinite) and started no earlier than op
    ``i - 1`` ends plus its gathers' seconds (``after``); there its lead is its start without that
    wait (after the op before it and its input) less the end of op ``i - 1``, rounded to the
    picosecond (so the passes of a steady state share their timelines), and ``units.leads`` take
    it. Second run, returned: every pass as its timeline, with the leads (the same times within a
    picosecond per re-gather; the gathers and their wait in the pass's timeline, where the
    exposure, the trace and the link loads read them). One run without re-gathers."""
    if not units.regathers:
        return simulate_arrays(spec, durations)
    first = simulate_arrays(spec, durations, after=lambda f: _after(units, f))
    f, end, n = first.flat, first.end, len(first.end)
    for s, got in units.regathers.items():
        for key, i, b in got:
            x, d = s * f.length + b, int(f.dep[s * f.length + b])
            ready = end[x - 1]  # b > i - 1 >= 1: never a stage's first op
            if d < n:
                ready = max(ready, end[d] + (spec.p2p_s if f.cross[x] else 0.0))
            units.leads[s][key] = round(float(ready - end[s * f.length + i - 1]), 12)
    return simulate_arrays(spec, durations)


def _after(units, f: Flat) -> tuple[np.ndarray, np.ndarray]:
    """Per flat unit (``after`` of :func:`~meshplan.pipeline.fast.simulate_arrays`): op ``i - 1``
    of each re-gather's pass and the seconds its gathers take (its timeline with no lead less its
    timeline with them hidden); -1 and 0 for every other unit."""
    idx, sec = np.full(len(f.kind), -1, dtype=np.int64), np.zeros(len(f.kind))
    for s, got in units.regathers.items():
        for (chunk, kind, mb), i, b in got:
            k = units.key(s, chunk, kind, mb)
            idx[s * f.length + b] = s * f.length + i - 1
            sec[s * f.length + b] = units.by_key(k[:6] + (0.0,)).duration_s - units.by_key(k).duration_s
    return idx, sec


def unshard_chunk(s: StreamSim, chunk: ChunkCosts, phase: str, lead_s: float, root: bool) -> None:
    """Torch's UNSHARD of ``chunk`` for a pass of ``phase`` ("forward" / "backward") issued
    ``lead_s`` seconds before the pass starts (module docstring): every layer's all-gather (and
    its routed experts', efsdp), then the embedding's and head's units where ``root`` (the pass
    finds them sharded; ``phase``'s rows of the table, none where it has no such row), from
    ``-lead_s`` on their streams; then the compute stream waits for all of them and runs their
    copy-outs (FSDP2's ``wait_for_unshard``), so the pass's own layers gather nothing more."""
    c = s.c
    s.free["fsdp"] = s.free["efsdp"] = -lead_s
    waits = [s.comm("shard", phase, "all-gather", f"fsdp AG L{i} (UNSHARD, {lead_s * 1e3:.3f} ms ahead)", "layer")
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
