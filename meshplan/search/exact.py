"""Exact evaluation of search candidates: the same code path as ``meshplan plan`` and
``meshplan step`` (:func:`meshplan.plan.build_plan`, then
:func:`meshplan.schedule.steptime.step_time` with the default :class:`~meshplan.schedule.rank_timeline.Overlap`),
the goodput of :mod:`meshplan.reliability`, and a pool of forked worker processes.
Plans are built without what only reports read (constraint rows and their per-axis
annotation, placement flags: ``build_plan(reports=False)``); an :class:`Exact` keeps none of
it. The ranking asks for the step alone (:data:`STEP_ONLY`: ``build_plan`` without memory
timelines either, then ``step_time``: the same step to the bit) and plans the top, and the
memory of candidates whose memory bound does not decide, completely.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from meshplan.memory import constraints as cons
from meshplan.plan import Infeasible, build_plan
from meshplan.schedule.rank_timeline import Overlap
from meshplan.reliability import reliability
from meshplan.search.explain import step_breakdown
from meshplan.search.space import Candidates, candidate_config
from meshplan.config import Config
from meshplan.schedule.steptime import step_time


@dataclass(frozen=True)
class Exact:
    """One candidate planned exactly: ``feasible`` and ``reasons`` from build_plan,
    ``peak_bytes`` of the most loaded stage, and (when simulated) ``step_s``, ``mfu``,
    ``tokens_per_s``, ``goodput`` and the step's parts
    (:func:`~meshplan.search.explain.step_breakdown`, seconds). ``complete`` False: a
    step-only evaluation (:data:`STEP_ONLY`): ``step_s``, ``mfu`` and ``tokens_per_s`` as
    the complete one gives them, no memory verdict (``feasible``: the mesh resolves), no
    peak, goodput or parts."""

    index: int
    feasible: bool
    reasons: tuple[str, ...]
    peak_bytes: float
    step_s: Optional[float] = None
    mfu: Optional[float] = None
    tokens_per_s: Optional[float] = None
    goodput: Optional[float] = None
    breakdown: Optional[dict] = None
    complete: bool = True


class Planner:
    """Exact evaluation of candidates (:meth:`__call__`)."""

    def __init__(self, cfg: Config, cands: Candidates):
        self.cfg, self.cands = cfg, cands
        # no constraint rows: an Exact keeps none of the plan's report-only fields
        self.no_rows = cons.Constraints((), cons.usable_bytes(cfg.cluster, cfg.training))

    def __call__(self, job: tuple[int, str]) -> Exact:
        """``job``: (candidate index, mode): :data:`PLAN_ONLY` (build_plan: the memory
        verdict), :data:`SIMULATE` (and step_time, goodput and the step's parts) or
        :data:`STEP_ONLY` (build_plan without memory timelines, then step_time: ``feasible``
        True says only that the mesh resolves; the search plans the memory where its bound
        does not decide)."""
        i, mode = job
        cc = candidate_config(self.cfg, self.cands, i)
        plan = build_plan(cc, self.no_rows, memory=mode != STEP_ONLY, reports=False)
        if isinstance(plan, Infeasible):
            return Exact(i, False, plan.reasons, float("nan"))
        if mode == STEP_ONLY:
            st = step_time(plan, Overlap())
            return Exact(i, True, (), float("nan"), st.step_s, st.mfu, st.tokens_per_s, complete=False)
        peak = plan.timeline.peak.total_bytes
        if mode == PLAN_ONLY:
            return Exact(i, plan.feasible, plan.reasons, peak)
        st = step_time(plan, Overlap())
        o = self.cfg.search
        good = reliability(plan, write_bandwidth_bytes_per_s=o.checkpoint_write_gb_per_s * 1e9,
                           read_bandwidth_bytes_per_s=o.checkpoint_read_gb_per_s * 1e9,
                           restart_overhead_s=o.restart_overhead_s).goodput if plan.feasible else None
        return Exact(i, plan.feasible, plan.reasons, peak, st.step_s, st.mfu, st.tokens_per_s, good,
                     step_breakdown(st))


#: Modes of a planner job (:meth:`Planner.__call__`).
PLAN_ONLY, SIMULATE, STEP_ONLY = "plan", "simulate", "step-only"

_WORKER: Optional[Planner] = None


def _work(job):
    return _WORKER(job)


class Pool:
    """Runs planner jobs in order, on ``workers`` forked processes when > 1."""

    def __init__(self, planner: Planner, workers: int):
        global _WORKER
        self.planner, self.pool = planner, None
        if workers > 1:
            import multiprocessing as mp

            _WORKER = planner
            try:
                self.pool = mp.get_context("fork").Pool(workers)
            except (OSError, ValueError):
                self.pool = None
        self.workers = workers if self.pool else 1

    def map(self, jobs: list) -> list[Exact]:
        if self.pool is None or len(jobs) < 2:
            return [self.planner(j) for j in jobs]
        return self.pool.map(_work, jobs, chunksize=1)

    def close(self):
        if self.pool is not None:
            self.pool.close()
            self.pool.join()
