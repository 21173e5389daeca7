"""``meshplan search``: every mesh of a config's model, cluster and training contract,
rejected with reasons or ranked by predicted step time.

The config's ``[mesh]`` table is ignored (a config without one is accepted); ``[search]``
(:class:`~meshplan.spec.search.SearchOptions`) narrows the space. Flow:

1. **Enumerate** (:mod:`meshplan.search.space`): factorizations of the world over
   ``(pp, dp_replicate, dp_shard, cp, tp)`` in that canonical order (tp innermost,
   node-major placement), with ep/etp for MoE, micro-batch, recompute, virtual stages and
   sharding; the validity rules of :mod:`meshplan.mesh.validity` on all at once.
2. **Vectorised estimate** (:mod:`meshplan.search.memory`, :mod:`meshplan.search.bounds`,
   :mod:`meshplan.search.timing`):
   exact persistent state, a lower and an upper bound on the memory-timeline peak, a lower
   bound on the step time, the efficiency of the local GEMMs, all as numpy arrays.
3. **Memory**: a lower bound above usable memory rejects, an upper bound within it keeps;
   a candidate in between ("near the memory limit") is planned exactly
   (:func:`meshplan.plan.build_plan`).
4. **GEMM threshold**: a candidate whose local GEMMs run below ``min_gemm_efficiency`` is
   rejected, unless no candidate at or above it fits: then the capacity constraint
   requires the narrow GEMMs and the below-threshold candidates are kept (and the result
   says so).
5. **Tighten the bound near the top**: candidates whose step-time bound is within 10% of
   the ``top``-th smallest get the pipeline schedule evaluated exactly on their unit
   bounds (:mod:`meshplan.search.pipeline`), still a lower bound, usually within 0.1% of
   the simulation.
6. **Rank by exact step time**, best-first: candidates are planned and simulated exactly
   (``build_plan`` + ``step_time(plan, Overlap())``, what ``meshplan plan`` and ``meshplan
   step`` run) in increasing order of their step-time lower bound, each bound tightened as
   in step 5 when its candidate reaches the front of the queue
   (:mod:`meshplan.search.frontier`; the printed bounds stay those of step 5), until ``top`` feasible
   ones are known and the next candidate's lower bound exceeds ``1.01`` x the ``top``-th
   exact step time (:func:`meshplan.search.rank.needed`); the top is then ordered by the tie
   rule (:mod:`meshplan.search.rank`: within 1%, fewer axes and lower degrees first, then the lower peak).
   Because the bound never exceeds the exact step time (tests check it on every
   candidate of small worlds), no candidate left unplanned can enter the top: the top is
   the one an exhaustive exact evaluation gives. ``exact_max`` caps the planned
   candidates; reaching it is reported (the top is then not proven). The top's step is
   split into parts and compared with the runner-up's (:mod:`meshplan.search.explain`).
7. **Settle the rest near the memory limit**: the first ``settle_max`` of them by step-time
   bound, then index, are planned (their verdict only changes the counts); any left are
   counted as undecided, never as feasible or rejected.
8. **The config's own mesh** (where it has a ``[mesh]``): the candidate that is the same run,
   evaluated by the same exact model and ranked among the feasible ones
   (:mod:`meshplan.search.configured`), or why no candidate is; it changes none of the above.

Exact ties (after the tie rule's keys) are broken by enumeration index, the same in the
exhaustive check.
Exact plans run on ``workers`` forked processes (default: the CPUs this process may use).
The output does not depend on the clock or on ``workers``: every budget is a count, the
ranking plans :data:`RANK_BATCH` candidates a round whatever the pool's size, and the pool
returns results in job order. Only ``wall_s`` and ``timings`` are measured times.

Goodput (:mod:`meshplan.reliability`, storage bandwidths and restart overhead from
``[search]``) is printed for the top candidates, not ranked.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import numpy as np

from meshplan.errors import ConfigError
from meshplan.limits import MAX_SEARCH_WORLD, over as over_bound
from meshplan.memory.constraints import usable_bytes
from meshplan.pipeline.registry import check_searched
from meshplan.search.bounds import bounds
from meshplan.search.exact import PLAN_ONLY, SIMULATE, STEP_ONLY, Exact, Planner, Pool, merge
from meshplan.search.explain import SPLIT_PARTS, Explanation, explain
from meshplan.search.frontier import Frontier
from meshplan.search.memory import Tables, stage_layout, state
from meshplan.search.rank import decide, needed, ranked, simplicity
from meshplan.search.candidate import accumulates, candidate_config
from meshplan.search.configured import Configured, configured
from meshplan.search.columns import FSDP_SHARDINGS, RECOMPUTE, SHARDING, ZERO12, Candidates
from meshplan.search.reasons import CODE, OK, REASONS, UNDECIDED, first_reason, zero1_refused
from meshplan.search.space import enumerate_candidates
from meshplan.search.pipeline import pipeline_bound
from meshplan.search.layer_bounds import gemm_efficiency, unit_bounds
from meshplan.search.time_tables import TimeTables
from meshplan.search.timing import step_lower_bound
from meshplan.config import Config
from meshplan.spec.axes.registry import search_axes
from meshplan.spec.wording import stream_words

#: Relative slack on the step-time bound in the stopping rule (floating-point rounding).
BOUND_SLACK = 1e-9
#: Candidates the ranking's queue tightens at once (:mod:`meshplan.search.frontier`): about
#: 0.3 s of :func:`refine` per block on Llama-3-405B / 16,384 H100 (~1 ms each plus a fixed
#: cost per pp degree), against 0.1-0.3 s per exact plan.
TIGHTEN_BLOCK = 256
#: Candidates the exact ranking plans per round (step 6) before it checks its stopping rule:
#: fixed, not the number of workers, so that which candidates are planned (and so the
#: ``exact_max`` cut, the planned count and the memory verdicts settled on the way) is the
#: same on every machine. 4: two jobs per worker on 2 cores; a larger pool gets fewer
#: than one job per worker a round (a run a few tenths of a second longer on 16 cores).
RANK_BATCH = 4


@dataclass
class Estimates:
    """Vectorised numbers per candidate (NaN where a rule already rejected it)."""

    peak_lo: np.ndarray
    peak_hi: np.ndarray
    step_lo: np.ndarray
    gemm: np.ndarray


@dataclass
class SearchResult:
    """Outcome of :func:`search`. ``code``: first rule each candidate breaks (index into
    :data:`~meshplan.search.reasons.REASONS`) or OK (-1); ``decided``: how the memory verdict
    was reached ("rule", "bound", "plan"); ``top``: the ranked feasible candidates (tie rule
    of :mod:`meshplan.search.rank`); ``exact``: every exactly planned candidate by index;
    ``explanation``: the top against the runner-up (:mod:`meshplan.search.explain`)."""

    config: Config
    candidates: Candidates
    code: np.ndarray
    decided: np.ndarray
    est: Estimates
    usable_bytes: float
    top: list[Exact]
    exact: dict[int, Exact]
    best_rejected: Optional[Exact]
    below_threshold_kept: bool
    proven: bool
    wall_s: float
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    explanation: Optional[Explanation] = None
    configured: Optional[Configured] = None

    def counts(self) -> dict[str, int]:
        """Candidates per outcome: ``feasible``, ``undecided`` (near the memory limit, beyond
        ``settle_max`` and not needed by the ranking) and one key per rejection reason; they add up to the
        number of candidates."""
        out = {"feasible": int((self.code == OK).sum()), "undecided": int((self.code == UNDECIDED).sum())}
        for i, (key, _) in enumerate(REASONS):
            out[key] = int((self.code == i).sum())
        return out


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
            # V-shaped schedules keep their closed-form bound: the unit bounds do not split the
            # backward into input and weight gradients, which those DAGs need
            sel = np.flatnonzero((g.vpp == v) & (micro[at] == m) & (g.ps == 0) & ((g.rf > 0) == rf))
            if not len(sel):
                continue
            part = {k: a[sel] for k, a in u.items()}
            i = idx[at[sel]]
            est.step_lo[i] = np.maximum(est.step_lo[i], pipeline_bound(part, v, m, rf))


def estimate(cfg: Config, c: Candidates, code: np.ndarray, tt: Optional[TimeTables] = None) -> Estimates:
    """The vectorised pass over every candidate that passed the validity rules; ``tt``: op
    and path tables to fill and reuse (:func:`refine` takes them too)."""
    n = len(c)
    est = Estimates(np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan))
    ok = np.flatnonzero(code == OK)
    if not len(ok):
        return est
    tt = tt or TimeTables(cfg, Tables(cfg))
    tables = tt.tables
    sub = c.take(ok)
    est.gemm[ok] = gemm_efficiency(cfg, tt, sub)
    for p in np.unique(sub.pp):
        idx = np.flatnonzero(sub.pp == p)
        g = sub.take(idx)
        st = stage_layout(cfg, g, int(p))
        s = state(cfg, tables, g, st)
        lo, hi = bounds(cfg, tables, g, st, s)
        est.peak_lo[ok[idx]], est.peak_hi[ok[idx]] = lo.max(axis=1), hi.max(axis=1)
        est.step_lo[ok[idx]] = step_lower_bound(cfg, tt, g, st, s)
    return est


Progress = Callable[[str, int, int], None]
RULE, BOUND, PLAN = 1, 2, 3
MEMORY, GEMM = CODE["memory"], CODE["gemm"]


def search(cfg: Config, progress: Optional[Progress] = None, workers: Optional[int] = None) -> SearchResult:
    """Search every mesh of ``cfg`` (module docstring). ``progress(label, done, total)`` is
    called as exact plans complete; ``workers``: processes for exact plans (default: the
    CPUs this process may use)."""
    if cfg.cluster.world > MAX_SEARCH_WORLD:
        raise ConfigError("cluster.nodes", f"{cfg.cluster.nodes} nodes x {cfg.cluster.node.gpus} GPUs = "
                                           f"{cfg.cluster.world} GPUs: {over_bound('search world', cfg.cluster.world)}; "
                                           "plan a chosen mesh with `meshplan plan`")
    check_searched(cfg.search.pp_schedules, cfg.training.framework)
    t0 = time.perf_counter()
    clock = _Clock()
    o = cfg.search
    c = enumerate_candidates(cfg)
    code = first_reason(cfg, c)
    decided = np.where(code == OK, 0, RULE)
    clock("enumerate")
    tt = TimeTables(cfg, Tables(cfg))
    est = estimate(cfg, c, code, tt)
    clock("estimate")
    usable = usable_bytes(cfg.cluster, cfg.training)
    valid = code == OK
    margin = o.memory_margin
    over = valid & (est.peak_lo > usable * (1 + margin))
    code[over], decided[over] = MEMORY, BOUND
    decided[valid & (est.peak_hi * (1 + margin) <= usable)] = BOUND
    above = est.gemm >= o.min_gemm_efficiency
    workers = workers or max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    pool = Pool(Planner(cfg, c), workers)
    run = _Runner(pool, code, decided, progress, est, margin)
    notes = run.notes
    try:
        apply = _threshold_applies(valid & ~over & above, decided, est, run)
        eligible = np.flatnonzero((code == OK) & (above | (not apply)))
        near_top = _near_top(est, eligible, o.top, o.refine_max)
        refine(cfg, c, est, near_top, tt)
        clock("refine")
        tight = np.zeros(len(c), bool)
        tight[near_top] = True
        top, proven, fastest = _rank(cfg, c, est, eligible, run, tt, tight)
        clock("rank")
        band = np.flatnonzero((code == OK) & (decided == 0))  # in index order: the stable sort breaks ties
        run.plan(band[np.argsort(est.step_lo[band], kind="stable")][:o.settle_max], PLAN_ONLY,
                 label="near the memory limit")
        left = (code == OK) & (decided == 0)
        if left.any():
            code[left] = UNDECIDED
            notes.append(f"{int(left.sum())} candidates near the memory limit were not planned (settle_max "
                         f"{o.settle_max} plans the first by step-time bound; their bounds keep them out of the "
                         "top); counted as undecided")
        clock("memory limit")
        if apply:
            code[(code == OK) & ~above] = GEMM
        best = _best_rejected(code, est, run, top)
        clock("best rejected")
    finally:
        pool.close()
    notes += _settings_notes(cfg, c)
    if not apply and top:  # with no candidate feasible at all, GEMM width is not the cause
        notes.append(f"no candidate with local GEMM efficiency >= {o.min_gemm_efficiency:.0%} fits: capacity "
                     f"requires narrower GEMMs, so the below-threshold candidates are kept")
    wall_s = time.perf_counter() - t0  # the search's own: the config's mesh is ranked after it (step 8)
    mine = None if cfg.mesh is None else configured(cfg, c, code, est.step_lo, run.exact, top, workers)
    return SearchResult(cfg, c, code, decided, est, usable, top, run.exact, best, not apply, proven,
                        wall_s, notes, clock.laps, _explanation(cfg, c, est, top, fastest), mine)


def _settings_notes(cfg: Config, c: Candidates) -> list[str]:
    """Where ``training.grad_accumulation``, ``training.fp8_all_gather``, ``training.zero3_engine`` or
    ``training.pp_schedule_runs`` does not apply to
    every candidate (:func:`meshplan.search.candidate.candidate_config`), one line saying how those
    candidates were planned; where ``recompute = "op"`` is searched on some candidates only
    (:func:`meshplan.search.space.op_recompute_ok`), one line saying so."""
    t, out = cfg.training, []
    fsdp = np.isin(c.sh, FSDP_SHARDINGS)
    if t.grad_accumulation != "sync" and not accumulates(cfg, c.pp, c.sh).all():
        out.append(f"training.grad_accumulation {t.grad_accumulation!r} applies to candidates with pp 1 and FSDP "
                   "(zero3, hsdp); the others are planned with 'sync' (with pp > 1 torch.distributed.pipelining "
                   "reduces once per step itself; ZeRO-1 reduces once per step)")
    if cfg.memory.fsdp_reduce is not None:
        out.append(f"[memory] fsdp_reduce {cfg.memory.fsdp_reduce!r} is not searched: each candidate reduces as its "
                   "pp and grad_accumulation say (after the last micro-batch with pp > 1, as "
                   "torch.distributed.pipelining does)")
    hsdp = ", hsdp candidates with FSDP2" if (c.sh == SHARDING.index("hsdp")).any() else ""  # only what is searched
    if t.zero3_engine == "deepspeed" and not (c.sh == SHARDING.index("zero3")).all():
        out.append("training.zero3_engine 'deepspeed' applies to zero3 candidates with pp 1; zero1 and zero2 "
                   "candidates are planned with DeepSpeed's ZeRO-1/2 (zero12_engine 'deepspeed': the same runtime at "
                   "another zero_optimization.stage)" + hsdp)
    elif t.zero3_engine != "fsdp2" and not (c.sh == SHARDING.index("zero3")).all():
        out.append(f"training.zero3_engine {t.zero3_engine!r} applies to zero3 candidates with pp 1; zero1 and hsdp "
                   "candidates are planned with FSDP2")
    if t.zero0_engine == "deepspeed":
        out.append("training.zero0_engine 'deepspeed' (DeepSpeed without ZeRO, stage 0) is not a search row: the "
                   "search has no unsharded candidate (meshplan plan plans it); zero1 and zero2 candidates are planned "
                   "with DeepSpeed's ZeRO-1/2 and zero3 with its ZeRO-3 (zero_optimization.stage 1, 2, 3 of the same "
                   "runtime)" + hsdp)
    if t.zero12_engine != "megatron" and not np.isin(c.sh, ZERO12).all():
        out.append(f"training.zero12_engine {t.zero12_engine!r} applies to zero1 and zero2 candidates (DeepSpeed's "
                   "ZeRO-1 and ZeRO-2: bucket all-reduces, ranked by the Megatron-style estimate, planned exactly as "
                   "DeepSpeed runs them); zero3 candidates are planned with DeepSpeed's ZeRO-3 (zero3_engine "
                   "'deepspeed', pp 1)" + hsdp)
    if "zero1" in cfg.search.sharding and zero1_refused(t) and (c.sh == SHARDING.index("zero1")).any():
        out.append("zero1 is rejected under training.framework \"torch\" (rule 'framework'): torch and torchtitan "
                   "have no engine that shards the optimizer state alone; set training.zero12_engine = \"deepspeed\" "
                   "(DeepSpeed's ZeRO-1) or framework = \"megatron\" (its distributed optimizer) to search it")
    if "op" in cfg.search.recompute and t.has_op_recompute and cfg.model.is_mla:
        out.append("recompute 'op' (torchtitan's op-level selective AC) is not searched with multi-head latent "
                   "attention: which of its mms the policy saves is not modelled")
    elif "op" in cfg.search.recompute and t.has_op_recompute and ((c.tp > 1) | (c.cp > 1) | (c.ep > 1)).any():
        out.append("recompute 'op' (torchtitan's op-level selective AC) is searched on candidates with tp = cp = ep = 1 "
                   "only: plan models it at tp > 1 with sequence parallelism (its replay repeats the tp "
                   "all-gathers), but the search's step-time pruning (search.timing) replays it as full recompute, "
                   "tp reduce-scatters included, which the policy saves, so it could discard such a candidate "
                   "wrongly; with cp or ep > 1 plan "
                   "refuses it (which CP and EP collectives its replay runs is not modelled)")
    if t.pp_schedule_runs > 1:
        out.append(f"training.pp_schedule_runs {t.pp_schedule_runs} applies to candidates with pp > 1: each runs its "
                   f"micro-batches as {t.pp_schedule_runs} pipeline schedules (a candidate whose micro-batches it does "
                   "not divide is rejected); with pp 1 it changes nothing")
    if (t.overlap_grad_reduce or t.overlap_param_gather) and not (c.sh == SHARDING.index("zero1")).all():
        out.append("training.overlap_grad_reduce and overlap_param_gather are Megatron-LM's DDP-buffer flags (zero1 "
                   "candidates); the others are planned without them (Megatron FSDP forces its own overlap)")
    if t.fp8_all_gather and not fsdp.all():
        out.append("training.fp8_all_gather applies to FSDP candidates (zero3, hsdp); zero1 candidates gather no "
                   "parameters with FSDP2 and are planned without it (their Linear GEMMs still in fp8)")
    return out


class _Clock:
    """Wall time of each phase, seconds."""

    def __init__(self):
        self.t, self.laps = time.perf_counter(), {}

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self.t
        self.t = now


class _Runner:
    """Plans candidates exactly through the pool and records the verdicts."""

    def __init__(self, pool: Pool, code: np.ndarray, decided: np.ndarray, progress: Optional[Progress],
                 est: Estimates, margin: float):
        self.pool, self.code, self.decided, self.progress = pool, code, decided, progress
        self.est, self.margin = est, margin
        self.exact: dict[int, Exact] = {}
        self.notes: list[str] = []

    def plan(self, idx, mode, label: str) -> list[Exact]:
        """Evaluate the candidates ``idx`` in order in ``mode`` (:meth:`Planner.__call__`; a
        str, or one per candidate); those already evaluated as far as their mode asks are
        skipped."""
        modes = [mode] * len(idx) if isinstance(mode, str) else list(mode)
        todo = [(int(i), md) for i, md in zip(idx, modes)
                if int(i) not in self.exact or _short_of(self.exact[int(i)], md)]
        out = []
        step = max(1, self.pool.workers) * 4  # batches of 4 jobs per worker (progress between them)
        for k in range(0, len(todo), step):
            out += self._batch(todo[k:k + step])
            if self.progress:
                self.progress(label, min(k + step, len(todo)), len(todo))
        return out

    def _batch(self, jobs: list[tuple[int, str]]) -> list[Exact]:
        res = self.pool.map(jobs)
        for k, r in enumerate(res):
            r = res[k] = merge(self.exact.get(r.index), r)  # the memory verdict and the step of two passes
            self.exact[r.index] = r
            self._check(r)
            if self.code[r.index] != OK or not r.complete:  # step-only: the memory bound decided
                continue
            if not r.feasible:
                self.code[r.index] = MEMORY if _memory_reason(r.reasons) else CODE["layers"]
            self.decided[r.index] = PLAN
        return res

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
    """Whether evaluation ``e`` lacks what ``mode`` gives (:meth:`Planner.__call__`)."""
    if mode == STEP_ONLY:
        return e.feasible and e.step_s is None
    if not e.complete:
        return True
    return mode == SIMULATE and e.breakdown is None  # simulated completely: the step's parts are there


def _memory_reason(reasons) -> bool:
    return any("usable" in r for r in reasons)


def _threshold_applies(above_ok: np.ndarray, decided: np.ndarray, est: Estimates, run: _Runner) -> bool:
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


def _near_top(est: Estimates, eligible: np.ndarray, top: int, most: int) -> np.ndarray:
    """Candidates whose step-time bound is within 10% of the ``top``-th smallest: the
    ones the ranking may plan, whose bound is worth tightening (at most ``most``)."""
    if not len(eligible):
        return eligible
    lo = est.step_lo[eligible]
    cut = np.sort(lo)[min(top, len(lo)) - 1] * 1.1
    near = eligible[lo <= cut]
    return near[np.argsort(est.step_lo[near], kind="stable")][:most]


def _rank(cfg: Config, c: Candidates, est: Estimates, eligible: np.ndarray, run: _Runner, tt: TimeTables,
          tight: np.ndarray) -> tuple[list[Exact], bool, Optional[Exact]]:
    """Best-first exact ranking (module docstring, step 6) under the tie rule of
    :mod:`meshplan.search.rank`: (top, proven, the fastest feasible candidate planned: the
    tie rule may list it below the top, or leave it out). The queue (:mod:`meshplan.search.frontier`)
    tightens each bound before its candidate is planned, on its own copy: ``est`` keeps the
    bounds the vectorised pass and :func:`refine` gave (``tight``: the candidates refined)."""
    o = cfg.search
    lo = est.step_lo.copy()
    own = replace(est, step_lo=lo)
    queue = Frontier(eligible, lo, lambda idx: refine(cfg, c, own, idx, tt), tight.copy(), block=TIGHTEN_BLOCK,
                     most=o.refine_max)
    steps: dict[int, float] = {}    # feasible: exact step times
    pending: dict[int, float] = {}  # near the memory limit, memory not planned yet: exact step times
    batch = RANK_BATCH
    planned, proven = 0, True
    while True:
        while len(queue):
            if len(steps) >= o.top and planned >= o.exact_min and \
                    needed(np.fromiter(steps.values(), float), o.top) < queue.next_bound(batch) * (1 - BOUND_SLACK):
                break
            if planned >= o.exact_max:
                proven = False
                run.notes.append(f"exact_max {o.exact_max} reached: {len(queue)} candidates with a lower "
                                 f"step-time bound than the top's were not planned; the top is not proven")
                break
            # while fewer than ``top`` steps are known the stopping rule cannot hold: the next
            # top - known candidates are planned in any case, as one batch (fewer pool round trips)
            chunk = queue.pop(min(max(batch, o.top - len(steps)), max(batch, o.exact_max - planned)))
            # the step alone (build_plan without memory timelines, then step_time); near the
            # memory limit the memory verdict follows only where the step could enter the top
            run.plan(chunk, STEP_ONLY, label="ranking")
            for r in (run.exact[int(i)] for i in chunk):  # planned now or before (threshold)
                planned += 1
                if r.step_s is None or not r.feasible:
                    continue
                if r.complete or run.decided[r.index] == BOUND:
                    steps[r.index] = r.step_s
                else:
                    pending[r.index] = r.step_s
            _settle_pending(steps, pending, o.top, run)
            if run.progress:
                run.progress("ranking", planned, planned + (len(queue) > 0))
        if not _complete_top(c, steps, o.top, run) or not proven:
            fastest = min(steps, key=lambda i: (steps[i], i)) if steps else None
            return [run.exact[i] for i in ranked(c, steps, o.top, peaks=_peaks(steps, run))], proven, \
                None if fastest is None else run.exact[fastest]


def _settle_pending(steps: dict[int, float], pending: dict[int, float], top: int, run: _Runner) -> None:
    """Plan the memory of the pending candidates (near the memory limit, step known) whose step
    is within :func:`~meshplan.search.rank.needed` of the known feasible ones: those that fit
    join ``steps``. The others cannot enter the top (``needed`` only falls as steps join), so
    their memory verdict is left to the settle phase."""
    cut = needed(np.fromiter(steps.values(), float), top)
    due = sorted((i for i, t in pending.items() if t <= cut), key=lambda i: (pending[i], i))
    run.plan(due, PLAN_ONLY, label="ranking")
    for i in due:
        step = pending.pop(i)
        if run.exact[i].feasible:
            steps[i] = step


def _complete_top(c: Candidates, steps: dict[int, float], top: int, run: _Runner) -> bool:
    """Plan the top's step-only candidates completely (peak, goodput, the step's parts), and the
    memory of every candidate within :func:`~meshplan.search.rank.needed` that ties a listed one
    on the tie rule's axes and degrees (its next key is the planned peak: a twin kept gathered
    must not be listed before the same mesh resharded only because its step is 0.085% shorter),
    until the top holds still; one whose plan does not fit after all (its memory bound was
    wrong: noted) leaves ``steps``. True when the top changed and the ranking must go on."""
    changed = False
    while True:
        order = ranked(c, steps, top, peaks=_peaks(steps, run))
        keys, cut = {simplicity(c, i) for i in order}, needed(np.fromiter(steps.values(), float), top)
        twins = [i for i in sorted(steps) if i not in order and steps[i] <= cut and not run.exact[i].complete
                 and simplicity(c, i) in keys]
        light = [i for i in order if _short_of(run.exact[i], SIMULATE)] + twins
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


def _peaks(steps: dict[int, float], run: _Runner) -> dict[int, float]:
    """Planned peak memory (bytes) of the candidates of ``steps`` whose memory is planned."""
    return {i: run.exact[i].peak_bytes for i in steps if run.exact[i].complete}


def describe(cfg: Config, c: Candidates, est: Estimates, e: Exact) -> dict:
    """What sets candidate ``e``'s step parts, for :func:`meshplan.search.explain.explain`."""
    i = e.index
    out: dict = {str(axis): int(c.degree(col.column)[i]) for axis, col in search_axes()}  # every searched axis
    out.update(vpp=int(c.vpp[i]), micro_batch=int(c.mb[i]), m=cfg.training.global_batch // int(c.mb[i] * c.dp[i]),
               recompute=RECOMPUTE[c.rc[i]], sharding=SHARDING[c.sh[i]], gemm_efficiency=float(est.gemm[i]),
               reshard_after_forward=bool(c.rf[i]), tp_comm_overlap=bool(c.ov[i]), layer_passes=e.layer_passes,
               stage_flops=e.stage_flops, compute_split=e.compute_split,
               copies_s=(e.compute_split or {}).get(SPLIT_PARTS[2]),
               streams=stream_words(candidate_config(cfg, c, i).training, cfg.origin))  # the stream names, by engine
    return out


def _explanation(cfg: Config, c: Candidates, est: Estimates, top: list[Exact],
                 fastest: Optional[Exact]) -> Optional[Explanation]:
    """The top against the runner-up (:mod:`meshplan.search.explain`), when both are
    simulated, naming ``fastest`` (the fastest feasible candidate planned) where the tie rule
    listed the top before it."""
    if len(top) < 2:
        return None
    a, b = top[0], top[1]
    if a.breakdown is None or b.breakdown is None:
        return None
    f = fastest if fastest is not None and fastest.step_s is not None else a
    row = next((k for k, e in enumerate(top, 1) if e.index == f.index), None)
    criterion = ""
    if f.index != a.index and a.step_s is not None and f.step_s is not None:  # what placed the top first, both values
        first, criterion = decide([a.step_s, f.step_s], [simplicity(c, a.index), simplicity(c, f.index)],
                                  [a.peak_bytes, f.peak_bytes])
        criterion = criterion if first is not None else f"{criterion} (enumeration order)"  # equal on every key
    return explain(a.breakdown, b.breakdown, describe(cfg, c, est, a), describe(cfg, c, est, b),
                   fastest_step_s=f.step_s, fastest_row=row, fastest_label=c.label(f.index), tie_criterion=criterion)


def _best_rejected(code: np.ndarray, est: Estimates, run: _Runner, top: list[Exact]) -> Optional[Exact]:
    """The rejected candidate (memory or GEMM efficiency) most worth keeping as evidence:
    among those whose step-time bound beats the winner's step time, the one closest to
    fitting (smallest peak lower bound); if none would beat it, the one with the smallest
    step-time bound. Planned and simulated exactly."""
    rejected = ((code == MEMORY) | (code == GEMM)) & np.isfinite(est.step_lo)
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
