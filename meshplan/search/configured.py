"""Where the config's own ``[mesh]`` ranks among the search's candidates (issue 11 follow-up:
``meshplan search`` ignores the mesh for the search, then says where it stands).

:func:`~meshplan.search.configured_find.find` maps the config's mesh and training knobs to the
candidate that is the same run (its columns, then :func:`~meshplan.search.candidate.candidate_config`
of that row compared with the config), or says why no candidate is. :func:`configured` evaluates that candidate
with the search's own exact model (:class:`~meshplan.search.exact.Planner`, ``SIMULATE``:
``build_plan`` + ``step_time(plan, Overlap())``) and ranks it by step time: #N = 1 + the
feasible candidates whose exact step is shorter, also where it is listed in the top (whose rows
follow the tie rule, so its row is given beside the rank, never as it). Feasible candidates whose
step-time lower bound is below its step and that the search did not plan are planned here
(the step alone, on the search's own worker processes where it passes its pool), lowest bound
first, at most ``[search] rank_max`` of them (default 32); beyond that
the rank is a range, ``between #lo and #hi``: each candidate left could be faster or not, so the
range is as wide as their count, whichever are planned (a plan moves one end by one), and the line
says how many and that ``rank_max`` plans more (newcomer trial 16: ``#162-#2,546 of 5,857`` for a
70B cp search said neither; planning them all there costs minutes). The rank is among
the feasible candidates the search decided: those left undecided near the memory limit
(``[search] settle_max``) are counted apart, with how many of them have a step-time lower bound
below its step (planned, those could rank ahead). Where the config's settings are not its mesh's
fastest searched setting, the line adds the mesh at that setting
(:mod:`meshplan.search.configured_best`, newcomer trial 26 #1: a micro-batch 1 read as the mesh's
173% gap to the top). None of it changes the search's result (its own planner and pool).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.mesh.resolve import Mesh, resolve_mesh
from meshplan.plan import Plan, build_plan
from meshplan.schedule.steptime import step_time
from meshplan.schedule.unit_sim import Overlap
from meshplan.search.columns import Candidates
from meshplan.search.configured_best import best_words, fastest_setting, setting_plan, setting_words
from meshplan.search.configured_find import find
from meshplan.search.configured_row import table_row
from meshplan.memory.constraints import usable_bytes
from meshplan.search.explain import relative
from meshplan.search.exact import SIMULATE, STEP_ALONE, Exact, Planner, Pool
from meshplan.search.rank import mesh_of
from meshplan.search.reasons import CODE, OK, REASONS, UNDECIDED, reason_texts
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.search import TIE

@dataclass(frozen=True)
class Configured:
    """The config's mesh among the candidates: ``mesh`` as printed (``dp_shard 8 x tp 8``);
    ``status`` ``ranked`` (``step_s``, ``tokens_per_s``, ``rank`` .. ``rank_hi`` by step time of
    ``feasible``; ``row`` in the top table or None; ``undecided`` candidates near the memory limit
    not ranked, ``undecided_below`` of them with a step-time lower bound below ``step_s``),
    ``infeasible`` or ``not_ranked`` (``reason``; a step where planned) or ``absent``
    (``reason``: why no candidate is this run); ``rank_max`` the ``[search] rank_max`` the rank
    planned with; ``would_row``: where ``absent`` and planned as given, the row of the top table it
    would take (:func:`~meshplan.search.configured_row.table_row`), None where it would follow every
    row shown or the top is not proven; ``best_index``, ``best_settings``, ``best_step_s``: where
    ranked and its settings are not its mesh's fastest searched setting
    (:func:`~meshplan.search.configured_best.fastest_setting`), that candidate, what it runs
    otherwise (``mb 4, full``) and its step (seconds), else None."""

    mesh: str
    status: str
    reason: Optional[str] = None
    step_s: Optional[float] = None
    tokens_per_s: Optional[float] = None
    rank: Optional[int] = None
    rank_hi: Optional[int] = None
    feasible: Optional[int] = None
    index: Optional[int] = None
    row: Optional[int] = None
    undecided: Optional[int] = None
    undecided_below: Optional[int] = None
    rank_max: Optional[int] = None
    would_row: Optional[int] = None
    best_index: Optional[int] = None
    best_settings: Optional[str] = None
    best_step_s: Optional[float] = None

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def line(self) -> str:
        """The line printed after the top table (``reason`` holds the notes in parentheses).

        >>> Configured("dp_shard 4 x tp 2", "ranked", "5.47% longer than the top's", 7.381, 71028.4, 40, 40, 717).line()
        "your mesh (dp_shard 4 x tp 2): 7.381 s, 71,028 tokens/s, rank #40 of 717 feasible by step time (5.47% longer than the top's)"
        >>> Configured("dp_shard 8 x tp 8", "ranked", None, 331.38, 12657.0, 80, 965, 1118, undecided=27).line()
        'your mesh (dp_shard 8 x tp 8): 331.380 s, 12,657 tokens/s, rank between #80 and #965 of 1,118 feasible by step time, 27 undecided near the memory limit not ranked'
        >>> print(Configured("cp 4 x tp 8", "absent", "cp before dp_shard", 50.0, 9000.0, 162, 2546, 5857,
        ...                  rank_max=32).line())  # doctest: +NORMALIZE_WHITESPACE
        your mesh (cp 4 x tp 8) is not among the candidates: cp before dp_shard; planned as given (not searched):
        50.000 s, 9,000 tokens/s, would rank between #162 and #2,546 of 5,857 feasible by step time (2,384 feasible
        candidates with a step-time lower bound below its step not planned, each could rank ahead: [search] rank_max
        32 planned the first by bound, each plan more narrows the range by one)
        """
        if self.status == "absent" and self.step_s is not None:  # planned as given (_as_given)
            lo, hi = self.rank or 0, self.rank_hi or 0  # set with step_s
            tail = f" ({left_words(hi - lo, self.rank_max)})" if hi > lo else ""
            row = "" if self.would_row is None else \
                f"be row #{self.would_row} of the top table (its step and peak against the rows', tiers applied), "
            return (f"your mesh ({self.mesh}) is not among the candidates: {self.reason}; planned as given (not "
                    f"searched): {self.step_s:.3f} s, {self.tokens_per_s:,.0f} tokens/s, would {row}rank "
                    f"{rank_words(lo, hi)} of {self.feasible:,} feasible by step time{tail}")
        if self.status == "absent":
            return f"your mesh ({self.mesh}) is not among the candidates: {self.reason}"
        if self.status == "infeasible":
            return f"your mesh ({self.mesh}): infeasible: {self.reason}"
        step = f"{self.step_s:.3f} s, {self.tokens_per_s:,.0f} tokens/s"
        if self.status == "not_ranked":
            return f"your mesh ({self.mesh}): {step}, not ranked: {self.reason}"
        rank = rank_words(self.rank or 0, self.rank_hi or 0)  # set when ranked
        apart = f", {self.undecided:,} undecided near the memory limit not ranked" if self.undecided else ""
        why = "" if self.reason is None else f" ({self.reason})"
        return f"your mesh ({self.mesh}): {step}, rank {rank} of {self.feasible:,} feasible by step time{apart}{why}"


def rank_words(lo: int, hi: int) -> str:
    """A rank, or the range the unplanned candidates leave.

    >>> rank_words(4, 4), rank_words(162, 2546)
    ('#4', 'between #162 and #2,546')
    """
    return f"#{lo:,}" if lo == hi else f"between #{lo:,} and #{hi:,}"


def left_words(left: int, rank_max: Optional[int]) -> str:
    """What the range means: ``left`` candidates not planned, each of which could rank ahead, and
    the ``[search] rank_max`` that plans more (:func:`_rank`)."""
    many = "s" if left > 1 else ""
    return (f"{left:,} feasible candidate{many} with a step-time lower bound below its step not planned, each could "
            f"rank ahead: [search] rank_max {rank_max} planned the first by bound, each plan more narrows the range "
            "by one")


def _mesh_words(spec: MeshSpec, world: int) -> str:
    """The config's mesh in its order (``tp 4 x dp_shard 2``; Megatron's degrees as given), a -1
    resolved where the mesh resolves."""
    pairs = list(zip(spec.names, spec.shape or []) if spec.names is not None else (spec.degrees or {}).items())
    try:
        mesh = resolve_mesh(spec, spec.world or world)
    except ConfigError:
        mesh = None
    if isinstance(mesh, Mesh):
        pairs = [(n, mesh.ep if n == "ep" else mesh.etp if n == "etp" else mesh.degree(n)) for n, _ in pairs]
    return " x ".join(f"{n} {d}" for n, d in pairs)


def configured(cfg: Config, c: Candidates, code: np.ndarray, step_lo: np.ndarray, exact: dict[int, Exact],
               top: list[Exact], workers: int | Pool = 1, proven: bool = True) -> Configured:
    """Where ``cfg``'s mesh ranks (module docstring): ``code``, ``step_lo``, ``exact``, ``top``
    the search's verdicts, step-time lower bounds, exact evaluations and ranked top; ``workers``:
    processes for the rank's plans, or the search's open :class:`~meshplan.search.exact.Pool` of
    ``cfg`` and ``c`` (its workers' caches warm; left open)."""
    if cfg.mesh is None:
        raise ValueError("configured: the config has no [mesh]")
    words = _mesh_words(cfg.mesh, cfg.cluster.world)
    i = find(cfg, cfg.mesh, c)
    if isinstance(i, str):
        return _as_given(cfg, c, code, step_lo, exact, words, i, workers, top if proven else [])
    texts = reason_texts(cfg.training)
    k = int(code[i])
    if k >= 0 and REASONS[k][0] not in ("memory", "host", "gemm"):  # those planned: the plan's own reasons
        return Configured(words, "infeasible", f"rule '{REASONS[k][0]}': {texts[REASONS[k][0]]}", index=i)
    planner = Planner(cfg, c)
    e = exact.get(i)
    if e is None or not e.complete or e.step_s is None:
        e = planner((i, SIMULATE))
    if not e.feasible or e.step_s is None:
        return Configured(words, "infeasible", "; ".join(e.reasons), index=i)
    if k == CODE["gemm"]:
        return Configured(words, "not_ranked", "local GEMM efficiency below the threshold ([search] "
                          "min_gemm_efficiency)", e.step_s, e.tokens_per_s, index=i)
    feasible = int((code == OK).sum()) + (k in (UNDECIDED, CODE["memory"]))
    undecided = np.flatnonzero(code == UNDECIDED)
    undecided = undecided[undecided != i]
    below = int((step_lo[undecided] < e.step_s).sum())
    row = next((n for n, t in enumerate(top, 1) if t.index == i), None)
    mesh_row = next((n for n, t in enumerate(top, 1) if mesh_of(c, t.index) == mesh_of(c, i)), None)
    n = cfg.search.rank_max
    # the fastest setting's one more plan (configured_best), known now: on the pool with the rank's plans
    j = setting_plan(cfg, c, code, step_lo, exact, top, i, e)
    extra = () if j is None else ((j, SIMULATE),)
    lo, hi, more = _rank(c, code, step_lo, exact, e.step_s, i, planner, workers, n, extra)
    best = fastest_setting(cfg, c, code, step_lo, exact, top, i, e, lambda job: more.get(job) or planner(job))
    best = None if best is None or best.index == i or best.step_s is None else best
    notes = _notes(row, e.step_s, top, k, hi - lo, len(undecided), below, mesh_row, n)
    b_words = None if best is None else setting_words(c, i, best.index)
    if best is not None and top:
        at = len(notes) - (k != OK) - bool(hi - lo) - bool(len(undecided))  # after the step against the top's
        notes.insert(at, best_words(b_words or "", float(best.step_s or 0), top, best.index))
    return Configured(words, "ranked", "; ".join(notes) or None, e.step_s, e.tokens_per_s, lo, hi, feasible, i, row,
                      len(undecided), below, n, best_index=None if best is None else best.index,
                      best_settings=b_words, best_step_s=None if best is None else best.step_s)


def _as_given(cfg: Config, c: Candidates, code: np.ndarray, step_lo: np.ndarray, exact: dict[int, Exact],
              words: str, why: str, workers: int | Pool, top: list[Exact]) -> Configured:
    """A mesh no candidate runs (``why``), planned as the config gives it with the search's exact model
    (``build_plan`` + ``step_time(plan, Overlap())``, as :class:`~meshplan.search.exact.Planner`), not
    added to the searched set: its step, the row of the top table ``top`` it would take
    (:func:`~meshplan.search.configured_row.table_row`; none from an empty ``top``, a top not proven)
    and where that step would rank among the feasible candidates (:func:`_rank`); ``why`` alone where
    it does not plan or fit."""
    try:
        plan = build_plan(cfg)
    except ConfigError as e:
        return Configured(words, "absent", f"{why}; as given it does not plan: {e}")
    if not isinstance(plan, Plan) or not plan.feasible:
        return Configured(words, "absent", f"{why}; as given: infeasible: {'; '.join(plan.reasons)}")
    st = step_time(plan, Overlap())
    n = cfg.search.rank_max
    lo, hi, _ = _rank(c, code, step_lo, exact, st.step_s, -1, Planner(cfg, c), workers, n)
    row = table_row(st.step_s, plan.timeline.peak.total_bytes, top, usable_bytes(cfg.cluster, cfg.training),
                    cfg.memory.fragmentation_fraction, cfg.search.headroom_tier)
    return Configured(words, "absent", why, st.step_s, st.tokens_per_s, lo, hi, int((code == OK).sum()), rank_max=n,
                      would_row=row)


def _notes(row: Optional[int], step_s: float, top: list[Exact], k: int, left: int, undecided: int,
           below: int, mesh_row: Optional[int] = None, rank_max: Optional[int] = None) -> list[str]:
    """The clauses in parentheses after the rank: its ``row`` in the top table (the tie rule's
    order, not the rank), or the row of its mesh listed at other settings (``mesh_row``: the rows
    are distinct meshes), ``step_s`` against the top's, a verdict reached here (code ``k``), the
    ``left`` feasible candidates unplanned (:func:`left_words`, ``rank_max``) and the ``below`` of the
    ``undecided`` whose step-time
    lower bound is below ``step_s``."""
    out = [f"row #{row:,} in the top table, whose tie rule orders meshes within {TIE:.0%} toward fewer axes, lower "
           "degrees and fewer settings"] if row is not None else [] if mesh_row is None else [
        f"its mesh is row #{mesh_row:,} in the top table, at other settings (one row per distinct mesh)"]
    out += [relative(step_s / top[0].step_s - 1, "the top's")] if row != 1 and top and top[0].step_s else []
    out += [] if k == OK else ["near the memory limit, planned here: it fits"]
    out += [left_words(left, rank_max)] if left else []
    if undecided and below:
        out.append(f"{below:,} of the undecided ha{'ve' if below > 1 else 's'} a step-time lower bound below its "
                   "step and could rank ahead if planned: [search] settle_max plans more")
    elif undecided:
        out.append("no undecided candidate could rank ahead: their step-time lower bounds are not below its step")
    return out


def _rank(c: Candidates, code: np.ndarray, step_lo: np.ndarray, exact: dict[int, Exact], step_s: float, i: int,
          planner: Planner, workers: int | Pool, rank_max: int = 32,
          extra: tuple = ()) -> tuple[int, int, dict[tuple[int, str], Exact]]:
    """(lowest, highest) rank of a step of ``step_s``: 1 + the feasible candidates with a shorter
    exact step; those unplanned whose lower bound is below it planned (:data:`~meshplan.search.exact.STEP_ALONE`:
    the step, to the bit the search's), lowest bound first, up to ``rank_max`` (``[search] rank_max``),
    the rest (and any plan that gives no step) left as the range: highest - lowest = those left.
    ``workers``: a process count (a pool of them forked here, closed after) or an open pool, used as it is.
    ``extra``: more planner jobs run in the same pool map after the rank's (their results, by job, the
    third element; they change no rank): the fastest setting's plan, which ran alone after them (the
    405B example's vpp 8 plan, serial in the parent while the workers idled)."""
    feasible = np.flatnonzero(code == OK)
    steps = {j: exact[j].step_s for j in feasible.tolist() if j in exact and exact[j].step_s is not None}
    open_ = [j for j in feasible.tolist() if j not in steps and j != i and step_lo[j] < step_s]
    open_.sort(key=lambda j: (step_lo[j], j))
    todo, left = open_[:rank_max], len(open_) - min(len(open_), rank_max)
    pool = workers if isinstance(workers, Pool) else Pool(planner, workers)
    more: dict[tuple[int, str], Exact] = {}
    try:
        got = pool.map([(j, STEP_ALONE) for j in todo] + list(extra))
        more = dict(zip(extra, got[len(todo):]))
        for r in got[:len(todo)]:
            if r.step_s is not None:
                steps[r.index] = r.step_s
            else:  # no step: it may be faster, so it widens the range
                left += 1
    finally:
        if pool is not workers:
            pool.close()
    faster = sum(1 for j, s in steps.items() if j != i and s is not None and s < step_s)
    return faster + 1, faster + 1 + left, more
