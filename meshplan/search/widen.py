"""What a narrowed ``[search] cp`` hides when no candidate fits (newcomer trial 16: ``plan``'s
``fix:`` line tries context parallelism, :func:`meshplan.plan_fix_cp.cp_variant`, while the search's
no-feasible-mesh fix never named it).

Context parallelism splits the sequence over cp ranks, so each rank holds 1 / cp of a layer's
activations while FSDP still shards the state over dp_shard x cp (:mod:`meshplan.spec.axes.cp`):
at a long sequence it is what fits without replaying the forward. Where the config narrows
``[search] cp`` (``cp = [1]``) and nothing fits while memory rejected some, :func:`widen` runs the
same search with ``cp`` left to every degree the rules allow, for the fastest row only (``top = 1``,
nothing settled near the memory limit: the counts of that search are not printed), and keeps that
row as the result's ``widened`` (:class:`~meshplan.search.driver.Widened`), which the
no-feasible-mesh fix names first (:mod:`meshplan.report.search_fix`). The narrowed candidates are a
subset of the widened ones with the same verdicts, so the row found has a cp the narrowed list left
out. ``meshplan search`` runs it after the search, only on the no-feasible-mesh path: a search that
finds a row never pays for it.

Llama-3-70B at seq 32768, global batch 512 on 8 dgx-h100 with ``[search] recompute = ["none"]`` and
``cp = [1]``: no candidate fits (without recompute every layer keeps its activations of 32768
tokens, split over tp 8 at most); widened, pp 2 x cp 4 x tp 8 fits (tests/test_search_widen.py).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Optional

from meshplan.config import Config
from meshplan.memory.constraints import state_floor_fix
from meshplan.search.driver import SearchResult, Widened, search


def worth_widening(r: SearchResult) -> bool:
    """Whether :func:`widened_cp` may help ``r``: no row, ``[search] cp`` narrowed and some
    candidate rejected for memory, but not where the model state alone exceeds usable memory fully
    sharded over every GPU (:func:`~meshplan.memory.constraints.state_floor_fix`: no cp helps)."""
    cfg = r.config
    return (not r.top and cfg.search.cp is not None and r.counts()["memory"] > 0
            and state_floor_fix(cfg.model, cfg.training, cfg.cluster) is None)


def widened_cp(cfg: Config, workers: Optional[int] = None) -> Optional[Widened]:
    """The fastest row of ``cfg``'s search with ``[search] cp`` left out (every cp the rules
    allow), ``top`` 1 and ``settle_max`` 0, ``[mesh]`` dropped (its line is not printed); None
    where that search finds none either."""
    o = cfg.search
    wide = replace(cfg, mesh=None, search=o.model_copy(update={"cp": None, "top": 1, "settle_max": 0}))
    r = search(wide, workers=workers)
    e = r.top[0] if r.top else None
    if e is None or e.step_s is None:
        return None
    return Widened(tuple(o.cp or ()), int(r.candidates.cp[e.index]), r.candidates.label(e.index), e.step_s,
                   e.peak_bytes)


def widen(r: SearchResult, workers: Optional[int] = None) -> SearchResult:
    """``r`` with ``widened`` set where :func:`worth_widening` (its wall time as ``timings["widen
    cp"]``, seconds, apart from the search's ``wall_s``); ``r`` itself, unchanged, otherwise."""
    if not worth_widening(r):
        return r
    t0 = time.perf_counter()
    r.widened = widened_cp(r.config, workers)
    r.timings["widen cp"] = time.perf_counter() - t0
    return r
