"""The order of the search's top: by predicted step time, with near-ties broken toward the
simpler mesh and the fewer, cheaper settings; one row per distinct mesh.

Rule (:func:`tie_order`): repeatedly take the fastest candidate not yet placed; among the
candidates within :data:`TIE` (1%) of its step time, place first the one with the fewest
axes of degree > 1, then the lowest product of the model-parallel degrees
``tp * pp * cp * ep``, then the lowest tp, then the fewest and cheapest settings off their
default (:func:`~meshplan.search.tie_key.knob_key`: fewer of them, then no recompute before selective, op, layer, block, full; no tp
overlap before overlap; vpp 1 before more; ``reshard_after_forward`` at the mesh's default before
off it (:meth:`~meshplan.spec.training.TrainingSpec.reshard_default`: resharded, kept gathered under
torch's FSDP2 with pp > 1; no setting without FSDP over a data axis:
:class:`~meshplan.search.reshard_key.ReshardKey`); the even layer split before the short end stages; 1F1B before a V-shaped schedule),
then the lower planned peak memory where the peaks differ by more than :data:`MEMORY_TIE` (1%)
of the lower one, then the shorter step, then the enumeration index. :func:`decide` is the same
rule for a pair (``meshplan compare`` decides with it, on each plan's :func:`~meshplan.search.tie_key.tie_key`) and names the
criterion that decided, with both values (``lower peak memory (26.3 vs 58.6 GiB)``), or says that
none does (:data:`EQUAL`: equal steps and keys, peaks within 1%; the search then lists them in
enumeration order, compare chooses neither). A 1% step difference (the tie threshold,
:data:`meshplan.spec.accuracy.TIE`, a judgement) is below the smallest measured error of the step
model (its mean |error| on the development set, far more elsewhere: both in
:data:`~meshplan.spec.accuracy.FIDELITY`), while every extra axis and degree is one more process
group, collective stream and way to fail, and every setting off its default one more thing to configure and get
wrong for a gain the model cannot resolve, so an expert running the mesh prefers the simpler
one (the Megatron GPT-3 175B search listed ``selective, tp overlap`` 0.6% slower above ``none``
for 21 MB less peak); between two equally simple candidates the one with clearly more headroom
(a Mixtral twin kept gathered at 58.6 GiB was listed before the same mesh resharded at 26.3 GiB,
0.085% slower).

The top table lists distinct meshes (:func:`mesh_of`: the degree of every searched axis):
each mesh's row is the first of its candidates in that order (:func:`distinct`), its other
settings listed apart.

Every pick has a step time within ``1 + TIE`` of the fastest candidate left; while fewer than
``k`` meshes are placed, some mesh among the ``k`` with the shortest best step has none of its
candidates placed, so the fastest left is at most that ``k``-th shortest best step. The first
``top`` meshes are thus decided by the candidates whose step time is at most ``(1 + TIE)``
times the ``top``-th shortest best step of a mesh (:func:`needed`): the search's stopping rule
plans exactly all of those (:func:`meshplan.search.driver.search`).

>>> tie_order([10.0, 10.05, 11.0], [(3, 8, 8), (2, 8, 8), (1, 1, 1)])
[1, 0, 2]
>>> tie_order([10.0, 10.0085], [(2, 8, 8), (2, 8, 8)], peaks=[58.6, 26.3])
[1, 0]
>>> tie_order([10.0, 10.0085], [(2, 8, 8), (2, 8, 8)], peaks=[55.91, 55.89])  # peaks within 1%: the step
[0, 1]
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np

from meshplan.units import GiB

from meshplan.search.columns import Candidates
from meshplan.search.tie_key import KEY_TERMS, knob_words, simplicity
from meshplan.spec.search import TIE, shorter_by
from meshplan.spec.axes.registry import search_axes

#: Peaks within this fraction of the lower one count as equal in the tie rule (1%: 0.6 GiB at
#: 60 GiB). Far below the 15% PyTorch's caching allocator was measured to lose to fragmentation
#: (GMLake, ASPLOS 2024; :data:`meshplan.spec.memory.ALLOCATOR_FRAGMENTATION`), so a smaller
#: difference buys no headroom a run could count on: the 175B search preferred a recompute
#: setting for 21 MB of 55.9 GiB.
MEMORY_TIE = 0.01

#: The tie rule's criteria after the step, in order (the words both :data:`RULE_LINE` and
#: :data:`PAIR_RULE` state; :data:`~meshplan.search.tie_key.KEY_TERMS` names each when it decides a pair).
TOWARD = ("fewer axes of degree > 1, then a lower tp*pp*cp*ep, then a lower tp, then fewer and cheaper settings off "
          "their default (no recompute before selective, op, layer, block, full; no tp overlap; vpp 1; "
          "reshard_after_forward at the mesh's default, resharded, kept gathered under torch's FSDP2 with pp > 1; "
          f"the even layer split; 1F1B), then a lower peak memory (peaks within {MEMORY_TIE:.0%} count as "
          "equal), then the shorter step")

#: One line for the report under the top table.
RULE_LINE = (f"order: by predicted step time; one row per distinct mesh (axis degrees), its first setting by the "
             f"rule; candidates within {TIE:.0%} of the fastest one not yet listed are ordered toward {TOWARD}")

#: The rule as ``meshplan compare`` applies it to two plans: :func:`decide` on each plan's
#: :func:`~meshplan.search.tie_key.tie_key`, the mesh and its settings, as the search orders its candidates.
PAIR_RULE = f"order: by predicted step time; within {TIE:.0%} toward {TOWARD}"


def top_heading(n: int, left_out: bool = True) -> str:
    """The title of the search's top table (text and HTML): what the order is, that each row
    is a distinct mesh, and what the rule guarantees of the meshes left out. Each pick of
    :func:`tie_order` is within ``1 + TIE`` of the fastest candidate not yet placed, and a mesh
    left out had no candidate placed before the last row's, so every row shown is at most
    :data:`TIE` longer than any mesh left out: the fastest mesh may fall out of the top N when
    a tie straddles row N, by less than 1%.

    >>> top_heading(3)  # doctest: +NORMALIZE_WHITESPACE
    'top 3 distinct meshes: by predicted step time; within 1% ordered toward fewer axes, lower degrees and fewer
    settings (none left out is more than 1% faster than a row shown)'

    ``left_out`` False (every feasible mesh is a row): the guarantee is moot and not said.

    >>> top_heading(19, left_out=False)
    'top 19 distinct meshes: by predicted step time; within 1% ordered toward fewer axes, lower degrees and fewer settings'
    """
    head = (f"top {n} distinct meshes: by predicted step time; within {TIE:.0%} ordered toward fewer axes, lower "
            "degrees and fewer settings")
    return f"{head} (none left out is more than {TIE:.0%} faster than a row shown)" if left_out else head


#: What :func:`decide` says of two meshes no criterion of the rule separates (the same step,
#: keys, and peaks within :data:`MEMORY_TIE`: a plan and its own export imported back, spelled otherwise).
EQUAL = "no criterion separates them"


def mesh_of(c: Candidates, i: int) -> tuple[int, ...]:
    """The mesh of candidate ``i`` as the top table tells rows apart: every searched axis's degree."""
    return tuple(int(c.degree(col.column)[i]) for _, col in search_axes())


def _peaks_tied(a: float, b: float) -> bool:
    """Whether two peaks (bytes) are within :data:`MEMORY_TIE` of the lower (two unplanned, inf, are)."""
    lo, hi = min(a, b), max(a, b)
    return hi <= lo * (1 + MEMORY_TIE)


def _pick(window: Sequence[int], steps: Sequence[float], keys: Sequence[tuple], mem: Sequence[float]) -> int:
    """The candidate of ``window`` placed first: the smallest key; among those, the peaks
    within :data:`MEMORY_TIE` of the lowest; among those the shortest step, then the index."""
    best = min(keys[j] for j in window)
    same = [j for j in window if keys[j] == best]
    low = min(mem[j] for j in same)
    return min((j for j in same if _peaks_tied(mem[j], low)), key=lambda j: (steps[j], j))


def _gib_pair(a: float, b: float) -> str:
    """Two byte counts in GiB with the digits that tell them apart (1 to 3 decimals).

    >>> _gib_pair(26.3 * GiB, 58.6 * GiB), _gib_pair(55.91 * GiB, 55.89 * GiB)
    ('26.3 vs 58.6 GiB', '55.91 vs 55.89 GiB')
    """
    for d in (1, 2, 3):
        x, y = f"{a / GiB:.{d}f}", f"{b / GiB:.{d}f}"
        if x != y:
            break
    return f"{x} vs {y} GiB"


def decide(steps: Sequence[float], keys: Sequence[tuple], peaks: Sequence[float],
           rel: float = TIE) -> tuple[Optional[int], str]:
    """The rule of the module docstring for two candidates: (0 or 1, the one placed first; the
    criterion that decided, with the first's value against the other's), or (None, :data:`EQUAL`)
    when they are equal on every criterion (the search lists them in enumeration order, which
    is no reason to prefer one). ``steps``: seconds; ``keys``:
    :func:`~meshplan.search.tie_key.simplicity` each (compare: :func:`~meshplan.search.tie_key.tie_key`
    of each plan); ``peaks``: planned peak memory, bytes. For a pair the search also lists (no
    third candidate's step moving the window) this is their order.

    >>> decide([10.0, 10.5], [(2, 8, 8), (3, 8, 8)], [60 * GiB, 50 * GiB])
    (0, 'shorter step by more than 1% (10.000 s vs 10.500 s, 4.8% shorter)')
    >>> decide([10.0, 10.05], [(3, 8, 8), (2, 8, 8)], [50 * GiB, 60 * GiB])
    (1, 'fewer axes of degree > 1 (2 vs 3)')
    >>> decide([10.0085, 10.0], [(2, 8, 8), (2, 8, 8)], [26.3 * GiB, 58.6 * GiB])
    (0, 'lower peak memory (26.3 vs 58.6 GiB)')
    >>> decide([10.0, 10.05], [(2, 8, 8), (2, 8, 8)], [55.91 * GiB, 55.89 * GiB])
    (0, 'shorter step, peaks within 1% (10.0000 s vs 10.0500 s; 55.91 vs 55.89 GiB)')
    >>> decide([6.17, 6.17], [(2, 2, 2), (2, 2, 2)], [38.1 * GiB, 38.1 * GiB])
    (None, 'no criterion separates them')
    """
    peaks = [p if p == p else float("inf") for p in peaks]  # NaN, a peak not planned: unplanned, as order_all's inf
    fast, slow = (0, 1) if steps[0] <= steps[1] else (1, 0)
    if steps[slow] > steps[fast] * (1 + rel):
        return fast, (f"shorter step by more than {rel:.0%} ({steps[fast]:.3f} s vs {steps[slow]:.3f} s, "
                      f"{shorter_by(steps[fast], steps[slow]):.1%} shorter)")
    first = _pick((0, 1), steps, keys, peaks)
    other = 1 - first
    for k, ((word, fmt), x, y) in enumerate(zip(KEY_TERMS, keys[first], keys[other])):
        if x != y:
            if k == 3:  # the count: name the settings too
                return first, f"{word} ({x} vs {y}: {knob_words(keys[first])} vs {knob_words(keys[other])})"
            return first, f"{word} ({fmt(x)} vs {fmt(y)})"
    if not _peaks_tied(peaks[first], peaks[other]):
        return first, f"lower peak memory ({_gib_pair(peaks[first], peaks[other])})"
    if steps[first] != steps[other]:
        within = f", peaks within {MEMORY_TIE:.0%}" if peaks[first] != peaks[other] else ""
        mem = f"; {_gib_pair(peaks[first], peaks[other])}" if within else ""
        return first, f"shorter step{within} ({steps[first]:.4f} s vs {steps[other]:.4f} s{mem})"
    return None, EQUAL


def tie_order(steps: Sequence[float], keys: Sequence[tuple], rel: float = TIE,
              peaks: Optional[Sequence[float]] = None) -> list[int]:
    """Positions of ``steps`` in the order of the module docstring's rule; ``keys[j]``: the
    tie key of position j (smaller first among the tied); ``peaks[j]``: its planned
    peak memory, bytes (lower first after the keys, where more than :data:`MEMORY_TIE` lower; inf:
    not planned, which would put it behind a planned twin for lack of a number: the search plans
    every twin that ties a placed candidate before it lists the top,
    :func:`meshplan.search.best_first._complete_top`)."""
    mem = peaks if peaks is not None else [0.0] * len(steps)
    left = sorted(range(len(steps)), key=lambda j: (steps[j], j))
    out: list[int] = []
    while left:
        cut = steps[left[0]] * (1 + rel)
        window = [j for j in left if steps[j] <= cut]
        pick = _pick(window, steps, keys, mem)
        out.append(pick)
        left.remove(pick)
    return out


def distinct(c: Candidates, order: Sequence[int]) -> list[int]:
    """The first candidate of each mesh (:func:`mesh_of`) in ``order``: the top table's rows."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for i in order:
        m = mesh_of(c, i)
        if m not in seen:
            seen.add(m)
            out.append(i)
    return out


def order_all(c: Candidates, steps: Mapping[int, float], rel: float = TIE,
              peaks: Optional[Mapping[int, float]] = None) -> list[int]:
    """Candidate indices of ``steps`` (index -> exact step time, seconds, of feasible candidates)
    in the rule's order, ``peaks`` (index -> planned peak memory, bytes; a candidate without one
    counts as inf: the search plans the memory of every candidate that ties a placed one on the
    keys, :func:`meshplan.search.best_first._complete_top`)."""
    idx = sorted(steps)
    mem = [float((peaks or {}).get(i, float("inf"))) for i in idx]
    order = tie_order([steps[i] for i in idx], [simplicity(c, i) for i in idx], rel, mem)
    return [idx[j] for j in order]


def ranked(c: Candidates, steps: Mapping[int, float], top: int, rel: float = TIE,
           peaks: Optional[Mapping[int, float]] = None) -> list[int]:
    """The rows of the top table: the first candidate of each of the ``top`` first distinct
    meshes of :func:`order_all`."""
    return distinct(c, order_all(c, steps, rel, peaks))[:top]


def variants(c: Candidates, order: Sequence[int], steps: Mapping[int, float], row: int,
             most: int = 3, rel: float = TIE) -> list[int]:
    """The other candidates of row ``row``'s mesh in ``order`` (:func:`order_all`) whose step is
    within ``rel`` of the fastest known (so all planned exactly, :func:`needed`), at most ``most``."""
    fastest = min(steps.values())
    mesh = mesh_of(c, row)
    return [i for i in order if i != row and mesh_of(c, i) == mesh and steps[i] <= fastest * (1 + rel)][:most]


def variant_label(k: int) -> str:
    """The label of row 1's ``k``-th other setting (from 0, :func:`variants`' order), as the line
    under the top table prints it and ``search --export`` takes it: row 1, then a letter.

    >>> [variant_label(k) for k in range(3)]
    ['1a', '1b', '1c']
    """
    return f"1{chr(ord('a') + k)}"


def best_of_meshes(c: Candidates, steps: Mapping[int, float]) -> np.ndarray:
    """The shortest step (seconds) of each mesh among ``steps`` (index -> seconds)."""
    best: dict[tuple[int, ...], float] = {}
    for i, s in steps.items():
        m = mesh_of(c, i)
        best[m] = min(best.get(m, s), s)
    return np.fromiter(best.values(), float, len(best))


def needed(steps: np.ndarray, top: int, rel: float = TIE) -> float:
    """Step time (seconds) up to which every candidate must be known exactly to fix the
    first ``top`` meshes of the rule: ``(1 + rel)`` x the ``top``-th smallest of ``steps``, the
    shortest step of each mesh known (:func:`best_of_meshes`)."""
    return float(np.sort(steps)[top - 1]) * (1 + rel) if len(steps) >= top else float("inf")
