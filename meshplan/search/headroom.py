"""The search's headroom tiers: which rows keep too little memory free to run as planned
(:func:`tight`) and the order that lists the rows clear of that first (:func:`tiered`).

A row is tight where its planned peak leaves under
:data:`~meshplan.spec.memory.ALLOCATOR_FRAGMENTATION` (15%, the one home of that threshold) of the
usable memory free while ``[memory] fragmentation_fraction``, the allowance the plan itself
reserves, is below it: PyTorch's caching allocator was measured to lose about that much to
fragmentation in LLM training (GMLake, ASPLOS 2024), so such a row fits only if the allocator
fragments less than it was measured to. Two newcomer trials found ``search`` ranking first a row at
0.5% free and ``search --export 1`` writing it; an expert would not run it.

By default (``[search] headroom_tier = true``) the top table lists its rows in two tiers: the rows
clear of that first, in the tie rule's order (:mod:`meshplan.search.rank`), then the tight ones,
in the same order, marked. The rows themselves (the top N distinct meshes by step time) are the
same as without tiers, so the rule's guarantee on the meshes left out still holds; only their
order changes. ``headroom_tier = false`` (``search --rank-tight``) keeps the order by step alone.

Within one mesh the tiers choose too (:func:`clear_rows`; newcomer trial 23: a single-mesh DeepSpeed
search showed its one row at no recompute, 3.3% free, while the same mesh with full recompute kept
50 GiB free): a row whose first setting by the rule is tight is shown at the first setting of its
mesh, in the rule's order, that keeps the headroom, where the search planned one; the tight setting
is named after it (``SearchResult.safer``). The search plans such a mesh's other settings
for this (:data:`CLEAR_MAX`, :func:`meshplan.search.best_first.best_first`).

>>> usable = 72e9  # 80 GB of HBM less a 10% reserve
>>> tight(62.8 * 2**30, usable, 0.0), tight(28.3 * 2**30, usable, 0.0), tight(62.8 * 2**30, usable, 0.15)
(True, False, False)
>>> tiered([11, 4, 9], [True, False, False])  # rows in the rule's order, the first one tight
[4, 9, 11]
>>> clear_rows([11, 4], [11, 4, 7, 12], {11: "A", 4: "B", 7: "A", 12: "B"}.get,
...            {11: True, 4: False, 7: False}.get)
([4, 7], [(7, 11)])
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from meshplan.spec.memory import ALLOCATOR_FRAGMENTATION


def tight(peak_bytes, usable_bytes: float, fragmentation_fraction: float):
    """Whether a planned peak (bytes; a float or a numpy array of them) leaves under
    :data:`ALLOCATOR_FRAGMENTATION` of ``usable_bytes`` free while the plan's own allowance
    ``fragmentation_fraction`` is below it: ``usable - peak < 0.15 x usable``, i.e. a peak above
    0.85 x usable (61.2e9 B = 57.0 GiB of H100's 72e9 B usable at a 10% reserve). A bool, or an array of them."""
    frac = ALLOCATOR_FRAGMENTATION
    under = (usable_bytes - np.asarray(peak_bytes, dtype=float) < frac * usable_bytes) & (fragmentation_fraction < frac)
    return under if np.ndim(peak_bytes) else bool(under)


def tiered(rows: Sequence[int], is_tight: Sequence[bool]) -> list[int]:
    """``rows`` (candidate indices in the tie rule's order) with the clear ones first and the
    tight ones (``is_tight``, per row) after, each tier in its given order: one sort on two
    columns, the tier then the rule's position (a stable partition)."""
    order = np.lexsort((np.arange(len(rows)), np.asarray(is_tight, dtype=bool)))
    return [rows[int(k)] for k in order]


#: Settings of one tight row's mesh the search plans at most, in the order of their step-time
#: bound, looking for its fastest setting that keeps the headroom (:func:`clear_rows`). A cost
#: cap, not a model constant: a mesh has at most a few dozen settings (micro-batch x recompute x
#: sharding x reshard), and past the first 16 by bound none is likely to be a row worth showing.
CLEAR_MAX = 16


def clear_rows(rows: Sequence[int], order: Sequence[int], mesh: Callable[[int], object],
               is_tight: Callable[[int], Optional[bool]]) -> tuple[list[int], list[tuple[int, int]]]:
    """(``rows`` with each tight row replaced by the first candidate of its mesh in ``order`` that
    is known clear, the rows then in ``order``'s order; the (shown, tight) pairs replaced).
    ``rows``: the first candidate of each mesh in ``order`` (the rule's order of every planned
    candidate); ``mesh(i)``: candidate i's mesh; ``is_tight(i)``: True (tight), False (clear) or
    None (memory not planned: neither). A mesh with no clear candidate keeps its tight row.
    In the module's doctest, rows 11 (mesh A, tight) and 4 (mesh B): A's first clear setting is 7,
    listed after 4 since the rule placed it after 4."""
    pos = {i: k for k, i in enumerate(order)}
    out, pairs = [], []
    for r in rows:
        if is_tight(r):
            clear = next((i for i in order if mesh(i) == mesh(r) and is_tight(i) is False), None)
            if clear is not None:
                pairs.append((clear, r))
                r = clear
        out.append(r)
    return sorted(out, key=lambda i: pos[i]), pairs


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
