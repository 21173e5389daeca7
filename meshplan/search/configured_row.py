"""The row of the search's top table that a mesh no candidate runs would take
(:func:`meshplan.search.configured._as_given`: planned as the config gives it, e.g. torchtitan's own
uneven layer split with virtual stages): :func:`table_row`. Newcomer trial 24 (#2): for such a plan,
whose step and peak were known, the line said only ``would rank between #66 and #4,341 of 8,822``.

The row follows the table's headroom tiers (:mod:`meshplan.search.headroom`: the clear meshes
first, the whole ranking tiered before the cut): a clear plan goes among the clear rows, a tight one
after every clear mesh, so after the table where it shows only clear rows. Within its tier it goes
after every row with a step no longer than its own; the tie rule's 1% window (:mod:`meshplan.search.rank`)
is not applied, the plan being no candidate of the search (its settings may lie outside the tie key's
terms, e.g. an uneven split other than the short end stages). The row is a position only within the
rows of a proven top (every candidate that could enter them planned); past the last row shown the
line keeps the rank by step time.

>>> from types import SimpleNamespace as Row
>>> top = [Row(step_s=2.195, peak_bytes=28.3 * 2**30), Row(step_s=1.852, peak_bytes=62.8 * 2**30)]  # clear, tight
>>> table_row(2.0, 20e9, top, 72e9, 0.0, True), table_row(1.8, 65e9, top, 72e9, 0.0, True)  # clear; tight
(1, 2)
>>> table_row(3.0, 20e9, top, 72e9, 0.0, True), table_row(3.0, 20e9, top, 72e9, 0.0, False)  # tiers on; off
(2, None)
"""

from __future__ import annotations

from typing import Optional, Sequence

from meshplan.memory.headroom import tight


def table_row(step_s: float, peak_bytes: float, top: Sequence, usable_bytes: float, fragmentation_fraction: float,
              tiers: bool) -> Optional[int]:
    """The row (1 = the top) a plan of ``step_s`` (seconds) and peak ``peak_bytes`` would take in the
    table ``top`` (rows in the table's order, each with ``step_s`` and ``peak_bytes``): 1 + the rows
    ahead of it, a row being ahead where (under ``tiers``) it is clear and the plan tight, or it is in
    the plan's tier (without tiers: any row) with a step no longer than ``step_s``. None where every
    row shown is ahead. ``usable_bytes`` and ``fragmentation_fraction`` decide the tiers
    (:func:`~meshplan.memory.headroom.tight`)."""
    mine = tight(peak_bytes, usable_bytes, fragmentation_fraction)
    ahead = 0
    for e in top:
        theirs = tight(e.peak_bytes, usable_bytes, fragmentation_fraction)
        ahead += (not theirs) if tiers and theirs != mine else e.step_s <= step_s
    return ahead + 1 if ahead < len(top) else None
