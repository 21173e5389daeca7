"""Exact evaluation of search candidates: the same code path as ``meshplan plan`` and
``meshplan step`` (:func:`meshplan.plan.build_plan`, then
:func:`meshplan.schedule.steptime.step_time` with the default :class:`~meshplan.schedule.unit_sim.Overlap`),
the goodput of :mod:`meshplan.reliability`, and a pool of forked worker processes.
Plans are built without what only reports read (constraint rows and their per-axis
annotation, placement flags: ``build_plan(reports=False)``); an :class:`Exact` keeps none of
it. The ranking asks for the step alone (:data:`STEP_ONLY`: ``build_plan`` without memory
timelines either, then ``step_time``: the same step to the bit, its parts and the goodput),
then the memory alone (:data:`PLAN_ONLY`) of the top and of candidates whose memory bound
does not decide; :func:`merge` joins the two into what :data:`SIMULATE` gives. The line on the
config's own mesh asks for less still (:data:`STEP_ALONE`: the same step, no parts, goodput or
kernel split, which its rank does not read).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from meshplan.memory import constraints as cons
from meshplan.plan import Infeasible, build_plan
from meshplan.schedule.unit_sim import Overlap
from meshplan.reliability import configured_reliability
from meshplan.schedule.kernel_kinds import kernel_kinds_s
from meshplan.search.step_parts import compute_split, layer_passes, stage_flops, step_breakdown
from meshplan.memory.headroom import tight
from meshplan.search.block_recompute import BLOCK_REFUSED, pick_block
from meshplan.search.candidate import candidate_config
from meshplan.search.columns import RECOMPUTE, Candidates
from meshplan.config import Config
from meshplan.schedule.steptime import step_time


@dataclass(frozen=True)
class Exact:
    """One candidate planned exactly: ``feasible`` and ``reasons`` from build_plan,
    ``peak_bytes`` of the most loaded stage, and (when simulated) ``step_s``, ``mfu``,
    ``tokens_per_s``, ``goodput``, the step's parts
    (:func:`~meshplan.search.step_parts.step_breakdown`, seconds) and ``layer_passes`` (its
    critical stage's layer passes, :func:`~meshplan.search.step_parts.layer_passes`), ``stage_flops``
    (FLOP its critical stage executes per step on one GPU, recompute included,
    :func:`~meshplan.search.step_parts.stage_flops`) and ``compute_split`` (its compute part's seconds
    by kernel kind, collectives' copies on the compute stream among them,
    :func:`~meshplan.search.step_parts.compute_split`), ``kernels_s`` (its other part's seconds by
    kernel kind, :func:`~meshplan.schedule.kernel_kinds.kernel_kinds_s`); ``block``: a ``block`` row's
    n, the smallest that fits (:meth:`Planner.block`), None elsewhere.
    ``complete`` False: a
    step-only evaluation (:data:`STEP_ONLY`): ``step_s``, ``mfu``, ``tokens_per_s`` and the
    parts as the complete one gives them, ``goodput`` as if the memory fits, no memory
    verdict (``feasible``: the mesh resolves) and no peak."""

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
    layer_passes: Optional[int] = None
    stage_flops: Optional[float] = None
    compute_split: Optional[dict] = None
    kernels_s: Optional[dict] = None
    block: Optional[int] = None


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
        does not decide) or :data:`STEP_ALONE` (as :data:`STEP_ONLY`, but only ``step_s``, ``mfu``
        and ``tokens_per_s``: the goodput, the parts and the kernel splits, ~7% of a step-only
        evaluation's time on the 405B example's rank plans, left None)."""
        i, mode = job
        if RECOMPUTE[self.cands.rc[i]] == "block":
            return self.block(i, mode)
        cc = candidate_config(self.cfg, self.cands, i)
        plan = build_plan(cc, self.no_rows, memory=mode not in (STEP_ONLY, STEP_ALONE), reports=False)
        if isinstance(plan, Infeasible):
            return Exact(i, False, plan.reasons, float("nan"))
        if mode == STEP_ALONE:
            st = step_time(plan, Overlap())
            return Exact(i, True, (), float("nan"), st.step_s, st.mfu, st.tokens_per_s, complete=False)
        if mode == STEP_ONLY:  # the goodput as if the memory fits (merge() drops it where it does not)
            st = step_time(plan, Overlap())
            return Exact(i, True, (), float("nan"), st.step_s, st.mfu, st.tokens_per_s, self._goodput(plan),
                         step_breakdown(st), complete=False, layer_passes=layer_passes(st), stage_flops=stage_flops(st),
                         compute_split=compute_split(plan, st, contention=True), kernels_s=kernel_kinds_s(st))
        peak = plan.timeline.peak.total_bytes
        if mode == PLAN_ONLY:
            return Exact(i, plan.feasible, plan.reasons, peak)
        st = step_time(plan, Overlap())
        return Exact(i, plan.feasible, plan.reasons, peak, st.step_s, st.mfu, st.tokens_per_s,
                     self._goodput(plan) if plan.feasible else None, step_breakdown(st), layer_passes=layer_passes(st),
                     stage_flops=stage_flops(st), compute_split=compute_split(plan, st, contention=True), kernels_s=kernel_kinds_s(st))

    def block(self, i: int, mode: str) -> Exact:
        """A ``block`` row in any ``mode``: its n picked first (:func:`~meshplan.search.block_recompute.pick_block`
        over memory plans, n 0 planned as ``none``; clear of the headroom under ``[search] headroom_tier``),
        then that plan's verdict and peak, and outside :data:`PLAN_ONLY` its step, parts and goodput
        (always complete: the memory is planned anyway). Where no n is picked: the verdict of the largest
        n short of the chunk where it does not fit (memory's reasons, or another rule's), else the
        ``block`` rule's reason (none fits, or only a tight n where none fits too)."""
        plans: dict = {}

        def plan_at(n: int):
            if n not in plans:
                plans[n] = build_plan(candidate_config(self.cfg, self.cands, i, block=n), self.no_rows, reports=False)
            return plans[n]

        cfg, most = self.cfg, int(self.cands.rk[i]) if self.cands.rk is not None else 0
        usable = self.no_rows.usable_bytes
        def clear(p) -> bool:  # a feasible plan (pick_block asks only of those)
            return not (cfg.search.headroom_tier and tight(p.timeline.peak.total_bytes, usable,
                                                            cfg.memory.fragmentation_fraction))

        n = pick_block(plan_at, most, clear, int(self.cands.rm[i]) if self.cands.rm is not None else 0)
        last = plans.get(most - 1)
        if n is None and isinstance(last, Infeasible):
            return Exact(i, False, tuple(last.reasons), float("nan"))
        if n is None and last is not None and not last.feasible:  # no n fits: memory's verdict (or another rule's)
            return Exact(i, False, tuple(last.reasons), last.timeline.peak.total_bytes, block=most - 1)
        if n is None:
            return Exact(i, False, (BLOCK_REFUSED,), float("nan"))
        plan = plans[n]
        peak = plan.timeline.peak.total_bytes
        if mode == PLAN_ONLY:
            return Exact(i, True, plan.reasons, peak, block=n)
        st = step_time(plan, Overlap())
        return Exact(i, True, plan.reasons, peak, st.step_s, st.mfu, st.tokens_per_s, self._goodput(plan),
                     step_breakdown(st), layer_passes=layer_passes(st), stage_flops=stage_flops(st),
                     compute_split=compute_split(plan, st, contention=True), kernels_s=kernel_kinds_s(st), block=n)

    def _goodput(self, plan) -> float:
        """Daly goodput of ``plan`` (:mod:`meshplan.reliability`: checkpoint size from the
        persistent state, failure rate from the world; neither reads the memory timelines or
        the step time), storage and restart from ``[search]`` (:func:`configured_reliability`)."""
        return configured_reliability(plan).goodput


def merge(prev: Optional[Exact], new: Exact) -> Exact:
    """One candidate's two evaluations as one: a step-only one (:data:`STEP_ONLY`: step,
    parts, goodput if it fits) and a memory one (:data:`PLAN_ONLY`: the verdict, peak,
    reasons) give what :data:`SIMULATE` gives (the same build_plan and step_time: equal
    fields); otherwise ``new``."""
    if prev is None:
        return new
    if prev.complete and not new.complete:
        memory, step = prev, new
    elif new.complete and new.step_s is None and prev.step_s is not None and new.feasible:
        memory, step = new, prev
    else:
        return new
    return replace(memory, step_s=step.step_s, mfu=step.mfu, tokens_per_s=step.tokens_per_s,
                   goodput=step.goodput if memory.feasible else None, breakdown=step.breakdown,
                   layer_passes=step.layer_passes, stage_flops=step.stage_flops,
                   compute_split=step.compute_split, kernels_s=step.kernels_s)


#: Modes of a planner job (:meth:`Planner.__call__`).
PLAN_ONLY, SIMULATE, STEP_ONLY, STEP_ALONE = "plan", "simulate", "step-only", "step-alone"

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

    def stream(self, jobs: list):
        """The results of ``jobs`` in job order as they complete (one queue on the workers, no barrier
        between chunks of them: :meth:`map`'s results, where each job runs as ``map`` of 2 or more would
        run it); in this process where there is no pool."""
        if self.pool is None:
            return (self.planner(j) for j in jobs)
        return self.pool.imap(_work, jobs, chunksize=1)

    def close(self):
        if self.pool is not None:
            self.pool.close()
            self.pool.join()
