"""The config's mesh at its fastest searched setting (newcomer trial 26 #1): ``meshplan search`` of
a Qwen3-235B-like model on 32 x 8 H200 printed ``your mesh (dp_shard 256 x ep 8): 18.951 s ...
173.31% longer than the top's``, the config's micro-batch 1, while the same mesh at the search's
micro-batch 4 was 7.668 s, 10.6% behind the top: the gap was the settings, not the mesh.

:func:`fastest_setting` picks that mesh's candidate as the top table would: its row there where it
has one (the tie rule and the headroom tiers already applied, :mod:`meshplan.search.rank`,
:mod:`meshplan.search.headroom`), else the first by the same rule among the mesh's feasible
candidates the search planned, the clear ones (peak at most 85% of usable memory,
:func:`~meshplan.memory.headroom.tight`) before the tight where ``[search] headroom_tier`` is on,
after one more plan: the mesh's unplanned feasible candidate with the lowest step-time lower bound,
where that bound is within the rule's 1% (:data:`~meshplan.spec.search.TIE`) of the best step known.
:func:`setting_words` names what it runs otherwise than the config (``mb 4, full``).
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from meshplan.config import Config
from meshplan.search.columns import Candidates
from meshplan.search.exact import SIMULATE, Exact
from meshplan.search.explain import relative
from meshplan.memory.headroom import tight
from meshplan.search.headroom import tier_order
from meshplan.search.rank import mesh_of, order_all
from meshplan.search.reasons import OK
from meshplan.spec.axes.registry import search_axes
from meshplan.spec.search import TIE
from meshplan.memory.constraints import usable_bytes

#: What the step is set against.
THE_TOPS = "the top's"


def same_mesh(c: Candidates, i: int) -> np.ndarray:
    """Mask over the candidates: those whose every searched axis's degree is candidate ``i``'s
    (:func:`~meshplan.search.rank.mesh_of` as one vectorised comparison)."""
    mask = np.ones(len(c), bool)
    for _, col in search_axes():
        d = c.degree(col.column)
        mask &= d == d[i]
    return mask


def fastest_setting(cfg: Config, c: Candidates, code: np.ndarray, step_lo: np.ndarray, exact: dict[int, Exact],
                    top: list[Exact], i: int, mine: Exact,
                    planner: Callable[[tuple[int, str]], Exact]) -> Optional[Exact]:
    """Candidate ``i``'s mesh at its fastest searched setting (module docstring): ``mine`` is ``i``
    planned, ``step_lo`` the step-time lower bounds (seconds), ``top`` the search's rows. None where
    nothing of the mesh has a step. ``planner``: the search's :class:`~meshplan.search.exact.Planner`, or
    any callable that gives the same :class:`~meshplan.search.exact.Exact` of a job (the plan
    :func:`setting_plan` names, made beside the rank's on the search's pool: ``configured``)."""
    row = next((t for t in top if mesh_of(c, t.index) == mesh_of(c, i)), None)
    if row is not None:
        return row
    known, best, j = _known(cfg, c, code, step_lo, exact, i, mine)
    if j is not None:
        e = planner((j, SIMULATE))
        if e.feasible and e.step_s is not None:
            best = _first(cfg, c, known | {j: e})
    return best


def setting_plan(cfg: Config, c: Candidates, code: np.ndarray, step_lo: np.ndarray, exact: dict[int, Exact],
                 top: list[Exact], i: int, mine: Exact) -> Optional[int]:
    """The candidate :func:`fastest_setting` of the same arguments plans (``SIMULATE``), or None where
    it plans none: known before any plan, so the plan can run beside the rank's
    (:func:`meshplan.search.configured._rank`) on the search's pool instead of after them."""
    if any(mesh_of(c, t.index) == mesh_of(c, i) for t in top):
        return None
    return _known(cfg, c, code, step_lo, exact, i, mine)[2]


def _known(cfg: Config, c: Candidates, code: np.ndarray, step_lo: np.ndarray, exact: dict[int, Exact], i: int,
           mine: Exact) -> tuple[dict[int, Exact], Optional[Exact], Optional[int]]:
    """(candidate ``i``'s mesh's feasible candidates with a step, ``mine`` as ``i``; the first of them
    by the rule, :func:`_first`; the one more plan: the mesh's unplanned feasible candidate of lowest
    step-time bound, then index, where that bound is within the rule's 1% of the best step known, else None)."""
    ok = np.flatnonzero(same_mesh(c, i) & (code == OK)).tolist()
    known = {j: exact[j] for j in ok if j in exact and exact[j].step_s is not None} | {i: mine}
    best = _first(cfg, c, known)
    rest = [j for j in ok if j not in known]
    if not rest:
        return known, best, None
    j = min(rest, key=lambda k: (step_lo[k], k))  # it could beat the best known
    return known, best, j if best is None or step_lo[j] < (best.step_s or np.inf) * (1 + TIE) else None


def _first(cfg: Config, c: Candidates, known: dict[int, Exact]) -> Optional[Exact]:
    """The first of ``known`` (index -> planned candidate) by the tie rule, the clear tier first
    where ``[search] headroom_tier`` is on (a peak not planned counts as clear)."""
    steps = {j: float(e.step_s) for j, e in known.items() if e.step_s is not None}
    if not steps:
        return None
    peaks = {j: known[j].peak_bytes for j in steps if known[j].complete}
    usable, frac = usable_bytes(cfg.cluster, cfg.training), cfg.memory.fragmentation_fraction
    if cfg.search.headroom_tier:
        order = tier_order(steps, lambda j: j in peaks and bool(tight(peaks[j], usable, frac)),
                           lambda j: mesh_of(c, j), lambda part: order_all(c, part, peaks=peaks))
    else:
        order = order_all(c, steps, peaks=peaks)
    return known[order[0]]


def setting_words(c: Candidates, mine: int, other: int) -> str:
    """The settings candidate ``other`` runs that ``mine`` (same mesh) does not, as the label names
    them (``mb 4, full``; all of ``other``'s where the labels differ only in what ``mine`` has).

    The label's parts are split at the commas outside parentheses (an expert mesh
    ``ep 16 (efsdp 4, etp 1)`` is one part), the first part the mesh."""
    have = set(_parts(c.label(mine))[1:])
    theirs = _parts(c.label(other))[1:]
    return ", ".join([p for p in theirs if p not in have] or theirs)


def _parts(label: str) -> list[str]:
    """``label`` split at ``", "`` outside parentheses.

    >>> _parts("dp_shard 8 x ep 8 (efsdp 1, etp 1), mb 4, full")
    ['dp_shard 8 x ep 8 (efsdp 1, etp 1)', 'mb 4', 'full']
    """
    out, depth, cur = [], 0, ""
    for ch in label:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + [cur.strip()]


def best_words(settings: str, step_s: float, top: list[Exact], index: int) -> str:
    """The clause naming the mesh at its fastest searched setting (candidate ``index``, ``step_s``
    seconds), the first by the top table's rule (within 1% the fewer settings,
    :mod:`meshplan.search.rank`), against the top's (or as the top row itself).

    >>> best_words("mb 4, full", 7.668, [Exact(0, True, (), 0.0, 6.933)], 5)
    "at mb 4, full (its fastest searched setting by the top table's rule): 7.668 s, 10.60% longer than the top's"
    >>> best_words("keep gathered", 7.297, [Exact(5, True, (), 0.0, 7.297)], 5)[-20:]
    '7.297 s, the top row'
    """
    head = f"at {settings} (its fastest searched setting by the top table's rule): {step_s:.3f} s"
    if top[0].index == index:
        return f"{head}, the top row"
    return f"{head}, {relative(step_s / top[0].step_s - 1, THE_TOPS)}" if top[0].step_s else head
