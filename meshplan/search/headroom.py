"""The search's headroom tiers: the order that lists the meshes that keep enough memory free to run
as planned first (:func:`tier_order`; :func:`tiered` for rows already in the rule's order).

A row is tight (:func:`meshplan.memory.headroom.tight`, the rule's one home, which compare and
plan's fix lines use too) where its planned peak leaves under
:data:`~meshplan.spec.memory.ALLOCATOR_FRAGMENTATION` (15%, the one home of that threshold) of the
usable memory free while ``[memory] fragmentation_fraction``, the allowance the plan itself
reserves, is below it: PyTorch's caching allocator was measured to lose about that much to
fragmentation in LLM training (GMLake, ASPLOS 2024), so such a row fits only if the allocator
fragments less than it was measured to. Two newcomer trials found ``search`` ranking first a row at
0.5% free and ``search --export 1`` writing it; an expert would not run it.

By default (``[search] headroom_tier = true``) the ranking is in two tiers, and the tiers come
before the tie rule (:mod:`meshplan.search.rank`) and the cut to the top N rows (:func:`tier_order`):
a mesh with a clear candidate is a clear row, at its first clear candidate by the rule applied to
the clear candidates alone (their 1% tie windows hold no tight candidate); the meshes with none
follow, by the rule applied to their candidates alone. The ranking is thus one list whatever N, and
row 1 (``search --export 1``) is the same at ``--top 3`` as at ``--top 10`` (newcomer trial 24: the
tiers once ordered only the N rows the step order kept, so ``--top 3`` listed first a tight mesh
that ``--top 10`` put after a clear one). The rule's guarantee on the meshes left out holds within
each tier: a tight mesh faster than the clear rows may be left out, and the table's title says so.
Within one mesh this shows a mesh whose fastest setting is tight at its fastest clear setting
(newcomer trial 23: a single-mesh DeepSpeed search showed its one row at no recompute, 3.3% free,
while the same mesh with full recompute kept 50 GiB free); the tight setting is named after it
(``SearchResult.safer``). The search (:func:`meshplan.search.best_first.best_first`) plans every
candidate that could be clear up to the tie band of the N-th clear mesh, so its top is this
ranking's (``tests/test_search.py``'s exhaustive oracle). ``headroom_tier = false`` (``search
--rank-tight``) keeps the rule's order over every candidate.

>>> tiered([11, 4, 9], [True, False, False])  # rows in the rule's order, the first one tight
[4, 9, 11]
>>> steps = {0: 1.0, 1: 1.005, 2: 1.2, 3: 1.1}  # candidate -> step (s); 0 and 2 of mesh A, 1 of B, 3 of C
>>> tier_order(steps, {0: True, 1: False, 2: False, 3: True}.get, "ABAC".__getitem__,
...            lambda part: sorted(part, key=part.get))  # 0 and 3 tight: A shown at 2, after B; C last
[1, 2, 3]
"""

from __future__ import annotations

from typing import Callable, Hashable, Mapping, Optional, Sequence

import numpy as np

from meshplan.spec.memory import ALLOCATOR_FRAGMENTATION


def tiered(rows: Sequence[int], is_tight: Sequence[bool]) -> list[int]:
    """``rows`` (candidate indices in the tie rule's order) with the clear ones first and the
    tight ones (``is_tight``, per row) after, each tier in its given order: one sort on two
    columns, the tier then the rule's position (a stable partition)."""
    order = np.lexsort((np.arange(len(rows)), np.asarray(is_tight, dtype=bool)))
    return [rows[int(k)] for k in order]


def tier_order(steps: Mapping[int, float], is_tight: Callable[[int], Optional[bool]], mesh: Callable[[int], Hashable],
               order: Callable[[Mapping[int, float]], list[int]]) -> list[int]:
    """The candidates of ``steps`` (index -> step time, seconds) in the tiers' order, whose first
    candidate of each mesh gives the rows (:func:`meshplan.search.rank.distinct`): ``order`` (the
    tie rule, :func:`meshplan.search.rank.order_all` with the planned peaks) over the clear
    candidates alone (``is_tight(i)`` false), then over the candidates of the meshes (``mesh(i)``)
    with no clear candidate. ``order`` sees each tier apart, so no tight candidate moves a clear
    one's 1% tie window, and the first k rows depend only on the candidates of their tier within
    1% of its k-th mesh (:func:`~meshplan.search.rank.needed`), as the search's stopping rule plans them."""
    clear = {i: s for i, s in steps.items() if not is_tight(i)}
    have = {mesh(i) for i in clear}
    return order(clear) + order({i: s for i, s in steps.items() if mesh(i) not in have})


#: How to rank by step alone, as the tier line names it.
OPT_OUT = "search --rank-tight (or [search] headroom_tier = false)"


def tier_line(n_tight: int, n_rows: int, on: bool) -> str:
    """The one line under the top table where a row shown is tight (``n_tight`` of ``n_rows``):
    with the tiers ``on``, that those rows are listed after the clear ones, marked, and how to
    rank by step alone; off, that the order is the step's alone and which rows are marked.

    >>> print(tier_line(1, 2, True))  # doctest: +NORMALIZE_WHITESPACE
    headroom tiers: 1 of 2 rows keeps under 15% of the usable memory free (marked "tight" in the peak
    column) and is listed after the 1 that keeps it, each tier by the order rule; search --rank-tight
    (or [search] headroom_tier = false) ranks by step time alone
    >>> print(tier_line(2, 2, True))  # doctest: +NORMALIZE_WHITESPACE
    headroom tiers: 2 of 2 rows keep under 15% of the usable memory free (marked "tight" in the peak
    column): no row shown keeps it, so the order is the rule's; search --rank-tight (or [search]
    headroom_tier = false) ranks by step time alone
    >>> print(tier_line(1, 3, False))  # doctest: +NORMALIZE_WHITESPACE
    headroom tiers off ([search] headroom_tier = false, or search --rank-tight): by step time alone;
    1 of 3 rows keeps under 15% of the usable memory free (marked "tight" in the peak column)
    """
    frac = f"{ALLOCATOR_FRAGMENTATION:.0%}"
    which = (f"{n_tight} of {n_rows} rows {'keeps' if n_tight == 1 else 'keep'} under {frac} of the usable memory "
             f"free (marked \"tight\" in the peak column)")
    if not on:
        return f"headroom tiers off ([search] headroom_tier = false, or search --rank-tight): by step time alone; {which}"
    clear = n_rows - n_tight
    if not clear:
        return f"headroom tiers: {which}: no row shown keeps it, so the order is the rule's; {OPT_OUT} ranks by step time alone"
    return (f"headroom tiers: {which} and {'is' if n_tight == 1 else 'are'} listed after the {clear} that "
            f"{'keeps' if clear == 1 else 'keep'} it, each tier by the order rule; {OPT_OUT} ranks by step time alone")
