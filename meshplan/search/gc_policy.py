"""The garbage collector's policy while ``meshplan search`` runs (issue 11 item 7: the 405B
search within 10 s on 2 cores).

A search allocates millions of short-lived objects (the rank timeline's tasks and events,
:mod:`meshplan.schedule.unit_events`) and keeps a large heap that never becomes garbage (the
candidate columns, the catalog, the estimate's tables). With CPython's default thresholds
(700, 10, 10) the cyclic collector spent 1.95 of the 18.87 CPU seconds of one 405B search with one
worker (``examples/llama3-405b_16384xh100_tp8-pp16-dp128.toml``; 11 full collections; timed with
``gc.callbacks``); under this policy 0.27 of 17.14 s, no full collection, the same result. :func:`search_gc` moves the heap present when the
search starts into the permanent generation (:func:`gc.freeze`: the forked workers inherit it,
and the collector no longer scans it, nor touches its pages, so they stay shared after the fork)
and raises the first generation's threshold so that young objects are collected less often.
Nothing is disabled: reference counting frees the acyclic garbage at once, and cycles are still
collected. No value the search computes depends on when the collector runs.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager

#: First-generation threshold while a search runs (CPython's default: 700 allocations). 50,000
#: objects of ~100 B is ~5 MB of young objects between collections.
YOUNG_THRESHOLD = 50_000


@contextmanager
def search_gc():
    """Within the block: the heap present on entry frozen (:func:`gc.freeze`) and the first
    generation collected every :data:`YOUNG_THRESHOLD` allocations; on exit the previous
    thresholds back and the frozen objects unfrozen (the next full collection sees them again).

    >>> before = gc.get_threshold()
    >>> with search_gc():
    ...     gc.get_threshold()[0] == YOUNG_THRESHOLD and gc.get_freeze_count() > 0
    True
    >>> gc.get_threshold() == before
    True
    """
    old = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, old[1], old[2])
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()
