"""Exact evaluation of search candidates: the same code path as ``meshplan plan`` and
``meshplan step`` (:func:`meshplan.plan.build_plan`, then
:func:`meshplan.schedule.steptime.step_time` with the default :class:`~meshplan.schedule.rank_timeline.Overlap`),
the goodput of :mod:`meshplan.reliability`, and a pool of forked worker processes.
The plan's constraint rows do not depend on the mesh: they are computed once per training
contract and passed to ``build_plan``.
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
    (:func:`~meshplan.search.explain.step_breakdown`, seconds)."""

    index: int
    feasible: bool
    reasons: tuple[str, ...]
    peak_bytes: float
    step_s: Optional[float] = None
    mfu: Optional[float] = None
    tokens_per_s: Optional[float] = None
    goodput: Optional[float] = None
    breakdown: Optional[dict] = None


class Planner:
    """Exact evaluation of candidates, with the constraints cached per training contract
    (they do not depend on the mesh)."""

    def __init__(self, cfg: Config, cands: Candidates):
        self.cfg, self.cands = cfg, cands
        self.constraints: dict = {}

    def __call__(self, job: tuple[int, bool]) -> Exact:
        i, simulate = job
        cc = candidate_config(self.cfg, self.cands, i)
        t = cc.training
        if t not in self.constraints:
            self.constraints[t] = cons.constraints(cc.model, t, cc.cluster, cc.cluster.world)
        plan = build_plan(cc, self.constraints[t])
        if isinstance(plan, Infeasible):
            return Exact(i, False, plan.reasons, float("nan"))
        peak = plan.timeline.peak.total_bytes
        if not simulate:
            return Exact(i, plan.feasible, plan.reasons, peak)
        st = step_time(plan, Overlap())
        o = self.cfg.search
        good = reliability(plan, write_bandwidth_bytes_per_s=o.checkpoint_write_gb_per_s * 1e9,
                           read_bandwidth_bytes_per_s=o.checkpoint_read_gb_per_s * 1e9,
                           restart_overhead_s=o.restart_overhead_s).goodput if plan.feasible else None
        return Exact(i, plan.feasible, plan.reasons, peak, st.step_s, st.mfu, st.tokens_per_s, good,
                     step_breakdown(st))


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
