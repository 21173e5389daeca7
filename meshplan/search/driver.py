"""``meshplan search``: every mesh of a config's model, cluster and training contract,
rejected with reasons or ranked by predicted step time.

The config's ``[mesh]`` table is ignored (a config without one is accepted); ``[search]``
(:class:`~meshplan.spec.search.SearchOptions`) narrows the space. Flow:

1. **Enumerate** (:mod:`meshplan.search.space`): factorizations of the world over
   ``(pp, dp_replicate, dp_shard, cp, tp)`` in that canonical order (tp innermost,
   node-major placement), with ep/etp for MoE, micro-batch, recompute, virtual stages and
   sharding; the validity rules of :mod:`meshplan.mesh.validity` on all at once.
2. **Vectorised estimate** (:mod:`meshplan.search.estimate` over :mod:`meshplan.search.memory`,
   :mod:`meshplan.search.bounds`, :mod:`meshplan.search.timing`):
   exact persistent state, a lower and an upper bound on the memory-timeline peak, a lower
   bound on the step time, the efficiency of the local GEMMs, all as numpy arrays.
3. **Memory**: a lower bound above usable memory rejects, an upper bound within it keeps;
   a candidate in between ("near the memory limit") is planned exactly
   (:func:`meshplan.plan.build_plan`). Under DeepSpeed ZeRO-Offload (``training.offload_optimizer =
   "cpu"``) the host memory too: a candidate the lower bound left whose node's ranks need more host
   memory than ``cluster.node.host_memory_gb`` is rejected (rule ``host``: the plan's verdict, exact,
   :mod:`meshplan.search.host_memory`).
4. **GEMM threshold**: a candidate whose local GEMMs run below ``min_gemm_efficiency`` is
   rejected, unless no candidate at or above it fits: then the capacity constraint
   requires the narrow GEMMs and the below-threshold candidates are kept (and the result
   says so).
5. **Tighten the bound near the top**: candidates whose step-time bound is within 10% of
   the ``top``-th smallest get the pipeline schedule evaluated exactly on their unit
   bounds (:mod:`meshplan.search.pipeline`), still a lower bound, usually within 0.1% of
   the simulation.
6. **Rank by exact step time**, best-first (:mod:`meshplan.search.best_first`): candidates
   are planned and simulated exactly (``build_plan`` + ``step_time(plan, Overlap())``, what
   ``meshplan plan`` and ``meshplan step`` run) in increasing order of their step-time lower
   bound, each bound tightened as in step 5 when its candidate reaches the front of the queue
   (:mod:`meshplan.search.frontier`; the printed bounds stay those of step 5), until ``top`` distinct
   feasible meshes are known and the next candidate's lower bound exceeds ``1.01`` x the ``top``-th
   shortest exact step time of a mesh (:func:`meshplan.search.rank.needed`); the top is then ordered by
   the tie rule (:mod:`meshplan.search.rank`: within 1%, fewer axes and lower degrees first, then fewer
   and cheaper settings, then the lower peak where more than 1% lower), one row per distinct mesh; under
   ``[search] headroom_tier`` (the default) those rows that keep under 15% of usable memory free are
   listed after the others (:mod:`meshplan.search.headroom`: the same rows, another order).
   Because the bound never exceeds the exact step time (tests check it on every
   candidate of small worlds), no candidate left unplanned can enter the top: the top is
   the one an exhaustive exact evaluation gives. ``exact_max`` caps the planned
   candidates; reaching it is reported (the top is then not proven). The top's step is
   split into parts and compared with the runner-up's (:mod:`meshplan.search.explain`).
7. **Settle the rest near the memory limit**: the first ``settle_max`` of them by step-time
   bound, then index, are planned (their verdict only changes the counts); any left are
   counted as undecided, never as feasible or rejected.
8. **The config's own mesh** (where it has a ``[mesh]``): the candidate that is the same run,
   evaluated by the same exact model and ranked by step time among the feasible ones the search
   decided, the undecided counted apart (:mod:`meshplan.search.configured`), or why no candidate
   is; it changes none of the above.

Exact ties (after the tie rule's keys) are broken by enumeration index, the same in the
exhaustive check.
Exact plans run on ``workers`` forked processes (default: the CPUs this process may use).
The output does not depend on the clock or on ``workers``: every budget is a count, the
ranking plans :data:`~meshplan.search.best_first.RANK_BATCH` candidates a round whatever the pool's size, and the pool
returns results in job order. Only ``wall_s`` and ``timings`` are measured times.

Goodput (:mod:`meshplan.reliability`, storage bandwidths and restart overhead from
``[search]``) is printed for the top candidates, not ranked.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.limits import MAX_SEARCH_WORLD, over as over_bound
from meshplan.memory.constraints import usable_bytes
from meshplan.memory.headroom import tight as tight_peak
from meshplan.pipeline.registry import check_searched
from meshplan.search.best_first import (BOUND, GEMM, MEMORY, RULE, Progress, Runner, best_first, best_rejected,
                                        threshold_applies, worth_tightening)
from meshplan.search.candidate import candidate_config
from meshplan.search.columns import RECOMPUTE, SHARDING, Candidates
from meshplan.search.configured import Configured, configured
from meshplan.search.estimate import Estimates, estimate, refine
from meshplan.search.exact import PLAN_ONLY, Exact, Planner, Pool
from meshplan.search.host_memory import host_over
from meshplan.search.explain import SPLIT_PARTS, Explanation, explain
from meshplan.search.gc_policy import search_gc
from meshplan.search.memory import Tables
from meshplan.search.rank import decide
from meshplan.search.tie_key import simplicity
from meshplan.search.reasons import CODE, OK, REASONS, UNDECIDED, first_reason
from meshplan.search.settings_notes import settings_notes
from meshplan.search.split_ac import split_ac_notes
from meshplan.search.space import enumerate_candidates
from meshplan.search.time_tables import TimeTables
from meshplan.spec.axes.registry import search_axes
from meshplan.spec.memory import ALLOCATOR_FRAGMENTATION
from meshplan.spec.wording import stream_words


@dataclass
class SearchResult:
    """Outcome of :func:`search`. ``code``: first rule each candidate breaks (index into
    :data:`~meshplan.search.reasons.REASONS`) or OK (-1); ``decided``: how the memory verdict
    was reached ("rule", "bound", "plan"); ``top``: the rows, one per distinct mesh, each its
    first candidate by the tie rule of :mod:`meshplan.search.rank`; ``exact``: every exactly
    planned candidate by index; ``explanation``: the top against the runner-up
    (:mod:`meshplan.search.explain`); ``placed``: every candidate the rule placed up to the last
    row, in order (the rows' meshes' other settings among them); ``variants``: the top mesh's
    other settings within 1% of the fastest step, at most 3; ``widened``: where no candidate fits
    and ``[search] cp`` is narrowed, the fastest row with every cp (:func:`meshplan.search.widen.widen`,
    which ``meshplan search`` runs after this search; None otherwise); ``widened_ep``: the same with every ep
    where the model is MoE and ``[search] ep`` is narrowed (newcomer trial nc58 #1b); ``tiered_past``: the tight meshes the
    rule's order over every candidate put before row 1, listed after it or left out by the headroom tiers
    (:mod:`meshplan.search.headroom`);
    ``safer``: (row shown, its mesh's first setting by the rule, tight) where the tiers showed the mesh
    at its fastest setting that keeps the headroom (:func:`~meshplan.search.headroom.tier_order`)."""

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
    placed: list[Exact] = field(default_factory=list)
    variants: list[Exact] = field(default_factory=list)
    widened: Optional["Widened"] = None
    widened_ep: Optional["Widened"] = None
    widened_mask: Optional["Widened"] = None
    tiered_past: list[Exact] = field(default_factory=list)
    safer: list[tuple[Exact, Exact]] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """Candidates per outcome: ``feasible``, ``undecided`` (near the memory limit, beyond
        ``settle_max`` and not needed by the ranking) and one key per rejection reason; they add up to the
        number of candidates."""
        out = {"feasible": int((self.code == OK).sum()), "undecided": int((self.code == UNDECIDED).sum())}
        for i, (key, _) in enumerate(REASONS):
            out[key] = int((self.code == i).sum())
        return out


@dataclass(frozen=True)
class Widened:
    """The fastest row of a search with ``[search] cp`` (or ``ep``: ``axis``) widened
    (:mod:`meshplan.search.widen`): ``given`` the config's list, ``cp`` the row's cp degree (its ep:
    ``ep``), ``label`` the candidate as the search prints it, ``step_s`` its exact step (seconds),
    ``peak_bytes`` its planned peak (bytes)."""

    given: tuple[int, ...]
    cp: int
    label: str
    step_s: float
    peak_bytes: float
    axis: str = "cp"
    ep: int = 1

    @property
    def degree(self) -> int:
        """The row's degree of the widened axis."""
        return self.ep if self.axis == "ep" else self.cp

    def to_dict(self) -> dict:
        return {"key": "search.cp", "given": list(self.given), "cp": self.cp, "label": self.label,
                "step_s": self.step_s, "peak_bytes": self.peak_bytes}


def search(cfg: Config, progress: Optional[Progress] = None, workers: Optional[int] = None) -> SearchResult:
    """Search every mesh of ``cfg`` (module docstring). ``progress(label, done, total)`` is
    called as exact plans complete; ``workers``: processes for exact plans (default: the
    CPUs this process may use)."""
    if cfg.cluster.world > MAX_SEARCH_WORLD:
        raise ConfigError("cluster.nodes", f"{cfg.cluster.nodes} nodes x {cfg.cluster.node.gpus} GPUs = "
                                           f"{cfg.cluster.world} GPUs: {over_bound('search world', cfg.cluster.world)}; "
                                           "plan a chosen mesh with `meshplan plan`")
    check_searched(cfg.search.pp_schedules, cfg.training.framework)
    with search_gc():
        return _search(cfg, progress, workers)


def _search(cfg: Config, progress: Optional[Progress], workers: Optional[int]) -> SearchResult:
    """:func:`search`'s body, under :func:`~meshplan.search.gc_policy.search_gc`."""
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
    valid, over = _memory_bounds(cfg, c, code, decided, est, usable, o.memory_margin)
    above = est.gemm >= o.min_gemm_efficiency
    workers = workers or max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    pool = Pool(Planner(cfg, c), workers)
    run = Runner(pool, code, decided, progress, est, o.memory_margin)
    notes = run.notes
    try:
        apply = threshold_applies(valid & ~over & above, decided, est, run)
        ranking = _ranking(cfg, c, code, est, run, tt, above | (not apply), clock)
        top, proven, fastest = ranking.top, ranking.proven, ranking.fastest
        _settle(o, code, decided, est, run, notes)
        clock("memory limit")
        if apply:
            code[(code == OK) & ~above] = GEMM
        best = best_rejected(c, code, est, run, top)
        clock("best rejected")
        notes += settings_notes(cfg, c) + split_ac_notes(cfg, c, code)  # after the last verdict: counts feasible
        if not apply and top:  # with no candidate feasible at all, GEMM width is not the cause
            notes.append(f"no candidate with local GEMM efficiency >= {o.min_gemm_efficiency:.0%} fits: capacity "
                         f"requires narrower GEMMs, so the below-threshold candidates are kept")
        wall_s = time.perf_counter() - t0  # the search's own: the config's mesh is ranked after it (step 8)
        # on the search's pool: its workers' caches are warm (a new pool cost 0.4 s CPU at 405B, 2 workers)
        mine = None if cfg.mesh is None else configured(cfg, c, code, est.step_lo, run.exact, top, pool, proven)
        if mine is not None:
            clock("your mesh")  # with the notes above (~ms)
    finally:
        pool.close()
    return SearchResult(cfg, c, code, decided, est, usable, top, run.exact, best, not apply, proven,
                        wall_s, notes, clock.laps, _explanation(cfg, c, est, top, fastest, usable, ranking.tiered_past,
                                                                 ranking.safer),
                        mine, ranking.placed, ranking.variants, tiered_past=ranking.tiered_past,
                        safer=ranking.safer)


def _memory_bounds(cfg: Config, c: Candidates, code: np.ndarray, decided: np.ndarray, est, usable: float,
                   margin: float) -> tuple:
    """(the candidates no rule rejected, those of them whose peak's lower bound exceeds the usable
    memory by more than ``margin``, or whose node's ranks need more host memory than the node's
    under ZeRO-Offload). Those are rejected for memory by the bound (rule ``memory``; a row over
    both is the bound's, as the plan lists the GPU's reason first) or for host memory (rule ``host``,
    exact: :func:`~meshplan.search.host_memory.host_over`, decided by that rule), and a candidate
    whose peak's upper bound fits with the margin is decided by the bound too (``code`` and
    ``decided`` updated in place; the rest need an exact plan)."""
    tiers, frac = cfg.search.headroom_tier, cfg.memory.fragmentation_fraction
    valid = code == OK
    over = valid & (est.peak_lo > usable * (1 + margin))
    code[over], decided[over] = MEMORY, BOUND
    host = valid & ~over & host_over(cfg, est.host_numel, est.host_per_element)
    code[host], decided[host] = HOST, RULE
    over |= host
    fits = valid & ~host & (est.peak_hi * (1 + margin) <= usable)
    decided[fits] = BOUND
    # a block row's upper bound holds at n 0 (none's fields, search.block_recompute): where it fits
    # (clear of the headroom where the tiers ask for it) none does, and the row adds nothing (rule block)
    roomy = ~(tiers & tight_peak(est.peak_hi * (1 + margin), usable, frac))
    code[fits & roomy & (c.rc == RECOMPUTE.index("block"))] = BLOCK
    # a block row whose least n (search.block_bounds.least_block) is its whole largest chunk:
    # only full, its own row, can fit
    whole = valid & ~over & (c.rc == RECOMPUTE.index("block")) & (c.rm >= c.rk) if c.rm is not None else None
    if whole is not None:
        code[whole], decided[whole] = BLOCK, BOUND
    return valid, over


def _ranking(cfg: Config, c, code: np.ndarray, est, run, tt, wide, clock):
    """The top by exact step time (:func:`~meshplan.search.best_first.best_first`) over the
    candidates still feasible and ``wide`` enough (local GEMM efficiency over the threshold where
    it applies), after the bounds of those nearest the top are tightened (:func:`refine`)."""
    eligible = np.flatnonzero((code == OK) & wide)
    near_top = worth_tightening(est, eligible, cfg.search.top, cfg.search.refine_max)
    refine(cfg, c, est, near_top, tt)
    clock("refine")
    tight = np.zeros(len(c), bool)
    tight[near_top] = True
    ranking = best_first(cfg, c, est, eligible, run, tt, tight)
    clock("rank")
    return ranking


def _settle(o, code: np.ndarray, decided: np.ndarray, est, run, notes: list[str]) -> None:
    """The candidates near the memory limit (neither bound decides them) planned for memory alone,
    the first ``settle_max`` by step-time lower bound (in index order: the stable sort breaks
    ties); those left are undecided (``code`` in place), with a note counting them."""
    band = np.flatnonzero((code == OK) & (decided == 0))  # in index order: the stable sort breaks ties
    run.plan(band[np.argsort(est.step_lo[band], kind="stable")][:o.settle_max], PLAN_ONLY,
             label="near the memory limit")
    left = (code == OK) & (decided == 0)
    if left.any():
        code[left] = UNDECIDED
        notes.append(f"{int(left.sum())} candidates near the memory limit were not planned (settle_max "
                     f"{o.settle_max} plans the first by step-time bound; their bounds keep them out of the "
                     "top); counted as undecided")


BLOCK, HOST = CODE["block"], CODE["host"]


class _Clock:
    """Wall time of each phase, seconds."""

    def __init__(self):
        self.t, self.laps = time.perf_counter(), {}

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self.t
        self.t = now


def describe(cfg: Config, c: Candidates, est: Estimates, e: Exact) -> dict:
    """What sets candidate ``e``'s step parts, for :func:`meshplan.search.explain.explain`."""
    i = e.index
    out: dict = {str(axis): int(c.degree(col.column)[i]) for axis, col in search_axes()}  # every searched axis
    out.update(vpp=int(c.vpp[i]), micro_batch=int(c.mb[i]), m=cfg.training.global_batch // int(c.mb[i] * c.dp[i]),
               recompute=c.recompute_word(i), sharding=SHARDING[c.sh[i]], gemm_efficiency=float(est.gemm[i]),
               reshard_after_forward=bool(c.rf[i]), tp_comm_overlap=bool(c.ov[i]), layer_passes=e.layer_passes,
               zero_hpz_partition_size=c.hpz(i),
               stage_flops=e.stage_flops, compute_split=e.compute_split,
               copies_s=(e.compute_split or {}).get(SPLIT_PARTS[2]),
               kernels_s=e.kernels_s,
               streams=stream_words(candidate_config(cfg, c, i).training, cfg.origin))  # the stream names, by engine
    return out


def _explanation(cfg: Config, c: Candidates, est: Estimates, top: list[Exact],
                 fastest: Optional[Exact], usable: float, tiered_past: list[Exact],
                 safer: Sequence[tuple[Exact, Exact]] = ()) -> Optional[Explanation]:
    """The top against the runner-up (:mod:`meshplan.search.explain`), when both are
    simulated, naming ``fastest`` (the fastest feasible candidate planned) where the tie rule
    listed the top before it, or the headroom tiers did (``tiered_past``, the tight rows the rule
    put first: :func:`_tier_words`; ``safer``, the meshes they show at a setting that keeps the
    headroom, whose tight first setting may be the fastest: :func:`_safer_words`); ``usable``: the
    bytes a GPU may hold (:func:`~meshplan.memory.constraints.usable_bytes`, computed once by the search)."""
    if len(top) < 2:
        return None
    a, b = top[0], top[1]
    if a.breakdown is None or b.breakdown is None:
        return None
    f = fastest if fastest is not None and fastest.step_s is not None else a
    row = next((k for k, e in enumerate(top, 1) if e.index == f.index), None)
    criterion = _tier_words(c, a, tiered_past, top, usable) or _safer_words(cfg, a, f, safer, top, usable)
    if not criterion and f.index != a.index and a.step_s is not None and f.step_s is not None:  # what placed the top first, both values
        first, criterion = decide([a.step_s, f.step_s], [simplicity(c, a.index), simplicity(c, f.index)],
                                  [a.peak_bytes, f.peak_bytes])
        criterion = criterion if first is not None else f"{criterion} (enumeration order)"  # equal on every key
    return explain(a.breakdown, b.breakdown, describe(cfg, c, est, a), describe(cfg, c, est, b),
                   fastest_step_s=f.step_s, fastest_row=row, fastest_label=c.label(f.index), tie_criterion=criterion,
                   tiers=bool(tiered_past) or any(t.index == f.index for _, t in safer)
                   or _tight_only(cfg, a, f, usable))


def _tier_words(c: Candidates, a: Exact, past: list[Exact], top: list[Exact], usable: float) -> str:
    """What placed the top ``a`` before the meshes the rule put first (``past``, tight), where the
    headroom tiers did: its free share against theirs, ``it keeps 57.7% of the usable memory free,
    row 2 (first by the order rule) 6.4%, under 15%``; where one is not a row shown (the tiers rank
    the whole list before the cut to ``--top``), how many and the first by its label: ``3 meshes first
    by the order rule keep less (the first, dp_shard 4 x tp 2, ..., 6.4%), under 15%``; "" where they
    moved none."""
    if not past:
        return ""
    at = {e.index: k for k, e in enumerate(top, 1)}
    keeps, under = f"it keeps {1 - a.peak_bytes / usable:.1%} of the usable memory free", \
        f"under {ALLOCATOR_FRAGMENTATION:.0%}"
    if any(e.index not in at for e in past):
        n, first = len(past), past[0]
        return (f"{keeps}, {n} mesh{'es' if n > 1 else ''} first by the order rule keep{'' if n > 1 else 's'} less "
                f"(the first, {c.label(first.index)}, {1 - first.peak_bytes / usable:.1%}), {under}")
    rows = ", ".join(str(at[e.index]) for e in past)
    free = ", ".join(f"{1 - e.peak_bytes / usable:.1%}" for e in past)
    return f"{keeps}, row{'s' if len(past) > 1 else ''} {rows} (first by the order rule) {free}, {under}"


def _safer_words(cfg: Config, a: Exact, fastest: Exact, safer, top: list[Exact], usable: float) -> str:
    """Where the fastest candidate is a mesh's tight first setting that the headroom tiers show at
    a setting keeping the headroom (``safer``: (shown, tight) pairs): ``it keeps 57.7% of the usable
    memory free, the fastest 6.4%, under 15% (its mesh is row 2, at its fastest setting that keeps
    it)``; "" otherwise. ``usable``: bytes, as :func:`_explanation`'s."""
    keeps = (f"it keeps {1 - a.peak_bytes / usable:.1%} of the usable memory free, the fastest "
             f"{1 - fastest.peak_bytes / usable:.1%}, under {ALLOCATOR_FRAGMENTATION:.0%}")
    shown = next((s for s, t in safer if t.index == fastest.index), None)
    if shown is not None:
        row = next((k for k, e in enumerate(top, 1) if e.index == shown.index), "?")
        return f"{keeps} (its mesh is row {row}, at its fastest setting that keeps it)"
    if _tight_only(cfg, a, fastest, usable):
        return f"{keeps} (its mesh is not a row: its settings that keep it are slower than the rows shown)"
    return ""


def _tight_only(cfg: Config, a: Exact, fastest: Exact, usable: float) -> bool:
    """Whether the headroom tiers, not the tie rule, put the top ``a`` (clear) before ``fastest``
    (tight) where the fastest's mesh is no row (its clear settings slower than the last row):
    newcomer 32's pp 2 x dp 16 x tp 4 on A100 40GB, 3.1% free, 0.024% faster than the top."""
    frac = cfg.memory.fragmentation_fraction
    return cfg.search.headroom_tier and tight_peak(fastest.peak_bytes, usable, frac) and \
        not tight_peak(a.peak_bytes, usable, frac)
