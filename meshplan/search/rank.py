"""The order of the search's top: by predicted step time, with near-ties broken toward the
simpler mesh.

Rule (:func:`tie_order`): repeatedly take the fastest candidate not yet placed; among the
candidates within :data:`TIE` (1%) of its step time, place first the one with the fewest
axes of degree > 1, then the lowest product of the model-parallel degrees
``tp * pp * cp * ep``, then the lowest tp, then the lower planned peak memory, then the
shorter step, then the enumeration index. :func:`decide` is the same rule for a pair
(``meshplan compare`` decides with it) and names the criterion that decided, with both
values (``lower peak memory (26.3 vs 58.6 GiB)``), or says that none does (:data:`EQUAL`: equal
steps, keys and peaks; the search then lists them in enumeration order, compare chooses neither). A 1% difference is below the step-time model's
stated accuracy, while every extra axis and degree is one more process group, collective
stream and way to fail, so an expert running the mesh prefers the simpler one; between two
equally simple meshes (twins that differ in a knob: resharded or kept gathered, recompute,
micro-batch) the one with more headroom (a Mixtral twin kept gathered at 58.6 GiB was listed before the same mesh
resharded at 26.3 GiB, 0.085% slower).

Every pick has a step time within ``1 + TIE`` of the ``k``-th smallest, so the first ``top``
picks are decided by the candidates whose step time is at most ``(1 + TIE)`` times the
``top``-th smallest: the search's stopping rule plans exactly all of those
(:func:`meshplan.search.driver.search`).

>>> tie_order([10.0, 10.05, 11.0], [(3, 8, 8), (2, 8, 8), (1, 1, 1)])
[1, 0, 2]
>>> tie_order([10.0, 10.0085], [(2, 8, 8), (2, 8, 8)], peaks=[58.6, 26.3])
[1, 0]
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from meshplan.units import GiB

from meshplan.search.columns import Candidates
from meshplan.spec.search import TIE
from meshplan.spec.axes.registry import search_axes


#: One line for the report under the top table.
RULE_LINE = (f"order: by predicted step time; candidates within {TIE:.0%} of the fastest one not yet listed are "
             "ordered toward fewer axes of degree > 1, then a lower tp*pp*cp*ep, then a lower tp, then a lower "
             "peak memory")



def top_heading(n: int, left_out: bool = True) -> str:
    """The title of the search's top table (text and HTML): what the order is, and what the
    rule guarantees of the meshes left out. Each pick of :func:`tie_order` is within ``1 + TIE``
    of the fastest candidate not yet placed, and a candidate left out was not placed at any
    pick, so every row shown is at most :data:`TIE` longer than any mesh left out: the fastest
    mesh may fall out of the top N when a tie straddles row N, by less than 1%.

    >>> top_heading(3)  # doctest: +NORMALIZE_WHITESPACE
    'top 3: by predicted step time; meshes within 1% ordered toward fewer axes and lower degrees (none left
    out is more than 1% faster than a row shown)'

    ``left_out`` False (every feasible candidate is a row): the guarantee is moot and not said.

    >>> top_heading(19, left_out=False)
    'top 19: by predicted step time; meshes within 1% ordered toward fewer axes and lower degrees'
    """
    head = f"top {n}: by predicted step time; meshes within {TIE:.0%} ordered toward fewer axes and lower degrees"
    return f"{head} (none left out is more than {TIE:.0%} faster than a row shown)" if left_out else head


#: What each position of a simplicity key (:func:`simplicity_of`) is called in the criterion
#: that decided a pair (:func:`decide`), the words of :data:`RULE_LINE`.
KEY_WORDS = ("fewer axes of degree > 1", "lower tp*pp*cp*ep", "lower tp")

#: What :func:`decide` says of two meshes no criterion of the rule separates (the same step,
#: simplicity key and peak memory: a plan and its own export imported back, spelled otherwise).
EQUAL = "no criterion separates them"


def simplicity_of(degree: Callable[[str], int]) -> tuple[int, int, int]:
    """(axes of degree > 1, tp * pp * cp * ep, tp) of one mesh, ``degree(column)`` giving the
    degree of each searched axis by its search column (``pp``, ``dpr``, ``dps``, ``cp``, ``tp``,
    ``ep``, ``etp``); smaller is simpler. :func:`simplicity` reads a search candidate,
    :func:`meshplan.compare.sides.side_of` a plan's mesh.

    >>> deg = {"pp": 4, "dps": 8, "tp": 2}
    >>> simplicity_of(lambda col: deg.get(col, 1))
    (3, 8, 2)
    """
    axes = sum(int(degree(col.column) > 1) for _, col in search_axes())
    mp = degree("tp") * degree("pp") * degree("cp") * degree("ep")
    return axes, mp, degree("tp")


def simplicity(c: Candidates, i: int) -> tuple[int, int, int]:
    """(axes of degree > 1, tp * pp * cp * ep, tp) of candidate ``i``: smaller is simpler.

    >>> from meshplan.search.columns import Candidates
    >>> import numpy as np
    >>> one = lambda v: np.array([v])
    >>> c = Candidates(pp=one(4), dpr=one(1), dps=one(8), cp=one(1), tp=one(2), ep=one(1), etp=one(1), mb=one(1),
    ...                rc=one(0), vpp=one(1), sh=one(1), rf=one(1), ov=one(0), us=one(0), ps=one(0))
    >>> simplicity(c, 0)
    (3, 8, 2)
    """
    return simplicity_of(lambda col: int(c.degree(col)[i]))


def _order_key(steps: Sequence[float], keys: Sequence[tuple], mem: Sequence[float], j: int) -> tuple:
    """What places ``j`` first among the tied: its simplicity key, peak memory, step, index."""
    return keys[j], mem[j], steps[j], j


def decide(steps: Sequence[float], keys: Sequence[tuple], peaks: Sequence[float],
           rel: float = TIE) -> tuple[Optional[int], str]:
    """The rule of the module docstring for two meshes: (0 or 1, the one placed first; the
    criterion that decided, with the first's value against the other's), or (None, :data:`EQUAL`)
    when they are equal on every criterion (the search lists them in enumeration order, which
    is no reason to prefer one). ``steps``: seconds;
    ``keys``: :func:`simplicity_of` each; ``peaks``: planned peak memory, bytes. For a pair the
    search also lists (no third candidate's step moving the window) this is their order in the
    search's top.

    >>> decide([10.0, 10.5], [(2, 8, 8), (3, 8, 8)], [60 * GiB, 50 * GiB])
    (0, 'shorter step by more than 1% (10.000 s vs 10.500 s, 4.8% shorter)')
    >>> decide([10.0, 10.05], [(3, 8, 8), (2, 8, 8)], [50 * GiB, 60 * GiB])
    (1, 'fewer axes of degree > 1 (2 vs 3)')
    >>> decide([10.0085, 10.0], [(2, 8, 8), (2, 8, 8)], [26.3 * GiB, 58.6 * GiB])
    (0, 'lower peak memory (26.3 vs 58.6 GiB)')
    >>> decide([6.17, 6.17], [(2, 2, 2), (2, 2, 2)], [38.1 * GiB, 38.1 * GiB])
    (None, 'no criterion separates them')
    """
    fast, slow = (0, 1) if steps[0] <= steps[1] else (1, 0)
    if steps[slow] > steps[fast] * (1 + rel):
        return fast, (f"shorter step by more than {rel:.0%} ({steps[fast]:.3f} s vs {steps[slow]:.3f} s, "
                      f"{1 - steps[fast] / steps[slow]:.1%} shorter)")
    first = min((0, 1), key=lambda j: _order_key(steps, keys, peaks, j))
    other = 1 - first
    for word, x, y in zip(KEY_WORDS, keys[first], keys[other]):
        if x != y:
            return first, f"{word} ({x} vs {y})"
    if peaks[first] != peaks[other]:
        return first, f"lower peak memory ({peaks[first] / GiB:.1f} vs {peaks[other] / GiB:.1f} GiB)"
    if steps[first] != steps[other]:
        return first, f"shorter step ({steps[first]:.4f} s vs {steps[other]:.4f} s)"
    return None, EQUAL


def tie_order(steps: Sequence[float], keys: Sequence[tuple], rel: float = TIE,
              peaks: Optional[Sequence[float]] = None) -> list[int]:
    """Positions of ``steps`` in the order of the module docstring's rule; ``keys[j]``: the
    simplicity key of position j (smaller first among the tied); ``peaks[j]``: its planned
    peak memory, bytes (lower first after the keys; inf: not planned, which would put it behind a
    planned twin for lack of a number: the search plans every twin that ties a listed candidate
    before it lists the top, :func:`meshplan.search.best_first._complete_top`)."""
    mem = peaks if peaks is not None else [0.0] * len(steps)
    left = sorted(range(len(steps)), key=lambda j: (steps[j], j))
    out: list[int] = []
    while left:
        cut = steps[left[0]] * (1 + rel)
        window = [j for j in left if steps[j] <= cut]
        pick = min(window, key=lambda j: _order_key(steps, keys, mem, j))
        out.append(pick)
        left.remove(pick)
    return out


def ranked(c: Candidates, steps: dict[int, float], top: int, rel: float = TIE,
           peaks: Optional[Mapping[int, float]] = None) -> list[int]:
    """Candidate indices of the ``top`` first by the rule, from ``steps`` (index -> exact
    step time, seconds) of feasible candidates and ``peaks`` (index -> planned peak memory,
    bytes; a candidate without one counts as inf: the search plans the memory of every
    candidate that ties a listed one on the keys, :func:`meshplan.search.best_first._complete_top`)."""
    idx = sorted(steps)
    mem = [float((peaks or {}).get(i, float("inf"))) for i in idx]
    order = tie_order([steps[i] for i in idx], [simplicity(c, i) for i in idx], rel, mem)
    return [idx[j] for j in order[:top]]


def needed(steps: np.ndarray, top: int, rel: float = TIE) -> float:
    """Step time (seconds) up to which every candidate must be known exactly to fix the
    first ``top`` of the rule: ``(1 + rel)`` x the ``top``-th smallest of ``steps``."""
    return float(np.sort(steps)[top - 1]) * (1 + rel) if len(steps) >= top else float("inf")
