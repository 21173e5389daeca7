"""The exact ranking of ``meshplan search`` (:mod:`meshplan.search.driver`, steps 4 to 7):
candidates planned through the worker pool with their verdicts recorded (:class:`Runner`),
whether the GEMM threshold applies (:func:`threshold_applies`), the candidates whose bound is
worth tightening (:func:`worth_tightening`), the best-first ranking itself (:func:`best_first`:
candidates planned in increasing order of their step-time lower bound, each bound tightened
when it reaches the front of the queue, :mod:`meshplan.search.frontier`, until no unplanned
bound can reach the top) and the rejected candidate kept as evidence
(:func:`best_rejected`). The order of the top is :mod:`meshplan.search.rank`'s tie rule.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import numpy as np

from meshplan.config import Config
from meshplan.search.block_recompute import BLOCK_REFUSED
from meshplan.search.columns import RECOMPUTE, Candidates
from meshplan.search.estimate import Estimates, refine
from meshplan.search.exact import PLAN_ONLY, SIMULATE, STEP_ONLY, Exact, Pool, merge
from meshplan.search.frontier import Frontier
from meshplan.search.rank import best_of_meshes, mesh_of, variants
from meshplan.search.tier_rank import Tiers
from meshplan.search.tie_key import simplicity
from meshplan.search.reasons import CODE, OK
from meshplan.search.time_tables import TimeTables

#: Relative slack on the step-time bound in the stopping rule (floating-point rounding).
BOUND_SLACK = 1e-9
#: Candidates the ranking's queue tightens at once (:mod:`meshplan.search.frontier`): about
#: 0.3 s of :func:`~meshplan.search.estimate.refine` per block on Llama-3-405B / 16,384 H100 (~1 ms each plus a fixed
#: cost per pp degree), against 0.1-0.3 s per exact plan.
TIGHTEN_BLOCK = 256
#: Candidates the exact ranking plans per round (step 6) before it checks its stopping rule:
#: fixed, not the number of workers, so that which candidates are planned (and so the
#: ``exact_max`` cut, the planned count and the memory verdicts settled on the way) is the
#: same on every machine. 4: two jobs per worker on 2 cores; a larger pool gets fewer
#: than one job per worker a round (a run a few tenths of a second longer on 16 cores).
RANK_BATCH = 4

@dataclass
class Ranking:
    """What :func:`best_first` returns: ``top``, the rows (the first candidate of each of the
    first ``top`` distinct meshes of the ranking: :mod:`meshplan.search.rank`'s rule, under the
    headroom tiers applied to each tier apart, :func:`~meshplan.search.headroom.tier_order`);
    ``proven``; ``fastest``, the fastest feasible candidate planned (the rule or the tiers may
    list it below the top, or leave it out); ``placed``, every candidate the ranking placed up to
    the last row, rows and their meshes' other settings, in order; ``variants``, the top mesh's
    other settings within 1% of the fastest; ``tiered_past``, the first candidates of the meshes
    with no clear candidate that the rule's order over every candidate put before row 1's mesh,
    shown after it or left out (empty without tiers or where they moved none); ``safer``, (row
    shown, its mesh's tight first setting by that order) where the tiers showed a mesh at its first
    clear setting instead (:meth:`~meshplan.search.tier_rank.Tiers.moved`)."""

    top: list[Exact]
    proven: bool
    fastest: Optional[Exact]
    placed: list[Exact] = field(default_factory=list)
    variants: list[Exact] = field(default_factory=list)
    tiered_past: list[Exact] = field(default_factory=list)
    safer: list[tuple[Exact, Exact]] = field(default_factory=list)


#: ``progress(label, done, total)``, called as exact plans complete.
Progress = Callable[[str, int, int], None]
#: How a candidate's memory verdict was reached (``SearchResult.decided``; 0: not yet): a validity rule, the
#: vectorised bounds, an exact plan.
RULE, BOUND, PLAN = 1, 2, 3
MEMORY, GEMM, BLOCK, HOST = CODE["memory"], CODE["gemm"], CODE["block"], CODE["host"]


class Runner:
    """Plans candidates exactly through the pool and records the verdicts."""

    def __init__(self, pool: Pool, code: np.ndarray, decided: np.ndarray, progress: Optional[Progress],
                 est: Estimates, margin: float):
        self.pool, self.code, self.decided, self.progress = pool, code, decided, progress
        self.est, self.margin = est, margin
        self.exact: dict[int, Exact] = {}
        self.notes: list[str] = []

    def plan(self, idx, mode, label: str) -> list[Exact]:
        """Evaluate the candidates ``idx`` in order in ``mode`` (:meth:`~meshplan.search.exact.Planner.__call__`; a
        str, or one per candidate); those already evaluated as far as their mode asks are
        skipped."""
        modes = [mode] * len(idx) if isinstance(mode, str) else list(mode)
        todo = [(int(i), md) for i, md in zip(idx, modes)
                if int(i) not in self.exact or _short_of(self.exact[int(i)], md)]
        step = max(1, self.pool.workers) * 4  # progress every 4 jobs per worker
        # one queue on the workers, results in job order (no barrier every ``step`` jobs: the 405B
        # example's settle phase, 32 plans, waited for the slowest of each 8); a last lone job runs
        # here, as the batches of ``step`` ran it (Pool.map of one job), seeing the block rows' n
        # recorded before it
        alone = todo[-1:] if len(todo) % step == 1 else []
        out = []
        for r in self.pool.stream(todo[:len(todo) - len(alone)]):
            out.append(self._record(r))
            if self.progress and (len(out) % step == 0 or len(out) == len(todo)):
                self.progress(label, len(out), len(todo))
        for r in self.pool.map(alone):
            out.append(self._record(r))
            if self.progress:
                self.progress(label, len(out), len(todo))
        return out

    def _record(self, r: Exact) -> Exact:
        """Record one plan's verdicts (merged with an earlier pass's) in ``exact``, ``code`` and ``decided``."""
        r = merge(self.exact.get(r.index), r)  # the memory verdict and the step of two passes
        self.exact[r.index] = r
        self._check(r)
        if r.block is not None and self.pool.planner.cands.rn is not None:  # a block row's n, for its
            self.pool.planner.cands.rn[r.index] = r.block  # label and plan input (the search's columns)
        if self.code[r.index] != OK or not r.complete:  # step-only: the memory bound decided
            return r
        if not r.feasible:
            self.code[r.index] = BLOCK if r.reasons[:1] == (BLOCK_REFUSED,) else \
                MEMORY if _memory_reason(r.reasons) else HOST if _host_reason(r.reasons) else CODE["layers"]
        self.decided[r.index] = PLAN
        return r

    def _check(self, r: Exact) -> None:
        """Record any exact plan outside the vectorised bounds (with the margin)."""
        i, e, m = r.index, self.est, self.margin
        if np.isfinite(r.peak_bytes) and not e.peak_lo[i] / (1 + m) <= r.peak_bytes <= e.peak_hi[i] * (1 + m):
            self.notes.append(f"candidate {i}: planned peak {r.peak_bytes:.4g} B outside the memory bounds "
                              f"[{e.peak_lo[i]:.4g}, {e.peak_hi[i]:.4g}] B by more than the margin {m:.0%}")
        if r.step_s is not None and r.step_s < e.step_lo[i] * (1 - BOUND_SLACK):
            self.notes.append(f"candidate {i}: simulated step {r.step_s:.6g} s below its lower bound "
                              f"{e.step_lo[i]:.6g} s: the ranking may not be exact")


def _short_of(e: Exact, mode: str) -> bool:
    """Whether evaluation ``e`` lacks what ``mode`` gives (:meth:`~meshplan.search.exact.Planner.__call__`)."""
    if mode == STEP_ONLY:
        return e.feasible and e.step_s is None
    if not e.complete:
        return True
    return mode == SIMULATE and e.breakdown is None  # simulated completely: the step's parts are there


def _memory_reason(reasons) -> bool:
    return any("usable" in r for r in reasons)


def _host_reason(reasons) -> bool:
    """ZeRO-Offload's host memory over the node's (:func:`meshplan.memory.offload_host.host_reason`'s
    words; the search's rule ``host`` rejects such rows before any plan, this is the backstop)."""
    return any(r.startswith("host memory: ") for r in reasons)


def threshold_applies(above_ok: np.ndarray, decided: np.ndarray, est: Estimates, run: Runner) -> bool:
    """Whether some candidate at or above the GEMM threshold fits: one the upper bound
    proves, else the first the exact plan confirms (in step-time-bound order)."""
    if (above_ok & (decided == BOUND)).any():
        return True
    idx = np.flatnonzero(above_ok)
    for i in idx[np.argsort(est.step_lo[idx], kind="stable")]:
        if run.plan([i], SIMULATE, label="threshold")[0].feasible if int(i) not in run.exact else \
                run.exact[int(i)].feasible:
            return True
    return False


def worth_tightening(est: Estimates, eligible: np.ndarray, top: int, most: int) -> np.ndarray:
    """Candidates whose step-time bound is within 10% of the ``top``-th smallest: the
    ones the ranking may plan, whose bound is worth tightening (at most ``most``)."""
    if not len(eligible):
        return eligible
    lo = est.step_lo[eligible]
    cut = np.sort(lo)[min(top, len(lo)) - 1] * 1.1
    near = eligible[lo <= cut]
    return near[np.argsort(est.step_lo[near], kind="stable")][:most]


def best_first(cfg: Config, c: Candidates, est: Estimates, eligible: np.ndarray, run: Runner, tt: TimeTables,
          tight: np.ndarray) -> Ranking:
    """Best-first exact ranking (:mod:`meshplan.search.driver`, step 6) under the tie rule of
    :mod:`meshplan.search.rank`: the :class:`Ranking`. The queue (:mod:`meshplan.search.frontier`)
    tightens each bound before its candidate is planned, on its own copy: ``est`` keeps the
    bounds the vectorised pass and :func:`refine` gave (``tight``: the candidates refined)."""
    o = cfg.search
    lo = est.step_lo.copy()
    own = replace(est, step_lo=lo)
    queue = Frontier(eligible, lo, lambda idx: refine(cfg, c, own, idx, tt), tight.copy(), block=TIGHTEN_BLOCK,
                     most=o.refine_max)
    steps: dict[int, float] = {}    # feasible: exact step times (with the tiers, tier known)
    pending: dict[int, float] = {}  # feasible or near the memory limit, memory not planned yet: exact step times
    batch = RANK_BATCH
    planned, proven = 0, True
    tiers = Tiers.of(cfg, c, run)
    while True:
        while len(queue):
            meshes = best_of_meshes(c, steps)  # the shortest known step of each mesh: the rows are distinct meshes
            # the step up to which every candidate must be ranked (inf while the top is not fixed)
            cut = tiers.cut(steps, tiers.open(queue.rest, pending))
            if np.isfinite(cut) and planned >= o.exact_min and cut < queue.next_bound(batch) * (1 - BOUND_SLACK):
                break
            if planned >= o.exact_max:
                proven = False
                run.notes.append(f"exact_max {o.exact_max} reached: {len(queue)} candidates with a lower "
                                 f"step-time bound than the top's were not planned; the top is not proven")
                break
            # while fewer than ``top`` steps are known the stopping rule cannot hold: the next
            # top - known candidates are planned in any case, as one batch (fewer pool round trips)
            chunk = queue.pop(min(max(batch, o.top - len(meshes)), max(batch, o.exact_max - planned)))
            # the step alone (build_plan without memory timelines, then step_time); near the
            # memory limit the memory verdict follows only where the step could enter the top
            run.plan(chunk, STEP_ONLY, label="ranking")
            for r in (run.exact[int(i)] for i in chunk):  # planned now or before (threshold)
                planned += 1
                if r.step_s is None or not r.feasible:
                    continue
                if r.complete or (run.decided[r.index] == BOUND and tiers.known(r.index)):
                    steps[r.index] = r.step_s
                else:
                    pending[r.index] = r.step_s
            _settle_pending(steps, pending, tiers.cut(steps, tiers.open(queue.rest, pending)), run)
            if run.progress:
                run.progress("ranking", planned, planned + (len(queue) > 0))
        if _complete_top(tiers, steps, run) and proven:
            continue
        return _ranking(tiers, steps, run, proven)


def _ranking(tiers: Tiers, steps: dict[int, float], run: Runner, proven: bool) -> Ranking:
    """The :class:`Ranking` of the exact steps ``steps`` (the top complete, :func:`_complete_top`),
    the memory of the meshes the tiers moved planned for the lines that name their free share."""
    c, top = tiers.c, tiers.top
    order = tiers.order(steps)
    rows = tiers.rows(order)
    past, safer = tiers.moved(steps, rows)
    fastest = min(steps, key=lambda i: (steps[i], i)) if steps else None
    # the explanation weighs the fastest against row 1 by the rule, peaks included: its memory planned too
    # (a candidate the memory bound admitted has none: NaN, newcomer 32's search failed on it)
    shown = past[:1] + [i for i in past if i in rows] + [t for _, t in safer] + ([] if fastest is None else [fastest])
    named = list(dict.fromkeys(i for i in shown if not run.exact[i].complete))
    run.plan(named, PLAN_ONLY, label="top")
    return Ranking([run.exact[i] for i in rows], proven, None if fastest is None else run.exact[fastest],
                   [run.exact[i] for i in _prefix(c, order, top)],
                   [run.exact[i] for i in variants(c, tiers.rule(steps), steps, rows[0])] if rows else [],
                   [run.exact[i] for i in past], [(run.exact[a], run.exact[b]) for a, b in safer])


def _settle_pending(steps: dict[int, float], pending: dict[int, float], cut: float, run: Runner) -> None:
    """Plan the memory of the pending candidates (near the memory limit, or with the tiers of no
    tier known yet; step known) whose step is within ``cut`` (:meth:`Tiers.cut
    <meshplan.search.tier_rank.Tiers.cut>`): those that fit join ``steps``. The others cannot enter
    the top (the cut only falls as steps join), so their memory verdict is left to the settle phase."""
    due = sorted((i for i, t in pending.items() if t <= cut), key=lambda i: (pending[i], i))
    run.plan(due, PLAN_ONLY, label="ranking")
    for i in due:
        step = pending.pop(i)
        if run.exact[i].feasible:
            steps[i] = step


def _complete_top(tiers: Tiers, steps: dict[int, float], run: Runner) -> bool:
    """Plan the top's rows completely (peak, goodput, the step's parts), the memory of the top
    mesh's variants (:func:`~meshplan.search.rank.variants`) and of every candidate within
    :func:`~meshplan.search.rank.needed` whose tie key (mesh and settings) another candidate there
    shares and a placed one holds (its next key is the planned peak: a twin kept gathered must not
    be listed before the same mesh resharded only because its step is 0.085% shorter), until the
    top holds still; one whose plan does not fit after all (its memory bound was wrong: noted)
    leaves ``steps``. True when the top changed and the ranking must go on. The order, rows and
    cut are ``tiers``' (:class:`~meshplan.search.tier_rank.Tiers`)."""
    c, top = tiers.c, tiers.top
    changed = False
    while True:
        order = tiers.order(steps)
        rows = tiers.rows(order)
        cut = tiers.cut(steps, False)
        near = [i for i in sorted(steps) if steps[i] <= cut]
        key = {i: simplicity(c, i) for i in near}
        shared = {k for k, n in Counter(key.values()).items() if n > 1} & \
            {simplicity(c, i) for i in _prefix(c, order, top)}
        twins = [i for i in near if key[i] in shared and i not in rows]
        shown = variants(c, tiers.rule(steps), steps, rows[0]) if rows else []
        light = [i for i in rows if _short_of(run.exact[i], SIMULATE)] + \
            [i for i in dict.fromkeys(twins + shown) if not run.exact[i].complete and i not in rows]
        if not light:
            return changed
        # the ranking's step-only evaluations hold the step, its parts and the goodput: the
        # memory alone completes them (merge), no second step_time
        modes = [PLAN_ONLY if run.exact[i].breakdown is not None else SIMULATE for i in light]
        for r in run.plan(light, modes, label="top"):
            if not r.feasible or r.step_s is None:
                run.notes.append(f"candidate {r.index}: planned peak {r.peak_bytes:.4g} B does not fit although its "
                                 "memory upper bound did; left out of the top")
                del steps[r.index]
                changed = True


def _prefix(c: Candidates, order: list[int], top: int) -> list[int]:
    """The candidates of ``order`` up to the first of the ``top``-th distinct mesh: every one
    the rule placed before the last row (all planned exactly, :func:`~meshplan.search.rank.needed`)."""
    seen: set = set()
    for k, i in enumerate(order):
        seen.add(mesh_of(c, i))
        if len(seen) == top:
            return order[:k + 1]
    return list(order)


def best_rejected(c: Candidates, code: np.ndarray, est: Estimates, run: Runner, top: list[Exact]) -> Optional[Exact]:
    """The rejected candidate (GPU memory, host memory under ZeRO-Offload, or GEMM efficiency) most
    worth keeping as evidence: among those whose step-time bound beats the winner's step time, the
    one closest to fitting (smallest peak lower bound); if none would beat it, the one with the
    smallest step-time bound. Planned and simulated exactly (its reasons the plan's)."""
    # not a block row: its n is picked where it fits (search.block_recompute); rejected, full's row is the evidence
    rejected = np.isin(code, (MEMORY, HOST, GEMM)) & np.isfinite(est.step_lo) & (c.rc != RECOMPUTE.index("block"))
    if not rejected.any():
        return None
    faster = rejected & (est.step_lo < (top[0].step_s if top else np.inf))
    if faster.any():
        idx = np.flatnonzero(faster)
        i = int(idx[np.lexsort((est.step_lo[idx], est.peak_lo[idx]))[0]])
    else:
        idx = np.flatnonzero(rejected)
        i = int(idx[np.argmin(est.step_lo[idx])])
    if i in run.exact and not _short_of(run.exact[i], SIMULATE):
        return run.exact[i]
    return run.plan([i], SIMULATE, label="best rejected")[0]
