"""The order of warm-up forwards, then forward/backward pairs, then the remaining backwards, on
arrays (:func:`pairs`): the stage orders of GPipe (warm-up = all micro-batches), 1F1B and
interleaved 1F1B. Its own module, importing no schedule, so that the schedules' classes
(:mod:`~meshplan.pipeline.gpipe`, :mod:`~meshplan.pipeline.one_f_one_b`) read their orders as
arrays without importing :mod:`~meshplan.pipeline.orders` (which imports the registry, which
imports them).
"""

from __future__ import annotations

import numpy as np

KINDS = ("F", "B", "W")


def pairs(w: np.ndarray, total: int) -> tuple[np.ndarray, np.ndarray]:
    """(kind, unit index) of ``w`` warm-up forwards, then forward/backward pairs, then the
    remaining backwards over ``total`` forward and ``total`` backward units, one row per entry
    of ``w`` (shape (rows, 1)): position c holds forward c while c < w, backward
    ``c - total`` from ``2 total - w`` on, and between them, from ``j = c - w``, forward
    ``w + j / 2`` (j even) or backward ``(j - 1) / 2`` (j odd): the list of
    :func:`~meshplan.pipeline.one_f_one_b.warmup_pairs_drain`, closed form on a (rows, 2 total) grid.

    >>> k, i = pairs(np.array([[2]]), 4)
    >>> " ".join(f"{KINDS[a]}{b}" for a, b in zip(k[0], i[0]))
    'F0 F1 F2 B0 F3 B1 B2 B3'
    """
    c = np.arange(2 * total, dtype=np.int64)[None, :]
    warm, drain = c < w, c >= 2 * total - w
    # two (rows, 2 total) arrays written in place: at 10^6 units each fresh array costs ms of page
    # faults in the command's one cold run (GPT-1T 1F1B at pp 128 x 4,096 micro-batches, cold
    # stage_orders 0.053-0.071 -> 0.017-0.026 CPU s; nested np.where made some twelve)
    idx = c - w  # j
    kind = idx & 1  # between warm-up and drain: j odd is a backward
    np.right_shift(idx, 1, out=idx)  # backward (j - 1) / 2
    np.add(idx, w, out=idx, where=kind == 0)  # forward w + j / 2
    np.copyto(kind, 1, where=drain)
    np.copyto(kind, 0, where=warm)
    np.copyto(idx, c - total, where=drain)
    np.copyto(idx, c, where=warm)
    return kind, idx
