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
    which their step bound counts replays of. In one process: :func:`estimate_start`, then
    :func:`estimate_groups` without a pool (the search runs the second on its pool)."""
    est, groups = estimate_start(cfg, c, code, tt)
    estimate_groups(est, groups)
    return est


@dataclass
class Groups:
    """What :func:`estimate_groups` needs after :func:`estimate_start`: the config, its tables (their
    op times filled for every shape by the local GEMMs' efficiency), the candidates that passed the
    rules (``sub``, their indices ``ok``) and one job (pp, rows of ``sub``) per pipeline degree."""

    cfg: Config
    tt: TimeTables
    sub: Candidates
    ok: np.ndarray
    jobs: list[tuple[int, np.ndarray]]


#: The :class:`Groups` a forked worker of the search's pool inherits (set by :func:`estimate_start`
#: before the driver forks it, as :data:`meshplan.search.exact._WORKER`), read by :func:`group_job`.
_FORKED: Optional[Groups] = None


def estimate_start(cfg: Config, c: Candidates, code: np.ndarray,
                   tt: Optional[TimeTables] = None) -> tuple[Estimates, Groups]:
    """The first part of :func:`estimate`, in this process: NaN arrays, the ``block`` rows' least n and
    every candidate's local GEMM efficiency (which asks the op table of every shape key, so that
    workers forked after it inherit them), and the pp groups :func:`estimate_groups` evaluates, largest
    first (rows x sqrt(pp): the 405B example's pp 16 and pp 32 groups took half its bound's time)."""
    global _FORKED
    n = len(c)
    est = Estimates(np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan),
                    np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64))
    ok = np.flatnonzero(code == OK)
    tt = tt or TimeTables(cfg, Tables(cfg))
    sub = c.take(ok)
    jobs: list[tuple[int, np.ndarray]] = []
    if len(ok):
        if c.rm is not None and sub.rm is not None:  # before the step bounds, which count the least n's replays
            c.rm[ok] = sub.rm[:] = least_block(cfg, tt.tables, sub)
        est.gemm[ok] = gemm_efficiency(cfg, tt, sub)
        jobs = [(int(p), np.flatnonzero(sub.pp == p)) for p in np.unique(sub.pp)]
        jobs.sort(key=lambda j: -len(j[1]) * float(j[0]) ** 0.5)
    _FORKED = Groups(cfg, tt, sub, ok, jobs)
    return est, _FORKED


def estimate_groups(est: Estimates, groups: Groups, pool=None) -> None:
    """The rest of :func:`estimate`, in place: per pp group the peak's bounds, the step's lower bound and the
    ZeRO-Offload host share (:func:`group_job`), on ``pool`` (:class:`~meshplan.search.exact.Pool`, forked after
    :func:`estimate_start`: its workers read ``groups`` from their copy of :data:`_FORKED`) or here. Each group's
    numbers are the same whichever process computes them (pure functions of the candidates and the tables)."""
    global _FORKED
    jobs = [(p, idx) for p, idx in groups.jobs]
    got = pool.map_fn(group_job, jobs) if pool is not None else [_group(groups, p, idx) for p, idx in jobs]
    if _FORKED is groups:  # the workers keep their copies; this process holds the tables no longer
        _FORKED = None
    for (_, idx), (lo, hi, step, numel, per) in zip(jobs, got):
        at = groups.ok[idx]
        est.peak_lo[at], est.peak_hi[at], est.step_lo[at] = lo, hi, step
        est.host_numel[at], est.host_per_element[at] = numel, per


def group_job(job: tuple[int, np.ndarray]) -> tuple[np.ndarray, ...]:
    """:func:`_group` of ``job`` (pp, rows) on the :class:`Groups` this process inherited (:data:`_FORKED`)."""
    assert _FORKED is not None, "group_job: no estimate_start before the fork"
    return _group(_FORKED, *job)


def _group(groups: Groups, p: int, idx: np.ndarray) -> tuple[np.ndarray, ...]:
    """(peak lower bound, peak upper bound, step lower bound, host elements, host bytes per element) of the
    rows ``idx`` of ``groups.sub``, all of pp ``p`` (:func:`~meshplan.search.bounds.bounds`,
    :func:`~meshplan.search.timing.step_lower_bound`, :func:`~meshplan.search.host_memory.host_state`)."""
    cfg, tt = groups.cfg, groups.tt
    g = groups.sub.take(idx)
    st = stage_layout(cfg, g, p)
    s = state(cfg, tt.tables, g, st)
    lo, hi = bounds(cfg, tt.tables, g, st, s)
    step = step_lower_bound(cfg, tt, g, st, s)
    numel, per = host_state(cfg, g, cfg.training.global_batch // (g.mb * g.dp), s)  # ZeRO-Offload's host share
    return lo.max(axis=1), hi.max(axis=1), step, numel, per
