"""The order of the search's top: by predicted step time, with near-ties broken toward the
simpler mesh.

Rule (:func:`tie_order`): repeatedly take the fastest candidate not yet placed; among the
candidates within :data:`TIE` (1%) of its step time, place first the one with the fewest
axes of degree > 1, then the lowest product of the model-parallel degrees
``tp * pp * cp * ep``, then the lowest tp, then the lower planned peak memory, then the
shorter step, then the enumeration index. A 1% difference is below the step-time model's
stated accuracy, while every extra axis and degree is one more process group, collective
stream and way to fail, so an expert running the mesh prefers the simpler one; between two
equally simple meshes (twins that differ in a knob: resharded or kept gathered, recompute,
micro-batch) the one with more headroom, as ``meshplan compare`` prefers the lower peak
within its 2% (a Mixtral twin kept gathered at 58.6 GiB was listed before the same mesh
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

from typing import Mapping, Optional, Sequence

import numpy as np

from meshplan.search.space import Candidates
from meshplan.spec.axes.registry import search_axes

#: Relative step-time difference within which candidates count as tied (1%).
TIE = 0.01

#: One line for the report under the top table.
RULE_LINE = (f"order: by predicted step time; candidates within {TIE:.0%} of the fastest one not yet listed are "
             "ordered toward fewer axes of degree > 1, then a lower tp*pp*cp*ep, then a lower tp, then a lower "
             "peak memory")


def simplicity(c: Candidates, i: int) -> tuple[int, int, int]:
    """(axes of degree > 1, tp * pp * cp * ep, tp) of candidate ``i``: smaller is simpler.

    >>> from meshplan.search.space import Candidates
    >>> import numpy as np
    >>> one = lambda v: np.array([v])
    >>> c = Candidates(pp=one(4), dpr=one(1), dps=one(8), cp=one(1), tp=one(2), ep=one(1), etp=one(1), mb=one(1),
    ...                rc=one(0), vpp=one(1), sh=one(1), rf=one(1), ov=one(0), us=one(0), ps=one(0))
    >>> simplicity(c, 0)
    (3, 8, 2)
    """
    mp = int(c.tp[i]) * int(c.pp[i]) * int(c.cp[i]) * int(c.ep[i])
    axes = sum(int(c.degree(col.column)[i] > 1) for _, col in search_axes())
    return axes, mp, int(c.tp[i])


def tie_order(steps: Sequence[float], keys: Sequence[tuple], rel: float = TIE,
              peaks: Optional[Sequence[float]] = None) -> list[int]:
    """Positions of ``steps`` in the order of the module docstring's rule; ``keys[j]``: the
    simplicity key of position j (smaller first among the tied); ``peaks[j]``: its planned
    peak memory, bytes (lower first after the keys; inf: not planned, which would put it behind a
    planned twin for lack of a number: the search plans every twin that ties a listed candidate
    before it lists the top, :func:`meshplan.search.driver._complete_top`)."""
    mem = peaks if peaks is not None else [0.0] * len(steps)
    left = sorted(range(len(steps)), key=lambda j: (steps[j], j))
    out: list[int] = []
    while left:
        cut = steps[left[0]] * (1 + rel)
        window = [j for j in left if steps[j] <= cut]
        pick = min(window, key=lambda j: (keys[j], mem[j], steps[j], j))
        out.append(pick)
        left.remove(pick)
    return out


def ranked(c: Candidates, steps: dict[int, float], top: int, rel: float = TIE,
           peaks: Optional[Mapping[int, float]] = None) -> list[int]:
    """Candidate indices of the ``top`` first by the rule, from ``steps`` (index -> exact
    step time, seconds) of feasible candidates and ``peaks`` (index -> planned peak memory,
    bytes; a candidate without one counts as inf: the search plans the memory of every
    candidate that ties a listed one on the keys, :func:`meshplan.search.driver._complete_top`)."""
    idx = sorted(steps)
    mem = [float((peaks or {}).get(i, float("inf"))) for i in idx]
    order = tie_order([steps[i] for i in idx], [simplicity(c, i) for i in idx], rel, mem)
    return [idx[j] for j in order[:top]]


def needed(steps: np.ndarray, top: int, rel: float = TIE) -> float:
    """Step time (seconds) up to which every candidate must be known exactly to fix the
    first ``top`` of the rule: ``(1 + rel)`` x the ``top``-th smallest of ``steps``."""
    return float(np.sort(steps)[top - 1]) * (1 + rel) if len(steps) >= top else float("inf")
