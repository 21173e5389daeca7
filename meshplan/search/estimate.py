"""The vectorised pass of ``meshplan search`` (:mod:`meshplan.search.driver`, steps 2 and 5):
per candidate a lower and an upper bound on the memory-timeline peak, a lower bound on the
step time and the efficiency of its local GEMMs, all as numpy arrays over the candidates
that passed the validity rules (:func:`estimate`); and the step-time bound of chosen
candidates raised to the exact pipeline schedule of their unit bounds (:func:`refine`),
still a lower bound. Kept apart from the driver so that the bounds' one entry point is
the same for the ranking (:mod:`meshplan.search.best_first`), the tests and the axis registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from meshplan.config import Config
from meshplan.pipeline.unshard_window import pipeline_window
from meshplan.search.block_bounds import least_block
from meshplan.search.bounds import bounds
from meshplan.search.comm_bounds import p2p_links_apart
from meshplan.search.columns import Candidates, candidate_schedule
from meshplan.search.host_memory import host_state
from meshplan.search.layer_bounds import unit_bounds
from meshplan.search.layer_chains import gemm_efficiency
from meshplan.search.memory import Tables, stage_layout, state
from meshplan.search.pipeline import blocking_mode, pipeline_bound, schedule_call_loads
from meshplan.search.reasons import OK
from meshplan.search.time_tables import TimeTables
from meshplan.search.timing import step_lower_bound


@dataclass
class Estimates:
    """Vectorised numbers per candidate (NaN where a rule already rejected it); ``host_numel``,
    ``host_per_element``: ZeRO-Offload's host partition of the most loaded stage's rank (elements)
    and its host bytes per element (:func:`meshplan.search.host_memory.host_state`; 0 where a rule
    already rejected the row or it offloads nothing)."""

    peak_lo: np.ndarray
    peak_hi: np.ndarray
    step_lo: np.ndarray
    gemm: np.ndarray
    host_numel: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    host_per_element: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


def refine(cfg: Config, c: Candidates, est: Estimates, idx: np.ndarray, tt: Optional[TimeTables] = None) -> None:
    """Raise the step-time bound of candidates ``idx`` to the exact pipeline schedule of
    their unit bounds (:mod:`meshplan.search.pipeline`), in place; ``tt``: the tables
    :func:`estimate` filled (default: new ones)."""
    if not len(idx):
        return
    tt = tt or TimeTables(cfg, Tables(cfg))
    tables = tt.tables
    sub = c.take(idx)
    micro = cfg.training.global_batch // (sub.mb * sub.dp)
    for p in np.unique(sub.pp):
        at = np.flatnonzero(sub.pp == p)
        g = sub.take(at)
        st = stage_layout(cfg, g, int(p))
        u = unit_bounds(cfg, tt, g, st, state(cfg, tables, g, st))
        for v, m, rf in sorted({(int(g.vpp[j]), int(micro[at[j]]), bool(g.rf[j])) for j in range(len(g))}):
            # split-backward schedules (V-shaped, ZB-H1) keep their closed-form bound: the unit bounds do not split the
            # backward into input and weight gradients, which those DAGs need
            sel = np.flatnonzero((g.vpp == v) & (micro[at] == m) & (g.ps == 0) & ((g.rf > 0) == rf))
            if not len(sel):
                continue
            part = {k: a[sel] for k, a in u.items()}
            i = idx[at[sel]]
            mode = blocking_mode(cfg, candidate_schedule(v)) if p > 1 else None  # waited calls (torch 1F1B)
            loads = schedule_call_loads(candidate_schedule(v), int(p), m, v, mode) if mode else None
            est.step_lo[i] = np.maximum(est.step_lo[i], pipeline_bound(part, v, m, rf,
                                                                       pipeline_window(cfg.training.framework, int(p)),
                                                                       loads, p2p_links_apart(tt, g.take(sel))))


def estimate(cfg: Config, c: Candidates, code: np.ndarray, tt: Optional[TimeTables] = None) -> Estimates:
    """The vectorised pass over every candidate that passed the validity rules; ``tt``: op
    and path tables to fill and reuse (:func:`refine` takes them too). Sets ``block`` rows' least n
    (:attr:`~meshplan.search.columns.Candidates.rm`, in place; :func:`~meshplan.search.block_bounds.least_block`),
    which their step bound counts replays of."""
    n = len(c)
    est = Estimates(np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan),
                    np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64))
    ok = np.flatnonzero(code == OK)
    if not len(ok):
        return est
    tt = tt or TimeTables(cfg, Tables(cfg))
    tables = tt.tables
    sub = c.take(ok)
    if c.rm is not None and sub.rm is not None:  # before the step bounds, which count the least n's replays
        c.rm[ok] = sub.rm[:] = least_block(cfg, tables, sub)
    est.gemm[ok] = gemm_efficiency(cfg, tt, sub)
    for p in np.unique(sub.pp):
        idx = np.flatnonzero(sub.pp == p)
        g = sub.take(idx)
        st = stage_layout(cfg, g, int(p))
        s = state(cfg, tables, g, st)
        lo, hi = bounds(cfg, tables, g, st, s)
        est.peak_lo[ok[idx]], est.peak_hi[ok[idx]] = lo.max(axis=1), hi.max(axis=1)
        est.step_lo[ok[idx]] = step_lower_bound(cfg, tt, g, st, s)
        est.host_numel[ok[idx]], est.host_per_element[ok[idx]] = host_state(
            cfg, g, cfg.training.global_batch // (g.mb * g.dp), s)  # ZeRO-Offload's host share (rule host)
    return est
