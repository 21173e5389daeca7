"""The memory timeline's passes and peak, pass by pass in Python: the exact model that
:mod:`meshplan.memory.passtable` and :mod:`meshplan.memory.peakscan` compute on arrays.

:func:`passes` walks the stage's op list (:func:`meshplan.memory.schedule.stage_ops`),
keeping the set of FSDP units left unsharded, and builds each distinct pass once;
:func:`scan` runs the running totals pass by pass. ``memory_timeline(plan, stage,
reference=True)`` uses both; tests/test_memory_fast.py checks the array path against them.
One loop step per micro-batch and stage: slow on pp 64-128 x thousands of micro-batches.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from meshplan.memory.pass_sizes import StageSizes
from meshplan.memory.passes import KINDS, PassBuilder
from meshplan.memory.passtable import Pass, PassTable
from meshplan.memory.peakscan import at_offset, template_stats


def _backward_flags(ops) -> tuple[set, set]:
    """Indices of the first and the last backward of each chunk in ``ops``."""
    first, last, seen = set(), {}, set()
    for i, (phase, chunk, _) in enumerate(ops):
        if phase == "backward":
            if chunk not in seen:
                first.add(i)
                seen.add(chunk)
            last[chunk] = i
    return first, set(last.values())


def passes(sizes: StageSizes, ops, evict: Sequence[bool] = (), waits: Sequence[bool] = (),
           unshard: Optional[dict[int, tuple]] = None, lag: Sequence[int] = ()) -> tuple[PassTable, list[tuple]]:
    """Run-length passes: each distinct (phase, chunk, gathered units, first, last, released after,
    waits, (UNSHARDs before it, lag)) built once; ``evict``: per op, whether the schedule's window reshards
    its chunk after it; ``waits`` (per op) and ``unshard`` (op -> chunks): torch's UNSHARD actions;
    ``lag`` (per op): a V-shaped schedule's lagging output-gradient bytes
    (:class:`~meshplan.memory.passes.PassBuilder`)."""
    templates: list[tuple] = [sizes.init]
    out = [Pass("init", 0, None, 0, 0)]
    cache: dict = {}
    gathered: frozenset = frozenset()
    first_b, last_b = _backward_flags(ops)
    t = len(sizes.init)
    for i, (phase, chunk, mb) in enumerate(ops):
        keys = set(sizes.chunk_units(chunk))
        g_in = frozenset(gathered & keys)
        ev = bool(evict[i]) if len(evict) else False
        wt = bool(waits[i]) if len(waits) else False
        pre = (unshard or {}).get(i, ())
        held = int(lag[i]) if len(lag) else 0
        key = (phase, chunk, g_in, i in first_b, i in last_b, ev, wt, (pre, held))
        if key not in cache:
            b = PassBuilder(sizes, phase, chunk, g_in, first=i in first_b, last=i in last_b, evict=ev, waits=wt,
                            unshard=pre, lag=held)
            templates.append(b.build())
            cache[key] = (len(templates) - 1, frozenset(b.gathered))
        tid, g_out = cache[key]
        gathered = (gathered - keys) | g_out
        out.append(Pass(phase, chunk, mb, tid, t))
        t += len(templates[tid])
    templates.append(sizes.step)
    out.append(Pass("step", 0, None, len(templates) - 1, t))
    return PassTable.of(out), templates


def scan(table: PassTable, templates: Sequence[tuple]) -> tuple[int, int, np.ndarray, dict]:
    """(peak pass index, offset in it, bytes per kind at the peak, max per kind)."""
    stats = [template_stats(t) for t in templates]
    cur = np.zeros(len(KINDS), dtype=np.int64)
    top, where, at_peak = None, (0, 0), cur.copy()
    kmax = np.zeros(len(KINDS), dtype=np.int64)
    for n, p in enumerate(table):
        vec, best, off, tk = stats[p.template]
        kmax = np.maximum(kmax, cur + tk)
        if templates[p.template] and (top is None or cur.sum() + best > top):
            top, where, at_peak = cur.sum() + best, (n, off), cur.copy()
        cur = cur + vec
    n, off = where
    return n, off, at_offset(at_peak, templates[table[n].template], off), {k: int(kmax[i]) for i, k in enumerate(KINDS)}
